"""The draft head's GPU driver: ``dflash2::draft_head`` and its backward on CUDA, over the
Triton kernels (and on CPU tensors under ``DFLASH2_BACKEND=triton`` with Triton's
interpreter, where the tests run it).

Forward, per chunk of R rows (tiles.gpu_tile_rows sizes it by the device's memory):
  1-2. the GEMMs s = h W^T (and t) write the raw logits straight into the chunk's planes
       in the compute dtype E (gemm.project);
  3.   draft_head_scan_kernel: the first read of each row, in segments: the normalisers'
       partials, the argmaxes' and the top-k's candidates;
  4.   draft_head_merge_kernel: per row the lse, top-k, label and the few gathered logits,
       written at the call's rows of its outputs, and the ce loss;
  5.   draft_head_sweep_kernel: the second read: the soft losses' sums and, where the
       forward keeps hidden's gradient, dL/ds of kl_div and ce into per-loss planes in
       the weight's dtype P [R, L, V];
  6-7. only for rkl, jsd or tv gradients: the finish of the chunk's sums, then a read for
       their planes (their gradients subtract a row sum);
  8.   one GEMM for every loss's plane: dL_l/dh = (dL_l/ds) W into [N, L, H].
After the last chunk one finish kernel turns every row's sums into losses. No aten op
reads or writes a plane but the GEMMs, no value is read on the host, and the top-k above
64 (the radix select, topk_kernels.py, with a sort of its [R, K] picks) is the only
step that reads a row more than twice.

Backward with the planes kept (a frozen lm_head, both trainers): one launch,
draft_head_hidden_grad_kernel. Otherwise (a trainable lm_head, or too many losses to
keep planes) per vocabulary slice of all rows (:func:`recomputed_grads`): the logits again
(one GEMM a side), the sweep kernel's combined dS = sum_l g_l dL_l/ds into one P plane,
dh += dS W[slice], the top-k and label logits' gradients added into dS, dW[slice] =
dS^T h; those few gradients reach dh through their W rows (one launch at the end).
"""

from __future__ import annotations

import torch

from . import gemm
from .checks import SOFT_LOSS_MASK, loss_count
from .gpu_launch import (
    CE,
    JSD,
    KL,
    MAX_CANDIDATE_K,
    PARTIALS_WIDTH,
    RKL,
    ROW_STATS_WIDTH,
    SUMS_COLUMNS,
    TV,
    candidate_cap,
    candidate_ids_needed,
    plan_finish,
    plan_hidden_grad,
    plan_merge,
    plan_radix_topk,
    plan_scan,
    plan_sparse_add,
    plan_sweep,
    segments,
)
from .tiles import ROW_STATS, plane_dtype

assert ROW_STATS == ROW_STATS_WIDTH, "tiles.ROW_STATS and scan_kernels.ROW_STATS must agree"

ROW_SUM_GRADS = RKL | JSD | TV  # their gradients subtract a row sum: a read after the finish


def _slot(loss_mask: int, bit: int) -> int:
    """The row of loss ``bit`` in the [L, ...] tensors, -1 when not requested."""
    return bin(loss_mask & (bit - 1)).count("1") if loss_mask & bit else -1


def in_weight_dtype(tensor, weight):
    return tensor if tensor is None or tensor.dtype == weight.dtype else tensor.to(weight.dtype)


def outputs(rows: int, losses: int, top_k: int, width: int, dtype, logits_dtype, keep_planes: bool, device) -> dict:
    """The op's outputs, allocated once (each written by one kernel; none a view of another:
    a custom op's outputs may not alias)."""
    f32, f64, i64 = torch.float32, torch.float64, torch.long
    make = dict(device=device)
    return {
        "losses": torch.empty((losses, rows), dtype=f32, **make),
        "topk_ids": torch.empty((rows, top_k), dtype=i64, **make),
        "topk_logits": torch.empty((rows, top_k), dtype=logits_dtype, **make),
        "label_ids": torch.empty(rows, dtype=i64, **make),
        "label_logit": torch.empty(rows, dtype=logits_dtype, **make),
        "draft_lse": torch.empty(rows, dtype=f32, **make),
        "target_lse": torch.empty(rows, dtype=f32, **make),
        "draft_argmax": torch.empty(rows, dtype=i64, **make),
        "target_argmax": torch.empty(rows, dtype=i64, **make),
        "at_topk": torch.empty((rows, top_k), dtype=f32, **make),
        "overlap": torch.empty(rows, dtype=f32, **make),
        "topk_z": torch.empty((rows, top_k), dtype=dtype, **make),
        "label_z": torch.empty(rows, dtype=dtype, **make),
        "hidden_grads": torch.empty((rows, losses, width) if keep_planes and losses else (0,), dtype=dtype, **make),
        "row_stats": torch.empty((rows, ROW_STATS), dtype=f64, **make),
    }


OUTPUT_ORDER = ("losses", "topk_ids", "topk_logits", "label_ids", "label_logit", "draft_lse", "target_lse",
                "draft_argmax", "target_argmax", "at_topk", "overlap", "topk_z", "label_z", "hidden_grads",
                "row_stats")


def forward(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
            logits_dtype, keep_planes: bool, tile_rows: int):
    """The op's outputs (ops.draft_head_op's docstring), the module docstring's steps."""
    rows, width = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    dtype = gemm.compute_dtype(weight.dtype)
    planes_dtype = plane_dtype(weight.dtype)
    losses = loss_count(loss_mask)
    has_target = target_hidden is not None
    target_weight = weight if target_weight is None else target_weight
    keep = keep_planes and losses > 0
    out = outputs(rows, losses, top_k, width, dtype, logits_dtype, keep, device)
    if rows == 0:
        return tuple(out[name] for name in OUTPUT_ORDER)
    hidden = in_weight_dtype(hidden, weight)
    target_hidden = in_weight_dtype(target_hidden, target_weight)
    chunk = max(1, min(rows, tile_rows))
    n_segments = segments(vocab, dtype, softcap > 0)
    topk_mode = 0 if top_k == 0 else (1 if top_k <= MAX_CANDIDATE_K else 2)
    cap = candidate_cap(top_k)
    f64, i64 = torch.float64, torch.long
    logits = torch.empty((chunk, vocab), dtype=dtype, device=device)
    target_logits = torch.empty((chunk, vocab), dtype=dtype, device=device) if has_target else None
    partials = torch.empty((chunk, n_segments, PARTIALS_WIDTH), dtype=f64, device=device)
    best = torch.empty((chunk, n_segments, PARTIALS_WIDTH), dtype=i64, device=device)
    candidates = topk_mode == 1
    cand_keys = torch.empty((chunk, n_segments, cap), dtype=i64, device=device) if candidates else None
    cand_ids = torch.empty((chunk, n_segments, cap), dtype=i64, device=device) \
        if candidates and candidate_ids_needed(dtype, logits_dtype) else None
    cand_count = torch.empty((chunk, n_segments), dtype=torch.int32, device=device) if candidates else None
    planes = torch.empty((chunk, losses, vocab), dtype=planes_dtype, device=device) if keep else None
    sums = torch.empty((rows, n_segments, SUMS_COLUMNS), dtype=f64, device=device) if has_target else None
    first_planes = loss_mask & (KL | CE) if keep else 0
    later_planes = loss_mask & ROW_SUM_GRADS if keep else 0
    scalars = (logit_scale, softcap)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        count = stop - start
        s = logits[:count]
        t = None if target_logits is None else target_logits[:count]
        gemm.project(s, hidden[start:stop], weight)
        if t is not None:
            gemm.project(t, target_hidden[start:stop], target_weight)
        chunk_candidates = [None if b is None else b[:count] for b in (cand_keys, cand_ids, cand_count)]
        plan_scan(s, t, partials[:count], best[:count], *chunk_candidates, top_k, *scalars, logits_dtype,
                  candidates).run(s)
        given = None
        if topk_mode == 2:
            ids = torch.empty((count, top_k), dtype=i64, device=device)
            keys = torch.empty_like(ids)
            plan_radix_topk(s, top_k, ids, keys, *scalars, logits_dtype).run(s)
            # The picks come in id order: a stable sort by key keeps equal keys in it.
            given = ids.gather(1, torch.sort(keys, dim=1, descending=True, stable=True).indices)
        plan_merge(s, t, partials[:count], best[:count], *chunk_candidates, given, labels, out, start, top_k,
                   *scalars, logits_dtype, topk_mode, _slot(loss_mask, CE)).run(s)
        chunk_planes = None if planes is None else planes[:count]
        if has_target or first_planes:
            plan_sweep(s, t, out["row_stats"], out["label_ids"], sums, chunk_planes, start, loss_mask, *scalars,
                       grads=1 if first_planes else 0, plane_mask=first_planes).run(s)
        if later_planes:
            plan_finish(sums, out["label_ids"], out["losses"], out["overlap"], out["row_stats"], start, count,
                        loss_mask, has_target).run(s)
            plan_sweep(s, t, out["row_stats"], out["label_ids"], None, chunk_planes, start, loss_mask, *scalars,
                       grads=1, plane_mask=later_planes).run(s)
        if keep:
            gemm.hidden_grad(out["hidden_grads"][start:stop].view(count * losses, width),
                             chunk_planes.view(count * losses, vocab), weight)
    if has_target and not later_planes:
        plan_finish(sums, out["label_ids"], out["losses"], out["overlap"], out["row_stats"], 0, rows, loss_mask,
                    has_target).run(logits)
    return tuple(out[name] for name in OUTPUT_ORDER)


def backward(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels, topk_ids,
             topk_z, label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale, softcap,
             logits_dtype, need_hidden: bool, need_weight: bool, tile_rows: int):
    """(grad_hidden [N, H] in hidden's dtype or None, grad_weight [V, H] in weight's dtype
    or None): the module docstring's backward; absent upstream gradients are None."""
    rows, width = hidden.shape
    losses = loss_count(loss_mask)
    # The kernels index these by row (our forward's outputs are; a raw call's may not be).
    topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats = (
        t.contiguous() for t in (topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats))
    if not need_weight and (hidden_grads.numel() or not losses):
        if not need_hidden:
            return None, None
        grad_hidden = torch.empty((rows, width), dtype=hidden.dtype, device=hidden.device)
        if rows:
            plan_hidden_grad(grad_hidden, hidden_grads if hidden_grads.numel() else None, grad_losses, weight,
                             topk_ids, topk_z, grad_topk, label_ids, label_z, grad_label, logit_scale,
                             softcap).run(grad_hidden)
        return grad_hidden, None
    grad_hidden, grad_weight = recomputed_grads(
        grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, topk_ids, label_ids,
        row_stats, loss_mask, logit_scale, softcap, need_hidden, need_weight,
        slice_columns(rows, weight.shape[0], tile_rows))
    return None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight


def recomputed_grads(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, topk_ids,
                     label_ids, row_stats, loss_mask, logit_scale, softcap, need_hidden, need_weight, columns: int,
                     vocab_start: int = 0, shard: bool = False):
    """(dh [N, H] in the compute dtype or None, dW [V_local, H] in weight's dtype or None), by the logits
    recomputed a vocabulary slice of ``columns`` at a time over all N rows: per slice
    s = h W[slice]^T (and t), the sweep's combined dS [N, C] against the forward's row
    statistics (ids global: vocab_start + the slice's start), dh += dS W[slice], the top-k
    and label logits' gradients added into dS, dW[slice] = dS^T h written in place; then
    those sparse gradients added to dh through their W rows (``shard``: a vocab-parallel
    shard's rows, ids global).
    Slicing the vocabulary, not the rows, keeps each GEMM's rows
    at N and reads and writes each row of dW once (a row chunk's dW += would read and write
    all of [V, H] in fp32 per chunk)."""
    rows, width = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    dtype = gemm.compute_dtype(weight.dtype)
    soft = bool(loss_mask & SOFT_LOSS_MASK)
    target_weight = weight if target_weight is None else target_weight
    empty = not rows or not vocab  # then nothing writes them
    grad_hidden = (torch.zeros if empty else torch.empty)((rows, width), dtype=dtype, device=device) \
        if need_hidden else None
    # dW in the weight's dtype: one GEMM writes each slice once, rounding once (no fp32 [V, H]).
    grad_weight = (torch.zeros if empty else torch.empty)((vocab, width), dtype=weight.dtype, device=device) \
        if need_weight else None
    if empty:
        return grad_hidden, grad_weight
    columns = max(1, min(vocab, columns))
    hidden = in_weight_dtype(hidden, weight)
    target_hidden = in_weight_dtype(target_hidden, target_weight) if soft else None
    # Flat buffers: the last slice's narrower planes are contiguous views of their front.
    logits = torch.empty(rows * columns, dtype=dtype, device=device)
    target_logits = torch.empty(rows * columns, dtype=dtype, device=device) if soft else None
    grad_logits = torch.empty(rows * columns, dtype=plane_dtype(weight.dtype), device=device)
    sparse_ids = topk_ids if topk_ids.shape[1] and grad_topk is not None else None
    top_k = topk_ids.shape[1]
    # dh takes the top-k and label gradients through their W rows, not through the
    # product over V (whose fp32 sums would round those large entries at every step).
    sparse = None
    if need_hidden and (sparse_ids is not None or grad_label is not None):
        sparse = torch.zeros((rows, top_k + 1), dtype=dtype, device=device)
    for start in range(0, vocab, columns):
        stop = min(vocab, start + columns)
        plane = (rows, stop - start)
        s = logits[:rows * (stop - start)].view(plane)
        t = None if target_logits is None else target_logits[:rows * (stop - start)].view(plane)
        dS = grad_logits[:rows * (stop - start)].view(plane)
        gemm.project(s, hidden, weight[start:stop])
        if t is not None:
            gemm.project(t, target_hidden, target_weight[start:stop])
        plan_sweep(s, t, row_stats, label_ids, None, dS, 0, loss_mask, logit_scale, softcap, grads=2,
                   vocab_start=vocab_start + start, grad_losses=grad_losses, topk_ids=sparse_ids,
                   grad_topk=grad_topk if sparse_ids is not None else None, grad_label=grad_label,
                   sparse=sparse).run(s)
        if need_hidden:
            gemm.hidden_grad(grad_hidden, dS, weight[start:stop], accumulate=start > 0)
        if need_weight:
            if sparse is not None:
                plan_sparse_add(dS, sparse, topk_ids, label_ids, vocab_start + start, sparse_ids is not None,
                                grad_label is not None).run(dS)
            gemm.accumulate_weight_grad(grad_weight[start:stop], dS, hidden, accumulate=False)
    if sparse is not None:
        plan_hidden_grad(grad_hidden, None, None, weight, topk_ids, sparse[:, :top_k],
                         sparse[:, :top_k] if sparse_ids is not None else None, label_ids,
                         sparse[:, top_k], sparse[:, top_k] if grad_label is not None else None,
                         logit_scale, softcap, vocab_start=vocab_start, shard=shard,
                         sloped=False, accumulate=True).run(grad_hidden)
    return grad_hidden, grad_weight


def slice_columns(rows: int, vocab: int, tile_rows: int) -> int:
    """The backward's vocabulary slice for the forward's chunk budget (tile_rows x V entries
    a plane), cut to a multiple of 128 (cuBLAS's tiles) when wider."""
    columns = max(1, tile_rows * vocab // max(rows, 1))
    if columns >= vocab:
        return vocab
    return columns - columns % 128 if columns >= 128 else columns
