"""The vocab-parallel draft head (SPEC section 7, last paragraph): ``weight`` is one rank's
rows [V_local, H] of the lm_head, at vocabulary offset ``vocab_start`` of a process group
(a DTensor ``Shard(0)``, or a plain shard with explicit ``vocab_start=`` / ``group=``), and
every rank returns what one process's :func:`dflash2_kernels.draft_head` returns.

Each rank walks the rows in chunks (the tile budget of api.tile_rows_for, over the largest
shard) and, per chunk, computes its own logits tile s = h W_local^T [R, V_local] (and the
target's) in the compute dtype (gemm.py), z = softcap * tanh(logit_scale * s / softcap).
The ranks then merge per-row statistics, never the [R, V] row:

1. ``all_reduce(MAX)`` of each row's max [2, R] (draft and target side);
2. ``all_reduce(SUM)`` of sum_v exp(z - max) [2, R] -> the global lse per side;
3. ``all_gather`` of each rank's local top-k (values in logits_dtype, global ids, padded
   with -inf / -1 where V_local < k; the draft's k is max(top_k, 1), its first id the
   argmax) and of the target's local argmax: [W, 2, R, k + 1] float64; merged with ties
   to the lower global id (NaN first), as the single-process head ranks;
4. ``all_reduce(SUM)`` of the rank's share of the soft losses (computed with the global
   lse), of sum_v min(p_v, q_v) (tv = 1 - it, overlap = it) and of the logits at the
   merged top-k ids and at the label (only the rank owning an id contributes, the others
   add an exact 0): [R, L + 2 + 2K].

Every collective moves O(R * K) elements (the all_gather W times that); the backward adds
one all_reduce of [R] per chunk (the gradient reaching the lse from the ranks' loss shares)
and one of [N, H] (hidden's gradient), see below.

Gradients (Megatron's convention, autograd Functions here: ``torch.distributed.nn``'s
all_reduce would all-reduce again in its backward, a factor of W): a sum of the ranks'
shares (a partial -> replicated value) is ``all_reduce`` SUM forward, identity backward;
a replicated value used in a rank-local computation (``hidden`` in the local GEMM, the lse
in the local loss shares) is identity forward, ``all_reduce`` SUM backward. So hidden.grad
is one process's on every rank, and each rank's weight.grad is its own shard's rows of one
process's dW (accumulated over chunks in the compute dtype, rounded once to weight's).
Each chunk runs under ``torch.utils.checkpoint`` (non-reentrant), so the backward holds one
chunk's [R, V_local] tiles at a time: they are recomputed (with the chunk's forward
collectives, on every rank in the same order, as the backward graph is the same on every
rank). Every rank must therefore run the same backward (the same outputs), as with any
tensor-parallel layer.

Future work: the per-tile reduction is a composite of torch ops (several [R, V_local]
planes per chunk: the tile budget counts them); the fused row kernels (C++ / Triton)
compute their own lse over the whole row, so using them here needs a two-pass kernel
taking an external (global) lse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import gemm
from .checks import HEAD_FLOATS, IGNORE_INDEX, SOFT_LOSS_MASK, check_head_args, loss_count, loss_names

__all__ = ["VocabShard", "draft_head", "logits_at_ids", "resolve", "wanted"]

# [R, V_local] float32-sized planes a chunk's composite holds at once (the backward's
# recompute keeps its saved tensors): per side (logits, exp, the int64 ranking keys) and
# per soft loss; the tile budget of api.tile_rows_for is spread over them.
_DRAFT_PLANES, _TARGET_PLANES, _LOSS_PLANES = 6, 4, 3


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


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if tensor.numel():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """[W, *tensor.shape], rank order."""
    world = dist.get_world_size(group)
    out = tensor.new_empty(world * tensor.numel())
    if tensor.numel():
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, tensor.reshape(-1).contiguous(), group=group)
    return out.view((world,) + tuple(tensor.shape))


class _SumAcrossRanks(torch.autograd.Function):
    """The ranks' shares -> their sum, replicated: all_reduce SUM forward, identity backward
    (every rank then uses the sum alike, so its gradient is already the replicated one)."""

    @staticmethod
    def forward(ctx, shares, group):
        return _all_reduce(shares.contiguous().clone(), dist.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _UsedLocally(torch.autograd.Function):
    """A replicated value used in a rank-local computation: identity forward, all_reduce SUM
    backward (each rank's gradient is its share's)."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), dist.ReduceOp.SUM, ctx.group), None


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
        grad = _all_reduce(grad.contiguous().clone(), dist.ReduceOp.SUM, ctx.group)
        return grad.to(ctx.dtype), None, None, None


class _WeightGradSink(torch.autograd.Function):
    """A stand-in for weight (no memory: a zero-stride [V_local, H] in the compute dtype)
    through which the chunks' dW accumulate in the compute dtype; rounded once to weight's."""

    @staticmethod
    def forward(ctx, weight, dtype):
        ctx.dtype = weight.dtype
        return torch.zeros((), dtype=dtype, device=weight.device).expand(weight.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class _LocalLogits(torch.autograd.Function):
    """s = rows @ weight^T [R, V_local] in the compute dtype (gemm.py: no full-size copy of a
    half-precision weight); the gradient of weight goes to ``sink`` (compute dtype)."""

    @staticmethod
    def forward(ctx, rows, weight, sink):
        out = torch.empty((rows.shape[0], weight.shape[0]), dtype=rows.dtype, device=rows.device)
        if out.numel():
            gemm.project(out, rows.to(weight.dtype), weight)
        else:
            out.zero_()
        ctx.save_for_backward(rows, weight)
        return out

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = grad_sink = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch.zeros_like(rows)
            if grad.numel():
                gemm.hidden_grad(grad_rows, grad, weight)
        if ctx.needs_input_grad[2]:
            grad_sink = torch.zeros(weight.shape, dtype=rows.dtype, device=rows.device)
            if grad.numel():
                gemm.accumulate_weight_grad(grad_sink, grad, rows.to(weight.dtype))
        return grad_rows, None, grad_sink


# --- per-chunk pieces -----------------------------------------------------------------------


def _transform(s: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    z = s * logit_scale if logit_scale != 1.0 else s
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


def _where_zero(weight: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    return torch.where(weight == 0, torch.zeros_like(term), weight * term)


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


def _local_candidates(rounded: torch.Tensor, k: int, start: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's best min(k, V_local) entries per row as ([R, k] float64 values, [R, k]
    float64 global ids), padded with -inf / -1."""
    rows, local = rounded.shape
    values = torch.full((rows, k), -math.inf, dtype=torch.float64, device=rounded.device)
    ids = torch.full((rows, k), -1.0, dtype=torch.float64, device=rounded.device)
    taken = min(k, local)
    if taken and rows:
        local_ids = torch.arange(start, start + local, device=rounded.device).expand(rows, local)
        picked = _ranked(rounded, local_ids, taken, vocab)
        values[:, :taken] = rounded.gather(1, picked).double()
        ids[:, :taken] = (picked + start).double()
    return values, ids


def _merge(values: torch.Tensor, ids: torch.Tensor, k: int, vocab: int, dtype: torch.dtype):
    """The ranks' candidates [W, R, k] -> the global top k: ([R, k] int64 ids, values in dtype)."""
    world, rows, width = values.shape
    values = values.permute(1, 0, 2).reshape(rows, world * width).to(dtype)
    ids = ids.permute(1, 0, 2).reshape(rows, world * width).long()
    picked = _ranked(values, ids, k, vocab)
    return ids.gather(1, picked), values.gather(1, picked)


def _owned(values: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """values [R, V_local] at global ids [R, J] owned by this rank, 0 elsewhere (differentiable)."""
    rows, local = values.shape
    if local == 0:
        return values.sum(-1, keepdim=True).expand(rows, ids.shape[1]) * 0
    index = ids - start
    owned = (index >= 0) & (index < local)
    picked = values.gather(1, index.clamp(0, local - 1))
    return torch.where(owned, picked, torch.zeros_like(picked))


@dataclass
class _Config:
    group: object
    start: int
    vocab: int
    loss_mask: int
    top_k: int
    logit_scale: float
    softcap: float
    logits_dtype: torch.dtype
    dtype: torch.dtype  # the compute dtype
    differentiable: bool


def _chunk(cfg: _Config, rows, target_rows, labels, weight, target_weight, sink):
    """One chunk of R rows -> (losses [L, R] f32, topk_ids, topk_logits, label_ids, label_logit,
    draft_lse, target_lse, overlap, draft_argmax, target_argmax, target_at_topk); the
    target-side / label entries are None where absent."""
    group, start, vocab = cfg.group, cfg.start, cfg.vocab
    count = rows.shape[0]
    z = _transform(_LocalLogits.apply(rows, weight, sink), cfg.logit_scale, cfg.softcap)
    local = z.shape[1]
    t = None
    if target_rows is not None:
        with torch.no_grad():
            t = _transform(_LocalLogits.apply(target_rows, target_weight, None), cfg.logit_scale, cfg.softcap)
    sides = [z.detach()] + ([t] if t is not None else [])
    # 1. the row maxima (a constant of the lse: its gradient through the max is 0).
    with torch.no_grad():
        maxima = torch.stack([side.amax(-1) if local else side.new_full((count,), -math.inf) for side in sides])
        _all_reduce(maxima, dist.ReduceOp.MAX, group)
        maxima = torch.where(torch.isfinite(maxima), maxima, torch.zeros_like(maxima))
    # 2. sum-exp at the global max -> the global lse per side.
    sums = [torch.exp(z - maxima[0, :, None]).sum(-1)]
    if t is not None:
        sums.append(torch.exp(t - maxima[1, :, None]).sum(-1))
    totals = _SumAcrossRanks.apply(torch.stack(sums), group)
    lse = maxima + torch.log(totals)
    draft_lse = lse[0]
    target_lse = lse[1].detach() if t is not None else None
    # 3. candidates: the draft's top max(k, 1) (its first the argmax), the target's argmax.
    with torch.no_grad():
        width = max(cfg.top_k, 1)
        rounded = z.detach().to(cfg.logits_dtype)
        values, ids = _local_candidates(rounded, width, start, vocab)
        if t is not None:
            t_values, t_ids = _local_candidates(t.to(cfg.logits_dtype), 1, start, vocab)
            values, ids = torch.cat([values, t_values], 1), torch.cat([ids, t_ids], 1)
        gathered = _all_gather(torch.stack([values, ids]), group)  # [W, 2, R, width (+1)]
        topk_ids, _ = _merge(gathered[:, 0, :, :width], gathered[:, 1, :, :width], width, vocab, cfg.logits_dtype)
        draft_argmax = topk_ids[:, 0].clone()
        topk_ids = topk_ids[:, :cfg.top_k].contiguous()
        target_argmax = None
        if t is not None:
            target_argmax = _merge(gathered[:, 0, :, width:], gathered[:, 1, :, width:], 1, vocab,
                                   cfg.logits_dtype)[0][:, 0].contiguous()
    label_ids = labels if labels is not None else target_argmax
    # 4. the shares of the soft losses, of sum min(p, q), of the logits at the ids.
    soft = [name for name in loss_names(cfg.loss_mask & SOFT_LOSS_MASK) if name != "tv"]
    shares = []
    if t is not None:
        lse_here = _UsedLocally.apply(draft_lse, group) if soft and cfg.differentiable else draft_lse
        log_q = z - lse_here[:, None]
        q = torch.exp(log_q)
        log_p = t - target_lse[:, None]
        p = torch.exp(log_p)
        log_m = torch.logaddexp(log_q, log_p) - math.log(2.0) if "jsd" in soft else None
        for name in soft:
            if name == "kl_div":
                shares.append(_where_zero(p, log_p - log_q).sum(-1))
            elif name == "rkl":
                shares.append(_where_zero(q, log_q - log_p).sum(-1))
            elif name == "jsd":
                shares.append(0.5 * (_where_zero(p, log_p - log_m) + _where_zero(q, log_q - log_m)).sum(-1))
        shares.append(torch.minimum(p, q).sum(-1))
    shares = [share[:, None] for share in shares]
    at = [_owned(z, topk_ids, start)]
    safe = None
    if label_ids is not None:
        safe = torch.where(label_ids == IGNORE_INDEX, 0, label_ids)
        at.append(_owned(z, safe[:, None], start))
    if t is not None:
        at.append(_owned(t, topk_ids, start))
    summed = _SumAcrossRanks.apply(torch.cat(shares + at, 1), group)
    column = 0
    soft_sums = {}
    for name in soft:
        soft_sums[name] = summed[:, column]
        column += 1
    overlap = None
    if t is not None:
        min_sum = summed[:, column]
        column += 1
        soft_sums["tv"] = 1.0 - min_sum
        overlap = min_sum.detach().float()
    k = cfg.top_k
    topk_z = summed[:, column:column + k]
    column += k
    label_z = None
    if label_ids is not None:
        label_z = summed[:, column]
        column += 1
    at_topk = summed[:, column:column + k].detach().float() if t is not None else None
    ignored = None if label_ids is None else label_ids == IGNORE_INDEX
    losses = []
    for name in loss_names(cfg.loss_mask):
        loss = draft_lse - label_z if name == "ce" else soft_sums[name]
        if ignored is not None:
            loss = torch.where(ignored, torch.zeros_like(loss), loss)
        losses.append(loss.float())
    loss_rows = torch.stack(losses) if losses else z.new_zeros((0, count), dtype=torch.float32)
    return (loss_rows, topk_ids, topk_z.to(cfg.logits_dtype), label_ids,
            None if label_z is None else label_z.to(cfg.logits_dtype), draft_lse.detach().float(),
            None if target_lse is None else target_lse.float(), overlap, draft_argmax, target_argmax, at_topk)


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


def _agreed(shard: VocabShard, hidden, target_hidden, labels, loss_mask, top_k, logits_dtype, needs_weight,
            needs_hidden, error) -> tuple[list[int], list[int]]:
    """One all_gather of each rank's offset, size and settings: ([starts], [sizes]) in rank
    order, after checking that the ranks agree and the shards tile [0, V)."""
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
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    table = _all_gather(mine, shard.group).cpu().tolist()
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
    # autocast stays out of them (checkpoint's recompute restores this state too).
    with torch.autocast(hidden.device.type, enabled=False):
        return _vocab_parallel(shard, hidden, target_hidden, labels, loss_mask, top_k, logit_scale, softcap,
                               logits_dtype, tile_mb, sizes, vocab, needs_hidden, needs_weight)


def _vocab_parallel(shard, hidden, target_hidden, labels, loss_mask, top_k, logit_scale, softcap, logits_dtype,
                    tile_mb, sizes, vocab, needs_hidden, needs_weight):
    from .api import DraftHeadOutput, tile_rows_for

    local_weight, local_target = shard.weight, shard.target_weight
    dtype = gemm.compute_dtype(local_weight.dtype)
    lead = hidden.shape[:-1]
    width = hidden.shape[-1]
    has_target = target_hidden is not None
    differentiable = needs_hidden or needs_weight
    cfg = _Config(shard.group, shard.start, vocab, loss_mask, top_k, float(logit_scale),
                  0.0 if softcap is None else float(softcap), logits_dtype, dtype, differentiable)
    soft = loss_count(loss_mask & SOFT_LOSS_MASK)
    planes = _DRAFT_PLANES + (_TARGET_PLANES if has_target else 0) + _LOSS_PLANES * soft
    tile_rows = tile_rows_for(max(1, max(sizes)), planes - 1 - int(has_target), has_target, True, dtype, tile_mb,
                              hidden.device.type)
    rows = _ReplicatedRows.apply(hidden.reshape(-1, width), local_weight.dtype, dtype, shard.group) \
        if needs_hidden else hidden.detach().reshape(-1, width).to(local_weight.dtype).to(dtype)
    target_rows = None
    if has_target:
        target_rows = target_hidden.detach().reshape(-1, width).to((local_target if local_target is not None
                                                                    else local_weight).dtype).to(dtype)
    flat_labels = None if labels is None else labels.reshape(-1)
    sink = _WeightGradSink.apply(local_weight, dtype) if needs_weight else None
    weight_values = local_weight.detach()
    target_values = weight_values if local_target is None else local_target.detach()
    count = rows.shape[0]
    parts = []
    for begin in range(0, max(count, 1), tile_rows):
        end = min(count, begin + tile_rows)
        args = (cfg, rows[begin:end], None if target_rows is None else target_rows[begin:end],
                None if flat_labels is None else flat_labels[begin:end], weight_values,
                target_values if has_target else None, sink)
        if differentiable:
            from torch.utils.checkpoint import checkpoint

            parts.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            parts.append(_chunk(*args))

    def joined(index, dim=0):
        pieces = [part[index] for part in parts]
        if pieces[0] is None:
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    (loss_rows, topk_ids, topk_logits, label_ids, label_logit, draft_lse, target_lse, overlap, draft_argmax,
     target_argmax, at_topk) = (joined(0, 1),) + tuple(joined(i) for i in range(1, 11))

    def shaped(tensor, *tail):
        return None if tensor is None else tensor.reshape(tuple(lead) + tail)

    has_label = label_ids is not None
    label_in_topk = None
    if has_label:
        label_in_topk = shaped((topk_ids == label_ids.unsqueeze(1)).any(1) & (label_ids != IGNORE_INDEX))
    return DraftHeadOutput(
        losses={name: shaped(loss_rows[i]) for i, name in enumerate(loss_names(loss_mask))},
        topk_ids=shaped(topk_ids, top_k),
        topk_logits=shaped(topk_logits, top_k),
        label_ids=shaped(label_ids),
        label_logit=shaped(label_logit),
        label_in_topk=label_in_topk,
        draft_lse=shaped(draft_lse),
        target_lse=shaped(target_lse),
        draft_argmax=shaped(draft_argmax),
        target_argmax=shaped(target_argmax),
        target_logits_at_topk=shaped(at_topk, top_k),
        overlap=shaped(overlap),
    )


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
