"""Every conv, draft head row and top-k kernel configuration the launchers pick, compiled with no
GPU for every architecture of the default list (dflash2_kernels/_cuda_archs.py: sm_80,
sm_86, sm_89, sm_90, sm_100, sm_120), each checked against that architecture's limits:
the default members at every configuration below, every other member of each kernel's
tuning space (dflash2_kernels/tuning/spaces.py) at the published shapes.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import triton

from dflash2_kernels import _cuda_archs
from dflash2_kernels.tuning import SPACES

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
# The draft head's GPU drivers (dflash2_kernels/head/gpu_launch.py) on a chunk of 512 rows of
# V = 248,320: every plane dtype (fp32, fp64) and gradient-plane dtype (bf16, fp16, fp32,
# fp64), with and without a softcap, the losses each trainer asks for (speculators: kl_div
# against a target, logits ranked in bf16; NeMo: ce with labels, no target), every loss at
# once, the serving form (no losses, K 16), the candidates' limit K = 64, the radix select
# (K = 65), K = 0, 64-bit keys (fp64 logits), and an unaligned vocabulary.
HEAD_CONFIGS = [
    {"head": dict(weight=weight, logits=logits, loss_mask=mask, target=target, labels=labels, softcap=softcap,
                  top_k=top_k, **extra)}
    for weight, logits, mask, target, labels, softcap, top_k, extra in [
        ("bfloat16", "bfloat16", 0b00001, True, False, False, 16, {}),
        ("bfloat16", "bfloat16", 0b10000, False, True, False, 16, {}),
        ("bfloat16", "bfloat16", 0b11111, True, True, False, 16, {}),
        ("bfloat16", "bfloat16", 0b11111, True, True, True, 16, {}),
        ("bfloat16", "bfloat16", 0b00000, False, False, False, 16, {}),
        ("float16", "float16", 0b01001, True, True, True, 64, {}),
        ("float32", "float32", 0b11111, True, True, False, 65, {}),
        ("float32", "bfloat16", 0b00011, True, False, True, 0, {}),
        ("float64", "float64", 0b11111, True, True, False, 16, {}),
        ("float64", "float32", 0b11111, True, True, True, 65, {}),
        ("bfloat16", "bfloat16", 0b10001, True, True, False, 16, {"vocab": 248_321}),
    ]
]
HEAD_KERNELS = ["scan", "merge", "sweep", "sweep_row_sums", "sweep_backward", "sweep_backward_sparse", "sparse_add",
                "sparse_hidden_grad", "finish", "hidden_grad", "radix_topk",
                "shard_pack", "shard_merge", "shard_shares", "shard_final", "shard_hidden_grad"]
# Every member of every configuration space (dflash2_kernels/tuning/spaces.py) beyond the
# defaults above, at the published conv shape and two head configurations that launch
# every head kernel between them (speculators' kl_div with candidates; every loss with
# the radix select: its merge and the select alone): no member a GPU's timing may pick
# goes uncompiled.
TUNING_DEPTH = max(len(space.configs) for space in SPACES.values())
TUNING_CONFIGS = [[5120, 16, 2, BF16, index] for index in range(1, TUNING_DEPTH)] + [
    {**HEAD_CONFIGS[0], "tuning": index} for index in range(1, TUNING_DEPTH)] + [
    {**HEAD_CONFIGS[6], "tuning": index, "kernels": ["merge", "radix_topk"]} for index in range(1, TUNING_DEPTH)]
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
    # One thread a child: communicate() on one child at a time would leave the next blocked
    # on its stdin, compiling one child after another.
    payload = json.dumps(CONFIGS + HEAD_CONFIGS + TUNING_CONFIGS)
    with ThreadPoolExecutor(len(children)) as pool:
        outputs = list(pool.map(lambda child: child.communicate(payload, timeout=900), children))
    found = {}
    for child, (out, err) in zip(children, outputs):
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
def _head(weight, logits, mask, softcap, top_k, *, target=True, labels=True, **extra):
    """A HEAD_CONFIGS entry's key."""
    return json.dumps({"head": dict(weight=weight, logits=logits, loss_mask=mask, target=target, labels=labels,
                                    softcap=softcap, top_k=top_k, **extra)})


_TANH = "a softcap's fp64 tanh: the fp64 division's slow path keeps an 8-byte stack frame"
_FP64 = "fp64 planes: the fp64 division's slow path keeps an 8-byte stack frame"
_COLUMN_PREDICATES = ("the column masks' predicates saved to the stack around the K_BLOCK loop of W rows "
                      "(P2R + STL before, LDL after: 8-16 bytes, once or twice a program)")
KNOWN_SPILLS = {
    **{(json.dumps([4096, 8, 3, BF16]), "backward", arch): "three taps: 128 registers to fit two blocks, 4 bytes"
       for arch in (86, 89)},
    **{(_head("bfloat16", "bfloat16", 0b11111, True, 16), "scan", arch): _TANH for arch in (86, 89, 90, 100, 120)},
    **{(_head("float16", "float16", 0b01001, True, 64), "scan", arch): _TANH for arch in (86, 89, 90, 100, 120)},
    **{(_head("bfloat16", "bfloat16", 0b11111, True, 16), kernel, arch): _TANH
       for kernel in ("merge",) for arch in (80, 86, 89)},
    (_head("bfloat16", "bfloat16", 0b11111, True, 16), "shard_pack", 80): _TANH,
    (_head("float64", "float32", 0b11111, True, 65), "shard_pack", 100): _TANH,
    **{(key, "hidden_grad", arch): _COLUMN_PREDICATES
       for key, arch in [(_head("bfloat16", "bfloat16", 0b00001, False, 16, labels=False), 90),
                         (_head("bfloat16", "bfloat16", 0b10000, False, 16, target=False), 90),
                         (_head("float64", "float64", 0b11111, False, 16), 86),
                         (_head("float64", "float64", 0b11111, False, 16), 89),
                         (_head("float64", "float32", 0b11111, True, 65), 120)]},
    (_head("float64", "float64", 0b11111, False, 16), "scan", 100): _FP64,
    (_head("float64", "float64", 0b11111, False, 16), "shard_pack", 120): _FP64,
    (_head("bfloat16", "bfloat16", 0b11111, False, 16), "sweep_backward", 90):
        "every loss's gradient at once: 80 registers, 8 bytes",
    **{(_head("bfloat16", "bfloat16", 0b10001, False, 16, vocab=248_321), "scan", arch):
       "an unaligned vocabulary: no vector loads, 128 registers and 24 bytes" for arch in (80, 86, 89)},
}
MEASURED_TRITON = triton.__version__.startswith("3.8.")


def _member_index(config) -> int:
    return config.get("tuning", 0) if isinstance(config, dict) else (config[4] if len(config) > 4 else 0)


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
    if _member_index(config):
        # A tuning member may spill where the default does not (four warps holding twice the
        # registers' worth of a segment, sixteen capped at 128 registers a thread): spills
        # cost time, not results, and the GPU's timing is what picks a member.
        return
    known = KNOWN_SPILLS.get((json.dumps(config), kernel, arch))
    if known is None:
        assert not spilled, f"sm_{arch}: register spills: {usage}"
    elif MEASURED_TRITON:
        assert spilled, f"sm_{arch}: the known spill ({known}) is gone: drop it from KNOWN_SPILLS ({usage})"


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("kernel", ["forward", "backward", "dbase"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"H{c[0]}-gs{c[1]}-K{c[2]}-{'-'.join(c[3])}")
def test_conv_compiles_within_each_architectures_limits(usage, config, kernel, arch):
    _assert_fits(arch, config, kernel, usage)


def _head_id(config) -> str:
    c = config["head"]
    parts = [f"W{c['weight']}", f"as{c['logits']}", f"mask{c['loss_mask']:05b}",
             "target" if c["target"] else "notarget", "labels" if c["labels"] else "nolabels",
             "softcap" if c["softcap"] else "nocap", f"K{c['top_k']}"] + ([f"V{c['vocab']}"] if "vocab" in c else [])
    return "head-" + "-".join(parts)


def _launched(config, kernel: str) -> bool:
    """Whether head_plans makes ``kernel`` for ``config`` (the radix select above K = 64, the
    row-sum planes' sweep for rkl, jsd, tv)."""
    c = config["head"]
    if kernel == "radix_topk":
        return c["top_k"] > 64
    if kernel == "sweep_row_sums":
        return bool(c["loss_mask"] & 0b01110)
    return True


HEAD_PAIRS = [(config, kernel) for config in HEAD_CONFIGS for kernel in HEAD_KERNELS if _launched(config, kernel)]


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("config,kernel", HEAD_PAIRS, ids=[f"{_head_id(c)}-{k}" for c, k in HEAD_PAIRS])
def test_head_compiles_within_each_architectures_limits(usage, config, kernel, arch):
    _assert_fits(arch, config, kernel, usage)


_CONV_SPACES = {"forward": "conv_forward", "backward": "conv_backward", "dbase": "conv_dbase"}
_HEAD_SPACES = {"scan": "head_scan", "sweep": "head_sweep", "sweep_row_sums": "head_sweep",
                "sweep_backward": "head_sweep", "sweep_backward_sparse": "head_sweep", "sparse_add": "head_sparse_add",
                "sparse_hidden_grad": "head_hidden_grad", "finish": "head_finish", "hidden_grad": "head_hidden_grad",
                "radix_topk": "head_radix_topk", "shard_pack": "head_shard_pack", "shard_merge": "head_shard_merge",
                "shard_shares": "head_shard_shares", "shard_final": "head_shard_final",
                "shard_hidden_grad": "head_hidden_grad"}


def _space_of(config, kernel: str) -> str:
    if isinstance(config, list):
        return _CONV_SPACES[kernel]
    if kernel == "merge":
        return "head_merge_candidates" if 0 < config["head"]["top_k"] <= 64 else "head_merge"
    return _HEAD_SPACES[kernel]


def _tuning_pairs() -> list:
    pairs = []
    for config in TUNING_CONFIGS:
        index = _member_index(config)
        kernels = _CONV_SPACES if isinstance(config, list) else [
            k for k in config.get("kernels", HEAD_KERNELS) if _launched(config, k)]
        pairs += [(config, kernel) for kernel in kernels if len(SPACES[_space_of(config, kernel)].configs) > index]
    return pairs


TUNING_PAIRS = _tuning_pairs()


def _tuning_id(config, kernel: str) -> str:
    index = _member_index(config)
    space = SPACES[_space_of(config, kernel)]
    shape = "conv-H5120" if isinstance(config, list) else _head_id(config)
    return f"{shape}-{kernel}-{space.name}:{space.configs[index].name}"


def test_every_space_member_is_compiled():
    """TUNING_CONFIGS reach every member of every space (with the defaults above)."""
    reached = {(_space_of(c, k), _member_index(c)) for c, k in TUNING_PAIRS}
    missing = [(name, i) for name, space in SPACES.items() for i in range(1, len(space.configs))
               if (name, i) not in reached]
    assert not missing, missing


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("config,kernel", TUNING_PAIRS, ids=[_tuning_id(c, k) for c, k in TUNING_PAIRS])
def test_every_tuning_member_compiles_within_each_architectures_limits(usage, config, kernel, arch):
    _assert_fits(arch, config, kernel, usage)
