"""One rank's part of the vocab-parallel draft head (SPEC section 7, last paragraph) on the
C++ row kernels (the CPU; shard_gpu.py is the Triton twin, shard.py what both share):
``weight`` is this rank's rows [V_local, H] of the lm_head from global id ``start``;
hidden, target_hidden and labels are replicated.

Each rank walks the rows in the same chunks (tiles.tile_rows_for over the largest shard) and
per chunk of R rows:

1. s = h W_local^T [R, V_local] (and the target's t) in the compute dtype (gemm.py);
2. the stats kernel (rows.shard_stats_*: C++ on the CPU, Triton on CUDA): s -> z (and t)
   in place, each side's local log-sum-exp, the local top-k of the logits rounded to
   logits_dtype (k = max(top_k, 1), at most V_local) and the target's local argmax;
3. ``all_gather`` of [2, R, k + 1] float64 (the candidates' unrounded logits and global
   ids, the target argmax's last; padded with -inf / -1): merged, ties to the lower
   global id and NaN first as one process ranks, into the top-k, the draft argmax (the
   first), the target argmax (the ce label without labels); and a shift per row and side,
   the largest top-1 logit, close to the row's maximum;
4. ``all_reduce`` SUM of [2, R] float64, sum_ranks exp(lse_rank - shift): the global lse;
5. the rows kernel (rows.shard_rows_*) against the global normalisers: this shard's shares
   of the soft losses' sums, of sum_v min(p_v, q_v) and of the sums that the gradients of
   jsd and tv subtract; where the forward keeps hidden's gradient planes (as one process
   does, tiles.keeps_hidden_grads) and no loss needs a row-global sum (kl_div, ce), dL/ds
   into the planes in the same pass;
6. ``all_reduce`` SUM of [R, C] float64: the shares, and the logits at the merged top-k
   ids, at the label and the target's at the top-k ids (the owning rank adds the value,
   every other an exact 0);
7. with planes and rkl, jsd or tv: the rows kernel again for dL/ds with the merged sums;
   then this shard's part of dL_l/dh = dL_l/ds W_local per loss.

Every collective moves O(R * K) elements (the all_gather W times that).

The backward (autograd.Function, Megatron's convention: hidden is replicated and used in a
rank-local product, so its gradient is the ranks' sum): from the planes, or by recomputing
each chunk's logits and running the rows kernel with the saved normalisers and sums (the
transform first, then the combined dL/ds) -- no collective per chunk; the top-k and label
logits' terms through the W rows this rank owns (grads.py); then one ``all_reduce`` SUM
of hidden's gradient [N, H]. Each rank's weight gradient is its own rows of one process's
dW (compute dtype, rounded once). Every rank must run the same backward.
"""

from __future__ import annotations

import math

import torch

from . import gemm
from .checks import IGNORE_INDEX, SOFT_LOSS_MASK, loss_count, loss_names
from .grads import SparseLogits, grads_from_planes, recomputed_grads
from .rows import shard_row_functions
from . import shard_common
from .shard_common import ShardPlan, merged_candidates
from .tiles import chunk_planes, tile_rows_for

NO_LABEL = -1  # a row's label on another shard (or no label): no one-hot here
_LOSS = {name: 1 << i for i, name in enumerate(("kl_div", "rkl", "jsd", "tv", "ce"))}
_GLOBAL_SUMS = _LOSS["rkl"] | _LOSS["jsd"] | _LOSS["tv"]  # their gradients subtract a row-global sum
# Columns of the rows kernel's shares and of row_stats (csrc/head_shard_cpu.cpp's Share, RowStat).
_SHARE = {"kl_div": 0, "rkl": 1, "jsd": 2, "overlap": 3, "jsd_q": 4, "tv_q": 5}
_STAT_RKL, _STAT_JSD_Q, _STAT_TV_Q = 4, 5, 6


def _owned(values: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """values [R, V_local] at global ids [R, J] owned by this rank, 0 elsewhere, float64."""
    local = values.shape[1]
    index = ids - start
    owned = (index >= 0) & (index < local)
    if local == 0:
        return torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
    picked = values.gather(1, index.clamp(0, local - 1)).double()
    return torch.where(owned, picked, torch.zeros_like(picked))


def local_labels(labels: torch.Tensor, start: int, local: int) -> torch.Tensor:
    """Global labels [R] as this shard's row kernels take them: the local id where this
    rank owns it, -100 kept (an ignored row), else -1 (the label's one-hot is elsewhere)."""
    index = labels - start
    owned = (index >= 0) & (index < local)
    return torch.where(owned, index, torch.where(labels == IGNORE_INDEX, labels, torch.full_like(labels, NO_LABEL)))


def _forward_chunk(plan: ShardPlan, out: dict, begin: int, end: int, s, t, labels, rows_fns, planes) -> None:
    """Steps 2 to 7 of the module docstring over rows [begin, end): s, t [R, V_local] raw
    logits (transformed in place), labels [R] global or None; fills ``out``'s rows."""
    stats_fn, rows_fn = rows_fns
    count, local = end - begin, s.shape[1]
    k, width = plan.top_k, max(plan.top_k, 1)
    has_target = t is not None
    doubles = dict(dtype=torch.float64, device=s.device)
    # 2. local statistics and candidates: [2, R, width + 1] (values, global ids), padded.
    candidates = torch.full((2, count, width + 1), -math.inf, **doubles)
    candidates[1] = -1.0
    lse = torch.full((2, count), -math.inf, **doubles)
    taken = min(width, local)
    if local and count:
        stats, ids, values, target_argmax = stats_fn(s, t, taken, plan.logit_scale, plan.softcap,
                                                     plan.logits_dtype)
        candidates[0, :, :taken] = values
        candidates[1, :, :taken] = (ids + plan.start).double()
        lse[0] = stats[:, 0]
        if has_target:
            lse[1] = stats[:, 1]
            candidates[0, :, width] = stats[:, 2]
            candidates[1, :, width] = (target_argmax + plan.start).double()
    # 3. the merged candidates and the shifts.
    gathered = shard_common.all_gather_ranks(candidates, plan.group)  # [W, 2, R, width + 1]
    topk_ids, topk_values = merged_candidates(gathered[:, 0, :, :width], gathered[:, 1, :, :width], width, plan.vocab,
                                    plan.logits_dtype)
    out["draft_argmax"][begin:end] = topk_ids[:, 0]
    shifts = torch.stack([topk_values[:, 0], torch.zeros_like(topk_values[:, 0])])
    target_argmax = None
    if has_target:
        target_ids, target_values = merged_candidates(gathered[:, 0, :, width:], gathered[:, 1, :, width:], 1, plan.vocab,
                                            plan.logits_dtype)
        target_argmax = target_ids[:, 0]
        out["target_argmax"][begin:end] = target_argmax
        shifts[1] = target_values[:, 0]
    topk_ids = topk_ids[:, :k]
    out["topk_ids"][begin:end] = topk_ids
    # 4. the global log-sum-exp: shifted by a value near the row's maximum, summed in float64.
    shifts = torch.where(torch.isfinite(shifts), shifts, torch.zeros_like(shifts))
    terms = shard_common.all_reduce_sum(torch.exp(lse - shifts), plan.group)
    lse = shifts + torch.log(terms)
    row_stats = torch.zeros((count, 7), **doubles)
    row_stats[:, 0], row_stats[:, 1] = shifts[0], lse[0]
    row_stats[:, 2], row_stats[:, 3] = shifts[1], lse[1]
    out["draft_lse"][begin:end] = lse[0]
    if has_target:
        out["target_lse"][begin:end] = lse[1]
    label_ids = labels if labels is not None else target_argmax
    here = None
    if label_ids is not None:
        out["label_ids"][begin:end] = label_ids
        here = local_labels(label_ids, plan.start, local)
    elif local:
        here = torch.full((count,), NO_LABEL, dtype=torch.long, device=s.device)
    # 5. this shard's shares (and the planes where no row-global sum is needed).
    mask = plan.loss_mask
    needs_sums = planes is not None and bool(mask & _GLOBAL_SUMS)
    shares = torch.zeros((count, 6), **doubles)
    if local and count:
        shares = rows_fn(s, t, here, mask, plan.logit_scale, plan.softcap, row_stats, False, True,
                         None if needs_sums else planes, None)
    # 6. one all_reduce: the shares and the logits at the merged ids and the label.
    names = [name for name in loss_names(mask & SOFT_LOSS_MASK) if name != "tv"]
    names += ["overlap"] if has_target else []
    if out["differentiable"]:  # the sums the gradients of jsd and tv subtract
        names += [name for name, loss in (("jsd_q", "jsd"), ("tv_q", "tv")) if mask & _LOSS[loss]]
    pieces = [shares[:, [_SHARE[name] for name in names]], _owned(s, topk_ids, plan.start)]
    if label_ids is not None:
        pieces.append(_owned(s, torch.where(label_ids == IGNORE_INDEX, 0, label_ids)[:, None], plan.start))
    if has_target:
        pieces.append(_owned(t, topk_ids, plan.start))
    summed = shard_common.all_reduce_sum(torch.cat(pieces, 1), plan.group)
    merged = dict(zip(names, summed.unbind(1)))
    position = len(names)
    out["topk_z"][begin:end] = summed[:, position:position + k]
    position += k
    label_z = None
    if label_ids is not None:
        label_z = summed[:, position]
        out["label_z"][begin:end] = label_z
        position += 1
    if has_target:
        out["at_topk"][begin:end] = summed[:, position:position + k]
        out["overlap"][begin:end] = merged["overlap"]
    row_stats[:, _STAT_RKL] = merged.get("rkl", 0.0)
    row_stats[:, _STAT_JSD_Q] = merged.get("jsd_q", 0.0)
    row_stats[:, _STAT_TV_Q] = merged.get("tv_q", 0.0)
    out["row_stats"][begin:end] = row_stats
    ignored = None if label_ids is None else label_ids == IGNORE_INDEX
    for slot, name in enumerate(loss_names(mask)):
        if name == "ce":
            loss = lse[0] - label_z
        elif name == "tv":
            loss = 1.0 - merged["overlap"]
        else:
            loss = merged[name]
        if ignored is not None:
            loss = torch.where(ignored, torch.zeros_like(loss), loss)
        out["losses"][slot, begin:end] = loss
    # 7. the planes of losses whose gradients need the merged sums.
    if needs_sums and local and count:
        rows_fn(s, t, here, mask, plan.logit_scale, plan.softcap, row_stats, False, False, planes, None)



def forward(hidden, weight, target_hidden, target_weight, labels, plan: ShardPlan, needs):
    """(results, saved tensors, saved metadata): results as shard._ShardHead returns them."""
    needs_hidden, needs_weight, planes_kept = needs
    device = hidden.device
    rows, width = hidden.shape
    local = weight.shape[0]
    dtype = gemm.compute_dtype(weight.dtype)
    losses = loss_count(plan.loss_mask)
    has_target = target_hidden is not None
    has_label = labels is not None or has_target
    target_weight = weight if target_weight is None else target_weight
    tile_rows = tile_rows_for(max(1, plan.largest_shard), losses, has_target, planes_kept, dtype, plan.tile_mb)
    k = plan.top_k
    f64, i64 = torch.float64, torch.long
    out = {
        "differentiable": needs_hidden or needs_weight,
        "losses": torch.empty((losses, rows), dtype=f64, device=device),
        "topk_ids": torch.empty((rows, k), dtype=i64, device=device),
        "topk_z": torch.empty((rows, k), dtype=f64, device=device),
        "label_ids": torch.empty(rows, dtype=i64, device=device),
        "label_z": torch.zeros(rows, dtype=f64, device=device),
        "draft_lse": torch.empty(rows, dtype=f64, device=device),
        "target_lse": torch.empty(rows, dtype=f64, device=device),
        "draft_argmax": torch.empty(rows, dtype=i64, device=device),
        "target_argmax": torch.empty(rows, dtype=i64, device=device),
        "at_topk": torch.empty((rows, k), dtype=f64, device=device),
        "overlap": torch.empty(rows, dtype=f64, device=device),
        "row_stats": torch.empty((rows, 7), dtype=f64, device=device),
    }
    hidden_grads = torch.zeros((rows, losses, width) if planes_kept else (0,), dtype=dtype, device=device)
    rows_fns = shard_row_functions(device)
    chunk = max(1, min(rows, tile_rows))
    logits = chunk_planes((chunk, local), dtype, device)
    target_logits = chunk_planes((chunk, local), dtype, device) if has_target else None
    loss_planes = chunk_planes((losses, chunk, local), dtype, device) if planes_kept else None
    for begin in range(0, rows, chunk):
        end = min(rows, begin + chunk)
        count = end - begin
        s = logits[:count]
        t = None
        if local:
            gemm.project(s, hidden[begin:end].to(weight.dtype), weight)
        if has_target:
            t = target_logits[:count]
            if local:
                gemm.project(t, target_hidden[begin:end].to(target_weight.dtype), target_weight)
        planes = None if loss_planes is None else loss_planes[:, :count]
        _forward_chunk(plan, out, begin, end, s, t, None if labels is None else labels[begin:end], rows_fns,
                       planes)
        if planes is not None and local:
            for loss in range(losses):
                gemm.hidden_grad(hidden_grads[begin:end, loss], planes[loss], weight)
    topk_logits = out["topk_z"].to(plan.logits_dtype)
    label_logit = out["label_z"].to(plan.logits_dtype) if has_label else None
    saved = (hidden, weight, target_hidden, target_weight, labels, out["topk_ids"], out["topk_z"].to(dtype),
             out["label_ids"], out["label_z"].to(dtype), out["row_stats"], hidden_grads)
    target_field = (lambda name: out[name].float()) if has_target else (lambda name: None)
    results = (out["losses"].float(), topk_logits, label_logit, out["topk_ids"],
               out["label_ids"] if has_label else None, out["draft_lse"].float(), target_field("target_lse"),
               out["draft_argmax"], out["target_argmax"] if has_target else None, target_field("at_topk"),
               target_field("overlap"))
    return results, saved, (tile_rows, has_label)



def backward(saved, meta, plan: ShardPlan, grad_losses, grad_topk, grad_label, need_hidden: bool,
             need_weight: bool):
    """(grad_hidden in hidden's dtype or None, grad_weight [V_local, H] in weight's dtype or None)."""
    (hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z, label_ids, label_z, row_stats,
     hidden_grads) = saved
    tile_rows, has_label = meta
    rows, width = hidden.shape
    local = weight.shape[0]
    dtype = gemm.compute_dtype(weight.dtype)
    losses = loss_count(plan.loss_mask)
    zeros = hidden.new_zeros
    grad_losses = zeros((losses, rows), dtype=torch.float32) if grad_losses is None else grad_losses
    grad_topk = zeros(topk_ids.shape, dtype=torch.float32) if grad_topk is None else grad_topk
    grad_label = zeros((rows,), dtype=torch.float32) if grad_label is None or not has_label else grad_label
    # The top-k and label logits this rank owns; the others' coefficients are 0. An
    # ignored row's label logit is the one at id 0 (SPEC section 7), the first shard's.
    index = topk_ids - plan.start
    owned = (index >= 0) & (index < local)
    label_logit_ids = torch.full_like(label_ids, NO_LABEL)
    here_labels = label_logit_ids
    if has_label:
        here_labels = local_labels(label_ids, plan.start, local)
        label_logit_ids = local_labels(torch.where(label_ids == IGNORE_INDEX, 0, label_ids), plan.start, local)
    sparse = SparseLogits(torch.where(owned, grad_topk, torch.zeros_like(grad_topk)), grad_label,
                          index.clamp(0, max(local - 1, 0)), torch.where(owned, topk_z, torch.zeros_like(topk_z)),
                          label_logit_ids, label_z, plan.logit_scale, plan.softcap)
    grad_hidden = grad_weight = None
    if need_weight or (need_hidden and not hidden_grads.numel() and losses):
        _, rows_fn = shard_row_functions(hidden.device)

        def rows_backward(start, stop, s, t, weights):
            rows_fn(s, t, here_labels[start:stop], plan.loss_mask, plan.logit_scale, plan.softcap,
                    row_stats[start:stop], True, False, None, weights)

        grad_hidden, grad_weight = recomputed_grads(grad_losses, sparse, hidden, weight, target_hidden,
                                                    target_weight, rows_backward, need_hidden, need_weight,
                                                    tile_rows)
    elif need_hidden:
        grad_hidden = grads_from_planes(grad_losses, hidden_grads, sparse, weight, (rows, width), dtype)
    if need_hidden:
        grad_hidden = shard_common.all_reduce_sum(grad_hidden.contiguous(), plan.group).to(hidden.dtype)
    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight


