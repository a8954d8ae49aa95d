"""Every Triton kernel's configuration space: the one place listing them.

The first member of each is the configuration the launchers used before tuning (chosen
from CPU-side compiles, tests/test_triton_aot.py): the default. The others trade tile
size against the grid's fill and registers (the conv), or warps and pipeline stages at
the same tile (the head: its segment width is the layout of the partial buffers the
drivers allocate, so it is not a launch-time choice). Members stay few: each is compiled
for six architectures in CI and timed on a user's GPU at its first use.
"""

from __future__ import annotations

from .space import Config, Space


def _warps(*pairs) -> tuple:
    """Configs named w{warps}[-s{stages}] from (warps, stages) pairs."""
    return tuple(Config(f"w{w}" + (f"-s{s}" if s != 3 else ""), w, s) for w, s in pairs)


def _conv(elements: int, channels: int, warps: int, stages: int = 3) -> Config:
    return Config(f"e{elements}-c{channels}-w{warps}" + (f"-s{stages}" if stages != 3 else ""), warps, stages,
                  {"tile_elements": elements, "tile_channels": channels})


CONV_FORWARD = Space("conv_forward", (
    _conv(4096, 256, 4), _conv(2048, 256, 4), _conv(8192, 256, 8), _conv(4096, 128, 4), _conv(4096, 256, 8)))
# The backward loops over row_steps row tiles a program: stages pipeline those loads.
CONV_BACKWARD = Space("conv_backward", (
    _conv(2048, 256, 8), _conv(1024, 256, 4), _conv(2048, 128, 8), _conv(2048, 256, 8, 2), _conv(4096, 256, 8)))
CONV_DBASE = Space("conv_dbase", (
    Config("b1024-w4", 4, 3, {"block": 1024}), Config("b512-w4", 4, 3, {"block": 512}),
    Config("b2048-w8", 8, 3, {"block": 2048}), Config("b1024-w4-s2", 4, 2, {"block": 1024})))

HEAD_SCAN = Space("head_scan", _warps((8, 3), (4, 3), (16, 3)))
HEAD_MERGE = Space("head_merge", _warps((4, 3), (8, 3), (2, 3)))
# With the segments' candidates to merge (top-k up to MAX_CANDIDATE_K): more live values.
HEAD_MERGE_CANDIDATES = Space("head_merge_candidates", _warps((8, 3), (4, 3), (16, 3)))
HEAD_SWEEP = Space("head_sweep", _warps((8, 3), (4, 3), (16, 3)))
HEAD_SPARSE_ADD = Space("head_sparse_add", _warps((1, 3), (2, 3)), mutates=("plane_ptr",))
HEAD_FINISH = Space("head_finish", _warps((1, 3), (2, 3), (4, 3)))
# Loops over K_BLOCK rows of W: stages pipeline the row loads.
HEAD_HIDDEN_GRAD = Space("head_hidden_grad", _warps((4, 3), (4, 2), (8, 3), (4, 4)), mutates=("out_ptr",))
HEAD_RADIX_TOPK = Space("head_radix_topk", (
    Config("v2048-w8", 8, 3, {"block_v": 2048}), Config("v1024-w4", 4, 3, {"block_v": 1024}),
    Config("v4096-w8", 8, 3, {"block_v": 4096}), Config("v2048-w8-s2", 8, 2, {"block_v": 2048})))
HEAD_SHARD_PACK = Space("head_shard_pack", _warps((8, 3), (4, 3)))
HEAD_SHARD_MERGE = Space("head_shard_merge", _warps((4, 3), (8, 3)))
HEAD_SHARD_SHARES = Space("head_shard_shares", _warps((1, 3), (2, 3)))
HEAD_SHARD_FINAL = Space("head_shard_final", _warps((1, 3), (2, 3)))

SPACES = {space.name: space for space in (
    CONV_FORWARD, CONV_BACKWARD, CONV_DBASE, HEAD_SCAN, HEAD_MERGE, HEAD_MERGE_CANDIDATES, HEAD_SWEEP, HEAD_SPARSE_ADD, HEAD_FINISH,
    HEAD_HIDDEN_GRAD, HEAD_RADIX_TOPK, HEAD_SHARD_PACK, HEAD_SHARD_MERGE, HEAD_SHARD_SHARES, HEAD_SHARD_FINAL)}
