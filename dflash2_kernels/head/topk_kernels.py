"""Triton kernel of the draft head's top-k (SPEC section 7). Kernels only.

The head's top-k for K above what the single-read candidates of scan_kernels.py cover
(K > 64). One program owns one row of raw logits s [R, V] and picks the ids of its K
largest logits after the transform and the rounding to logits_dtype, ties to the lower
id, NaN above everything: a radix select, so that the cost is a fixed number of passes
over the row whatever K is (csrc/head_row_passes.h's RowTopK is the CPU's answer):

  1. each logit, transformed and rounded as every pass does (kernel_math), becomes an
     integer key in the value order (KEY_BITS 32 for values exact in fp32, 64 for fp64;
     -0 as +0, every NaN the largest key);
  2. one pass per 8-bit digit, most significant first: a 256-bin histogram of the digit
     over the keys that match the digits chosen so far, then the digit of the K-th largest
     key and how many keys above it are already in (KEY_BITS / 8 passes in all);
  3. one pass in id order collects every key above the K-th and, of the keys equal to it,
     the lowest ids until K are taken (a running count and a scan per tile).

The K ids come out in id order with their keys; the launcher sorts those [R, K] by key
(stable, so equal keys stay in id order). No atomics across programs: deterministic.
"""

import triton
import triton.language as tl

from .kernel_math import order_key, rounded, transformed


@triton.jit
def _digits(key, KEY_BITS: tl.constexpr):
    """The key as unsigned digits: itself for 32-bit keys, its sign bit flipped for 64-bit ones."""
    if KEY_BITS == 32:
        return key
    else:
        return key ^ (-0x7FFFFFFFFFFFFFFF - 1)


@triton.jit
def draft_head_topk_kernel(
    values_ptr,  # [R, V] at stride_values_row, unit vocab stride: raw logits s (E)
    ids_ptr,  # [R, K] int64 at stride_out_row: the picked ids, in id order
    keys_ptr,  # [R, K] int64 at stride_out_row: their keys (_key)
    vocab,
    top_k,  # 1 <= top_k <= vocab
    stride_values_row,
    stride_out_row,
    logit_scale: tl.float64,
    softcap: tl.float64,
    inv_softcap: tl.float64,
    HAS_SOFTCAP: tl.constexpr,
    ROUND: tl.constexpr,  # kernel_math ROUND_* for logits_dtype
    KEY_BITS: tl.constexpr,  # 32 or 64
    BLOCK_V: tl.constexpr,
):
    """One row per program: its top_k ids by value (the module docstring)."""
    E: tl.constexpr = values_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    row_ptr = values_ptr + row * stride_values_row
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)  # the K-th key's digits chosen so far (as unsigned digits)
    known = tl.zeros([], tl.int64)  # their bits
    remaining = tl.zeros([], tl.int64) + top_k  # how many keys matching the prefix are still to take
    for level in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (level + 1)
        counts = tl.zeros([256], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            in_row = offsets < vocab
            raw = tl.load(row_ptr + offsets, mask=in_row, other=0.0)
            z = rounded(transformed(raw, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP), ROUND)
            digits = _digits(order_key(z, KEY_BITS), KEY_BITS)
            match = in_row & ((digits & known) == prefix)
            # Keys off the prefix (and past the row) counted in bin 0, then taken out of it:
            # Triton 3.1 (torch 2.5's) has no mask argument to tl.histogram.
            digit_of = tl.where(match, (digits >> shift) & 255, 0).to(tl.int32)
            unmatched = BLOCK_V - tl.sum(match.to(tl.int32), axis=0)
            counts += tl.histogram(digit_of, 256) - tl.where(bins == 0, unmatched, 0)
        # The digit d of the K-th largest: the largest d with at least `remaining` keys at or above it.
        at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
        digit = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
        remaining -= tl.sum(tl.where(bins > digit, counts, 0), axis=0).to(tl.int64)
        prefix = prefix | (digit.to(tl.int64) << shift)
        known = known | (tl.full([], 255, tl.int64) << shift)
    kth = _digits(prefix, KEY_BITS)  # back in the key order
    # Collect, in id order: every key above the K-th, and `remaining` of those equal to it.
    taken = tl.zeros([], tl.int64)
    equal_seen = tl.zeros([], tl.int64)
    out_row = row * stride_out_row
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        in_row = offsets < vocab
        raw = tl.load(row_ptr + offsets, mask=in_row, other=0.0)
        key = order_key(rounded(transformed(raw, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP), ROUND), KEY_BITS)
        equal = in_row & (key == kth)
        equal_before = equal_seen + tl.cumsum(equal.to(tl.int64), axis=0) - equal.to(tl.int64)
        picked = in_row & ((key > kth) | (equal & (equal_before < remaining)))
        position = taken + tl.cumsum(picked.to(tl.int64), axis=0) - 1
        tl.store(ids_ptr + out_row + position, offsets.to(tl.int64), mask=picked)
        tl.store(keys_ptr + out_row + position, key, mask=picked)
        taken += tl.sum(picked.to(tl.int64), axis=0)
        equal_seen += tl.sum(equal.to(tl.int64), axis=0)
