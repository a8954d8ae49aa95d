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
from dflash2_kernels.tuning.spaces import CONV_BACKWARD

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
            minimum=lambda out: minimum.conv_forward(x, delta, base, out, BLOCK_SIZE),
            kernels=("grouped_dynamic_conv_fwd_kernel",))
    return make


H200_PROGRAMS = 132 * 8  # what the conv's backward launcher aims for on an H200 (conv/launch.py)


@contextlib.contextmanager
def conv_backward_plan(plan_rows: int, hidden: int):
    """The conv backward launcher's split of rows into chunks (one dbase partial each) as
    on an H200 at ``plan_rows`` rows: the row steps a program takes there, whatever the
    rows of the call (the interpreter's own plan aims at 4 programs)."""
    from dflash2_kernels.conv import launch

    tiles = launch.conv_tiles(hidden // GROUP_SIZE, GROUP_SIZE, CONV_BACKWARD.default)
    steps = _h200_row_steps(plan_rows, hidden)
    saved = launch._target_programs, launch._MAX_ROW_STEPS
    launch._target_programs, launch._MAX_ROW_STEPS = (lambda device: 1), steps
    try:
        yield steps * tiles.block_n
    finally:
        launch._target_programs, launch._MAX_ROW_STEPS = saved


def _h200_row_steps(plan_rows: int, hidden: int) -> int:
    """The row steps a backward program takes on an H200 at ``plan_rows`` rows."""
    from dflash2_kernels.conv import launch

    tiles = launch.conv_tiles(hidden // GROUP_SIZE, GROUP_SIZE, CONV_BACKWARD.default)
    row_tiles = -(-plan_rows // tiles.block_n)
    return min(launch._MAX_ROW_STEPS, max(1, -(-row_tiles * tiles.col_tiles(hidden // GROUP_SIZE) // H200_PROGRAMS)))


def conv_backward_chunks(rows: int, hidden: int, plan_rows: int | None) -> int:
    """The dbase partials (row chunks) of a backward over ``rows`` rows under conv_backward_plan."""
    from dflash2_kernels.conv import launch

    tiles = launch.conv_tiles(hidden // GROUP_SIZE, GROUP_SIZE, CONV_BACKWARD.default)
    row_tiles = -(-rows // tiles.block_n)
    steps = min(_h200_row_steps(plan_rows or rows, hidden), max(1, row_tiles * tiles.col_tiles(hidden // GROUP_SIZE)))
    return -(-row_tiles // steps)


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
            minimum=lambda grads: minimum.conv_backward(dy, x, delta, base, *grads, BLOCK_SIZE,
                                                        chunks=conv_backward_chunks(rows, hidden, plan_rows)),
            kernels=("grouped_dynamic_conv_bwd_kernel", "grouped_dynamic_conv_dbase_kernel"),
            prepare_reference=prepare)
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


# --- the draft head's GPU driver (Triton) --------------------------------------------------

HEAD_WIDTH = 8  # the GEMMs are torch's (counted with the ops around ours): a narrow H keeps them cheap


def _head_inputs(rows: int, vocab: int, seed: int, device, *, target: bool = True, labels: bool = False):
    """hidden [R, 8], W [V, 8] (logits spread over a few units), the target's hidden, labels."""
    g = _generator(seed, device)
    hidden = torch.randn(rows, HEAD_WIDTH, generator=g, device=device)
    weight = torch.randn(vocab, HEAD_WIDTH, generator=g, device=device)
    target_hidden = hidden + 0.7 * torch.randn(rows, HEAD_WIDTH, generator=g, device=device) if target else None
    label_ids = torch.randint(0, vocab, (rows,), generator=g, device=device) if labels else None
    return hidden, weight, target_hidden, label_ids


def _head_chunk(rows: int, vocab: int, top_k: int, *, target: bool, labels: bool, losses: int,
                plane_losses: int = 0):
    from dflash2_kernels.head.gpu_launch import segments

    return minimum.HeadChunk(rows, vocab, segments(vocab, torch.float32, False), top_k, target, labels, losses,
                             plane_losses)


def head_forward_case(vocab: int, losses: tuple, top_k: int) -> Callable:
    """One chunk of the training forward with a frozen lm_head (the forward keeps dL/dh): the
    scan, the merge, the sweep (sums and the planes of kl_div / ce) and the finish."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head import gpu_driver
        from dflash2_kernels.head.checks import loss_mask_of

        target = any(name != "ce" for name in losses)
        hidden, weight, target_hidden, labels = _head_inputs(rows, vocab, 9, device, target=target,
                                                             labels="ce" in losses)
        mask = loss_mask_of(losses)
        chunk = _head_chunk(rows, vocab, top_k, target=target, labels=labels is not None, losses=len(losses),
                            plane_losses=len(losses))
        kernels = {"draft_head_scan_kernel": minimum.head_scan(chunk),
                   "draft_head_merge_kernel": minimum.head_merge(chunk),
                   "draft_head_sweep_kernel[forward]": minimum.head_sweep_forward(chunk)}
        if target:
            kernels["draft_head_finish_kernel"] = minimum.head_finish(rows, chunk.segments, mask, True)
        return CaseRun(
            ours=lambda: gpu_driver.forward(hidden, weight, target_hidden, None, labels, mask, top_k, 1.0, 0.0,
                                            torch.float32, True, rows),
            reference=lambda: reference.draft_head(hidden, weight, target_hidden=target_hidden, labels=labels,
                                                   losses=losses, top_k=top_k),
            minimum=lambda _: minimum.Minimum(sum(kernels.values()), kernels), kernels=tuple(kernels))
    return make


def head_radix_case(vocab: int, top_k: int) -> Callable:
    """The serving form with K above the candidates' limit: the scan, the radix select (and a
    torch sort of its [R, K] picks), the merge."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head import gpu_driver

        hidden, weight, _, _ = _head_inputs(rows, vocab, 12, device, target=False)
        chunk = _head_chunk(rows, vocab, 0, target=False, labels=False, losses=0)
        merge = minimum.head_merge(minimum.HeadChunk(rows, vocab, chunk.segments, top_k, False, False, 0))
        kernels = {"draft_head_scan_kernel": minimum.head_scan(chunk),
                   "draft_head_topk_kernel": minimum.head_radix_topk(rows, vocab, top_k, 4),
                   "draft_head_merge_kernel": merge - chunk.segments * rows * 8 * top_k + rows * top_k * 8}
        return CaseRun(
            ours=lambda: gpu_driver.forward(hidden, weight, None, None, None, 0, top_k, 1.0, 0.0, torch.float32,
                                            False, rows),
            reference=lambda: torch.topk(hidden @ weight.t(), top_k, dim=-1),
            minimum=lambda _: minimum.Minimum(sum(kernels.values()), kernels), kernels=tuple(kernels))
    return make


def _head_backward_state(rows: int, vocab: int, device, weight_grad: bool):
    """The forward's saved tensors of a kl_div + ce call and upstream gradients."""
    from dflash2_kernels.head import gpu_driver

    hidden, weight, target_hidden, labels = _head_inputs(rows, vocab, 10, device, labels=True)
    mask = 0b10001
    out = gpu_driver.forward(hidden, weight, target_hidden, None, labels, mask, TOP_K, 1.0, 0.0, torch.float32,
                             not weight_grad, rows)
    g = _generator(11, device)
    grads = (torch.rand(2, rows, generator=g, device=device), torch.randn(rows, TOP_K, generator=g, device=device),
             torch.randn(rows, generator=g, device=device))
    saved = (hidden, weight, target_hidden, None, labels, out[1], out[11], out[3], out[12], out[13], out[14], mask,
             TOP_K, 1.0, 0.0, torch.float32)
    return grads, saved


def head_backward_case(vocab: int, weight_grad: bool) -> Callable:
    """The backward of a kl_div + ce call: from the kept dL/dh planes (a frozen lm_head: one
    launch), or the recompute of a trainable lm_head (the sweep's combined dL/ds a chunk)."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head import gpu_driver

        grads, saved = _head_backward_state(rows, vocab, device, weight_grad)
        if weight_grad:
            # dh and dW: the top-k and label gradients leave the plane for dh, join it for dW.
            chunk = _head_chunk(rows, vocab, TOP_K, target=True, labels=True, losses=2)
            kernels = {"draft_head_sweep_kernel[backward]": minimum.head_sweep_backward(chunk, sparse_out=True),
                       "draft_head_sparse_add_kernel": minimum.head_sparse_add(rows, TOP_K, 4, 4),
                       "draft_head_hidden_grad_kernel": minimum.head_hidden_grad(rows, HEAD_WIDTH, 0, TOP_K, 4, 4, 4)}
        else:
            kernels = {"draft_head_hidden_grad_kernel": minimum.head_hidden_grad(rows, HEAD_WIDTH, 2, TOP_K, 4, 4, 4)}
        return CaseRun(
            ours=lambda: gpu_driver.backward(*grads, *saved, True, weight_grad, rows),
            reference=lambda: None,
            minimum=lambda _: minimum.Minimum(sum(kernels.values()), kernels), kernels=tuple(kernels))
    return make


@contextlib.contextmanager
def _one_rank():
    """The vocab-parallel collectives of one rank alone: a gather of itself, a sum of itself."""
    from dflash2_kernels.head import shard_common

    gather, reduce = shard_common.all_gather_ranks, shard_common.all_reduce_sum
    shard_common.all_gather_ranks = lambda tensor, group: tensor.unsqueeze(0)
    shard_common.all_reduce_sum = lambda tensor, group: tensor
    try:
        yield
    finally:
        shard_common.all_gather_ranks, shard_common.all_reduce_sum = gather, reduce


def head_shard_case(vocab: int) -> Callable:
    """One rank's forward of the vocab-parallel head on the Triton kernels (a world of one:
    the collectives are the identity), kl_div + ce with kept planes: the scan, the pack, the
    merge, the sweep, then the shares, the final."""

    def make(rows: int, ops=None, device="cpu") -> CaseRun:
        from dflash2_kernels.head import shard_common, shard_gpu

        hidden, weight, target_hidden, labels = _head_inputs(rows, vocab, 13, device, labels=True)
        plan = shard_common.ShardPlan(None, 0, vocab, 0b10001, TOP_K, 1.0, 0.0, torch.float32, None, vocab)
        chunk = _head_chunk(rows, vocab, TOP_K, target=True, labels=True, losses=2, plane_losses=2)
        kernels = {
            "draft_head_scan_kernel": minimum.head_scan(chunk),
            "draft_head_shard_pack_kernel": minimum.head_shard_pack(rows, chunk.segments, TOP_K, True, 4, 1),
            "draft_head_shard_merge_kernel": minimum.head_shard_merge(rows, 1, TOP_K, TOP_K, True, True, 4),
            "draft_head_sweep_kernel[forward]": minimum.head_sweep_forward(chunk),
            "draft_head_shard_shares_kernel": minimum.head_shard_shares(rows, chunk.segments, TOP_K),
            "draft_head_shard_final_kernel": minimum.head_shard_final(rows, 2, TOP_K, 4, 4, True),
        }

        def ours():
            with _one_rank():
                return shard_gpu.forward(hidden, weight, target_hidden, None, labels, plan, (True, False, True))

        return CaseRun(ours=ours, reference=lambda: None,
                       minimum=lambda _: minimum.Minimum(sum(kernels.values()), kernels), kernels=tuple(kernels))
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
    Case("head forward kl_div fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k {TOP_K}, fp32",
         TRAIN_ROWS, (2, 4), head_forward_case(VOCAB, ("kl_div",), TOP_K)),
    Case("head forward ce fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k {TOP_K}, fp32",
         TRAIN_ROWS, (2, 4), head_forward_case(VOCAB, ("ce",), TOP_K)),
    Case("head backward kept planes fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k {TOP_K}",
         TRAIN_ROWS, (2, 4), head_backward_case(VOCAB, False)),
    Case("head backward recompute fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k {TOP_K}, fp32",
         TRAIN_ROWS, (2, 4), head_backward_case(VOCAB, True)),
    Case("head top-k radix fp32", "head_topk", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k 256, fp32",
         TRAIN_ROWS, (2, 4), head_radix_case(VOCAB, 256)),
    Case("head vocab-parallel shard fp32", "head", "interpreter", f"{TRAIN_ROWS} rows x V {VOCAB}, k {TOP_K}, fp32",
         TRAIN_ROWS, (2, 4), head_shard_case(VOCAB)),
)


def kernel_key(launch, expected: str) -> str:
    """``expected`` if the launch is that kernel (its name without template arguments)."""
    name = minimum.kernel_name(expected)
    if launch.name != name:
        raise AssertionError(f"expected a launch of {name}, got {launch.kernel}")
    return expected
