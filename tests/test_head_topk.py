"""The draft head's top-k on both devices' paths: the C++ row kernel's selection
(csrc/head_row_passes.h's RowTopK, through dflash2::draft_head_rows_cpu) and the GPU
driver's (the scan kernel's candidates and the merge, or the radix select of
dflash2_kernels/head/topk_kernels.py; under the interpreter without a GPU),
against a stable sort of the logits rounded to logits_dtype: value descending, NaN first,
-0 = +0, ties to the lower id, K from 1 to V. The logits are exact in every dtype here
(no scale, no softcap), so the expected ids are exact too.
"""

from __future__ import annotations

import pytest
import torch

from dflash2_kernels._extension import has_kernel

from .head_cases import gpu_driver_runs

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _logits(rows: int, vocab: int, kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """random: spread values; ties: a handful of values (ties everywhere, the K-th included);
    specials: ties plus NaN, +-inf and -0 / +0; nans: a third NaN (more than K NaN blocks);
    neginf: -inf but for a few values (fewer than K); rounding: 1 + 1e-3 N(0, 1), which a
    16-bit logits_dtype rounds to a handful of keys (ties made by the rounding)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return (torch.randn(rows, vocab, generator=gen, dtype=F64) * 3).to(dtype)
    if kind == "rounding":
        return (1 + 1e-3 * torch.randn(rows, vocab, generator=gen, dtype=F64)).to(dtype)
    if kind in ("nans", "neginf"):
        values = torch.randn(rows, vocab, generator=gen, dtype=F64)
        if kind == "nans":
            return values.masked_fill(torch.rand(rows, vocab, generator=gen) < 1 / 3, float("nan")).to(dtype)
        return values.masked_fill(torch.rand(rows, vocab, generator=gen) > 5 / vocab, float("-inf")).to(dtype)
    values = (torch.randint(-4, 5, (rows, vocab), generator=gen).to(F64) * 0.75).to(dtype)
    if kind == "specials":
        flat = values.view(-1)
        picks = torch.randperm(flat.numel(), generator=gen)[: max(4, flat.numel() // 10)]
        specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0], dtype=F64).to(dtype)
        flat[picks] = specials[torch.arange(len(picks)) % len(specials)]
    return values


def _expected(logits: torch.Tensor, top_k: int, logits_dtype: torch.dtype) -> torch.Tensor:
    rounded = logits.to(logits_dtype).to(F64)
    rounded = torch.where(rounded == 0, torch.zeros_like(rounded), rounded)  # -0 ties with +0
    return torch.sort(rounded, dim=-1, descending=True, stable=True).indices[:, :top_k]


# (rows, vocab, K, kind, plane dtype, logits_dtype): vocabularies across the CPU kernel's lanes
# of 8 floats / 4 doubles, K from 1 to V, K large enough to compact its candidates many times
# (2K held, then the best K kept) and K = V; every rounding of the logits. A float row of
# at least 2K blocks of 32 takes its bar from the blocks' maxima first (RowTopK::
# bar_from_blocks): K at that limit, ties and rounding at the bar, a bar that is NaN (K
# blocks hold one) or -inf (fewer than K finite logits), a row's last lanes past its blocks.
CPU_CASES = [
    (4, 1000, 15, "specials", F32, F16),
    (4, 1000, 15, "nans", F32, F32),
    (3, 1024, 10, "neginf", F32, F32),
    (4, 3000, 16, "ties", F32, BF16),
    (4, 3000, 16, "ties", F32, F32),
    (3, 5011, 64, "rounding", F32, F16),
    (3, 5011, 78, "rounding", F32, BF16),
    (3, 33_000, 256, "random", F32, BF16),
    (3, 33_000, 500, "specials", F32, F32),
    (3, 1, 1, "random", F32, F32),
    (4, 7, 7, "ties", F32, F32),
    (4, 9, 3, "specials", F32, BF16),
    (5, 64, 64, "specials", F64, F64),
    (6, 1000, 1, "specials", F32, F16),
    (6, 1000, 40, "ties", F32, F32),
    (6, 1000, 300, "random", F32, BF16),
    (6, 1000, 999, "specials", F64, F32),
    (3, 5000, 5000, "ties", F32, F32),
    (3, 5000, 2048, "random", F32, F16),
    (2, 33_000, 1024, "ties", F32, BF16),
]


def _case_id(case) -> str:
    rows, vocab, k, kind, dtype, logits_dtype = case
    return f"{rows}x{vocab}-K{k}-{kind}-{str(dtype)[6:]}-as-{str(logits_dtype)[6:]}"


@pytest.mark.skipif(not has_kernel("draft_head_rows_cpu", "cpu"), reason="needs the C++ extension")
@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_cpu_row_kernel_top_k(case):
    rows, vocab, top_k, kind, dtype, logits_dtype = case
    logits = _logits(rows, vocab, kind, dtype)
    out = torch.ops.dflash2.draft_head_rows_cpu(logits.clone(), None, None, 0, top_k, 1.0, 0.0, logits_dtype, None)
    expected = _expected(logits, top_k, logits_dtype)
    assert torch.equal(out[3], expected)
    assert torch.equal(out[2][:, 0], expected[:, 0])  # the draft argmax is the first
    values = out[4]
    assert torch.equal(torch.isnan(values), torch.isnan(logits.gather(1, expected)))
    assert torch.equal(values.nan_to_num(), logits.gather(1, expected).nan_to_num())


def _triton_top_k(logits: torch.Tensor, top_k: int, logits_dtype: torch.dtype) -> torch.Tensor:
    """dk.draft_head's top-k on its GPU driver over exactly these logits [R, V]: each row as
    a GEMM of one product (hidden [[1]], weight the row as [V, 1]), so NaN, +-inf and -0
    pass through unchanged."""
    import dflash2_kernels as dk

    device = "cuda" if torch.cuda.is_available() else "cpu"
    one = torch.ones(1, 1, dtype=logits.dtype, device=device)
    picks = [dk.draft_head(one, row.unsqueeze(1).to(device), losses=(), top_k=top_k, logits_dtype=logits_dtype)
             for row in logits]
    return torch.cat([out.topk_ids.cpu() for out in picks])


# The GPU driver's two ways on small rows (the interpreter runs a program in about a
# millisecond an operation): the single-read candidates (K <= 64) over segments of 4096
# (2048 fp64) with ties past what a segment keeps, and the radix select above (16-bit
# values read as fp32 keys, fp32, fp64); specials, K = 1 and K = V.
TRITON_CASES = [
    (2, 1, 1, "random", F32, F32),
    (3, 9, 9, "specials", F32, F32),
    (3, 100, 17, "ties", BF16, BF16),
    (2, 100, 5, "specials", F16, F16),
    (2, 5000, 64, "ties", F32, F32),
    (2, 9000, 16, "rounding", F32, BF16),
    (2, 9000, 16, "nans", F32, F32),
    (2, 4100, 16, "neginf", F32, F32),
    (2, 2100, 60, "ties", F64, F64),
    (2, 5000, 65, "random", F32, BF16),
    (2, 2100, 700, "ties", F32, F32),
    (2, 1100, 1100, "specials", F64, F64),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_top_k(case, monkeypatch):
    if not gpu_driver_runs():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1) or CUDA")
    monkeypatch.setenv("DFLASH2_BACKEND", "triton")
    rows, vocab, top_k, kind, dtype, logits_dtype = case
    values = _logits(rows, vocab, kind, dtype, seed=1)
    assert torch.equal(_triton_top_k(values, top_k, logits_dtype), _expected(values, top_k, logits_dtype))
