"""Argument checks shared by the serving functions: clear errors naming the argument."""

from __future__ import annotations

import torch

SERVING_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def require_tensor(name: str, value, *, dim: int | None = None, floats: tuple | None = None,
                   integer: bool = False) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(value.shape)}.")
    if floats is not None and value.dtype not in floats:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in floats)
        raise TypeError(f"{name} must be one of {names}, got {value.dtype}.")
    if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise TypeError(f"{name} must hold integer token ids, got {value.dtype}.")


def require_one_device(**tensors: torch.Tensor) -> torch.device:
    devices = {tensor.device for tensor in tensors.values()}
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {listed}.")
    return devices.pop()


def require_generator(generator, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
    if generator.device.type != device.type or (device.type == "cuda" and generator.device.index != device.index):
        raise ValueError(f"generator is on {generator.device} but the tensors are on {device}.")


def uniforms(shape: tuple[int, ...], device: torch.device, generator) -> torch.Tensor:
    """The draws' uniforms in [0, 1): one torch.rand launch, capturable in a CUDA graph."""
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
