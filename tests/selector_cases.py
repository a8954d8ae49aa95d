"""The selector's case table and input builders, shared by its tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2_kernels import reference

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


@dataclass(frozen=True)
class SelectorCase:
    lead: tuple[int, ...]
    vocab: int
    rank: int
    top_k: int
    unary_dtype: torch.dtype = F32
    projected_dtype: torch.dtype = F32
    codebook_dtype: torch.dtype = F32

    @property
    def id(self) -> str:
        names = "-".join(str(d).removeprefix("torch.") for d in (self.unary_dtype, self.projected_dtype,
                                                                 self.codebook_dtype))
        return f"{'x'.join(map(str, self.lead))}-V{self.vocab}-r{self.rank}-k{self.top_k}-{names}"


CASES = [
    SelectorCase((6,), 50, 16, 5),
    SelectorCase((2, 3), 7, 12, 5),  # V = 7 < N * k: ids repeat within and across rows
    SelectorCase((2, 2, 3), 40, 256, 16),  # the real rank and k; leading dims of rank 3
    SelectorCase((9,), 33, 20, 1),  # k = 1; r not a multiple of any vector width
    SelectorCase((5,), 64, 40, 33),  # k above one warp pass of 32 candidates
    SelectorCase((4,), 30, 24, 16, BF16, BF16, BF16),
    SelectorCase((4,), 30, 24, 16, F16, F16, F16),
    SelectorCase((2, 4), 3, 32, 5, BF16, BF16, F32),  # autocast: bf16 U and P, fp32 codebooks
    SelectorCase((3,), 25, 8, 4, F32, F32, BF16),  # fp32 P over bf16 codebooks
    SelectorCase((5,), 17, 10, 4, F64, F64, F64),
    SelectorCase((0,), 10, 8, 3),  # no rows
    # N k >= 2 V: ids repeat, in many rows (the CPU forward's candidate-id order pays off
    # at such ratios; test_cpu_forward_orders_give_the_same_bits runs both orders)
    SelectorCase((1024,), 300, 64, 16),
    SelectorCase((512,), 200, 40, 16, BF16, BF16, BF16),  # the same, 16-bit, r not a multiple of 16
    # The CPU backward's AVX-512 sums (csrc/double_lanes.h) take r in 64-wide chunks, a
    # tail after them: one chunk and a tail, in 16-bit rows; two chunks of bf16 codebooks
    # under fp32 P; a chunk and a 36-wide tail.
    SelectorCase((96,), 50, 80, 6, BF16, BF16, BF16),
    SelectorCase((48,), 30, 128, 4, F32, F32, BF16),
    SelectorCase((3, 20), 40, 100, 8),
    # Training size: dA sums ~1,000 rows an id, dB ~4,000 terms, each in one serial chain
    # (r = 80: a 64-wide chunk and a tail).
    SelectorCase((65536,), 64, 80, 4),
]


def make_inputs(case: SelectorCase, device: str, seed: int = 0):
    """(unary [..., V], projected [..., r], A [V, r], B [V, r], pred [...], cand [..., k], dS)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    unary = randn(*case.lead, case.vocab, dtype=case.unary_dtype)
    projected = randn(*case.lead, case.rank, dtype=case.projected_dtype)
    predecessor = randn(case.vocab, case.rank, dtype=case.codebook_dtype, scale=0.5)
    successor = randn(case.vocab, case.rank, dtype=case.codebook_dtype, scale=0.5)
    predecessor_ids = torch.randint(0, case.vocab, case.lead, generator=g).to(device)
    candidate_ids = torch.randint(0, case.vocab, (*case.lead, case.top_k), generator=g).to(device)
    grad = randn(*case.lead, case.top_k, dtype=case.unary_dtype)
    return unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad


def scores_with_grads(fn, unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad):
    """(S, dU, dP, dA, dB) of fn(U, P, A, B, pred, cand) with upstream gradient dS."""
    leaves = [t.detach().requires_grad_() for t in (unary, projected, predecessor, successor)]
    scores = fn(*leaves, predecessor_ids, candidate_ids)
    grads = torch.autograd.grad(scores, leaves, grad)
    return (scores.detach(), *grads)


def exact_scores_with_grads(unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad):
    """The float64 judge: the same formula on float64 copies of the inputs."""
    u, p, a, b = (t.detach().double() for t in (unary, projected, predecessor, successor))
    return scores_with_grads(reference.selector_score_candidates, u, p, a, b, predecessor_ids, candidate_ids,
                             grad.double())
