"""The parent side of the fuzz suite: run a plan of case ranges in child processes, read
their protocol (see runner.py), and turn crashes, hangs and failed cases into reports.

A child that crashes or hangs is reported with the case it was running, and a fresh
child carries on with the next case, so one crash hides nothing after it. Children
inherit this process's environment unchanged: an LD_PRELOAD of a sanitizer runtime (and
its *SAN_OPTIONS) set by the caller applies to them too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# A child imports torch and the package (several seconds on a small CPU) before its first case.
STARTUP_S = 120.0


@dataclass
class TargetResult:
    """Everything the children reported about one target's cases."""

    target: str
    seed: int
    count: int
    failures: list[dict] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)  # one report per crashed or hung child


def reproducer(target: str, seed: int, index: int) -> str:
    return f"python -m tests.fuzz.runner {target} {seed} {index} 1 --traceback"


def run_plan(seed: int, ranges: list[tuple[str, int, int]], *, env: dict | None = None, per_case_s: float = 2.0,
             case_timeout_s: float | None = None) -> dict[str, TargetResult]:
    """Run every (target, start, count) range, in order, in as few children as crashes allow.

    env: the children's environment (default: this process's, LD_PRELOAD and all);
    per_case_s: the time each case adds to a child's timeout (beyond STARTUP_S);
    case_timeout_s: the children's per-case watchdog (else DFLASH2_FUZZ_CASE_TIMEOUT or 120 s).
    """
    env = dict(os.environ if env is None else env)
    if case_timeout_s is not None:
        env["DFLASH2_FUZZ_CASE_TIMEOUT"] = str(case_timeout_s)
    results = {target: TargetResult(target, seed, 0) for target, _, _ in ranges}
    for target, _, count in ranges:
        results[target].count += count
    pending = list(ranges)
    while pending:
        timeout = STARTUP_S + per_case_s * sum(count for _, _, count in pending)
        returncode, stdout, stderr = _run_child(seed, pending, timeout, env)
        last_case = None
        for line in stdout.splitlines():
            if line.startswith("CASE "):
                last_case = line[5:]
            elif line.startswith("FAIL "):
                failure = json.loads(line[5:])
                results[failure["target"]].failures.append(failure)
            elif line.startswith("DONE "):
                target, start, count = line.split()[1:4]
                pending.remove((target, int(start), int(count)))
        if "END" in stdout.splitlines() and returncode in (0, 1):
            break
        if last_case is None:  # it never reached a case (an import error): a new child would not either
            for target, start, _ in pending:
                results[target].crashes.append(
                    _crash_report(seed, returncode, f"{target} {start} (startup, before any case)", stderr))
            break
        # Crashed or hung in last_case: report it, skip it, carry on in a fresh child.
        crashed_target, index = last_case.split(" ", 2)[:2]
        results[crashed_target].crashes.append(_crash_report(seed, returncode, last_case, stderr))
        pending = _after(pending, crashed_target, int(index))
    return results


def _run_child(seed: int, ranges, timeout_s: float, env: dict) -> tuple[int | None, str, str]:
    """(exit status or None if killed at the timeout, stdout, stderr) of one child."""
    plan = [f"{target}:{start}:{count}" for target, start, count in ranges]
    command = [sys.executable, "-m", "tests.fuzz.runner", "--plan", str(seed), *plan]
    # Files, not pipes: whatever a killed child flushed is still there to read.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=err)
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            returncode = None
        out.seek(0)
        err.seek(0)
        return returncode, out.read(), err.read()


def _after(pending, target: str, index: int):
    """The pending ranges with target's range resumed after index."""
    resumed = []
    for name, start, count in pending:
        if name == target and start <= index < start + count:
            rest = start + count - index - 1
            if rest:
                resumed.append((name, index + 1, rest))
        else:
            resumed.append((name, start, count))
    return resumed


def _crash_report(seed: int, returncode: int | None, last_case: str, stderr: str) -> str:
    if returncode is None:
        how = "hung: killed at the batch timeout"
    elif returncode < 0:
        how = f"crashed: killed by signal {signal.Signals(-returncode).name}"
    elif "Timeout (" in stderr:
        how = "hung: the per-case watchdog (DFLASH2_FUZZ_CASE_TIMEOUT) fired"
    else:
        how = f"exited with status {returncode} before finishing"
    target, index = last_case.split(" ", 2)[:2]
    lines = [f"the child {how}", f"  while running case {last_case}"]
    if index.isdigit():
        lines.append(f"  reproduce: {reproducer(target, seed, int(index))}")
    tail = "\n".join(stderr.strip().splitlines()[-25:])
    if tail:
        lines.append("  stderr (tail):\n    " + tail.replace("\n", "\n    "))
    return "\n".join(lines)


def _failure_class(failure: dict) -> tuple[str, str]:
    """Group failures by what was drawn and what went wrong, not by the exact numbers."""
    verdict = failure["verdict"]
    head = verdict.split(":", 1)[0]
    if verdict.startswith("wrong result"):
        head = ": ".join(verdict.split(": ")[:2])
    return failure["kind"], head


def format_report(result: TargetResult, *, examples_per_class: int = 1) -> str:
    """Empty when every case behaved; else crashes first, then failures grouped by class,
    each with its count, one verdict, the case and the command that replays it."""
    sections = list(result.crashes)
    classes: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for failure in result.failures:
        classes[_failure_class(failure)].append(failure)
    if result.failures:
        sections.append(f"{len(result.failures)} of {result.count} cases failed, in {len(classes)} classes:")
    for (kind, _), members in sorted(classes.items(), key=lambda item: -len(item[1])):
        for failure in members[:examples_per_class]:
            sections.append(
                f"- [{len(members)}x] {kind}\n"
                f"    {failure['verdict']}\n"
                f"    case {failure['index']}: {failure['description']}\n"
                f"    reproduce: {reproducer(result.target, result.seed, failure['index'])}"
            )
    return "\n".join(sections)
