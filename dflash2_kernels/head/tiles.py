"""The draft head's chunks of rows: how many rows one holds (the tile budget, SPEC section 7:
"a tile budget bounds the rest") and the memory its [R, V] planes live in, shared by the
single-process head (api.py, ops.py, grads.py) and the vocab-parallel one (shard.py)."""

from __future__ import annotations

import os

import torch

from .._extension import EXTENSION_LOADED

__all__ = ["DEFAULT_TILE_MB", "TILE_ENV", "chunk_planes", "keeps_hidden_grads", "tile_rows_for"]

TILE_ENV = "DFLASH2_HEAD_TILE_MB"
# The working set of one chunk of rows (its logits, the target's and the forward's loss
# gradient planes) in MiB, by device. CPU: measured (benchmarks/micro/head_tile.py,
# docs/BENCHMARKS.md "draft head"): the GEMMs need chunks of ~64+ rows to run at speed, and
# 256 MiB gives 64 rows at V = 131,072 with two losses, within 1/8 of the dense head's
# memory. CUDA: not measured yet; 1 GiB gives ~256 rows of V = 248,320 with two losses,
# enough rows for cuBLAS's tiles, under a tenth of the dense head's [N, V] tensors at 16k rows.
DEFAULT_TILE_MB = {"cpu": 256, "cuda": 1024}


def tile_rows_for(vocab: int, losses: int, has_target: bool, planes: bool, dtype: torch.dtype,
                  tile_mb: float | None = None, device_type: str = "cpu") -> int:
    """Rows per chunk so that the chunk's [R, V] planes fit in ``tile_mb`` MiB (at least
    one row); ``tile_mb`` defaults to ``DFLASH2_HEAD_TILE_MB`` or the device's DEFAULT_TILE_MB."""
    if tile_mb is None:
        raw = os.environ.get(TILE_ENV, "").strip()
        try:
            tile_mb = float(raw) if raw else DEFAULT_TILE_MB.get(device_type, DEFAULT_TILE_MB["cpu"])
        except ValueError:
            raise ValueError(f"{TILE_ENV} must be a number of MiB, got {raw!r}.") from None
    if isinstance(tile_mb, bool) or not isinstance(tile_mb, (int, float)) or not 0 < tile_mb < float("inf"):
        raise ValueError(f"tile_mb (or {TILE_ENV}) must be a positive number of MiB, got {tile_mb!r}.")
    planes_per_row = 1 + int(has_target) + (losses if planes else 0)
    return max(1, int(tile_mb * (1 << 20)) // (planes_per_row * vocab * dtype.itemsize))


def keeps_hidden_grads(hidden_requires_grad: bool, weight_requires_grad: bool, losses: int, has_target: bool) -> bool:
    """Whether the forward keeps each loss's dL_l/dh ([L, N, H]) for the backward: one GEMM
    per loss in the forward, against one per side plus dS @ W (and the row passes again)
    for a recompute in the backward; kept while that is no dearer, and only where weight
    needs no gradient (dW needs the recompute's dS)."""
    recompute_gemms = 2 + int(has_target)
    return (torch.is_grad_enabled() and hidden_requires_grad and not weight_requires_grad
            and 0 < losses <= recompute_gemms)


def _cached_empty() -> bool:
    # A kernel for every backend (no tensor argument to dispatch on): not a CPU key's.
    return EXTENSION_LOADED and torch._C._dispatch_has_kernel_for_dispatch_key(
        "dflash2::cpu_cached_empty", "CompositeExplicitAutograd")


def chunk_planes(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor for a chunk's planes ([R, V] logits, [L, R, V] gradients). On
    the CPU from the C++ ops' result cache (dflash2::cpu_cached_empty): torch.empty would
    map fresh pages for a block this large on every call, about 30 ms of page faults per
    128 MiB here, a tenth of a serving call."""
    if device.type == "cpu" and _cached_empty():
        return torch.ops.dflash2.cpu_cached_empty(list(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device)
