"""What the vocab-parallel draft head's two drivers (shard_cpu.py, shard_gpu.py) share: the
plan of one call (the same on every rank but its offset), the collectives over the shard
group, and the ranking of the ranks' merged candidates as one process ranks them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ShardPlan", "all_gather_ranks", "all_reduce_sum", "merged_candidates"]


@dataclass(frozen=True)
class ShardPlan:
    """What every chunk of one vocab-parallel call shares (the same on every rank but start)."""

    group: object  # the ProcessGroup of the vocabulary shards
    start: int  # this rank's first global id
    vocab: int  # the global V
    loss_mask: int
    top_k: int
    logit_scale: float
    softcap: float  # 0: none
    logits_dtype: torch.dtype
    tile_mb: float | None
    largest_shard: int  # the ranks' largest V_local: every rank walks the same chunks


def all_gather_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """[W, *tensor.shape], rank order."""
    world = dist.get_world_size(group)
    out = tensor.new_empty(world * tensor.numel())
    if tensor.numel():
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor.reshape(-1).contiguous(), group=group)
    return out.view((world,) + tuple(tensor.shape))


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if tensor.numel():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _ranked(values: torch.Tensor, ids: torch.Tensor, k: int, vocab: int) -> torch.Tensor:
    """Positions [R, k] of each row's k best entries of values [R, C] (ids [R, C] global, -1
    = padding): value descending, NaN first, ties to the lower id, padding last; k <= C."""
    if values.dtype != torch.float64:
        bits = (values.float() + 0.0).view(torch.int32).long()  # + 0.0: -0 ties with +0
        key = torch.where(bits < 0, (~bits) & 0xFFFFFFFF, bits | 0x80000000)  # the float order, unsigned
        key = torch.where(torch.isnan(values), torch.full_like(key, 1 << 32), key)
        id_bits = max(1, (vocab - 1).bit_length())
        key = (key << id_bits) | ((vocab - 1) - ids.clamp(min=0))
        key = torch.where(ids < 0, torch.full_like(key, -1), key)
        return torch.topk(key, k, dim=1).indices
    # float64 values: no 64-bit key with room for the id; three stable sorts (last one primary).
    order = torch.sort(ids, dim=1, stable=True).indices
    by_value = torch.sort(values.gather(1, order), dim=1, descending=True, stable=True).indices
    order = order.gather(1, by_value)
    by_pad = torch.sort((ids.gather(1, order) < 0).to(torch.int8), dim=1, stable=True).indices
    return order.gather(1, by_pad)[:, :k]


def merged_candidates(values: torch.Tensor, ids: torch.Tensor, k: int, vocab: int, logits_dtype: torch.dtype):
    """The ranks' candidates [W, R, C] (unrounded logits, global ids) -> the best k by the
    logits rounded to logits_dtype: (ids [R, k] int64, unrounded logits [R, k] float64)."""
    world, rows, width = values.shape
    values = values.permute(1, 0, 2).reshape(rows, world * width)
    ids = ids.permute(1, 0, 2).reshape(rows, world * width).long()
    picked = _ranked(values.to(logits_dtype), ids, k, vocab)
    return ids.gather(1, picked), values.gather(1, picked)
