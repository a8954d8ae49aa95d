"""Argument checks shared by the serving functions: clear errors naming the argument."""

from __future__ import annotations

import math

import torch

# What the compiled serving ops (torch.ops.dflash2.candidate_topk, select_path,
# rejection_sample) read; the public functions take float64 too, on the reference.
KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SERVING_FLOATS = (*KERNEL_FLOATS, torch.float64)


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
    if generator.device.type != device.type or _device_index(generator.device) != _device_index(device):
        raise ValueError(f"generator is on {generator.device} but the tensors are on {device}.")


def _device_index(device: torch.device) -> int | None:
    """``device``'s index; a CUDA device named without one (``torch.Generator("cuda")``)
    is the current device, as torch resolves it."""
    if device.type == "cuda" and device.index is None:
        return torch.cuda.current_device()
    return device.index if device.type == "cuda" else None


def require_ids_in_range(name: str, ids: torch.Tensor, vocab: int) -> None:
    """IndexError naming ``name`` for an id outside [0, vocab), on CPU tensors, as the
    C++ CPU kernels raise it. Elsewhere nothing is read here (a CUDA tensor would need a
    host synchronisation; the reference gives such ids the CUDA kernels' rule instead),
    nor while torch.compile traces."""
    if ids.device.type != "cpu" or ids.numel() == 0 or torch.compiler.is_compiling():
        return
    flat = ids.reshape(-1)
    bad = ((flat < 0) | (flat >= vocab)).nonzero()
    if bad.numel():
        index = int(bad[0])
        raise IndexError(f"{name} holds {int(flat[index])} at flat index {index}, out of range for a vocabulary "
                         f"of {vocab}.")


def refuse_dtensors(what: str, **tensors) -> None:
    """A clear error for DTensors on a path that runs the PyTorch reference (whose plain
    index tensors cannot meet them): dflash2_kernels.distributed.refuse_dtensors."""
    if any(type(tensor) not in (torch.Tensor, torch.nn.Parameter) for tensor in tensors.values()):
        from ..distributed import refuse_dtensors as refuse

        refuse(what, **tensors)


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even, subnormals included, +-inf
    beyond its range), as a Python float. Plain arithmetic on frexp / ldexp: torch.compile
    traces it on every supported torch (torch 2.5's cannot trace ``struct.pack``)."""
    if value != value or value == 0 or value in (math.inf, -math.inf):
        return value
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    bits = min(24, exponent + 149)  # float32 keeps 24 bits, fewer below 2**-126 (spacing 2**-149)
    result = math.ldexp(round(mantissa * 2.0 ** bits), exponent - bits) if bits >= 0 else 0.0 * value
    return math.copysign(math.inf, value) if abs(result) >= 2.0 ** 128 else result


def kernel_temperature(temperature) -> float:
    """The temperature as the kernels take it, a float32 (returned as a Python float):
    greedy versus sampled is decided from that value on every path, so a positive
    temperature that rounds to 0 walks greedily everywhere. TypeError / ValueError
    naming ``temperature`` unless it is a real number, finite and >= 0 as a float32."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}.")
    value = as_float32(float(temperature))
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 as a float32 (0 selects greedily), "
                         f"got {temperature}.")
    return value


def uniforms(shape: tuple[int, ...], device: torch.device, generator, rows_of=None) -> torch.Tensor:
    """The draws' uniforms in [0, 1): one torch.rand launch, capturable in a CUDA graph.
    Every path (kernels and reference) draws them here, the same way, so a fixed
    generator state gives the same tokens on each. ``rows_of`` a DTensor (the batch's
    rows): the draws become a DTensor laid out as its rows, rank 0's draws on every rank
    (dflash2_kernels.distributed.like_rows)."""
    draws = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    if rows_of is not None and type(rows_of) is not torch.Tensor:
        from ..distributed import like_rows

        draws = like_rows(draws, rows_of)
    return draws
