"""The draft head's argument checks (SPEC section 7), shared by the public function and
the custom ops: each raises ValueError / TypeError / IndexError naming the argument
before any kernel runs."""

from __future__ import annotations

import math

import torch

from .. import reference

LOSS_ORDER = reference.DRAFT_HEAD_LOSSES  # bit i of a loss mask is LOSS_ORDER[i]
SOFT_LOSS_MASK = sum(1 << LOSS_ORDER.index(name) for name in reference.SOFT_LOSSES)
CE_MASK = 1 << LOSS_ORDER.index("ce")
HEAD_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
IGNORE_INDEX = reference.IGNORE_INDEX


def loss_mask_of(losses) -> int:
    """The bit mask of a sequence of loss names (each once, any order)."""
    if isinstance(losses, str):
        raise TypeError(f"losses must be a sequence of loss names such as ('kl_div',), got the string {losses!r}.")
    try:
        names = list(losses)
    except TypeError:
        raise TypeError(f"losses must be a sequence of loss names, got {type(losses).__name__}.") from None
    mask = 0
    for name in names:
        if name not in LOSS_ORDER:
            raise ValueError(f"losses holds {name!r}, not one of {', '.join(LOSS_ORDER)}.")
        bit = 1 << LOSS_ORDER.index(name)
        if mask & bit:
            raise ValueError(f"losses names {name!r} twice.")
        mask |= bit
    return mask


def loss_count(loss_mask: int) -> int:
    """How many losses a mask asks for (a loop over the bits, not ``bin(mask).count``:
    torch 2.5's dynamo cannot trace ``bin``)."""
    count = 0
    for bit in range(len(LOSS_ORDER)):
        count += (loss_mask >> bit) & 1
    return count


def loss_names(loss_mask: int) -> tuple[str, ...]:
    """The losses of a mask, in LOSS_ORDER (the order of every [L, ...] tensor)."""
    return tuple(name for i, name in enumerate(LOSS_ORDER) if loss_mask >> i & 1)


def _tensor(name: str, value, *, floats: bool = False) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if floats and value.dtype not in HEAD_FLOATS:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in HEAD_FLOATS)
        raise TypeError(f"{name} must be one of {allowed}, got {value.dtype}.")
    return value


def check_head_args(hidden, weight, target_hidden, target_weight, labels, loss_mask: int, top_k: int,
                    logit_scale: float, softcap: float, logits_dtype) -> None:
    """hidden [..., H], weight [V, H], target_hidden like hidden, target_weight like weight,
    labels [...] int64 in [0, V) or -100; softcap 0 means none. Label values are checked on
    CPU tensors only: on CUDA a check would cost a host sync, and the kernels make a bad
    label's row NaN instead of reading outside the row."""
    _tensor("hidden", hidden, floats=True)
    _tensor("weight", weight, floats=True)
    if hidden.dim() < 1:
        raise ValueError("hidden must be [..., H], got a 0-dimensional tensor.")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}.")
    vocab, width = weight.shape
    if hidden.shape[-1] != width:
        raise ValueError(f"hidden's last dim {hidden.shape[-1]} must equal weight's H = {width} "
                         f"(weight [V, H] = {tuple(weight.shape)}).")
    if vocab < 1:
        raise ValueError(f"weight must have at least one row (V >= 1), got shape {tuple(weight.shape)}.")
    tensors = {"hidden": hidden, "weight": weight}
    if target_hidden is not None:
        _tensor("target_hidden", target_hidden, floats=True)
        if target_hidden.shape != hidden.shape:
            raise ValueError(f"target_hidden must have hidden's shape {tuple(hidden.shape)}, "
                             f"got {tuple(target_hidden.shape)}.")
        tensors["target_hidden"] = target_hidden
    if target_weight is not None:
        _tensor("target_weight", target_weight, floats=True)
        if target_hidden is None:
            raise ValueError("target_weight was given without target_hidden.")
        if target_weight.shape != weight.shape:
            raise ValueError(f"target_weight must have weight's shape {tuple(weight.shape)}, "
                             f"got {tuple(target_weight.shape)}.")
        tensors["target_weight"] = target_weight
    if labels is not None:
        _tensor("labels", labels)
        if labels.dtype != torch.int64:
            raise TypeError(f"labels must be int64, got {labels.dtype}.")
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                             f"got {tuple(labels.shape)}.")
        tensors["labels"] = labels
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"draft_head: all tensors must be on one device, got {listed}.")
    if not isinstance(loss_mask, int) or isinstance(loss_mask, bool) or not 0 <= loss_mask < 1 << len(LOSS_ORDER):
        raise ValueError(f"loss_mask must be an int in [0, {(1 << len(LOSS_ORDER)) - 1}], got {loss_mask!r}.")
    if loss_mask & SOFT_LOSS_MASK and target_hidden is None:
        raise ValueError(f"losses {loss_names(loss_mask & SOFT_LOSS_MASK)} need target_hidden (the soft target).")
    if loss_mask & CE_MASK and target_hidden is None and labels is None:
        raise ValueError("loss 'ce' needs labels or target_hidden (whose argmax is then the label).")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in [0, V = {vocab}], got {top_k!r}.")
    if not isinstance(logit_scale, (int, float)) or isinstance(logit_scale, bool) \
            or not math.isfinite(logit_scale) or logit_scale == 0:
        raise ValueError(f"logit_scale must be a finite nonzero number, got {logit_scale!r}.")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ValueError(f"softcap must be a finite positive number (or None), got {softcap!r}.")
    if logits_dtype not in HEAD_FLOATS:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in HEAD_FLOATS)
        raise TypeError(f"logits_dtype must be one of {allowed}, got {logits_dtype!r}.")
    if labels is not None and labels.numel() and labels.device.type == "cpu" and has_data(labels):
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            value = int(labels[bad][0])
            raise IndexError(f"labels holds {value}, out of range for a vocabulary of {vocab} "
                             f"(-100 ignores a row).")


def has_data(tensor: torch.Tensor) -> bool:
    """Whether the tensor's values can be read now: not fake, not meta, not inside a
    CUDA graph capture (where a read would break the capture)."""
    if tensor.device.type == "meta" or isinstance(tensor, torch._subclasses.FakeTensor):
        return False
    if torch.compiler.is_compiling():
        return False
    if tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True
