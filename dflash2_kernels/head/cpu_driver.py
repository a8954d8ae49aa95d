"""The draft head's CPU driver: the chunk loop of ``dflash2::draft_head`` and its backward
over the C++ row kernels (csrc/head_cpu.cpp through rows.py).

Per chunk the logits s = h W^T [R, V] (and the target's) go into one reused buffer in the
compute dtype E (gemm.py); the row kernel turns each row into its losses, statistics and
candidates in place (and dL_l/ds planes where the forward keeps hidden's gradient), and
the results are copied into the call's outputs. The backward either scales the kept
dL_l/dh planes (grads.grads_from_planes) or recomputes each chunk's logits and turns them
into dL/ds in place (grads.recomputed_grads). The GPU driver (gpu_driver.py) computes the
same outputs with another shape of loop.
"""

from __future__ import annotations

import torch

from .._extension import has_kernel
from . import gemm
from .checks import loss_count
from .grads import SparseLogits, grads_from_planes, recomputed_grads
from .rows import rows_backward_cpu, rows_forward_cpu
from .tiles import ROW_STATS, chunk_planes


def forward(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
            logits_dtype, keep_planes: bool, tile_rows: int):
    """The op's outputs (ops.draft_head_op's docstring) on CPU tensors."""
    if not has_kernel("draft_head_rows_cpu", "cpu"):
        raise RuntimeError("dflash2::draft_head has no kernel for cpu tensors in this build (the C++ extension is not "
                           "built there).")
    rows, width = hidden.shape
    losses = loss_count(loss_mask)
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
    hidden_grads = torch.empty((rows, losses, width) if keep_planes and losses else (0,), dtype=dtype, **make)
    row_stats = torch.zeros((rows, ROW_STATS), dtype=torch.float64, **make)
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
        part = rows_forward_cpu(s, t, None if labels is None else labels[start:stop], loss_mask, top_k, logit_scale,
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
        row_stats[start:stop, 0] = part.draft_lse
        row_stats[start:stop, 1] = part.target_lse
        for loss in range(losses if planes is not None else 0):
            gemm.hidden_grad(hidden_grads[start:stop, loss], planes[loss], weight)
    return (out_losses, topk_ids, topk_z.to(logits_dtype, copy=True), label_ids, label_z.to(logits_dtype, copy=True),
            stats[0], stats[1], argmaxes[0], argmaxes[1], at_topk, stats[2], topk_z, label_z, hidden_grads, row_stats)


def backward(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids,
             topk_z, label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale, softcap,
             logits_dtype, need_hidden: bool, need_weight: bool, tile_rows: int):
    """(grad_hidden [N, H] in hidden's dtype or None, grad_weight [V, H] in weight's dtype
    or None) on CPU tensors; absent upstream gradients (None) are zeros."""
    dtype = gemm.compute_dtype(weight.dtype)
    rows, width = hidden.shape
    zeros = hidden.new_zeros
    grad_losses = zeros((loss_count(loss_mask), rows), dtype=torch.float32) if grad_losses is None else grad_losses
    grad_topk = zeros((rows, top_k), dtype=torch.float32) if grad_topk is None else grad_topk
    grad_label = zeros((rows,), dtype=torch.float32) if grad_label is None else grad_label
    sparse = SparseLogits(grad_topk, grad_label, topk_ids, topk_z, label_ids, label_z, logit_scale, softcap)
    if need_weight or (need_hidden and not hidden_grads.numel() and loss_count(loss_mask)):
        def rows_backward(start, stop, s, t, weights):
            rows_backward_cpu(s, t, None if labels is None else labels[start:stop], loss_mask, logit_scale, softcap,
                              logits_dtype, weights)

        grad_hidden, grad_weight = recomputed_grads(grad_losses, sparse, hidden, weight, target_hidden,
                                                    target_weight, rows_backward, need_hidden, need_weight,
                                                    tile_rows)
        return (grad_hidden.to(hidden.dtype) if need_hidden else None,
                grad_weight.to(weight.dtype) if need_weight else None)
    if not need_hidden:
        return None, None
    grad_hidden = grads_from_planes(grad_losses, hidden_grads, sparse, weight, (rows, width), dtype)
    return grad_hidden.to(hidden.dtype), None
