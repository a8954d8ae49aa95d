"""The conv in vectorized PyTorch: the CPU path and the fallback on any device.

Same inputs as the Triton launchers (x ``[N, H]``, delta ``[N, K, G]``, base ``[K, H]``).
Rows are viewed as whole draft blocks ``[blocks, L, G, gs]`` (plus one short tail
block when L does not divide N), so a tap is a slice along the block axis: no
shifted copies and no masks. Everything accumulates in fp32 (fp64 for fp64 inputs)
and rounds once at the end, except dbase's sum over chunks, which runs in fp64 (see
conv_backward_vectorized).

On the CPU the blocks are taken a cache-sized chunk at a time: each elementwise op
then works on data still in cache, so DRAM sees each operand about once instead of
once per op. Elsewhere (a GPU without Triton) one chunk covers everything, since
each op is a kernel launch there.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

_CPU_CHUNK_BYTES = 4 << 20


def _chunks(x: torch.Tensor, block_size: int) -> Iterator[tuple[slice, int, int]]:
    """(row slice, blocks, block length) covering x's rows with whole draft blocks."""
    n_rows, hidden_size = x.shape
    full = n_rows // block_size
    if x.device.type == "cpu":
        per_chunk = max(1, _CPU_CHUNK_BYTES // max(1, 4 * hidden_size * block_size))
    else:
        per_chunk = max(1, full)
    for first in range(0, full, per_chunk):
        blocks = min(per_chunk, full - first)
        yield slice(first * block_size, (first + blocks) * block_size), blocks, block_size
    tail = n_rows - full * block_size
    if tail:
        yield slice(full * block_size, n_rows), 1, tail


def _accumulator(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _staging(result: torch.Tensor, acc: torch.dtype, rows_per_chunk: int):
    """Where a chunk of ``result`` is computed: the result itself when it is already in
    the accumulator dtype, otherwise one scratch buffer reused by every chunk (fresh
    pages cost a fault each, more than the arithmetic on them)."""
    if result.dtype == acc:
        return lambda rows: result[rows]
    scratch = torch.empty((rows_per_chunk, *result.shape[1:]), dtype=acc, device=result.device)
    return lambda rows: scratch[: rows.stop - rows.start]


def conv_forward_vectorized(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """out: [N, H] out_dtype. Computes in fp32 (fp64 when any input is fp64)."""
    n_rows, hidden_size = x.shape
    kernel_size, num_groups = delta.shape[1], delta.shape[2]
    group_size = hidden_size // num_groups
    acc = _accumulator(x, delta, base)
    taps = base.to(x.dtype).to(acc).view(kernel_size, num_groups, group_size)
    out = torch.empty((n_rows, hidden_size), dtype=out_dtype, device=x.device)
    chunks = list(_chunks(x, block_size))
    out_stage = _staging(out, acc, max(r.stop - r.start for r, _, _ in chunks))

    for rows, blocks, length in chunks:
        xb = x[rows].to(acc).reshape(blocks, length, num_groups, group_size)
        db = delta[rows].to(acc).reshape(blocks, length, kernel_size, num_groups, 1)
        staged = out_stage(rows)
        ob = staged.view(blocks, length, num_groups, group_size)
        torch.mul(xb, taps[0], out=ob)
        ob.addcmul_(xb, db[:, :, 0])
        for tap in range(1, min(kernel_size, length)):
            target = ob[:, tap:]
            source = xb[:, : length - tap]
            target.addcmul_(source, taps[tap])
            target.addcmul_(source, db[:, tap:, tap])
        if staged.data_ptr() != out[rows].data_ptr():
            out[rows] = staged
    return out


def conv_backward_vectorized(
    dy: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [N, H] x.dtype, ddelta [N, K, G] delta.dtype, dbase [K, H] base.dtype)."""
    n_rows, hidden_size = x.shape
    kernel_size, num_groups = delta.shape[1], delta.shape[2]
    group_size = hidden_size // num_groups
    acc = _accumulator(dy, x, delta, base)
    taps = base.to(x.dtype).to(acc).view(kernel_size, num_groups, group_size)
    dx = torch.empty((n_rows, hidden_size), dtype=x.dtype, device=x.device)
    ddelta = torch.empty((n_rows, kernel_size, num_groups), dtype=delta.dtype, device=x.device)
    # Each chunk's dbase term is one fp32 sum (pairwise inside torch). A running fp32 sum
    # over the CPU's chunks would lose accuracy as N grows (a wide H means a few hundred
    # rows a chunk, so hundreds of chunks at training sizes); an fp64 one does not.
    # Elsewhere one chunk covers every row, and fp64 may not exist there (MPS).
    dbase_dtype = torch.float64 if x.device.type == "cpu" else acc
    dbase = torch.zeros((kernel_size, num_groups, group_size), dtype=dbase_dtype, device=x.device)
    chunks = list(_chunks(x, block_size))
    chunk_rows = max(r.stop - r.start for r, _, _ in chunks)
    dx_stage = _staging(dx, acc, chunk_rows)
    ddelta_stage = _staging(ddelta, acc, chunk_rows)
    product_buffer = torch.empty((chunk_rows, hidden_size), dtype=acc, device=x.device)

    for rows, blocks, length in chunks:
        xb = x[rows].to(acc).reshape(blocks, length, num_groups, group_size)
        gb = dy[rows].to(acc).reshape(blocks, length, num_groups, group_size)
        db = delta[rows].to(acc).reshape(blocks, length, kernel_size, num_groups, 1)
        dx_staged, ddelta_staged = dx_stage(rows), ddelta_stage(rows)
        dxb = dx_staged.view(blocks, length, num_groups, group_size)
        ddb = ddelta_staged.view(blocks, length, kernel_size, num_groups)
        torch.mul(gb, taps[0], out=dxb)
        dxb.addcmul_(gb, db[:, :, 0])
        for tap in range(1, kernel_size):
            ddb[:, : min(tap, length), tap] = 0  # rows whose tap reaches before the block
        for tap in range(min(kernel_size, length)):
            # Output row t (t >= tap) reads input row t - tap of the same block.
            dy_out = gb[:, tap:]
            x_in = xb[:, : length - tap]
            if tap:
                dx_in = dxb[:, : length - tap]
                dx_in.addcmul_(dy_out, taps[tap])
                dx_in.addcmul_(dy_out, db[:, tap:, tap])
            product = product_buffer[: blocks * (length - tap)].view(blocks, length - tap, num_groups, group_size)
            torch.mul(dy_out, x_in, out=product)
            torch.sum(product, dim=-1, out=ddb[:, tap:, tap])
            dbase[tap] += product.sum(dim=(0, 1))
        if dx_staged.data_ptr() != dx[rows].data_ptr():
            dx[rows] = dx_staged
        if ddelta_staged.data_ptr() != ddelta[rows].data_ptr():
            ddelta[rows] = ddelta_staged
    return dx, ddelta, dbase.view(kernel_size, hidden_size).to(base.dtype)
