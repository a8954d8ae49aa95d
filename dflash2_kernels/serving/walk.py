"""The selection half of the serving path over the C++ ops ``dflash2::candidate_topk``
and ``dflash2::select_path`` (schemas in csrc/registration.cpp; kernels in
csrc/serving_cpu.cpp and csrc/kernels/serving_*.cu).

On CUDA one drafted block is two kernels (a split-row top-k, then per position the
merge, the edge scores and, in the last block of each sequence, the walk) plus one
``torch.rand`` for a sampled walk: no host synchronisation, so it captures in a CUDA
graph. The kernels take k <= 32 (one warp lane per candidate) and float16, bfloat16 or
float32; every other k in [1, V], any float64 input, a build without the compiled
extension and DFLASH2_BACKEND=reference run the PyTorch reference
(``dflash2_kernels.reference``) instead, with the same semantics: the same uniforms
drawn the same way, greedy ties as torch.argmax, the same output dtypes and shapes
(its transition sums in float64, rounded once: FALLBACK_TRANSITION_DTYPE).
On CUDA that path is sync-free too (an out-of-range anchor gets the kernels' NaN/-1
rule there); on CPU it raises IndexError for one, as the kernels do.
"""

from __future__ import annotations

import torch

from .. import _fake_checks as fake_checks
from .. import reference
from .._backend import selected_backend
from .._extension import EXTENSION_LOADED, has_kernel
from ._checks import (
    KERNEL_FLOATS,
    SERVING_FLOATS,
    kernel_temperature,
    refuse_dtensors,
    require_generator,
    require_ids_in_range,
    require_one_device,
    require_tensor,
    uniforms,
)

__all__ = ["candidate_topk", "edge_scores", "walk"]

# The largest k the kernels take (one warp lane per candidate); a larger k runs the reference.
MAX_TOP_K = 32
# Where the reference runs, its transition sums run in float64 and the edges round once:
# a float32 einsum rounds as the host BLAS sums, which differs between machines and, at
# other operand addresses, between calls (MKL without conditional reproducibility), so
# the walk over them could too. In float64 every host and every call gets the same
# edges (and closer to exact than a float32 sum).
FALLBACK_TRANSITION_DTYPE = torch.float64
# The message for DTensors on the reference path.
_REFERENCE_PATH = f"dk.{{}} with k > {MAX_TOP_K}, float64 inputs, no compiled kernel or DFLASH2_BACKEND=reference"


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
        fake_checks.defined(op, **tensors, uniforms=uniforms)
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


def _use_kernel(op_name: str, device: torch.device, top_k: int, *tensors: torch.Tensor) -> bool:
    """Whether the compiled op runs: it is built for the device, not switched off, and
    the call is within what it takes (k <= 32, no float64)."""
    return (top_k <= MAX_TOP_K and all(t.dtype in KERNEL_FLOATS for t in tensors)
            and selected_backend() != "reference" and has_kernel(op_name, device.type))


def _check_top_k(top_k, vocab: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, (int, torch.SymInt)):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}.")
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab}], got {top_k}.")


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def candidate_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row, sorted descending, for any k in [1, V].

    logits: [..., V] float16, bfloat16, float32 or float64. Returns (values [..., k] in
    logits' dtype, ids [..., k] int64). The values equal ``torch.topk``'s (NaN ranks
    above +inf); tied values may come in either index order. k <= 32 in float16,
    bfloat16 or float32 runs the fused kernel; the rest is ``torch.topk``.
    """
    require_tensor("logits", logits, floats=SERVING_FLOATS)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}.")
    _check_top_k(top_k, logits.shape[-1])
    if not _use_kernel("candidate_topk", logits.device, top_k, logits):
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
        raise TypeError(f"successor_codebook must have predecessor_codebook's dtype {predecessor_codebook.dtype}, "
                        f"got {successor_codebook.dtype}.")
    vocab, rank = predecessor_codebook.shape
    batch, draft, logits_vocab = logits.shape
    if logits_vocab != vocab or batch < 1 or draft < 1:
        raise ValueError(f"logits must be [B >= 1, D >= 1, vocab_size={vocab}], got {tuple(logits.shape)}.")
    if tuple(projected.shape) != (batch, draft, rank):
        raise ValueError(f"projected must be [B, D, rank] = {(batch, draft, rank)}, got {tuple(projected.shape)}.")
    if anchor_ids.shape[0] != batch:
        raise ValueError(f"anchor_ids must be [B] = [{batch}], got {tuple(anchor_ids.shape)}.")
    _check_top_k(top_k, vocab)


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


def _on_kernels(projected, logits, predecessor_codebook, top_k) -> bool:
    return _use_kernel("select_path", logits.device, top_k, logits, projected, predecessor_codebook)


def edge_scores(
    projected: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every adjacent pair's score for one drafted block (SPEC section 2).

    projected: [B, D, r] (P = hidden_projection(h)); logits: [B, D, V]; codebooks:
    [V, r] (float16, bfloat16, float32 or float64 each, the codebooks one dtype);
    anchor_ids: [B] int (the last verified token); top_k: any k in [1, V].
    Returns (edges [B, D, k, k], candidate_ids [B, D, k] int64) with
    ``edges[b, t, i, j] = U[b, t, j] + T(prev_i, cand[b, t, j])``: prev is cand[b, t-1]
    for t > 0 and the anchor for t = 0 (so every row i of edges[b, 0] is the anchor's).
    Edges are in ``promote_types(logits, promote_types(codebooks, projected))``: on the
    kernels (k <= 32, no float64) computed in fp32 and rounded once; otherwise by the
    reference, in NeMo's order (T, then T added to U) with T summed in float64 and the
    edges rounded once, so that no host BLAS's rounding reaches them. An anchor id outside
    [0, V) raises IndexError on CPU; on CUDA (no host sync) its sequence's edges at t = 0
    come out NaN.
    """
    _validate_block(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k)
    if not _on_kernels(projected, logits, predecessor_codebook, top_k):
        refuse_dtensors(_REFERENCE_PATH.format("edge_scores"), projected=projected, logits=logits,
                        anchor_ids=anchor_ids, predecessor_codebook=predecessor_codebook,
                        successor_codebook=successor_codebook)
        require_ids_in_range("anchor_ids", anchor_ids, predecessor_codebook.shape[0])
        edges, candidate_ids = reference.serving_edge_scores(
            projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k,
            transition_dtype=FALLBACK_TRANSITION_DTYPE)
        # NeMo's dtype, under torch.autocast too (its einsum then runs in the autocast dtype).
        from .._autocast import serving_score_dtype

        return edges.to(serving_score_dtype(logits, projected, predecessor_codebook)), candidate_ids
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

    Arguments as :func:`edge_scores` (any k in [1, V], float64 included), plus
    temperature (0 walks greedily; taken as a float32, as the kernels take it, so one
    that rounds to 0 is greedy) and the generator of the sampled walk's uniforms.
    Returns (path [B, D] int64, candidate_ids [B, D, k] int64, draft_probs [B, D, k]
    float32 or None when greedy). Greedy: j_0 = argmax_j E[b, 0, 0, j], then
    j_t = argmax_j E[b, t, j_{t-1}, j] on the rounded scores (first maximum wins, as
    torch.argmax). Sampled: each step draws from q = softmax(E[b, t, j_{t-1}, :].float() / T)
    by inverse CDF at one ``torch.rand`` uniform per step (drawn the same way whichever
    path runs), and draft_probs holds those q: the proposal :func:`rejection_sample`
    needs to stay lossless. On CUDA a sequence whose anchor id is outside [0, V) gets
    path -1 (CPU raises IndexError).
    """
    _validate_block(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k)
    temperature = kernel_temperature(temperature)
    require_generator(generator, logits.device)
    batch, draft = logits.shape[:2]
    draws = (uniforms((batch, draft), logits.device, generator, rows_of=logits) if temperature > 0
             else logits.new_empty(0, dtype=torch.float32))
    if not _on_kernels(projected, logits, predecessor_codebook, top_k):
        refuse_dtensors(_REFERENCE_PATH.format("walk"), projected=projected, logits=logits, anchor_ids=anchor_ids,
                        predecessor_codebook=predecessor_codebook, successor_codebook=successor_codebook)
        require_ids_in_range("anchor_ids", anchor_ids, predecessor_codebook.shape[0])
        return reference.serving_walk(projected, logits, anchor_ids, predecessor_codebook, successor_codebook,
                                      top_k, temperature, draws if temperature > 0 else None,
                                      transition_dtype=FALLBACK_TRANSITION_DTYPE)
    path, candidate_ids, draft_probs, _ = _select_path(
        projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k, temperature, draws)
    return path, candidate_ids, draft_probs if temperature > 0 else None
