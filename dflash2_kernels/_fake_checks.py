"""Checks the fake (meta) implementations of the C++ ops make, as their kernels do.

A fake implementation runs for FakeTensors under torch.compile and for any call that
involves a ``meta`` tensor: a call mixing CPU and meta tensors reaches it, not the
CPU kernel. Without these checks it would hand back an uninitialised tensor for
arguments the kernel refuses.
"""

from __future__ import annotations

import torch

KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SERVING_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def defined(op: str, **tensors) -> None:
    """Every tensor argument given (the kernels refuse None as csrc/tensor_checks.h does)."""
    for name, tensor in tensors.items():
        if tensor is None:
            raise TypeError(f"{op}: {name} must be a tensor, got None.")


def one_device(op: str, **tensors: torch.Tensor) -> None:
    """Every tensor argument of ``op`` on one device (ValueError naming them otherwise)."""
    devices = {tensor.device for tensor in tensors.values()}
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {listed}.")


def float_dtype(op: str, name: str, dtype: torch.dtype, allowed: tuple = KERNEL_FLOATS) -> None:
    """A dtype the kernel can read or store (TypeError naming the argument otherwise)."""
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{op}: {name} must be one of {names}, got {dtype}.")


def int64_ids(op: str, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype != torch.int64:
            raise TypeError(f"{op}: {name} must be int64, got {tensor.dtype}.")
