"""Benchmark the candidate selector's training path: ours vs the eager reference vs
torch.compile of it, with the shared floor beside them.

    python benchmarks/bench_selector.py [--out results.jsonl] [--no-compile] [--quick]

Every case is one of the two ways the drafters call the selector:

- ``score_candidates`` (speculators): full-vocabulary unary logits [N, V], gathered at
  the k candidates inside the op, so the logits' gradient is a dense [N, V] tensor;
- ``pair_scores`` (NeMo): unary values already gathered, [N, k];

at two levels:

- ``module``: from the hidden states, the hidden projection P = W h included, as the
  drafters call it (``CandidateSelector.score_candidates`` / ``.pair_scores``);
- ``op``: given P, the selector's own work (the public ``dk.score_candidates`` /
  ``dk.pair_scores``);

forward, and forward+backward with gradients for every input. Each case runs ours, the
eager reference (speculators' / NeMo's formula on plain PyTorch), ``torch.compile`` of
that reference, and the **floor**: the work every implementation shares, timed alone
with plain PyTorch (the gathers of the candidates' B rows, the A rows and, from full
logits, the unary entries; the projection GEMMs at module level; for the backward, the
B rows and A rows gathered again for g = sum_j dS_j B[cand_j] and dP = g A[pred], and
fills of the gradients' bytes: dP, the dense dA and dB and, for ``score_candidates``,
the dense [N, V] logits gradient, each into memory kept from the previous call, as
ours writes them), all timed in turns, one call each per repetition
(``common.time_side_by_side``).
The table reports median / p20 / p80 ms, the peak memory beyond the inputs, GB/s over
the minimal bytes, how many times faster ours is, and ours as a percent of the floor.

CUDA: N in {4096, 16384}, V = 248,320, H = 5120, r = 256, k = 16, bf16. CPU: N = 4096,
V = 32,000, H = 1024, k = 16, r in {64, 256}, fp32.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash2_kernels as dk  # noqa: E402
from dflash2_kernels import reference  # noqa: E402

from common import (  # noqa: E402
    FLOOR_IMPL, Row, peak_extra_bytes, print_table, start_run, time_side_by_side, write_records,
)

APIS = ("score_candidates", "pair_scores")
LEVELS = ("module", "op")


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
        return (f"N{self.rows} V{self.vocab} H{self.hidden} r{self.rank} "
                f"{str(self.dtype).removeprefix('torch.')}")


GPU_SHAPES = [Shape(4096, 248_320, 5120, torch.bfloat16), Shape(16384, 248_320, 5120, torch.bfloat16)]
CPU_SHAPES = [Shape(4096, 32_000, 1024, torch.float32, rank=64), Shape(4096, 32_000, 1024, torch.float32, rank=256)]


class Inputs:
    """One shape's tensors: the selector's parameters, h, P, the logits, their gathered
    values, ids and the upstream gradient."""

    def __init__(self, shape: Shape, device: torch.device):
        torch.manual_seed(0)
        self.selector = dk.CandidateSelector(shape.vocab, shape.hidden, shape.rank, shape.top_k).to(device, shape.dtype)
        with torch.no_grad():  # upstream initialises B to zero; trained codebooks are not
            self.selector.successor_codebook.normal_(0.0, 0.02)
        self.hidden = torch.randn(shape.rows, shape.hidden, device=device, dtype=shape.dtype)
        self.logits = torch.randn(shape.rows, shape.vocab, device=device, dtype=shape.dtype)
        self.predecessors = torch.randint(0, shape.vocab, (shape.rows,), device=device)
        self.candidates = self.logits.topk(shape.top_k, dim=-1).indices
        self.unary = self.logits.gather(-1, self.candidates)
        with torch.no_grad():
            self.projected = self.selector.hidden_projection(self.hidden)
        self.grad = torch.randn(shape.rows, shape.top_k, device=device, dtype=shape.dtype)
        self.grad_projected = torch.randn_like(self.projected)

    @property
    def codebooks(self):
        return self.selector.predecessor_codebook, self.selector.successor_codebook


def implementations(api: str, level: str, inputs: Inputs):
    """(ours, reference) as functions of (first, unary): ``first`` is h (module) or P (op),
    ``unary`` the logits [N, V] or the gathered values [N, k]."""
    sel = inputs.selector
    pred, cand = inputs.predecessors, inputs.candidates
    if level == "module":
        if api == "score_candidates":
            ours = lambda h, u: sel.score_candidates(u, h, pred, cand)  # noqa: E731
            ref = lambda h, u: reference.selector_score_candidates(  # noqa: E731
                u, sel.hidden_projection(h), sel.predecessor_codebook, sel.successor_codebook, pred, cand)
        else:
            ours = lambda h, u: sel.pair_scores(h, u, cand, pred)  # noqa: E731
            ref = lambda h, u: reference.selector_pair_scores(  # noqa: E731
                sel.hidden_projection(h), u, sel.predecessor_codebook, sel.successor_codebook, cand, pred)
        return ours, ref
    if api == "score_candidates":
        ours = lambda p, u: dk.score_candidates(u, p, *inputs.codebooks, pred, cand)  # noqa: E731
        ref = lambda p, u: reference.selector_score_candidates(u, p, *inputs.codebooks, pred, cand)  # noqa: E731
    else:
        ours = lambda p, u: dk.pair_scores(p, u, *inputs.codebooks, cand, pred)  # noqa: E731
        ref = lambda p, u: reference.selector_pair_scores(p, u, *inputs.codebooks, cand, pred)  # noqa: E731
    return ours, ref


def floor(api: str, level: str, backward: bool, inputs: Inputs, shape: Shape):
    """The shared work alone, with plain PyTorch: the reads every implementation makes
    (the k candidates' B rows per position, as ``embedding_bag`` sums them; the A rows;
    from full-vocabulary logits, the N k unary entries), the projection GEMMs at module
    level and, for the backward, the reads again (g = sum_j dS_j B[cand_j] as
    ``embedding_bag`` with per-sample weights, the A rows for dP = g A[pred]) and a fill
    of every gradient's bytes (dP [N, r], dA and dB [V, r], and for ``score_candidates``
    autograd's dense [N, V] logits gradient). The fills go into tensors kept across
    calls: ours writes its large results into memory kept from its previous call
    (dflash2_kernels.memory), so fresh pages' faults are not work it has to do."""
    sel = inputs.selector
    pred, cand = inputs.predecessors, inputs.candidates
    predecessor_codebook, successor_codebook = (c.detach() for c in inputs.codebooks)
    gradients = []
    if backward:
        options = {"device": inputs.hidden.device, "dtype": shape.dtype}
        gradients = [torch.empty(shape.rows, shape.rank, **options)]
        gradients += [torch.empty(shape.vocab, shape.rank, **options) for _ in range(2)]
        if api == "score_candidates":
            gradients.append(torch.empty(shape.rows, shape.vocab, **options))

    def shared():
        out = []
        with torch.no_grad():
            out.append(F.embedding_bag(cand, successor_codebook, mode="sum"))
            out.append(F.embedding(pred, predecessor_codebook))
            if api == "score_candidates":
                out.append(inputs.logits.gather(-1, cand))
        if level == "module":
            if backward:  # P = W h, dh = dP W, dW = dP^T h
                h = inputs.hidden.detach().requires_grad_()
                out += torch.autograd.grad(F.linear(h, sel.hidden_projection.weight), [h, sel.hidden_projection.weight],
                                           inputs.grad_projected)
            else:
                with torch.no_grad():
                    out.append(F.linear(inputs.hidden, sel.hidden_projection.weight))
        if backward:
            with torch.no_grad():
                out.append(F.embedding_bag(cand, successor_codebook, mode="sum", per_sample_weights=inputs.grad))
                out.append(F.embedding(pred, predecessor_codebook))
                for gradient in gradients:
                    gradient.zero_()
        return out

    return shared


def minimal_bytes(shape: Shape, api: str, level: str, backward: bool) -> int:
    """Each operand read once (B: the k gathered rows per position), each result and
    gradient written once (dU of full logits, dA and dB are dense, as autograd requires)."""
    size = torch.empty((), dtype=shape.dtype).element_size()
    n, k, r, v = shape.rows, shape.top_k, shape.rank, shape.vocab
    projection = (shape.hidden * r + n * shape.hidden + n * r) * size  # read W, h; write P
    scores = (n * k + n * r + n * r + n * k * r + n * k) * size  # U at k ids, P, A rows, B rows; write S
    total = scores + (projection if level == "module" else 0)
    if not backward:
        return total
    total += (n * k + n * k * r + 2 * n * r + n * r) * size + 2 * v * r * size  # dS, B rows, A, P; dP, dA, dB
    total += (n * v if api == "score_candidates" else n * k) * size  # dU
    if level == "module":
        total += 2 * projection  # dh = dP W, dW = dP^T h
    return total


def main() -> None:
    run = start_run(__doc__, quick_help="the first shape, op level only")
    args, device, env, copy_gbps = run.args, run.device, run.env, run.copy_gbps
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    levels = LEVELS
    if args.quick:
        shapes, levels = shapes[:1], ("op",)

    rows: list[Row] = []
    for shape in shapes:
        inputs = Inputs(shape, device)
        params = [inputs.selector.hidden_projection.weight, *inputs.codebooks]
        for level in levels:
            for api in APIS:
                first = inputs.hidden if level == "module" else inputs.projected
                unary = inputs.logits if api == "score_candidates" else inputs.unary
                leaves = [first.detach().requires_grad_(), unary.detach().requires_grad_()]
                grad_leaves = leaves + (params if level == "module" else params[1:])
                ours, ref = implementations(api, level, inputs)
                impls = {"ours": ours, "reference": ref}
                if not args.no_compile:
                    impls["compiled reference"] = torch.compile(ref, dynamic=False)
                for backward in (False, True):
                    label = f"{level} {api} {'fwd+bwd' if backward else 'fwd'} {shape.name}"
                    calls = {impl: _call(fn, leaves, grad_leaves if backward else None, inputs.grad)
                             for impl, fn in impls.items()}
                    calls[FLOOR_IMPL] = floor(api, level, backward, inputs, shape)
                    nbytes = minimal_bytes(shape, api, level, backward)
                    # Every implementation captures: device time from a CUDA-graph replay.
                    for impl, timing in time_side_by_side(calls, device, reps=10, graph=True).items():
                        peak = peak_extra_bytes(calls[impl], device)
                        rows.append(Row("selector", label, impl, timing, nbytes, copy_gbps,
                                        {"peak_extra_mib": None if peak is None else peak / 2**20}))
        del inputs

    print_table(rows)
    write_records(rows, env, args.out)


def _call(fn, leaves, grad_leaves, grad):
    """One call of ``fn(*leaves)``: under no_grad, or (``grad_leaves`` given) with the
    backward, gradients for every leaf in ``grad_leaves``."""
    if grad_leaves is None:
        def forward():
            with torch.no_grad():
                return fn(*leaves)
        return forward
    return lambda: torch.autograd.grad(fn(*leaves), grad_leaves, grad)


if __name__ == "__main__":
    main()
