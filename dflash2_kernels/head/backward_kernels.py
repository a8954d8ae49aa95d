"""Triton kernel of the draft head's backward with a frozen lm_head (SPEC section 7). Kernels only.

The forward kept dL_l/dh = (dL_l/ds) W per loss ([N, L, H] in the compute dtype E), so
the gradient w.r.t. hidden is, per row n,

    dh[n] = sum_l g_l[n] dL_l/dh[n] + sum_j c_j W[topk_ids[n, j]] + c_label W[label[n]]

with c = (the upstream gradient of the top-k / label logit) x dz/ds at that logit: the
top-k and label logits' own gradients go through the W rows they came from (K + 1 rows),
not through a product over V, whose rounding would grow with V. The recompute's backward
(gpu_driver.recomputed_grads) takes it too, without planes, for the same sparse gradients
(SLOPED off: c given as dL/ds by the sweep; ACCUMULATE onto its dense dh). One launch for
the whole backward: one program per (row, slice of BLOCK_H columns), fp32 (fp64) sums,
rounded once to the output's dtype.

Bad ids (outside [0, V) in a raw call of the backward op: no host sync checks them on a
GPU) read nothing and make their row's gradient NaN. A vocab-parallel shard (SHARD)
holds W's rows [vocab_start, vocab_start + V_local): ids elsewhere are another rank's
(0 here; the ranks' gradients are summed).
"""

import triton
import triton.language as tl

from .kernel_math import IGNORE_INDEX, scalar_as, slope_of_s, stored_as


@triton.jit
def _weight_rows(weight_ptr, ids, active, cols, in_cols, vocab, vocab_start, stride_weight_row, stride_weight_col,
                 E: tl.constexpr, SHARD: tl.constexpr):
    """W rows at global ids [J] over columns [B] -> [J, B] in E: 0 where not active or
    (SHARD) owned by another rank, NaN at a bad id."""
    local = ids - vocab_start
    inside = (local >= 0) & (local < vocab)
    read = active & inside
    rows = tl.load(weight_ptr + tl.where(read, local, 0)[:, None] * stride_weight_row + cols[None, :] * stride_weight_col,
                   mask=read[:, None] & in_cols[None, :], other=0.0).to(E)
    if not SHARD:
        # (not ~inside: Triton 3.1's interpreter has no int1 constants to invert with)
        rows = tl.where((active & ((local < 0) | (local >= vocab)))[:, None], float("nan"), rows)
    return rows


@triton.jit
def draft_head_hidden_grad_kernel(
    planes_ptr,  # E [N, L, H] contiguous: dL_l/dh (HAS_PLANES)
    grad_losses_ptr,  # [L, N] at (stride_gl_loss, stride_gl_row) (HAS_GRAD_LOSSES)
    weight_ptr,  # [V, H] (a shard's [V_local, H]) at (stride_weight_row, stride_weight_col)
    topk_ids_ptr,  # int64 [N, K] global ids
    topk_z_ptr,  # E [N, K]: the transformed logits there (SLOPED; its dtype is E either way)
    grad_topk_ptr,  # [N, K] at (stride_gt_row, stride_gt_col) (HAS_GRAD_TOPK)
    label_ids_ptr,  # int64 [N]: a label, -100 (ignored: the logit at id 0), -1 (none)
    label_z_ptr,  # E [N] (SLOPED)
    grad_label_ptr,  # [N] at stride_glabel (HAS_GRAD_LABEL)
    out_ptr,  # [N, H] at stride_out_row: the result, rounded once to its dtype
    width,
    vocab,
    vocab_start,
    top_k,
    h_tiles,
    stride_gl_loss,
    stride_gl_row,
    stride_weight_row,
    stride_weight_col,
    stride_gt_row,
    stride_gt_col,
    stride_glabel,
    stride_out_row,
    logit_scale: tl.float64,
    inv_softcap: tl.float64,
    LOSSES: tl.constexpr,
    HAS_PLANES: tl.constexpr,
    HAS_GRAD_LOSSES: tl.constexpr,
    HAS_GRAD_TOPK: tl.constexpr,
    HAS_GRAD_LABEL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SHARD: tl.constexpr,
    SLOPED: tl.constexpr,  # the gradients are dL/dz (times dz/ds here); else dL/ds already
    ACCUMULATE: tl.constexpr,  # out += the sum (out in E)
    K_BLOCK: tl.constexpr,  # top-k W rows gathered at once
    BLOCK_H: tl.constexpr,
):
    """One program per (row, column slice): the module docstring's sum."""
    E: tl.constexpr = topk_z_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    n = pid // h_tiles
    cols = (pid % h_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_cols = cols < width
    total = tl.zeros([BLOCK_H], E)
    if HAS_PLANES and HAS_GRAD_LOSSES:
        for loss in tl.static_range(LOSSES):
            weight = scalar_as(tl.load(grad_losses_ptr + loss * stride_gl_loss + n * stride_gl_row), E)
            plane = tl.load(planes_ptr + (n * LOSSES + loss) * width + cols, mask=in_cols, other=0.0)
            total += weight * plane
    if HAS_GRAD_TOPK:
        for first in range(0, top_k, K_BLOCK):
            picks = first + tl.arange(0, K_BLOCK)
            active = picks < top_k
            ids = tl.load(topk_ids_ptr + n * top_k + picks, mask=active, other=0)
            grads = tl.load(grad_topk_ptr + n * stride_gt_row + picks * stride_gt_col, mask=active, other=0.0).to(E)
            if SLOPED:
                z = tl.load(topk_z_ptr + n * top_k + picks, mask=active, other=0.0)
                grads = grads * slope_of_s(z, logit_scale, inv_softcap, E, HAS_SOFTCAP)
            coefficients = tl.where(active, grads, 0.0)
            rows = _weight_rows(weight_ptr, ids, active, cols, in_cols, vocab, vocab_start, stride_weight_row,
                                stride_weight_col, E, SHARD)
            total += tl.sum(coefficients[:, None] * rows, axis=0)
    if HAS_GRAD_LABEL:
        label = tl.load(label_ids_ptr + n)
        coefficient = scalar_as(tl.load(grad_label_ptr + n * stride_glabel), E)
        if SLOPED:
            z = tl.load(label_z_ptr + n)
            coefficient = coefficient * slope_of_s(z, logit_scale, inv_softcap, E, HAS_SOFTCAP)
        column = tl.where(label == IGNORE_INDEX, 0, label)
        one = tl.arange(0, 1)
        row = _weight_rows(weight_ptr, column + one, (label != -1) | (one < 0), cols, in_cols, vocab, vocab_start,
                           stride_weight_row, stride_weight_col, E, SHARD)
        total += tl.sum(coefficient * row, axis=0)
    if ACCUMULATE:
        total += tl.load(out_ptr + n * stride_out_row + cols, mask=in_cols, other=0.0).to(E)
    tl.store(out_ptr + n * stride_out_row + cols, stored_as(total, out_ptr.dtype.element_ty), mask=in_cols)
