"""How results are judged: the SPEC section 4 contract against float64, and exact equality.

The contract (tests/contract.py) is extended in two ways the fuzzer's tiny and special
cases need:

- non-finite expectations: where the float64 evaluation is NaN or +-inf (a -inf logit, a
  NaN codebook row) the kernel must give the same value; elsewhere the bar applies;
- half an ulp of the output dtype (at the largest expected magnitude) is added to the
  bar (SPEC section 4's floor, tests/contract.py's contract_floor, is 4 fp32 ulps: less
  than one rounding to a 16-bit dtype). On a one-element output the reference can round
  luckily to an error of zero; a correctly rounded result must still pass. Anything
  beyond one rounding still fails.
"""

from __future__ import annotations

import torch

from ..contract import contract_floor, contract_violation


def compute_dtype(*tensors) -> torch.dtype:
    """The precision kernels compute in: float64 when any float input is float64, else
    float32 (README: "compute in fp32 (fp64 when an input is fp64)")."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def assert_contract(name: str, got, reference: torch.Tensor, exact: torch.Tensor, *,
                    truncating_stores: bool = False, compute_dtype: torch.dtype | None = None) -> None:
    """got within twice the reference's error of the float64 result (SPEC section 4), as
    tests/contract.py's assert_within_contract judges it, plus the two extensions above.

    compute_dtype: when a raw op is asked for an output finer than it computes in (fp64
    out of fp32 inputs), the result is judged as the compute dtype's: an fp32 value
    stored in fp64 cannot carry fp64 accuracy, and the reference's is as random.
    """
    assert isinstance(got, torch.Tensor), f"{name}: expected a tensor, got {type(got).__name__}"
    assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    assert got.dtype == reference.dtype, f"{name}: dtype {got.dtype} != reference {reference.dtype}"
    assert got.device == exact.device, f"{name}: device {got.device} != {exact.device}"
    if compute_dtype is not None and got.dtype.itemsize > compute_dtype.itemsize:
        got, reference = got.to(compute_dtype), reference.to(compute_dtype)
    special = ~torch.isfinite(exact)
    if special.any():
        at_special = got[special].double()
        wanted = exact[special]
        same = (at_special == wanted) | (at_special.isnan() & wanted.isnan())
        if not same.all():
            where = special.nonzero()[~same][0].tolist()
            raise AssertionError(f"{name}: at {where} expected {exact[tuple(where)].item()} (non-finite), "
                                 f"got {got[tuple(where)].item()}")
        got, reference, exact = got[~special], reference[~special], exact[~special]
    assert not torch.isnan(got).any(), f"{name}: NaN in the kernel's result (unwritten element?)"
    if exact.numel() == 0:
        return
    largest = exact.abs().max().item()
    floor = contract_floor(got.dtype, largest) + torch.finfo(got.dtype).eps / 2 * largest
    if truncating_stores and got.dtype in (torch.bfloat16, torch.float16):
        floor += torch.finfo(got.dtype).eps * largest  # as tests/contract.py allows the Triton interpreter
    violation = contract_violation(name, got, reference, exact.double(), floor)
    assert violation is None, f"{violation} (the floor with half an ulp)"


def assert_equal(name: str, got, expected: torch.Tensor) -> None:
    """Same dtype, shape and values (NaN equal to NaN)."""
    assert isinstance(got, torch.Tensor), f"{name}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    same = (got == expected) | (got.isnan() & expected.isnan()) if got.is_floating_point() else got == expected
    if not same.all():
        where = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{name}: at {where} got {got[tuple(where)].item()}, "
                             f"expected {expected[tuple(where)].item()} ({int((~same).sum())} elements differ)")


def float64(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 copy of a float tensor (ids pass through), detached."""
    tensor = tensor.detach()
    return tensor.double() if tensor.is_floating_point() else tensor


def with_grads(fn, leaves: dict[str, torch.Tensor], others: dict, grad_out: torch.Tensor,
               *, output_index: int | None = None) -> dict[str, torch.Tensor]:
    """{'out': fn(**leaves, **others), 'd<name>': gradient} for upstream gradient grad_out.

    detach() keeps strides, so strided inputs reach the function as they are. A leaf the
    result does not depend on gets a zero gradient (torch's materialize_grads).
    """
    inputs = {name: tensor.detach().requires_grad_() for name, tensor in leaves.items()}
    out = fn(**inputs, **others)
    if output_index is not None:
        out = out[output_index]
    grads = torch.autograd.grad(out, list(inputs.values()), grad_out.to(out.dtype), allow_unused=True,
                                materialize_grads=True) if inputs else ()
    return {"out": out.detach(), **{f"d{name}": grad for name, grad in zip(inputs, grads)}}


def assert_all_contract(results: dict, references: dict, exacts: dict, *, truncating_stores: bool = False) -> None:
    """assert_contract for every entry of the float64 results (output and gradients)."""
    for name, exact in exacts.items():
        assert name in results, f"{name}: missing from the result"
        assert_contract(name, results[name], references[name], exact, truncating_stores=truncating_stores)
