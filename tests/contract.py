"""The numerical contract of SPEC section 4, as assertions."""

from __future__ import annotations

import torch

_ABSOLUTE_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float16: 1e-6}


def assert_within_contract(
    name: str,
    kernel: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor,
    *,
    truncating_stores: bool = False,
) -> None:
    """kernel's max error against float64 <= 2x the reference's, plus a tiny floor.

    ``truncating_stores``: the result came from the Triton interpreter, which truncates
    fp32 -> bf16/fp16 stores instead of rounding them, so a 16-bit result may be off
    by one more ulp of its largest value.
    """
    assert kernel.shape == exact.shape, f"{name}: shape {tuple(kernel.shape)} != {tuple(exact.shape)}"
    assert kernel.dtype == reference.dtype, f"{name}: dtype {kernel.dtype} != reference {reference.dtype}"
    assert not torch.isnan(kernel).any(), f"{name}: NaN in the kernel's result (unwritten element?)"
    if exact.numel() == 0:
        return
    kernel_error = (kernel.double() - exact).abs().max().item()
    reference_error = (reference.double() - exact).abs().max().item()
    floor = _ABSOLUTE_FLOOR[kernel.dtype]
    if truncating_stores and kernel.dtype in (torch.bfloat16, torch.float16):
        floor += torch.finfo(kernel.dtype).eps * exact.abs().max().item()
    assert kernel_error <= 2 * reference_error + floor, (
        f"{name}: error {kernel_error:.3e} > 2 x reference {reference_error:.3e} + {floor:.1e}"
    )
