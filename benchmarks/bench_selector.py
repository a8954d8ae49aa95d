"""Benchmark the candidate selector's training op: ours vs the eager reference vs
torch.compile of it.

    python benchmarks/bench_selector.py [--out results.jsonl] [--no-compile] [--quick]

Times ``CandidateSelector.score_candidates`` (the hidden projection, the gather of the
unary logits at the top-k candidates, the bilinear transition scores) forward;
forward+backward with gradients for every input (the unary logits, the hidden states,
the three parameters), as in training; and forward+backward without the unary
logits' gradient ("no dU"), which shows the selector's own cost: the dense [N, V]
logits gradient costs ours and the reference the same. Reports median / p20 / p80 ms, the
peak memory beyond the inputs, and GB/s over the minimal bytes: each operand read
once (for B: the k gathered rows per position), each output and gradient written
once (the gradient of full-vocabulary logits is a dense [N, V] tensor, as autograd
requires). On CUDA: N in {4096, 16384}, V = 248,320, r = 256, k = 16, H = 5120, bf16;
on CPU: N = 4096, V = 32,000, H = 1024, fp32.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash2_kernels as dk  # noqa: E402
from dflash2_kernels import reference  # noqa: E402

from common import (  # noqa: E402
    Row, peak_extra_bytes, print_table, start_run, time_fn, write_records,
)


@dataclass(frozen=True)
class Shape:
    rows: int
    vocab: int
    hidden: int
    dtype: torch.dtype
    rank: int = 256
    top_k: int = 16

    @property
    def name(self) -> str:
        return f"N{self.rows} V{self.vocab} H{self.hidden} {str(self.dtype).removeprefix('torch.')}"


GPU_SHAPES = [Shape(4096, 248_320, 5120, torch.bfloat16), Shape(16384, 248_320, 5120, torch.bfloat16)]
CPU_SHAPES = [Shape(4096, 32_000, 1024, torch.float32)]


def reference_score_candidates(selector, unary_logits, hidden, predecessor_ids, candidate_ids):
    """speculators' score_candidates, as upstream computes it."""
    return reference.selector_score_candidates(
        unary_logits,
        selector.hidden_projection(hidden),
        selector.predecessor_codebook,
        selector.successor_codebook,
        predecessor_ids,
        candidate_ids,
    )


def minimal_bytes(shape: Shape, grads: str) -> int:
    """grads: "forward" (none), "all" (dU too), or "no_unary" (all but dU)."""
    size = torch.empty((), dtype=shape.dtype).element_size()
    n, k, r = shape.rows, shape.top_k, shape.rank
    projection = (shape.hidden * r + n * shape.hidden + n * r) * size  # read W, h; write P
    scores = (n * k + n * r + n * r + n * k * r + n * k) * size  # U at k ids, P, A rows, B rows; write S
    forward = projection + scores
    if grads == "forward":
        return forward
    dense_grads = 2 * shape.vocab * r * size  # dA, dB are dense tensors
    if grads == "all":
        dense_grads += n * shape.vocab * size  # and so is dU
    backward_bytes = (n * k + n * k * r + 2 * n * r + n * r) * size + dense_grads  # dS, B rows, A, P; write dP
    backward_bytes += 2 * projection  # dh = dP W, dW = dP^T h
    return forward + backward_bytes


def main() -> None:
    run = start_run(__doc__, quick_help="the first shape only")
    args, device, env, copy_gbps = run.args, run.device, run.env, run.copy_gbps

    impls = {"ours": lambda s, *a: s.score_candidates(*a), "reference": reference_score_candidates}
    if not args.no_compile:
        impls["compiled reference"] = torch.compile(reference_score_candidates, dynamic=False)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    if args.quick:
        shapes = shapes[:1]

    rows: list[Row] = []
    for shape in shapes:
        torch.manual_seed(0)
        selector = dk.CandidateSelector(shape.vocab, shape.hidden, shape.rank, shape.top_k).to(device, shape.dtype)
        hidden = torch.randn(shape.rows, shape.hidden, device=device, dtype=shape.dtype)
        logits = torch.randn(shape.rows, shape.vocab, device=device, dtype=shape.dtype)
        predecessors = torch.randint(0, shape.vocab, (shape.rows,), device=device)
        candidates = logits.topk(shape.top_k, dim=-1).indices
        grad = torch.randn(shape.rows, shape.top_k, device=device, dtype=shape.dtype)
        frozen_logits = logits.clone()
        leaves = [hidden.requires_grad_(), logits.requires_grad_(), *selector.parameters()]

        for impl, score in impls.items():
            def forward(score=score):
                with torch.no_grad():
                    return score(selector, logits, hidden, predecessors, candidates)

            def forward_backward(score=score):
                out = score(selector, logits, hidden, predecessors, candidates)
                return torch.autograd.grad(out, leaves, grad)

            def forward_backward_frozen_logits(score=score):
                out = score(selector, frozen_logits, hidden, predecessors, candidates)
                return torch.autograd.grad(out, [leaves[0], *leaves[2:]], grad)

            modes = (("fwd", forward, "forward"), ("fwd+bwd", forward_backward, "all"),
                     ("fwd+bwd no dU", forward_backward_frozen_logits, "no_unary"))
            for label, fn, grads in modes:
                timing = time_fn(fn, device, reps=10)
                peak = peak_extra_bytes(fn, device)
                extra = {"peak_extra_mib": None if peak is None else peak / 2**20}
                rows.append(Row("selector", f"{label} {shape.name}", impl, timing, minimal_bytes(shape, grads),
                                copy_gbps, extra))
        del selector, hidden, logits, leaves

    print_table(rows)
    write_records(rows, env, args.out)


if __name__ == "__main__":
    main()
