"""The calls whose traffic benchmarks/traffic.py reports and tests/*traffic* check: every
CUDA kernel (run by the SIMT emulator) and every Triton kernel (run by the interpreter)
of the package, each inside the op that launches it, with the eager reference of that op
on the same inputs and the op's minimum (benchmarks/traffic_minimum.py).

A case builds its inputs at a number of rows (rows of the conv and the head's chunk,
selector rows, serving sequences of D = 8 drafted positions) and any hidden size, so
the report can count it at two scaled-down row counts and extrapolate per row to the
published shape (SPEC section 5), and the tests can count it at a few rows.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

import traffic_minimum as minimum
from dflash2_kernels import reference

TOP_K = 16
RANK = 256
BLOCK_SIZE = 8
TAPS = 2
GROUP_SIZE = 16
DRAFT = 8  # drafted positions per sequence (L = 8)


@dataclass
class CaseRun:
    """One call, ready to run: ``ours()`` launches the kernels (and whatever torch ops the
    op runs around them); ``reference()`` runs the eager reference on the same inputs;
    ``minimum(result)`` gives the op's and each kernel's minimum from ours' result."""

    ours: Callable[[], object]
    reference: Callable[[], object]
    minimum: Callable[[object], minimum.Minimum]
    kernels: tuple  # the keys of the launches ours() makes, in order
    # Runs the reference's forward (untimed, uncounted) when reference() is its backward.
    prepare_reference: Callable[[], None] | None = None
    # Restores the inputs ours() overwrites (untimed, uncounted), before each call.
    reset: Callable[[], None] | None = None


@dataclass(frozen=True)
class Case:
    name: str  # unique, e.g. "conv forward bf16"
    op: str  # the bench record's op, for the measured CPU speed-up (docs/results/records.jsonl)
    counter: str  # "interpreter" or "emulator"
    shape: str  # the published shape it stands for
    full_rows: int  # rows (or sequences) at that shape
    scaled_rows: tuple  # two row counts the report counts at (extrapolating per row)
    make: Callable  # make(rows, ops, device) -> CaseRun: ops is the CUDA kernels' op namespace


def _generator(seed: int, device="cpu") -> torch.Generator:
    """Inputs are drawn on their device: at the published shapes (the GPU check) some
    hold a billion elements."""
    return torch.Generator(device).manual_seed(seed)


# --- the conv (Triton) -------------------------------------------------------------------


def _conv_inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int, device):
    g = _generator(seed, device)
    groups = hidden // GROUP_SIZE
    x = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    # As real training hands it: one side of the kernel projection's [N, 2, K, G] view.
    delta = (0.1 * torch.randn(rows, 2, TAPS, groups, generator=g, device=device)).to(dtype)[:, 0]
    base = torch.randn(TAPS, hidden, generator=g, device=device).to(dtype)
    return x, delta, base


def conv_forward_case(dtype: torch.dtype, hidden: int) -> Callable:
    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.conv.launch import conv_forward_triton

        x, delta, base = _conv_inputs(rows, hidden, dtype, 0, device)
        out_dtype = torch.promote_types(x.dtype, delta.dtype)
        return CaseRun(
            ours=lambda: conv_forward_triton(x, delta, base, BLOCK_SIZE, out_dtype),
            reference=lambda: reference.grouped_dynamic_conv(x, delta, base, block_size=BLOCK_SIZE,
                                                             group_size=GROUP_SIZE),
            minimum=lambda out: minimum.conv_forward(x, delta, base, base.to(x.dtype), out, BLOCK_SIZE),
            kernels=("grouped_dynamic_conv_fwd_kernel",))
    return make


H200_PROGRAMS = 132 * 8  # what the conv's backward launcher aims for on an H200 (conv/launch.py)


@contextlib.contextmanager
def conv_backward_plan(plan_rows: int, hidden: int):
    """The conv backward launcher's split of rows into chunks (one dbase partial each) as
    on an H200 at ``plan_rows`` rows: the row steps a program takes there, whatever the
    rows of the call (the interpreter's own plan aims at 4 programs)."""
    from dflash2_kernels.conv import launch

    tiles = launch.conv_tiles(hidden // GROUP_SIZE, GROUP_SIZE, backward=True)
    row_tiles = -(-plan_rows // tiles.block_n)
    steps = min(launch._MAX_ROW_STEPS, max(1, -(-row_tiles * tiles.col_tiles(hidden // GROUP_SIZE)
                                                // H200_PROGRAMS)))
    saved = launch._target_programs, launch._MAX_ROW_STEPS
    launch._target_programs, launch._MAX_ROW_STEPS = (lambda device: 1), steps
    try:
        yield steps * tiles.block_n
    finally:
        launch._target_programs, launch._MAX_ROW_STEPS = saved


def conv_backward_case(dtype: torch.dtype, hidden: int, plan_rows: int | None = None) -> Callable:
    """plan_rows: count the backward as the launcher splits ``plan_rows`` rows on an H200
    (the report's published shape); None: as it splits the call's own rows there."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.conv.launch import conv_backward_triton

        def ours():
            if device != "cpu":
                return conv_backward_triton(dy, x, delta, base, BLOCK_SIZE)
            with conv_backward_plan(plan_rows or rows, hidden):
                return conv_backward_triton(dy, x, delta, base, BLOCK_SIZE)

        x, delta, base = _conv_inputs(rows, hidden, dtype, 1, device)
        dy = torch.randn(rows, hidden, generator=_generator(2, device), device=device).to(
            torch.promote_types(x.dtype, delta.dtype))
        # The reference's backward alone: its forward runs (and saves what autograd keeps) first.
        leaves = [t.detach().requires_grad_() for t in (x, delta, base)]
        graph = {}

        def reference_backward():
            if "out" not in graph:
                graph["out"] = reference.grouped_dynamic_conv(*leaves, block_size=BLOCK_SIZE, group_size=GROUP_SIZE)
            graph.pop("out").backward(dy)

        def prepare():
            graph["out"] = reference.grouped_dynamic_conv(*leaves, block_size=BLOCK_SIZE, group_size=GROUP_SIZE)

        return CaseRun(
            ours=ours,
            reference=reference_backward,
            minimum=lambda grads: minimum.conv_backward(dy, x, delta, base, base.to(x.dtype), *grads, BLOCK_SIZE),
            kernels=("grouped_dynamic_conv_bwd_kernel",), prepare_reference=prepare)
    return make


# --- the selector (CUDA) -----------------------------------------------------------------


def _selector_inputs(rows: int, vocab: int, dtype: torch.dtype, seed: int, device):
    g = _generator(seed, device)
    unary = torch.randn(rows, vocab, generator=g, device=device).to(dtype)
    projected = torch.randn(rows, RANK, generator=g, device=device).to(dtype)
    predecessor = (0.1 * torch.randn(vocab, RANK, generator=g, device=device)).to(dtype)
    successor = (0.1 * torch.randn(vocab, RANK, generator=g, device=device)).to(dtype)
    predecessor_ids = torch.randint(0, vocab, (rows,), generator=g, device=device)
    candidate_ids = torch.randint(0, vocab, (rows, TOP_K), generator=g, device=device)
    return unary, projected, predecessor, successor, predecessor_ids, candidate_ids


def selector_forward_case(vocab: int, dtype: torch.dtype) -> Callable:
    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        unary, projected, a, b, pred, cand = _selector_inputs(rows, vocab, dtype, 3, device)
        return CaseRun(
            ours=lambda: ops.selector_scores(unary, projected, a, b, pred, cand, False, unary.dtype),
            reference=lambda: reference.selector_score_candidates(unary, projected, a, b, pred, cand),
            minimum=lambda scores: minimum.selector_forward(unary, projected, a, b, pred, cand, False, scores),
            kernels=("selector_scores_forward_kernel",))
    return make


def selector_backward_case(vocab: int, dtype: torch.dtype) -> Callable:
    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        unary, projected, a, b, pred, cand = _selector_inputs(rows, vocab, dtype, 4, device)
        grad = torch.randn(rows, TOP_K, generator=_generator(5, device), device=device).to(dtype)
        leaves = [t.detach().requires_grad_() for t in (unary, projected, a, b)]
        graph = {}

        def prepare():
            graph["out"] = reference.selector_score_candidates(*leaves, pred, cand)

        def reference_backward():
            if "out" not in graph:
                prepare()
            graph.pop("out").backward(grad)
            for leaf in leaves:
                leaf.grad = None

        accumulator = 8 if dtype == torch.float64 else 4
        return CaseRun(
            ours=lambda: ops.selector_scores_backward(grad, projected, a, b, pred, cand, False, vocab, unary.dtype),
            reference=reference_backward,
            minimum=lambda grads: minimum.selector_backward(grad, projected, a, b, pred, cand, False, grads,
                                                            accumulator),
            kernels=("selector_backward_rows_kernel", "selector_segment_chunks_kernel[predecessors]",
                     "selector_segment_carry_kernel[predecessors]", "selector_segment_chunks_kernel[successors]",
                     "selector_segment_carry_kernel[successors]"),
            prepare_reference=prepare)
    return make


# --- serving (CUDA) ------------------------------------------------------------------------


def topk_slices(rows: int, vocab: int) -> int:
    """The launcher's split of each row (csrc/kernels/serving_kernels.cu, plan_topk_split, 132 SMs)."""
    slices = max(1, -(-132 * 32 // rows))
    slices = min(slices, 256, max(1, vocab // 1024))
    length = -(-vocab // slices)
    length = -(-length // 16) * 16
    return -(-vocab // length)


def _serving_inputs(sequences: int, vocab: int, dtype: torch.dtype, seed: int, device):
    g = _generator(seed, device)
    logits = torch.randn(sequences, DRAFT, vocab, generator=g, device=device).to(dtype)
    projected = torch.randn(sequences, DRAFT, RANK, generator=g, device=device).to(dtype)
    predecessor = (0.1 * torch.randn(vocab, RANK, generator=g, device=device)).to(dtype)
    successor = (0.1 * torch.randn(vocab, RANK, generator=g, device=device)).to(dtype)
    anchors = torch.randint(0, vocab, (sequences,), generator=g, device=device)
    uniforms = torch.rand(sequences, DRAFT, generator=g, device=device)
    return logits, projected, predecessor, successor, anchors, uniforms


def topk_case(vocab: int, dtype: torch.dtype) -> Callable:
    def make(sequences: int, ops=None, device="cpu") -> CaseRun:
        logits = _serving_inputs(sequences, vocab, dtype, 6, device)[0].reshape(sequences * DRAFT, vocab)
        slices = topk_slices(logits.shape[0], vocab)
        return CaseRun(
            ours=lambda: ops.candidate_topk(logits, TOP_K),
            reference=lambda: reference.candidate_topk(logits, TOP_K),
            minimum=lambda out: minimum.candidate_topk(logits, out[0], out[1], slices),
            kernels=("topk_partial_kernel", "topk_merge_kernel"))
    return make


def walk_case(vocab: int, dtype: torch.dtype, temperature: float) -> Callable:
    def make(sequences: int, ops=None, device="cpu") -> CaseRun:
        logits, projected, a, b, anchors, uniforms = _serving_inputs(sequences, vocab, dtype, 7, device)
        score_dtype = reference.serving_score_dtype(logits, projected, a)
        slices = topk_slices(sequences * DRAFT, vocab)
        return CaseRun(
            ours=lambda: ops.select_path(logits, projected, a, b, anchors, uniforms, TOP_K, temperature,
                                         score_dtype),
            reference=lambda: reference.serving_walk(projected, logits, anchors, a, b, TOP_K, temperature, uniforms),
            minimum=lambda out: minimum.select_path(logits, projected, a, b, anchors, uniforms, temperature, out,
                                                    slices),
            kernels=("topk_partial_kernel", "select_path_kernel"))
    return make


def rejection_case(vocab: int) -> Callable:
    def make(sequences: int, ops=None, device="cpu") -> CaseRun:
        g = _generator(8, device)
        target = torch.softmax(torch.randn(sequences, DRAFT + 1, vocab, generator=g, device=device), -1)
        draft_probs = torch.softmax(torch.randn(sequences, DRAFT, TOP_K, generator=g, device=device), -1)
        candidates = torch.stack([torch.randperm(vocab, generator=g, device=device)[:TOP_K]
                                  for _ in range(sequences * DRAFT)]).reshape(sequences, DRAFT, TOP_K)
        tokens = candidates[..., 0].clone()
        # Small uniforms: most positions are accepted.
        uniforms = torch.rand(sequences, DRAFT + 1, generator=g, device=device) * 1e-6
        slices = math.ceil(vocab / 4096)
        return CaseRun(
            ours=lambda: ops.rejection_sample(tokens, target, draft_probs, candidates, uniforms),
            reference=lambda: reference.rejection_sample(tokens, target, draft_probs, candidates, uniforms),
            minimum=lambda out: minimum.rejection_sample(tokens, target, draft_probs, candidates, uniforms, *out,
                                                         slices),
            kernels=("verify_mass_kernel", "verify_bonus_kernel"))
    return make


# --- the draft head's row kernels (Triton) ------------------------------------------------

HEAD_LOSSES = ("kl_div",)
HEAD_LOSS_MASK = 1  # kl_div: row_launch.LOSS_ORDER


def _head_rows_inputs(rows: int, vocab: int, seed: int, device):
    g = _generator(seed, device)
    return 4 * torch.randn(rows, vocab, generator=g, device=device), 4 * torch.randn(rows, vocab, generator=g,
                                                                                       device=device)


def head_rows_forward_case(vocab: int) -> Callable:
    """One chunk of the training forward with a frozen lm_head: kl_div, its dL/ds plane."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head.row_launch import head_rows_triton

        s0, t0 = _head_rows_inputs(rows, vocab, 9, device)
        s, t = s0.clone(), t0.clone()  # the kernel overwrites them
        planes = torch.empty(len(HEAD_LOSSES), rows, vocab, device=device)
        state = {}

        def ours():
            losses, stats = head_rows_triton(s, t, None, HEAD_LOSS_MASK, 1.0, 0.0, planes)
            state.update(losses=losses, stats=stats)
            return losses

        def eager():
            z = s0.detach().requires_grad_()
            losses = reference.draft_head_row_losses(z, t0, None, HEAD_LOSSES)
            torch.autograd.grad(losses["kl_div"].sum(), z)

        return CaseRun(
            ours=ours, reference=eager,
            minimum=lambda _: minimum.head_rows_forward(s0, t0, None, state["losses"], state["stats"], planes),
            kernels=("draft_head_rows_kernel[forward]",), reset=lambda: (s.copy_(s0), t.copy_(t0)))
    return make


def head_rows_backward_case(vocab: int) -> Callable:
    """One chunk of the backward that recomputes (a trainable lm_head): kl_div's dL/ds."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head.row_launch import head_rows_backward_triton

        s0, t0 = _head_rows_inputs(rows, vocab, 10, device)
        grad_losses = torch.rand(len(HEAD_LOSSES), rows, generator=_generator(11, device), device=device)
        graph = {}

        def prepare():
            z = s0.detach().requires_grad_()
            graph["loss"] = (reference.draft_head_row_losses(z, t0, None, HEAD_LOSSES)["kl_div"], z)

        def eager_backward():
            if "loss" not in graph:
                prepare()
            loss, z = graph.pop("loss")
            torch.autograd.grad(loss, z, grad_losses[0])

        s, t = s0.clone(), t0.clone()  # the kernel overwrites them
        return CaseRun(
            ours=lambda: head_rows_backward_triton(s, t, None, HEAD_LOSS_MASK, 1.0, 0.0, grad_losses),
            reference=eager_backward,
            minimum=lambda _: minimum.head_rows_backward(s0, t0, None, grad_losses),
            kernels=("draft_head_rows_kernel[backward]",), prepare_reference=prepare,
            reset=lambda: (s.copy_(s0), t.copy_(t0)))
    return make


def head_topk_case(vocab: int, top_k: int) -> Callable:
    """The head's Triton top-k over a chunk's logits (a radix select: head/topk_kernels.py)."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head.topk_launch import row_topk_triton

        values, _ = _head_rows_inputs(rows, vocab, 12, device)
        return CaseRun(
            ours=lambda: row_topk_triton(values, top_k),
            reference=lambda: torch.topk(values, top_k, dim=-1),
            minimum=lambda ids: minimum.head_topk(values, ids),
            kernels=("draft_head_topk_kernel",))
    return make


# --- the published shapes (SPEC section 5: Qwen3.8-27B-DFlash2, its largest V and H) -----

HIDDEN = 5120
VOCAB = 248_320
TRAIN_ROWS = 4096  # speculators: 512 anchors x block 8
SERVE_SEQUENCES = 32  # 32 requests x 8 drafted positions

CASES = (
    Case("conv forward fp32", "conv", "interpreter", f"[1, {TRAIN_ROWS}, {HIDDEN}] fp32", TRAIN_ROWS, (32, 64),
         conv_forward_case(torch.float32, HIDDEN)),
    Case("conv forward bf16", "conv", "interpreter", f"[1, {TRAIN_ROWS}, {HIDDEN}] bf16", TRAIN_ROWS, (32, 64),
         conv_forward_case(torch.bfloat16, HIDDEN)),
    # Whole row chunks of the H200's plan (10 row steps of 8 rows at 4096 x 5120): 1 and 2
    # dbase partials, so that the partials extrapolate per row like everything else.
    Case("conv backward fp32", "conv", "interpreter", f"[1, {TRAIN_ROWS}, {HIDDEN}] fp32", TRAIN_ROWS, (80, 160),
         conv_backward_case(torch.float32, HIDDEN, TRAIN_ROWS)),
    Case("conv backward bf16", "conv", "interpreter", f"[1, {TRAIN_ROWS}, {HIDDEN}] bf16", TRAIN_ROWS, (80, 160),
         conv_backward_case(torch.bfloat16, HIDDEN, TRAIN_ROWS)),
    Case("selector score_candidates forward bf16", "selector", "emulator",
         f"N {TRAIN_ROWS}, V {VOCAB}, r {RANK}, k {TOP_K}, bf16", TRAIN_ROWS, (32, 64),
         selector_forward_case(VOCAB, torch.bfloat16)),
    Case("selector score_candidates backward bf16", "selector", "emulator",
         f"N {TRAIN_ROWS}, V {VOCAB}, r {RANK}, k {TOP_K}, bf16", TRAIN_ROWS, (32, 64),
         selector_backward_case(VOCAB, torch.bfloat16)),
    Case("candidate_topk bf16", "topk", "emulator", f"B {SERVE_SEQUENCES} x D {DRAFT}, V {VOCAB}, k {TOP_K}, bf16",
         SERVE_SEQUENCES, (1, 2), topk_case(VOCAB, torch.bfloat16)),
    Case("walk greedy bf16", "walk", "emulator",
         f"B {SERVE_SEQUENCES} x D {DRAFT}, V {VOCAB}, r {RANK}, k {TOP_K}, bf16", SERVE_SEQUENCES, (1, 2),
         walk_case(VOCAB, torch.bfloat16, 0.0)),
    Case("walk sampled bf16", "walk", "emulator",
         f"B {SERVE_SEQUENCES} x D {DRAFT}, V {VOCAB}, r {RANK}, k {TOP_K}, bf16, T = 1", SERVE_SEQUENCES, (1, 2),
         walk_case(VOCAB, torch.bfloat16, 1.0)),
    Case("rejection_sample fp32", "rejection", "emulator", f"B {SERVE_SEQUENCES} x D {DRAFT}, V {VOCAB}, k {TOP_K}",
         SERVE_SEQUENCES, (1, 2), rejection_case(VOCAB)),
    Case("head rows kl_div forward fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, fp32",
         TRAIN_ROWS, (2, 4), head_rows_forward_case(VOCAB)),
    Case("head rows kl_div backward fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, fp32",
         TRAIN_ROWS, (2, 4), head_rows_backward_case(VOCAB)),
    Case("head top-k fp32", "head_topk", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k {TOP_K}, fp32",
         TRAIN_ROWS, (2, 4), head_topk_case(VOCAB, TOP_K)),
)


def kernel_key(launch, expected: str) -> str:
    """``expected`` if the launch is that kernel (its name without template arguments)."""
    name = minimum.kernel_name(expected)
    if launch.name != name:
        raise AssertionError(f"expected a launch of {name}, got {launch.kernel}")
    return expected
