"""Triton kernels of the draft head's first read of each chunk (SPEC section 7). Kernels only.

A chunk is R rows of raw logits s = h W^T [R, V] (and the target's t), in the planes'
dtype E, written by the GEMMs and never rewritten: every pass transforms what it reads
(kernel_math.transformed), so no pass writes a plane back.

``draft_head_scan_kernel``: one program per (row, segment of SEG entries), the segment
held in registers, one read of s and t. It writes the segment's partials:
  - each side's (max, sum of e^(z - max)) for the log-normalisers;
  - the target's best (key, id) of the logits rounded to logits_dtype (its argmax), and
    the draft's when no candidates are asked for;
  - the candidates for the top-k (CANDIDATES): every entry whose key reaches a bar that
    at least K entries of the segment reach, compacted (at most CAP, usually K or a few
    more). The bar is the K-th largest maximum of the segment's blocks of SUB entries:
    K blocks hold an entry at or above it, so the segment's K best all pass, ties at the
    K-th included. Where more than CAP pass (many ties), the exact K-th key is found
    (distinct keys from the top, at most K steps) and exactly K are kept, the ties
    lowest id first.
Splitting rows into segments gives the GPU R x S programs even for a chunk of few rows
(serving: 256 rows), where one program a row would leave most of 132 SMs idle.

``draft_head_merge_kernel``: one program per row: the segments' partials into the row's
lse (fp64), argmaxes and top-k (the candidates' best K by (key, lower id), one max
reduction each over packed (key, id) words for 32-bit keys), the label, and the few
logits the outputs need gathered from the raw planes (the top-k's, the label's, the
target's at the top-k ids). It writes the op's outputs at their global rows directly
(no copies), the ce loss, and the fp64 row statistics the second pass reads.

No atomics: every sum has a fixed order, so results are deterministic.
"""

import triton
import triton.language as tl

from .kernel_math import (
    IGNORE_INDEX,
    key_floor,
    lse_merged,
    lse_partial,
    order_key,
    order_key32,
    rounded,
    stored_as,
    transformed,
)

# Row statistics (fp64 [N, ROW_STATS]) the later passes and the backward read.
STAT_DRAFT_LSE = tl.constexpr(0)
STAT_TARGET_LSE = tl.constexpr(1)
STAT_RKL = tl.constexpr(2)  # the row sums the gradients of rkl, jsd and tv subtract
STAT_JSD_Q = tl.constexpr(3)
STAT_TV_Q = tl.constexpr(4)
ROW_STATS = tl.constexpr(5)
# Per-segment partials: fp64 [R, S, 4] (z max, z sum, t max, t sum) and int64 [R, S, 4]
# (target's best key, its id, draft's best key, its id).
PARTIALS = tl.constexpr(4)


@triton.jit
def _best(keys, ids):
    """(largest key, lowest id holding it) of a segment (int32 ids): torch.argmax's first maximum."""
    top = tl.max(keys, axis=0)
    return top, tl.min(tl.where(keys == top, ids, 0x7FFFFFFF), axis=0)


@triton.jit
def _segment_key(x, KEY_BITS: tl.constexpr):
    """The scan's keys: int32 (order_key32) for values exact in fp32, int64 for fp64."""
    if KEY_BITS == 32:
        return order_key32(x)
    else:
        return order_key(x, KEY_BITS)


@triton.jit
def draft_head_scan_kernel(
    logits_ptr,  # [R, V] raw s (E) at stride_logits_row, unit vocab stride
    target_ptr,  # [R, V] raw t like logits (HAS_TARGET; else a stand-in)
    partials_ptr,  # fp64 [R, S, 4]
    best_ptr,  # int64 [R, S, 4]
    cand_keys_ptr,  # int64 [R, S, CAP] (CANDIDATES): packed_candidate words, or 64-bit keys
    cand_ids_ptr,  # int64 [R, S, CAP] (CANDIDATES with 64-bit keys): their ids
    cand_count_ptr,  # int32 [R, S] (CANDIDATES)
    n_segments,
    vocab,
    top_k,  # 1 <= top_k (CANDIDATES)
    stride_logits_row,
    stride_target_row,
    logit_scale: tl.float64,
    softcap: tl.float64,
    inv_softcap: tl.float64,
    HAS_TARGET: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROUND: tl.constexpr,  # kernel_math ROUND_* for logits_dtype
    KEY_BITS: tl.constexpr,  # 32, or 64 for fp64 logits
    CANDIDATES: tl.constexpr,
    DRAFT_BEST: tl.constexpr,  # the draft's argmax partial (no candidates to take it from)
    CAP: tl.constexpr,
    SEG: tl.constexpr,
    SUB: tl.constexpr,
):
    """One program per (row, segment): the module docstring's partials."""
    E: tl.constexpr = logits_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_segments
    seg = (pid % n_segments).to(tl.int32)
    # Ids and (for values exact in fp32) keys in int32: half the registers of int64.
    offsets = seg * SEG + tl.arange(0, SEG)
    in_row = offsets < vocab
    ids = offsets
    out = pid * PARTIALS

    z = transformed(tl.load(logits_ptr + row * stride_logits_row + offsets, mask=in_row, other=0.0),
                    logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
    peak, total = lse_partial(z, in_row, E)
    tl.store(partials_ptr + out, peak)
    tl.store(partials_ptr + out + 1, total)
    if KEY_BITS == 32:
        floor = tl.full([], -0x7FFFFFFF - 1, tl.int32)
    else:
        floor = key_floor(KEY_BITS)
    if HAS_TARGET:
        t = transformed(tl.load(target_ptr + row * stride_target_row + offsets, mask=in_row, other=0.0),
                        logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
        peak_t, total_t = lse_partial(t, in_row, E)
        tl.store(partials_ptr + out + 2, peak_t)
        tl.store(partials_ptr + out + 3, total_t)
        key_t, id_t = _best(tl.where(in_row, _segment_key(rounded(t, ROUND), KEY_BITS), floor), ids)
        tl.store(best_ptr + out, key_t.to(tl.int64))
        tl.store(best_ptr + out + 1, id_t.to(tl.int64))
    keys = tl.where(in_row, _segment_key(rounded(z, ROUND), KEY_BITS), floor)
    if DRAFT_BEST:
        key_z, id_z = _best(keys, ids)
        tl.store(best_ptr + out + 2, key_z.to(tl.int64))
        tl.store(best_ptr + out + 3, id_z.to(tl.int64))
    if CANDIDATES:
        blocks = tl.max(tl.reshape(keys, (SEG // SUB, SUB)), axis=1)
        # The K-th largest block maximum: the largest maximum that K maxima reach.
        reach = tl.sum((blocks[None, :] >= blocks[:, None]).to(tl.int32), axis=1)
        bar = tl.max(tl.where(reach >= top_k, blocks, floor), axis=0)
        take = in_row & (keys >= bar)
        count = tl.sum(take.to(tl.int32), axis=0)
        if count > CAP:
            # Many entries at the bar (ties): the exact K-th key, one distinct key a step.
            kth = tl.max(keys, axis=0)
            seen = tl.sum((in_row & (keys == kth)).to(tl.int32), axis=0)
            while seen < top_k:
                kth = tl.max(tl.where(keys < kth, keys, floor), axis=0)
                seen += tl.sum((in_row & (keys == kth)).to(tl.int32), axis=0)
            above = in_row & (keys > kth)
            equal = in_row & (keys == kth)
            room = top_k - tl.sum(above.to(tl.int32), axis=0)
            take = above | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) <= room))
            count = tl.sum(take.to(tl.int32), axis=0)
        position = tl.cumsum(take.to(tl.int32), axis=0) - 1
        slots = pid * CAP + position
        if KEY_BITS == 32:
            tl.store(cand_keys_ptr + slots, packed_candidate(keys, ids), mask=take)
        else:
            tl.store(cand_keys_ptr + slots, keys, mask=take)
            tl.store(cand_ids_ptr + slots, ids.to(tl.int64), mask=take)
        tl.store(cand_count_ptr + pid, count)


@triton.jit
def packed_candidate(keys, ids):
    """An order_key32 key and its id in one signed word that orders as (key, lower id
    first): the key above the id's complement."""
    return (keys.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def pick_candidates(cand_keys_ptr, cand_ids_ptr, cand_count_ptr, row, n_segments, out_ptr, count, id_offset,
                    KEY_BITS: tl.constexpr, S_P2: tl.constexpr, CAP: tl.constexpr):
    """Stores the ids (+ id_offset) of the best ``count`` of chunk row ``row``'s candidates
    (the scan's, [S, CAP] with their counts: packed words for 32-bit keys, keys and ids for
    64-bit ones) at out_ptr[0 .. count), best first: largest key, ties to the lower id,
    one max reduction a pick (two for 64-bit keys). Returns the first id (-1 for count 0)."""
    BIG: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    segs = tl.arange(0, S_P2)
    valid = segs < n_segments
    slots = tl.arange(0, CAP)
    counts = tl.load(cand_count_ptr + row * n_segments + segs, mask=valid, other=0)
    taken = valid[:, None] & (slots[None, :] < counts[:, None])
    where_at = (row * n_segments + segs[:, None]) * CAP + slots[None, :]
    first = tl.full([], -1, tl.int64)
    if KEY_BITS == 32:
        EMPTY: tl.constexpr = -0x7FFFFFFFFFFFFFFF - 1
        packed = tl.load(cand_keys_ptr + where_at, mask=taken, other=EMPTY)
        for j in range(0, count):
            best = tl.max(tl.max(packed, axis=1), axis=0)
            packed = tl.where(packed == best, EMPTY, packed)
            picked = 0xFFFFFFFF - (best & 0xFFFFFFFF) + id_offset
            tl.store(out_ptr + j, picked)
            first = tl.where(j == 0, picked, first)
    else:
        keys = tl.load(cand_keys_ptr + where_at, mask=taken, other=key_floor(KEY_BITS))
        ids = tl.load(cand_ids_ptr + where_at, mask=taken, other=BIG)
        for j in range(0, count):
            best = tl.max(tl.max(keys, axis=1), axis=0)
            picked = tl.min(tl.min(tl.where(keys == best, ids, BIG), axis=1), axis=0)
            keys = tl.where((keys == best) & (ids == picked), key_floor(KEY_BITS), keys)
            tl.store(out_ptr + j, picked + id_offset)
            first = tl.where(j == 0, picked + id_offset, first)
    return first


@triton.jit
def segments_lse(partials_ptr, base, segs, valid, SIDE: tl.constexpr):
    peaks = tl.load(partials_ptr + base + segs * PARTIALS + 2 * SIDE, mask=valid, other=float("-inf"))
    totals = tl.load(partials_ptr + base + segs * PARTIALS + 2 * SIDE + 1, mask=valid, other=0.0)
    return lse_merged(peaks, totals)


@triton.jit
def segments_best(best_ptr, base, segs, valid, SIDE: tl.constexpr, KEY_BITS: tl.constexpr, BIG: tl.constexpr):
    keys = tl.load(best_ptr + base + segs * PARTIALS + 2 * SIDE, mask=valid, other=key_floor(KEY_BITS))
    ids = tl.load(best_ptr + base + segs * PARTIALS + 2 * SIDE + 1, mask=valid, other=BIG)
    top = tl.max(keys, axis=0)
    return tl.min(tl.where(keys == top, ids, BIG), axis=0)


@triton.jit
def z_at(row_ptr, index, vocab, logit_scale, softcap, inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The transformed logit at ``index`` of a raw row; NaN for an index outside [0, vocab)
    (a bad id reads nothing)."""
    inside = (index >= 0) & (index < vocab)
    raw = tl.load(row_ptr + tl.where(inside, index, 0), mask=inside, other=float("nan"))
    return transformed(raw, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)


@triton.jit
def draft_head_merge_kernel(
    logits_ptr,  # [R, V] raw s of the chunk (E)
    target_ptr,  # [R, V] raw t (HAS_TARGET)
    partials_ptr,  # fp64 [R, S, 4] (scan)
    best_ptr,  # int64 [R, S, 4] (scan)
    cand_keys_ptr,  # int64 [R, S, CAP] (TOPK 1)
    cand_ids_ptr,  # int64 [R, S, CAP] (TOPK 1)
    cand_count_ptr,  # int32 [R, S] (TOPK 1)
    given_ids_ptr,  # int64 [R, K] ordered ids (TOPK 2)
    labels_ptr,  # int64 [N] at stride_labels (HAS_LABELS): a label or -100
    topk_ids_ptr,  # int64 [N, K]
    topk_z_ptr,  # E [N, K]
    topk_logits_ptr,  # logits_dtype [N, K]
    at_topk_ptr,  # fp32 [N, K] (HAS_TARGET)
    label_ids_ptr,  # int64 [N]
    label_z_ptr,  # E [N]
    label_logit_ptr,  # logits_dtype [N]
    draft_lse_ptr,  # fp32 [N]
    target_lse_ptr,  # fp32 [N] (HAS_TARGET)
    draft_argmax_ptr,  # int64 [N]
    target_argmax_ptr,  # int64 [N] (HAS_TARGET)
    overlap_ptr,  # fp32 [N]: 0 without a target (the finish writes it with one)
    losses_ptr,  # fp32 [L, N] (CE_SLOT >= 0)
    row_stats_ptr,  # fp64 [N, ROW_STATS]
    row_start,  # the chunk's first row of N
    n_rows,  # N
    n_segments,
    vocab,
    top_k,
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
    TOPK: tl.constexpr,  # 0 none (K == 0), 1 from the scan's candidates, 2 given ids
    CE_SLOT: tl.constexpr,  # ce's row of losses, -1 without ce
    S_P2: tl.constexpr,  # next power of two >= n_segments
    CAP: tl.constexpr,
):
    """One program per row of the chunk: the module docstring's merge."""
    E: tl.constexpr = logits_ptr.dtype.element_ty
    BIG: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    row = tl.program_id(0).to(tl.int64)
    n = row_start + row
    z_row_ptr = logits_ptr + row * stride_logits_row
    t_row_ptr = target_ptr + row * stride_target_row
    segs = tl.arange(0, S_P2)
    valid = segs < n_segments
    base = row * n_segments * PARTIALS
    draft_lse = segments_lse(partials_ptr, base, segs, valid, 0)
    tl.store(draft_lse_ptr + n, draft_lse.to(tl.float32))
    tl.store(row_stats_ptr + n * ROW_STATS + STAT_DRAFT_LSE, draft_lse)
    target_best = tl.full([], -1, tl.int64)
    if HAS_TARGET:
        target_lse = segments_lse(partials_ptr, base, segs, valid, 1)
        tl.store(target_lse_ptr + n, target_lse.to(tl.float32))
        tl.store(row_stats_ptr + n * ROW_STATS + STAT_TARGET_LSE, target_lse)
        target_best = segments_best(best_ptr, base, segs, valid, 0, KEY_BITS, BIG)
        tl.store(target_argmax_ptr + n, target_best)
    else:  # the target-side outputs are 0 (the public function returns None for them)
        tl.store(row_stats_ptr + n * ROW_STATS + STAT_TARGET_LSE, tl.zeros([], tl.float64))
        tl.store(target_lse_ptr + n, tl.zeros([], tl.float32))
        tl.store(target_argmax_ptr + n, tl.zeros([], tl.int64))
        tl.store(overlap_ptr + n, tl.zeros([], tl.float32))
    # The sums a later pass fills in stay 0 for losses that need none.
    for column in tl.static_range(STAT_RKL, ROW_STATS):
        tl.store(row_stats_ptr + n * ROW_STATS + column, tl.zeros([], tl.float64))

    label = target_best
    if HAS_LABELS:
        label = tl.load(labels_ptr + n * stride_labels)
    tl.store(label_ids_ptr + n, label)
    # The label's logit: at id 0 on ignored rows (and with no label), NaN for a bad label.
    at = tl.where((label == IGNORE_INDEX) | (label == -1), 0, label)
    label_z = z_at(z_row_ptr, at, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
    tl.store(label_z_ptr + n, label_z)
    tl.store(label_logit_ptr + n, stored_as(rounded(label_z, ROUND), label_logit_ptr.dtype.element_ty))
    if CE_SLOT >= 0:
        loss = tl.where(label == IGNORE_INDEX, 0.0, draft_lse - label_z.to(tl.float64))
        tl.store(losses_ptr + CE_SLOT * n_rows + n, loss.to(tl.float32))

    first = tl.full([], -1, tl.int64)
    if TOPK == 1:
        first = pick_candidates(cand_keys_ptr, cand_ids_ptr, cand_count_ptr, row, n_segments, topk_ids_ptr + n * top_k,
                                top_k, 0, KEY_BITS, S_P2, CAP)
    elif TOPK == 2:
        for j in range(0, top_k):
            picked = tl.load(given_ids_ptr + row * top_k + j)
            tl.store(topk_ids_ptr + n * top_k + j, picked)
            first = tl.where(j == 0, picked, first)
    if TOPK == 0:
        first = segments_best(best_ptr, base, segs, valid, 1, KEY_BITS, BIG)
    tl.store(draft_argmax_ptr + n, first)
    if TOPK != 0:
        # The picked ids' logits: the ids were just stored by this program.
        tl.debug_barrier()
        for j in range(0, top_k):
            picked = tl.load(topk_ids_ptr + n * top_k + j)
            z_j = z_at(z_row_ptr, picked, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
            tl.store(topk_z_ptr + n * top_k + j, z_j)
            tl.store(topk_logits_ptr + n * top_k + j, stored_as(rounded(z_j, ROUND), topk_logits_ptr.dtype.element_ty))
            if HAS_TARGET:
                t_j = z_at(t_row_ptr, picked, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
                tl.store(at_topk_ptr + n * top_k + j, t_j.to(tl.float32))
            else:
                tl.store(at_topk_ptr + n * top_k + j, tl.zeros([], tl.float32))
