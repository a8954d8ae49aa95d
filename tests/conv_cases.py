"""The conv's case table and input builders, shared by the numerics tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2_kernels import reference

F32 = (torch.float32, torch.float32, torch.float32)
F64 = (torch.float64, torch.float64, torch.float64)
BF16 = (torch.bfloat16, torch.bfloat16, torch.bfloat16)
F16 = (torch.float16, torch.float16, torch.float16)
# speculators under bf16 autocast: fp32 x, bf16 strided delta, fp32 base.
AUTOCAST = (torch.float32, torch.bfloat16, torch.float32)
# pure bf16 activations with fp32 master weights: the base is rounded to bf16 first.
BF16_FP32_BASE = (torch.bfloat16, torch.bfloat16, torch.float32)
BF16_FP32_DELTA = (torch.bfloat16, torch.float32, torch.float32)
# fp64 beside 16-bit operands: fp64 accumulation, results rounded once to 16 bits.
F64_BF16_DELTA = (torch.float64, torch.bfloat16, torch.float64)
F16_F64_DELTA = (torch.float16, torch.float64, torch.float16)


@dataclass(frozen=True)
class ConvCase:
    lead: tuple[int, ...]
    hidden: int
    group_size: int
    kernel_size: int
    block_size: int
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = F32
    strided_delta: bool = False
    x_row_stride: bool = False

    @property
    def id(self) -> str:
        names = "-".join(str(d).removeprefix("torch.") for d in self.dtypes)
        flags = ("+sd" if self.strided_delta else "") + ("+rs" if self.x_row_stride else "")
        lead = "x".join(map(str, self.lead))
        return f"{lead}x{self.hidden}-gs{self.group_size}-K{self.kernel_size}-L{self.block_size}-{names}{flags}"


# Tiles: 16 rows (8 in the backward) x 256 channels (BLOCK_G groups of BLOCK_J channels).
CASES = [
    ConvCase((37,), 40, 8, 2, 8),  # N % L != 0, H narrower than one tile
    ConvCase((2, 13), 48, 16, 2, 8, strided_delta=True),  # blocks straddle sequences
    ConvCase((3, 16), 320, 16, 2, 16, strided_delta=True, x_row_stride=True),  # 2 group tiles
    ConvCase((29,), 264, 8, 3, 8),  # G = 33: a second group tile with one group
    ConvCase((21,), 32, 8, 1, 1),  # K = L = 1
    ConvCase((19,), 40, 8, 2, 2),  # L == K
    ConvCase((23,), 40, 8, 3, 3),  # L == K == 3
    ConvCase((4, 9), 48, 16, 3, 16, x_row_stride=True),
    ConvCase((150,), 40, 8, 2, 8),  # many row tiles: several chunks of several steps
    ConvCase((17,), 72, 24, 2, 8),  # group size not a power of two
    ConvCase((17,), 600, 300, 2, 8, strided_delta=True),  # a group split over 3 channel tiles
    ConvCase((19,), 60, 12, 2, 8),  # group size not a multiple of 8 (C++: vector lanes + a tail)
    ConvCase((19,), 36, 3, 3, 8, strided_delta=True),  # group size under 8 (C++: the tail alone)
    ConvCase((37,), 40, 8, 2, 8, BF16),
    ConvCase((2, 13), 320, 16, 2, 8, BF16, strided_delta=True),
    ConvCase((37,), 40, 8, 2, 8, F16),
    ConvCase((2, 24), 320, 16, 2, 8, AUTOCAST, strided_delta=True),
    ConvCase((33,), 48, 16, 2, 8, BF16_FP32_BASE),
    ConvCase((33,), 48, 16, 2, 8, BF16_FP32_DELTA),
    ConvCase((5, 8), 32, 16, 2, 8, F64),
    ConvCase((19,), 48, 16, 2, 8, F64_BF16_DELTA),
    ConvCase((19,), 48, 16, 2, 8, F16_F64_DELTA),
    ConvCase((0,), 40, 8, 2, 8),  # empty
    ConvCase((2, 0), 48, 16, 2, 8, BF16),  # empty leading dim
]

# Training sizes (SPEC section 5): 64k rows, delta one side of the [..., 2, K, G]
# projection. dbase sums over every row, so how its sum is accumulated shows at this size.
TRAINING_CASES = [
    ConvCase((4, 16384), 256, 16, 2, 8, F32, strided_delta=True),
    ConvCase((65536,), 256, 16, 2, 8, BF16, strided_delta=True),
]

# The Triton interpreter takes ~20 ms a row step, too slow for TRAINING_CASES. Two
# groups wide, a backward tile holds 64 rows, so 16k rows are 256 row steps: one
# program taking them all runs 4x the longest chain a launch plans (64 steps).
LONG_CHAIN_CASE = ConvCase((4, 4096), 32, 16, 2, 8, F32, strided_delta=True)


def make_inputs(case: ConvCase, device: str, seed: int = 0):
    """(x [..., H], delta [..., K, G], base [K, H], dy [..., H]) on device, fresh random."""
    generator = torch.Generator().manual_seed(seed)
    x_dtype, delta_dtype, base_dtype = case.dtypes
    num_groups = case.hidden // case.group_size
    k = case.kernel_size

    def randn(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype).to(device)

    if case.x_row_stride:
        x = randn(*case.lead, case.hidden + 24, dtype=x_dtype)[..., : case.hidden]
    else:
        x = randn(*case.lead, case.hidden, dtype=x_dtype)
    if case.strided_delta:
        delta = randn(*case.lead, 2, k, num_groups, dtype=delta_dtype, scale=0.5)[..., 1, :, :]
    else:
        delta = randn(*case.lead, k, num_groups, dtype=delta_dtype, scale=0.5)
    base = randn(k, case.hidden, dtype=base_dtype)
    out_dtype = torch.promote_types(x_dtype, delta_dtype)
    dy = randn(*case.lead, case.hidden, dtype=out_dtype)
    return x, delta, base, dy


def conv_with_grads(fn, x, delta, base, dy, case: ConvCase):
    """(out, dx, ddelta, dbase) of fn(x, delta, base) with upstream gradient dy."""
    # detach() keeps the strides, so strided inputs reach the op as they are.
    leaves = [t.detach().requires_grad_() for t in (x, delta, base)]
    out = fn(*leaves, block_size=case.block_size, group_size=case.group_size)
    grads = torch.autograd.grad(out, leaves, dy)
    return (out.detach(), *grads)


def exact_conv_with_grads(x, delta, base, dy, case: ConvCase):
    """The float64 judge: the same formula on float64 copies, base rounded to x's dtype."""
    x64 = x.detach().double()
    delta64 = delta.detach().double()
    base64 = base.detach().to(x.dtype).double()
    return conv_with_grads(reference.grouped_dynamic_conv, x64, delta64, base64, dy.double(), case)
