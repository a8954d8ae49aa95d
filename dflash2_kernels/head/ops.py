"""The draft head's custom ops (SPEC section 7): ``dflash2::draft_head`` and its backward
``dflash2::draft_head_backward``, with fake implementations and autograd.

Both walk the rows in chunks of ``tile_rows``: per chunk the logits s = h W^T [R, V]
(and the target's) go into one reused buffer in the compute dtype (gemm.py), the row
reduction (rows.py: C++ on the CPU, Triton on CUDA) turns each row into its losses,
statistics and candidates, and nothing of size [N, V] is ever held.

The gradient w.r.t. hidden: the losses are per row, so with a frozen ``weight`` (both
trainers) the forward asks the row kernel for dL_l/ds of each loss while the chunk is
at hand and keeps dL_l/dh = (dL_l/ds) W ([L, N, H]); the backward scales those rows by
the upstream gradients and adds the top-k and label logits' terms through the W rows
they came from: no logits are recomputed. Where ``weight`` needs a gradient (or the
forward kept no planes) the backward recomputes each chunk's logits, turns them into
dL/ds in place and accumulates dW (in the compute dtype, chunks in order: deterministic).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import gemm
from .checks import HEAD_FLOATS, IGNORE_INDEX, check_head_args, has_data, loss_count
from .grads import SparseLogits, grads_from_planes, recomputed_grads
from .rows import row_functions
from .tiles import chunk_planes


def _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows) -> None:
    check_head_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                    logits_dtype)
    if hidden.dim() != 2:
        raise ValueError(f"draft_head op: hidden must be [N, H] (the public function flattens), "
                         f"got shape {tuple(hidden.shape)}.")
    if not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive int, got {tile_rows!r}.")


def _output_shapes(hidden, weight, loss_mask, top_k, planes: bool):
    rows, width = hidden.shape
    losses = loss_count(loss_mask)
    return rows, width, losses, (losses, rows, width) if planes and losses else (0,)


@torch.library.custom_op("dflash2::draft_head", mutates_args=())
def draft_head_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_hidden: Optional[torch.Tensor],
    target_weight: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    loss_mask: int,
    top_k: int,
    logit_scale: float,
    softcap: float,
    logits_dtype: torch.dtype,
    hidden_grad_planes: bool,
    tile_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H] -> (losses [L, N] f32, topk_ids [N, K], topk_logits [N, K]
    logits_dtype, label_ids [N] (-1: none), label_logit [N] logits_dtype, draft_lse, target_lse
    [N] f32, draft_argmax, target_argmax [N], target_at_topk [N, K] f32, overlap [N] f32,
    topk_z [N, K] E, label_z [N] E, hidden_grads [L, N, H] E or [0]); softcap 0 = none, E the
    compute dtype, target-side results 0 without target_hidden."""
    _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows)
    forward_rows, _ = row_functions(hidden.device)
    rows, width, losses, planes_shape = _output_shapes(hidden, weight, loss_mask, top_k, hidden_grad_planes)
    vocab = weight.shape[0]
    dtype = gemm.compute_dtype(weight.dtype)
    chunk = min(rows, tile_rows)
    target_weight = weight if target_weight is None else target_weight
    make = dict(device=hidden.device)
    out_losses = torch.empty((losses, rows), dtype=torch.float32, **make)
    topk_ids = torch.empty((rows, top_k), dtype=torch.long, **make)
    topk_z = torch.empty((rows, top_k), dtype=dtype, **make)
    label_ids = torch.empty(rows, dtype=torch.long, **make)
    label_z = torch.empty(rows, dtype=dtype, **make)
    # Separate tensors, never views of one: a custom op's outputs may not alias each other.
    stats = [torch.empty(rows, dtype=torch.float32, **make) for _ in range(3)]  # draft_lse, target_lse, overlap
    argmaxes = [torch.empty(rows, dtype=torch.long, **make) for _ in range(2)]
    at_topk = torch.empty((rows, top_k), dtype=torch.float32, **make)
    hidden_grads = torch.empty(planes_shape, dtype=dtype, **make)
    logits = chunk_planes((chunk, vocab), dtype, hidden.device)
    target_logits = chunk_planes((chunk, vocab), dtype, hidden.device) if target_hidden is not None else None
    loss_planes = chunk_planes((losses, chunk, vocab), dtype, hidden.device) if hidden_grads.dim() == 3 else None
    for start in range(0, rows, max(chunk, 1)):
        stop = min(rows, start + chunk)
        count = stop - start
        s = logits[:count]
        gemm.project(s, hidden[start:stop].to(weight.dtype), weight)
        t = None
        if target_logits is not None:
            t = target_logits[:count]
            gemm.project(t, target_hidden[start:stop].to(target_weight.dtype), target_weight)
        planes = None if loss_planes is None else loss_planes[:, :count]
        part = forward_rows(s, t, None if labels is None else labels[start:stop], loss_mask, top_k, logit_scale,
                            softcap, logits_dtype, planes)
        out_losses[:, start:stop] = part.losses
        topk_ids[start:stop] = part.topk_ids
        topk_z[start:stop] = part.topk_z
        label_ids[start:stop] = part.label
        label_z[start:stop] = part.label_z
        for row, value in enumerate((part.draft_lse, part.target_lse, part.overlap)):
            stats[row][start:stop] = value
        argmaxes[0][start:stop] = part.draft_argmax
        argmaxes[1][start:stop] = part.target_argmax
        at_topk[start:stop] = part.target_at_topk
        for loss in range(losses if planes is not None else 0):
            gemm.hidden_grad(hidden_grads[loss, start:stop], planes[loss], weight)
    return (out_losses, topk_ids, topk_z.to(logits_dtype, copy=True), label_ids, label_z.to(logits_dtype, copy=True),
            stats[0], stats[1], argmaxes[0], argmaxes[1], at_topk, stats[2], topk_z, label_z, hidden_grads)


@draft_head_op.register_fake
def _(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype,
      hidden_grad_planes, tile_rows):
    _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows)
    rows, width, losses, planes_shape = _output_shapes(hidden, weight, loss_mask, top_k, hidden_grad_planes)
    dtype = gemm.compute_dtype(weight.dtype)
    f32, i64 = torch.float32, torch.long
    new = hidden.new_empty
    return (new((losses, rows), dtype=f32), new((rows, top_k), dtype=i64), new((rows, top_k), dtype=logits_dtype),
            new((rows,), dtype=i64), new((rows,), dtype=logits_dtype), new((rows,), dtype=f32),
            new((rows,), dtype=f32), new((rows,), dtype=i64), new((rows,), dtype=i64),
            new((rows, top_k), dtype=f32), new((rows,), dtype=f32), new((rows, top_k), dtype=dtype),
            new((rows,), dtype=dtype), new(planes_shape, dtype=dtype))


def _check_backward_args(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                         topk_ids, topk_z, label_ids, label_z, hidden_grads, loss_mask, top_k, logit_scale, softcap,
                         logits_dtype, tile_rows) -> None:
    _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows)
    rows, width = hidden.shape
    dtype = gemm.compute_dtype(weight.dtype)
    expected = {
        "grad_losses": (grad_losses, (loss_count(loss_mask), rows), None),
        "grad_topk": (grad_topk, (rows, top_k), None),
        "grad_label": (grad_label, (rows,), None),
        "topk_ids": (topk_ids, (rows, top_k), torch.long),
        "topk_z": (topk_z, (rows, top_k), dtype),
        "label_ids": (label_ids, (rows,), torch.long),
        "label_z": (label_z, (rows,), dtype),
    }
    for name, (tensor, shape, want) in expected.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}.")
        if want is not None and tensor.dtype != want:
            raise TypeError(f"{name} must be {want}, got {tensor.dtype}.")
        if want is None and tensor.dtype not in HEAD_FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {tensor.dtype}.")
        if tensor.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {tensor.device}.")
    vocab = weight.shape[0]
    if has_data(topk_ids) and topk_ids.numel() and bool(((topk_ids < 0) | (topk_ids >= vocab)).any()):
        raise IndexError(f"topk_ids holds ids outside [0, {vocab}).")
    if has_data(label_ids) and bool(((label_ids < -1) & (label_ids != IGNORE_INDEX) | (label_ids >= vocab)).any()):
        raise IndexError(f"label_ids holds ids outside [0, {vocab}) other than -100 (ignored) and -1 (none).")
    if hidden_grads.numel() and (tuple(hidden_grads.shape) != (loss_count(loss_mask), rows, width)
                                 or hidden_grads.dtype != dtype):
        raise ValueError(f"hidden_grads must be empty or {dtype} [{loss_count(loss_mask)}, {rows}, {width}], "
                         f"got {hidden_grads.dtype} {tuple(hidden_grads.shape)}.")


@torch.library.custom_op("dflash2::draft_head_backward", mutates_args=())
def draft_head_backward_op(
    grad_losses: torch.Tensor,
    grad_topk: torch.Tensor,
    grad_label: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_hidden: Optional[torch.Tensor],
    target_weight: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    topk_ids: torch.Tensor,
    topk_z: torch.Tensor,
    label_ids: torch.Tensor,
    label_z: torch.Tensor,
    hidden_grads: torch.Tensor,
    loss_mask: int,
    top_k: int,
    logit_scale: float,
    softcap: float,
    logits_dtype: torch.dtype,
    need_hidden: bool,
    need_weight: bool,
    tile_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden [N, H] in hidden's dtype, grad_weight [V, H] in weight's dtype), each
    empty ([0]) where not needed. grad_losses [L, N], grad_topk [N, K], grad_label [N] are
    the upstream gradients of the forward's losses, topk_logits and label_logit."""
    _check_backward_args(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                         topk_ids, topk_z, label_ids, label_z, hidden_grads, loss_mask, top_k, logit_scale, softcap,
                         logits_dtype, tile_rows)
    dtype = gemm.compute_dtype(weight.dtype)
    rows, width = hidden.shape
    no_hidden, no_weight = hidden.new_empty(0), weight.new_empty(0)  # distinct: outputs may not alias
    sparse = SparseLogits(grad_topk, grad_label, topk_ids, topk_z, label_ids, label_z, logit_scale, softcap)
    if need_weight or (need_hidden and not hidden_grads.numel() and loss_count(loss_mask)):
        _, backward_rows = row_functions(hidden.device)

        def rows_backward(start, stop, s, t, weights):
            backward_rows(s, t, None if labels is None else labels[start:stop], loss_mask, logit_scale, softcap,
                          logits_dtype, weights)

        grad_hidden, grad_weight = recomputed_grads(grad_losses, sparse, hidden, weight, target_hidden,
                                                    target_weight, rows_backward, need_hidden, need_weight,
                                                    tile_rows)
        return (grad_hidden.to(hidden.dtype) if need_hidden else no_hidden,
                grad_weight.to(weight.dtype) if need_weight else no_weight)
    if not need_hidden:
        return no_hidden, no_weight
    grad_hidden = grads_from_planes(grad_losses, hidden_grads, sparse, weight, (rows, width), dtype)
    return grad_hidden.to(hidden.dtype), no_weight


@draft_head_backward_op.register_fake
def _(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z,
      label_ids, label_z, hidden_grads, loss_mask, top_k, logit_scale, softcap, logits_dtype, need_hidden,
      need_weight, tile_rows):
    _check_backward_args(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                         topk_ids, topk_z, label_ids, label_z, hidden_grads, loss_mask, top_k, logit_scale, softcap,
                         logits_dtype, tile_rows)
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)))


def _setup_context(ctx, inputs, output) -> None:
    (hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype,
     _planes, tile_rows) = inputs
    topk_ids, label_ids, topk_z, label_z, hidden_grads = output[1], output[3], output[11], output[12], output[13]
    ctx.save_for_backward(hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z, label_ids, label_z,
                          hidden_grads)
    ctx.options = (loss_mask, top_k, logit_scale, softcap, logits_dtype, tile_rows)


def _backward(ctx, grad_losses, _ids, grad_topk, _labels, grad_label, *_rest):
    hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z, label_ids, label_z, hidden_grads = \
        ctx.saved_tensors
    loss_mask, top_k, logit_scale, softcap, logits_dtype, tile_rows = ctx.options
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError("draft_head does not differentiate target_hidden or target_weight (the verifier's side "
                           "is a fixed target): detach them.")
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    rows = hidden.shape[0]
    zeros = hidden.new_zeros
    grad_losses = zeros((loss_count(loss_mask), rows), dtype=torch.float32) if grad_losses is None else grad_losses
    grad_topk = zeros((rows, top_k), dtype=torch.float32) if grad_topk is None else grad_topk
    grad_label = zeros((rows,), dtype=torch.float32) if grad_label is None else grad_label
    grad_hidden, grad_weight = draft_head_backward_op(
        grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z,
        label_ids, label_z, hidden_grads, loss_mask, top_k, logit_scale, softcap, logits_dtype, need_hidden,
        need_weight, tile_rows)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None) + (None,) * 10


draft_head_op.register_autograd(_backward, setup_context=_setup_context)
