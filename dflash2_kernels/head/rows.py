"""The draft head's row reduction of one chunk of logits, by device: the C++ ops
(csrc/head_cpu.cpp, csrc/head_shard_cpu.cpp) on the CPU, the Triton kernels
(row_launch.py) on CUDA (and on CPU tensors under ``DFLASH2_BACKEND=triton`` with
``TRITON_INTERPRET=1``).

All take raw logits s = h W^T [R, V] in the compute dtype and leave the transformed
logits z (and t) in their place, and rank each row's rounded logits (top-k, argmaxes)
with ties to the lower id, as the dense reference's stable sort has them. The shard
functions are the vocab-parallel head's two passes (shard.py): local statistics and
candidates, then the losses' shares and gradients against the merged normalisers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._extension import has_kernel


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


def shard_stats_cpu(s, t, top_k, logit_scale, softcap, logits_dtype):
    """-> (stats [R, 3] f64: local lse of z, of t, t at the target's local argmax;
    topk_ids [R, k] local; topk_values [R, k] f64 unrounded; target_argmax [R] local)."""
    return torch.ops.dflash2.draft_head_shard_stats_cpu(s, t, top_k, logit_scale, softcap, logits_dtype)


def shard_rows_cpu(s, t, labels, loss_mask, logit_scale, softcap, row_stats, transform, shares, loss_grads,
                   grad_losses):
    """-> shares [R, 6] f64 (or [0, 6]); see csrc/head_shard_cpu.cpp."""
    return torch.ops.dflash2.draft_head_shard_rows_cpu(s, t, labels, loss_mask, logit_scale, softcap, row_stats,
                                                       transform, shares, loss_grads, grad_losses)


def _triton_wanted(device: torch.device) -> bool:
    from .._backend import selected_backend

    return selected_backend() == "triton" or device.type == "cuda"


def _functions(device: torch.device, triton, cpu, cpu_op: str, what: str):
    """``triton()`` (the functions on the Triton kernels) on CUDA or under
    DFLASH2_BACKEND=triton, else ``cpu`` where the C++ op is built."""
    if _triton_wanted(device):
        return triton()
    if device.type == "cpu" and has_kernel(cpu_op, "cpu"):
        return cpu
    raise RuntimeError(f"{what} has no kernel for {device.type} tensors in this build (the C++ extension is not "
                       f"built there).")


def row_functions(device: torch.device):
    """The forward and backward row reductions for tensors on ``device``."""
    return _functions(device, lambda: (rows_forward_triton, rows_backward_triton),
                      (rows_forward_cpu, rows_backward_cpu), "draft_head_rows_cpu", "dflash2::draft_head")


def _shard_triton():
    from .row_launch import shard_rows_triton, shard_stats_triton

    return shard_stats_triton, shard_rows_triton


def shard_row_functions(device: torch.device):
    """The vocab-parallel head's stats and rows functions for tensors on ``device``."""
    return _functions(device, _shard_triton, (shard_stats_cpu, shard_rows_cpu), "draft_head_shard_stats_cpu",
                      "the vocab-parallel draft head")


def _transform(x: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    y = x * logit_scale
    return softcap * torch.tanh(y / softcap) if softcap > 0 else y


def rows_forward_triton(s, t, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, planes) -> RowsOut:
    from .row_launch import head_rows_triton
    from .topk_launch import row_topk_triton

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
    # Rounding to a dtype at least as wide as the planes' changes nothing.
    rounded = s if logits_dtype.itemsize >= s.dtype.itemsize else s.to(logits_dtype)
    topk_ids = row_topk_triton(rounded, top_k)
    draft_argmax = topk_ids[:, 0] if top_k else torch.argmax(rounded, dim=1)
    safe = torch.where(label < 0, 0, label)
    return RowsOut(losses, stats[:, 0], stats[:, 1], stats[:, 2], draft_argmax, target_argmax,
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
