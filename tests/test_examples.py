"""Every script in examples/ runs as a user would run it (a fresh interpreter, from the
repository root) and prints what its docstring promises.

Each example imports speculators or NeMo Automodel (requirements/upstream.txt); without
them it is skipped. The subprocess inherits the environment, so under the sanitized
build (scripts/asan.py) the examples run on it too.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Seconds per example: each takes ~15-30 s on a busy 2-core machine (mostly imports);
# the sanitized build is slower. The bound only keeps a hung example from hanging CI.
# (Run one at a time: started together on 2 cores they took longer, not shorter.)
TIMEOUT_S = 600


def run_example(name: str) -> str:
    """Run examples/``name`` in a fresh interpreter; its stdout, or a failure with its output."""
    env = dict(os.environ)
    # A plain checkout works too, not only an installed package.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        result = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{name} ran past {TIMEOUT_S} s; its output so far:\n{error.stdout}\n{error.stderr}")
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def needs(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"needs {package}")


def finite(text: str) -> float:
    value = float(text)
    assert math.isfinite(value), text
    return value


def patch_replaced(out: str, count: int) -> None:
    """The printed PatchReport: ``count`` modules swapped for ours, none skipped."""
    summary = re.search(r"dflash2_kernels\.patch: (\d+) replaced.* (\d+) skipped", out)
    assert summary and summary.groups() == (str(count), "0"), out


@needs("speculators")
def test_speculators_train_step():
    out = run_example("speculators_train_step.py")
    patch_replaced(out, 5)  # two convs in each of the two layers, the selector
    assert "replaced candidate_selector" in out and "-> dflash2_kernels.modules.CandidateSelector" in out, out
    match = re.search(r"loss: (\S+) \(unary (\S+) \+ selector (\S+)\)", out)
    assert match, out
    loss, unary, selector = map(finite, match.groups())
    assert unary > 0 and selector > 0 and loss == pytest.approx(unary + selector, abs=2e-4)


@needs("speculators")
def test_speculators_serve_step():
    out = run_example("speculators_serve_step.py")
    patch_replaced(out, 5)
    for mode in ("greedy ", "sampled"):
        rows = re.findall(rf"{mode} request \d: path \[(\d+), (\d+), (\d+)\] accepted (\d) bonus (\d+)", out)
        assert len(rows) == 4, out
        for *path, accepted, bonus in rows:
            assert 0 <= int(accepted) <= 3 and 0 <= int(bonus) < 512 and all(0 <= int(t) < 512 for t in path)


@needs("nemo_automodel")
def test_nemo_train_step():
    out = run_example("nemo_train_step.py")
    patch_replaced(out, 5)
    assert "-> dflash2_kernels.compat.nemo.CandidateSelector" in out, out
    match = re.search(r"loss: (\S+) \(base (\S+) \+ selector (\S+)\), candidate recall (\S+)", out)
    assert match, out
    loss, base, selector, recall = map(finite, match.groups())
    # A selector loss of 0 would mean no position had its target among the candidates.
    assert base > 0 and selector > 0 and recall > 0 and loss == pytest.approx(base + selector, abs=2e-4)


@needs("nemo_automodel")
def test_nemo_serve_step():
    out = run_example("nemo_serve_step.py")
    assert re.search(r"dflash2_kernels\.patch_nemo: \d+ replaced", out), out
    assert "draft built from dflash2_kernels.compat.nemo.CandidateSelector" in out, out
    for mode in ("greedy ", "sampled"):
        tokens = re.search(rf"{mode}: \[([\d, ]+)\]", out)
        assert tokens and len(tokens.group(1).split(",")) == 12, out
    assert "greedy output equals the target's own greedy decoding: True" in out, out
