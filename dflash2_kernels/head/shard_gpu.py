"""One rank's part of the vocab-parallel draft head on the Triton kernels (CUDA, or CPU
tensors under ``DFLASH2_BACKEND=triton`` with Triton's interpreter): the GPU twin of
shard_cpu.py, by gpu_driver.py's rules (shard.py holds what both share: the plan, the
collectives, the autograd Function).

Per chunk of R rows (every rank walks the same chunks: tiles.gpu_tile_rows over the
largest shard, without the device's free memory, which differs between ranks):
  1-2. s = h W_local^T (and t) straight into the chunk's planes (gemm.project);
  3.   draft_head_scan_kernel over the shard: its normalisers' partials, the target's best,
       its candidates for max(K, 1) picks (the radix select above 64);
  4.   draft_head_shard_pack_kernel: one int64 row a row of this shard's lse, best picks
       (global ids, unrounded z) and target best;
  5.   all_gather of the packs ([W, R, 2 KW + 4] int64);
  6.   draft_head_shard_merge_kernel: the global lse, top-k, argmaxes and label, and this
       rank's share of the logits at the merged ids and the label;
  7.   draft_head_sweep_kernel: the shard's sums and, where the forward keeps hidden's
       gradient, dL/ds of kl_div and ce into the planes (ids global through vocab_start);
  8.   one GEMM for the planes: this shard's part of dL_l/dh.
With rkl, jsd or tv gradients each chunk also sums and merges its shares (steps 9-11)
before a read for their planes; otherwise steps 9-11 run once for all rows after the
loop: draft_head_shard_shares_kernel, one all_reduce SUM of the shares [N, 2K + 7]
(float64), draft_head_shard_final_kernel. Every collective moves O(R K) elements.

Backward: the planes' rows and this shard's top-k and label W rows in one launch
(draft_head_hidden_grad_kernel, SHARD), or the recompute over the shard's vocabulary
slices (gpu_driver.recomputed_grads); then one all_reduce SUM of hidden's gradient [N, H] in the
compute dtype, rounded once to hidden's dtype. Each rank's dW is its own rows of one
process's.
"""

from __future__ import annotations

import torch

from . import gemm, shard_common
from .checks import SOFT_LOSS_MASK, loss_count
from .gpu_driver import ROW_SUM_GRADS, in_weight_dtype, outputs, recomputed_grads, slice_columns
from .gpu_launch import (
    CE,
    KL,
    MAX_CANDIDATE_K,
    PARTIALS_WIDTH,
    SUMS_COLUMNS,
    candidate_cap,
    candidate_ids_needed,
    plan_hidden_grad,
    plan_radix_topk,
    plan_scan,
    plan_shard_final,
    plan_shard_merge,
    plan_shard_pack,
    plan_shard_shares,
    plan_sweep,
    segments,
    send_width,
    shares_width,
)
from .tiles import gpu_tile_rows, plane_dtype


def _outputs(rows: int, losses: int, top_k: int, dtype, logits_dtype, device) -> dict:
    """The single-process outputs without hidden_grads (a shard keeps no planes), plus the
    fp64 [rows, shares_width(K)] shares each rank sends to the others."""
    out = outputs(rows, losses, top_k, 0, dtype, logits_dtype, False, device)
    del out["hidden_grads"]
    out["shares"] = torch.empty((rows, shares_width(top_k)), dtype=torch.float64, device=device)
    return out


def _merge_ranks_candidates(gathered: torch.Tensor, top_k: int, vocab: int, logits_dtype) -> torch.Tensor:
    """The merged top-k ids [R, K] of every rank's candidates (K above MAX_CANDIDATE_K: the
    packs' [W, R, K] ids and fp64 values, ranked as one process ranks them; O(R W K) aten)."""
    slots = (gathered.shape[2] - 4) // 2
    ids = gathered[:, :, :slots]
    values = gathered[:, :, slots + 1:2 * slots + 1].contiguous().view(torch.float64)
    merged, _ = shard_common.merged_candidates(values, ids, top_k, vocab, logits_dtype)
    return merged.contiguous()


def forward(hidden, weight, target_hidden, target_weight, labels, plan, needs):
    """(results, saved tensors, saved metadata): results as shard._ShardHead returns them."""
    needs_hidden, needs_weight, planes_kept = needs
    rows, width = hidden.shape
    local = weight.shape[0]
    device = hidden.device
    dtype = gemm.compute_dtype(weight.dtype)
    mask = plan.loss_mask
    losses = loss_count(mask)
    has_target = target_hidden is not None
    has_label = labels is not None or has_target
    target_weight = weight if target_weight is None else target_weight
    top_k = plan.top_k
    slots = max(top_k, 1)  # the draft's argmax is the first pick, with K == 0 too
    picks = min(slots, local)
    topk_mode = 1 if slots <= MAX_CANDIDATE_K else 2
    scalars = (plan.logit_scale, plan.softcap)
    out = _outputs(rows, losses, top_k, dtype, plan.logits_dtype, device)
    keep = planes_kept and losses > 0
    hidden_grads = (torch.zeros((rows, losses, width), dtype=dtype, device=device) if keep and not local else
                    torch.empty((rows, losses, width) if keep else (0,), dtype=dtype, device=device))
    if rows:
        chunk = gpu_tile_rows(rows, max(1, plan.largest_shard), losses, has_target, planes_kept, weight.dtype,
                              plan.logits_dtype, plan.tile_mb, device, width, free_memory=False)
        n_segments = segments(local, dtype, plan.softcap > 0) if local else 0
        h = in_weight_dtype(hidden, weight)
        th = in_weight_dtype(target_hidden, target_weight)
        f64, i64 = torch.float64, torch.long
        s_all = torch.empty((chunk, local), dtype=dtype, device=device)
        t_all = torch.empty((chunk, local), dtype=dtype, device=device) if has_target else None
        partials = torch.empty((chunk, n_segments, PARTIALS_WIDTH), dtype=f64, device=device)
        best = torch.empty((chunk, n_segments, PARTIALS_WIDTH), dtype=i64, device=device)
        cap = candidate_cap(slots)
        candidates = topk_mode == 1 and local > 0
        cand = [torch.empty((chunk, n_segments, cap), dtype=i64, device=device) if candidates else None,
                torch.empty((chunk, n_segments, cap), dtype=i64, device=device)
                if candidates and candidate_ids_needed(dtype, plan.logits_dtype) else None,
                torch.empty((chunk, n_segments), dtype=torch.int32, device=device) if candidates else None]
        send = torch.empty((chunk, send_width(slots)), dtype=i64, device=device)
        planes = torch.empty((chunk, losses, local), dtype=plane_dtype(weight.dtype), device=device) \
            if keep and local else None
        sums = torch.empty((rows, n_segments, SUMS_COLUMNS), dtype=f64, device=device)
        first_planes = mask & (KL | CE) if planes is not None else 0
        later_planes = mask & ROW_SUM_GRADS if keep else 0
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            count = stop - start
            s = s_all[:count]
            t = None if t_all is None else t_all[:count]
            given = None
            if local:
                gemm.project(s, h[start:stop], weight)
                if t is not None:
                    gemm.project(t, th[start:stop], target_weight)
                plan_scan(s, t, partials[:count], best[:count], *[c if c is None else c[:count] for c in cand],
                          picks, *scalars, plan.logits_dtype, candidates).run(s)
                if topk_mode == 2:
                    ids = torch.empty((count, picks), dtype=i64, device=device)
                    keys = torch.empty_like(ids)
                    plan_radix_topk(s, picks, ids, keys, *scalars, plan.logits_dtype).run(s)
                    given = ids.gather(1, torch.sort(keys, dim=1, descending=True, stable=True).indices)
                    given = torch.nn.functional.pad(given, (0, slots - picks), value=-1).contiguous()
            plan_shard_pack(s, t, partials[:count], best[:count], *[c if c is None else c[:count] for c in cand],
                            given, send[:count], plan.start, slots, picks, *scalars, plan.logits_dtype,
                            topk_mode).run(send)
            gathered = shard_common.all_gather_ranks(send[:count], plan.group)
            merged = None if topk_mode == 1 else _merge_ranks_candidates(gathered, top_k, plan.vocab,
                                                                         plan.logits_dtype)
            plan_shard_merge(gathered, s, t, labels, merged, out, start, plan.start, plan.vocab, top_k, *scalars,
                             plan.logits_dtype, topk_mode).run(send)
            chunk_planes = None if planes is None else planes[:count]
            if local and (has_target or first_planes):
                plan_sweep(s, t, out["row_stats"], out["label_ids"], sums if has_target else None, chunk_planes,
                           start, mask, *scalars, grads=1 if first_planes else 0, plane_mask=first_planes,
                           vocab_start=plan.start).run(s)
            if later_planes:
                _merge_shares(out, sums, plan, start, count, has_target, dtype)
                if local:
                    plan_sweep(s, t, out["row_stats"], out["label_ids"], None, chunk_planes, start, mask, *scalars,
                               grads=1, plane_mask=later_planes, vocab_start=plan.start).run(s)
            if planes is not None:
                gemm.hidden_grad(hidden_grads[start:stop].view(count * losses, width),
                                 chunk_planes.view(count * losses, local), weight)
        if not later_planes:
            _merge_shares(out, sums, plan, 0, rows, has_target, dtype)
    target_field = (lambda name: out[name]) if has_target else (lambda name: None)
    results = (out["losses"], out["topk_logits"], out["label_logit"] if has_label else None, out["topk_ids"],
               out["label_ids"] if has_label else None, out["draft_lse"], target_field("target_lse"),
               out["draft_argmax"], out["target_argmax"] if has_target else None, target_field("at_topk"),
               target_field("overlap"))
    saved = (hidden, weight, target_hidden, target_weight, out["topk_ids"], out["topk_z"], out["label_ids"],
             out["label_z"], out["row_stats"], hidden_grads)
    return results, saved, None


def _merge_shares(out: dict, sums, plan, start: int, rows: int, has_target: bool, dtype) -> None:
    """Steps 9-11 of the module docstring over rows [start, start + rows)."""
    plan_shard_shares(sums, out["shares"], start, rows, plan.top_k).run(out["shares"])
    shard_common.all_reduce_sum(out["shares"][start:start + rows], plan.group)
    plan_shard_final(out, start, rows, plan.top_k, plan.loss_mask, has_target, dtype,
                     plan.logits_dtype).run(out["shares"])


def backward(saved, meta, plan, grad_losses, grad_topk, grad_label, need_hidden: bool, need_weight: bool):
    """(grad_hidden in hidden's dtype or None, grad_weight [V_local, H] in weight's dtype or None)."""
    hidden, weight, target_hidden, target_weight, topk_ids, topk_z, label_ids, label_z, row_stats, hidden_grads = saved
    rows, width = hidden.shape
    local = weight.shape[0]
    device = hidden.device
    dtype = gemm.compute_dtype(weight.dtype)
    mask = plan.loss_mask
    losses = loss_count(mask)
    scalars = (plan.logit_scale, plan.softcap)
    grad_hidden = grad_weight = None
    if not need_weight and (hidden_grads.numel() or not losses):
        if need_hidden:
            grad_hidden = torch.empty((rows, width), dtype=dtype, device=device)
            if rows:
                plan_hidden_grad(grad_hidden, hidden_grads if hidden_grads.numel() else None, grad_losses, weight,
                                 topk_ids, topk_z, grad_topk, label_ids, label_z, grad_label, *scalars,
                                 vocab_start=plan.start, shard=True).run(grad_hidden)
    else:
        tile_rows = gpu_tile_rows(rows, max(1, plan.largest_shard), losses, bool(mask & SOFT_LOSS_MASK), False,
                                  weight.dtype, plan.logits_dtype, plan.tile_mb, device, width, free_memory=False)
        grad_hidden, grad_weight = recomputed_grads(
            grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, topk_ids, label_ids,
            row_stats, mask, *scalars, need_hidden, need_weight, slice_columns(rows, max(1, local), tile_rows),
            vocab_start=plan.start, shard=True)
    if need_hidden:
        grad_hidden = shard_common.all_reduce_sum(grad_hidden.contiguous(), plan.group).to(hidden.dtype)
    return grad_hidden, grad_weight
