"""The draft head's row reduction of one chunk of logits, by device: the C++ op
``dflash2::draft_head_rows_cpu`` on the CPU, the Triton kernels (row_launch.py) on CUDA
(and on CPU tensors under ``DFLASH2_BACKEND=triton`` with ``TRITON_INTERPRET=1``).

Both take raw logits s = h W^T [R, V] in the compute dtype and leave the transformed
logits z (and t) in their place; the C++ op also ranks each row (top-k, argmaxes), the
Triton path ranks with torch on the chunk (``ranked``: one int64 key per entry, so ties
fall to the lower id on every device, as the dense reference's stable sort has them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch



class RowsOut(NamedTuple):
    """One chunk's per-row results (R rows, K = top_k, L requested losses; E the compute dtype)."""

    losses: torch.Tensor  # [L, R] E
    draft_lse: torch.Tensor  # [R] E
    target_lse: torch.Tensor  # [R] E (0 without a target)
    overlap: torch.Tensor  # [R] E (0 without a target)
    draft_argmax: torch.Tensor  # [R] int64
    target_argmax: torch.Tensor  # [R] int64 (0 without a target)
    topk_ids: torch.Tensor  # [R, K] int64
    topk_z: torch.Tensor  # [R, K] E, the unrounded logits there
    target_at_topk: torch.Tensor  # [R, K] E (0 without a target)
    label: torch.Tensor  # [R] int64: labels as given, else the target argmax; -1 for none
    label_z: torch.Tensor  # [R] E, z at the label (at 0 on ignored rows)


def rows_forward_cpu(s, t, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, planes) -> RowsOut:
    losses, stats, argmax, topk_ids, topk_z, at_topk, label_z = torch.ops.dflash2.draft_head_rows_cpu(
        s, t, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, planes)
    if labels is not None:
        label = labels
    elif t is not None:
        label = argmax[:, 1]
    else:
        label = torch.full_like(argmax[:, 0], -1)
    return RowsOut(losses, stats[:, 0], stats[:, 1], stats[:, 2], argmax[:, 0], argmax[:, 1], topk_ids, topk_z,
                   at_topk, label, label_z)


def rows_backward_cpu(s, t, labels, loss_mask, logit_scale, softcap, logits_dtype, grad_losses) -> None:
    """s becomes sum_l grad_losses[l] dL_l/ds (the top-k and label logits' terms are the caller's)."""
    torch.ops.dflash2.draft_head_rows_backward_cpu(s, t, labels, loss_mask, logit_scale, softcap, logits_dtype,
                                                   grad_losses)


def _transform(x: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    y = x * logit_scale
    return softcap * torch.tanh(y / softcap) if softcap > 0 else y


def ranked(rounded: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids of each row's top_k of ``rounded`` [R, V]: value descending, NaN first,
    ties to the lower id (``torch.topk`` on one int64 key per entry: the value's
    order-preserving bits above the inverted id, so no two keys tie)."""
    vocab = rounded.shape[1]
    bits = (rounded.float() + 0.0).view(torch.int32).long()  # + 0.0 turns -0 into +0, which ties with it
    key = torch.where(bits < 0, (~bits) & 0xFFFFFFFF, bits | 0x80000000)  # the float order as unsigned
    key = torch.where(torch.isnan(rounded), torch.full_like(key, 1 << 32), key)
    id_bits = max(1, (vocab - 1).bit_length())
    ids = torch.arange(vocab, device=rounded.device)
    key = (key << id_bits) | ((vocab - 1) - ids)
    return torch.topk(key, top_k, dim=1).indices


def rows_forward_triton(s, t, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, planes) -> RowsOut:
    from .row_launch import head_rows_triton

    rows = s.shape[0]
    target_argmax = torch.zeros(rows, dtype=torch.long, device=s.device)
    if t is not None:
        # Before the kernel overwrites t: the label of a ce without labels must be known to it.
        target_argmax = torch.argmax(_transform(t, logit_scale, softcap).to(logits_dtype), dim=1)
    if labels is not None:
        label = labels
    elif t is not None:
        label = target_argmax
    else:
        label = torch.full((rows,), -1, dtype=torch.long, device=s.device)
    losses, stats = head_rows_triton(s, t, label, loss_mask, logit_scale, softcap, planes)
    rounded = s.to(logits_dtype)
    topk_ids = ranked(rounded, top_k)
    safe = torch.where(label < 0, 0, label)
    return RowsOut(losses, stats[:, 0], stats[:, 1], stats[:, 2], torch.argmax(rounded, dim=1), target_argmax,
                   topk_ids, s.gather(1, topk_ids), t.gather(1, topk_ids) if t is not None else
                   torch.zeros_like(s[:, :top_k]), label, s.gather(1, safe.unsqueeze(1)).squeeze(1))


def rows_backward_triton(s, t, labels, loss_mask, logit_scale, softcap, logits_dtype, grad_losses) -> None:
    from .row_launch import head_rows_backward_triton

    label = labels
    if label is None and t is not None:
        label = torch.argmax(_transform(t, logit_scale, softcap).to(logits_dtype), dim=1)
    head_rows_backward_triton(s, t, label, loss_mask, logit_scale, softcap, grad_losses)


def logit_slope(z: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    """dz/ds at transformed logits z: the scale, times 1 - (z / softcap)^2 under a softcap."""
    if softcap > 0:
        return logit_scale * (1 - (z / softcap) ** 2)
    return torch.full_like(z, logit_scale)
