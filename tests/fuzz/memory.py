"""Fuzz cases for ``dflash2::cpu_cached_empty`` (csrc/cpu_cached_empty.cpp): an
uninitialized CPU tensor of any size and real dtype from the C++ ops' result cache (the
draft head's chunk buffers). Valid calls must give a contiguous CPU tensor of exactly that
shape and dtype, writable in full (blocks from 64 KiB come from the cache, smaller ones
from at::empty); bad sizes and dtypes must raise naming the argument."""

from __future__ import annotations

import torch

import dflash2_kernels  # noqa: F401 - loads torch.ops.dflash2

from .case import Agrees, Call, Case
from .draw import Draw
from .mutations import Mutation, at_op_boundary, bad_case

BAD_FRACTION = 0.5
REAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool)


def cpu_cached_empty_case(draw: Draw) -> Case:
    """dflash2::cpu_cached_empty(size int[], dtype) -> Tensor."""
    dims = draw.integer(0, 3)
    size = [draw.size(0, 70, edges=(0, 1)) for _ in range(dims)]  # at most 343k elements
    if draw.chance(0.3):  # from 64 KiB (16,384 floats) up: memory from the cache itself
        size = [draw.integer(16_384, 70_000)]
    dtype = draw.pick(REAL_DTYPES)
    args = dict(size=size, dtype=dtype)
    op = torch.ops.dflash2.cpu_cached_empty
    if draw.chance(BAD_FRACTION):
        negative = list(size) + [draw.pick([-1, -7, -(2**40)])]
        mutations = [
            Mutation("a negative extent", "size", negative, ("size",)),
            Mutation("more elements than int64 counts", "size", [2**40, 2**40], ("size",)),
            Mutation("a complex dtype", "dtype", draw.pick([torch.complex64, torch.complex128]), ("dtype",)),
            Mutation("a string for a dtype", "dtype", "float32", ("dtype",)),
            Mutation("None for a dtype", "dtype", None, ("dtype",)),
        ]
        return bad_case(draw, Call(op, args), at_op_boundary(mutations))

    def run():
        out = op(size, dtype)
        out.fill_(1)  # every element writable
        return out

    def judge(out) -> None:
        assert isinstance(out, torch.Tensor), f"expected a tensor, got {out!r}"
        assert tuple(out.shape) == tuple(size), f"shape {tuple(out.shape)} != {tuple(size)}"
        assert out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous(), \
            f"{out.dtype} on {out.device}, contiguous: {out.is_contiguous()}"
        assert bool((out == 1).all()), "not every element holds what was written"

    return Case(f"valid ({len(size)}-D {dtype})", run, Agrees(judge), args)
