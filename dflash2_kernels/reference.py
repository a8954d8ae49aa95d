"""Pure-PyTorch ground truth for every op (the oracle the tests judge kernels by).

These functions reproduce the upstream implementations' semantics, rounding order
included, so that "the reference run in the input dtype" in the numerical contract
(SPEC section 4) means what upstream users actually get today.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_grouped_dynamic_conv_args",
    "check_nemo_conv_args",
    "grouped_dynamic_conv",
    "nemo_grouped_dynamic_convolve",
]


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _require_tensor(name: str, value) -> None:
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


def check_grouped_dynamic_conv_args(
    hidden_states: torch.Tensor,
    delta_kernel: torch.Tensor,
    base_kernel: torch.Tensor,
    block_size: int,
    group_size: int,
) -> None:
    """Validate the conv's arguments; raise before any kernel could launch.

    The four shape/size ``ValueError`` messages are speculators' word for word, in
    speculators' order, so code that matches on them keeps working.
    """
    _require_tensor("hidden_states", hidden_states)
    _require_tensor("delta_kernel", delta_kernel)
    _require_tensor("base_kernel", base_kernel)
    _require_positive_int("block_size", block_size)
    _require_positive_int("group_size", group_size)
    if hidden_states.dim() < 1:
        raise ValueError("hidden_states must have at least one dimension [..., hidden_size].")
    devices = {t.device for t in (hidden_states, delta_kernel, base_kernel)}
    if len(devices) > 1:
        raise ValueError(
            "hidden_states, delta_kernel and base_kernel must be on one device, got "
            f"{hidden_states.device}, {delta_kernel.device} and {base_kernel.device}."
        )

    hidden_size = hidden_states.shape[-1]
    if hidden_size % group_size:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by group_size ({group_size})."
        )
    kernel_size = base_kernel.shape[0] if base_kernel.dim() > 0 else 0
    if kernel_size > block_size:
        raise ValueError(f"kernel_size ({kernel_size}) cannot exceed block_size ({block_size}).")
    if base_kernel.dim() != 2 or kernel_size < 1 or base_kernel.shape[1] != hidden_size:
        raise ValueError(
            "base_kernel must have shape [kernel_size, hidden_size], got "
            f"{tuple(base_kernel.shape)}."
        )
    expected_delta_shape = (*hidden_states.shape[:-1], kernel_size, hidden_size // group_size)
    if tuple(delta_kernel.shape) != expected_delta_shape:
        raise ValueError(
            f"delta_kernel must have shape {expected_delta_shape}, got "
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
    rows = hidden_states.reshape(-1, num_groups, group_size)
    delta = delta_kernel.reshape(-1, kernel_size, num_groups)
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
    """NeMo's conv arguments: the conv's checks, then [B, S, H] with L dividing S."""
    check_grouped_dynamic_conv_args(hidden, dynamic, base_kernel, block_size, group_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [batch, sequence, hidden], got {tuple(hidden.shape)}.")
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
    base_kernel: [K, H]. Rounds like NeMo (base term, then an addcmul per tap).
    Equal to :func:`grouped_dynamic_conv` whenever S is a multiple of block_size.
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
        values = blocks if tap == 0 else torch.nn.functional.pad(
            blocks[:, :, : block_size - tap], (0, 0, 0, 0, tap, 0)
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
