"""Launchers of the conv's Triton kernels: tile choice, buffers, grids.

Inputs arrive flattened and validated by ``ops.py``: x ``[N, H]``, delta ``[N, K, G]``,
base ``[K, H]``, each with a unit last stride and any row stride. A forward is one
launch (the kernels round the base to x's dtype as they load it); a backward is two (the
gradients, then the deterministic sum of the dbase partials in base's dtype), more only
where a group spans several channel tiles or the sums run in fp64 for 16-bit results.
Tiles come from each kernel's configuration space (tuning/spaces.py), the tuner's choice per
shape class; what depends on the shape alone is computed once per shape:
an eager call's Python time is the cost at serving sizes, where a kernel takes microseconds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from .._launch_math import cdiv, next_power_of_2
from ..tuning import TUNER, Config, rows_class
from ..tuning.spaces import CONV_BACKWARD, CONV_DBASE, CONV_FORWARD
from .kernels import grouped_dynamic_conv_bwd_kernel, grouped_dynamic_conv_dbase_kernel, grouped_dynamic_conv_fwd_kernel

# Under TRITON_INTERPRET=1, triton.jit hands back an interpreter object instead of a
# compiled kernel; which one we got is what decides whether CPU tensors can run here.
KERNELS_INTERPRETED = type(grouped_dynamic_conv_fwd_kernel).__name__ == "InterpretedFunction"

_MAX_PROGRAMS = 2**31 - 1
_MAX_BLOCK_J = 128
_MAX_ROW_STEPS = 64

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch, fully decided: what the launchers run and the AOT test compiles."""

    kernel: object
    programs: int
    args: dict
    constexprs: dict
    num_warps: int
    num_stages: int = 3  # Triton's default on CUDA

    def run(self, device_of: torch.Tensor) -> None:
        """Launch on the tensors in ``args``; ``device_of`` is one of them (x)."""
        # Plain tensors (the eager calls) first: the type test costs ~50 ns of their few us.
        if type(device_of) is not torch.Tensor:
            from torch._subclasses.fake_tensor import FakeTensor
            from torch._subclasses.functional_tensor import FunctionalTensor

            # torch.compile tracing a traceable op's body (conv/ops.py): no data to run on,
            # and no device to guard (the compiled graph launches on its own).
            if isinstance(device_of, (FakeTensor, FunctionalTensor)):
                self._launch(traced=True)
                return
        # Triton launches on the current CUDA device; a guard (~5 us) only where the
        # tensors live on another one.
        if device_of.is_cuda and device_of.device.index != torch.cuda.current_device():
            with torch.cuda.device(device_of.device):
                self._launch()
        else:
            self._launch()

    def _launch(self, traced: bool = False) -> None:
        """traced: record the launch in the graph being traced, through ``wrap_triton``
        (a ``triton_kernel_wrapper_*`` node that the compiled graph runs), instead of
        launching the kernel. The interpreter's kernels (TRITON_INTERPRET=1) cannot be
        wrapped; conv/ops.py keeps traced calls from reaching them."""
        kernel = self.kernel
        if traced and not KERNELS_INTERPRETED:
            kernel = torch.library.wrap_triton(kernel)
        kernel[(self.programs,)](**self.args, **self.constexprs, num_warps=self.num_warps,
                                 num_stages=self.num_stages)


@dataclass(frozen=True)
class ConvTiles:
    """Compile-time tile shape of one launch (shared by forward and backward)."""

    block_n: int
    block_g: int
    block_j: int
    j_tiles: int
    num_warps: int
    num_stages: int

    def col_tiles(self, num_groups: int) -> int:
        return cdiv(num_groups, self.block_g) * self.j_tiles


@functools.lru_cache(maxsize=None)
def conv_tiles(num_groups: int, group_size: int, config: Config) -> ConvTiles:
    """Tile shape for a hidden size of ``num_groups * group_size`` channels under one
    configuration of the forward's or backward's space (tuning/spaces.py): about
    ``tile_channels`` channels wide (contiguous when the group size is a power of two)
    and ``tile_elements`` elements in all, at most 64 rows.
    """
    block_j = min(next_power_of_2(group_size), _MAX_BLOCK_J)
    block_g = max(1, min(next_power_of_2(num_groups), config.params["tile_channels"] // block_j))
    block_n = max(1, min(64, config.params["tile_elements"] // (block_g * block_j)))
    return ConvTiles(block_n, block_g, block_j, cdiv(group_size, block_j), config.num_warps, config.num_stages)


def accumulator_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_grid(programs: int) -> None:
    if programs > _MAX_PROGRAMS:
        raise ValueError(
            f"grouped_dynamic_conv: {programs} programs exceed the grid limit {_MAX_PROGRAMS}."
        )


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) * 8
    # The interpreter: few programs, so small test shapes still take several row steps.
    return 4


@functools.lru_cache(maxsize=None)  # a property query costs ~10 us a call
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_conv_forward(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, out: torch.Tensor, block_size: int,
    config: Config | None = None,
) -> KernelLaunch:
    """The forward launch writing out [N, H] from x [N, H], delta [N, K, G], base [K, H]
    (any float dtype: the kernel rounds it to x's, as speculators does before use), in
    ``config`` of CONV_FORWARD (None: the tuner's choice for this shape class)."""
    n_rows, hidden_size = x.shape
    kernel_size, num_groups = delta.shape[1], delta.shape[2]
    group_size = hidden_size // num_groups
    if config is None:
        key = (num_groups, group_size, kernel_size, x.dtype, delta.dtype, base.dtype, rows_class(n_rows))
        config = TUNER.choose(CONV_FORWARD, key, x,
                              lambda trial: plan_conv_forward(x, delta, base, out, block_size, trial))
    tiles = conv_tiles(num_groups, group_size, config)
    n_col_tiles = tiles.col_tiles(num_groups)
    programs = cdiv(n_rows, tiles.block_n) * n_col_tiles
    _check_grid(programs)
    args = dict(
        x_ptr=x, delta_ptr=delta, base_ptr=base, out_ptr=out,
        n_rows=n_rows, num_groups=num_groups, block_size=block_size, n_col_tiles=n_col_tiles,
        stride_x_row=x.stride(0), stride_delta_row=delta.stride(0), stride_delta_tap=delta.stride(1),
        stride_base_tap=base.stride(0), stride_out_row=out.stride(0),
    )
    constexprs = dict(
        KERNEL_SIZE=kernel_size,
        GROUP_SIZE=group_size,
        # base counts as x's dtype: it is rounded to it first
        ACC_DTYPE=_TL_DTYPES[accumulator_dtype(x, delta)],
        ROUND_BASE=base.dtype != x.dtype,
        BLOCK_N=tiles.block_n,
        BLOCK_G=tiles.block_g,
        BLOCK_J=tiles.block_j,
    )
    return KernelLaunch(grouped_dynamic_conv_fwd_kernel, programs, args, constexprs, tiles.num_warps,
                        tiles.num_stages)


def plan_conv_backward(
    dy: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, acc_dtype: torch.dtype,
    config: Config | None = None,
) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward launch and the buffers it writes: (launch, dx, ddelta splits, dbase partials).
    base [K, H] in any float dtype (rounded to x's in the kernel); ``config`` of
    CONV_BACKWARD (None: the tuner's choice for this shape class).

    ddelta is [J_TILES, N, K, G]: delta's dtype when a group fits one channel tile,
    otherwise partials per tile in acc_dtype. dbase partials are [chunks, K, H] in fp64.
    dx and ddelta come back in acc_dtype instead of a 16-bit input dtype when acc_dtype
    is fp64: Triton has no single rounding from fp64 to fp16/bf16 (the interpreter
    gives NaN), so the launcher rounds them once in PyTorch.
    """
    n_rows, hidden_size = x.shape
    kernel_size, num_groups = delta.shape[1], delta.shape[2]
    group_size = hidden_size // num_groups
    if config is None:
        key = (num_groups, group_size, kernel_size, dy.dtype, x.dtype, delta.dtype, base.dtype, rows_class(n_rows))
        config = TUNER.choose(CONV_BACKWARD, key, x,
                              lambda trial: plan_conv_backward(dy, x, delta, base, block_size, acc_dtype, trial)[0])
    tiles = conv_tiles(num_groups, group_size, config)
    n_col_tiles = tiles.col_tiles(num_groups)
    row_tiles = cdiv(n_rows, tiles.block_n)
    row_steps = min(_MAX_ROW_STEPS, max(1, cdiv(row_tiles * n_col_tiles, _target_programs(x.device))))
    n_chunks = cdiv(row_tiles, row_steps)
    programs = n_chunks * n_col_tiles
    _check_grid(programs)

    dx = torch.empty((n_rows, hidden_size), dtype=_stored_dtype(x.dtype, acc_dtype), device=x.device)
    ddelta_dtype = _stored_dtype(delta.dtype, acc_dtype) if tiles.j_tiles == 1 else acc_dtype
    ddelta = torch.empty((tiles.j_tiles, n_rows, kernel_size, num_groups), dtype=ddelta_dtype, device=x.device)
    dbase_partial = torch.empty((n_chunks, kernel_size, hidden_size), dtype=torch.float64, device=x.device)
    args = dict(
        dy_ptr=dy, x_ptr=x, delta_ptr=delta, base_ptr=base,
        dx_ptr=dx, ddelta_ptr=ddelta, dbase_partial_ptr=dbase_partial,
        n_rows=n_rows, hidden_size=hidden_size, num_groups=num_groups, block_size=block_size,
        n_col_tiles=n_col_tiles, row_steps=row_steps,
        stride_dy_row=dy.stride(0), stride_x_row=x.stride(0), stride_delta_row=delta.stride(0),
        stride_delta_tap=delta.stride(1), stride_base_tap=base.stride(0),
    )
    constexprs = dict(
        KERNEL_SIZE=kernel_size,
        KERNEL_SIZE_POW2=next_power_of_2(kernel_size),
        GROUP_SIZE=group_size,
        ACC_DTYPE=_TL_DTYPES[acc_dtype],
        ROUND_BASE=base.dtype != x.dtype,
        BLOCK_N=tiles.block_n,
        BLOCK_G=tiles.block_g,
        BLOCK_J=tiles.block_j,
    )
    launch = KernelLaunch(grouped_dynamic_conv_bwd_kernel, programs, args, constexprs, tiles.num_warps,
                          tiles.num_stages)
    return launch, dx, ddelta, dbase_partial


def plan_conv_dbase(dbase_partial: torch.Tensor, dbase: torch.Tensor, config: Config | None = None) -> KernelLaunch:
    """The launch summing dbase_partial [chunks, K, H] fp64 into dbase [K, H] (contiguous),
    in ``config`` of CONV_DBASE (None: the tuner's choice)."""
    numel = dbase.numel()
    if config is None:
        key = (numel, dbase_partial.shape[0], dbase.dtype)
        config = TUNER.choose(CONV_DBASE, key, dbase, lambda trial: plan_conv_dbase(dbase_partial, dbase, trial))
    block = config.params["block"]
    args = dict(partial_ptr=dbase_partial, dbase_ptr=dbase, n_chunks=dbase_partial.shape[0], numel=numel)
    return KernelLaunch(grouped_dynamic_conv_dbase_kernel, cdiv(numel, block), args, dict(BLOCK=block),
                        config.num_warps, config.num_stages)


def _stored_dtype(result_dtype: torch.dtype, acc_dtype: torch.dtype) -> torch.dtype:
    """What a kernel stores a result of result_dtype as: fp64 rather than a 16-bit float
    when it accumulates in fp64 (see plan_conv_backward)."""
    if acc_dtype == torch.float64 and result_dtype.itemsize == 2:
        return torch.float64
    return result_dtype


def conv_forward_triton(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """out: [N, H] out_dtype from x [N, H], delta [N, K, G], base [K, H]."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    plan_conv_forward(x, delta, base, out, block_size).run(x)
    return out


def conv_backward_triton(
    dy: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [N, H] x.dtype, ddelta [N, K, G] delta.dtype, dbase [K, H] base.dtype)."""
    if x.numel() == 0:
        return (
            torch.zeros(x.shape, dtype=x.dtype, device=x.device),
            torch.zeros(delta.shape, dtype=delta.dtype, device=x.device),
            torch.zeros(base.shape, dtype=base.dtype, device=x.device),
        )
    acc_dtype = accumulator_dtype(dy, x, delta, base)
    launch, dx, ddelta, dbase_partial = plan_conv_backward(dy, x, delta, base, block_size, acc_dtype)
    launch.run(x)
    dbase = torch.empty(base.shape, dtype=base.dtype, device=x.device)
    plan_conv_dbase(dbase_partial, dbase).run(x)
    ddelta = ddelta[0] if ddelta.shape[0] == 1 else ddelta.sum(0)
    # no-ops (no launch) but for fp64 sums of 16-bit results and groups wider than a tile
    return dx.to(x.dtype), ddelta.to(delta.dtype), dbase
