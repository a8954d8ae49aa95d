"""What the trainers' fused-head forwards share: the lm_head's pieces and the logits dtype.

``speculators_head`` and ``nemo_head`` replace the two trainers' training forwards with
ones that call :func:`dflash2_kernels.draft_head` in place of ``lm_head(hidden)``; this
module reads an lm_head the way both need it, and works out the dtype upstream's dense
logits would have had, which the fused head rounds its logits to before top-k / argmax.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["head_weight", "logits_at", "logits_dtype_of", "with_heads_returning_input"]


def head_weight(head: nn.Module, name: str) -> torch.Tensor:
    """``head.weight`` [V, H] of a bias-free linear lm_head, or a ValueError naming ``name``.

    The fused head has no bias term (no DFlash 2 verifier's lm_head has one); a biased
    head would be silently wrong, so it is refused.
    """
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"fused_head needs {name} to be a linear layer with a [vocab, hidden] weight, "
                         f"got {type(head).__name__}.")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"fused_head cannot fold {name}'s bias into dflash2_kernels.draft_head: unpatch the "
                         "fused head (dk.patch(model) without fused_head) for a biased lm_head.")
    return weight


def logits_dtype_of(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of ``nn.Linear``'s ``hidden @ weight.T`` here: autocast's when it is on
    for hidden's device, else the weight's (a plain Linear needs the two to agree)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def logits_at(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] . weight[ids] -> [...] float32 (float64 for float64 weights): one
    logit per row at a given id (O(N * H): the verifier's logit at its own argmax)."""
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    rows = weight.detach()[ids.reshape(-1)].to(dtype)
    return (hidden.detach().reshape(-1, hidden.shape[-1]).to(dtype) * rows).sum(-1).reshape(ids.shape)


def _return_input(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def with_heads_returning_input(heads, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` while each of ``heads`` returns its input: upstream's own
    forward then hands back the normed hidden states it would have projected to [N, V]
    (module hooks still run; the heads' weights are untouched).

    A function, not a ``with`` block: upstream's backbone breaks torch.compile's graph (a
    ``torch.compiler.disable``d mask builder), and Dynamo cannot resume a frame inside a
    user context manager; it would run the caller's whole frame eager. Here the break
    lands at this call, as it lands at upstream's own call of its backbone.
    """
    saved = [(head, vars(head).get("forward")) for head in heads]
    try:
        for head in heads:
            head.forward = _return_input
        return fn(*args, **kwargs)
    finally:
        for head, forward in saved:
            if forward is None:
                vars(head).pop("forward", None)
            else:
                head.forward = forward
