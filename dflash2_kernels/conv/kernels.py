"""Triton kernels of the grouped dynamic causal conv (SPEC section 1). Kernels only.

Tiling: a program owns BLOCK_N rows x (BLOCK_G groups x BLOCK_J channels of each
group). Tiling the channel axis by group keeps each group's delta a single broadcast
value and makes the backward's per-group reduction a reduction over the tile's last
axis; it works for any group size (BLOCK_J is the next power of two, capped, and a
group wider than the cap is split over J_TILES tiles whose fp32 partials the launcher
adds). Programs are numbered on one grid axis (row tile major, channel tile minor),
so no grid axis can overflow, and row indices are int64 from the start.

speculators rounds the base kernel to the hidden dtype before use; the kernels do that
rounding as they load it (ROUND_BASE: base's dtype is not x's), bf16 by hand as the
head's kernels store it (the Triton interpreter truncates fp32 -> bf16 casts), so that a
call is one launch with no [K, H] cast before it.
"""

import triton
import triton.language as tl

from ..head.kernel_math import stored_as


@triton.jit
def _base_row(base_ptr, tap, stride_base_tap, channels, col_ok, x_ptr, ROUND_BASE: tl.constexpr,
              ACC_DTYPE: tl.constexpr):
    """Tap ``tap`` of the base kernel at ``channels``, rounded to x's dtype, in ACC_DTYPE."""
    base = tl.load(base_ptr + tap * stride_base_tap + channels, mask=col_ok, other=0.0)
    if ROUND_BASE:
        base = stored_as(base, x_ptr.dtype.element_ty)
    return base.to(ACC_DTYPE)


@triton.jit
def _conv_tile(
    pid,
    n_col_tiles,
    num_groups,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Split a program id into (row tile, j tile, groups [1,G,1], channels [1,G,J], col mask)."""
    J_TILES: tl.constexpr = (GROUP_SIZE + BLOCK_J - 1) // BLOCK_J
    row_tile = pid // n_col_tiles
    col_tile = pid % n_col_tiles
    group_tile = col_tile // J_TILES
    j_tile = col_tile % J_TILES
    groups = group_tile * BLOCK_G + tl.arange(0, BLOCK_G)[None, :, None]
    in_group = j_tile * BLOCK_J + tl.arange(0, BLOCK_J)[None, None, :]
    channels = groups * GROUP_SIZE + in_group
    col_ok = (groups < num_groups) & (in_group < GROUP_SIZE)
    return row_tile, j_tile, groups, channels, col_ok


@triton.jit
def grouped_dynamic_conv_fwd_kernel(
    x_ptr,  # [N, H] rows at stride_x_row, unit channel stride
    delta_ptr,  # [N, K, G] at (stride_delta_row, stride_delta_tap, 1)
    base_ptr,  # [K, H] at (stride_base_tap, 1), any float dtype (ROUND_BASE: rounded to x's)
    out_ptr,  # [N, H] at (stride_out_row, 1), dtype promote(x, delta)
    n_rows,
    num_groups,
    block_size,
    n_col_tiles,
    stride_x_row,
    stride_delta_row,
    stride_delta_tap,
    stride_base_tap,
    stride_out_row,
    KERNEL_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    ROUND_BASE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    row_tile, _, groups, channels, col_ok = _conv_tile(
        tl.program_id(0), n_col_tiles, num_groups, GROUP_SIZE, BLOCK_G, BLOCK_J
    )
    rows = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    in_range = rows < n_rows
    position = rows % block_size

    acc = tl.zeros((BLOCK_N, BLOCK_G, BLOCK_J), dtype=ACC_DTYPE)
    for tap in tl.static_range(KERNEL_SIZE):
        # Row n reads row n - tap only inside its own draft block.
        reads = in_range & (position >= tap)
        x = tl.load(x_ptr + (rows - tap) * stride_x_row + channels, mask=reads & col_ok, other=0.0)
        delta = tl.load(
            delta_ptr + rows * stride_delta_row + tap * stride_delta_tap + groups,
            mask=reads & (groups < num_groups),
            other=0.0,
        )
        base = _base_row(base_ptr, tap, stride_base_tap, channels, col_ok, x_ptr, ROUND_BASE, ACC_DTYPE)
        acc += (base + delta.to(ACC_DTYPE)) * x.to(ACC_DTYPE)

    tl.store(
        out_ptr + rows * stride_out_row + channels,
        acc.to(out_ptr.dtype.element_ty),
        mask=in_range & col_ok,
    )


@triton.jit
def grouped_dynamic_conv_bwd_kernel(
    dy_ptr,  # [N, H] at (stride_dy_row, 1), dtype promote(x, delta)
    x_ptr,  # [N, H] at (stride_x_row, 1)
    delta_ptr,  # [N, K, G] at (stride_delta_row, stride_delta_tap, 1)
    base_ptr,  # [K, H] at (stride_base_tap, 1), any float dtype (ROUND_BASE: rounded to x's)
    dx_ptr,  # [N, H] contiguous, x's dtype
    ddelta_ptr,  # [J_TILES, N, K, G] contiguous: delta's dtype, or fp32 when J_TILES > 1
    dbase_partial_ptr,  # [n_row_chunks, K, H] fp64 contiguous
    n_rows,
    hidden_size,
    num_groups,
    block_size,
    n_col_tiles,
    row_steps,
    stride_dy_row,
    stride_x_row,
    stride_delta_row,
    stride_delta_tap,
    stride_base_tap,
    KERNEL_SIZE: tl.constexpr,
    KERNEL_SIZE_POW2: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    ROUND_BASE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """One pass for all three gradients over a chunk of row_steps x BLOCK_N rows.

    dbase is reduced over the chunk in registers and written as this program's own
    partial (no atomics), so the sum over chunks (grouped_dynamic_conv_dbase_kernel) is
    deterministic. Each row
    step's term is a tree sum of its BLOCK_N rows in ACC_DTYPE; the steps add up in
    fp64: an fp32 running sum loses accuracy with every step (one program taking 16k
    rows misses SPEC section 4 by 2x), and one fp64 add per step costs next to nothing.
    """
    chunk, j_tile, groups, channels, col_ok = _conv_tile(
        tl.program_id(0), n_col_tiles, num_groups, GROUP_SIZE, BLOCK_G, BLOCK_J
    )
    group_ok = groups < num_groups
    taps = tl.arange(0, KERNEL_SIZE_POW2)[:, None, None]
    # 2-D views of the same tile for ddelta, whose last axis is the group.
    groups_2d = tl.reshape(groups, (1, BLOCK_G))
    group_ok_2d = groups_2d < num_groups
    ddelta_split = ddelta_ptr + j_tile.to(tl.int64) * n_rows * KERNEL_SIZE * num_groups

    dbase_acc = tl.zeros((KERNEL_SIZE_POW2, BLOCK_G, BLOCK_J), dtype=tl.float64)
    first_row = chunk.to(tl.int64) * row_steps * BLOCK_N
    for step in range(row_steps):
        rows = first_row + step * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
        rows_2d = tl.reshape(rows, (BLOCK_N, 1))
        in_range = rows < n_rows
        position = rows % block_size
        dy = tl.load(
            dy_ptr + rows * stride_dy_row + channels, mask=in_range & col_ok, other=0.0
        ).to(ACC_DTYPE)

        dx = tl.zeros((BLOCK_N, BLOCK_G, BLOCK_J), dtype=ACC_DTYPE)
        step_dbase = tl.zeros((KERNEL_SIZE_POW2, BLOCK_G, BLOCK_J), dtype=ACC_DTYPE)
        for tap in tl.static_range(KERNEL_SIZE):
            base = _base_row(base_ptr, tap, stride_base_tap, channels, col_ok, x_ptr, ROUND_BASE, ACC_DTYPE)

            # dx[m] gathers output row m + tap, when that row reads back into m's block.
            if tap == 0:
                dy_out = dy
                delta_out = tl.load(
                    delta_ptr + rows * stride_delta_row + groups,
                    mask=in_range & group_ok,
                    other=0.0,
                )
            else:
                out_rows = rows + tap
                feeds = (out_rows < n_rows) & ((out_rows % block_size) >= tap)
                dy_out = tl.load(
                    dy_ptr + out_rows * stride_dy_row + channels, mask=feeds & col_ok, other=0.0
                ).to(ACC_DTYPE)
                delta_out = tl.load(
                    delta_ptr + out_rows * stride_delta_row + tap * stride_delta_tap + groups,
                    mask=feeds & group_ok,
                    other=0.0,
                )
            dx += (base + delta_out.to(ACC_DTYPE)) * dy_out

            # ddelta and dbase of output row n, tap `tap`: dy[n] * x[n - tap] inside the block.
            reads = in_range & (position >= tap)
            x_in = tl.load(
                x_ptr + (rows - tap) * stride_x_row + channels, mask=reads & col_ok, other=0.0
            ).to(ACC_DTYPE)
            product = dy * x_in
            ddelta = tl.sum(product, axis=2)
            tl.store(
                ddelta_split + rows_2d * (KERNEL_SIZE * num_groups) + tap * num_groups + groups_2d,
                ddelta.to(ddelta_ptr.dtype.element_ty),
                mask=(rows_2d < n_rows) & group_ok_2d,
            )
            step_dbase = tl.where(taps == tap, tl.sum(product, axis=0)[None, :, :], step_dbase)
        dbase_acc += step_dbase.to(tl.float64)

        tl.store(
            dx_ptr + rows * hidden_size + channels,
            dx.to(dx_ptr.dtype.element_ty),
            mask=in_range & col_ok,
        )

    tl.store(
        dbase_partial_ptr + chunk.to(tl.int64) * KERNEL_SIZE * hidden_size + taps * hidden_size + channels,
        dbase_acc.to(dbase_partial_ptr.dtype.element_ty),
        mask=(taps < KERNEL_SIZE) & col_ok,
    )


@triton.jit
def grouped_dynamic_conv_dbase_kernel(
    partial_ptr,  # [n_chunks, K * H] fp64 contiguous: the backward's per-chunk dbase
    dbase_ptr,  # [K * H] contiguous, base's dtype
    n_chunks,
    numel,
    BLOCK: tl.constexpr,
):
    """dbase = the chunks' partials summed in chunk order in fp64, rounded once to base's
    dtype: deterministic, and one launch where a PyTorch sum and a cast were two."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = cols < numel
    total = tl.zeros((BLOCK,), dtype=tl.float64)
    for chunk in range(n_chunks):
        total += tl.load(partial_ptr + chunk * numel + cols, mask=in_range, other=0.0)
    tl.store(dbase_ptr + cols, stored_as(total, dbase_ptr.dtype.element_ty), mask=in_range)
