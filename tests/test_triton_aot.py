"""Every conv and draft head row kernel configuration the launchers pick, compiled for
sm_90 with no GPU.

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
# The draft head's row kernels (dflash2_kernels/head/row_launch.py) on a chunk of 512 rows
# of V = 248,320: every tile shape (fp32 / fp64, with and without a softcap) with the
# losses each trainer asks for (speculators: kl_div; NeMo: ce without a target), every
# loss at once, soft losses without labels or planes, the serving form (no losses), and
# an unaligned vocabulary.
HEAD_ROW_CONFIGS = [
    {"head_rows": dict(dtype=dtype, loss_mask=mask, target=target, labels=labels, softcap=softcap, grads=grads)}
    for dtype, mask, target, labels, softcap, grads in [
        ("float32", 0b00001, True, True, False, True),
        ("float32", 0b11111, True, True, False, True),
        ("float32", 0b10000, False, True, False, True),
        ("float32", 0b00000, False, False, False, False),
        ("float32", 0b01111, True, False, False, False),
        ("float32", 0b00001, True, True, True, True),
        ("float32", 0b11111, True, True, True, True),
        ("float32", 0b10000, False, True, True, True),
        ("float64", 0b00001, True, True, False, True),
        ("float64", 0b11111, True, True, False, True),
        ("float64", 0b11111, True, True, True, True),
    ]
] + [  # a vocabulary that is not a multiple of 16: no aligned vector loads, more registers
    {"head_rows": dict(dtype="float32", loss_mask=0b11111, target=True, labels=True, softcap=False, grads=True,
                       vocab=248_321)},
]
# The top-k kernel: 32-bit keys (fp16 / bf16 / fp32 values) and 64-bit ones (fp64).
HEAD_TOPK_CONFIGS = [{"head_topk": dict(dtype=dtype)} for dtype in ("bfloat16", "float16", "float32", "float64")]
HEAD_KERNELS = ["forward", "backward", "shard_stats", "shard_shares", "shard_planes", "shard_backward"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sm90_usage():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.triton_aot"],
        input=json.dumps(CONFIGS + HEAD_ROW_CONFIGS + HEAD_TOPK_CONFIGS), capture_output=True, text=True, cwd=REPO, env=env, timeout=900,
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


def _head_row_id(config) -> str:
    c = config["head_rows"]
    parts = [c["dtype"], f"mask{c['loss_mask']:05b}", "target" if c["target"] else "notarget",
             "labels" if c["labels"] else "nolabels", "softcap" if c["softcap"] else "nocap",
             "grads" if c["grads"] else "nograds"] + ([f"V{c['vocab']}"] if "vocab" in c else [])
    return "head-" + "-".join(parts)


@pytest.mark.parametrize("kernel", HEAD_KERNELS)
@pytest.mark.parametrize("config", HEAD_ROW_CONFIGS, ids=_head_row_id)
def test_head_rows_compile_for_sm90_without_spills(sm90_usage, config, kernel):
    usage = sm90_usage[json.dumps(config)][kernel]
    assert "error" not in usage, usage.get("error")
    assert usage["local"] == 0 and usage["stack"] == 0, f"register spills: {usage}"
    assert usage["registers"] <= 255


@pytest.mark.parametrize("config", HEAD_TOPK_CONFIGS, ids=lambda c: "topk-" + c["head_topk"]["dtype"])
def test_head_topk_compiles_for_sm90_without_spills(sm90_usage, config):
    usage = sm90_usage[json.dumps(config)]["topk"]
    assert "error" not in usage, usage.get("error")
    assert usage["local"] == 0 and usage["stack"] == 0, f"register spills: {usage}"
    assert usage["registers"] <= 255
