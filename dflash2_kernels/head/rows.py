"""The draft head's row reduction of one chunk of logits on the CPU: the C++ ops
(csrc/head_cpu.cpp, csrc/head_shard_cpu.cpp) as the CPU driver (cpu_driver.py) and the
vocab-parallel CPU path (shard.py) call them, and which device runs the Triton kernels
instead (:func:`triton_wanted`; gpu_driver.py, shard_gpu.py).

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


def triton_wanted(device: torch.device) -> bool:
    """Whether the head runs its Triton kernels on ``device``'s tensors: on CUDA, and
    anywhere under DFLASH2_BACKEND=triton (CPU tensors then need Triton's interpreter)."""
    from .._backend import selected_backend

    return selected_backend() == "triton" or device.type == "cuda"


def shard_row_functions(device: torch.device):
    """The vocab-parallel head's CPU stats and rows functions (the C++ ops)."""
    if device.type == "cpu" and has_kernel("draft_head_shard_stats_cpu", "cpu"):
        return shard_stats_cpu, shard_rows_cpu
    raise RuntimeError(f"the vocab-parallel draft head has no CPU kernel for {device.type} tensors in this build "
                       f"(the C++ extension is not built there).")


def logit_slope(z: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    """dz/ds at transformed logits z: the scale, times 1 - (z / softcap)^2 under a softcap."""
    if softcap > 0:
        return logit_scale * (1 - (z / softcap) ** 2)
    return torch.full_like(z, logit_scale)
