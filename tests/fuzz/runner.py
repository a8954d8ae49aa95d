"""The child process of the fuzz suite: runs ranges of cases of one or more targets.

    python -m tests.fuzz.runner TARGET SEED START COUNT [--traceback]
    python -m tests.fuzz.runner --plan SEED TARGET:START:COUNT [TARGET:START:COUNT ...]

(from the repository root). The first form replays cases of one target:
``python -m tests.fuzz.runner TARGET SEED INDEX 1 --traceback`` reruns exactly one and
prints its traceback. The second is what the test harness runs: several targets in one
process, so that importing torch (seconds) is paid once per child, not per target.

Protocol on stdout, one flushed line each, so the parent can name the case that a crash
or hang happened in and carry on after it in a fresh child:

    CASE <target> <index> <description>   before the case runs
    FAIL <json>                           after a case that misbehaved
    DONE <target> <start> <count>         after the last case of a range
    END                                   after the last range

Exit status 0 when every case passed, 1 when some failed; anything else, or no END, is a
crash. A case running longer than DFLASH2_FUZZ_CASE_TIMEOUT seconds (default 120) gets
every thread's stack dumped on stderr and the process exits: a hang names its case too.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

# Set up like tests/conftest.py, before anything imports dflash2_kernels: poisoned C++
# allocations, and the Triton interpreter when there is no GPU. setdefault: a caller's
# explicit choice (and its LD_PRELOAD, ASAN_OPTIONS, ...) stands.
os.environ.setdefault("DFLASH2_POISON_OUTPUTS", "1")

import torch  # noqa: E402

from ..triton_interpreter import FAULT as INTERPRETER_FAULT  # noqa: E402

if not torch.cuda.is_available():
    if INTERPRETER_FAULT:  # tests/triton_interpreter.py: the conv's Triton cases run the default backend
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")

from .. import host_blas  # noqa: E402
from .case import judge_outcome  # noqa: E402
from .targets import TARGETS, draw_case, known  # noqa: E402

CASE_TIMEOUT_ENV = "DFLASH2_FUZZ_CASE_TIMEOUT"


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_range(target: str, seed: int, start: int, count: int, *, show_traceback: bool = False) -> int:
    """Run cases start .. start+count-1 of target, printing the protocol; returns failures."""
    case_timeout = float(os.environ.get(CASE_TIMEOUT_ENV, "120"))
    failed = 0
    for index in range(start, start + count):
        _emit(f"CASE {target} {index} (drawing the case)")
        faulthandler.dump_traceback_later(case_timeout, exit=True)
        try:
            case = draw_case(target, seed, index)
        except Exception as error:  # noqa: BLE001 - a generator bug is reported like any failure
            if show_traceback:
                traceback.print_exc()
            kind, description = "?", "?"
            verdict = f"the case generator raised {type(error).__name__}: {error}"
        else:
            kind, description = case.kind, case.describe()
            _emit(f"CASE {target} {index} {description}")
            with host_blas.emulated():  # DFLASH2_TEST_BLAS: a stand-in BLAS, alternation per case
                verdict = judge_outcome(case, show_traceback=show_traceback)
        faulthandler.cancel_dump_traceback_later()
        if verdict is not None:
            failed += 1
            _emit("FAIL " + json.dumps({"target": target, "index": index, "kind": kind,
                                        "description": description, "verdict": verdict}))
    _emit(f"DONE {target} {start} {count}")
    return failed


def parse_range(text: str) -> tuple[str, int, int]:
    """'TARGET:START:COUNT' -> (target, start, count)."""
    target, start, count = text.rsplit(":", 2)
    return target, int(start), int(count)


def main(argv: list[str]) -> int:
    show_traceback = "--traceback" in argv
    args = [a for a in argv if a != "--traceback"]
    try:
        if args and args[0] == "--plan":
            seed, ranges = int(args[1]), [parse_range(text) for text in args[2:]]
        else:
            (target, seed, start, count), ranges = args, None
            seed, ranges = int(seed), [(target, int(start), int(count))]
        unknown = [r[0] for r in ranges if not known(r[0])]
        if unknown or not ranges:
            raise ValueError(f"unknown targets {unknown}")
    except ValueError as error:
        sys.stderr.write(f"{error}\n{__doc__}\ntargets: {', '.join(TARGETS)}\n")
        return 2
    failed = sum(run_range(t, seed, s, c, show_traceback=show_traceback) for t, s, c in ranges)
    _emit("END")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
