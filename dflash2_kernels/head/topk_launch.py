"""Launcher of the draft head's Triton top-k (topk_kernels.py): checks, tile, grid, and the
final ordering of the K picked per row.

Grid: one program per row (a chunk brings hundreds of rows: several waves over the GPU's
SMs). Tile (sm_90; tests/test_triton_aot.py compiles both key widths and forbids spills):
BLOCK_V 2048 over 8 warps for 32-bit keys (fp16, bf16, fp32 values: 8 entries a thread),
1024 over 8 for 64-bit keys (fp64). The kernel reads the row KEY_BITS / 8 + 1 times,
whatever K is. Not measured on a GPU yet.
"""

from __future__ import annotations

import numbers

import torch

from ..conv.launch import KernelLaunch
from .topk_kernels import draft_head_topk_kernel

KERNELS_INTERPRETED = type(draft_head_topk_kernel).__name__ == "InterpretedFunction"
VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_PROGRAMS = 2**31 - 1


def topk_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(KEY_BITS, BLOCK_V, num_warps) for values of ``dtype``."""
    return (64, 1024, 8) if dtype == torch.float64 else (32, 2048, 8)


def plan_row_topk(values: torch.Tensor, top_k: int, ids: torch.Tensor, keys: torch.Tensor) -> KernelLaunch:
    """The launch over checked arguments: ids, keys [R, K] int64, contiguous."""
    rows, vocab = values.shape
    key_bits, block_v, num_warps = topk_tiles(values.dtype)
    args = dict(values_ptr=values, ids_ptr=ids, keys_ptr=keys, vocab=vocab, top_k=top_k,
                stride_values_row=values.stride(0), stride_out_row=ids.stride(0))
    return KernelLaunch(draft_head_topk_kernel, rows, args, dict(KEY_BITS=key_bits, BLOCK_V=block_v), num_warps)


def row_topk_triton(values: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids [R, K] int64 of each row's top_k values of values [R, V] (float16, bfloat16,
    float32 or float64, unit last stride; CUDA, or CPU under TRITON_INTERPRET=1): value
    descending, NaN first, ties (-0 = +0 included) to the lower id. Raises TypeError /
    ValueError naming the argument before any launch."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}.")
    if values.dtype not in VALUE_DTYPES:
        raise TypeError(f"values must be float16, bfloat16, float32 or float64, got {values.dtype}.")
    if values.dim() != 2:
        raise ValueError(f"values must be [rows, vocab], got shape {tuple(values.shape)}.")
    rows, vocab = values.shape
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in [0, {vocab}], got {top_k!r}.")
    if vocab > 1 and values.stride(1) != 1:
        raise ValueError(f"values must have a unit last stride, got strides {values.stride()}.")
    if values.device.type != "cuda" and not (values.device.type == "cpu" and KERNELS_INTERPRETED):
        raise ValueError(f"values must be a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), got one on "
                         f"{values.device}.")
    if rows > _MAX_PROGRAMS:
        raise ValueError(f"values has {rows} rows, more than the grid limit {_MAX_PROGRAMS} (one program a row).")
    ids = torch.empty((rows, top_k), dtype=torch.long, device=values.device)
    if rows == 0 or top_k == 0:
        return ids
    keys = torch.empty_like(ids)
    plan_row_topk(values, top_k, ids, keys).run(values)
    # The picked come in id order: a stable sort by key keeps equal keys in it.
    return ids.gather(1, torch.sort(keys, dim=1, descending=True, stable=True).indices)
