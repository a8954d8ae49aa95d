"""The vocab-parallel draft head (SPEC section 7, last paragraph): ``weight`` is one rank's
rows [V_local, H] of the lm_head, at vocabulary offset ``vocab_start`` of a process group
(a DTensor ``Shard(0)``, or a plain shard with explicit ``vocab_start=`` / ``group=``), and
every rank returns what one process's :func:`dflash2_kernels.draft_head` returns.

This module resolves the shard (its rows, offset and group), checks the arguments (the
same on every rank, and agreed across the ranks with one small exchange through the process
group's store, host to host, so that a bad
argument raises on every rank instead of leaving the others waiting in a collective) and
hands the work to shard.py: each rank reduces its own [R, V_local] tiles with the fused
row kernels, and the ranks merge per-row statistics, never the [R, V] row.

Also :func:`logits_at_ids`: the logits at given global ids under the same sharding.

Gradients follow Megatron's convention: a sum of the ranks' shares (a partial ->
replicated value) is ``all_reduce`` SUM forward, identity backward; a replicated value
used in a rank-local computation (``hidden`` in the local GEMM) is identity forward,
``all_reduce`` SUM backward. So hidden.grad is one process's on every rank, and each
rank's weight.grad is its own shard's rows of one process's dW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import gemm
from .checks import HEAD_FLOATS, check_head_args
from .shard import shard_head
from .shard_common import ShardPlan, all_gather_ranks, all_reduce_sum

__all__ = ["VocabShard", "draft_head", "logits_at_ids", "resolve", "wanted"]

def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - depends on the torch build
        return None
    return DTensor, Replicate, Shard


def _is_dtensor(value) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(value, types[0])


def _shard_dim(weight) -> int | None:
    """The mesh dim on which a DTensor is Shard(0) with every other mesh dim Replicate; else None."""
    _, Replicate, Shard = _dtensor_types()
    sharded = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for i, p in enumerate(weight.placements) if i not in sharded]
    if len(sharded) == 1 and all(isinstance(p, Replicate) for p in others):
        return sharded[0]
    return None


def wanted(weight, vocab_start, group) -> bool:
    """Whether ``draft_head`` runs vocab-parallel: explicit vocab_start / group, or a weight
    DTensor Shard(0) on one mesh dim (Replicate on the others)."""
    if vocab_start is not None or group is not None:
        return True
    return dist.is_available() and _is_dtensor(weight) and _shard_dim(weight) is not None


def _placement_error(name: str, value, why: str):
    from ..distributed import DTensorPlacementError

    return DTensorPlacementError(
        f"draft_head (vocab parallel): {name} is a DTensor with placements {tuple(value.placements)}; {why}: "
        f"pass {name}.full_tensor() (or {name}.redistribute(placements=[Replicate()] * mesh.ndim)), "
        f"or plain tensors (to_local() of replicated DTensors), instead.")


def _replicated(name: str, value):
    """A replicated input (hidden, target_hidden, labels) as a plain tensor: a DTensor must be
    Replicate on every mesh dim (its to_local(), differentiable)."""
    if value is None or not _is_dtensor(value):
        return value
    _, Replicate, _ = _dtensor_types()
    if not all(isinstance(p, Replicate) for p in value.placements):
        raise _placement_error(name, value, "the vocab-parallel head takes it replicated (equal on every rank)")
    return value.to_local()


@dataclass
class VocabShard:
    """One rank's share of a vocab-parallel lm_head (after :func:`resolve`)."""

    weight: torch.Tensor  # [V_local, H], plain
    target_weight: torch.Tensor | None  # [V_local, H], plain, the same rows
    start: int  # this rank's first global id
    group: object  # the ProcessGroup of the vocab shards
    global_vocab: int | None  # the DTensor's V (None for a plain shard: from the gather)


def resolve(weight, target_weight, vocab_start, group) -> VocabShard:
    """The local shard, its offset and group from a weight DTensor Shard(0) or from explicit
    ``vocab_start`` / ``group``. The checks here are the same on every rank (no collective)."""
    if not dist.is_available():
        raise RuntimeError("draft_head: vocab_start / group need torch.distributed, which this build lacks.")
    if _is_dtensor(weight):
        if vocab_start is not None or group is not None:
            raise ValueError("draft_head: vocab_start / group are for a plain local shard of weight; weight is a "
                             "DTensor, whose Shard(0) placement gives the offset and the group: pass neither.")
        dim = _shard_dim(weight)
        if dim is None:
            raise _placement_error("weight", weight, "the vocab-parallel head takes it Shard(0) on one mesh dim "
                                                     "and Replicate() on the others")
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = weight.device_mesh
        _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
        local_target = None
        if target_weight is not None:
            if not _is_dtensor(target_weight) or target_weight.device_mesh != mesh \
                    or tuple(target_weight.placements) != tuple(weight.placements) \
                    or target_weight.shape != weight.shape:
                raise ValueError(f"draft_head: target_weight must be sharded as weight is (a DTensor of shape "
                                 f"{tuple(weight.shape)} on the same mesh with placements "
                                 f"{tuple(weight.placements)}), got "
                                 f"{_describe(target_weight)}.")
            local_target = target_weight.to_local()
        return VocabShard(weight.to_local(), local_target, int(offset[0]), mesh.get_group(dim), int(weight.shape[0]))
    if vocab_start is None:
        raise ValueError("draft_head: group was given without vocab_start (the global id of this rank's first "
                         "weight row).")
    if group is None:
        raise ValueError("draft_head: vocab_start was given without group (the ProcessGroup over which the "
                         "vocabulary is sharded).")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
        raise TypeError(f"vocab_start must be an int, got {type(vocab_start).__name__}.")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}.")
    if _is_dtensor(target_weight):
        raise ValueError("draft_head: target_weight is a DTensor but weight is a plain local shard: pass "
                         "target_weight's local rows (the same vocab_start) as a plain tensor.")
    return VocabShard(weight, target_weight, vocab_start, group, None)


def _describe(value) -> str:
    if _is_dtensor(value):
        return f"a DTensor of shape {tuple(value.shape)} with placements {tuple(value.placements)}"
    if isinstance(value, torch.Tensor):
        return f"a plain tensor of shape {tuple(value.shape)}"
    return type(value).__name__


# --- collectives ----------------------------------------------------------------------------


class _SumAcrossRanks(torch.autograd.Function):
    """The ranks' shares -> their sum, replicated: all_reduce SUM forward, identity backward
    (every rank then uses the sum alike, so its gradient is already the replicated one)."""

    @staticmethod
    def forward(ctx, shares, group):
        return all_reduce_sum(shares.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReplicatedRows(torch.autograd.Function):
    """hidden (replicated) as the local GEMMs take it: rounded to weight's dtype, held in the
    compute dtype; the backward sums the ranks' shares (all_reduce SUM, compute dtype) and
    rounds once to hidden's dtype."""

    @staticmethod
    def forward(ctx, hidden, weight_dtype, dtype, group):
        ctx.group, ctx.dtype = group, hidden.dtype
        return hidden.to(weight_dtype).to(dtype, copy=True)

    @staticmethod
    def backward(ctx, grad):
        grad = all_reduce_sum(grad.contiguous().clone(), ctx.group)
        return grad.to(ctx.dtype), None, None, None


# --- logits at ids ---------------------------------------------------------------------------


def _transform(s: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    z = s * logit_scale if logit_scale != 1.0 else s
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


# --- the public path ------------------------------------------------------------------------

_DTYPE_CODES = {dtype: i for i, dtype in enumerate(HEAD_FLOATS)}


def _code(dtype) -> int:
    return _DTYPE_CODES.get(dtype, -1)


def _local_checks(shard: VocabShard, hidden, target_hidden, labels) -> None:
    """What only this rank can see wrong (its shard): raised on every rank after the gather."""
    for name, tensor in (("weight", shard.weight), ("target_weight", shard.target_weight)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.dtype not in HEAD_FLOATS:
            raise TypeError(f"{name} must be a float tensor (float16, bfloat16, float32, float64), "
                            f"got {tensor.dtype}.")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be this rank's rows [V_local, H], got shape {tuple(tensor.shape)}.")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise TypeError(f"hidden must be a [..., H] torch.Tensor, got {_describe(hidden)}.")
    if hidden.shape[-1] != shard.weight.shape[1]:
        raise ValueError(f"hidden's last dim {hidden.shape[-1]} must equal weight's H = {shard.weight.shape[1]} "
                         f"(this rank's weight rows [V_local, H] = {tuple(shard.weight.shape)}).")
    if shard.target_weight is not None and shard.target_weight.shape != shard.weight.shape:
        raise ValueError(f"target_weight must be sharded as weight is: this rank's rows "
                         f"{tuple(shard.target_weight.shape)} != weight's {tuple(shard.weight.shape)}.")
    if shard.start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {shard.start}.")
    if shard.weight.device != hidden.device:
        raise ValueError(f"draft_head: weight (on {shard.weight.device}) and hidden (on {hidden.device}) must be "
                         f"on one device.")


# Exchanges made so far per process group: every rank makes the same calls, so the n-th
# exchange of a group has the same keys on every rank.
_EXCHANGES: dict = {}


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no default group, or a torch without it
        return None


def _exchange(values: list[int], group, device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``values`` (ints, the same count on every rank), in group rank order.

    Through the default group's store where there is one: host to host, so no device work
    is issued and nothing waits for the GPU's queue (an all_gather of a device tensor read
    back on the host would drain it every call). A rank deletes its key of two exchanges
    ago: by the time it writes exchange n, every rank has written n - 1, so every rank has
    read n - 2. Without a store: an all_gather of the values on ``device``."""
    store = _default_store()
    if store is None:
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        return all_gather_ranks(mine, group).cpu().tolist()
    name = getattr(group, "group_name", None) or "default"
    index = _EXCHANGES.get(name, 0)
    _EXCHANGES[name] = index + 1
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prefix = f"dflash2/draft_head/{name}"
    store.set(f"{prefix}/{index}/{rank}", ",".join(str(int(v)) for v in values))
    table = [[int(v) for v in store.get(f"{prefix}/{index}/{r}").decode().split(",")] for r in range(world)]
    if index >= 2:
        store.delete_key(f"{prefix}/{index - 2}/{rank}")
    return table


def _agreed(shard: VocabShard, hidden, target_hidden, labels, loss_mask, top_k, logits_dtype, needs_weight,
            needs_hidden, error) -> tuple[list[int], list[int]]:
    """One exchange of each rank's offset, size and settings (:func:`_exchange`): ([starts],
    [sizes]) in rank order, after checking that the ranks agree and the shards tile [0, V)."""
    ok = error is None
    weight = shard.weight if isinstance(shard.weight, torch.Tensor) else None
    device = weight.device if weight is not None else torch.device("cpu")
    rows = hidden.numel() // hidden.shape[-1] if ok and hidden.shape[-1] else 0
    fields = {
        "ok": int(ok), "vocab_start": shard.start if ok else 0, "size": weight.shape[0] if ok else 0,
        "H": hidden.shape[-1] if ok else 0, "rows": rows, "top_k": top_k if isinstance(top_k, int) else -1,
        "losses": loss_mask, "target_hidden": int(target_hidden is not None), "labels": int(labels is not None),
        "target_weight": int(shard.target_weight is not None), "weight.requires_grad": int(needs_weight),
        "hidden.requires_grad": int(needs_hidden), "logits_dtype": _code(logits_dtype),
        "weight.dtype": _code(weight.dtype) if weight is not None else -1,
        "vocab": shard.global_vocab if shard.global_vocab is not None else -1,
    }
    table = _exchange(list(fields.values()), shard.group, device)
    if error is not None:
        raise error
    names = list(fields)
    bad = [rank for rank, row in enumerate(table) if not row[0]]
    if bad:
        raise ValueError(f"draft_head (vocab parallel): the arguments of rank(s) {bad} of the group are invalid "
                         f"(they raise the reason); every rank raises.")
    for column, name in enumerate(names):
        if name in ("ok", "vocab_start", "size"):
            continue
        values = [row[column] for row in table]
        if len(set(values)) > 1:
            raise ValueError(f"draft_head (vocab parallel): the ranks disagree on {name} ({values} in rank order); "
                             f"every rank must pass the same replicated arguments.")
    starts = [row[1] for row in table]
    sizes = [row[2] for row in table]
    total = sum(sizes)
    position = 0
    for rank in sorted((r for r in range(len(table)) if sizes[r]), key=lambda r: starts[r]):
        if starts[rank] != position:
            kind = "a gap" if starts[rank] > position else "an overlap"
            raise ValueError(f"draft_head (vocab parallel): the shards (vocab_start, rows) = "
                             f"{list(zip(starts, sizes))} in rank order leave {kind}: rank {rank}'s vocab_start is "
                             f"{starts[rank]}, where the shards before it end at {position}; the ranks' "
                             f"vocab_start must tile [0, V = {total}) without gaps or overlaps.")
        position += sizes[rank]
    for rank in range(len(table)):
        if not 0 <= starts[rank] <= total:
            raise ValueError(f"draft_head (vocab parallel): vocab_start {starts[rank]} of rank {rank} is out of range "
                             f"[0, V = {total}].")
    if total < 1:
        raise ValueError("draft_head (vocab parallel): the shards hold no weight rows (V = 0).")
    return starts, sizes


def draft_head(hidden, weight, *, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
               logits_dtype, tile_mb, vocab_start, group, vocab_size):
    """The vocab-parallel path of :func:`dflash2_kernels.draft_head` (its arguments; softcap
    None = none, logits_dtype None = hidden's)."""
    shard = resolve(weight, target_weight, vocab_start, group)
    hidden = _replicated("hidden", hidden)
    target_hidden = _replicated("target_hidden", target_hidden)
    labels = _replicated("labels", labels)
    if logits_dtype is None and isinstance(hidden, torch.Tensor):
        logits_dtype = hidden.dtype
    grad_on = torch.is_grad_enabled()
    needs_weight = bool(grad_on and isinstance(shard.weight, torch.Tensor) and shard.weight.requires_grad)
    needs_hidden = bool(grad_on and isinstance(hidden, torch.Tensor) and hidden.requires_grad)
    error = None
    try:
        _local_checks(shard, hidden, target_hidden, labels)
    except (TypeError, ValueError, IndexError) as caught:
        error = caught
    starts, sizes = _agreed(shard, hidden, target_hidden, labels, loss_mask, top_k, logits_dtype, needs_weight,
                            needs_hidden, error)
    vocab = sum(sizes)
    if shard.global_vocab is not None and shard.global_vocab != vocab:  # pragma: no cover - DTensor guarantees it
        raise ValueError(f"draft_head: weight's shards hold {vocab} rows, its global shape says {shard.global_vocab}.")
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(f"vocab_size = {vocab_size!r} but the ranks' shards of weight tile [0, {vocab}).")
    # The single-process checks against the global vocabulary (the same on every rank): weight
    # stands in as a zero-stride [V, H] of the local shard's dtype and device.
    local_weight, local_target = shard.weight, shard.target_weight
    stand_in = local_weight.new_zeros(()).expand(vocab, local_weight.shape[1])
    target_stand_in = None if local_target is None else local_target.new_zeros(()).expand(vocab, local_weight.shape[1])
    check_head_args(hidden, stand_in, target_hidden, target_stand_in, labels, loss_mask, top_k, logit_scale,
                    0.0 if softcap is None else softcap, logits_dtype)
    for name, tensor in (("target_hidden", target_hidden), ("target_weight", local_target)):
        if tensor is not None and tensor.requires_grad and grad_on:
            raise ValueError(f"{name} requires grad, but draft_head never differentiates the verifier's side: "
                             f"pass {name}.detach().")
    # The products are the head's own (fp32 accumulation, as the custom op under autocast):
    # autocast stays out of them.
    plan = ShardPlan(shard.group, shard.start, vocab, loss_mask, top_k, float(logit_scale),
                     0.0 if softcap is None else float(softcap), logits_dtype, tile_mb, max(sizes))
    with torch.autocast(hidden.device.type, enabled=False):
        return shard_head(hidden, local_weight, target_hidden, local_target, labels, plan)


def logits_at_ids(hidden, weight, ids, *, vocab_start=None, group=None, logit_scale: float = 1.0,
                  softcap: float | None = None, row_bytes: int = 32 << 20) -> torch.Tensor:
    """The logits z = softcap * tanh(logit_scale * h . W[id] / softcap) at global ``ids``
    [..., J] (int64 in [0, V)) for replicated ``hidden`` [..., H] and a vocab-parallel
    ``weight`` (a DTensor Shard(0), or this rank's rows with ``vocab_start`` / ``group``):
    each rank computes h . W_local[id - vocab_start] for the ids it owns (0 elsewhere), one
    all_reduce SUM of [..., J] merges them (identity backward; hidden's gradient summed
    over the ranks). O(N J H) work in row chunks of about ``row_bytes`` of gathered rows,
    O(N J) communication; [..., J] in the compute dtype, differentiable w.r.t. hidden and
    weight (e.g. the target's logits at a trainer's candidates)."""
    shard = resolve(weight, None, vocab_start, group)
    hidden = _replicated("hidden", hidden)
    ids = _replicated("ids", ids)
    local = shard.weight
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"ids must be int64 [..., J] over hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {_describe(ids)}.")
    if hidden.shape[-1] != local.shape[1]:
        raise ValueError(f"hidden's last dim {hidden.shape[-1]} must equal weight's H = {local.shape[1]}.")
    dtype = gemm.compute_dtype(local.dtype)
    width = hidden.shape[-1]
    needs_hidden = torch.is_grad_enabled() and hidden.requires_grad
    rows = _ReplicatedRows.apply(hidden.reshape(-1, width), local.dtype, dtype, shard.group) if needs_hidden \
        else hidden.detach().reshape(-1, width).to(local.dtype).to(dtype)
    flat_ids = ids.reshape(rows.shape[0], -1)
    picks = flat_ids.shape[1]
    step = max(1, row_bytes // max(1, (picks + 1) * width * torch.finfo(dtype).bits // 8))
    pieces = []
    for begin in range(0, max(rows.shape[0], 1), step):
        index = flat_ids[begin:begin + step] - shard.start
        owned = (index >= 0) & (index < local.shape[0])
        if local.shape[0]:
            picked = local[index.clamp(0, local.shape[0] - 1)].to(dtype)  # [R, J, H], differentiable
            s = torch.bmm(picked, rows[begin:begin + step].unsqueeze(2)).squeeze(2)
        else:
            s = rows[begin:begin + step, :1] * 0 + local.sum() * 0
            s = s.expand(-1, picks)
        z = _transform(s, float(logit_scale), 0.0 if softcap is None else float(softcap))
        pieces.append(torch.where(owned, z, torch.zeros_like(z)))
    shares = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return _SumAcrossRanks.apply(shares, shard.group).reshape(ids.shape)
