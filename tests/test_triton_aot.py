"""Every conv kernel configuration the launchers pick, compiled for sm_90 with no GPU.

This catches code-generation errors the interpreter cannot see, and register spills
before a GPU ever runs the kernel. The compiling happens in one child process
without TRITON_INTERPRET (see tests/triton_aot.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (hidden, group size, taps, x / delta / base dtypes): the published drafters' shapes
# and dtype mixes, plus the group sizes that change the tiling (not a power of two,
# wider than one channel tile) and fp64 (the fp64 accumulator).
BF16 = ["bfloat16"] * 3
CONFIGS = [
    [5120, 16, 2, BF16],
    [4096, 16, 2, BF16],
    [6656, 16, 2, BF16],
    [5120, 16, 2, ["float16"] * 3],
    [5120, 16, 2, ["float32"] * 3],
    [5120, 16, 2, ["float32", "bfloat16", "float32"]],  # autocast training
    [5120, 16, 2, ["bfloat16", "bfloat16", "float32"]],
    [4096, 8, 3, BF16],
    [4096, 16, 1, BF16],
    [4800, 24, 2, BF16],
    [4800, 300, 2, BF16],
    [1024, 16, 2, ["float64"] * 3],
]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sm90_usage():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.triton_aot"],
        input=json.dumps(CONFIGS), capture_output=True, text=True, cwd=REPO, env=env, timeout=900,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout)


@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"H{c[0]}-gs{c[1]}-K{c[2]}-{'-'.join(c[3])}")
def test_compiles_for_sm90_without_spills(sm90_usage, config, kernel):
    usage = sm90_usage[json.dumps(config)][kernel]
    assert "error" not in usage, usage.get("error")
    assert usage["local"] == 0 and usage["stack"] == 0, f"register spills: {usage}"
    assert usage["registers"] <= 255
