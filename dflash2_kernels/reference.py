"""Pure-PyTorch ground truth for every op (the oracle the tests judge kernels by).

These functions reproduce the upstream implementations' semantics, rounding order
included, so that "the reference run in the input dtype" in the numerical contract
(SPEC section 4) means what upstream users actually get today.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "check_grouped_dynamic_conv_args",
    "check_nemo_conv_args",
    "require_float_tensor",
    "grouped_dynamic_conv",
    "nemo_grouped_dynamic_convolve",
    "candidate_topk",
    "greedy_verify",
    "inverse_cdf_draw",
    "rejection_sample",
    "serving_edge_scores",
    "serving_walk",
    "DraftHeadOutput",
    "draft_head",
    "draft_head_logits",
]


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def require_float_tensor(name: str, value) -> None:
    """A torch.Tensor of a dtype the kernels read (TypeError naming ``name`` otherwise)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} must have a floating-point dtype (float16, bfloat16, float32 or float64), "
            f"got {value.dtype}."
        )


def _require_positive_int(name: str, value) -> None:
    # SymInt: torch.compile may hand the op's int arguments over as symbols.
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    if value >= 2**63:  # the ops' schemas take a signed 64-bit int
        raise ValueError(f"{name} must be < 2**63, got {value}.")


def check_grouped_dynamic_conv_args(
    hidden_states: torch.Tensor,
    delta_kernel: torch.Tensor,
    base_kernel: torch.Tensor,
    block_size: int,
    group_size: int,
    *,
    names: tuple[str, str] = ("hidden_states", "delta_kernel"),
) -> None:
    """Validate the conv's arguments; raise before any kernel could launch.

    The four shape/size ``ValueError`` messages are speculators' word for word, in
    speculators' order, so code that matches on them keeps working. ``names``: what
    the caller calls the hidden and delta tensors (NeMo: ``hidden``, ``dynamic``).
    """
    hidden_name, delta_name = names
    require_float_tensor(hidden_name, hidden_states)
    require_float_tensor(delta_name, delta_kernel)
    require_float_tensor("base_kernel", base_kernel)
    _require_positive_int("block_size", block_size)
    _require_positive_int("group_size", group_size)
    if hidden_states.dim() < 1:
        raise ValueError(f"{hidden_name} must have at least one dimension [..., hidden_size].")
    devices = {t.device for t in (hidden_states, delta_kernel, base_kernel)}
    if len(devices) > 1:
        raise ValueError(
            f"{hidden_name}, {delta_name} and base_kernel must be on one device, got "
            f"{hidden_states.device}, {delta_kernel.device} and {base_kernel.device}."
        )

    hidden_size = hidden_states.shape[-1]
    if hidden_size % group_size:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by group_size ({group_size})."
        )
    if base_kernel.dim() != 2:
        raise ValueError(
            "base_kernel must have shape [kernel_size, hidden_size], got "
            f"{tuple(base_kernel.shape)}."
        )
    kernel_size = base_kernel.shape[0]
    if kernel_size > block_size:
        raise ValueError(f"kernel_size ({kernel_size}) cannot exceed block_size ({block_size}).")
    if kernel_size < 1 or base_kernel.shape[1] != hidden_size:
        raise ValueError(
            "base_kernel must have shape [kernel_size, hidden_size], got "
            f"{tuple(base_kernel.shape)}."
        )
    expected_delta_shape = (*hidden_states.shape[:-1], kernel_size, hidden_size // group_size)
    if tuple(delta_kernel.shape) != expected_delta_shape:
        raise ValueError(
            f"{delta_name} must have shape {expected_delta_shape}, got "
            f"{tuple(delta_kernel.shape)}."
        )


def grouped_dynamic_conv(
    hidden_states: torch.Tensor,
    delta_kernel: torch.Tensor,
    base_kernel: torch.Tensor,
    *,
    block_size: int,
    group_size: int,
) -> torch.Tensor:
    """speculators' grouped dynamic causal conv, in the input dtype (SPEC section 1).

    hidden_states: [..., H] float; delta_kernel: [..., K, H // group_size] float (any
    strides); base_kernel: [K, H] float, cast to the hidden dtype before use.
    Returns [..., H] in ``promote_types(hidden, delta)``. Positions run over the
    flattened rows: row n sits at ``n % block_size`` in its draft block.
    """
    check_grouped_dynamic_conv_args(
        hidden_states, delta_kernel, base_kernel, block_size, group_size
    )
    kernel_size, hidden_size = base_kernel.shape
    num_groups = hidden_size // group_size
    count = math.prod(hidden_states.shape[:-1])  # not -1: ambiguous when H = 0
    rows = hidden_states.reshape(count, num_groups, group_size)
    delta = delta_kernel.reshape(count, kernel_size, num_groups)
    position = torch.arange(rows.shape[0], device=rows.device) % block_size
    base = base_kernel.to(rows.dtype).view(kernel_size, 1, num_groups, group_size)

    output = torch.zeros_like(rows)
    for tap in range(kernel_size):
        # Row n reads row n - tap; the first `tap` rows have no such row.
        kept = max(rows.shape[0] - tap, 0)
        shifted = torch.cat([rows.new_zeros(rows.shape[0] - kept, num_groups, group_size), rows[:kept]])
        coefficient = base[tap] + delta[:, tap, :, None]
        in_block = (position >= tap).view(-1, 1, 1)
        output = output + shifted * coefficient * in_block
    return output.reshape(hidden_states.shape)


def check_nemo_conv_args(
    hidden: torch.Tensor,
    dynamic: torch.Tensor,
    base_kernel: torch.Tensor,
    group_size: int,
    block_size: int,
) -> None:
    """NeMo's conv arguments, in NeMo's names: [B, S, H] hidden, the conv's checks, then
    L dividing S.

    Any number of taps K >= 1 is accepted, K > L included (NeMo's decode step convolves
    a one-position query with block_size 1): a tap past the block start reads zero.
    speculators' ``kernel_size (K) cannot exceed block_size (L)`` does not apply here.
    """
    require_float_tensor("hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [batch, sequence, hidden], got {tuple(hidden.shape)}.")
    require_float_tensor("dynamic", dynamic)
    require_float_tensor("base_kernel", base_kernel)
    _require_positive_int("block_size", block_size)
    # The shared checks see L raised to K, so speculators' K <= L rule never fires; a
    # base_kernel that is not 2-D still gets their shape message.
    taps = base_kernel.shape[0] if base_kernel.dim() == 2 else 1
    check_grouped_dynamic_conv_args(hidden, dynamic, base_kernel, max(block_size, taps), group_size,
                                    names=("hidden", "dynamic"))
    if hidden.shape[1] % block_size:
        raise ValueError(
            f"sequence length ({hidden.shape[1]}) must be a multiple of block_size ({block_size})."
        )


def nemo_grouped_dynamic_convolve(
    hidden: torch.Tensor,
    dynamic: torch.Tensor,
    base_kernel: torch.Tensor,
    group_size: int,
    block_size: int,
) -> torch.Tensor:
    """NeMo Automodel's variant: positions restart with every sequence.

    hidden: [B, S, H] float with S a multiple of block_size; dynamic: [B, S, K, G];
    base_kernel: [K, H], any K >= 1 (taps >= block_size only ever read zero). Rounds
    like NeMo (base term, then an addcmul per tap). Equal to :func:`grouped_dynamic_conv`
    whenever S is a multiple of block_size and K <= block_size.
    """
    check_nemo_conv_args(hidden, dynamic, base_kernel, group_size, block_size)
    batch, seq_len, hidden_size = hidden.shape
    kernel_size = base_kernel.shape[0]
    num_groups = hidden_size // group_size
    num_blocks = seq_len // block_size
    blocks = hidden.reshape(batch, num_blocks, block_size, num_groups, group_size)
    taps = dynamic.reshape(batch, num_blocks, block_size, kernel_size, num_groups, 1)
    output = torch.zeros_like(blocks)
    for tap in range(kernel_size):
        # Block position t reads t - tap; the first min(tap, L) positions read zero.
        kept = max(block_size - tap, 0)
        values = blocks if tap == 0 else torch.nn.functional.pad(
            blocks[:, :, :kept], (0, 0, 0, 0, block_size - kept, 0)
        )
        kernel = base_kernel[tap].view(num_groups, group_size).to(hidden.dtype)
        output = output + kernel * values
        output = torch.addcmul(output, taps[:, :, :, tap], values)
    return output.reshape(batch, seq_len, hidden_size)


# --- Candidate selector (SPEC section 2) ------------------------------------------


def selector_context(
    predecessor_codebook: torch.Tensor, projected: torch.Tensor, predecessor_ids: torch.Tensor
) -> torch.Tensor:
    """speculators' ``context``: A[pred] * P, in the codebook dtype. [..., r]."""
    predecessor = predecessor_codebook[predecessor_ids.long()]
    return predecessor * projected.to(predecessor.dtype)


def selector_transition_scores(
    projected: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    predecessor_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
) -> torch.Tensor:
    """T[..., j] = sum_rho A[pred, rho] P[rho] B[cand_j, rho], codebook dtype. [..., k].

    Materialises [..., k, r], as upstream does.
    """
    context = selector_context(predecessor_codebook, projected, predecessor_ids)
    successors = successor_codebook[candidate_ids.long()]
    return (context.unsqueeze(-2) * successors).sum(dim=-1)


def selector_score_candidates(
    unary_logits: torch.Tensor,
    projected: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    predecessor_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
) -> torch.Tensor:
    """speculators' ``score_candidates`` given P = hidden_projection(h).

    unary_logits [..., V], projected [..., r], codebooks [V, r], predecessor_ids [...],
    candidate_ids [..., k] -> [..., k] in unary_logits' dtype: U gathered at the
    candidates plus the transition scores cast to U's dtype.
    """
    unary = unary_logits.gather(-1, candidate_ids.long())
    transition = selector_transition_scores(
        projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids
    )
    return unary + transition.to(unary.dtype)


def selector_pair_scores(
    projected: torch.Tensor,
    unary: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    candidate_ids: torch.Tensor,
    predecessor_ids: torch.Tensor,
) -> torch.Tensor:
    """NeMo's ``pair_scores`` given P: unary [..., k] already gathered; dtypes promote."""
    gate = torch.nn.functional.embedding(predecessor_ids.long(), predecessor_codebook) * projected
    successors = torch.nn.functional.embedding(candidate_ids.long(), successor_codebook)
    return unary + torch.einsum("...r,...kr->...k", gate, successors)


# --- Serving (SPEC sections 2 and 3): top-k, edge scores, the walk, verification ---------
#
# Sampling is inverse-CDF against caller-supplied uniforms, so the kernels and these
# references draw the same tokens from the same uniforms: a draw over weights w picks
# the first index whose running sum exceeds u * sum(w) (or, when rounding leaves no
# such index, the last index with positive weight).
#
# These are also the serving functions' path wherever the kernels do not reach (k > 32,
# float64, rejection sampling over more than 4,194,304 tokens), so they take every k in
# [1, V] and every float dtype, and they are total: an id outside [0, V) gets the CUDA
# kernels' rule (below) instead of an out-of-bounds read, with no host synchronisation.
# (The public functions raise IndexError for such ids on CPU before calling these.)


def serving_score_dtype(logits: torch.Tensor, projected: torch.Tensor, codebook: torch.Tensor) -> torch.dtype:
    """NeMo's score dtype: unary (logits' dtype) + einsum(A[pred] * P, B[cand])."""
    return torch.promote_types(logits.dtype, torch.promote_types(codebook.dtype, projected.dtype))


def _in_vocabulary(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as int64 with every id outside [0, vocab) replaced by 0, the mask of those in range)."""
    ids = ids.long()
    valid = (ids >= 0) & (ids < vocab)
    return torch.where(valid, ids, 0), valid


def candidate_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits per row, sorted descending: ([..., k] logits' dtype, [..., k] int64)."""
    return torch.topk(logits, top_k, dim=-1)


def serving_edge_scores(
    projected: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    top_k: int,
    *,
    transition_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """E[b, t, i, j] = U[b, t, j] + T(prev_i, cand[b, t, j]) for every adjacent pair.

    projected [B, D, r], logits [B, D, V], anchor_ids [B] -> (edges [B, D, k, k] in
    :func:`serving_score_dtype`, candidate_ids [B, D, k] int64). The predecessors of
    position t > 0 are cand[b, t-1, :]; position 0 has the anchor alone, so every row
    i of E[b, 0] holds the anchor's scores. NeMo's arithmetic: T in
    promote_types(codebooks, projected), added to U in the score dtype (so all-float64
    inputs are computed in float64). An anchor outside [0, V) gives its sequence NaN
    edges at t = 0 (the CUDA kernels' rule). transition_dtype: T's dtype instead of
    NeMo's (float64: the edges come out in float64, for the caller to round once).
    """
    unary, candidate_ids = candidate_topk(logits, top_k)
    batch, draft = candidate_ids.shape[:2]
    anchors, valid = _in_vocabulary(anchor_ids, predecessor_codebook.shape[0])
    anchors = anchors.reshape(batch, 1, 1).expand(batch, 1, top_k)
    predecessors = torch.cat([anchors, candidate_ids[:, :-1]], dim=1)  # [B, D, k]
    dtype = transition_dtype or torch.promote_types(predecessor_codebook.dtype, projected.dtype)
    gate = predecessor_codebook[predecessors].to(dtype) * projected.to(dtype).unsqueeze(-2)  # [B, D, k, r]
    successors = successor_codebook[candidate_ids].to(dtype)  # [B, D, k, r]; einsum wants one dtype
    transition = torch.einsum("btir,btjr->btij", gate, successors)
    edges = unary.unsqueeze(-2) + transition
    edges[:, 0] = torch.where(valid.reshape(batch, 1, 1), edges[:, 0], float("nan"))
    return edges, candidate_ids


def inverse_cdf_draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of weights [..., n] (>= 0) by uniforms [...] in [0, 1).

    -1 for a row without positive weight.
    """
    running = weights.cumsum(-1)
    target = (uniforms.to(running.dtype) * running[..., -1]).unsqueeze(-1)
    above = running > target
    first_above = torch.where(above.any(-1), above.int().argmax(-1), -1)
    positive = weights > 0
    n = weights.shape[-1]
    last_positive = torch.where(positive.any(-1), n - 1 - positive.flip(-1).int().argmax(-1), -1)
    return torch.where(first_above >= 0, first_above, last_positive)


def serving_walk(
    projected: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    top_k: int,
    temperature: float,
    uniforms: torch.Tensor | None = None,
    *,
    transition_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """NeMo's walk over the edge scores, with sampling driven by uniforms [B, D].

    Returns (path [B, D] int64, candidate_ids [B, D, k] int64, draft_probs [B, D, k]
    float32 or None when greedy). Greedy takes the first maximum (NaN counts as the
    maximum, as torch.argmax does); sampled steps draw from q = softmax(E_row.float() / T)
    with :func:`inverse_cdf_draw` (the greedy choice when the scores are NaN). A
    sequence whose anchor is outside [0, V) walks its NaN first edges and gets path -1
    (the CUDA kernels' rule). transition_dtype: as :func:`serving_edge_scores`.
    """
    edges, candidate_ids = serving_edge_scores(
        projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k,
        transition_dtype=transition_dtype,
    )
    edges = edges.to(serving_score_dtype(logits, projected, predecessor_codebook))
    batch, draft = candidate_ids.shape[:2]
    rows = torch.arange(batch, device=edges.device)
    choice = torch.zeros(batch, dtype=torch.long, device=edges.device)
    path, probs = [], []
    for position in range(draft):
        scores = edges[rows, position, choice]  # [B, k]
        if temperature > 0:
            q = torch.softmax(scores.float() / temperature, dim=-1)
            drawn = inverse_cdf_draw(q, uniforms[:, position])
            # NaN scores leave nothing to draw from: fall back to the greedy choice.
            choice = torch.where(drawn >= 0, drawn, scores.argmax(dim=-1))
            probs.append(q)
        else:
            choice = scores.argmax(dim=-1)
        path.append(candidate_ids[rows, position, choice])
    _, valid = _in_vocabulary(anchor_ids, predecessor_codebook.shape[0])
    path = torch.where(valid.reshape(batch, 1), torch.stack(path, 1), -1)
    return path, candidate_ids, torch.stack(probs, 1) if probs else None


def rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    candidate_ids: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched lossless verification (SPEC section 3), NeMo's rule per sequence.

    draft_tokens [B, D], target_probs [B, D+1, V], draft_probs [B, D, k], candidate_ids
    [B, D, k], uniforms [B, D+1] (u[:, t] tests position t, u[:, D] draws the bonus)
    -> (accepted [B] int64, bonus [B] int64). Accept d_t while u_t * q_t(d_t) < p_t(d_t);
    the bonus comes from normalize(max(p_a - q_a, 0)) at the first rejection a (p_a if
    that has no mass), or from p_D when all D are accepted. Computed in float64, for any
    V and k. Ids outside [0, V) follow the CUDA kernels' rule: such a draft token has
    no target mass (it is never accepted), such a candidate takes no mass off the
    residual.
    """
    batch, draft = draft_tokens.shape
    vocab = target_probs.shape[-1]
    tokens, token_valid = _in_vocabulary(draft_tokens, vocab)
    candidates, candidate_valid = _in_vocabulary(candidate_ids, vocab)
    q_all = draft_probs.double()
    p = target_probs[:, :draft].gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double().clamp_min(0)
    p = torch.where(token_valid, p, 0.0)
    q = (q_all * (candidate_ids.long() == draft_tokens.long().unsqueeze(-1))).sum(-1)
    passed = uniforms[:, :draft].double() * q < p
    accepted = passed.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=tokens.device)
    target_row = target_probs[rows, accepted].double().clamp_min(0)  # [B, V]: only the bonus rows
    rejected = accepted < draft
    at = accepted.clamp_max(draft - 1)
    residual = target_row.clone()
    taken = torch.where(candidate_valid, q_all, 0.0)
    residual.scatter_add_(-1, candidates[rows, at], -taken[rows, at])
    residual = residual.clamp_min(0)
    use_residual = rejected & (residual.sum(-1) > 0)
    weights = torch.where(use_residual.unsqueeze(-1), residual, target_row)
    return accepted, inverse_cdf_draw(weights, uniforms[:, draft])


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix with d_t == argmax p_t, and the verifier's token after it.

    draft_tokens [B, D], target_logits [B, D+1, V] (any float dtype, compared in it)
    -> (accepted [B], bonus [B]) int64. A draft token outside [0, V) is never the argmax.
    """
    target = target_logits.argmax(-1)  # [B, D+1]
    draft = draft_tokens.shape[1]
    accepted = (draft_tokens.long() == target[:, :draft]).long().cumprod(-1).sum(-1)
    return accepted, target.gather(1, accepted.unsqueeze(1)).squeeze(1)


# --- the draft head (SPEC section 7) ------------------------------------------------------

DRAFT_HEAD_LOSSES = ("kl_div", "rkl", "jsd", "tv", "ce")
SOFT_LOSSES = ("kl_div", "rkl", "jsd", "tv")
IGNORE_INDEX = -100


class DraftHeadOutput(NamedTuple):
    """What :func:`dflash2_kernels.draft_head` returns (SPEC section 7); every tensor over
    the leading dims [...] of ``hidden`` (K = top_k). The target-side fields are None
    without ``target_hidden``."""

    losses: dict  # name -> [...] float32, 0 on ignored rows (label -100)
    topk_ids: torch.Tensor  # [..., K] int64, logit descending, ties: lower id first
    topk_logits: torch.Tensor  # [..., K] logits_dtype
    label_ids: torch.Tensor | None  # [...] int64: labels (-100 kept), else the target argmax
    label_logit: torch.Tensor | None  # [...] logits_dtype, the logit at label 0 on ignored rows
    label_in_topk: torch.Tensor | None  # [...] bool, False on ignored rows
    draft_lse: torch.Tensor  # [...] float32
    target_lse: torch.Tensor | None  # [...] float32
    draft_argmax: torch.Tensor  # [...] int64
    target_argmax: torch.Tensor | None  # [...] int64
    target_logits_at_topk: torch.Tensor | None  # [..., K] float32
    overlap: torch.Tensor | None  # [...] float32, sum_v min(p_v, q_v) = 1 - tv


def draft_head_output(lead, losses: dict, topk_ids, topk_logits, label_ids, label_logit, draft_lse, target_lse,
                      draft_argmax, target_argmax, target_logits_at_topk, overlap) -> DraftHeadOutput:
    """A :class:`DraftHeadOutput` over the leading dims ``lead`` from flat per-row results
    over N rows ([N] or [N, K]; None where a field is absent; ``losses`` name -> [N]), with
    ``label_in_topk`` from ``topk_ids`` and ``label_ids``."""
    top_k = topk_ids.shape[-1]

    def shaped(tensor, *tail):
        return None if tensor is None else tensor.reshape(tuple(lead) + tail)

    label_in_topk = None
    if label_ids is not None:
        label_in_topk = (topk_ids == label_ids.unsqueeze(-1)).any(-1) & (label_ids != IGNORE_INDEX)
    return DraftHeadOutput(
        losses={name: shaped(loss) for name, loss in losses.items()},
        topk_ids=shaped(topk_ids, top_k),
        topk_logits=shaped(topk_logits, top_k),
        label_ids=shaped(label_ids),
        label_logit=shaped(label_logit),
        label_in_topk=shaped(label_in_topk),
        draft_lse=shaped(draft_lse),
        target_lse=shaped(target_lse),
        draft_argmax=shaped(draft_argmax),
        target_argmax=shaped(target_argmax),
        target_logits_at_topk=shaped(target_logits_at_topk, top_k),
        overlap=shaped(overlap),
    )


def draft_head_logits(hidden: torch.Tensor, weight: torch.Tensor, logit_scale: float = 1.0,
                      softcap: float | None = None) -> torch.Tensor:
    """z = softcap * tanh(logit_scale * h W^T / softcap) (no tanh without softcap): hidden
    [..., H] taken in weight's dtype (as autocast hands a bf16 lm_head its input), W
    [V, H] -> [..., V] in weight's dtype, the scale and softcap applied there too (NeMo's
    compute_logits)."""
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _where_zero(weight: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """weight * term with 0 where the weight is exactly 0 (0 log 0 = 0; NaN still propagates)."""
    return torch.where(weight == 0, torch.zeros_like(term), weight * term)


def draft_head_row_losses(z: torch.Tensor, t: torch.Tensor | None, labels: torch.Tensor | None,
                          names: tuple[str, ...]) -> dict:
    """The per-row losses of speculators' losses/eager.py over logits z, t [N, V] (any
    float dtype, computed in float32 or float64 as z's precision allows), ce against
    labels [N] (in range). Where a probability is exactly 0 its term is 0."""
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    z = z.to(dtype)
    draft_lse = torch.logsumexp(z, dim=-1, keepdim=True)
    log_q = z - draft_lse
    q = log_q.exp()
    losses = {}
    if t is not None:
        t = t.to(dtype)
        log_p = t - torch.logsumexp(t, dim=-1, keepdim=True)
        p = log_p.exp()
        log_m = torch.logaddexp(log_q, log_p) - math.log(2.0)
        for name in names:
            if name == "kl_div":
                losses[name] = _where_zero(p, log_p - log_q).sum(-1)
            elif name == "rkl":
                losses[name] = _where_zero(q, log_q - log_p).sum(-1)
            elif name == "jsd":
                losses[name] = 0.5 * (_where_zero(p, log_p - log_m) + _where_zero(q, log_q - log_m)).sum(-1)
            elif name == "tv":
                losses[name] = 1.0 - torch.minimum(p, q).sum(-1)
    if "ce" in names:
        losses["ce"] = draft_lse.squeeze(-1) - z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return losses


def draft_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    target_hidden: torch.Tensor | None = None,
    target_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    losses: tuple[str, ...] = ("kl_div",),
    top_k: int = 16,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    logits_dtype: torch.dtype | None = None,
) -> DraftHeadOutput:
    """The dense draft head: [..., V] logits for both sides, then speculators' losses on
    them (log_softmax in float32, float64 for float64 logits), top-k and argmax of the
    logits rounded to ``logits_dtype`` (ties: the lower id). Arguments and results as
    :func:`dflash2_kernels.draft_head` (SPEC section 7); differentiable as upstream's."""
    lead = hidden.shape[:-1]
    vocab = weight.shape[0]
    logits_dtype = logits_dtype or hidden.dtype
    z = draft_head_logits(hidden, weight, logit_scale, softcap).reshape(-1, vocab)
    t = None
    if target_hidden is not None:
        # The verifier's side is a constant (SPEC: W_t a frozen copy): no gradient reaches
        # weight, target_weight or target_hidden through t.
        target_weight = weight if target_weight is None else target_weight
        t = draft_head_logits(target_hidden.detach(), target_weight.detach(), logit_scale,
                              softcap).reshape(-1, vocab)
    rounded = z.to(logits_dtype)
    topk_ids = torch.sort(rounded.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    draft_argmax = torch.argmax(rounded.detach(), dim=-1)
    stat_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    target_argmax = target_lse = at_topk = overlap = None
    if t is not None:
        target_argmax = torch.argmax(t.detach().to(logits_dtype), dim=-1)
        target_lse = torch.logsumexp(t.detach().to(stat_dtype), dim=-1).float()
        at_topk = t.detach().to(stat_dtype).gather(-1, topk_ids).float()
        p = torch.softmax(t.detach().to(stat_dtype), -1)
        overlap = torch.minimum(p, torch.softmax(z.detach().to(stat_dtype), -1)).sum(-1).float()
    label_ids = labels.reshape(-1).long() if labels is not None else target_argmax
    label_logit = ignored = None
    if label_ids is not None:
        ignored = label_ids == IGNORE_INDEX
        label_logit = rounded.gather(-1, torch.where(ignored, 0, label_ids).unsqueeze(-1)).squeeze(-1)
    row_losses = draft_head_row_losses(z, t, None if label_ids is None else torch.where(ignored, 0, label_ids),
                                       tuple(losses))
    out_losses = {}
    for name in losses:
        loss = row_losses[name].float()
        out_losses[name] = loss if ignored is None else torch.where(ignored, torch.zeros_like(loss), loss)
    return draft_head_output(lead, out_losses, topk_ids, rounded.gather(-1, topk_ids), label_ids, label_logit,
                             torch.logsumexp(z.detach().to(stat_dtype), dim=-1).float(), target_lse, draft_argmax,
                             target_argmax, at_topk, overlap)
