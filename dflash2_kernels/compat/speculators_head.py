"""speculators' ``DFlash2DraftModel.forward`` with the draft head fused (``fused_head=True``).

Upstream's forward projects the draft's and the verifier's normed hidden states to
[N, V] logits, then reduces them: the unary loss terms of ``loss_fn`` (``losses/eager.py``
or their Triton twins), the selector's top-k candidates with the target injected at
slot K-1, and the metrics (accept rate 1 - TV, greedy accuracies, candidate recall and
target mass, teacher-forced selector accuracy, eal, the oracle accept length). Here the
same backbone runs (upstream's own ``_backbone_forward``, its heads made to return their
inputs), :func:`dflash2_kernels.draft_head` computes every per-row quantity from the
hidden states, and upstream's own functions apply the masks, position decay (fixed-exp
or D-PACE), normalisation and selector loss to those rows. Metrics keep their names,
dtypes and meaning; their values agree with upstream's within SPEC section 4 (the
head's sums are taken in fp32/fp64 where upstream's run over V in fp32).

Loss terms: kl_div, rkl, jsd, tv and ce are the head's rows; nla (-log max(1 - tv, 1e-5))
and lk_hybrid (lambda KL + (1 - lambda) TV, lambda = exp(-eta sg(1 - tv))) are built
from the tv and kl_div rows, their values from the head's fp64-summed overlap.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..head import draft_head
from .fused_head import head_weight, logits_at, logits_dtype_of, with_heads_returning_input

__all__ = ["fused_forward", "loss_terms"]

_NLA_EPS = 1e-5  # speculators.losses.eager._NLA_EPS
_LK_HYBRID_ETA = 3.0  # lk_hybrid_loss's default eta
# speculators' loss name -> the head's rows it is built from.
_ROWS_OF = {"kl_div": ("kl_div",), "rkl": ("rkl",), "jsd": ("jsd",), "ce": ("ce",), "tv": ("tv",),
            "nla": ("tv",), "lk_hybrid": ("kl_div", "tv")}


def _known_losses() -> dict[int, str]:
    """id(loss function) -> speculators' name for it, for its eager and fused variants."""
    from speculators.losses import utils

    known = {}
    for table in (utils._EAGER_LOSS_FN_MAP, utils._FUSED_LOSS_FN_MAP):
        known.update({id(fn): name for name, fn in table.items()})
    return known


def loss_terms(loss_config: dict) -> list[tuple[str, str, float, float]]:
    """[(config key, speculators' loss name, weight, eta)] of a ``LossConfig``
    ({key: (loss_fn, weight)}); ValueError naming the entry for a function the fused head
    does not compute. ``functools.partial(lk_hybrid_loss, eta=...)`` keeps its eta."""
    known = _known_losses()
    terms = []
    for key, entry in loss_config.items():
        fn, weight = entry
        eta = _LK_HYBRID_ETA
        base = fn
        if isinstance(fn, functools.partial) and not fn.args and set(fn.keywords) <= {"eta"}:
            base, eta = fn.func, float(fn.keywords.get("eta", _LK_HYBRID_ETA))
        name = known.get(id(base))
        if name is None or (base is not fn and name != "lk_hybrid"):
            raise ValueError(f"loss_config[{key!r}] is {fn!r}: the fused head computes speculators' own losses "
                             f"only ({', '.join(_ROWS_OF)}); run this loss with the fused head off.")
        terms.append((key, name, float(weight), eta))
    return terms


def _term_rows(name: str, eta: float, out) -> torch.Tensor:
    """speculators' per-position loss ``name`` [1, T] float32 from the head's rows."""
    if name in ("kl_div", "rkl", "jsd", "ce", "tv"):
        return out.losses[name]
    tv = out.losses["tv"]
    overlap = out.overlap  # summed in fp64 by the head: 1 - tv in fp32 would cancel
    if name == "nla":
        slope = torch.where(overlap > _NLA_EPS, 1.0 / overlap.clamp_min(_NLA_EPS), torch.zeros_like(overlap))
        return -torch.log(overlap.clamp_min(_NLA_EPS)) + (tv - tv.detach()) * slope
    weight = torch.exp(-eta * overlap)  # lambda = exp(-eta * sg[alpha])
    return weight * out.losses["kl_div"] + (1.0 - weight) * tv


def _decay_fn(loss_mask, block_size, gamma, per_position_loss_weight, dpace_alpha, sample_from_anchor):
    from speculators.losses import dflash_loss_decay, dpace_loss_decay

    if per_position_loss_weight == "dpace":
        return functools.partial(dpace_loss_decay, loss_mask=loss_mask, block_size=block_size,
                                 dpace_alpha=dpace_alpha)
    return functools.partial(dflash_loss_decay, gamma=gamma, sample_from_anchor=sample_from_anchor)


def _unary_metrics(out, terms, loss_mask, block_size, *, gamma, per_position_loss_weight, dpace_alpha,
                   sample_from_anchor) -> tuple[torch.Tensor, dict[str, Any]]:
    """``speculators.models.dspark.metrics.compute_metrics`` (no confidence head) on the
    head's rows: the compound loss and the unary metrics."""
    from speculators.losses import compound_loss
    from speculators.models.metrics import compute_accepted_length_counts, compute_accuracy_multi_step

    device = loss_mask.device
    seq_len = loss_mask.shape[1]
    pos_idx = (torch.arange(seq_len, device=device) % block_size).unsqueeze(0)
    start_pos = 0 if sample_from_anchor else 1
    decay_fn = _decay_fn(loss_mask, block_size, gamma, per_position_loss_weight, dpace_alpha, sample_from_anchor)
    # upstream's compound_loss calls loss_fn(logits, targets) per term: each term here
    # hands back its rows (the placeholders only carry the device).
    rows_config = {key: (lambda _logits, _targets, rows=_term_rows(name, eta, out): rows, weight)
                   for key, name, weight, eta in terms}
    loss, term_losses = compound_loss(out.overlap, None, loss_mask, pos_idx, loss_config=rows_config,
                                      decay_fn=decay_fn)

    with torch.no_grad():
        accept_rate = out.overlap
        num_blocks = seq_len // block_size
        accept_blocks = accept_rate.view(num_blocks, block_size)
        draft_mask = loss_mask.to(accept_rate.dtype).view(num_blocks, block_size)[:, start_pos:]
        accept_prefix = (accept_blocks[:, start_pos:] * draft_mask).cumprod(dim=-1)

    metrics: dict[str, Any] = {}
    ones = torch.ones((), device=device)
    metrics["loss_sum"] = loss.detach().clone()
    metrics["loss_total"] = ones
    for term_name, term_val in term_losses.items():
        metrics[f"{term_name}_sum"] = term_val
        metrics[f"{term_name}_total"] = ones.clone()
    with torch.no_grad():
        mask_f = loss_mask.to(accept_rate.dtype)
        metrics["accept_rate_sum"] = (accept_rate * mask_f).sum()
        metrics["accept_rate_total"] = mask_f.sum().clamp_min(1.0)
        per_block_len = accept_prefix.sum(dim=-1) + 1.0
        block_valid = (draft_mask.sum(dim=-1) > 0).to(accept_rate.dtype)
        metrics["accept_len_sum"] = (per_block_len * block_valid).sum()
        metrics["accept_len_total"] = block_valid.sum().clamp_min(1.0)

    pred_ids, target_ids = out.draft_argmax, out.target_argmax
    correct_per_pos, total_per_pos = compute_accuracy_multi_step(pred_ids, target_ids, loss_mask, pos_idx,
                                                                 block_size)
    metrics["full_acc_sum"] = correct_per_pos[start_pos:].sum()
    metrics["full_acc_total"] = total_per_pos[start_pos:].sum()
    for pos in range(start_pos, block_size):
        metrics[f"position_{pos}_acc_sum"] = correct_per_pos[pos]
        metrics[f"position_{pos}_acc_total"] = total_per_pos[pos]
    eal_sum, eal_total = compute_accepted_length_counts(
        (pred_ids == target_ids).reshape(num_blocks, block_size)[:, start_pos:], draft_mask.to(torch.bool))
    metrics["eal_sum"] = eal_sum
    metrics["eal_total"] = eal_total
    return loss, metrics


def _candidate_scores(selector, candidate_logits, hidden, predecessor_ids, candidate_ids) -> torch.Tensor:
    """``score_candidates`` with the unary term already gathered: [1, T, K] in the logits'
    dtype (ours' fused pair kernel when the selector is ours, upstream's sum otherwise)."""
    if callable(getattr(selector, "pair_scores", None)):
        return selector.pair_scores(hidden, candidate_logits, candidate_ids, predecessor_ids).to(candidate_logits.dtype)
    transition = selector.transition_scores(hidden, predecessor_ids, candidate_ids)
    return candidate_logits + transition.to(candidate_logits.dtype)


def fused_forward(
    self,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    verifier_last_hidden_states: torch.Tensor,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    loss_config=None,
    tv_loss_fn=None,
    gamma: float = 4.0,
    max_anchors: int = 512,
    selector_loss_alpha: float = 1.0,
    per_position_loss_weight: str = "fixed-exp-decay",
    dpace_alpha: float = 0.5,
    **kwargs,
) -> tuple[None, torch.Tensor, dict[str, Any]]:
    """``DFlash2DraftModel.forward`` (same arguments, same ``(None, loss, metrics)``) with
    the head fused: no [num_anchors * block_size, V] tensor is made, forward or backward.

    ``tv_loss_fn`` (upstream's choice of TV kernel for the accept-rate metric) is not
    called: the head's overlap is that metric.
    """
    from speculators.models.dflash2 import core, metrics as upstream_metrics

    weight = head_weight(self.lm_head, "lm_head")
    target_weight = head_weight(self.verifier_lm_head, "verifier_lm_head")
    terms = loss_terms(loss_config or core._DEFAULT_LOSS_CONFIG)
    hidden, _, target_hidden, aligned_loss_mask, block_indices = with_heads_returning_input(
        (self.lm_head, self.verifier_lm_head), self._backbone_forward, hidden_states, input_ids, loss_mask,
        verifier_last_hidden_states, document_ids, position_ids, max_anchors=max_anchors, **kwargs)
    predecessor_ids = self._predecessor_ids(input_ids, block_indices)
    top_k = self.candidate_selector.top_k
    rows = sorted({row for _, name, _, _ in terms for row in _ROWS_OF[name]})
    out = draft_head(hidden, weight, target_hidden=target_hidden.detach(), target_weight=target_weight.detach(),
                     losses=rows, top_k=top_k, logits_dtype=logits_dtype_of(hidden, weight))

    training_candidate_ids, target_positions, contains_target = upstream_metrics.selector_training_candidates(
        out.topk_ids, out.target_argmax)
    unary_candidates = out.topk_logits.clone()
    unary_candidates[..., -1] = torch.where(contains_target, unary_candidates[..., -1], out.label_logit)
    candidate_logits = _candidate_scores(self.candidate_selector, unary_candidates, hidden,
                                         predecessor_ids.reshape(1, -1), training_candidate_ids)

    sample_from_anchor = self.config.sample_from_anchor
    block_size = self.block_size
    unary_loss, metrics = _unary_metrics(out, terms, aligned_loss_mask, block_size, gamma=gamma,
                                         per_position_loss_weight=per_position_loss_weight, dpace_alpha=dpace_alpha,
                                         sample_from_anchor=sample_from_anchor)
    selector_loss = upstream_metrics.compute_selector_loss(
        candidate_logits, target_positions, aligned_loss_mask, block_size, gamma=gamma,
        per_position_loss_weight=per_position_loss_weight, dpace_alpha=dpace_alpha,
        sample_from_anchor=sample_from_anchor)
    loss = unary_loss + selector_loss_alpha * selector_loss
    metrics.update(_selector_metrics(out, target_hidden, target_weight, training_candidate_ids, candidate_logits,
                                     contains_target, aligned_loss_mask, block_size, top_k, sample_from_anchor,
                                     unary_loss, selector_loss, loss))
    return None, loss, metrics


def _selector_metrics(out, target_hidden, target_weight, training_candidate_ids, candidate_logits, contains_target,
                      loss_mask, block_size, top_k, sample_from_anchor, unary_loss, selector_loss, loss) -> dict:
    """The DFlash 2 half of ``speculators.models.dflash2.metrics.compute_metrics``."""
    from speculators.models.metrics import compute_accepted_length_counts

    device = loss_mask.device
    one = torch.ones((), device=device)
    metrics: dict[str, Any] = {
        "unary_loss_sum": unary_loss.detach().clone(), "unary_loss_total": one,
        "selector_loss_sum": selector_loss.detach().clone(), "selector_loss_total": one.clone(),
        "loss_sum": loss.detach().clone(), "loss_total": one.clone(),
    }
    with torch.no_grad():
        target_ids = out.target_argmax
        valid = loss_mask.to(torch.bool)
        valid_float = valid.to(out.topk_logits.dtype)
        valid_total = valid_float.sum()
        metrics[f"unary_candidate_recall_at_{top_k}_sum"] = (contains_target.to(valid_float.dtype) * valid_float).sum()
        metrics[f"unary_candidate_recall_at_{top_k}_total"] = valid_total

        # The verifier's logits at the training candidates: the top-k's, and the target's
        # own (its maximum) where it was injected at slot K-1.
        at_candidates = out.target_logits_at_topk.clone()
        at_target = logits_at(target_hidden, target_weight, target_ids).to(at_candidates.dtype)
        at_candidates[..., -1] = torch.where(contains_target, at_candidates[..., -1], at_target)
        candidate_mass = torch.exp(torch.logsumexp(at_candidates, dim=-1) - out.target_lse)
        metrics[f"unary_candidate_target_mass_at_{top_k}_sum"] = (candidate_mass * valid_float).sum()
        metrics[f"unary_candidate_target_mass_at_{top_k}_total"] = valid_total.clone()

        teacher_forced_ids = training_candidate_ids.gather(
            -1, candidate_logits.detach().argmax(dim=-1, keepdim=True)).squeeze(-1)
        serving_valid = valid_float * contains_target.to(valid_float.dtype)
        metrics["teacher_forced_selector_acc_sum"] = (teacher_forced_ids.eq(target_ids).to(valid_float.dtype)
                                                      * serving_valid).sum()
        metrics["teacher_forced_selector_acc_total"] = serving_valid.sum()

        num_blocks = loss_mask.shape[1] // block_size
        contains_target_blocks = contains_target.view(num_blocks, block_size)
        valid_blocks = valid.view(num_blocks, block_size)
        start_pos = 0 if sample_from_anchor else 1
        selector_correct = teacher_forced_ids.eq(target_ids) & contains_target
        eal_sum, eal_total = compute_accepted_length_counts(
            selector_correct.view(num_blocks, block_size)[:, start_pos:], valid_blocks[:, start_pos:])
        metrics["eal_sum"] = eal_sum
        metrics["eal_total"] = eal_total

        oracle_alive = torch.ones(num_blocks, dtype=torch.bool, device=device)
        oracle_accepted_length = torch.ones(num_blocks, dtype=torch.float32, device=device)
        for position in range(1, block_size):
            oracle_alive = oracle_alive & valid_blocks[:, position] & contains_target_blocks[:, position]
            oracle_accepted_length += oracle_alive.to(oracle_accepted_length.dtype)
        block_valid = valid_blocks[:, 1:].any(dim=-1)
        metrics[f"unary_top_{top_k}_oracle_accepted_length_sum"] = (oracle_accepted_length * block_valid).sum()
        metrics[f"unary_top_{top_k}_oracle_accepted_length_total"] = block_valid.sum().to(torch.float32)
    return metrics
