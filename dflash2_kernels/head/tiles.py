"""The draft head's chunks of rows: how many rows one holds (the tile budget, SPEC section 7:
"a tile budget bounds the rest": tile_rows_for on the CPU, gpu_tile_rows on the GPU
driver) and the memory the CPU's [R, V] planes live in, shared by the single-process head
and the vocab-parallel one."""

from __future__ import annotations

import os

import torch

from .._extension import EXTENSION_LOADED

__all__ = ["DEFAULT_TILE_MB", "ROW_STATS", "TILE_ENV", "chunk_planes", "gpu_tile_rows", "keeps_hidden_grads",
           "plane_dtype", "tile_rows_for"]

TILE_ENV = "DFLASH2_HEAD_TILE_MB"
# The working set of one chunk of rows of the CPU driver (its logits, the target's and the
# forward's loss gradient planes) in MiB: measured (benchmarks/micro/head_tile.py,
# docs/BENCHMARKS.md "draft head"): the GEMMs need chunks of ~64+ rows to run at speed, and
# 256 MiB gives 64 rows at V = 131,072 with two losses, within 1/8 of the dense head's
# memory. The GPU driver sizes its chunks itself (gpu_tile_rows).
DEFAULT_TILE_MB = {"cpu": 256}


# Columns of the op's fp64 row statistics: lse(z), lse(t) and the row sums the gradients of
# rkl, jsd and tv subtract (head/scan_kernels.py's STAT_*).
ROW_STATS = 5
# The GPU driver's chunk budget where a tenth of the dense head's memory is less (a serving
# call's few hundred rows would otherwise run in chunks of tens of rows).
GPU_MIN_BUDGET_MB = 256
# GEMM row tiles: a chunk of many rows is cut to a multiple of this.
GPU_ROW_QUANTUM = 128


def _budget_mb(tile_mb: float | None) -> float | None:
    """tile_mb, else DFLASH2_HEAD_TILE_MB, else None (the driver's default); checked."""
    if tile_mb is None:
        raw = os.environ.get(TILE_ENV, "").strip()
        try:
            tile_mb = float(raw) if raw else None
        except ValueError:
            raise ValueError(f"{TILE_ENV} must be a number of MiB, got {raw!r}.") from None
    if tile_mb is None:
        return None
    if isinstance(tile_mb, bool) or not isinstance(tile_mb, (int, float)) or not 0 < tile_mb < float("inf"):
        raise ValueError(f"tile_mb (or {TILE_ENV}) must be a positive number of MiB, got {tile_mb!r}.")
    return float(tile_mb)


def plane_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the GPU driver's gradient planes: the weight's when it is 16-bit (the dh
    and dW GEMMs take it as it is, rounded once), else the compute dtype."""
    if weight_dtype.itemsize == 2:
        return weight_dtype
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def gpu_tile_rows(rows: int, vocab: int, losses: int, has_target: bool, planes: bool, weight_dtype: torch.dtype,
                  logits_dtype: torch.dtype, tile_mb: float | None, device: torch.device, width: int = 0,
                  free_memory: bool = True, backward: bool = True) -> int:
    """Rows per chunk of the GPU driver (gpu_driver.py): its planes ([R, V] raw logits per
    side in the compute dtype, the gradient planes in plane_dtype: the forward's per loss, or
    the backward's one unless no ``backward`` can follow) within ``tile_mb`` MiB if given
    (or DFLASH2_HEAD_TILE_MB), else
    within a tenth of what the dense head holds at least (its logits in logits_dtype and
    their fp32 log-softmax, per side: (itemsize + 4) bytes a logit), less what the call
    holds besides its chunk (the kept dL/dh planes [N, L, H] and hidden in W's dtype, from
    ``width``), but at least GPU_MIN_BUDGET_MB, and within a quarter of the device's free
    memory (``free_memory``: not for a vocab-parallel shard, whose ranks must walk the same
    chunks); cut to a multiple of GPU_ROW_QUANTUM rows when longer (cuBLAS's row tiles)."""
    sides = 1 + int(has_target)
    compute = torch.float64 if weight_dtype == torch.float64 else torch.float32
    gradient_planes = losses if planes else int(backward)
    per_row = vocab * (sides * compute.itemsize + gradient_planes * plane_dtype(weight_dtype).itemsize)
    budget_mb = _budget_mb(tile_mb)
    if budget_mb is not None:
        budget = budget_mb * (1 << 20)
    else:
        dense = rows * vocab * sides * (logits_dtype.itemsize + 4)
        held = rows * width * ((losses if planes else 0) * compute.itemsize + sides * weight_dtype.itemsize)
        budget = max(dense // 10 - held, GPU_MIN_BUDGET_MB << 20)
        if device.type == "cuda" and free_memory:
            budget = min(budget, _free_device_bytes(device) // 4)
    chunk = int(budget // max(1, per_row))
    if chunk >= GPU_ROW_QUANTUM:
        chunk -= chunk % GPU_ROW_QUANTUM
    return max(1, min(rows, chunk))


def _free_device_bytes(device: torch.device) -> int:
    """What the device can still give: the driver's free memory and the caching allocator's
    reserved but unused blocks (host-side counters: no synchronisation)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def tile_rows_for(vocab: int, losses: int, has_target: bool, planes: bool, dtype: torch.dtype,
                  tile_mb: float | None = None) -> int:
    """Rows per chunk of the CPU driver so that the chunk's [R, V] planes fit in ``tile_mb``
    MiB (at least one row); ``tile_mb`` defaults to ``DFLASH2_HEAD_TILE_MB`` or DEFAULT_TILE_MB."""
    budget_mb = _budget_mb(tile_mb)
    if budget_mb is None:
        budget_mb = DEFAULT_TILE_MB["cpu"]
    planes_per_row = 1 + int(has_target) + (losses if planes else 0)
    return max(1, int(budget_mb * (1 << 20)) // (planes_per_row * vocab * dtype.itemsize))


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
