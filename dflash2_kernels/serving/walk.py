"""The selection half of the serving path over the C++ ops ``dflash2::candidate_topk``
and ``dflash2::select_path`` (schemas in csrc/registration.cpp; kernels in
csrc/serving_cpu.cpp and csrc/kernels/serving_*.cu).

On CUDA one drafted block is two kernels (a split-row top-k, then per position the
merge, the edge scores and, in the last block of each sequence, the walk) plus one
``torch.rand`` for a sampled walk: no host synchronisation, so it captures in a CUDA
graph. Without the compiled extension, or with DFLASH2_BACKEND=reference, the PyTorch
reference runs instead.
"""

from __future__ import annotations

import torch

from .. import _fake_checks as fake_checks
from .. import reference
from .._backend import selected_backend
from .._extension import EXTENSION_LOADED, has_kernel
from ._checks import SERVING_FLOATS, require_generator, require_one_device, require_tensor, uniforms

__all__ = ["candidate_topk", "edge_scores", "walk"]

MAX_TOP_K = 32


if EXTENSION_LOADED:

    @torch.library.register_fake("dflash2::candidate_topk")
    def _(logits, top_k):
        fake_checks.float_dtype("candidate_topk", "logits", logits.dtype, fake_checks.SERVING_FLOATS)
        shape = (logits.shape[0], top_k)
        return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.long)

    @torch.library.register_fake("dflash2::select_path")
    def _(logits, projected, predecessor_codebook, successor_codebook, anchor_ids, uniforms, top_k, temperature,
          score_dtype):
        op = "select_path"
        tensors = dict(logits=logits, projected=projected, predecessor_codebook=predecessor_codebook,
                       successor_codebook=successor_codebook, anchor_ids=anchor_ids)
        if temperature > 0:
            tensors["uniforms"] = uniforms
        fake_checks.one_device(op, **tensors)
        for name in ("logits", "projected", "predecessor_codebook"):
            fake_checks.float_dtype(op, name, tensors[name].dtype, fake_checks.SERVING_FLOATS)
        fake_checks.float_dtype(op, "score_dtype", score_dtype, fake_checks.SERVING_FLOATS)
        fake_checks.int64_ids(op, anchor_ids=anchor_ids)
        batch, draft = logits.shape[:2]
        return (
            logits.new_empty((batch, draft), dtype=torch.long),
            logits.new_empty((batch, draft, top_k), dtype=torch.long),
            logits.new_empty((batch, draft, top_k), dtype=torch.float32),
            logits.new_empty((batch, draft, top_k, top_k), dtype=score_dtype),
        )


def _use_kernel(op_name: str, device: torch.device) -> bool:
    return selected_backend() != "reference" and has_kernel(op_name, device.type)


def _check_top_k(top_k, vocab: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, (int, torch.SymInt)):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}.")
    if not 1 <= top_k <= min(vocab, MAX_TOP_K):
        raise ValueError(f"top_k must be in [1, min(vocab_size={vocab}, {MAX_TOP_K})], got {top_k}.")


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def candidate_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k <= 32 largest logits of each row, sorted descending.

    logits: [..., V] float16, bfloat16 or float32. Returns (values [..., k] in logits'
    dtype, ids [..., k] int64). The values equal ``torch.topk``'s (NaN ranks above
    +inf); tied values may come in either index order.
    """
    require_tensor("logits", logits, floats=SERVING_FLOATS)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}.")
    _check_top_k(top_k, logits.shape[-1])
    if not _use_kernel("candidate_topk", logits.device):
        return reference.candidate_topk(logits, top_k)
    lead = logits.shape[:-1]
    values, ids = torch.ops.dflash2.candidate_topk(_unit_last_stride(logits.reshape(-1, logits.shape[-1])), top_k)
    return values.view(*lead, top_k), ids.view(*lead, top_k)


def _validate_block(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k) -> None:
    require_tensor("logits", logits, dim=3, floats=SERVING_FLOATS)
    require_tensor("projected", projected, dim=3, floats=SERVING_FLOATS)
    require_tensor("predecessor_codebook", predecessor_codebook, dim=2, floats=SERVING_FLOATS)
    require_tensor("successor_codebook", successor_codebook, dim=2, floats=SERVING_FLOATS)
    require_tensor("anchor_ids", anchor_ids, dim=1, integer=True)
    require_one_device(projected=projected, logits=logits, anchor_ids=anchor_ids,
                       predecessor_codebook=predecessor_codebook, successor_codebook=successor_codebook)
    if successor_codebook.shape != predecessor_codebook.shape:
        raise ValueError(f"successor_codebook must have predecessor_codebook's shape "
                         f"{tuple(predecessor_codebook.shape)}, got {tuple(successor_codebook.shape)}.")
    if successor_codebook.dtype != predecessor_codebook.dtype:
        raise TypeError(f"the codebooks must share a dtype, got {predecessor_codebook.dtype} and "
                        f"{successor_codebook.dtype}.")
    vocab, rank = predecessor_codebook.shape
    batch, draft, logits_vocab = logits.shape
    if logits_vocab != vocab or batch < 1 or draft < 1:
        raise ValueError(f"logits must be [B >= 1, D >= 1, vocab_size={vocab}], got {tuple(logits.shape)}.")
    if tuple(projected.shape) != (batch, draft, rank):
        raise ValueError(f"projected must be [B, D, rank] = {(batch, draft, rank)}, got {tuple(projected.shape)}.")
    if anchor_ids.shape[0] != batch:
        raise ValueError(f"anchor_ids must be [B] = [{batch}], got {tuple(anchor_ids.shape)}.")
    _check_top_k(top_k, vocab)


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}.")
    if not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0 selects greedily), got {temperature}.")
    return float(temperature)


def _select_path(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k, temperature,
                 draws):
    """(path, candidate_ids, draft_probs, edges) from the fused op."""
    if projected.dtype != predecessor_codebook.dtype:
        projected = projected.float()  # the kernels read P in the codebook dtype or fp32
    return torch.ops.dflash2.select_path(
        _unit_last_stride(logits),
        projected.contiguous(),
        _unit_last_stride(predecessor_codebook),
        _unit_last_stride(successor_codebook),
        anchor_ids.long().contiguous(),
        draws,
        top_k,
        temperature,
        reference.serving_score_dtype(logits, projected, predecessor_codebook),
    )


def edge_scores(
    projected: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every adjacent pair's score for one drafted block (SPEC section 2).

    projected: [B, D, r] (P = hidden_projection(h)); logits: [B, D, V] float16, bfloat16
    or float32; anchor_ids: [B] int (the last verified token); codebooks: [V, r].
    Returns (edges [B, D, k, k], candidate_ids [B, D, k] int64) with
    ``edges[b, t, i, j] = U[b, t, j] + T(prev_i, cand[b, t, j])``: prev is cand[b, t-1]
    for t > 0 and the anchor for t = 0 (so every row i of edges[b, 0] is the anchor's).
    Edges are in ``promote_types(logits, promote_types(codebooks, projected))``,
    computed in fp32 and rounded once. An anchor id outside [0, V) raises IndexError on
    CPU; on CUDA (no host sync) its sequence's edges come out NaN.
    """
    _validate_block(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k)
    if not _use_kernel("select_path", logits.device):
        edges, candidate_ids = reference.serving_edge_scores(
            projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k)
        return edges.to(reference.serving_score_dtype(logits, projected, predecessor_codebook)), candidate_ids
    no_draws = logits.new_empty(0, dtype=torch.float32)
    _, candidate_ids, _, edges = _select_path(projected, logits, anchor_ids, predecessor_codebook,
                                              successor_codebook, top_k, 0.0, no_draws)
    return edges, candidate_ids


def walk(
    projected: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    top_k: int,
    temperature: float = 0.0,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Trace one coherent path through a drafted block's candidates (NeMo's walk).

    Arguments as :func:`edge_scores`, plus temperature (0 walks greedily) and the
    generator of the sampled walk's uniforms. Returns (path [B, D] int64,
    candidate_ids [B, D, k] int64, draft_probs [B, D, k] float32 or None when greedy).
    Greedy: j_0 = argmax_j E[b, 0, 0, j], then j_t = argmax_j E[b, t, j_{t-1}, j] on
    the rounded scores (first maximum wins, as torch.argmax). Sampled: each step draws
    from q = softmax(E[b, t, j_{t-1}, :].float() / T), and draft_probs holds those q:
    the proposal :func:`rejection_sample` needs to stay lossless. On CUDA a sequence
    whose anchor id is outside [0, V) gets path -1 (CPU raises IndexError).
    """
    _validate_block(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k)
    temperature = _check_temperature(temperature)
    require_generator(generator, logits.device)
    batch, draft = logits.shape[:2]
    draws = (uniforms((batch, draft), logits.device, generator) if temperature > 0
             else logits.new_empty(0, dtype=torch.float32))
    if not _use_kernel("select_path", logits.device):
        return reference.serving_walk(projected, logits, anchor_ids, predecessor_codebook, successor_codebook,
                                      top_k, temperature, draws)
    path, candidate_ids, draft_probs, _ = _select_path(
        projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k, temperature, draws)
    return path, candidate_ids, draft_probs if temperature > 0 else None
