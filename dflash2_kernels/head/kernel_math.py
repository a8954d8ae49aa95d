"""Per-entry math of the draft head's Triton kernels (SPEC section 7), shared by every pass:
the logit transform and its slope, exp, rounding to the logits' dtype, ranking keys, the
soft losses' entries and their gradients. ``@triton.jit`` helpers only, no kernels.

Numbers, as csrc/head_row_passes.h computes them on the CPU: entries in the planes'
dtype E (fp32, or fp64 for fp64 weights), each segment's sums as tree sums in E, the
sums across segments in fp64. log p - log q is (t - z) + (lse(z) - lse(t)) with the
normaliser difference in fp64, so a large shared offset cancels exactly. Rounding to a
16-bit dtype goes through fp32, as torch's conversions do (so an fp64 logit rounds twice,
exactly as ``tensor.to(torch.bfloat16)`` rounds it), and bf16 is rounded by hand: the
Triton interpreter truncates fp32 -> bf16 casts, a GPU rounds them to nearest even.
"""

import triton
import triton.language as tl

IGNORE_INDEX = tl.constexpr(-100)
# ROUND codes: what the ranking rounds a logit to (the launcher picks one per logits_dtype).
ROUND_NONE = tl.constexpr(0)  # logits_dtype at least as wide as the planes
ROUND_BF16 = tl.constexpr(1)
ROUND_FP16 = tl.constexpr(2)
ROUND_FP32 = tl.constexpr(3)  # fp64 planes ranked as fp32


@triton.jit
def exp_in(x, E: tl.constexpr):
    """e^x in E; fp32 as 2^(x * log2 e), what a GPU computes for tl.exp (the product rounded
    to fp32, then ex2.approx), so the interpreter's exact numpy exp does not hide that
    rounding (up to |x log2 e| / 2 ulps) from the tests."""
    if E == tl.float64:
        return tl.exp(x)
    else:
        return tl.exp2(x * 1.4426950408889634)


@triton.jit
def tanh64(x):
    """tanh of fp64 x from exp alone (no libdevice under the interpreter): Cephes' rational
    approximation below |x| = 0.625, where 1 - 2 / (e^2x + 1) would cancel, that formula
    above; within 1 ulp of fp64, NaN stays NaN, +-inf gives +-1. fp32 planes take it too and
    round once (z within 0.5 ulp, as torch's tanhf): an fp32 version is off by 1.2 ulp near
    0.625, too close to the contract's 2x once a GPU's approximate exp adds its share."""
    magnitude = tl.abs(x)
    square = x * x
    numerator = (-9.64399179425052238628e-1 * square - 9.92877231001918586564e1) * square - 1.61468768441708447952e3
    denominator = ((square + 1.12811678491632931402e2) * square + 2.23548839060100448583e3) * square
    denominator = denominator + 4.84406305325125486048e3
    small = x + x * square * (numerator / denominator)
    large = 1.0 - 2.0 / (tl.exp(magnitude + magnitude) + 1.0)  # e^2x = inf: 1
    large = tl.where(x < 0, -large, large)
    return tl.where(magnitude < 0.625, small, large)


@triton.jit
def scalar_as(value, E: tl.constexpr):
    """An fp64 scalar argument rounded to E, through a product with an fp64 1: the
    interpreter hands scalars over as Python floats, and tl.cast of one goes through fp32."""
    return (value * tl.full([], 1.0, tl.float64)).to(E)


@triton.jit
def transformed(s, logit_scale, softcap, inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z = softcap * tanh(scale * s / softcap), or scale * s: scale * s and softcap * tanh
    rounded to E as the reference's tensor ops round them, the tanh in fp64."""
    z = s * scalar_as(logit_scale, E)
    if HAS_SOFTCAP:
        argument = z.to(tl.float64) * scalar_as(inv_softcap, tl.float64)
        z = scalar_as(softcap, E) * tanh64(argument).to(E)
    return z


@triton.jit
def slope_of_s(z, logit_scale, inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz/ds at transformed logits z: scale * (1 - (z / softcap)^2), or scale."""
    if HAS_SOFTCAP:
        ratio = z * scalar_as(inv_softcap, E)
        return scalar_as(logit_scale, E) * (1.0 - ratio * ratio)
    else:
        return tl.zeros_like(z) + scalar_as(logit_scale, E)


@triton.jit
def bf16_rounded(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def rounded(x, ROUND: tl.constexpr):
    """x rounded as ``tensor.to(logits_dtype)`` rounds it, held in fp32 (fp64 without
    rounding from fp64 planes): the value the ranking and the logits' outputs see."""
    if ROUND == ROUND_BF16:
        return bf16_rounded(x.to(tl.float32))
    elif ROUND == ROUND_FP16:
        return x.to(tl.float32).to(tl.float16).to(tl.float32)
    elif ROUND == ROUND_FP32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def stored_as(x, D: tl.constexpr):
    """x as a value of dtype D rounded once to nearest even (bf16 by hand: see the module
    docstring), ready for tl.store into a D tensor."""
    if D == tl.bfloat16:
        return bf16_rounded(x.to(tl.float32)).to(tl.bfloat16)
    elif D == tl.float16:
        return x.to(tl.float32).to(tl.float16)
    else:
        return x.to(D)


@triton.jit
def order_key(x, KEY_BITS: tl.constexpr):
    """Order-preserving int64 keys of values x: KEY_BITS 32 for values exact in fp32 (keys in
    [0, 2^32)), 64 for fp64 (the signed int64 order); -0 as +0, every NaN the largest."""
    x = tl.where(x == 0, 0.0, x)
    if KEY_BITS == 32:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(bits < 0, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
        return tl.where(x != x, 0xFFFFFFFF, key)
    else:
        bits = x.to(tl.float64).to(tl.int64, bitcast=True)
        key = bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)
        return tl.where(x != x, 0x7FFFFFFFFFFFFFFF, key)


@triton.jit
def order_key32(x):
    """Order-preserving int32 keys of values exact in fp32, in registers half the width of
    order_key's: a float's bits with the magnitude flipped where the sign is set, -0 as +0,
    every NaN the largest; each is order_key(x, 32) less 2^31 (so it packs the same way)."""
    x = tl.where(x == 0, 0.0, x).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def key_floor(KEY_BITS: tl.constexpr):
    """An int64 key below every value's key of either form (order_key's, order_key32's): the
    empty slot."""
    return tl.full([], -0x7FFFFFFFFFFFFFFF - 1, tl.int64)


@triton.jit
def lse_partial(z, in_row, E: tl.constexpr):
    """(max, sum of e^(z - max)) of a segment, both fp64, with torch.logsumexp's edges kept
    for the merge: a NaN entry makes the sum NaN whatever the max did with it (maxnum on a
    GPU), and an infinite max shifts by 0 (its sum does not matter, the max decides)."""
    z = tl.where(in_row, z, float("-inf"))
    peak = tl.max(z, axis=0)
    finite = tl.abs(peak) < float("inf")
    total = tl.sum(exp_in(z - tl.where(finite, peak, 0.0), E), axis=0)
    return peak.to(tl.float64), total.to(tl.float64)


@triton.jit
def lse_merged(peaks, totals):
    """logsumexp from segments' (max, sum) partials [S] fp64 (padding: -inf, 0): NaN if any
    sum is NaN, the max if it is infinite, else max + log(sum of sum_i e^(max_i - max))."""
    peak = tl.max(peaks, axis=0)
    nan_seen = tl.sum((totals != totals).to(tl.int32), axis=0)
    finite = tl.abs(peak) < float("inf")
    shift = tl.where(finite, peak, 0.0)
    terms = tl.where(peaks > float("-inf"), totals * tl.exp(peaks - shift), 0.0)
    lse = tl.where(finite, peak + tl.log(tl.sum(terms, axis=0)), peak)
    return tl.where(nan_seen != 0, float("nan"), lse)


@triton.jit
def weighted(weight, term):
    """weight * term, 0 where the weight is exactly 0 (0 log 0 = 0; NaN still propagates)."""
    return tl.where(weight == 0, 0.0, weight * term)


@triton.jit
def soft_entries(z, t, draft_lse_e, target_lse_e, lse_gap_e, E: tl.constexpr):
    """Per entry p = softmax(t), q = softmax(z) and d = log p - log q = (t - z) + (lse(z) - lse(t))."""
    q = exp_in(z - draft_lse_e, E)
    p = exp_in(t - target_lse_e, E)
    log_ratio = (t - z) + lse_gap_e
    return p, q, log_ratio


@triton.jit
def mixture_logs(log_ratio, E: tl.constexpr):
    """(log q - log m, log p - log m), m = (p + q) / 2, from d = log p - log q:
    log m - log q = max(d, 0) + log((1 + e^-|d|) / 2), and symmetrically for p."""
    # where(), not maximum(): a GPU's maxnum would turn a NaN d into 0.
    half_log = tl.log(0.5 + 0.5 * exp_in(-tl.abs(log_ratio), E))
    q_over_m = -(tl.where(log_ratio > 0, log_ratio, 0.0) + half_log)
    p_over_m = tl.where(log_ratio < 0, log_ratio, 0.0) - half_log
    return q_over_m, p_over_m


@triton.jit
def tv_slope(p, q):
    """d(-min(p, q))/dq: -1 where q < p, -1/2 where they tie (torch.minimum's split), else 0."""
    return tl.where(q < p, -1.0, tl.where(q == p, -0.5, 0.0))


@triton.jit
def loss_slope(LOSS: tl.constexpr, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E: tl.constexpr):
    """dL/dz of loss LOSS (its index in LOSS_ORDER: kl_div, rkl, jsd, tv, ce) at entries,
    before dz/ds; rkl_e, jsd_q_e, tv_q_e are the row sums the softmax terms subtract."""
    if LOSS == 0:
        return q - p
    elif LOSS == 1:
        return weighted(q, -log_ratio - rkl_e)
    elif LOSS == 2:
        q_over_m, _ = mixture_logs(log_ratio, E)
        return weighted(q, 0.5 * q_over_m - jsd_q_e)
    elif LOSS == 3:
        return weighted(q, tv_slope(p, q) - tv_q_e)
    else:
        return q - one_hot
