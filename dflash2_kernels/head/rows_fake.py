"""Fake (meta) implementations of the C++ row ops ``dflash2::draft_head_rows_cpu`` and
``dflash2::draft_head_rows_backward_cpu`` (csrc/head_cpu.cpp), with the checks the
kernels make on shapes and dtypes (values, such as label ranges, need data)."""

from __future__ import annotations

import torch

from .._extension import EXTENSION_LOADED
from .checks import CE_MASK, HEAD_FLOATS, LOSS_ORDER, SOFT_LOSS_MASK, loss_count


def _check_rows(op, logits, target_logits, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, **more):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a tensor, got {type(logits).__name__}.")
    if logits.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: logits must be float32 or float64, got {logits.dtype}.")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"{op}: logits must be [rows, vocab] with vocab >= 1, got shape {tuple(logits.shape)}.")
    rows, vocab = logits.shape
    tensors = {"logits": logits}
    if target_logits is not None:
        if target_logits.dtype != logits.dtype or tuple(target_logits.shape) != (rows, vocab):
            raise ValueError(f"{op}: target_logits must be {logits.dtype} [{rows}, {vocab}], got "
                             f"{target_logits.dtype} {tuple(target_logits.shape)}.")
        tensors["target_logits"] = target_logits
    if labels is not None:
        if labels.dtype != torch.int64 or tuple(labels.shape) != (rows,):
            raise ValueError(f"{op}: labels must be int64 [{rows}], got {labels.dtype} {tuple(labels.shape)}.")
        tensors["labels"] = labels
    tensors.update({name: tensor for name, tensor in more.items() if tensor is not None})
    if len({t.device for t in tensors.values()}) > 1:
        listed = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {listed}.")
    if not 0 <= loss_mask < 1 << len(LOSS_ORDER):
        raise ValueError(f"{op}: loss_mask must be in [0, {(1 << len(LOSS_ORDER)) - 1}], got {loss_mask}.")
    if loss_mask & SOFT_LOSS_MASK and target_logits is None:
        raise ValueError(f"{op}: loss_mask asks for a soft loss, which needs target_logits.")
    if loss_mask & CE_MASK and target_logits is None and labels is None:
        raise ValueError(f"{op}: loss_mask asks for ce, which needs labels or target_logits.")
    if not 0 <= top_k <= vocab:
        raise ValueError(f"{op}: top_k must be in [0, {vocab}], got {top_k}.")
    if logit_scale == 0 or logit_scale != logit_scale or abs(logit_scale) == float("inf"):
        raise ValueError(f"{op}: logit_scale must be finite and nonzero, got {logit_scale}.")
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"{op}: softcap must be finite and >= 0 (0: none), got {softcap}.")
    if logits_dtype not in HEAD_FLOATS:
        raise TypeError(f"{op}: logits_dtype must be a float dtype, got {logits_dtype}.")
    return rows, vocab, loss_count(loss_mask)


if EXTENSION_LOADED:

    @torch.library.register_fake("dflash2::draft_head_rows_cpu")
    def _(logits, target_logits, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, loss_grads):
        op = "draft_head_rows_cpu"
        rows, vocab, losses = _check_rows(op, logits, target_logits, labels, loss_mask, top_k, logit_scale, softcap,
                                          logits_dtype, loss_grads=loss_grads)
        if loss_grads is not None and (loss_grads.dtype != logits.dtype
                                       or tuple(loss_grads.shape) != (losses, rows, vocab)):
            raise ValueError(f"{op}: loss_grads must be {logits.dtype} [{losses}, {rows}, {vocab}], got "
                             f"{loss_grads.dtype} {tuple(loss_grads.shape)}.")
        new = logits.new_empty
        return (new((losses, rows)), new((rows, 3)), new((rows, 2), dtype=torch.long),
                new((rows, top_k), dtype=torch.long), new((rows, top_k)), new((rows, top_k)), new((rows,)))

    @torch.library.register_fake("dflash2::draft_head_rows_backward_cpu")
    def _(logits, target_logits, labels, loss_mask, logit_scale, softcap, logits_dtype, grad_losses):
        op = "draft_head_rows_backward_cpu"
        if not isinstance(grad_losses, torch.Tensor):
            raise TypeError(f"{op}: grad_losses must be a tensor, got {type(grad_losses).__name__}.")
        rows, vocab, losses = _check_rows(op, logits, target_logits, labels, loss_mask, 0, logit_scale, softcap,
                                          logits_dtype, grad_losses=grad_losses)
        if grad_losses.dtype != logits.dtype or tuple(grad_losses.shape) != (losses, rows):
            raise ValueError(f"{op}: grad_losses must be {logits.dtype} [{losses}, {rows}], got "
                             f"{grad_losses.dtype} {tuple(grad_losses.shape)}.")

    @torch.library.register_fake("dflash2::draft_head_shard_stats_cpu")
    def _(logits, target_logits, top_k, logit_scale, softcap, logits_dtype):
        rows, vocab, _ = _check_rows("draft_head_shard_stats_cpu", logits, target_logits, None, 0, top_k,
                                     logit_scale, softcap, logits_dtype)
        new = logits.new_empty
        return (new((rows, 3), dtype=torch.float64), new((rows, top_k), dtype=torch.long),
                new((rows, top_k), dtype=torch.float64), new((rows,), dtype=torch.long))

    @torch.library.register_fake("dflash2::draft_head_shard_rows_cpu")
    def _(logits, target_logits, labels, loss_mask, logit_scale, softcap, row_stats, transform, shares, loss_grads,
          grad_losses):
        op = "draft_head_shard_rows_cpu"
        for name, tensor in (("labels", labels), ("row_stats", row_stats)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}.")
        rows, vocab, losses = _check_rows(op, logits, target_logits, labels, loss_mask, 0, logit_scale, softcap,
                                          logits.dtype, row_stats=row_stats, loss_grads=loss_grads,
                                          grad_losses=grad_losses)
        if row_stats.dtype != torch.float64 or tuple(row_stats.shape) != (rows, 7):
            raise ValueError(f"{op}: row_stats must be float64 [{rows}, 7], got {row_stats.dtype} "
                             f"{tuple(row_stats.shape)}.")
        if loss_grads is not None and grad_losses is not None:
            raise ValueError(f"{op}: loss_grads (forward) and grad_losses (backward) exclude each other: pass one.")
        if loss_grads is not None and (loss_grads.dtype != logits.dtype
                                       or tuple(loss_grads.shape) != (losses, rows, vocab)):
            raise ValueError(f"{op}: loss_grads must be {logits.dtype} [{losses}, {rows}, {vocab}], got "
                             f"{loss_grads.dtype} {tuple(loss_grads.shape)}.")
        if grad_losses is not None and (grad_losses.dtype != logits.dtype
                                        or tuple(grad_losses.shape) != (losses, rows)):
            raise ValueError(f"{op}: grad_losses must be {logits.dtype} [{losses}, {rows}], got "
                             f"{grad_losses.dtype} {tuple(grad_losses.shape)}.")
        return logits.new_empty((rows if shares else 0, 6), dtype=torch.float64)
