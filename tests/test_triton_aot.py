"""Every conv, draft head row and top-k kernel configuration the launchers pick, compiled with no
GPU for every architecture of the default list (dflash2_kernels/_cuda_archs.py: sm_80,
sm_86, sm_89, sm_90, sm_100, sm_120), each checked against that architecture's limits.

This catches code-generation errors the interpreter cannot see, register spills, and
blocks that would not fit a multiprocessor (registers, shared memory) before a GPU ever
runs the kernel. The compiling happens in child processes without TRITON_INTERPRET (see
tests/triton_aot.py), one a core, the architectures dealt out among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from dflash2_kernels import _cuda_archs

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
ARCHS = [major * 10 + minor for major, minor in _cuda_archs.TARGETS]


@pytest.fixture(scope="module")
def usage():
    """{arch: {config: {kernel: resource usage}}}, from children compiling at once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    share = min(len(ARCHS), os.cpu_count() or 1)
    children = [subprocess.Popen([sys.executable, "-m", "tests.triton_aot", *map(str, ARCHS[i::share])],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=REPO, env=env)
                for i in range(share)]
    found = {}
    for child in children:
        out, err = child.communicate(json.dumps(CONFIGS + HEAD_ROW_CONFIGS + HEAD_TOPK_CONFIGS), timeout=900)
        assert child.returncode == 0, err[-4000:]
        found.update(json.loads(out))
    return found


# Spills ptxas chooses (Triton 3.8's, CUDA 13.0) to fit one more block on a
# multiprocessor, 4-16 bytes a thread: {(configuration, kernel, arch): why}. Tile changes
# move such spills to other configurations or architectures rather than remove them
# (measured: the conv backward at 1024 elements spills with four taps instead; the head's
# fp32 rows over 16 warps spill at V 248,321 instead), so the tiles wait for a GPU's
# measurement. With Triton 3.8 each must still be there (a ptxas that stops spilling
# fails the test, and the entry goes); every other limit holds for them too.
def _head(dtype, softcap):
    """The every-loss head row configuration of ``dtype`` (HEAD_ROW_CONFIGS), as its key."""
    return json.dumps({"head_rows": dict(dtype=dtype, loss_mask=0b11111, target=True, labels=True, softcap=softcap,
                                         grads=True)})


KNOWN_SPILLS = {
    **{(json.dumps([4096, 8, 3, BF16]), "backward", arch): "three taps: 128 registers to fit two blocks, 4 bytes"
       for arch in (86, 89)},
    (_head("float32", False), "forward", 80): "every loss: 64 registers, 16 bytes of stack",
    **{(_head("float32", True), "forward", arch): "every loss with a softcap, 16 warps: 64 registers, 8 bytes"
       for arch in (100, 120)},
    (_head("float64", True), "shard_stats", 120): "fp64 with a softcap, 16 warps: 40 registers, 8 bytes",
    **{(json.dumps({"head_topk": dict(dtype=dtype)}), "topk", 120): "16-bit values read as 32-bit keys: 128 registers, "
       "8 bytes" for dtype in ("bfloat16", "float16")},
}
MEASURED_TRITON = triton.__version__.startswith("3.8.")


def _assert_fits(arch: int, config, kernel: str, found: dict) -> None:
    """No compile error, a block that fits one of ``arch``'s multiprocessors (registers,
    shared memory), and no spill but a known one."""
    usage = found[str(arch)][json.dumps(config)][kernel]
    assert "error" not in usage, usage.get("error")
    assert usage["registers"] <= _cuda_archs.REGISTERS_PER_THREAD, usage
    assert usage["registers"] * usage["threads"] <= _cuda_archs.REGISTERS_PER_MULTIPROCESSOR, \
        f"sm_{arch}: a block needs more registers than a multiprocessor has: {usage}"
    limit = _cuda_archs.SHARED_MEMORY_KIB[divmod(arch, 10)] * 1024
    assert usage["shared"] + usage["dynamic_shared"] <= limit, f"sm_{arch}: over {limit} bytes of shared memory: {usage}"
    spilled = usage["local"] > 0 or usage["stack"] > 0
    known = KNOWN_SPILLS.get((json.dumps(config), kernel, arch))
    if known is None:
        assert not spilled, f"sm_{arch}: register spills: {usage}"
    elif MEASURED_TRITON:
        assert spilled, f"sm_{arch}: the known spill ({known}) is gone: drop it from KNOWN_SPILLS ({usage})"


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"H{c[0]}-gs{c[1]}-K{c[2]}-{'-'.join(c[3])}")
def test_conv_compiles_within_each_architectures_limits(usage, config, kernel, arch):
    _assert_fits(arch, config, kernel, usage)


def _head_row_id(config) -> str:
    c = config["head_rows"]
    parts = [c["dtype"], f"mask{c['loss_mask']:05b}", "target" if c["target"] else "notarget",
             "labels" if c["labels"] else "nolabels", "softcap" if c["softcap"] else "nocap",
             "grads" if c["grads"] else "nograds"] + ([f"V{c['vocab']}"] if "vocab" in c else [])
    return "head-" + "-".join(parts)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("kernel", HEAD_KERNELS)
@pytest.mark.parametrize("config", HEAD_ROW_CONFIGS, ids=_head_row_id)
def test_head_rows_compile_within_each_architectures_limits(usage, config, kernel, arch):
    _assert_fits(arch, config, kernel, usage)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("config", HEAD_TOPK_CONFIGS, ids=lambda c: "topk-" + c["head_topk"]["dtype"])
def test_head_topk_compiles_within_each_architectures_limits(usage, config, arch):
    _assert_fits(arch, config, "topk", usage)
