"""Triton kernels that merge a vocab-parallel draft head's shards (SPEC section 7, last
paragraph; the driver is shard_gpu.py). Kernels only.

Each rank holds W's rows [vocab_start, vocab_start + V_local) and reads its own [R, V_local]
planes with the single-process kernels (scan_kernels.py, sweep_kernels.py); these kernels
turn what the ranks exchange into the results one process would have:

``draft_head_shard_pack_kernel`` (per row, before the all_gather): this shard's lse of
each side, its best KW candidates (global ids, unrounded z) and the target's best (global
id, unrounded t), fp64 values as their int64 bits in one int64 row of SEND_WIDTH(KW), so
that one all_gather carries everything. A shard shorter than KW pads with id -1.

``draft_head_shard_merge_kernel`` (per row, after it): the global lse (a logsumexp over the
ranks' lse), the global top-K by the logits rounded to logits_dtype (ties to the lower
global id, NaN first), the target's argmax, the label; and this rank's share of the
logits the outputs need: z at the merged ids, at the label, t at the merged ids where this
rank owns them, exact zeros elsewhere, into the shares row that one all_reduce sums.

``draft_head_shard_shares_kernel`` (per row): this shard's segment sums (the sweep's) into
the shares row. ``draft_head_shard_final_kernel`` (per row, after the all_reduce): the
summed shares into the losses, overlap, the top-k and label logits and the row sums the
gradients of rkl, jsd and tv subtract.

Shares, fp64 [N, SHARES_BASE + 2K + 1]: the six sums (sweep_kernels' SUM_*), then z at the
K merged ids, z at the label, t at the K merged ids.
"""

import triton
import triton.language as tl

from .kernel_math import IGNORE_INDEX, key_floor, lse_merged, order_key, rounded, stored_as
from .scan_kernels import (
    ROW_STATS,
    STAT_DRAFT_LSE,
    STAT_JSD_Q,
    STAT_RKL,
    STAT_TARGET_LSE,
    STAT_TV_Q,
    pick_candidates,
    segments_best,
    segments_lse,
    z_at,
)
from .sweep_kernels import SUM_JSD, SUM_JSD_Q, SUM_KL, SUM_OVERLAP, SUM_RKL, SUM_TV_Q, SUMS_WIDTH, loss_slot

SHARES_BASE = SUMS_WIDTH  # the sums' columns come first


@triton.jit
def _bits(value):
    return value.to(tl.float64).to(tl.int64, bitcast=True)


@triton.jit
def _value(bits):
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def draft_head_shard_pack_kernel(
    logits_ptr,  # [R, V_local] raw s (E)
    target_ptr,  # [R, V_local] raw t (HAS_TARGET)
    partials_ptr,  # fp64 [R, S, 4] (scan)
    best_ptr,  # int64 [R, S, 4] (scan)
    cand_keys_ptr,  # int64 [R, S, CAP] (TOPK 1)
    cand_ids_ptr,
    cand_count_ptr,
    given_ids_ptr,  # int64 [R, KW] local ids, ordered (TOPK 2)
    send_ptr,  # int64 [R, 2 KW + 4]: ids, target id, values, target value, lse(z), lse(t)
    n_segments,  # 0 for an empty shard
    vocab,  # V_local
    vocab_start,
    picks,  # this shard's candidates: min(KW, V_local)
    stride_logits_row,
    stride_target_row,
    logit_scale: tl.float64,
    softcap: tl.float64,
    inv_softcap: tl.float64,
    HAS_TARGET: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KEY_BITS: tl.constexpr,
    TOPK: tl.constexpr,  # 1 the scan's candidates, 2 given ids
    KW: tl.constexpr,  # candidate slots a rank sends: max(top_k, 1)
    S_P2: tl.constexpr,
    CAP: tl.constexpr,
):
    """One program per row of the chunk: the module docstring's pack."""
    E: tl.constexpr = logits_ptr.dtype.element_ty
    BIG: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    row = tl.program_id(0).to(tl.int64)
    send = send_ptr + row * (2 * KW + 4)
    z_row_ptr = logits_ptr + row * stride_logits_row
    segs = tl.arange(0, S_P2)
    valid = segs < n_segments
    base = row * n_segments * 4
    tl.store(send + 2 * KW + 2, _bits(segments_lse(partials_ptr, base, segs, valid, 0)))
    if TOPK == 1:
        pick_candidates(cand_keys_ptr, cand_ids_ptr, cand_count_ptr, row, n_segments, send, picks, 0, KEY_BITS, S_P2,
                        CAP)
    else:
        for j in range(0, picks):
            tl.store(send + j, tl.load(given_ids_ptr + row * KW + j))
    tl.debug_barrier()
    for j in range(0, KW):
        if j < picks:
            local = tl.load(send + j)
            z = z_at(z_row_ptr, local, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
            tl.store(send + KW + 1 + j, _bits(z))
            tl.store(send + j, local + vocab_start)
        else:
            tl.store(send + j, tl.full([], -1, tl.int64))
            tl.store(send + KW + 1 + j, _bits(tl.full([], float("-inf"), tl.float64)))
    # The target's side: padding unless this shard has entries (an empty shard sends none).
    target_lse = tl.full([], float("-inf"), tl.float64)
    target_id = tl.full([], -1, tl.int64)
    target_value = tl.full([], float("-inf"), tl.float64)
    if HAS_TARGET:
        if n_segments > 0:
            target_lse = segments_lse(partials_ptr, base, segs, valid, 1)
            local = segments_best(best_ptr, base, segs, valid, 0, KEY_BITS, BIG)
            target_value = z_at(target_ptr + row * stride_target_row, local, vocab, logit_scale, softcap,
                                inv_softcap, E, HAS_SOFTCAP).to(tl.float64)
            target_id = local + vocab_start
    tl.store(send + 2 * KW + 3, _bits(target_lse))
    tl.store(send + KW, target_id)
    tl.store(send + 2 * KW + 1, _bits(target_value))


@triton.jit
def _ranks_lse(gathered_ptr, ranks, live_ranks, column, rank_stride):
    lse = _value(tl.load(gathered_ptr + ranks * rank_stride + column, mask=live_ranks,
                         other=_bits(tl.full([], float("-inf"), tl.float64))))
    totals = tl.where(lse != lse, float("nan"), tl.where(lse > float("-inf"), 1.0, 0.0))
    return lse_merged(lse, totals.to(tl.float64))


@triton.jit
def draft_head_shard_merge_kernel(
    gathered_ptr,  # int64 [W, R, 2 KW + 4]: every rank's pack
    logits_ptr,  # [R, V_local] raw s (E): this rank's logits at the merged ids
    target_ptr,  # [R, V_local] raw t (HAS_TARGET)
    labels_ptr,  # int64 [N] global at stride_labels (HAS_LABELS)
    given_ids_ptr,  # int64 [R, K] merged global ids, ordered (TOPK 2)
    topk_ids_ptr,  # int64 [N, K]
    label_ids_ptr,  # int64 [N]
    draft_lse_ptr,  # fp32 [N]
    target_lse_ptr,  # fp32 [N]
    draft_argmax_ptr,  # int64 [N]
    target_argmax_ptr,  # int64 [N]
    overlap_ptr,  # fp32 [N]: 0 without a target
    row_stats_ptr,  # fp64 [N, ROW_STATS]
    shares_ptr,  # fp64 [N, SHARES_BASE + 2K + 1]
    row_start,
    world,
    vocab,  # V_local
    vocab_start,
    global_vocab,
    top_k,
    picks,  # max(top_k, 1): the draft's argmax is the first pick, with K == 0 too
    rows_in_chunk,  # R: the gathered tensor's rank stride is R (2 KW + 4)
    stride_logits_row,
    stride_target_row,
    stride_labels,
    logit_scale: tl.float64,
    softcap: tl.float64,
    inv_softcap: tl.float64,
    HAS_TARGET: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROUND: tl.constexpr,
    KEY_BITS: tl.constexpr,
    TOPK: tl.constexpr,  # 1 merge the ranks' candidates here, 2 given ids
    KW: tl.constexpr,
    W_P2: tl.constexpr,
    KW_P2: tl.constexpr,
):
    """One program per row of the chunk: the module docstring's merge."""
    E: tl.constexpr = logits_ptr.dtype.element_ty
    BIG: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    WIDTH: tl.constexpr = 2 * KW + 4
    row = tl.program_id(0).to(tl.int64)
    n = row_start + row
    rank_stride = rows_in_chunk * WIDTH
    row_base = gathered_ptr + row * WIDTH
    ranks = tl.arange(0, W_P2)
    live_ranks = ranks < world
    stats = row_stats_ptr + n * ROW_STATS
    draft_lse = _ranks_lse(row_base, ranks, live_ranks, 2 * KW + 2, rank_stride)
    tl.store(draft_lse_ptr + n, draft_lse.to(tl.float32))
    tl.store(stats + STAT_DRAFT_LSE, draft_lse)
    floor = key_floor(KEY_BITS)
    target_best = tl.full([], -1, tl.int64)
    if HAS_TARGET:
        target_lse = _ranks_lse(row_base, ranks, live_ranks, 2 * KW + 3, rank_stride)
        tl.store(target_lse_ptr + n, target_lse.to(tl.float32))
        tl.store(stats + STAT_TARGET_LSE, target_lse)
        ids = tl.load(row_base + ranks * rank_stride + KW, mask=live_ranks, other=-1)
        values = _value(tl.load(row_base + ranks * rank_stride + 2 * KW + 1, mask=live_ranks, other=0))
        keys = tl.where(ids >= 0, order_key(rounded(values, ROUND), KEY_BITS), floor)
        top = tl.max(keys, axis=0)
        target_best = tl.min(tl.where((keys == top) & (ids >= 0), ids, BIG), axis=0)
        tl.store(target_argmax_ptr + n, target_best)
    else:
        tl.store(stats + STAT_TARGET_LSE, tl.zeros([], tl.float64))
        tl.store(target_lse_ptr + n, tl.zeros([], tl.float32))
        tl.store(target_argmax_ptr + n, tl.zeros([], tl.int64))
        tl.store(overlap_ptr + n, tl.zeros([], tl.float32))
    for column in tl.static_range(STAT_RKL, ROW_STATS):
        tl.store(stats + column, tl.zeros([], tl.float64))

    first = tl.full([], -1, tl.int64)
    if TOPK == 1:
        slots = tl.arange(0, KW_P2)
        at = row_base + ranks[:, None] * rank_stride + slots[None, :]
        present = live_ranks[:, None] & (slots[None, :] < KW)
        ids = tl.load(at, mask=present, other=-1)
        values = _value(tl.load(at + KW + 1, mask=present, other=0))
        keys = tl.where(ids >= 0, order_key(rounded(values, ROUND), KEY_BITS), floor)
        for j in range(0, picks):
            best = tl.max(tl.max(keys, axis=1), axis=0)
            picked = tl.min(tl.min(tl.where((keys == best) & (ids >= 0), ids, BIG), axis=1), axis=0)
            keys = tl.where(ids == picked, floor, keys)
            ids = tl.where(ids == picked, -1, ids)
            if j < top_k:
                tl.store(topk_ids_ptr + n * top_k + j, picked)
            first = tl.where(j == 0, picked, first)
    else:
        for j in range(0, top_k):
            picked = tl.load(given_ids_ptr + row * top_k + j)
            tl.store(topk_ids_ptr + n * top_k + j, picked)
            first = tl.where(j == 0, picked, first)
    tl.store(draft_argmax_ptr + n, first)

    label = target_best
    if HAS_LABELS:
        label = tl.load(labels_ptr + n * stride_labels)
    tl.store(label_ids_ptr + n, label)
    # This rank's share of the logits the outputs need: its own, exact zeros elsewhere.
    shares = shares_ptr + n * (SHARES_BASE + 2 * top_k + 1)
    z_row_ptr = logits_ptr + row * stride_logits_row
    tl.debug_barrier()
    for j in range(0, top_k):
        local = tl.load(topk_ids_ptr + n * top_k + j) - vocab_start
        owned = (local >= 0) & (local < vocab)
        z = z_at(z_row_ptr, local, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
        tl.store(shares + SHARES_BASE + j, tl.where(owned, z.to(tl.float64), 0.0))
        if HAS_TARGET:
            t = z_at(target_ptr + row * stride_target_row, local, vocab, logit_scale, softcap, inv_softcap, E,
                     HAS_SOFTCAP)
            tl.store(shares + SHARES_BASE + top_k + 1 + j, tl.where(owned, t.to(tl.float64), 0.0))
        else:
            tl.store(shares + SHARES_BASE + top_k + 1 + j, tl.zeros([], tl.float64))
    # The label's logit: at id 0 on ignored rows and with no label; NaN on every rank for a
    # label outside [0, V).
    global_at = tl.where((label == IGNORE_INDEX) | (label == -1), 0, label)
    local = global_at - vocab_start
    owned = (local >= 0) & (local < vocab)
    z = z_at(z_row_ptr, local, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
    share = tl.where(owned, z.to(tl.float64), 0.0)
    share = tl.where((global_at < 0) | (global_at >= global_vocab), float("nan"), share)
    tl.store(shares + SHARES_BASE + top_k, share)


@triton.jit
def draft_head_shard_shares_kernel(
    sums_ptr,  # fp64 [N, S, SUMS_WIDTH] (the sweep's, this shard's segments)
    shares_ptr,  # fp64 [N, SHARES_BASE + 2K + 1]
    row_start,
    n_segments,  # 0 for an empty shard
    top_k,
    S_P2: tl.constexpr,
):
    """One program per row: this shard's sums into its shares row."""
    n = row_start + tl.program_id(0).to(tl.int64)
    segs = tl.arange(0, S_P2)
    valid = segs < n_segments
    row_sums = sums_ptr + n * n_segments * SUMS_WIDTH + segs * SUMS_WIDTH
    shares = shares_ptr + n * (SHARES_BASE + 2 * top_k + 1)
    for column in tl.static_range(SUMS_WIDTH):
        tl.store(shares + column, tl.sum(tl.load(row_sums + column, mask=valid, other=0.0), axis=0))


@triton.jit
def draft_head_shard_final_kernel(
    shares_ptr,  # fp64 [N, SHARES_BASE + 2K + 1], summed over the ranks
    label_ids_ptr,  # int64 [N]
    losses_ptr,  # fp32 [L, N]
    overlap_ptr,  # fp32 [N] (HAS_TARGET)
    row_stats_ptr,  # fp64 [N, ROW_STATS]
    topk_z_ptr,  # E [N, K]
    topk_logits_ptr,  # logits_dtype [N, K]
    at_topk_ptr,  # fp32 [N, K]
    label_z_ptr,  # E [N]
    label_logit_ptr,  # logits_dtype [N]
    row_start,
    n_rows,
    top_k,
    LOSS_MASK: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per row: the module docstring's final step."""
    n = row_start + tl.program_id(0).to(tl.int64)
    shares = shares_ptr + n * (SHARES_BASE + 2 * top_k + 1)
    E: tl.constexpr = topk_z_ptr.dtype.element_ty
    label = tl.load(label_ids_ptr + n)
    live = label != IGNORE_INDEX
    stats = row_stats_ptr + n * ROW_STATS
    for j in range(0, top_k):
        z = tl.load(shares + SHARES_BASE + j).to(E)
        tl.store(topk_z_ptr + n * top_k + j, z)
        tl.store(topk_logits_ptr + n * top_k + j, stored_as(rounded(z, ROUND), topk_logits_ptr.dtype.element_ty))
        tl.store(at_topk_ptr + n * top_k + j, tl.load(shares + SHARES_BASE + top_k + 1 + j).to(tl.float32))
    label_z = tl.load(shares + SHARES_BASE + top_k).to(E)
    tl.store(label_z_ptr + n, label_z)
    tl.store(label_logit_ptr + n, stored_as(rounded(label_z, ROUND), label_logit_ptr.dtype.element_ty))
    overlap = tl.load(shares + SUM_OVERLAP)
    if HAS_TARGET:
        tl.store(overlap_ptr + n, overlap.to(tl.float32))
    losses = losses_ptr + n
    if (LOSS_MASK & 1) != 0:
        tl.store(losses + loss_slot(LOSS_MASK, 0) * n_rows, tl.where(live, tl.load(shares + SUM_KL), 0.0).to(tl.float32))
    if (LOSS_MASK & 2) != 0:
        rkl = tl.where(live, tl.load(shares + SUM_RKL), 0.0)
        tl.store(losses + loss_slot(LOSS_MASK, 1) * n_rows, rkl.to(tl.float32))
        tl.store(stats + STAT_RKL, rkl)
    if (LOSS_MASK & 4) != 0:
        jsd = tl.where(live, tl.load(shares + SUM_JSD), 0.0)
        tl.store(losses + loss_slot(LOSS_MASK, 2) * n_rows, jsd.to(tl.float32))
        tl.store(stats + STAT_JSD_Q, tl.where(live, tl.load(shares + SUM_JSD_Q), 0.0))
    if (LOSS_MASK & 8) != 0:
        tl.store(losses + loss_slot(LOSS_MASK, 3) * n_rows, tl.where(live, 1.0 - overlap, 0.0).to(tl.float32))
        tl.store(stats + STAT_TV_Q, tl.where(live, tl.load(shares + SUM_TV_Q), 0.0))
    if (LOSS_MASK & 16) != 0:
        draft_lse = tl.load(stats + STAT_DRAFT_LSE)
        loss = tl.where(live, draft_lse - tl.load(shares + SHARES_BASE + top_k), 0.0)
        tl.store(losses + loss_slot(LOSS_MASK, 4) * n_rows, loss.to(tl.float32))
