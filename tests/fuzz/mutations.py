"""Generic ways to break one argument of a valid call, each with the names the error
message may use for it.

A mutation always makes the call invalid by the op's documented contract; shape
mutations that depend on how arguments relate live with their target's generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .case import Call
from .draw import NON_FLOATS, NON_INTEGERS, Draw


@dataclass(frozen=True)
class Mutation:
    """Replace ``argument`` by ``value``; the error must name one of ``names``."""

    label: str
    argument: str
    value: Any
    names: tuple[str, ...]
    binding: bool = False  # refused by torch's dispatcher before a raw op runs (see Raises)

    def apply(self, call: Call) -> Call:
        return call.replaced(self.argument, self.value)


# What torch's dispatcher refuses at a raw op's boundary, before the op's code sees it.
# None for a Tensor is not among them: it reaches the op as an undefined tensor.
BINDING_LABELS = ("a list for a tensor", "float", "a string for an int", ">= 2**63", "None for an int",
                  "a string for a dtype", "None for a dtype", "a string for a float", "None for a float")


# What torch's dispatcher turns into a valid argument before a raw op's code runs: an
# int argument given True arrives as 1 (README, "Bad input": a documented non-error).
CONVERTED_LABELS = ("bool True",)


def at_op_boundary(mutations: list[Mutation]) -> list[Mutation]:
    """The same mutations of a raw op's (torch.ops.dflash2.*) arguments: those the
    dispatcher refuses itself are marked ``binding``; those it converts into valid
    arguments are dropped (the op cannot tell them apart)."""
    return [Mutation(m.label, m.argument, m.value, m.names, m.label in BINDING_LABELS) for m in mutations
            if m.label not in CONVERTED_LABELS]


def _names(argument: str, partners) -> tuple[str, ...]:
    return tuple(dict.fromkeys((argument, *partners)))


def float_tensor_mutations(draw: Draw, argument: str, tensor: torch.Tensor, *, accepted=None,
                           partners=()) -> list[Mutation]:
    """A float argument given a wrong dtype, None, a Python list, or a 'meta' tensor
    among CPU ones. ``accepted``: the float dtypes it takes (others count as wrong)."""
    wrong = [dtype for dtype in (*NON_FLOATS, torch.float16, torch.bfloat16, torch.float32, torch.float64)
             if accepted is not None and dtype not in accepted or dtype in NON_FLOATS]
    dtype = draw.pick(wrong)
    names = _names(argument, partners)
    return [
        Mutation(f"dtype {str(dtype).removeprefix('torch.')}", argument, _cast(tensor, dtype), names),
        Mutation("None for a tensor", argument, None, (argument,)),
        Mutation("a list for a tensor", argument, tensor.detach().tolist(), (argument,)),
        Mutation("on the meta device", argument, tensor.detach().to("meta"), (argument,)),
    ]


def id_tensor_mutations(draw: Draw, argument: str, tensor: torch.Tensor, vocab: int, *, accepted=None,
                        check_range: bool = True, partners=()) -> list[Mutation]:
    """An id argument given a non-integer (or, for raw ops, non-int64) dtype, None, a
    'meta' tensor, or (CPU checks every id) an id outside [0, vocab)."""
    wrong = list(NON_INTEGERS)
    if accepted is not None:
        wrong += [dtype for dtype in (torch.int8, torch.int16, torch.int32, torch.uint8) if dtype not in accepted]
    dtype = draw.pick(wrong)
    mutations = [
        Mutation(f"dtype {str(dtype).removeprefix('torch.')}", argument, _cast(tensor, dtype),
                 _names(argument, partners)),
        Mutation("None for a tensor", argument, None, (argument,)),
        Mutation("on the meta device", argument, tensor.detach().to("meta"), (argument,)),
    ]
    limits = torch.iinfo(tensor.dtype)
    representable = [i for i in (vocab, vocab + 1, -1, -vocab - 1, 2**40, -(2**62)) if limits.min <= i <= limits.max]
    if check_range and tensor.numel() and representable:
        bad_id = draw.pick(representable)
        out_of_range = tensor.contiguous().clone()
        out_of_range.view(-1)[draw.integer(0, tensor.numel() - 1)] = bad_id
        mutations.append(Mutation(f"id {bad_id} (V={vocab})", argument, out_of_range, (argument,)))
    return mutations


def size_mutations(draw: Draw, argument: str, *, too_large=None, partners=()) -> list[Mutation]:
    """An int size (block_size, top_k, ...) that is < 1, a bool, a float, None, a string,
    beyond int64, or (``too_large``) above its documented maximum."""
    names = _names(argument, partners)
    mutations = [
        Mutation("0", argument, 0, names),
        Mutation("negative", argument, draw.pick([-1, -7, -(2**40)]), names),
        Mutation("bool True", argument, True, names),
        Mutation("float", argument, draw.pick([2.0, 1.5, float("nan")]), names),
        Mutation("None for an int", argument, None, names),
        Mutation("a string for an int", argument, "8", names),
        Mutation(">= 2**63", argument, draw.pick([2**63, 2**64 + 3, 10**30]), names),
    ]
    if too_large is not None:
        mutations.append(Mutation("above its maximum", argument, too_large, names))
    return mutations


def dtype_argument_mutations(draw: Draw, argument: str, accepted) -> list[Mutation]:
    """A ScalarType argument (out_dtype, score_dtype, ...) naming a type it cannot produce,
    or not a dtype at all."""
    wrong = [dtype for dtype in (*NON_FLOATS, torch.float16, torch.bfloat16, torch.float32, torch.float64)
             if dtype not in accepted]
    return [
        Mutation("a dtype it cannot store", argument, draw.pick(wrong), (argument,)),
        Mutation("a string for a dtype", argument, "float32", (argument,)),
        Mutation("None for a dtype", argument, None, (argument,)),
    ]


def temperature_mutations(draw: Draw, argument: str = "temperature") -> list[Mutation]:
    return [
        Mutation("negative", argument, draw.pick([-0.5, -1e-3, -float("inf")]), (argument,)),
        Mutation("NaN", argument, float("nan"), (argument,)),
        Mutation("inf", argument, float("inf"), (argument,)),
        Mutation("a string for a float", argument, "hot", (argument,)),
        Mutation("None for a float", argument, None, (argument,)),
    ]


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach()
    if dtype.is_complex:
        return tensor.to(torch.float32).to(dtype)
    if dtype == torch.float8_e4m3fn:
        return tensor.to(torch.float32).clamp(-100, 100).to(dtype)
    if tensor.is_floating_point() and not dtype.is_floating_point:
        return tensor.clamp(-100, 100).to(dtype)  # integer casts of large floats are undefined
    return tensor.to(dtype)


# --- shape helpers for the targets' own mutations ------------------------------------


def with_dim_resized(draw: Draw, tensor: torch.Tensor, dim: int, delta: int = 1) -> torch.Tensor:
    """A tensor like ``tensor`` with dim ``dim`` grown by delta (shrunk if that would be < 0)."""
    shape = list(tensor.shape)
    shape[dim] = shape[dim] + delta if shape[dim] + delta >= 0 else shape[dim] + abs(delta)
    return _like(draw, tensor, shape)


def with_extra_dim(draw: Draw, tensor: torch.Tensor, size: int = 2) -> torch.Tensor:
    return _like(draw, tensor, [size, *tensor.shape])


def with_dim_dropped(draw: Draw, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    shape = list(tensor.shape)
    del shape[dim]
    return _like(draw, tensor, shape)


def _like(draw: Draw, tensor: torch.Tensor, shape) -> torch.Tensor:
    """Fresh values of tensor's dtype (ids: 0, valid for any vocabulary)."""
    if tensor.is_floating_point():
        return draw.randn(shape, tensor.dtype)
    return torch.zeros(shape, dtype=tensor.dtype)


def bad_case(draw: Draw, call: Call, mutations: list[Mutation]):
    """A case that applies one of ``mutations`` (drawn) to an otherwise valid call."""
    from .case import Case, Raises

    mutation = draw.pick(mutations)
    broken = mutation.apply(call)
    return Case(f"bad {mutation.argument}: {mutation.label}", broken, Raises(mutation.names, mutation.binding),
                broken.args)
