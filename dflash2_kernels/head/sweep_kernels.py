"""Triton kernels of the draft head's second read of each chunk, and of the row sums it
leaves (SPEC section 7). Kernels only.

``draft_head_sweep_kernel``: one program per (row, segment of SEG entries) of a chunk of
raw logits s [R, V] (and t), against the row's normalisers (scan_kernels' row
statistics). It transforms what it reads and, as asked:
  - SUMS: the segment's shares of the soft losses' sums and of sum min(p, q), fp64
    [N, S, 6] (kl, rkl, jsd, overlap, jsd_q, tv_q; the last two are the sums the
    gradients of jsd and tv subtract), for ``draft_head_finish_kernel``;
  - GRADS 1: dL_l/ds of the losses of PLANE_MASK into per-loss planes [R, L, V] in the
    planes' dtype P (the weight's, for the dh GEMM): kl_div and ce need nothing but the
    normalisers, so they come in the same read as the sums; rkl, jsd and tv subtract a
    row sum and take a read of their own after the finish (row statistics);
  - GRADS 2: the backward's combined sum_l g_l dL_l/ds into one P plane [R, V] (for dh
    and dW), the top-k and label logits' own gradients at their entries added in, or
    (SPARSE_OUT) written as dL/ds to [N, K + 1] instead: dh then takes them through their
    W rows (backward_kernels.py) rather than through a product over V, whose fp32 sums
    would round those large entries at every step of V, and
    ``draft_head_sparse_add_kernel`` adds them to the plane after the dh product, for dW.
Ignored rows (label -100) get 0 for every loss term (where(), not a product: their terms
may be NaN); the top-k and label logits are outputs on every row, so their gradients are
not masked.

``draft_head_finish_kernel``: one program per row: the segments' fp64 shares summed in a
fixed order into the losses, the overlap and the row sums a later pass needs.
Vocab parallel (head/shard_gpu.py): the same kernels over one rank's shard, ids global
through ``vocab_start``.
"""

import triton
import triton.language as tl

from .kernel_math import (
    IGNORE_INDEX,
    exp_in,
    loss_slope,
    mixture_logs,
    scalar_as,
    slope_of_s,
    soft_entries,
    stored_as,
    transformed,
    tv_slope,
    weighted,
)
from .scan_kernels import ROW_STATS, STAT_DRAFT_LSE, STAT_JSD_Q, STAT_RKL, STAT_TARGET_LSE, STAT_TV_Q

# Columns of the per-segment sums, fp64 [N, S, SUMS_WIDTH].
SUM_KL = tl.constexpr(0)
SUM_RKL = tl.constexpr(1)
SUM_JSD = tl.constexpr(2)
SUM_OVERLAP = tl.constexpr(3)
SUM_JSD_Q = tl.constexpr(4)
SUM_TV_Q = tl.constexpr(5)
SUMS_WIDTH = tl.constexpr(6)


@triton.jit
def loss_slot(LOSS_MASK: tl.constexpr, LOSS: tl.constexpr):
    """A requested loss's row in the [L, ...] tensors: how many requested losses precede it."""
    below: tl.constexpr = LOSS_MASK & ((1 << LOSS) - 1)
    return (below & 1) + ((below >> 1) & 1) + ((below >> 2) & 1) + ((below >> 3) & 1)


@triton.jit
def _segment_sum(values, in_row):
    return tl.sum(tl.where(in_row, values, 0.0), axis=0).to(tl.float64)


@triton.jit
def _plane_store(planes_ptr, slot, stride_plane_loss, offsets, in_row, value):
    tl.store(planes_ptr + slot * stride_plane_loss + offsets, stored_as(value, planes_ptr.dtype.element_ty),
             mask=in_row)


@triton.jit
def draft_head_sweep_kernel(
    logits_ptr,  # [R, V] raw s (E) at stride_logits_row
    target_ptr,  # [R, V] raw t (HAS_TARGET)
    row_stats_ptr,  # fp64 [N, ROW_STATS]: lse(z), lse(t), and the finished rkl, jsd_q, tv_q sums
    label_ids_ptr,  # int64 [N]: global label, -100 ignored, -1 none
    sums_ptr,  # fp64 [N, S, SUMS_WIDTH] (SUMS)
    planes_ptr,  # P: GRADS 1 [R, L, V] at (stride_plane_row, stride_plane_loss, 1); GRADS 2 [R, V]
    grad_losses_ptr,  # [L, N] at (stride_gl_loss, stride_gl_row) (GRADS 2 with HAS_GRAD_LOSSES)
    topk_ids_ptr,  # int64 [N, K] global (GRADS 2 with HAS_GRAD_TOPK)
    grad_topk_ptr,  # [N, K] at (stride_gt_row, stride_gt_col) (GRADS 2 with HAS_GRAD_TOPK)
    grad_label_ptr,  # [N] at stride_glabel (GRADS 2 with HAS_GRAD_LABEL)
    sparse_ptr,  # E [N, K + 1], zeros in (SPARSE_OUT): the top-k and label logits' dL/ds
    row_start,
    n_segments,
    vocab,  # this plane's V (a shard's V_local)
    vocab_start,  # the global id of entry 0 (0 but for a vocab-parallel shard)
    top_k,
    stride_logits_row,
    stride_target_row,
    stride_plane_row,
    stride_plane_loss,
    stride_gl_loss,
    stride_gl_row,
    stride_gt_row,
    stride_gt_col,
    stride_glabel,
    logit_scale: tl.float64,
    softcap: tl.float64,
    inv_softcap: tl.float64,
    LOSS_MASK: tl.constexpr,  # the requested losses (their slots in planes and grad_losses)
    HAS_TARGET: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SUMS: tl.constexpr,
    GRADS: tl.constexpr,  # 0 none, 1 planes, 2 combined
    PLANE_MASK: tl.constexpr,  # GRADS 1: the losses whose planes this pass writes
    HAS_GRAD_LOSSES: tl.constexpr,
    HAS_GRAD_TOPK: tl.constexpr,
    HAS_GRAD_LABEL: tl.constexpr,
    SPARSE_OUT: tl.constexpr,  # GRADS 2: the top-k and label gradients to sparse_ptr, not the plane
    SEG: tl.constexpr,
):
    """One program per (row, segment): the module docstring's second read."""
    E: tl.constexpr = logits_ptr.dtype.element_ty
    KL: tl.constexpr = (LOSS_MASK & 1) != 0
    RKL: tl.constexpr = (LOSS_MASK & 2) != 0
    JSD: tl.constexpr = (LOSS_MASK & 4) != 0
    TV: tl.constexpr = (LOSS_MASK & 8) != 0
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_segments
    seg = pid % n_segments
    n = row_start + row
    offsets = seg * SEG + tl.arange(0, SEG)
    in_row = offsets < vocab
    stats = row_stats_ptr + n * ROW_STATS
    draft_lse = tl.load(stats + STAT_DRAFT_LSE)
    target_lse = tl.load(stats + STAT_TARGET_LSE)
    label = tl.load(label_ids_ptr + n)
    live = label != IGNORE_INDEX
    here = label - vocab_start  # the one-hot's entry in this plane (outside it: none here)

    z = transformed(tl.load(logits_ptr + row * stride_logits_row + offsets, mask=in_row, other=0.0),
                    logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
    draft_lse_e = draft_lse.to(E)
    if HAS_TARGET:
        t = transformed(tl.load(target_ptr + row * stride_target_row + offsets, mask=in_row, other=0.0),
                        logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
        p, q, log_ratio = soft_entries(z, t, draft_lse_e, target_lse.to(E), (draft_lse - target_lse).to(E), E)
    else:  # ce alone: q only (p and log_ratio unused)
        q = exp_in(z - draft_lse_e, E)
        p = q
        log_ratio = q

    if SUMS:
        out = sums_ptr + (n * n_segments + seg) * SUMS_WIDTH
        zero = tl.zeros([], tl.float64)
        kl = zero
        rkl = zero
        jsd = zero
        jsd_q = zero
        tv_q = zero
        if KL:
            kl = _segment_sum(weighted(p, log_ratio), in_row)
        if RKL:
            rkl = _segment_sum(weighted(q, -log_ratio), in_row)
        if JSD:
            q_over_m, p_over_m = mixture_logs(log_ratio, E)
            q_half = weighted(q, 0.5 * q_over_m)
            jsd_q = _segment_sum(q_half, in_row)
            jsd = _segment_sum(0.5 * weighted(p, p_over_m) + q_half, in_row)
        if TV:
            tv_q = _segment_sum(weighted(q, tv_slope(p, q)), in_row)
        smaller = tl.where(q < p, q, p)
        smaller = tl.where(q != q, q, smaller)  # NaN in either gives NaN, as torch.minimum
        tl.store(out + SUM_KL, kl)
        tl.store(out + SUM_RKL, rkl)
        tl.store(out + SUM_JSD, jsd)
        overlap = zero
        if HAS_TARGET:
            overlap = _segment_sum(smaller, in_row)
        tl.store(out + SUM_OVERLAP, overlap)
        tl.store(out + SUM_JSD_Q, jsd_q)
        tl.store(out + SUM_TV_Q, tv_q)

    if GRADS != 0:
        rkl_e = tl.load(stats + STAT_RKL).to(E)
        jsd_q_e = tl.load(stats + STAT_JSD_Q).to(E)
        tv_q_e = tl.load(stats + STAT_TV_Q).to(E)
        one_hot = tl.where(offsets == here, 1.0, 0.0).to(E)
        dz_ds = slope_of_s(z, logit_scale, inv_softcap, E, HAS_SOFTCAP)
        plane_row = planes_ptr + row * stride_plane_row
        if GRADS == 1:
            for loss in tl.static_range(5):
                if ((PLANE_MASK >> loss) & 1) != 0:
                    slope = loss_slope(loss, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
                    _plane_store(plane_row, loss_slot(LOSS_MASK, loss), stride_plane_loss, offsets, in_row,
                                 tl.where(live, slope * dz_ds, 0.0))
        else:
            dense = tl.zeros([SEG], E)
            if HAS_GRAD_LOSSES:
                weights = grad_losses_ptr + n * stride_gl_row
                for loss in tl.static_range(5):
                    if ((LOSS_MASK >> loss) & 1) != 0:
                        weight = scalar_as(tl.load(weights + loss_slot(LOSS_MASK, loss) * stride_gl_loss), E)
                        dense += weight * loss_slope(loss, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
            dense = tl.where(live, dense, 0.0)
            first = seg * SEG  # the segment's first entry, local to the plane
            column = tl.where(label == IGNORE_INDEX, 0, label) - vocab_start  # the label logit's entry
            if SPARSE_OUT:
                tl.store(plane_row + offsets, stored_as(dense * dz_ds, planes_ptr.dtype.element_ty), mask=in_row)
                width = top_k + 1
                if HAS_GRAD_TOPK:
                    for j in range(0, top_k):
                        picked = tl.load(topk_ids_ptr + n * top_k + j) - vocab_start
                        if (picked >= first) & (picked < first + SEG):
                            grad = scalar_as(tl.load(grad_topk_ptr + n * stride_gt_row + j * stride_gt_col), E)
                            slope = tl.sum(tl.where(offsets == picked, dz_ds, 0.0), axis=0)
                            tl.store(sparse_ptr + n * width + j, grad * slope)
                if HAS_GRAD_LABEL:
                    # At id 0 on ignored rows, none for -1 (no label).
                    if (column >= first) & (column < first + SEG) & (label != -1):
                        grad = scalar_as(tl.load(grad_label_ptr + n * stride_glabel), E)
                        slope = tl.sum(tl.where(offsets == column, dz_ds, 0.0), axis=0)
                        tl.store(sparse_ptr + n * width + top_k, grad * slope)
            else:
                if HAS_GRAD_TOPK:
                    # Only segments holding one of the row's top-k ids add their gradients.
                    hits = tl.zeros([], tl.int32)
                    for j in range(0, top_k):
                        picked = tl.load(topk_ids_ptr + n * top_k + j) - vocab_start
                        hits += ((picked >= first) & (picked < first + SEG)).to(tl.int32)
                    if hits > 0:
                        for j in range(0, top_k):
                            picked = tl.load(topk_ids_ptr + n * top_k + j) - vocab_start
                            grad = scalar_as(tl.load(grad_topk_ptr + n * stride_gt_row + j * stride_gt_col), E)
                            dense += tl.where(offsets == picked, grad, 0.0)
                if HAS_GRAD_LABEL:
                    grad = scalar_as(tl.load(grad_label_ptr + n * stride_glabel), E)
                    dense += tl.where((offsets == column) & (label != -1), grad, 0.0)
                tl.store(plane_row + offsets, stored_as(dense * dz_ds, planes_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def draft_head_sparse_add_kernel(
    plane_ptr,  # P [R, C] at stride_plane_row: one vocabulary slice's dL/ds, columns global ids column_start + c
    sparse_ptr,  # E [N, K + 1]: the top-k and label logits' dL/ds (the sweep's SPARSE_OUT)
    topk_ids_ptr,  # int64 [N, K] global
    label_ids_ptr,  # int64 [N]: a label, -100 (ignored: the logit at id 0), -1 (none)
    column_start,
    columns,
    top_k,
    stride_plane_row,
    HAS_GRAD_TOPK: tl.constexpr,
    HAS_GRAD_LABEL: tl.constexpr,
):
    """One program per row: the row's sparse gradients that fall in this slice added to
    its plane entries, in a fixed order (a label that is also a top-k id adds twice)."""
    n = tl.program_id(0).to(tl.int64)
    E: tl.constexpr = sparse_ptr.dtype.element_ty
    P: tl.constexpr = plane_ptr.dtype.element_ty
    row = plane_ptr + n * stride_plane_row
    width = top_k + 1
    if HAS_GRAD_TOPK:
        for j in range(0, top_k):
            local = tl.load(topk_ids_ptr + n * top_k + j) - column_start
            if (local >= 0) & (local < columns):
                value = tl.load(row + local).to(E) + tl.load(sparse_ptr + n * width + j)
                tl.store(row + local, stored_as(value, P))
    if HAS_GRAD_LABEL:
        label = tl.load(label_ids_ptr + n)
        local = tl.where(label == IGNORE_INDEX, 0, label) - column_start
        if (label != -1) & (local >= 0) & (local < columns):
            value = tl.load(row + local).to(E) + tl.load(sparse_ptr + n * width + top_k)
            tl.store(row + local, stored_as(value, P))


@triton.jit
def draft_head_finish_kernel(
    sums_ptr,  # fp64 [N, S, SUMS_WIDTH]
    label_ids_ptr,  # int64 [N]
    losses_ptr,  # fp32 [L, N]
    overlap_ptr,  # fp32 [N] (HAS_TARGET)
    row_stats_ptr,  # fp64 [N, ROW_STATS]
    row_start,
    n_rows,  # N
    n_segments,
    LOSS_MASK: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    S_P2: tl.constexpr,
):
    """One program per row: the segments' sums into its soft losses (0 on ignored rows),
    its overlap and the row sums the gradients of rkl, jsd and tv subtract."""
    n = row_start + tl.program_id(0).to(tl.int64)
    segs = tl.arange(0, S_P2)
    valid = segs < n_segments
    row_sums = sums_ptr + n * n_segments * SUMS_WIDTH + segs * SUMS_WIDTH
    live = tl.load(label_ids_ptr + n) != IGNORE_INDEX
    overlap = tl.sum(tl.load(row_sums + SUM_OVERLAP, mask=valid, other=0.0), axis=0)
    if HAS_TARGET:
        tl.store(overlap_ptr + n, overlap.to(tl.float32))
    losses = losses_ptr + n
    if (LOSS_MASK & 1) != 0:
        kl = tl.sum(tl.load(row_sums + SUM_KL, mask=valid, other=0.0), axis=0)
        tl.store(losses + loss_slot(LOSS_MASK, 0) * n_rows, tl.where(live, kl, 0.0).to(tl.float32))
    stats = row_stats_ptr + n * ROW_STATS
    if (LOSS_MASK & 2) != 0:
        rkl = tl.sum(tl.load(row_sums + SUM_RKL, mask=valid, other=0.0), axis=0)
        tl.store(losses + loss_slot(LOSS_MASK, 1) * n_rows, tl.where(live, rkl, 0.0).to(tl.float32))
        tl.store(stats + STAT_RKL, tl.where(live, rkl, 0.0))
    if (LOSS_MASK & 4) != 0:
        jsd = tl.sum(tl.load(row_sums + SUM_JSD, mask=valid, other=0.0), axis=0)
        jsd_q = tl.sum(tl.load(row_sums + SUM_JSD_Q, mask=valid, other=0.0), axis=0)
        tl.store(losses + loss_slot(LOSS_MASK, 2) * n_rows, tl.where(live, jsd, 0.0).to(tl.float32))
        tl.store(stats + STAT_JSD_Q, tl.where(live, jsd_q, 0.0))
    if (LOSS_MASK & 8) != 0:
        tv_q = tl.sum(tl.load(row_sums + SUM_TV_Q, mask=valid, other=0.0), axis=0)
        tl.store(losses + loss_slot(LOSS_MASK, 3) * n_rows, tl.where(live, 1.0 - overlap, 0.0).to(tl.float32))
        tl.store(stats + STAT_TV_Q, tl.where(live, tv_q, 0.0))
