"""Drop-in replacements for NeMo Automodel 0.7.0's DFlash 2 pieces, on the fused ops.

Mirrors ``nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2``: the
signatures, constructor errors, attributes, initialisation and checkpoint keys of
``GroupedDynamicCausalConv`` and ``CandidateSelector``, and the module-level
``_grouped_dynamic_convolve`` (here :func:`grouped_dynamic_convolve`) and
``dflash2_rejection_sample``. ``from_upstream`` turns a NeMo module into ours around the
very same ``Parameter`` objects, so an optimizer and a checkpoint see no change.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import modules, reference
from ..conv import grouped_dynamic_conv
from ..serving import rejection_sample

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "CandidateSelector",
    "GroupedDynamicCausalConv",
    "dflash2_rejection_sample",
    "grouped_dynamic_convolve",
]

# NeMo's greedy threshold (draft_qwen3.GREEDY_TEMPERATURE_EPS): below it the walk is
# greedy, because dividing by a tiny temperature can turn the softmax into NaN.
GREEDY_TEMPERATURE_EPS = 1e-5


def grouped_dynamic_convolve(
    hidden: torch.Tensor,
    dynamic: torch.Tensor,
    base_kernel: torch.Tensor,
    group_size: int,
    block_size: int,
) -> torch.Tensor:
    """NeMo's ``_grouped_dynamic_convolve`` on the fused op.

    hidden [B, S, H] float, dynamic [B, S, K, G] (any strides), base_kernel [K, H]
    -> [B, S, H] in ``promote_types(hidden, dynamic)``. Block positions restart with
    every sequence, and a tap that reaches past its block start reads zero, for any
    K >= 1 (NeMo's decode step runs K = 2 taps with block_size 1). S not a multiple of
    block_size is a ValueError naming both (NeMo fails there with a reshape error).
    """
    reference.check_nemo_conv_args(hidden, dynamic, base_kernel, group_size, block_size)
    # Taps >= block_size never reach inside a block: the fused op (which keeps
    # speculators' K <= L rule) runs on the others, and autograd hands the dropped
    # taps zero gradients, which is what they get in NeMo too.
    taps = min(base_kernel.shape[0], block_size)
    return grouped_dynamic_conv(
        hidden, dynamic[..., :taps, :], base_kernel[:taps], block_size=block_size, group_size=group_size
    )


def _require_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")


class GroupedDynamicCausalConv(nn.Module):
    """NeMo's ``GroupedDynamicCausalConv(hidden_size, kernel_size, group_size)``, fused.

    Parameters (NeMo's checkpoint keys): ``base_kernel`` [2, K, H] (side 0 convolves
    the sublayer input, side 1 its output) and ``kernel_projection.weight``
    [2*K*G, H], G = H / group_size. Attributes ``kernel_size`` and ``group_size``.
    The block size comes with every call, as in NeMo.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("conv_kernel_size", kernel_size),
                            ("conv_group_size", group_size)):
            _require_size(name, value)
        # NeMo divides by group_size unchecked (ZeroDivisionError at 0): name it instead.
        if group_size < 1:
            raise ValueError(f"conv_group_size must be >= 1, got {group_size}.")
        if hidden_size % group_size != 0:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}.")
        if kernel_size < 1:
            raise ValueError(f"conv_kernel_size must be >= 1, got {kernel_size}.")
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}.")
        self.kernel_size = kernel_size
        self.group_size = group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        # Built in NeMo's order, so a seeded construction draws the same random numbers.
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)
        self.reset_parameters()

    @classmethod
    def from_upstream(cls, module: nn.Module) -> GroupedDynamicCausalConv:
        """Ours around a NeMo conv's own ``base_kernel`` and ``kernel_projection.weight``
        (the same Parameter objects: no copy, no random numbers drawn). The training
        flag carries over; hooks on the upstream module do not."""
        base = modules.upstream_parameter(module, "base_kernel")
        kernel_size, group_size = getattr(module, "kernel_size", None), getattr(module, "group_size", None)
        if base.dim() != 3 or base.shape[0] != 2 or base.shape[1] != kernel_size:
            raise ValueError(f"the upstream module's base_kernel must have shape [2, kernel_size={kernel_size}, "
                             f"hidden_size], got {tuple(base.shape)}.")
        hidden_size = base.shape[2]
        # The meta device: the constructor's placeholders cost no memory and no RNG draws
        # (and it checks the sizes before the projection's shape is worked out from them).
        with torch.device("meta"):
            conv = cls(hidden_size, kernel_size, group_size)
        shape = (2 * kernel_size * (hidden_size // group_size), hidden_size)
        conv.kernel_projection.weight = modules.upstream_linear_weight(module, "kernel_projection", shape)
        conv.base_kernel = base
        return conv.train(module.training)

    def reset_parameters(self) -> None:
        """The identity convolution: unit self-tap, zero dynamic correction."""
        nn.init.zeros_(self.kernel_projection.weight)
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0, :] = 1.0

    def prepare(self, hidden: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, S, H] (the sublayer input) -> (convolved [B, S, H], dynamic [B, S, K, G]).

        The projection runs once; ``dynamic`` (side 1, for :meth:`finish`) and side 0
        are strided views of its output, which the kernels read in place.
        """
        modules.check_hidden("hidden", hidden, self.kernel_projection.weight)
        width = self.base_kernel.shape[-1]
        if hidden.dim() != 3:
            raise ValueError(f"hidden must have shape [batch, sequence, hidden_size={width}], got "
                             f"{tuple(hidden.shape)}.")
        groups = width // self.group_size
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, groups)
        convolved = grouped_dynamic_convolve(
            hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_size
        )
        return convolved, dynamic[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        """hidden [B, S, H] (the sublayer output), dynamic [B, S, K, G] from :meth:`prepare`
        -> [B, S, H]."""
        return grouped_dynamic_convolve(hidden, dynamic, self.base_kernel[1], self.group_size, block_size)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.base_kernel.shape[-1]}, kernel_size={self.kernel_size}, "
                f"group_size={self.group_size}")


class CandidateSelector(modules.CandidateSelector):
    """NeMo's ``CandidateSelector(vocab_size, hidden_size, rank, top_k)``, fused.

    Parameters (NeMo's checkpoint keys): ``predecessor_codebook`` [V, r],
    ``successor_codebook`` [V, r], ``hidden_projection.weight`` [r, H]. Attributes
    ``rank`` and ``top_k``. ``pair_scores`` is inherited (NeMo's signature already);
    :meth:`walk` follows NeMo's greedy threshold.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                            ("selector_rank", rank), ("selector_top_k", top_k)):
            _require_size(name, value)
        # NeMo's checks first, in NeMo's order and words; the base class checks the rest.
        if rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {rank}.")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k must be in [1, vocab_size={vocab_size}], got {top_k}.")
        # The base class builds the parameters in NeMo's order, then calls our
        # reset_parameters: a seeded construction draws what NeMo's draws.
        super().__init__(vocab_size, hidden_size, rank, top_k)
        self.rank = rank

    @classmethod
    def from_upstream(cls, module: nn.Module) -> CandidateSelector:
        """Ours around a NeMo selector's own codebooks and ``hidden_projection.weight``
        (the same Parameter objects: no copy, no random numbers drawn). The training
        flag carries over; hooks on the upstream module do not."""
        predecessor = modules.upstream_parameter(module, "predecessor_codebook")
        successor = modules.upstream_parameter(module, "successor_codebook")
        if predecessor.dim() != 2 or successor.shape != predecessor.shape:
            raise ValueError("the upstream module's codebooks must both be [vocab_size, rank], got "
                             f"{tuple(predecessor.shape)} and {tuple(successor.shape)}.")
        vocab_size, rank = predecessor.shape
        projection = getattr(module, "hidden_projection", None)
        hidden_size = projection.in_features if isinstance(projection, nn.Linear) else None
        weight = modules.upstream_linear_weight(module, "hidden_projection", (rank, hidden_size))
        with torch.device("meta"):  # placeholders: no memory, no RNG draws
            selector = cls(vocab_size, hidden_size, rank, getattr(module, "top_k", None))
        selector.hidden_projection.weight = weight
        selector.predecessor_codebook = predecessor
        selector.successor_codebook = successor
        return selector.train(module.training)

    def reset_parameters(self) -> None:
        """NeMo's start: predecessor ~ N(0, 0.02), successor zero (so every score is the
        draft's own logit), hidden projection as ``nn.Linear`` built it."""
        with torch.no_grad():
            self.predecessor_codebook.normal_(mean=0.0, std=0.02)
            self.successor_codebook.zero_()

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """NeMo's ``walk``: hidden [B, D, H], logits [B, D, V], anchor_ids [B] int.

        Returns (path [B, D] int64, candidate_ids [B, D, k] int64, draft_probs
        [B, D, k] float32, or None when greedy). Greedy unless temperature >=
        GREEDY_TEMPERATURE_EPS, exactly NeMo's branch (so a negative or NaN temperature
        walks greedily there too); otherwise each step samples from
        softmax(scores.float() / temperature), drawing from ``generator`` (NeMo draws
        from the global generator with torch.multinomial: same distribution, other
        draws).
        """
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {type(temperature).__name__}.")
        temperature = float(temperature) if temperature >= GREEDY_TEMPERATURE_EPS else 0.0
        return super().walk(hidden, logits, anchor_ids, temperature, generator=generator)


def dflash2_rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    candidate_ids: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """NeMo's ``dflash2_rejection_sample`` on :func:`dflash2_kernels.rejection_sample`.

    draft_tokens [1, D] int (the walk's path), target_probs [1, D+1, V] float (the
    verifier's distributions), draft_probs [1, D, k] float (the walk's proposal),
    candidate_ids [1, D, k] int -> (accepted: int, bonus: 0-d int64 tensor on the
    inputs' device). Lossless: d_t is kept while u_t * q_t(d_t) < p_t(d_t), the bonus
    comes from normalize(max(p_a - q_a, 0)) at the first rejection a (p_a when that
    has no mass) or from p_D. Draws from ``generator`` (NeMo: torch.rand_like and
    torch.multinomial on the global generator). Reading ``accepted`` synchronises with
    the device, as NeMo's ``.item()`` does.
    """
    if draft_probs is None:
        # NeMo never rejection-samples a greedy walk: it checks the path against the
        # verifier's argmax instead (dk.greedy_verify does that).
        raise TypeError("draft_probs is None (a greedy walk): verify it with dflash2_kernels.greedy_verify, or "
                        "pass its one-hot proposal (candidate_ids == draft_tokens[..., None]).float().")
    if isinstance(draft_tokens, torch.Tensor) and draft_tokens.dim() == 2 and draft_tokens.shape[0] != 1:
        raise ValueError(f"draft_tokens must be [1, D] (one sequence, as NeMo), got {tuple(draft_tokens.shape)}; "
                         "dflash2_kernels.rejection_sample takes a batch.")
    accepted, bonus = rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids, generator=generator)
    count, token = torch.stack([accepted[0], bonus[0]]).tolist()
    if token < 0:
        # NeMo's torch.multinomial raises RuntimeError here.
        raise ValueError(f"target_probs[0, {count}] has no probability mass to draw the bonus token from.")
    return count, bonus[0]
