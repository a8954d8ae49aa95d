"""One rank's part of the vocab-parallel draft head (SPEC section 7, last paragraph):
``weight`` is this rank's rows [V_local, H] of the lm_head from global id ``start``;
hidden, target_hidden and labels are replicated. vocab_parallel.py resolves the shard and
checks the arguments; this module holds the autograd Function and hands the work to the
device's driver: shard_cpu.py (the C++ row kernels) or shard_gpu.py (Triton), which
share shard_common.py (the plan, the collectives, the ranking of merged candidates).

Each rank reduces its own [R, V_local] tiles, and the ranks merge per-row statistics
(lse, the local top-k and the target's argmax, the losses' shares, the logits at the
merged ids) with collectives of O(R K) elements; the [R, V] row is never gathered.

The backward follows Megatron's convention: hidden is replicated and used in a rank-local
product, so its gradient is the ranks' sum (one all_reduce SUM of [N, H]); each rank's
weight gradient is its own rows of one process's dW (compute dtype, rounded once). Every
rank must run the same backward.
"""

from __future__ import annotations

import torch

from .. import reference
from .checks import loss_count, loss_names
from .rows import triton_wanted
from .shard_common import ShardPlan
from .tiles import keeps_hidden_grads

__all__ = ["shard_head"]


def _driver(device: torch.device):
    if triton_wanted(device):
        from . import shard_gpu

        return shard_gpu
    from . import shard_cpu

    return shard_cpu


class _ShardHead(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], target_hidden, target_weight, labels) -> the
    head's per-row results over the whole vocabulary; differentiable outputs: losses
    [L, N] float32, topk_logits [N, K] and label_logit [N] (logits_dtype)."""

    @staticmethod
    def forward(ctx, hidden, weight, target_hidden, target_weight, labels, plan: ShardPlan, needs):
        driver = _driver(hidden.device)
        results, saved, meta = driver.forward(hidden, weight, target_hidden, target_weight, labels, plan, needs)
        ctx.save_for_backward(*saved)
        ctx.driver, ctx.meta, ctx.plan = driver, meta, plan
        ctx.mark_non_differentiable(*[r for r in results[3:] if r is not None])
        # An unused output's gradient arrives as None, not as a zero-filled tensor.
        ctx.set_materialize_grads(False)
        return results

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_losses, grad_topk, grad_label, *_):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden, grad_weight = ctx.driver.backward(ctx.saved_tensors, ctx.meta, ctx.plan, grad_losses, grad_topk,
                                                       grad_label, need_hidden, need_weight)
        return grad_hidden, grad_weight, None, None, None, None, None


def shard_head(hidden, weight, target_hidden, target_weight, labels, plan: ShardPlan) -> reference.DraftHeadOutput:
    """This rank's part of the vocab-parallel head (the module docstring): hidden [..., H]
    replicated, weight [V_local, H] this rank's rows; every rank returns the same
    DraftHeadOutput (one process's result over the whole vocabulary)."""
    lead = hidden.shape[:-1]
    width = hidden.shape[-1]
    needs_hidden = torch.is_grad_enabled() and hidden.requires_grad
    needs_weight = torch.is_grad_enabled() and weight.requires_grad
    # Decided here: autograd runs the Function's forward with grad mode off.
    planes_kept = keeps_hidden_grads(hidden.requires_grad, weight.requires_grad, loss_count(plan.loss_mask),
                                     target_hidden is not None)
    flat_target = None if target_hidden is None else target_hidden.detach().reshape(-1, width)
    flat_labels = None if labels is None else labels.reshape(-1)
    target_weight = None if target_weight is None else target_weight.detach()
    (losses, topk_logits, label_logit, topk_ids, label_ids, draft_lse, target_lse, draft_argmax, target_argmax,
     at_topk, overlap) = _ShardHead.apply(hidden.reshape(-1, width), weight, flat_target, target_weight,
                                          flat_labels, plan, (needs_hidden, needs_weight, planes_kept))
    return reference.draft_head_output(
        lead, {name: losses[i] for i, name in enumerate(loss_names(plan.loss_mask))}, topk_ids, topk_logits,
        label_ids, label_logit, draft_lse, target_lse, draft_argmax, target_argmax, at_topk, overlap)
