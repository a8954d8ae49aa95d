"""Every member of every configuration space (dflash2_kernels/tuning/spaces.py) launched and
judged, as the tuner may pick it on a user's GPU: the conv at the contract against float64
(tile members change the rows, groups and chunks a program owns), the draft head's single
process and vocab-parallel drivers against their float64 judges, each with its member
forced. Without a GPU the kernels run under Triton's interpreter (which ignores warps and
stages: tests/test_triton_aot.py compiles every member for every architecture); with one,
compiled. Each test also checks that the forced member is what was launched.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels.conv import launch as conv_launch
from dflash2_kernels.tuning import SPACES, TUNER

from .contract import assert_within_contract
from .conv_cases import BF16, CASES, ConvCase, conv_with_grads, exact_conv_with_grads, make_inputs
from .distributed_support import load_rank_results, run_ranks, save_rank_result
from .head_cases import gpu_driver_runs
from .test_head import _check_case, _run
from .test_head_triton import CASES as HEAD_CASES
from .triton_interpreter import SKIP_REASON as INTERPRETER_SKIP_REASON

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
CONV_SPACES = ("conv_forward", "conv_backward", "conv_dbase")
HEAD_SPACES = [name for name in SPACES if name.startswith("head_") and not name.startswith("head_shard_")]
SHARD_SPACES = [name for name in SPACES if name.startswith("head_shard_")]
HEAD_DEPTH = max(len(SPACES[name].configs) for name in HEAD_SPACES)

# Chunks of several row steps (150 rows), a group split over channel tiles (300 wide),
# bf16 with a strided delta over two group tiles and three taps. The defaults run the
# whole table in tests/test_conv_numerics.py.
CONV_CASES = [CASES[8], CASES[10], ConvCase((2, 13), 320, 16, 3, 8, BF16, strided_delta=True)]
_KERNEL_SPACES = {
    "grouped_dynamic_conv_fwd_kernel": "conv_forward", "grouped_dynamic_conv_bwd_kernel": "conv_backward",
    "grouped_dynamic_conv_dbase_kernel": "conv_dbase", "draft_head_scan_kernel": "head_scan",
    "draft_head_sweep_kernel": "head_sweep", "draft_head_sparse_add_kernel": "head_sparse_add",
    "draft_head_finish_kernel": "head_finish", "draft_head_hidden_grad_kernel": "head_hidden_grad",
    "draft_head_topk_kernel": "head_radix_topk", "draft_head_shard_pack_kernel": "head_shard_pack",
    "draft_head_shard_merge_kernel": "head_shard_merge", "draft_head_shard_shares_kernel": "head_shard_shares",
    "draft_head_shard_final_kernel": "head_shard_final",
}


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    if not HAS_CUDA and not conv_launch.KERNELS_INTERPRETED:
        pytest.skip(INTERPRETER_SKIP_REASON)
    monkeypatch.setenv("DFLASH2_BACKEND", "triton")


def _kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(fn).__name__)


@contextlib.contextmanager
def _launches(record: list):
    """Records (kernel name, num_warps, num_stages, constexprs) of each launch."""
    run = conv_launch.KernelLaunch.run

    def recording(self, device_of):
        record.append((_kernel_name(self.kernel), self.num_warps, self.num_stages, self.constexprs))
        return run(self, device_of)

    conv_launch.KernelLaunch.run = recording
    try:
        yield record
    finally:
        conv_launch.KernelLaunch.run = run


def _members(index: int) -> dict:
    """Every space's member ``index``, where it has one."""
    return {name: space.configs[index] for name, space in SPACES.items() if len(space.configs) > index}


def _assert_launched(record, forced: dict, spaces) -> None:
    seen = set()
    for kernel, warps, stages, constexprs in record:
        space = _KERNEL_SPACES.get(kernel)
        if kernel == "draft_head_merge_kernel":
            space = "head_merge_candidates" if constexprs["TOPK"] == 1 else "head_merge"
        if space in forced:
            config = forced[space]
            assert (warps, stages) == (config.num_warps, config.num_stages), (kernel, config)
            seen.add(space)
    assert set(spaces) <= seen, f"not launched: {set(spaces) - seen}"


@pytest.mark.parametrize("space,member", [(s, c.name) for s in CONV_SPACES for c in SPACES[s].configs[1:]])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c.id)
def test_conv_member_within_contract(case, space, member, poison_empty):
    config = SPACES[space].named(member)
    x, delta, base, dy = make_inputs(case, DEVICE)
    exact = exact_conv_with_grads(x, delta, base, dy, case)
    expected = conv_with_grads(reference.grouped_dynamic_conv, x, delta, base, dy, case)
    with TUNER.forced({space: config}), _launches([]) as record:
        got = conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, case)
    _assert_launched(record, {space: config}, [space])
    for name, kernel, ref, ex in zip(("out", "dx", "ddelta", "dbase"), got, expected, exact):
        assert_within_contract(f"{case.id} {space}:{member} {name}", kernel, ref, ex, truncating_stores=not HAS_CUDA)


# The head's single-process driver: the recompute of a trainable lm_head with candidates
# (kl_div, tv: the sparse add, the accumulating hidden grad); the radix select with the
# kept planes (ce: the planes' hidden grad).
HEAD_RUNS = [(HEAD_CASES[0], True), (HEAD_CASES[4], False)]


@pytest.mark.parametrize("index", range(1, HEAD_DEPTH))
def test_head_members_match_float64(index, poison_empty):
    if not gpu_driver_runs():
        pytest.skip(INTERPRETER_SKIP_REASON)
    forced = {name: config for name, config in _members(index).items() if name in HEAD_SPACES}
    record = []
    for case, weight_grad in HEAD_RUNS:
        with TUNER.forced(forced), _launches(record):  # the judge takes the gradients on the CPU
            hidden, weight, kwargs, ours, ref, grads = _run(case, weight_grad=weight_grad, device=DEVICE)
            _check_case(case, hidden, weight, kwargs, ours, ref, grads)
    _assert_launched(record, forced, forced)


def _shard_worker(rank: int, out_dir: str, world: int, names: list) -> None:
    from .test_head_vocab_parallel import _run_case

    with TUNER.forced(_members(1)), _launches([]) as record:
        results = {name: _run_case(rank, world, name) for name in names}
    results["launched"] = [(kernel, warps, stages, {"TOPK": c.get("TOPK", 0)}) for kernel, warps, stages, c in record]
    save_rank_result(out_dir, rank, results)


def test_shard_members_match_one_process(tmp_path):
    """The vocab-parallel Triton path on two gloo ranks with each shard kernel's second
    member (every shard space has two; the first runs in tests/test_head_vocab_parallel.py)."""
    from .test_head_vocab_parallel import TIMEOUT_S, _judge

    if not gpu_driver_runs():
        pytest.skip(INTERPRETER_SKIP_REASON)
    assert all(len(SPACES[name].configs) == 2 for name in SHARD_SPACES)
    names = ["w2-triton-planes"]
    run_ranks(_shard_worker, tmp_path, 2, names, world=2, timeout_s=TIMEOUT_S)
    results = load_rank_results(tmp_path, 2)
    for name in names:
        _judge(name, results)
    forced = {name: SPACES[name].configs[1] for name in SHARD_SPACES}
    for per_rank in results:
        _assert_launched(per_rank["launched"], forced, SHARD_SPACES)
