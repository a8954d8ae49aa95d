"""Launchers of the draft head's Triton row kernel (row_kernels.py): checks, tiles, grids.

One chunk of R rows of raw logits s = h W^T [R, V] (and the target's t) at a time, as
csrc/head_cpu.cpp's CPU op takes it (head_rows_triton, head_rows_backward_triton), or a
vocab-parallel rank's shard of them, as csrc/head_shard_cpu.cpp's ops take it
(shard_stats_triton, shard_rows_triton). The ranking is the top-k kernel's
(topk_launch.py), on the transformed logits the row kernel leaves in place.

Grid: one program per row, looping over V in BLOCK_V tiles. Every loss is a per-row
reduction, so a row in one program needs no cross-program merge (no partials buffer,
no second launch, no atomics: deterministic); a chunk brings hundreds of rows, several
waves of programs over the H200's 132 SMs (serving: 32 x 8 = 256 rows, two). Splitting V
over programs (and merging partial sums in a second launch) would pay off only for chunks
of fewer rows than SMs.

Tiles (sm_90; tests/test_triton_aot.py compiles the variants for sm_80 ... sm_120 and forbids
spills, but for the ones ptxas makes on sm_100 with every loss, listed there):
BLOCK_V = 2048 fp32 / 1024 fp64 entries with 8 warps, i.e. 8 (4) entries a thread, two
16-byte loads per plane per tile. The wider the tile, the fewer per-tile reductions
(each a cross-warp round through shared memory and a barrier) per entry, and 8 entries a
thread stay cheap in registers: kl_div with planes 39 a thread (six programs, 48 warps
an SM), every loss 76 (three programs), fp64 every loss 96. With a softcap the tanh runs
in fp64 (row_kernels._tanh64) and 4 fp32 entries a thread already spill (ptxas settles
at 80 registers with every loss): 2 entries a thread there, BLOCK_V 1024 over 16 warps
(fp32) or 512 over 16 (fp64: one entry a thread; over 8 warps the fp64 divisions' slow
path needed a stack frame in the shard backward's fused transform). (Register counts from
before the four modes became one kernel; the test's bound is no spill and no stack.) Not
measured on a GPU yet.
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import reference
from ..conv.launch import KernelLaunch
from .checks import loss_count
from .row_kernels import draft_head_rows_kernel

LOSS_ORDER = reference.DRAFT_HEAD_LOSSES  # bit i of loss_mask = LOSS_ORDER[i]
assert LOSS_ORDER == ("kl_div", "rkl", "jsd", "tv", "ce"), "row_kernels.py hard-codes this order"
SOFT_LOSS_MASK = 0b01111  # kl_div, rkl, jsd, tv: need target_logits
CE_MASK = 0b10000  # ce: needs labels
IGNORE_INDEX = reference.IGNORE_INDEX
NO_LABEL = -1

# Under TRITON_INTERPRET=1, triton.jit hands back an interpreter object: CPU tensors run.
KERNELS_INTERPRETED = type(draft_head_rows_kernel).__name__ == "InterpretedFunction"

# (plane dtype, softcap) -> (BLOCK_V, num_warps); see the module docstring.
_TILES = {
    (torch.float32, False): (2048, 8),  # 8 entries a thread: two 16-byte loads a plane
    (torch.float64, False): (1024, 8),  # 4 entries a thread: the same bytes
    (torch.float32, True): (1024, 16),  # 2 entries a thread: the fp64 tanh's registers
    (torch.float64, True): (512, 16),  # 1 entry a thread: see the module docstring
}
_MAX_PROGRAMS = 2**31 - 1


def row_tiles(dtype: torch.dtype, softcap: bool) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernels for planes of ``dtype``, with or without a softcap."""
    return _TILES[(dtype, bool(softcap))]


# --- argument checks (before any launch) ------------------------------------------------


def _check_plane(name: str, plane, rows: int | None, vocab: int | None, dtype, device) -> None:
    if not isinstance(plane, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(plane).__name__}.")
    if dtype is None:
        if plane.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64, got {plane.dtype}.")
    elif plane.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} (the dtype of logits), got {plane.dtype}.")
    if plane.dim() != 2:
        raise ValueError(f"{name} must be [rows, vocab], got shape {tuple(plane.shape)}.")
    if rows is not None and tuple(plane.shape) != (rows, vocab):
        raise ValueError(f"{name} must be [{rows}, {vocab}] like logits, got {tuple(plane.shape)}.")
    if device is not None and plane.device != device:
        raise ValueError(f"{name} must be on {device} like logits, got {plane.device}.")
    if plane.shape[1] > 1 and plane.stride(1) != 1:
        raise ValueError(f"{name} must have a unit last stride, got strides {plane.stride()}.")
    if plane.shape[0] > 1 and plane.stride(0) < plane.shape[1]:
        raise ValueError(f"{name}'s rows overlap (row stride {plane.stride(0)} < vocab {plane.shape[1]}): "
                         "the kernels write the rows in place.")


def _check_device(logits: torch.Tensor) -> None:
    if logits.device.type == "cuda" or logits.device.type == "meta":
        return
    if logits.device.type == "cpu" and KERNELS_INTERPRETED:
        return
    raise ValueError(f"logits must be a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), got one on "
                     f"{logits.device}.")


def _check_scalars(loss_mask, logit_scale, softcap) -> None:
    if isinstance(loss_mask, bool) or not isinstance(loss_mask, numbers.Integral):
        raise TypeError(f"loss_mask must be an int, got {type(loss_mask).__name__}.")
    if not 0 <= loss_mask < 1 << len(LOSS_ORDER):
        raise ValueError(f"loss_mask must be in [0, {(1 << len(LOSS_ORDER)) - 1}], got {loss_mask}.")
    for name, value in (("logit_scale", logit_scale), ("softcap", softcap)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}.")
    if not math.isfinite(logit_scale) or logit_scale == 0:
        raise ValueError(f"logit_scale must be finite and nonzero, got {logit_scale}.")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: none), got {softcap}.")


def _check_labels(labels, rows: int, vocab: int, device, loss_mask: int, absent: bool = False) -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}.")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64, got {labels.dtype}.")
    if tuple(labels.shape) != (rows,):
        raise ValueError(f"labels must be [{rows}] (one per row of logits), got shape {tuple(labels.shape)}.")
    if labels.device != device:
        raise ValueError(f"labels must be on {device} like logits, got {labels.device}.")
    # Values are checked where that costs no device sync; on a GPU the kernel never reads
    # outside the row for a bad label, it makes that row's ce NaN instead.
    if labels.device.type == "cpu" and rows:
        allowed = (labels == IGNORE_INDEX) | ((labels >= 0) & (labels < vocab))
        if absent or not loss_mask & CE_MASK:
            allowed |= labels == NO_LABEL
        if not bool(allowed.all()):
            bad = int(labels[~allowed][0])
            extra = ", -1 (no label)" if absent or not loss_mask & CE_MASK else ""
            raise IndexError(f"labels holds {bad}, out of range for a vocabulary of {vocab} "
                             f"(allowed: [0, {vocab}), -100 (ignored row){extra}).")


def _check_common(logits, target_logits, labels, loss_mask, logit_scale, softcap,
                  absent_labels: bool = False) -> tuple[int, int]:
    """The checks every launcher shares; returns (rows, vocab). absent_labels: -1 is a
    label (one on another shard) even with ce."""
    _check_plane("logits", logits, None, None, None, None)
    rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1, got shape {tuple(logits.shape)}.")
    _check_device(logits)
    _check_scalars(loss_mask, logit_scale, softcap)
    if target_logits is not None:
        _check_plane("target_logits", target_logits, rows, vocab, logits.dtype, logits.device)
        if logits.device.type != "meta" and target_logits.data_ptr() == logits.data_ptr():
            raise ValueError("target_logits must not be logits itself (both are written in place).")
    elif loss_mask & SOFT_LOSS_MASK:
        raise ValueError("loss_mask asks for a soft loss (kl_div, rkl, jsd, tv), which needs target_logits.")
    if labels is not None:
        _check_labels(labels, rows, vocab, logits.device, loss_mask, absent_labels)
    elif loss_mask & CE_MASK:
        raise ValueError("loss_mask asks for ce, which needs labels (resolved by the caller).")
    return rows, vocab


# --- plans: one launch, fully decided (what the launchers run and the AOT test compiles) -

# row_kernels.draft_head_rows_kernel's modes.
FORWARD, BACKWARD, SHARD_STATS, SHARD_ROWS = 0, 1, 2, 3


def plan_head_rows(mode: int, logits, target_logits, labels, loss_mask, logit_scale, softcap, *, losses=None,
                   stats=None, shard_out=None, row_stats=None, loss_grads=None, grad_losses=None,
                   transform=False, shares=False) -> KernelLaunch:
    """The launch of ``mode`` over checked arguments. Outputs by mode: FORWARD writes losses
    [L, R] and stats [R, 3] (and the [L, R, V] loss_grads planes when given); BACKWARD the
    combined dL/ds over logits (grad_losses [L, R]); SHARD_STATS shard_out [R, 2] float64;
    SHARD_ROWS (row_stats [R, 7] float64) shard_out [R, 6] float64 with ``shares``, and
    loss_grads or, with grad_losses, the combined dL/ds."""
    rows, vocab = logits.shape
    block_v, num_warps = row_tiles(logits.dtype, softcap > 0)
    if loss_grads is not None and loss_grads.shape[0] > 0:
        grads = 1
    elif grad_losses is not None:
        grads = 2
    else:
        grads = 0
    # Stand-ins for absent tensors: the kernel never touches them (constexpr-pruned).
    planes = loss_grads if grads == 1 else logits
    weights = grad_losses if grads == 2 and grad_losses.shape[0] else None
    args = dict(
        logits_ptr=logits,
        target_ptr=logits if target_logits is None else target_logits,
        labels_ptr=logits if labels is None else labels,
        # No loss: losses is [0, R] (perhaps no storage); never written, stats stands in.
        losses_ptr=losses if losses is not None and losses.shape[0] else (logits if stats is None else stats),
        stats_ptr=logits if stats is None else stats,
        shard_ptr=logits if shard_out is None else shard_out,
        row_stats_ptr=logits if row_stats is None else row_stats,
        grads_ptr=planes,
        grad_losses_ptr=logits if weights is None else weights,
        n_rows=rows, vocab=vocab,
        stride_logits_row=logits.stride(0),
        stride_target_row=(logits if target_logits is None else target_logits).stride(0),
        stride_labels=1 if labels is None else labels.stride(0),
        stride_grad_loss=planes.stride(0) if grads == 1 else 0,
        stride_grad_row=planes.stride(1) if grads == 1 else 0,
        stride_weight_loss=weights.stride(0) if weights is not None else 0,
        stride_weight_row=weights.stride(1) if weights is not None else 0,
        logit_scale=float(logit_scale), softcap=float(softcap), inv_softcap=1.0 / softcap if softcap > 0 else 0.0,
    )
    constexprs = dict(
        LOSS_MASK=loss_mask, HAS_TARGET=target_logits is not None, HAS_LABELS=labels is not None,
        HAS_SOFTCAP=softcap > 0, MODE=mode, TRANSFORM=bool(transform), SHARES=bool(shares), GRADS=grads,
        BLOCK_V=block_v,
    )
    return KernelLaunch(draft_head_rows_kernel, rows, args, constexprs, num_warps)


# --- the launchers -----------------------------------------------------------------------


def head_rows_triton(logits, target_logits, labels, loss_mask, logit_scale, softcap, loss_grads=None):
    """Forward over one chunk of R rows of a vocabulary of V.

    logits: [R, V] float32 or float64, unit last stride (the row stride may exceed V): the
      raw draft logits s = h W^T, overwritten IN PLACE by the transformed logits
      z = softcap * tanh(logit_scale * s / softcap) (softcap > 0) or z = logit_scale * s.
    target_logits: [R, V] like logits, or None: the raw target logits, likewise overwritten by t.
    labels: [R] int64 or None: per row the ce label (resolved by the caller), -100 = an
      ignored row (its losses and gradient planes 0), -1 = no label (only without ce).
      Values are checked on CPU tensors (IndexError); on a GPU (no sync) a bad label
      makes its row's ce NaN, never a read outside the row.
    loss_mask: int, bit i = LOSS_ORDER[i]; kl_div, rkl, jsd, tv need target_logits, ce labels.
    logit_scale: finite, nonzero; softcap: finite, >= 0 (0: no tanh).
    loss_grads: None, or [L, R, V] like logits (L = popcount(loss_mask)), unit last stride:
      filled with dL_l/ds (w.r.t. the raw s, dz/ds included) per requested loss in
      LOSS_ORDER order; 0 on ignored rows.

    Returns (losses [L, R], stats [R, 3]) in logits' dtype: stats = (lse(z), lse(t) (0
    without a target), sum_v min(p_v, q_v) (0 without; also on ignored rows)), with
    q = softmax(z), p = softmax(t). Raises TypeError / ValueError / IndexError naming the
    argument before any launch.
    """
    rows, vocab = _check_common(logits, target_logits, labels, loss_mask, logit_scale, softcap)
    losses_n = loss_count(loss_mask)
    if loss_grads is not None:
        if not isinstance(loss_grads, torch.Tensor):
            raise TypeError(f"loss_grads must be a torch.Tensor or None, got {type(loss_grads).__name__}.")
        if loss_grads.dtype != logits.dtype:
            raise TypeError(f"loss_grads must be {logits.dtype} (the dtype of logits), got {loss_grads.dtype}.")
        if tuple(loss_grads.shape) != (losses_n, rows, vocab):
            raise ValueError(f"loss_grads must be [{losses_n}, {rows}, {vocab}] (one plane per requested loss), "
                             f"got {tuple(loss_grads.shape)}.")
        if loss_grads.device != logits.device:
            raise ValueError(f"loss_grads must be on {logits.device} like logits, got {loss_grads.device}.")
        if vocab > 1 and loss_grads.stride(2) != 1:
            raise ValueError(f"loss_grads must have a unit last stride, got strides {loss_grads.stride()}.")
    losses = torch.empty((losses_n, rows), dtype=logits.dtype, device=logits.device)
    stats = torch.empty((rows, 3), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return losses, stats
    _check_grid(rows)
    plan_head_rows(FORWARD, logits, target_logits, labels, loss_mask, logit_scale, softcap, losses=losses,
                   stats=stats, loss_grads=loss_grads).run(logits)
    return losses, stats


def head_rows_backward_triton(logits, target_logits, labels, loss_mask, logit_scale, softcap, grad_losses):
    """Backward recompute over one chunk (arguments as :func:`head_rows_triton`).

    logits (raw s) is overwritten IN PLACE with the combined gradient
    sum_l grad_losses[l, r] * dL_l/ds (the dense part only: the caller adds the sparse
    top-k and label terms), 0 on ignored rows; target_logits with the transformed t.
    grad_losses: [L, R] in logits' dtype, any strides.
    """
    rows, vocab = _check_common(logits, target_logits, labels, loss_mask, logit_scale, softcap)
    losses_n = loss_count(loss_mask)
    if not isinstance(grad_losses, torch.Tensor):
        raise TypeError(f"grad_losses must be a torch.Tensor, got {type(grad_losses).__name__}.")
    if grad_losses.dtype != logits.dtype:
        raise TypeError(f"grad_losses must be {logits.dtype} (the dtype of logits), got {grad_losses.dtype}.")
    if tuple(grad_losses.shape) != (losses_n, rows):
        raise ValueError(f"grad_losses must be [{losses_n}, {rows}] (one row per requested loss), "
                         f"got {tuple(grad_losses.shape)}.")
    if grad_losses.device != logits.device:
        raise ValueError(f"grad_losses must be on {logits.device} like logits, got {grad_losses.device}.")
    if rows == 0:
        return
    _check_grid(rows)
    plan_head_rows(BACKWARD, logits, target_logits, labels, loss_mask, logit_scale, softcap,
                   grad_losses=grad_losses).run(logits)


def _check_matrix(name: str, tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}.")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {tuple(tensor.shape)}.")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} like logits, got {tensor.device}.")


def shard_stats_triton(logits, target_logits, top_k, logit_scale, softcap, logits_dtype):
    """The vocab-parallel head's first pass over one rank's chunk (csrc/head_shard_cpu.cpp's
    draft_head_shard_stats_cpu, on CUDA): logits [R, V_local] raw in, z out (target_logits
    likewise) -> (stats [R, 3] float64: local lse of z, of t, t at the target's local argmax;
    topk_ids [R, k] int64 local, by the logits rounded to logits_dtype, ties to the lower
    id; topk_values [R, k] float64, z there; target_argmax [R] int64 local)."""
    from .topk_launch import row_topk_triton

    rows, vocab = _check_common(logits, target_logits, None, 0, logit_scale, softcap)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in [0, {vocab}], got {top_k!r}.")
    if logits_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"logits_dtype must be a float dtype, got {logits_dtype!r}.")
    local_lse = torch.empty((rows, 2), dtype=torch.float64, device=logits.device)
    if rows:
        _check_grid(rows)
        plan_head_rows(SHARD_STATS, logits, target_logits, None, 0, logit_scale, softcap,
                       shard_out=local_lse).run(logits)
    rounded = logits if logits_dtype.itemsize >= logits.dtype.itemsize else logits.to(logits_dtype)
    topk_ids = row_topk_triton(rounded, top_k)
    stats = torch.zeros((rows, 3), dtype=torch.float64, device=logits.device)
    stats[:, 0] = local_lse[:, 0]
    target_argmax = torch.zeros(rows, dtype=torch.long, device=logits.device)
    if target_logits is not None:
        target_argmax = torch.argmax(target_logits.to(logits_dtype), dim=1)
        stats[:, 1] = local_lse[:, 1]
        stats[:, 2] = target_logits.gather(1, target_argmax[:, None])[:, 0]
    return stats, topk_ids, logits.gather(1, topk_ids).double(), target_argmax


def shard_rows_triton(logits, target_logits, labels, loss_mask, logit_scale, softcap, row_stats, transform, shares,
                      loss_grads, grad_losses):
    """The vocab-parallel head's second pass over one rank's chunk (csrc/head_shard_cpu.cpp's
    draft_head_shard_rows_cpu, on CUDA): labels [R] local (-1: on another shard), row_stats
    [R, 7] float64 (the merged normalisers and sums) -> shares [R, 6] float64 (or [0, 6]);
    dL/ds into loss_grads [L, R, V_local], or with grad_losses [L, R] over logits."""
    if labels is None:
        raise TypeError("labels must be a torch.Tensor ([R] int64: local ids, -1 elsewhere, -100 ignored), got None.")
    rows, vocab = _check_common(logits, target_logits, labels, loss_mask, logit_scale, softcap, absent_labels=True)
    _check_matrix("row_stats", row_stats, (rows, 7), torch.float64, logits.device)
    losses_n = loss_count(loss_mask)
    if loss_grads is not None and grad_losses is not None:
        raise ValueError("loss_grads (forward) and grad_losses (backward) exclude each other: pass one.")
    if loss_grads is not None:
        _check_matrix("loss_grads", loss_grads, (losses_n, rows, vocab), logits.dtype, logits.device)
        if vocab > 1 and loss_grads.stride(2) != 1:
            raise ValueError(f"loss_grads must have a unit last stride, got strides {loss_grads.stride()}.")
        if shares and loss_mask & 0b01110:
            raise ValueError("loss_grads with shares: rkl, jsd and tv's gradients need the row sums of every shard "
                             "(row_stats' last columns): merge the shares first, then pass loss_grads in a second "
                             "call.")
    if grad_losses is not None:
        _check_matrix("grad_losses", grad_losses, (losses_n, rows), logits.dtype, logits.device)
    if transform and (shares or grad_losses is None):
        raise ValueError("transform (raw logits in) is the backward's recompute here: pass grad_losses, and shares "
                         "False (the kernel transforms each tile as its gradient pass reads it).")
    out = torch.empty((rows if shares else 0, 6), dtype=torch.float64, device=logits.device)
    if rows:
        _check_grid(rows)
        plan_head_rows(SHARD_ROWS, logits, target_logits, labels, loss_mask, logit_scale, softcap,
                       shard_out=out if shares else None, row_stats=row_stats.contiguous(), loss_grads=loss_grads,
                       grad_losses=grad_losses, transform=transform, shares=shares).run(logits)
    return out


def _check_grid(rows: int) -> None:
    if rows > _MAX_PROGRAMS:
        raise ValueError(f"logits has {rows} rows, more than the grid limit {_MAX_PROGRAMS} (one program a row).")
