"""DTensor sharding rules for the ``dflash2::`` custom ops (registered at import).

No draft module is tensor-parallel in either trainer, so what these rules guarantee is
that a DTensor argument is never silently wrong: each op either runs on the local
shards with a rule that makes the result equal one process's, or raises a ValueError
that says what to pass instead.

Accepted layouts (a 1-D or N-D device mesh; every mesh dimension on its own):

- everything ``Replicate()``: the op runs on every rank, the results are ``Replicate()``;
- rows ``Shard(0)``: the row tensors (the flattened leading dims the public functions
  pass the op: hidden states, projections, logits, ids, labels, ...) ``Shard(0)``, the
  parameters (conv ``base``, selector codebooks, head ``weight``) ``Replicate()``. The
  per-row results are ``Shard(0)`` (the head's per-loss ``[L, N]`` results ``Shard(1)``),
  and a gradient reduced over rows into a replicated parameter (conv ``dbase``,
  selector ``dA`` / ``dB``, head ``dW``) comes out ``Partial()``: its value (after
  ``full_tensor()`` or a reduction) is one process's gradient. A row tensor given
  ``Replicate()`` next to ``Shard(0)`` ones is sliced locally (no communication).
  The conv takes ``Shard(0)`` rows only where every rank's first row starts a draft
  block (its positions ``n mod block_size`` are then the global ones and no tap crosses
  ranks); elsewhere it raises.

The vocab-parallel draft head is not a rule: ``dk.draft_head`` takes a lm_head ``weight``
DTensor ``Shard(0)`` on one mesh dim (Replicate on the others) to its vocab-parallel path
(head/vocab_parallel.py), which unwraps every DTensor (``to_local()``) before any op runs,
so the ``draft_head`` rule below never sees it; the op itself (reached with any other
weight layout) still takes the lm_head whole.

Anything else in a forward op (a sharded parameter, e.g. vocab-parallel ``Shard(0)``
codebooks, an lm_head weight sharded otherwise or reaching the op directly; rows sharded
on another dim; ``Partial()`` inputs) raises
:class:`DTensorPlacementError` (a ValueError, and a NotImplementedError so that
DTensor passes it on unwrapped) naming the argument and what to pass: ``.full_tensor()``, a
``redistribute(placements=[Replicate()])``, or plain local tensors. The backward ops
accept whatever the autograd engine hands them and let DTensor redistribute it to the
forward's layout (a gradient may come back ``Replicate()`` where its output was
``Shard(0)``): the backward never raises for a layout its forward accepted.

The head's row-chunk kernels (``draft_head_rows_cpu`` / ``_backward_cpu``, and the
vocab-parallel shard's ``draft_head_shard_stats_cpu`` / ``draft_head_shard_rows_cpu``) are
internal and in-place: they have no rule (DTensor raises NotImplementedError for them).

The serving functions' reference paths (k > 32, float64, very large vocabularies,
``DFLASH2_BACKEND=reference``) refuse DTensors the same way (:func:`refuse_dtensors`).
The serving functions draw their uniforms as plain tensors; :func:`like_rows` turns such
a tensor into a DTensor laid out as the batch rows of a DTensor argument (rank 0's
draws, scattered), so a sampled walk or a rejection sample on DTensors draws what one
process with rank 0's generator would.
"""

from __future__ import annotations

import math

import torch


__all__ = ["AVAILABLE", "NO_RULE", "RULES", "DTensorPlacementError", "like_rows", "refuse_dtensors"]


class DTensorPlacementError(NotImplementedError, ValueError):
    """A DTensor argument in a layout the op has no rule for. A ValueError for callers; a
    NotImplementedError so that DTensor's dispatcher passes it on unwrapped (it wraps
    every other exception of a sharding rule in a RuntimeError)."""


AVAILABLE = False
try:  # a build without torch.distributed (or without DTensor) has nothing to register
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.experimental import register_sharding

        AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the torch build
    pass

# op name -> the function giving its acceptable (outputs, inputs) placement lists.
RULES: dict = {}
# The ops without a rule (DTensor raises NotImplementedError for them), and why.
NO_RULE = {
    "draft_head_rows_cpu": "internal, in-place row-chunk kernel of draft_head (called on local tensors)",
    "draft_head_rows_backward_cpu": "internal, in-place row-chunk kernel of draft_head's backward",
    "draft_head_shard_stats_cpu": "internal, in-place row-chunk kernel of the vocab-parallel draft_head (local shards)",
    "draft_head_shard_rows_cpu": "internal, in-place row-chunk kernel of the vocab-parallel draft_head (local shards)",
    "cpu_cached_empty": "an allocation (no tensor argument): the draft head's chunk buffers",
}

# The public names of the ops' arguments, for the messages.
_PUBLIC_NAMES = {
    "x": "hidden_states", "delta": "delta_kernel", "base": "base_kernel",
    "unary": "unary_logits / unary", "logits": "logits",
}

_PASS = ("pass {name}.full_tensor() (or {name}.redistribute(placements=[Replicate()] * mesh.ndim)), "
         "or plain tensors (to_local() of replicated DTensors), instead")


def _named(name: str) -> str:
    public = _PUBLIC_NAMES.get(name)
    return name if public is None or public == name else f"{name} ({public})"


def _placements(spec) -> tuple:
    return tuple(spec.placements)


def _is_replicate(spec) -> bool:
    return all(isinstance(p, Replicate) for p in spec.placements)


def _is_rows(spec) -> bool:
    """Every mesh dim Replicate or Shard(0) (a nested Shard(0) over several dims is rows too)."""
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in spec.placements)


def _refuse(op: str, name: str, spec, why: str) -> None:
    raise DTensorPlacementError(
        f"dflash2::{op}: {_named(name)} is a DTensor with placements {_placements(spec)}; {why}: "
        f"{_PASS.format(name=name)}."
    )


def _check_params(op: str, why: str = "", **params) -> None:
    """Parameters (codebooks, base kernel, lm_head weight) must be Replicate."""
    for name, spec in params.items():
        if spec is not None and not _is_replicate(spec):
            _refuse(op, name, spec, "the kernels read this parameter whole (rows by token id, every channel), "
                                    "so it must be Replicate() on every mesh dim" + why)


def _rows_sharded(op: str, **rows) -> bool:
    """Whether any row tensor is Shard(0) (else all are Replicate); raise for other layouts."""
    sharded = False
    for name, spec in rows.items():
        if spec is None:
            continue
        if not _is_rows(spec) or spec.ndim == 0:
            _refuse(op, name, spec, "row tensors must be Replicate() or Shard(0) (rows) on every mesh dim")
        sharded = sharded or not _is_replicate(spec)
    return sharded


def _chunk_starts(size: int, mesh_sizes) -> set[int]:
    """Every index where a shard of ``size`` rows can start when dim 0 is chunked (torch.chunk
    sizes, as DTensor splits) over any subset of the mesh dims, in mesh-dim order."""
    pieces = {(0, size)}
    for ranks in mesh_sizes:
        split = set(pieces)
        for start, length in pieces:
            step = -(-length // ranks) if length else 0
            for rank in range(ranks):
                offset = min(length, rank * step)
                split.add((start + offset, min(step, length - offset)))
        pieces = split
    return {start for start, length in pieces if length}


def _blocks_aligned(x_spec, block_size: int) -> bool:
    """Whether every Shard(0) chunk of x's leading dim starts at a draft-block boundary."""
    shape = tuple(x_spec.shape)
    rows_per_index = math.prod(shape[1:-1])
    return all(start * rows_per_index % block_size == 0
               for start in _chunk_starts(shape[0], tuple(x_spec.mesh.shape)))


# --- rules ----------------------------------------------------------------------------------

R = S0 = S1 = P = None
if AVAILABLE:
    R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _conv_forward_rule(op: str, x, delta, base, block_size) -> list:
    _check_params(op, base=base)
    if not _rows_sharded(op, x=x, delta=delta):
        return [([R], [R, R, R])]
    if x.ndim < 2:
        _refuse(op, "x", x, "a 1-D x is one row of channels: Shard(0) would split the channels")
    if not _blocks_aligned(x, block_size):
        _refuse(op, "x", x, f"its Shard(0) rows do not split at draft-block boundaries (every rank's rows must "
                            f"start at a multiple of block_size={block_size}, else a rank's positions n mod "
                            f"block_size and its tap reads would differ from one process's)")
    return [([S0], [S0, S0, R]), ([R], [R, R, R])]


def _conv_backward_rule(x, block_size) -> list:
    strategies = [([R, R, R], [R, R, R, R])]
    if x.ndim >= 2 and _blocks_aligned(x, block_size):
        strategies.append(([S0, S0, P], [S0, S0, S0, R]))
    return strategies


def _pad(strategies: list, trailing: int) -> list:
    """Append ``trailing`` None input placements (the non-tensor arguments) to each strategy."""
    return [(outputs, inputs + [None] * trailing) for outputs, inputs in strategies]


def _register(op_name: str, rule) -> None:
    """register_sharding(rule) for torch.ops.dflash2.<op_name>.default."""
    register_sharding(getattr(torch.ops.dflash2, op_name).default)(rule)
    RULES[op_name] = rule


def _register_all() -> None:
    ops = set(torch._C._dispatch_get_all_op_names())

    def have(name: str) -> bool:
        return f"dflash2::{name}" in ops

    if have("grouped_dynamic_conv"):
        def conv(x, delta, base, block_size, group_size):
            return _pad(_conv_forward_rule("grouped_dynamic_conv", x, delta, base, block_size), 2)

        def conv_backward(grad_out, x, delta, base, block_size, group_size):
            return _pad(_conv_backward_rule(x, block_size), 2)

        _register("grouped_dynamic_conv", conv)
        _register("grouped_dynamic_conv_backward", conv_backward)

    if have("conv_forward_cpu"):
        def conv_cpu(x, delta, base, block_size, out_dtype):
            return _pad(_conv_forward_rule("conv_forward_cpu", x, delta, base, block_size), 2)

        def conv_cpu_backward(grad_out, x, delta, base, block_size):
            return _pad(_conv_backward_rule(x, block_size), 1)

        _register("conv_forward_cpu", conv_cpu)
        _register("conv_backward_cpu", conv_cpu_backward)

    if have("selector_scores"):
        def selector(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
                     unary_gathered, out_dtype):
            op = "selector_scores"
            _check_params(op, predecessor_codebook=predecessor_codebook, successor_codebook=successor_codebook)
            strategies = [([R], [R, R, R, R, R, R])]
            if _rows_sharded(op, unary=unary, projected=projected, predecessor_ids=predecessor_ids,
                             candidate_ids=candidate_ids):
                strategies.insert(0, ([S0], [S0, S0, R, R, S0, S0]))
            return _pad(strategies, 2)

        def selector_backward(grad_scores, projected, predecessor_codebook, successor_codebook, predecessor_ids,
                              candidate_ids, unary_gathered, unary_width, unary_dtype):
            return _pad([([R, R, R, R], [R, R, R, R, R, R]),
                         ([S0, S0, P, P], [S0, S0, R, R, S0, S0])], 3)

        _register("selector_scores", selector)
        _register("selector_scores_backward", selector_backward)

    if have("candidate_topk"):
        def topk(logits, top_k):
            strategies = [([R, R], [R])]
            if _rows_sharded("candidate_topk", logits=logits):
                if logits.ndim < 2:
                    _refuse("candidate_topk", "logits", logits, "a 1-D logits is one row: Shard(0) would split "
                                                                "the vocabulary")
                strategies.insert(0, ([S0, S0], [S0]))
            return _pad(strategies, 1)

        _register("candidate_topk", topk)

    if have("select_path"):
        def select_path(logits, projected, predecessor_codebook, successor_codebook, anchor_ids, uniforms, top_k,
                        temperature, score_dtype):
            op = "select_path"
            _check_params(op, predecessor_codebook=predecessor_codebook, successor_codebook=successor_codebook)
            # Greedy calls pass an empty uniforms: it has no rows, so it stays Replicate.
            draws = uniforms if uniforms.ndim and uniforms.shape[0] == logits.shape[0] else None
            sharded = _rows_sharded(op, logits=logits, projected=projected, anchor_ids=anchor_ids, uniforms=draws)
            strategies = [([R] * 4, [R] * 6)]
            if sharded:
                strategies.insert(0, ([S0] * 4, [S0, S0, R, R, S0, S0 if draws is not None else R]))
            return _pad(strategies, 3)

        _register("select_path", select_path)

    if have("rejection_sample"):
        def rejection(draft_tokens, target_probs, draft_probs, candidate_ids, uniforms):
            strategies = [([R, R], [R] * 5)]
            if _rows_sharded("rejection_sample", draft_tokens=draft_tokens, target_probs=target_probs,
                             draft_probs=draft_probs, candidate_ids=candidate_ids, uniforms=uniforms):
                strategies.insert(0, ([S0, S0], [S0] * 5))
            return strategies

        _register("rejection_sample", rejection)

    if have("draft_head"):
        def head(hidden, weight, target_hidden, target_weight, labels, loss_mask, top_k, logit_scale, softcap,
                 logits_dtype, hidden_grad_planes, tile_rows):
            op = "draft_head"
            _check_params(op, " (a vocab-parallel lm_head, Shard(0) on one mesh dim and Replicate() on the others, "
                              "goes to dk.draft_head, which runs it vocab-parallel; the op takes it whole)",
                          weight=weight, target_weight=target_weight)
            present = [spec for spec in (hidden, weight, target_hidden, target_weight, labels) if spec is not None]
            planes = hidden_grad_planes and loss_mask > 0
            replicated = ([R] * 15, [R] * len(present))
            if not _rows_sharded(op, hidden=hidden, target_hidden=target_hidden, labels=labels):
                return _pad([replicated], 7)
            inputs = [S0 if spec is hidden or spec is target_hidden or spec is labels else R for spec in present]
            # losses [L, N]: Shard(1); per-row results Shard(0); hidden_grads [N, L, H] Shard(0) (or [0]:
            # Replicate); row_stats [N, 5] Shard(0).
            outputs = [S1] + [S0] * 12 + [S0 if planes else R, S0]
            return _pad([(outputs, inputs), replicated], 7)

        def head_backward(grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                          topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats, loss_mask, top_k,
                          logit_scale, softcap, logits_dtype, need_hidden, need_weight, tile_rows):
            tensors = (grad_losses, grad_topk, grad_label, hidden, weight, target_hidden, target_weight, labels,
                       topk_ids, topk_z, label_ids, label_z, hidden_grads, row_stats)
            present = [spec for spec in tensors if spec is not None]
            replicated = ([R, R], [R] * len(present))
            row_inputs = []
            for index, spec in enumerate(tensors):
                if spec is None:
                    continue
                if spec is weight or spec is target_weight:
                    row_inputs.append(R)
                elif index == 0:
                    row_inputs.append(S1)  # grad_losses [L, N]
                elif index == 12 and spec.ndim != 3:
                    row_inputs.append(R)  # no planes: an empty [0]
                else:
                    row_inputs.append(S0)  # hidden_grads [N, L, H], row_stats [N, 5], the per-row tensors
            rows = ([S0 if need_hidden else R, P if need_weight else R], row_inputs)
            return _pad([rows, replicated], 8)

        _register("draft_head", head)
        _register("draft_head_backward", head_backward)


def like_rows(values: torch.Tensor, rows_of: torch.Tensor) -> torch.Tensor:
    """``values`` (a plain tensor over the batch rows, e.g. a walk's uniforms) as a DTensor
    laid out as ``rows_of``'s dim 0 when ``rows_of`` is a DTensor; unchanged otherwise.

    The values are rank 0's, scattered (or broadcast): every rank then draws what one
    process holding rank 0's generator state draws, whatever the other ranks' states."""
    if not AVAILABLE or not isinstance(rows_of, DTensor) or isinstance(values, DTensor):
        return values
    placements = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in rows_of.placements]
    if values.dim() == 0 or values.shape[0] != rows_of.shape[0]:
        placements = [Replicate()] * rows_of.device_mesh.ndim
    return distribute_tensor(values, rows_of.device_mesh, placements)


def refuse_dtensors(what: str, **tensors) -> None:
    """Raise :class:`DTensorPlacementError` if any of ``tensors`` is a DTensor: for the public
    functions' paths that run the PyTorch reference inside (the serving functions past
    the kernels' limits), whose plain index tensors cannot meet DTensors."""
    if not AVAILABLE:
        return
    named = [name for name, tensor in tensors.items() if isinstance(tensor, DTensor)]
    if named:
        raise DTensorPlacementError(
            f"{what} runs the PyTorch reference, which takes no DTensors (got {', '.join(named)} as DTensors): "
            f"pass plain tensors instead: each rank's to_local() rows (the function is row-wise; "
            f"parameters whole) or full_tensor()."
        )


if AVAILABLE:
    _register_all()
