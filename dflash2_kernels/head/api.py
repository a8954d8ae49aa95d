"""``dk.draft_head``: the draft's per-row losses against the verifier and the selector's
top-k candidates straight from hidden states, never holding [N, V] logits (SPEC section 7)."""

from __future__ import annotations

import torch

from .. import reference
from .._backend import selected_backend, triton_importable
from .._extension import has_kernel
from . import vocab_parallel
from .checks import check_head_args, loss_count, loss_mask_of, loss_names
from .gemm import compute_dtype
from .rows import triton_wanted
from .tiles import gpu_tile_rows, keeps_hidden_grads, tile_rows_for

__all__ = ["DraftHeadOutput", "draft_head"]

DraftHeadOutput = reference.DraftHeadOutput


def _kernel_for(device: torch.device) -> bool:
    backend = selected_backend()
    if backend == "reference":
        return False
    if backend == "triton" or device.type == "cuda":
        return triton_importable()
    return device.type == "cpu" and has_kernel("draft_head_rows_cpu", "cpu")


def draft_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    target_hidden: torch.Tensor | None = None,
    target_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    losses=("kl_div",),
    top_k: int = 16,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    logits_dtype: torch.dtype | None = None,
    tile_mb: float | None = None,
    vocab_start: int | None = None,
    group=None,
    vocab_size: int | None = None,
) -> DraftHeadOutput:
    """The draft head's per-row losses and candidates without [N, V] logits.

    hidden: [..., H] float (the draft's normed last hidden state; differentiable),
    weight: [V, H] float (the lm_head; differentiable when it requires grad, its gradient
    accumulated in float32); target_hidden: [..., H] and target_weight: [V, H] (default
    weight), the verifier's side, never differentiated; labels: [...] int64 (-100: an
    ignored row); losses: names among "kl_div", "rkl", "jsd", "tv", "ce"; top_k in [0, V];
    z = softcap * tanh(logit_scale * h W^T / softcap) (no tanh for softcap None);
    logits_dtype: what the logits are rounded to before top-k / argmax (default hidden's);
    tile_mb: the chunk's working set in MiB (default DFLASH2_HEAD_TILE_MB, else 256 on
    the CPU; on CUDA a tenth of what the dense head holds, at least 256 MiB and at most a
    quarter of the free device memory: tiles.gpu_tile_rows).

    Labels are checked on CPU tensors (IndexError); on CUDA, where reading them would cost
    a host sync, a label outside [0, V) and not -100 makes its row's ce and label_logit NaN.

    hidden is taken in weight's dtype and every product accumulated in float32 (float64
    for float64 weights). Returns :class:`DraftHeadOutput` (SPEC section 7): ``losses`` a
    dict name -> [...] float32, ``topk_ids`` / ``topk_logits`` [..., K], ``label_ids``,
    ``label_logit``, ``label_in_topk`` [...], the no-grad statistics ``draft_lse``,
    ``target_lse``, ``draft_argmax``, ``target_argmax``, ``target_logits_at_topk``,
    ``overlap``; target-side fields None without target_hidden, label fields None with
    neither labels nor target_hidden.

    Vocab parallel (SPEC section 7; head/vocab_parallel.py): ``weight`` may be one rank's
    rows of the lm_head, either a DTensor ``Shard(0)`` on one mesh dim (Replicate on any
    other; uneven shards as torch.chunk makes them) or a plain [V_local, H] tensor with
    ``vocab_start`` (int, the global id of its first row) and ``group`` (the
    ProcessGroup of the shards); ``target_weight`` sharded the same way. The ranks' shards
    must tile [0, V) (``vocab_size``, if given, must equal V); ``hidden``,
    ``target_hidden``, ``labels`` (global ids) are replicated (plain tensors, or
    Replicate DTensors); ``top_k`` in [0, V] (a shard may hold fewer than top_k rows).
    Each rank reduces its own [R, V_local] tiles and the ranks merge per-row
    statistics: all_reduce MAX and SUM of [2, R] (row max, sum-exp -> global lse),
    all_gather of each rank's local top-k and target argmax ([W, 2, R, K + 1] float64),
    all_reduce SUM of [R, L + 2 + 2K] (loss shares, sum min(p, q), logits at the merged
    ids and the label); the backward adds all_reduce SUMs of [R] (per chunk) and of
    [N, H] (hidden's gradient). The result is the same DraftHeadOutput (same fields,
    dtypes, shapes), plain tensors equal on every rank; hidden's gradient is one
    process's on every rank, weight's each rank's own rows of one process's dW. Every
    rank must make the same call and run the same backward.
    """
    loss_mask = loss_mask_of(losses)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}.")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)):
        raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}.")
    if vocab_parallel.wanted(weight, vocab_start, group):
        return vocab_parallel.draft_head(
            hidden, weight, target_hidden=target_hidden, target_weight=target_weight, labels=labels,
            loss_mask=loss_mask, top_k=top_k, logit_scale=logit_scale, softcap=softcap, logits_dtype=logits_dtype,
            tile_mb=tile_mb, vocab_start=vocab_start, group=group, vocab_size=vocab_size)
    if vocab_size is not None and isinstance(weight, torch.Tensor) and vocab_size != weight.shape[0]:
        raise ValueError(f"vocab_size = {vocab_size} but weight holds {weight.shape[0]} rows (a vocab-parallel "
                         f"shard needs vocab_start= and group=, or a Shard(0) DTensor weight).")
    if logits_dtype is None and isinstance(hidden, torch.Tensor):
        logits_dtype = hidden.dtype
    check_head_args(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale,
                    0.0 if softcap is None else softcap, logits_dtype)
    for name, tensor in (("target_hidden", target_hidden), ("target_weight", target_weight)):
        if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but draft_head never differentiates the verifier's side: "
                             f"pass {name}.detach().")
    if not _kernel_for(hidden.device):
        return reference.draft_head(hidden, weight, target_hidden=target_hidden, target_weight=target_weight,
                                    labels=labels, losses=loss_names(loss_mask), top_k=top_k,
                                    logit_scale=logit_scale, softcap=softcap, logits_dtype=logits_dtype)
    lead = hidden.shape[:-1]
    width = hidden.shape[-1]
    vocab = weight.shape[0]
    losses_count = loss_count(loss_mask)
    planes = keeps_hidden_grads(hidden.requires_grad, weight.requires_grad, losses_count, target_hidden is not None)
    if triton_wanted(hidden.device):
        backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        tile_rows = gpu_tile_rows(lead.numel(), vocab, losses_count, target_hidden is not None,
                                  planes, weight.dtype, logits_dtype, tile_mb, hidden.device, width, backward=backward)
    else:
        tile_rows = tile_rows_for(vocab, losses_count, target_hidden is not None, planes, compute_dtype(weight.dtype),
                                  tile_mb)
    flat_target = None if target_hidden is None else target_hidden.reshape(-1, width)
    flat_labels = None if labels is None else labels.reshape(-1)
    (loss_rows, topk_ids, topk_logits, label_ids, label_logit, draft_lse, target_lse, draft_argmax, target_argmax,
     at_topk, overlap, _topk_z, _label_z, _planes, _row_stats) = torch.ops.dflash2.draft_head(
        hidden.reshape(-1, width), weight, flat_target, target_weight, flat_labels, loss_mask, top_k,
        float(logit_scale), 0.0 if softcap is None else float(softcap), logits_dtype, planes, tile_rows)

    has_target = target_hidden is not None
    has_label = labels is not None or has_target

    def target_side(tensor):
        return tensor if has_target else None

    return reference.draft_head_output(
        lead, {name: loss_rows[i] for i, name in enumerate(loss_names(loss_mask))}, topk_ids, topk_logits,
        label_ids if has_label else None, label_logit if has_label else None, draft_lse.detach(),
        target_side(target_lse.detach()), draft_argmax, target_side(target_argmax), target_side(at_topk.detach()),
        target_side(overlap.detach()))
