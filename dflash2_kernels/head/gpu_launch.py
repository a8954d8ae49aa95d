"""Launch plans of the draft head's Triton kernels (scan_kernels.py, sweep_kernels.py,
backward_kernels.py, topk_kernels.py, shard_kernels.py): tiles, grids, constexprs. Each ``plan_*`` takes
checked tensors and returns a :class:`KernelLaunch`, fully decided: what the GPU
drivers (gpu_driver.py, shard_gpu.py) run and tests/triton_aot.py compiles.

Warps and stages come from each kernel's configuration space (tuning/spaces.py: the
tuner's choice per shape class, timed on the user's GPU; tests/test_triton_aot.py compiles
every member for sm_80 ... sm_120, forbidding spills in the defaults). Tiles: a segment of SEG entries
(by default over 8 warps), held in registers by
the scan and the sweep: 4096 fp32 entries (16 a thread: four 16-byte loads a plane), 2048
fp64 ones, half that with a softcap (its fp64 tanh's registers). Sub-blocks of 32 for the
candidates' bar: 128 of them in an fp32 segment, so the bar stays tight up to K = 64
(MAX_CANDIDATE_K); CAP = 2 x next_pow2(K) (at least 16) candidates a segment.
"""

from __future__ import annotations

import torch

from .._launch_math import cdiv, next_power_of_2
from ..conv.launch import KernelLaunch
from ..tuning import TUNER, rows_class
from ..tuning import spaces as tuning_spaces
from .backward_kernels import draft_head_hidden_grad_kernel
from .scan_kernels import ROW_STATS, draft_head_merge_kernel, draft_head_scan_kernel
from .shard_kernels import (
    draft_head_shard_final_kernel,
    draft_head_shard_merge_kernel,
    draft_head_shard_pack_kernel,
    draft_head_shard_shares_kernel,
)
from .sweep_kernels import SUMS_WIDTH, draft_head_finish_kernel, draft_head_sparse_add_kernel, draft_head_sweep_kernel
from .topk_kernels import draft_head_topk_kernel

# Under TRITON_INTERPRET=1, triton.jit hands back an interpreter object: CPU tensors run.
KERNELS_INTERPRETED = type(draft_head_scan_kernel).__name__ == "InterpretedFunction"
ROW_STATS_WIDTH = ROW_STATS.value
SUMS_COLUMNS = SUMS_WIDTH.value
PARTIALS_WIDTH = 4
MAX_CANDIDATE_K = 64  # above: the radix select (topk_kernels.py), KEY_BITS / 8 + 1 reads of a row
SUB_BLOCK = 32
HIDDEN_BLOCK = 256  # columns of dh a backward program writes
_MAX_PROGRAMS = 2**31 - 1
KL, RKL, JSD, TV, CE = 1, 2, 4, 8, 16
# ROUND codes (kernel_math.ROUND_*).
_ROUND_NONE, _ROUND_BF16, _ROUND_FP16, _ROUND_FP32 = 0, 1, 2, 3


def segment_tiles(dtype: torch.dtype, softcap: bool) -> tuple[int, int]:
    """(SEG, default num_warps) of the scan and sweep kernels for planes of ``dtype``."""
    seg = 4096 if dtype == torch.float32 else 2048
    return (seg // 2 if softcap else seg), 8


def _tuned(space, kernel, programs: int, args: dict, constexprs: dict, device_of: torch.Tensor,
           *sizes: int) -> KernelLaunch:
    """The launch in the tuner's choice of ``space`` (warps and stages at a fixed tile) for
    the shape class: the constexprs, the planes' dtype, and ``sizes`` by power of two."""
    key = (*constexprs.values(), device_of.dtype, *(rows_class(size) for size in sizes))
    config = TUNER.choose(space, key, device_of, lambda trial: KernelLaunch(
        kernel, programs, args, constexprs, trial.num_warps, trial.num_stages))
    return KernelLaunch(kernel, programs, args, constexprs, config.num_warps, config.num_stages)


def segments(vocab: int, dtype: torch.dtype, softcap: bool) -> int:
    """How many segments a row of ``vocab`` entries splits into."""
    return max(1, cdiv(vocab, segment_tiles(dtype, softcap)[0]))


def candidate_cap(top_k: int) -> int:
    """Candidates a segment keeps at most (K <= MAX_CANDIDATE_K)."""
    return max(16, 2 * next_power_of_2(max(top_k, 1)))


def round_code(plane_dtype: torch.dtype, logits_dtype: torch.dtype) -> int:
    """What the ranking rounds a logit of the planes to (kernel_math.ROUND_*)."""
    if logits_dtype.itemsize >= plane_dtype.itemsize:
        return _ROUND_NONE
    return {torch.bfloat16: _ROUND_BF16, torch.float16: _ROUND_FP16, torch.float32: _ROUND_FP32}[logits_dtype]


def key_bits(plane_dtype: torch.dtype, logits_dtype: torch.dtype) -> int:
    """64 where the ranked values are fp64, else 32."""
    return 64 if plane_dtype == torch.float64 and logits_dtype == torch.float64 else 32


def candidate_ids_needed(plane_dtype: torch.dtype, logits_dtype: torch.dtype) -> bool:
    """Whether the candidates need an ids buffer beside their keys: 32-bit keys and their ids
    share one packed word (scan_kernels.packed_candidate), 64-bit keys do not."""
    return key_bits(plane_dtype, logits_dtype) == 64


def _scalars(logit_scale: float, softcap: float) -> dict:
    return dict(logit_scale=float(logit_scale), softcap=float(softcap),
                inv_softcap=1.0 / softcap if softcap > 0 else 0.0)


def _grid(programs: int) -> int:
    if programs > _MAX_PROGRAMS:
        raise ValueError(f"draft_head: {programs} programs exceed the grid limit {_MAX_PROGRAMS}: use smaller "
                         f"chunks (tile_mb).")
    return programs


def plan_scan(logits, target, partials, best, cand_keys, cand_ids, cand_count, top_k: int, logit_scale: float,
              softcap: float, logits_dtype: torch.dtype, candidates: bool) -> KernelLaunch:
    """The first read of a chunk: logits, target [R, V] raw (target may be None);
    partials fp64 [R, S, 4], best int64 [R, S, 4]; with ``candidates`` (1 <= top_k <=
    MAX_CANDIDATE_K) cand_keys int64 [R, S, CAP] (with cand_ids like it for 64-bit keys,
    else None: candidate_ids_needed) and cand_count int32 [R, S]."""
    rows, vocab = logits.shape
    seg, _ = segment_tiles(logits.dtype, softcap > 0)
    n_segments = partials.shape[1]
    args = dict(logits_ptr=logits, target_ptr=logits if target is None else target, partials_ptr=partials,
                best_ptr=best, cand_keys_ptr=cand_keys if candidates else best,
                cand_ids_ptr=cand_ids if candidates and cand_ids is not None else best,
                cand_count_ptr=cand_count if candidates else best,
                n_segments=n_segments, vocab=vocab, top_k=top_k, stride_logits_row=logits.stride(0),
                stride_target_row=(logits if target is None else target).stride(0), **_scalars(logit_scale, softcap))
    constexprs = dict(HAS_TARGET=target is not None, HAS_SOFTCAP=softcap > 0,
                      ROUND=round_code(logits.dtype, logits_dtype), KEY_BITS=key_bits(logits.dtype, logits_dtype),
                      CANDIDATES=bool(candidates), DRAFT_BEST=not candidates,
                      CAP=cand_keys.shape[2] if candidates else 16, SEG=seg, SUB=SUB_BLOCK)
    return _tuned(tuning_spaces.HEAD_SCAN, draft_head_scan_kernel, _grid(rows * n_segments), args, constexprs, logits,
                  rows, vocab)


def plan_merge(logits, target, partials, best, cand_keys, cand_ids, cand_count, given_ids, labels, outputs: dict,
               row_start: int, top_k: int, logit_scale: float, softcap: float, logits_dtype: torch.dtype,
               topk_mode: int, ce_slot: int) -> KernelLaunch:
    """The merge of a chunk's partials into the op's rows [row_start, row_start + R) of
    ``outputs`` (topk_ids, topk_z, topk_logits, at_topk, label_ids, label_z, label_logit,
    draft_lse, target_lse, draft_argmax, target_argmax, losses, row_stats); topk_mode 0
    (K == 0), 1 (candidates), 2 (given_ids [R, K], ordered)."""
    rows, vocab = logits.shape
    n_segments = partials.shape[1]
    o = outputs
    stand_in = partials
    args = dict(
        logits_ptr=logits, target_ptr=logits if target is None else target, partials_ptr=partials, best_ptr=best,
        cand_keys_ptr=cand_keys if topk_mode == 1 else best,
        cand_ids_ptr=cand_ids if topk_mode == 1 and cand_ids is not None else best,
        cand_count_ptr=cand_count if topk_mode == 1 else best, given_ids_ptr=given_ids if topk_mode == 2 else best,
        labels_ptr=stand_in if labels is None else labels, topk_ids_ptr=o["topk_ids"], topk_z_ptr=o["topk_z"],
        topk_logits_ptr=o["topk_logits"], at_topk_ptr=o["at_topk"], label_ids_ptr=o["label_ids"],
        label_z_ptr=o["label_z"], label_logit_ptr=o["label_logit"], draft_lse_ptr=o["draft_lse"],
        target_lse_ptr=o["target_lse"], draft_argmax_ptr=o["draft_argmax"], target_argmax_ptr=o["target_argmax"],
        overlap_ptr=o["overlap"], losses_ptr=o["losses"] if ce_slot >= 0 else o["draft_lse"], row_stats_ptr=o["row_stats"],
        row_start=row_start, n_rows=o["draft_lse"].shape[0], n_segments=n_segments, vocab=vocab, top_k=top_k,
        stride_logits_row=logits.stride(0), stride_target_row=(logits if target is None else target).stride(0),
        stride_labels=1 if labels is None else labels.stride(0), **_scalars(logit_scale, softcap))
    constexprs = dict(HAS_TARGET=target is not None, HAS_LABELS=labels is not None, HAS_SOFTCAP=softcap > 0,
                      ROUND=round_code(logits.dtype, logits_dtype), KEY_BITS=key_bits(logits.dtype, logits_dtype),
                      TOPK=topk_mode, CE_SLOT=ce_slot, S_P2=next_power_of_2(n_segments),
                      CAP=cand_keys.shape[2] if topk_mode == 1 else 16)
    space = tuning_spaces.HEAD_MERGE_CANDIDATES if topk_mode == 1 else tuning_spaces.HEAD_MERGE
    return _tuned(space, draft_head_merge_kernel, _grid(rows), args, constexprs, logits, rows, vocab)


def plan_sweep(logits, target, row_stats, label_ids, sums, planes, row_start: int, loss_mask: int, logit_scale: float,
               softcap: float, *, grads: int, plane_mask: int = 0, vocab_start: int = 0, grad_losses=None,
               topk_ids=None, grad_topk=None, grad_label=None, sparse=None) -> KernelLaunch:
    """The second read of a chunk: sums fp64 [N, S, 6] (or None: no sums), planes P
    [R, L, V] (grads 1: the losses of plane_mask) or [R, V] (grads 2: the combined
    gradient with grad_losses [L, N], topk_ids / grad_topk [N, K], grad_label [N], each
    may be None; the top-k and label gradients into ``sparse`` E [N, K + 1], zeros in,
    instead of the plane when it is given)."""
    rows, vocab = logits.shape
    seg, _ = segment_tiles(logits.dtype, softcap > 0)
    n_segments = cdiv(vocab, seg)
    stand_in = row_stats
    plane = planes if planes is not None else logits
    args = dict(
        logits_ptr=logits, target_ptr=logits if target is None else target, row_stats_ptr=row_stats,
        label_ids_ptr=label_ids, sums_ptr=stand_in if sums is None else sums, planes_ptr=plane,
        grad_losses_ptr=stand_in if grad_losses is None else grad_losses,
        topk_ids_ptr=label_ids if topk_ids is None else topk_ids,
        grad_topk_ptr=stand_in if grad_topk is None else grad_topk,
        grad_label_ptr=stand_in if grad_label is None else grad_label,
        sparse_ptr=logits if sparse is None else sparse,
        row_start=row_start, n_segments=n_segments, vocab=vocab, vocab_start=vocab_start,
        top_k=0 if topk_ids is None else topk_ids.shape[1],
        stride_logits_row=logits.stride(0), stride_target_row=(logits if target is None else target).stride(0),
        stride_plane_row=plane.stride(0), stride_plane_loss=plane.stride(1) if grads == 1 else 0,
        stride_gl_loss=0 if grad_losses is None else grad_losses.stride(0),
        stride_gl_row=0 if grad_losses is None else grad_losses.stride(1),
        stride_gt_row=0 if grad_topk is None else grad_topk.stride(0),
        stride_gt_col=0 if grad_topk is None else grad_topk.stride(1),
        stride_glabel=0 if grad_label is None else grad_label.stride(0), **_scalars(logit_scale, softcap))
    constexprs = dict(LOSS_MASK=loss_mask, HAS_TARGET=target is not None, HAS_SOFTCAP=softcap > 0,
                      SUMS=sums is not None, GRADS=grads, PLANE_MASK=plane_mask if grads == 1 else 0,
                      HAS_GRAD_LOSSES=grad_losses is not None, HAS_GRAD_TOPK=grad_topk is not None,
                      HAS_GRAD_LABEL=grad_label is not None, SPARSE_OUT=sparse is not None, SEG=seg)
    return _tuned(tuning_spaces.HEAD_SWEEP, draft_head_sweep_kernel, _grid(rows * n_segments), args, constexprs,
                  logits, rows, vocab)


def plan_sparse_add(plane, sparse, topk_ids, label_ids, column_start: int, has_topk: bool,
                    has_label: bool) -> KernelLaunch:
    """The top-k and label logits' dL/ds (sparse E [N, K + 1]) added to one vocabulary
    slice's plane P [N, C] (columns: global ids column_start + c), for the dW product."""
    rows, columns = plane.shape
    args = dict(plane_ptr=plane, sparse_ptr=sparse, topk_ids_ptr=topk_ids, label_ids_ptr=label_ids,
                column_start=column_start, columns=columns, top_k=topk_ids.shape[1],
                stride_plane_row=plane.stride(0))
    constexprs = dict(HAS_GRAD_TOPK=bool(has_topk), HAS_GRAD_LABEL=bool(has_label))
    return _tuned(tuning_spaces.HEAD_SPARSE_ADD, draft_head_sparse_add_kernel, _grid(rows), args, constexprs, plane,
                  rows, columns)


def plan_finish(sums, label_ids, losses, overlap, row_stats, row_start: int, rows: int, loss_mask: int,
                has_target: bool) -> KernelLaunch:
    """The row sums of rows [row_start, row_start + rows) from sums fp64 [N, S, 6]."""
    n_segments = sums.shape[1]
    args = dict(sums_ptr=sums, label_ids_ptr=label_ids, losses_ptr=losses if losses.numel() else sums,
                overlap_ptr=overlap, row_stats_ptr=row_stats, row_start=row_start, n_rows=label_ids.shape[0],
                n_segments=n_segments)
    constexprs = dict(LOSS_MASK=loss_mask, HAS_TARGET=has_target, S_P2=next_power_of_2(n_segments))
    return _tuned(tuning_spaces.HEAD_FINISH, draft_head_finish_kernel, _grid(rows), args, constexprs, sums, rows)


def plan_hidden_grad(out, planes, grad_losses, weight, topk_ids, topk_z, grad_topk, label_ids, label_z, grad_label,
                     logit_scale: float, softcap: float, *, vocab_start: int = 0, shard: bool = False,
                     sloped: bool = True, accumulate: bool = False) -> KernelLaunch:
    """dh [N, H] (out, rounded once to its dtype) from the kept planes E [N, L, H] (or
    None), grad_losses [L, N], and the top-k and label logits' gradients through weight's
    rows (each gradient may be None; weight and the gradients at any strides, the ids,
    logits and planes contiguous); ``sloped`` False: the gradients are dL/ds already;
    ``accumulate``: out (in the compute dtype) += the sum."""
    rows, width = out.shape
    block_h = HIDDEN_BLOCK if topk_z.element_size() <= 4 else HIDDEN_BLOCK // 2  # fp64 sums: half the columns
    h_tiles = cdiv(width, block_h)
    top_k = topk_ids.shape[1]
    stand_in = topk_z
    args = dict(
        planes_ptr=stand_in if planes is None else planes, grad_losses_ptr=stand_in if grad_losses is None else grad_losses,
        weight_ptr=weight, topk_ids_ptr=topk_ids, topk_z_ptr=topk_z,
        grad_topk_ptr=stand_in if grad_topk is None else grad_topk, label_ids_ptr=label_ids, label_z_ptr=label_z,
        grad_label_ptr=stand_in if grad_label is None else grad_label, out_ptr=out, width=width,
        vocab=weight.shape[0], vocab_start=vocab_start, top_k=top_k, h_tiles=h_tiles,
        stride_gl_loss=0 if grad_losses is None else grad_losses.stride(0),
        stride_gl_row=0 if grad_losses is None else grad_losses.stride(1), stride_weight_row=weight.stride(0),
        stride_weight_col=weight.stride(1),
        stride_gt_row=0 if grad_topk is None else grad_topk.stride(0),
        stride_gt_col=0 if grad_topk is None else grad_topk.stride(1),
        stride_glabel=0 if grad_label is None else grad_label.stride(0), stride_out_row=out.stride(0),
        logit_scale=float(logit_scale), inv_softcap=1.0 / softcap if softcap > 0 else 0.0)
    constexprs = dict(LOSSES=0 if planes is None else planes.shape[1], HAS_PLANES=planes is not None,
                      HAS_GRAD_LOSSES=grad_losses is not None, HAS_GRAD_TOPK=grad_topk is not None and top_k > 0,
                      HAS_GRAD_LABEL=grad_label is not None, HAS_SOFTCAP=softcap > 0, SHARD=bool(shard),
                      SLOPED=bool(sloped), ACCUMULATE=bool(accumulate),
                      K_BLOCK=min(16, next_power_of_2(max(top_k, 1))), BLOCK_H=block_h)
    return _tuned(tuning_spaces.HEAD_HIDDEN_GRAD, draft_head_hidden_grad_kernel, _grid(rows * h_tiles), args,
                  constexprs, weight, rows, width, weight.shape[0])


def topk_block(dtype: torch.dtype, config) -> int:
    """BLOCK_V of the radix select over planes of ``dtype`` in ``config`` of HEAD_RADIX_TOPK
    (its block_v counts fp32 entries: half as many fp64 ones, the same registers)."""
    block_v = config.params["block_v"]
    return block_v // 2 if dtype == torch.float64 else block_v


def plan_radix_topk(logits, top_k: int, ids, keys, logit_scale: float, softcap: float,
                    logits_dtype: torch.dtype) -> KernelLaunch:
    """The radix select over raw logits [R, V]: ids, keys [R, K] int64, in id order."""
    rows, vocab = logits.shape
    args = dict(values_ptr=logits, ids_ptr=ids, keys_ptr=keys, vocab=vocab, top_k=top_k,
                stride_values_row=logits.stride(0), stride_out_row=ids.stride(0), **_scalars(logit_scale, softcap))
    constexprs = dict(HAS_SOFTCAP=softcap > 0, ROUND=round_code(logits.dtype, logits_dtype),
                      KEY_BITS=key_bits(logits.dtype, logits_dtype))
    space = tuning_spaces.HEAD_RADIX_TOPK

    def launch(config) -> KernelLaunch:
        return KernelLaunch(draft_head_topk_kernel, _grid(rows), args,
                            dict(constexprs, BLOCK_V=topk_block(logits.dtype, config)), config.num_warps,
                            config.num_stages)

    key = (*constexprs.values(), logits.dtype, top_k, rows_class(rows), rows_class(vocab))
    return launch(TUNER.choose(space, key, logits, launch))


# --- the vocab-parallel shard's merges (shard_kernels.py; driver: shard_gpu.py) ----------------

SHARES_SUMS = SUMS_COLUMNS  # the shares row starts with the six sums


def send_width(candidate_slots: int) -> int:
    """int64 words a row of a shard's pack takes: ids, target id, values, target value, two lse."""
    return 2 * candidate_slots + 4


def shares_width(top_k: int) -> int:
    """fp64 columns of a shares row: the sums, z at the K ids, z at the label, t at the K ids."""
    return SHARES_SUMS + 2 * top_k + 1


def plan_shard_pack(logits, target, partials, best, cand_keys, cand_ids, cand_count, given_ids, send,
                    vocab_start: int, candidate_slots: int, picks: int, logit_scale: float, softcap: float,
                    logits_dtype: torch.dtype, topk_mode: int) -> KernelLaunch:
    """This shard's pack of a chunk into send int64 [R, send_width(candidate_slots)];
    partials [R, S, 4] with S = 0 for an empty shard (its logits [R, 0])."""
    rows, vocab = logits.shape
    n_segments = partials.shape[1]
    stand_in = send
    args = dict(logits_ptr=logits, target_ptr=logits if target is None else target, partials_ptr=partials,
                best_ptr=best, cand_keys_ptr=cand_keys if topk_mode == 1 and cand_keys is not None else stand_in,
                cand_ids_ptr=cand_ids if topk_mode == 1 and cand_ids is not None else stand_in,
                cand_count_ptr=cand_count if topk_mode == 1 and cand_count is not None else stand_in,
                given_ids_ptr=given_ids if given_ids is not None else stand_in, send_ptr=send,
                n_segments=n_segments, vocab=vocab, vocab_start=vocab_start, picks=picks,
                stride_logits_row=max(logits.stride(0), 1),
                stride_target_row=max((logits if target is None else target).stride(0), 1),
                **_scalars(logit_scale, softcap))
    constexprs = dict(HAS_TARGET=target is not None, HAS_SOFTCAP=softcap > 0,
                      KEY_BITS=key_bits(logits.dtype, logits_dtype), TOPK=topk_mode, KW=candidate_slots,
                      S_P2=max(1, next_power_of_2(n_segments)),
                      CAP=cand_keys.shape[2] if topk_mode == 1 and cand_keys is not None else 16)
    return _tuned(tuning_spaces.HEAD_SHARD_PACK, draft_head_shard_pack_kernel, _grid(rows), args, constexprs, logits,
                  rows, vocab)


def plan_shard_merge(gathered, logits, target, labels, given_ids, outputs: dict, row_start: int, vocab_start: int,
                     global_vocab: int, top_k: int, logit_scale: float, softcap: float, logits_dtype: torch.dtype,
                     topk_mode: int) -> KernelLaunch:
    """The merge of every rank's pack, gathered int64 [W, R, send_width(KW)], into the rows
    [row_start, row_start + R) of ``outputs`` (topk_ids, label_ids, draft_lse, target_lse,
    draft_argmax, target_argmax, overlap, row_stats, shares); topk_mode 1 (merge the
    candidates here) or 2 (given_ids [R, K] global, ordered)."""
    world, rows, width = gathered.shape
    slots = (width - 4) // 2
    o = outputs
    args = dict(
        gathered_ptr=gathered, logits_ptr=logits, target_ptr=logits if target is None else target,
        labels_ptr=gathered if labels is None else labels, given_ids_ptr=gathered if given_ids is None else given_ids,
        topk_ids_ptr=o["topk_ids"], label_ids_ptr=o["label_ids"], draft_lse_ptr=o["draft_lse"],
        target_lse_ptr=o["target_lse"], draft_argmax_ptr=o["draft_argmax"], target_argmax_ptr=o["target_argmax"],
        overlap_ptr=o["overlap"], row_stats_ptr=o["row_stats"], shares_ptr=o["shares"], row_start=row_start,
        world=world, vocab=logits.shape[1], vocab_start=vocab_start, global_vocab=global_vocab, top_k=top_k,
        picks=max(top_k, 1), rows_in_chunk=rows, stride_logits_row=max(logits.stride(0), 1),
        stride_target_row=max((logits if target is None else target).stride(0), 1),
        stride_labels=1 if labels is None else labels.stride(0), **_scalars(logit_scale, softcap))
    constexprs = dict(HAS_TARGET=target is not None, HAS_LABELS=labels is not None, HAS_SOFTCAP=softcap > 0,
                      ROUND=round_code(logits.dtype, logits_dtype), KEY_BITS=key_bits(logits.dtype, logits_dtype),
                      TOPK=topk_mode, KW=slots, W_P2=next_power_of_2(world),
                      KW_P2=next_power_of_2(slots))
    return _tuned(tuning_spaces.HEAD_SHARD_MERGE, draft_head_shard_merge_kernel, _grid(rows), args, constexprs, logits,
                  rows, logits.shape[1])


def plan_shard_shares(sums, shares, row_start: int, rows: int, top_k: int) -> KernelLaunch:
    """This shard's segment sums fp64 [N, S, 6] (S may be 0) of rows [row_start, row_start +
    rows) into shares fp64 [N, shares_width(top_k)]."""
    n_segments = sums.shape[1]
    args = dict(sums_ptr=sums if sums.numel() else shares, shares_ptr=shares, row_start=row_start,
                n_segments=n_segments, top_k=top_k)
    return _tuned(tuning_spaces.HEAD_SHARD_SHARES, draft_head_shard_shares_kernel, _grid(rows), args,
                  dict(S_P2=max(1, next_power_of_2(n_segments))), shares, rows, top_k)


def plan_shard_final(outputs: dict, row_start: int, rows: int, top_k: int, loss_mask: int, has_target: bool,
                     plane_dtype_: torch.dtype, logits_dtype: torch.dtype) -> KernelLaunch:
    """The summed shares of rows [row_start, row_start + rows) into ``outputs``' losses,
    overlap, row_stats, topk_z / topk_logits, at_topk, label_z / label_logit."""
    o = outputs
    args = dict(shares_ptr=o["shares"], label_ids_ptr=o["label_ids"],
                losses_ptr=o["losses"] if o["losses"].numel() else o["shares"], overlap_ptr=o["overlap"],
                row_stats_ptr=o["row_stats"], topk_z_ptr=o["topk_z"], topk_logits_ptr=o["topk_logits"],
                at_topk_ptr=o["at_topk"], label_z_ptr=o["label_z"], label_logit_ptr=o["label_logit"],
                row_start=row_start, n_rows=o["label_ids"].shape[0], top_k=top_k)
    constexprs = dict(LOSS_MASK=loss_mask, HAS_TARGET=has_target, ROUND=round_code(plane_dtype_, logits_dtype))
    return _tuned(tuning_spaces.HEAD_SHARD_FINAL, draft_head_shard_final_kernel, _grid(rows), args, constexprs,
                  o["shares"], rows, top_k)
