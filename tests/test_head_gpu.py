"""dk.draft_head on CUDA (cuBLAS GEMMs, the Triton row kernel, torch.topk over unique
keys) against float64, with the CPU tests' cases and judge (tests/test_head.py)."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk

from .head_cases import make_inputs
from .test_head import CASES, _case_id, _check_case, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_draft_head_cuda_matches_float64(case):
    hidden, weight, kwargs, ours, ref, grads = _run(case, device="cuda")
    _check_case(case, hidden, weight, kwargs, ours, ref, grads)


@pytest.mark.parametrize("case", [CASES[4], CASES[9]], ids=_case_id)
def test_draft_head_cuda_weight_grad(case):
    hidden, weight, kwargs, ours, ref, grads = _run(case, weight_grad=True, device="cuda")
    _check_case(case, hidden, weight, kwargs, ours, ref, grads)


def test_draft_head_cuda_training_vocab():
    case = (64, 248_320, 64, torch.bfloat16, torch.bfloat16, ("kl_div", "tv", "ce"), 16, 1.0, None, "given", None)
    hidden, weight, kwargs, ours, ref, grads = _run(case, device="cuda")
    _check_case(case, hidden, weight, kwargs, ours, ref, grads)


def test_draft_head_cuda_memory_is_not_n_by_v():
    """Peak allocation of a forward+backward stays far below one [N, V] float32 tensor."""
    rows, vocab = 4096, 65536
    hidden, weight, target, labels = (t.cuda() if t is not None else None for t in make_inputs(
        rows, vocab, 64, hidden_dtype=torch.bfloat16, labels="given"))
    hidden.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = dk.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=("kl_div", "tv"), top_k=16,
                        tile_mb=64)
    (out.losses["kl_div"].sum() + out.losses["tv"].sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < rows * vocab * 4 // 4, peak
