"""The numerical contract of SPEC section 4, as assertions.

A result is judged against the float64 evaluation of its formula: its largest error may
be at most twice the pure-PyTorch reference's (run in the input dtype) plus a floor of a
few fp32 units in the last place of the output's largest magnitude,

    floor = 4 * eps(float32) * max|exact| + 1e-6     (32- and 16-bit results)
    floor = 1e-12                                     (float64 results)

A summation order, an all-reduce or another BLAS may move a sum by a few ulps of its
magnitude; the floor scales with the value so that a judge holds on every host. A
scalar's reference error is one sample of rounding and may be 0 by chance: for a scalar
the floor is the bar (a few ulps of the value), so no host's summation order decides.
"""

from __future__ import annotations

import torch

_FP32_ULPS = 4
_ABSOLUTE = 1e-6
_FLOAT64_FLOOR = 1e-12


def contract_floor(dtype: torch.dtype, largest: float) -> float:
    """SPEC section 4's floor for a result of ``dtype`` whose exact value's largest
    magnitude is ``largest``."""
    if dtype == torch.float64:
        return _FLOAT64_FLOOR
    return _FP32_ULPS * torch.finfo(torch.float32).eps * largest + _ABSOLUTE


def largest_magnitude(exact: torch.Tensor) -> float:
    """max|exact| over the finite entries (0 for none)."""
    finite = exact[torch.isfinite(exact)] if exact.is_floating_point() else exact
    return finite.abs().max().item() if finite.numel() else 0.0


def contract_violation(name: str, kernel: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor,
                       floor: float) -> str | None:
    """Why ``kernel`` fails SPEC section 4's bar against ``exact`` (float64) with
    ``reference`` setting it, or None. Where the reference itself is not finite but the
    exact value is (a 16-bit reference overflowing on one host's kernels, not another's),
    the reference sets no bar there: the kernel must be within the floor alone."""
    kernel_error = (kernel.double() - exact).abs()
    reference_error = (reference.double() - exact).abs()
    usable = torch.isfinite(reference_error)
    bar = 2 * reference_error[usable].max().item() + floor if usable.any() else floor
    worst = kernel_error[usable].max().item() if usable.any() else 0.0
    if not worst <= bar:
        return (f"{name}: error {worst:.3e} > 2 x reference {reference_error[usable].max().item():.3e} + floor "
                f"{floor:.3e} (max|exact| {largest_magnitude(exact):.4g})")
    if not usable.all():
        beyond = kernel_error[~usable].max().item()
        if not beyond <= floor:
            return (f"{name}: error {beyond:.3e} > floor {floor:.3e} where the reference is not finite "
                    f"({int((~usable).sum())} elements)")
    return None


def assert_within_contract(
    name: str,
    kernel: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor,
    *,
    truncating_stores: bool = False,
) -> None:
    """kernel's max error against float64 <= 2x the reference's + :func:`contract_floor`.

    ``truncating_stores``: the result came from the Triton interpreter, which truncates
    fp32 -> bf16/fp16 stores instead of rounding them, so a 16-bit result may be off
    by one more ulp of its largest value.
    """
    assert kernel.shape == exact.shape, f"{name}: shape {tuple(kernel.shape)} != {tuple(exact.shape)}"
    assert kernel.dtype == reference.dtype, f"{name}: dtype {kernel.dtype} != reference {reference.dtype}"
    assert not torch.isnan(kernel).any(), f"{name}: NaN in the kernel's result (unwritten element?)"
    if exact.numel() == 0:
        return
    largest = largest_magnitude(exact.double())
    floor = contract_floor(kernel.dtype, largest)
    if truncating_stores and kernel.dtype in (torch.bfloat16, torch.float16):
        floor += torch.finfo(kernel.dtype).eps * largest
    violation = contract_violation(name, kernel, reference, exact.double(), floor)
    assert violation is None, violation


def assert_same_within_floor(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """Two of our computations of one value that may differ only by summation order
    (eager and compiled, one process and several, a DTensor and its local tensor): equal
    shape and dtype, the same non-finite values, and every difference within
    :func:`contract_floor` of ``expected``'s largest magnitude; a 16-bit result may also
    differ by one ulp of its dtype there (each side rounds its fp32 value once)."""
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
    if got.numel() == 0:
        return
    got64, want64 = got.detach().double(), expected.detach().double()
    special = ~torch.isfinite(want64)
    same = (got64[special] == want64[special]) | (got64[special].isnan() & want64[special].isnan())
    assert same.all(), f"{name}: a non-finite value of the expected result differs"
    got64, want64 = got64[~special], want64[~special]
    if not got64.numel():
        return
    difference = (got64 - want64).abs().max().item()
    largest = largest_magnitude(expected.detach().double())
    floor = contract_floor(got.dtype, largest)
    if got.dtype in (torch.bfloat16, torch.float16):
        floor += torch.finfo(got.dtype).eps * largest
    assert difference <= floor, f"{name}: results differ by {difference:.3e} > floor {floor:.3e}"
