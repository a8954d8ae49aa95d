"""Triton kernels of the draft head's row reduction (SPEC section 7). Kernels only.

The Triton twin of csrc/head_row_passes.h's passes, without the ranking (the top-k kernel,
topk_kernels.py, ranks): one program owns one row of a chunk of raw logits s [R, V] (and
the target's) and walks it in BLOCK_V tiles, in passes:

  AB. s -> z = softcap * tanh(scale * s / softcap) (or scale * s) stored over s, and the
      row's log-normaliser in the same pass (an online logsumexp: each tile's max and
      sum of exp(z - tile max), merged into a running fp64 (max, sum)), which saves the
      separate sum-of-exp pass over both planes that a plain max-then-sum would read;
  C.  the losses' sums, which need both normalisers (only with a target);
  D.  dL/ds into per-loss planes (forward) or the combined sum_l g_l dL_l/ds over s
      itself (backward).

One kernel, four modes (MODE, a constexpr), so that every launch shares one prologue and
one gradient pass:
  0 forward (one process): AB, C, the losses and statistics, D into planes (GRADS 1);
  1 backward (one process): AB, C's sums the gradients subtract, D combined (GRADS 2);
  2 shard statistics (vocab parallel, head/shard.py): AB, the local lse of each side (fp64);
  3 shard rows: the normalisers and sums from row_stats (merged across the ranks), C into
    the shard's shares (SHARES, fp64), D into planes or combined (GRADS), the transform
    done by D as it reads raw logits (TRANSFORM: the backward's recompute; with TRANSFORM
    the launcher asks for D alone).

Numbers: entries are computed in the planes' dtype (fp32 planes: fp32 math, as the
references' log_softmax), every tile's sums are tree sums in that dtype, and the sums
across tiles are kept in fp64: a row of 248,320 entries is ~120 tiles, and an fp32
running sum over them would lose what the contract (SPEC section 4) allows. log p -
log q is formed as (t - z) + (lse(z) - lse(t)), the normaliser difference in fp64, so a
large shared offset cancels exactly; log m for jsd as max(d, 0) + log((1 + e^-|d|) / 2)
of d = log p - log q, which neither overflows nor loses tiny m (the references'
logaddexp). Where a weight (p or q) is exactly 0 its term is 0; NaN still propagates.

Between passes a barrier: a later pass may read entries another thread stored (the
compiler picks each access's layout), and the ce label's raw logit is read before any
thread overwrites it. No atomics: every row is one program, so results are deterministic.
libdevice is not available under the Triton interpreter, so tanh is built from exp here
(in fp64 for fp32 planes too, see _tanh64).
"""

import triton
import triton.language as tl

IGNORE_INDEX = tl.constexpr(-100)


@triton.jit
def _exp(x, E: tl.constexpr):
    """e^x in E; fp32 as 2^(x * log2 e), which is what a GPU computes for tl.exp (the
    product rounded to fp32, then ex2.approx), so that the interpreter's numpy exp does not
    hide the product's rounding (up to |x * log2 e| / 2 ulps) from the tests. That error
    stays well inside the contract (the tests' margins to it are the same as with numpy's
    exp), so an exactly split exponent is not worth its extra work."""
    if E == tl.float64:
        return tl.exp(x)
    else:
        return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _tanh64(x):
    """tanh of fp64 x from exp alone (libdevice is not available under the interpreter):
    Cephes' rational approximation below |x| = 0.625, where 1 - 2 / (e^2x + 1) would
    cancel, that formula above it; within 1 ulp of fp64, NaN stays NaN, +-inf gives +-1.
    fp32 planes take it too and round once (then z is within 0.5 ulp, as torch's tanhf):
    an fp32 version of these formulas is off by up to 1.2 ulp near |x| = 0.625, too
    close to the contract's 2x for a softcap of 30 once a GPU's approximate exp adds its
    share. The fp64 math (an exp and two divisions an entry) is paid only with a softcap."""
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
def _scalar_as(value, E: tl.constexpr):
    """An fp64 scalar argument rounded to E. Through a product with an fp64 1: the
    interpreter hands scalar arguments over as Python floats, and tl.cast of one goes
    through fp32 there, which would round an fp64 logit_scale."""
    return (value * tl.full([], 1.0, tl.float64)).to(E)


@triton.jit
def _transformed(s, logit_scale, softcap, inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z = softcap * tanh(scale * s / softcap), or scale * s: scale * s and softcap * tanh
    rounded to E as the reference's tensor ops round them, the tanh and its argument in
    fp64 (s * scale / softcap as a product with 1 / softcap, given by the launcher)."""
    z = s * _scalar_as(logit_scale, E)
    if HAS_SOFTCAP:
        argument = z.to(tl.float64) * _scalar_as(inv_softcap, tl.float64)
        z = _scalar_as(softcap, E) * _tanh64(argument).to(E)
    return z


@triton.jit
def _slope_of_s(z, logit_scale, inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz/ds at transformed logits z: scale * (1 - (z / softcap)^2), or scale."""
    if HAS_SOFTCAP:
        ratio = z * _scalar_as(inv_softcap, E)
        return _scalar_as(logit_scale, E) * (1.0 - ratio * ratio)
    else:
        return tl.zeros_like(z) + _scalar_as(logit_scale, E)


@triton.jit
def _transform_row(row_ptr, vocab, logit_scale, softcap, inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """Pass AB over one row of V entries at row_ptr (unit stride): s -> z in place.
    Returns logsumexp(z) as an fp64 scalar, with torch.logsumexp's edges: NaN if any
    entry is NaN, +inf if one is +inf, -inf if all are -inf."""
    row_max = tl.full([], float("-inf"), tl.float64)
    row_sum = tl.zeros([], tl.float64)  # sum of exp(z - row_max)
    nan_seen = tl.zeros([], tl.int32)  # not int1: Triton 3.1's interpreter has no int1 scalars
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        in_row = offsets < vocab
        s = tl.load(row_ptr + offsets, mask=in_row, other=0.0)
        z = _transformed(s, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
        tl.store(row_ptr + offsets, z, mask=in_row)
        z = tl.where(in_row, z, float("-inf"))
        tile_max = tl.max(z, axis=0)
        # Shift by the tile's max when it is finite; otherwise the sum does not matter
        # (an infinite max decides the lse) and 0 keeps exp from making NaN of -inf - -inf.
        # A NaN entry gives a NaN sum whatever the max did with it (maxnum on a GPU, NaN
        # under the interpreter): that is how NaN is detected.
        finite_max = tl.abs(tile_max) < float("inf")
        tile_sum = tl.sum(_exp(z - tl.where(finite_max, tile_max, 0.0), E), axis=0).to(tl.float64)
        nan_seen = nan_seen | (tile_sum != tile_sum).to(tl.int32)
        tile_max = tile_max.to(tl.float64)
        new_max = tl.where(tile_max > row_max, tile_max, row_max)
        kept = tl.where(row_max > float("-inf"), row_sum * tl.exp(row_max - new_max), 0.0)
        added = tl.where(tile_max > float("-inf"), tile_sum * tl.exp(tile_max - new_max), 0.0)
        row_sum = kept + added
        row_max = new_max
    lse = tl.where(tl.abs(row_max) < float("inf"), row_max + tl.log(row_sum), row_max)
    return tl.where(nan_seen != 0, float("nan"), lse)


@triton.jit
def _weighted(weight, term):
    """weight * term, 0 where the weight is exactly 0 (0 log 0 = 0; NaN still propagates)."""
    return tl.where(weight == 0, 0.0, weight * term)


@triton.jit
def _soft_entries(z, t, draft_lse_e, target_lse_e, lse_gap_e, E: tl.constexpr):
    """Per-entry p = softmax(t), q = softmax(z) and d = log p - log q = (t - z) + (lse(z) - lse(t))."""
    q = _exp(z - draft_lse_e, E)
    p = _exp(t - target_lse_e, E)
    log_ratio = (t - z) + lse_gap_e
    return p, q, log_ratio


@triton.jit
def _mixture_logs(log_ratio, E: tl.constexpr):
    """(log q - log m, log p - log m), m = (p + q) / 2, from d = log p - log q:
    log m - log q = max(d, 0) + log((1 + e^-|d|) / 2), and symmetrically for p."""
    # where(), not maximum(): a GPU's maxnum would turn a NaN d into 0.
    half_log = tl.log(0.5 + 0.5 * _exp(-tl.abs(log_ratio), E))
    q_over_m = -(tl.where(log_ratio > 0, log_ratio, 0.0) + half_log)
    p_over_m = tl.where(log_ratio < 0, log_ratio, 0.0) - half_log
    return q_over_m, p_over_m


@triton.jit
def _tv_slope(p, q):
    """d(-min(p, q))/dq: -1 where q < p, -1/2 where they tie (torch.minimum's split), else 0."""
    return tl.where(q < p, -1.0, tl.where(q == p, -0.5, 0.0))


@triton.jit
def _soft_sums(z_row_ptr, t_row_ptr, vocab, draft_lse, target_lse, E: tl.constexpr,
               NEED_KL: tl.constexpr, NEED_RKL: tl.constexpr, NEED_JSD: tl.constexpr,
               NEED_OVERLAP: tl.constexpr, NEED_TV_SLOPE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass C over one row of transformed z, t: fp64 scalars (kl, rkl, jsd, overlap,
    jsd_q = sum q (log q - log m) / 2, tv_q = sum q * tv slope); those not needed are 0.
    rkl and the two q-weighted sums are also what the gradients' softmax terms subtract."""
    kl = tl.zeros([], tl.float64)
    rkl = tl.zeros([], tl.float64)
    jsd = tl.zeros([], tl.float64)
    overlap = tl.zeros([], tl.float64)
    jsd_q = tl.zeros([], tl.float64)
    tv_q = tl.zeros([], tl.float64)
    draft_lse_e = draft_lse.to(E)
    target_lse_e = target_lse.to(E)
    lse_gap_e = (draft_lse - target_lse).to(E)
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        in_row = offsets < vocab
        z = tl.load(z_row_ptr + offsets, mask=in_row, other=float("-inf"))
        t = tl.load(t_row_ptr + offsets, mask=in_row, other=float("-inf"))
        p, q, log_ratio = _soft_entries(z, t, draft_lse_e, target_lse_e, lse_gap_e, E)
        if NEED_KL:
            kl += tl.sum(tl.where(in_row, _weighted(p, log_ratio), 0.0), axis=0).to(tl.float64)
        if NEED_RKL:
            rkl += tl.sum(tl.where(in_row, _weighted(q, -log_ratio), 0.0), axis=0).to(tl.float64)
        if NEED_JSD:
            q_over_m, p_over_m = _mixture_logs(log_ratio, E)
            q_half = _weighted(q, 0.5 * q_over_m)
            jsd_q += tl.sum(tl.where(in_row, q_half, 0.0), axis=0).to(tl.float64)
            jsd += tl.sum(tl.where(in_row, 0.5 * _weighted(p, p_over_m) + q_half, 0.0), axis=0).to(tl.float64)
        if NEED_OVERLAP:
            smaller = tl.where(q < p, q, p)
            smaller = tl.where(q != q, q, smaller)  # NaN in either gives NaN, as torch.minimum
            overlap += tl.sum(tl.where(in_row, smaller, 0.0), axis=0).to(tl.float64)
        if NEED_TV_SLOPE:
            tv_q += tl.sum(tl.where(in_row, _weighted(q, _tv_slope(p, q)), 0.0), axis=0).to(tl.float64)
    return kl, rkl, jsd, overlap, jsd_q, tv_q


@triton.jit
def _loss_slope(LOSS: tl.constexpr, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E: tl.constexpr):
    """dL/dz of loss LOSS (its index in LOSS_ORDER) at one tile (before dz/ds)."""
    if LOSS == 0:  # kl_div
        return q - p
    elif LOSS == 1:  # rkl
        return _weighted(q, -log_ratio - rkl_e)
    elif LOSS == 2:  # jsd
        q_over_m, _ = _mixture_logs(log_ratio, E)
        return _weighted(q, 0.5 * q_over_m - jsd_q_e)
    elif LOSS == 3:  # tv
        return _weighted(q, _tv_slope(p, q) - tv_q_e)
    else:  # ce
        return q - one_hot


@triton.jit
def _gradient_pass(z_row_ptr, t_row_ptr, grad_row_ptr, plane_stride, vocab, label, live, draft_lse, target_lse,
                   rkl, jsd_q, tv_q, kl_weight, rkl_weight, jsd_weight, tv_weight, ce_weight, logit_scale, softcap,
                   inv_softcap, E: tl.constexpr, HAS_SOFTCAP: tl.constexpr, KL: tl.constexpr, RKL: tl.constexpr,
                   JSD: tl.constexpr, TV: tl.constexpr, CE: tl.constexpr, RKL_SLOT: tl.constexpr,
                   JSD_SLOT: tl.constexpr, TV_SLOT: tl.constexpr, CE_SLOT: tl.constexpr, GRADS: tl.constexpr,
                   TRANSFORM: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass D over one row: dL_l/ds into plane l at grad_row_ptr + slot * plane_stride
    (GRADS 1), or sum_l weight_l dL_l/ds over z itself (GRADS 2). With TRANSFORM the row
    holds raw s (and t): each tile is transformed as it is read (t stored back), so the
    recompute needs no pass of its own. Ignored rows (not live) get 0 (where(), not a
    product: their terms may be NaN)."""
    SOFT: tl.constexpr = KL or RKL or JSD or TV  # reads the target (the launcher checks there is one)
    draft_lse_e = draft_lse.to(E)
    target_lse_e = target_lse.to(E)
    lse_gap_e = (draft_lse - target_lse).to(E)
    rkl_e = rkl.to(E)
    jsd_q_e = jsd_q.to(E)
    tv_q_e = tv_q.to(E)
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        in_row = offsets < vocab
        if TRANSFORM:
            z = _transformed(tl.load(z_row_ptr + offsets, mask=in_row, other=0.0), logit_scale, softcap,
                             inv_softcap, E, HAS_SOFTCAP)
            z = tl.where(in_row, z, float("-inf"))
        else:
            z = tl.load(z_row_ptr + offsets, mask=in_row, other=float("-inf"))
        if SOFT:
            if TRANSFORM:
                t = _transformed(tl.load(t_row_ptr + offsets, mask=in_row, other=0.0), logit_scale, softcap,
                                 inv_softcap, E, HAS_SOFTCAP)
                tl.store(t_row_ptr + offsets, t, mask=in_row)
                t = tl.where(in_row, t, float("-inf"))
            else:
                t = tl.load(t_row_ptr + offsets, mask=in_row, other=float("-inf"))
            p, q, log_ratio = _soft_entries(z, t, draft_lse_e, target_lse_e, lse_gap_e, E)
        else:  # ce alone: q only (p and log_ratio unused)
            q = _exp(z - draft_lse_e, E)
            p = q
            log_ratio = q
        one_hot = tl.where(offsets == label, 1.0, 0.0).to(E)
        dz_ds = _slope_of_s(z, logit_scale, inv_softcap, E, HAS_SOFTCAP)
        if GRADS == 1:
            if KL:
                slope = _loss_slope(0, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
                tl.store(grad_row_ptr + offsets, tl.where(live, slope * dz_ds, 0.0), mask=in_row)
            if RKL:
                slope = _loss_slope(1, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
                tl.store(grad_row_ptr + RKL_SLOT * plane_stride + offsets, tl.where(live, slope * dz_ds, 0.0),
                         mask=in_row)
            if JSD:
                slope = _loss_slope(2, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
                tl.store(grad_row_ptr + JSD_SLOT * plane_stride + offsets, tl.where(live, slope * dz_ds, 0.0),
                         mask=in_row)
            if TV:
                slope = _loss_slope(3, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
                tl.store(grad_row_ptr + TV_SLOT * plane_stride + offsets, tl.where(live, slope * dz_ds, 0.0),
                         mask=in_row)
            if CE:
                slope = _loss_slope(4, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
                tl.store(grad_row_ptr + CE_SLOT * plane_stride + offsets, tl.where(live, slope * dz_ds, 0.0),
                         mask=in_row)
        else:
            combined = tl.zeros([BLOCK_V], E)
            if KL:
                combined += kl_weight * _loss_slope(0, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
            if RKL:
                combined += rkl_weight * _loss_slope(1, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
            if JSD:
                combined += jsd_weight * _loss_slope(2, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
            if TV:
                combined += tv_weight * _loss_slope(3, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
            if CE:
                combined += ce_weight * _loss_slope(4, p, q, log_ratio, one_hot, rkl_e, jsd_q_e, tv_q_e, E)
            tl.store(z_row_ptr + offsets, tl.where(live, combined * dz_ds, 0.0), mask=in_row)


@triton.jit
def _row_label(labels_ptr, row, stride_labels, HAS_LABELS: tl.constexpr):
    """The row's label (-1: none). A volatile load: where it is first needed after the
    passes, the compiler would otherwise hoist it and hold it across them (with their fp64
    values live, ptxas parked it on the stack)."""
    label = tl.full([], -1, tl.int64)
    if HAS_LABELS:
        label = tl.load(labels_ptr + row * stride_labels, volatile=True)
    return label


@triton.jit
def draft_head_rows_kernel(
    logits_ptr,  # [R, V] raw s in (MODE 3 without TRANSFORM: z); z out, or (GRADS 2) the combined dL/ds
    target_ptr,  # [R, V] raw target logits in, transformed t out (HAS_TARGET; else a stand-in)
    labels_ptr,  # [R] int64 at stride_labels: a label, -100 (ignored row) or -1 (none here) (HAS_LABELS)
    losses_ptr,  # MODE 0: [L, R] contiguous, the planes' dtype: the requested losses in LOSS_ORDER
    stats_ptr,  # MODE 0: [R, 3] contiguous: lse(z), lse(t) (0 without target), sum min(p, q) (0 without)
    shard_ptr,  # fp64, MODE 2: [R, 2] the local lse(z), lse(t); MODE 3 with SHARES: [R, 6] the shares
    row_stats_ptr,  # MODE 3: [R, 7] fp64: shift, lse(z), shift, lse(t), sum rkl, sum jsd_q, sum tv_q
    grads_ptr,  # GRADS 1: [L, R, V] at (stride_grad_loss, stride_grad_row, 1): dL/ds per loss
    grad_losses_ptr,  # GRADS 2: [L, R] at (stride_weight_loss, stride_weight_row): upstream gradients
    n_rows,
    vocab,
    stride_logits_row,
    stride_target_row,
    stride_labels,
    stride_grad_loss,
    stride_grad_row,
    stride_weight_loss,
    stride_weight_row,
    logit_scale: tl.float64,
    softcap: tl.float64,  # > 0 with HAS_SOFTCAP
    inv_softcap: tl.float64,  # 1 / softcap (with HAS_SOFTCAP)
    LOSS_MASK: tl.constexpr,  # bit i: LOSS_ORDER[i] = kl_div, rkl, jsd, tv, ce
    HAS_TARGET: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    MODE: tl.constexpr,  # 0 forward, 1 backward, 2 shard statistics, 3 shard rows (the module docstring)
    TRANSFORM: tl.constexpr,  # MODE 3: the logits are raw
    SHARES: tl.constexpr,  # MODE 3: pass C into shard_ptr
    GRADS: tl.constexpr,  # 0 none, 1 planes, 2 combined over the logits
    BLOCK_V: tl.constexpr,
):
    """One row per program (the module docstring's passes, by MODE)."""
    E: tl.constexpr = logits_ptr.dtype.element_ty
    KL: tl.constexpr = (LOSS_MASK & 1) != 0
    RKL: tl.constexpr = (LOSS_MASK & 2) != 0
    JSD: tl.constexpr = (LOSS_MASK & 4) != 0
    TV: tl.constexpr = (LOSS_MASK & 8) != 0
    CE: tl.constexpr = (LOSS_MASK & 16) != 0
    # Each requested loss's slot in the [L, ...] tensors: how many requested losses precede it.
    RKL_SLOT: tl.constexpr = LOSS_MASK & 1
    JSD_SLOT: tl.constexpr = (LOSS_MASK & 1) + ((LOSS_MASK >> 1) & 1)
    TV_SLOT: tl.constexpr = (LOSS_MASK & 1) + ((LOSS_MASK >> 1) & 1) + ((LOSS_MASK >> 2) & 1)
    CE_SLOT: tl.constexpr = (LOSS_MASK & 1) + ((LOSS_MASK >> 1) & 1) + ((LOSS_MASK >> 2) & 1) + ((LOSS_MASK >> 3) & 1)

    row = tl.program_id(0).to(tl.int64)
    z_row_ptr = logits_ptr + row * stride_logits_row
    t_row_ptr = target_ptr + row * stride_target_row
    label_z = tl.zeros([], E)
    if MODE == 0 and CE:
        label = _row_label(labels_ptr, row, stride_labels, HAS_LABELS)
        # The raw logit at the label, read before pass AB overwrites it; an out-of-range
        # label (unchecked on the device) reads nothing and makes the ce NaN.
        has_label = (label >= 0) & (label < vocab)
        label_s = tl.load(z_row_ptr + tl.where(has_label, label, 0), mask=has_label, other=float("nan"))
        label_z = _transformed(label_s, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP)
        tl.debug_barrier()

    # The normalisers: pass AB, or (MODE 3) merged across the ranks.
    draft_lse = tl.zeros([], tl.float64)
    target_lse = tl.zeros([], tl.float64)
    rkl = tl.zeros([], tl.float64)
    jsd_q = tl.zeros([], tl.float64)
    tv_q = tl.zeros([], tl.float64)
    if MODE == 3:
        row_stats = row_stats_ptr + row * 7
        draft_lse = tl.load(row_stats + 1)
        target_lse = tl.load(row_stats + 3)
        rkl = tl.load(row_stats + 4)
        jsd_q = tl.load(row_stats + 5)
        tv_q = tl.load(row_stats + 6)
    else:
        draft_lse = _transform_row(z_row_ptr, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP, BLOCK_V)
        if HAS_TARGET:
            target_lse = _transform_row(t_row_ptr, vocab, logit_scale, softcap, inv_softcap, E, HAS_SOFTCAP,
                                        BLOCK_V)
        tl.debug_barrier()

    if MODE == 2:
        tl.store(shard_ptr + row * 2, draft_lse)
        tl.store(shard_ptr + row * 2 + 1, target_lse)
    else:
        # Pass C: what this mode needs of the losses' sums.
        kl = tl.zeros([], tl.float64)
        jsd = tl.zeros([], tl.float64)
        overlap = tl.zeros([], tl.float64)
        if MODE == 0 and HAS_TARGET:
            kl, rkl, jsd, overlap, jsd_q, tv_q = _soft_sums(
                z_row_ptr, t_row_ptr, vocab, draft_lse, target_lse, E,
                KL, RKL, JSD, True, TV and GRADS == 1, BLOCK_V,
            )
            tl.debug_barrier()
        if MODE == 1 and (RKL or JSD or TV):
            _, rkl, _, _, jsd_q, tv_q = _soft_sums(
                z_row_ptr, t_row_ptr, vocab, draft_lse, target_lse, E, False, RKL, JSD, False, TV, BLOCK_V,
            )
            tl.debug_barrier()
        if MODE == 3 and SHARES and HAS_TARGET:
            # Sums against the global normalisers: rkl, jsd_q, tv_q here are this shard's
            # shares (a D pass in the same launch uses them only for kl_div / ce).
            kl, rkl, jsd, overlap, jsd_q, tv_q = _soft_sums(
                z_row_ptr, t_row_ptr, vocab, draft_lse, target_lse, E, KL, RKL, JSD, True, TV, BLOCK_V,
            )
            tl.debug_barrier()
        label = _row_label(labels_ptr, row, stride_labels, HAS_LABELS)
        live = label != IGNORE_INDEX
        if MODE == 3 and SHARES:
            shares = shard_ptr + row * 6
            tl.store(shares, tl.where(live, kl, 0.0))
            tl.store(shares + 1, tl.where(live, rkl, 0.0))
            tl.store(shares + 2, tl.where(live, jsd, 0.0))
            tl.store(shares + 3, overlap)
            tl.store(shares + 4, tl.where(live, jsd_q, 0.0))
            tl.store(shares + 5, tl.where(live, tv_q, 0.0))
        if MODE == 0:
            stats_row_ptr = stats_ptr + row * 3
            tl.store(stats_row_ptr, draft_lse.to(E))
            tl.store(stats_row_ptr + 1, target_lse.to(E))
            tl.store(stats_row_ptr + 2, overlap.to(E))
            losses_row_ptr = losses_ptr + row
            if KL:
                tl.store(losses_row_ptr, tl.where(live, kl, 0.0).to(E))
            if RKL:
                tl.store(losses_row_ptr + RKL_SLOT * n_rows, tl.where(live, rkl, 0.0).to(E))
            if JSD:
                tl.store(losses_row_ptr + JSD_SLOT * n_rows, tl.where(live, jsd, 0.0).to(E))
            if TV:
                tl.store(losses_row_ptr + TV_SLOT * n_rows, tl.where(live, 1.0 - overlap, 0.0).to(E))
            if CE:
                tl.store(losses_row_ptr + CE_SLOT * n_rows,
                         tl.where(live, draft_lse - label_z.to(tl.float64), 0.0).to(E))

        if GRADS != 0:
            zero = tl.zeros([], E)
            kl_weight = zero
            rkl_weight = zero
            jsd_weight = zero
            tv_weight = zero
            ce_weight = zero
            if GRADS == 2:
                weights_ptr = grad_losses_ptr + row * stride_weight_row
                if KL:
                    kl_weight = tl.load(weights_ptr)
                if RKL:
                    rkl_weight = tl.load(weights_ptr + RKL_SLOT * stride_weight_loss)
                if JSD:
                    jsd_weight = tl.load(weights_ptr + JSD_SLOT * stride_weight_loss)
                if TV:
                    tv_weight = tl.load(weights_ptr + TV_SLOT * stride_weight_loss)
                if CE:
                    ce_weight = tl.load(weights_ptr + CE_SLOT * stride_weight_loss)
            # slot * plane stride passes 2^31 with every loss on chunks past ~2,100 rows of V = 248,320.
            _gradient_pass(z_row_ptr, t_row_ptr, grads_ptr + row * stride_grad_row,
                           tl.cast(stride_grad_loss, tl.int64), vocab, label, live, draft_lse, target_lse, rkl,
                           jsd_q, tv_q, kl_weight, rkl_weight, jsd_weight, tv_weight, ce_weight, logit_scale,
                           softcap, inv_softcap, E, HAS_SOFTCAP, KL, RKL, JSD, TV, CE, RKL_SLOT, JSD_SLOT, TV_SLOT,
                           CE_SLOT, GRADS, MODE == 3 and TRANSFORM, BLOCK_V)
