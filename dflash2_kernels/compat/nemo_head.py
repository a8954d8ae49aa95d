"""NeMo Automodel's ``DFlash2TrainerModule.forward`` with the draft head fused (``fused_head=True``).

Upstream's step computes ``compute_logits(output_hidden, lm_head)`` ([B, S, V]: under
tensor parallelism gathered from the vocab-sharded lm_head with ``full_tensor()``, so
[B, S, V] on every rank), then CE against the data tokens (``DFlashDecayLoss``), the
selector's top-k candidates and the greedy metrics. Here the draft's backbone runs as
upstream's (its own ``_prepare_block_inputs`` / ``_build_block_targets``), and
:func:`dflash2_kernels.draft_head` computes the CE rows, the top-k, the labels' places
among them and the argmax from the predicted positions' hidden states, with NeMo's
output transform (``output_multiplier``, ``final_logit_softcapping``). A vocab-sharded
lm_head (a DTensor Shard(0) weight) runs vocab-parallel: per-row statistics and top-k
are merged across the TP group, [N, V] is never gathered. Upstream's own loss module
applies the decay weights and normalisation; the selector terms and every metric of
``DFlash2StepMetrics`` follow upstream's expressions on the head's results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..head import draft_head
from .fused_head import head_weight, logits_dtype_of

__all__ = ["fused_forward"]


def fused_forward(
    self,
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    doc_remaining: torch.Tensor | None = None,
):
    """``DFlash2TrainerModule.forward`` (same arguments, same ``DFlash2StepMetrics``) with
    the head fused: no [B, S, V] logits, forward or backward."""
    from nemo_automodel.components.speculative.dflash.core import compute_acceptance_stats
    from nemo_automodel.components.speculative.dflash.dflash2_core import DFlash2StepMetrics

    bsz, seq_len = input_ids.shape
    anchor_positions, block_keep_mask, noise_embedding, full_position_ids, dflash_attn_mask, _ = (
        self._prepare_block_inputs(input_ids, loss_mask, position_ids=position_ids, seq_lens=seq_lens,
                                   doc_remaining=doc_remaining))
    output_hidden = self.draft_model(position_ids=full_position_ids, noise_embedding=noise_embedding,
                                     target_hidden=hidden_states, attention_mask=dflash_attn_mask)
    n, bs = anchor_positions.size(1), self.block_size
    _, target_ids, block_mask = self._build_block_targets(input_ids, loss_mask, anchor_positions, block_keep_mask,
                                                          seq_len, doc_remaining=doc_remaining)
    pred_hidden = output_hidden.view(bsz, n, bs, -1)[:, :, 1:, :]
    pred_targets = target_ids[:, :, 1:]
    pred_mask = block_mask[:, :, 1:]

    weight = head_weight(self.lm_head, "the target's lm_head")
    draft = self.draft_model
    selector = draft.candidate_selector
    logits_dtype = logits_dtype_of(pred_hidden, weight)
    out = draft_head(pred_hidden, weight, labels=pred_targets, losses=("ce",), top_k=selector.top_k,
                     logit_scale=float(getattr(draft, "output_multiplier", 1.0)),
                     softcap=getattr(draft, "final_logit_softcapping", None), logits_dtype=logits_dtype)

    loss_fn = self.loss_fn
    assert loss_fn is not None, "loss_fn is always constructed for loss_type='dflash'"
    # F.cross_entropy returns the logits' dtype: so does upstream's per-token NLL.
    token_nll = out.losses["ce"].to(logits_dtype)
    loss_out = loss_fn._reduce(token_nll.reshape(bsz, -1), pred_mask.reshape(bsz, -1), None, bs)

    unary, candidate_ids = out.topk_logits, out.topk_ids
    scores = selector.pair_scores(pred_hidden, unary, candidate_ids, target_ids[:, :, :-1])
    has_target = out.label_in_topk
    target_index = (candidate_ids == pred_targets.unsqueeze(-1)).to(torch.int64).argmax(dim=-1)
    selector_mask = pred_mask * has_target.to(pred_mask.dtype)
    selector_weights = self._depth_weights(selector_mask)
    token_nll = F.cross_entropy(scores.reshape(-1, scores.shape[-1]).float(), target_index.reshape(-1),
                                reduction="none").view_as(selector_mask)
    selector_loss = (token_nll * selector_weights).sum() / (selector_weights.sum() + 1e-6)
    loss = loss_out.total_loss + self.selector_loss_weight * selector_loss

    with torch.no_grad():
        eval_mask = pred_mask.bool()
        valid_tokens = pred_mask.sum()
        selected_ids = candidate_ids.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
        correct_tokens = ((selected_ids == pred_targets) & eval_mask).sum()
        accept_len, accept_len_sum, valid_blocks = compute_acceptance_stats(selected_ids, pred_targets, eval_mask)
        base_ids = out.draft_argmax
        base_correct_tokens = ((base_ids == pred_targets) & eval_mask).sum()
        base_accept_len, base_accept_len_sum, _ = compute_acceptance_stats(base_ids, pred_targets, eval_mask)
        denominator = valid_tokens.clamp_min(1)

    return DFlash2StepMetrics(
        loss=loss,
        loss_weight=self._depth_weights(pred_mask).sum().detach(),
        accuracy=(correct_tokens / denominator).detach(),
        valid_tokens=valid_tokens.detach(),
        correct_tokens=correct_tokens.detach(),
        accept_len=accept_len.detach(),
        accept_len_sum=accept_len_sum.detach(),
        valid_blocks=valid_blocks.detach(),
        base_loss=loss_out.total_loss.detach(),
        selector_loss=selector_loss.detach(),
        base_accuracy=(base_correct_tokens / denominator).detach(),
        base_correct_tokens=base_correct_tokens.detach(),
        base_accept_len=base_accept_len.detach(),
        base_accept_len_sum=base_accept_len_sum.detach(),
        candidate_recall=(selector_mask.sum() / denominator).detach(),
    )
