"""The draft head's custom ops (SPEC section 7): ``dflash2::draft_head`` and its backward
``dflash2::draft_head_backward``, with fake implementations and autograd: the one place
defining them.

Both walk the rows in chunks of ``tile_rows`` and never hold [N, V]. Each device has its
own driver behind the same two functions, chosen once per call: cpu_driver.py (the C++
row kernels, one chunk loop shared with the vocab-parallel CPU path's helpers) and
gpu_driver.py (the Triton kernels, on CUDA tensors or on CPU tensors under
``DFLASH2_BACKEND=triton`` with Triton's interpreter).

The gradient w.r.t. hidden: the losses are per row, so with a frozen ``weight`` (both
trainers) the forward forms dL_l/ds of each loss while the chunk is at hand and keeps
dL_l/dh = (dL_l/ds) W ([N, L, H]); the backward scales those rows by the upstream
gradients and adds the top-k and label logits' terms through the W rows they came from:
no logits are recomputed. Where ``weight`` needs a gradient (or the forward kept no
planes) the backward recomputes each chunk's logits, turns them into dL/ds and
accumulates dW in the compute dtype, chunks in order (deterministic).
"""

from __future__ import annotations

from typing import Optional

import torch

from .checks import HEAD_FLOATS, IGNORE_INDEX, check_head_args, has_data, loss_count
from .gemm import compute_dtype
from .rows import triton_wanted
from .tiles import ROW_STATS


def driver_for(device: torch.device):
    """The module whose ``forward`` / ``backward`` run the op on ``device``'s tensors."""
    if triton_wanted(device):
        from . import gpu_driver

        return gpu_driver
    from . import cpu_driver

    return cpu_driver


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
    return rows, width, losses, (rows, losses, width) if planes and losses else (0,)


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
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """hidden [N, H], weight [V, H] -> (losses [L, N] f32, topk_ids [N, K], topk_logits [N, K]
    logits_dtype, label_ids [N] (-1: none), label_logit [N] logits_dtype, draft_lse, target_lse
    [N] f32, draft_argmax, target_argmax [N], target_at_topk [N, K] f32, overlap [N] f32,
    topk_z [N, K] E, label_z [N] E, hidden_grads [N, L, H] E or [0], row_stats [N, 5] f64);
    softcap 0 = none, E the compute dtype, target-side results 0 without target_hidden.
    row_stats: lse(z), lse(t) and the row sums the gradients of rkl, jsd, tv subtract (the
    GPU driver's backward reads them; the CPU driver recomputes its rows and leaves the sums 0)."""
    _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows)
    return driver_for(hidden.device).forward(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k,
                                             logit_scale, softcap, logits_dtype, hidden_grad_planes, tile_rows)


@draft_head_op.register_fake
def _(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype,
      hidden_grad_planes, tile_rows):
    _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows)
    rows, width, losses, planes_shape = _output_shapes(hidden, weight, loss_mask, top_k, hidden_grad_planes)
    dtype = compute_dtype(weight.dtype)
    f32, f64, i64 = torch.float32, torch.float64, torch.long
    new = hidden.new_empty
    return (new((losses, rows), dtype=f32), new((rows, top_k), dtype=i64), new((rows, top_k), dtype=logits_dtype),
            new((rows,), dtype=i64), new((rows,), dtype=logits_dtype), new((rows,), dtype=f32),
            new((rows,), dtype=f32), new((rows,), dtype=i64), new((rows,), dtype=i64),
            new((rows, top_k), dtype=f32), new((rows,), dtype=f32), new((rows, top_k), dtype=dtype),
            new((rows,), dtype=dtype), new(planes_shape, dtype=dtype), new((rows, ROW_STATS), dtype=f64))


def _check_backward_args(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                         topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale,
                         softcap, logits_dtype, tile_rows) -> None:
    _check_op_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                   logits_dtype, tile_rows)
    rows, width = hidden.shape
    dtype = compute_dtype(weight.dtype)
    expected = {
        "grad_losses": (grad_losses, (loss_count(loss_mask), rows), None),
        "grad_topk": (grad_topk, (rows, top_k), None),
        "grad_label": (grad_label, (rows,), None),
        "topk_ids": (topk_ids, (rows, top_k), torch.long),
        "topk_z": (topk_z, (rows, top_k), dtype),
        "label_ids": (label_ids, (rows,), torch.long),
        "label_z": (label_z, (rows,), dtype),
        "row_stats": (row_stats, (rows, ROW_STATS), torch.float64),
    }
    for name, (tensor, shape, want) in expected.items():
        if tensor is None and name.startswith("grad_"):
            continue  # an output nothing differentiated: no gradient
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
    # Values are read where that costs no device sync (CPU tensors); on a GPU the kernels
    # read nothing outside W for a bad id, and make that row's gradient NaN instead.
    if topk_ids.device.type == "cpu" and has_data(topk_ids):
        if topk_ids.numel() and bool(((topk_ids < 0) | (topk_ids >= vocab)).any()):
            raise IndexError(f"topk_ids holds ids outside [0, {vocab}).")
        if bool(((label_ids < -1) & (label_ids != IGNORE_INDEX) | (label_ids >= vocab)).any()):
            raise IndexError(f"label_ids holds ids outside [0, {vocab}) other than -100 (ignored) and -1 (none).")
    if hidden_grads.numel() and (tuple(hidden_grads.shape) != (rows, loss_count(loss_mask), width)
                                 or hidden_grads.dtype != dtype):
        raise ValueError(f"hidden_grads must be empty or {dtype} [{rows}, {loss_count(loss_mask)}, {width}], "
                         f"got {hidden_grads.dtype} {tuple(hidden_grads.shape)}.")


@torch.library.custom_op("dflash2::draft_head_backward", mutates_args=())
def draft_head_backward_op(
    grad_losses: Optional[torch.Tensor],
    grad_topk: Optional[torch.Tensor],
    grad_label: Optional[torch.Tensor],
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
    row_stats: torch.Tensor,
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
    the upstream gradients of the forward's losses, topk_logits and label_logit (None: 0)."""
    _check_backward_args(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                         topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale,
                         softcap, logits_dtype, tile_rows)
    grad_hidden, grad_weight = driver_for(hidden.device).backward(
        grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z,
        label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale, softcap, logits_dtype,
        need_hidden, need_weight, tile_rows)
    # Distinct empties where not needed: a custom op's outputs may not alias.
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden,
            weight.new_empty(0) if grad_weight is None else grad_weight)


@draft_head_backward_op.register_fake
def _(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z,
      label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale, softcap, logits_dtype, need_hidden,
      need_weight, tile_rows):
    _check_backward_args(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                         topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale,
                         softcap, logits_dtype, tile_rows)
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)))


def _setup_context(ctx, inputs, output) -> None:
    (hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype,
     _planes, tile_rows) = inputs
    topk_ids, label_ids, topk_z, label_z, hidden_grads, row_stats = (output[1], output[3], output[11], output[12],
                                                                     output[13], output[14])
    ctx.save_for_backward(hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z, label_ids, label_z,
                          hidden_grads, row_stats)
    ctx.options = (loss_mask, top_k, logit_scale, softcap, logits_dtype, tile_rows)
    # Only losses, topk_logits and label_logit carry gradients; an unused one arrives as None
    # rather than as a zero-filled tensor (a launch each, 84 MB for dL/dh at 4096 x 5120).
    ctx.mark_non_differentiable(*output[5:])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_losses, _ids, grad_topk, _labels, grad_label, *_rest):
    (hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z, label_ids, label_z, hidden_grads,
     row_stats) = ctx.saved_tensors
    loss_mask, top_k, logit_scale, softcap, logits_dtype, tile_rows = ctx.options
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError("draft_head does not differentiate target_hidden or target_weight (the verifier's side "
                           "is a fixed target): detach them.")
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_hidden, grad_weight = draft_head_backward_op(
        grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z,
        label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale, softcap, logits_dtype,
        need_hidden, need_weight, tile_rows)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None) + (None,) * 10


draft_head_op.register_autograd(_backward, setup_context=_setup_context)
