"""The candidate selector's scoring op (SPEC section 2): Python registration over the
C++ ops (schemas in csrc/registration.cpp, kernels in csrc/selector_*.cpp and
csrc/kernels/), and the functional forms over plain tensors.

``dflash2::selector_scores`` computes, per row n of the flattened leading dims,

    S[n, j] = U[n, cand[n, j]] + sum_rho A[pred[n], rho] * P[n, rho] * B[cand[n, j], rho]

without forming anything of size [N, k, r]; its backward op writes dU (at the
gathered entries only), dP, and dA / dB summed over repeated ids, deterministically.
Without the compiled extension the functions run the PyTorch reference instead.
"""

from __future__ import annotations

import torch

from .. import _fake_checks as fake_checks
from .. import reference
from .._backend import selected_backend
from .._eager import plain_eager
from .._extension import EXTENSION_LOADED

__all__ = ["pair_scores", "score_candidates", "transition_scores"]

_SUPPORTED = reference.SUPPORTED_DTYPES
_INTEGER_DTYPES = frozenset(d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                        getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                        getattr(torch, "uint64", None)) if d is not None)


if EXTENSION_LOADED:

    @torch.library.register_fake("dflash2::selector_scores")
    def _(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
          unary_gathered, out_dtype):
        op = "selector_scores"
        fake_checks.one_device(op, unary=unary, projected=projected, predecessor_codebook=predecessor_codebook,
                               successor_codebook=successor_codebook, predecessor_ids=predecessor_ids,
                               candidate_ids=candidate_ids)
        for name, tensor in (("unary", unary), ("projected", projected), ("predecessor_codebook",
                                                                          predecessor_codebook)):
            fake_checks.float_dtype(op, name, tensor.dtype)
        fake_checks.float_dtype(op, "out_dtype", out_dtype)
        fake_checks.int64_ids(op, predecessor_ids=predecessor_ids, candidate_ids=candidate_ids)
        return projected.new_empty((projected.shape[0], candidate_ids.shape[-1]), dtype=out_dtype)

    @torch.library.register_fake("dflash2::selector_scores_backward")
    def _(grad_scores, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
          unary_gathered, unary_width, unary_dtype):
        op = "selector_scores_backward"
        fake_checks.one_device(op, grad_scores=grad_scores, projected=projected,
                               predecessor_codebook=predecessor_codebook, successor_codebook=successor_codebook,
                               predecessor_ids=predecessor_ids, candidate_ids=candidate_ids)
        for name, tensor in (("grad_scores", grad_scores), ("projected", projected),
                             ("predecessor_codebook", predecessor_codebook)):
            fake_checks.float_dtype(op, name, tensor.dtype)
        fake_checks.float_dtype(op, "unary_dtype", unary_dtype)
        fake_checks.int64_ids(op, predecessor_ids=predecessor_ids, candidate_ids=candidate_ids)
        return (
            projected.new_empty((projected.shape[0], unary_width), dtype=unary_dtype),
            projected.new_empty(projected.shape),
            predecessor_codebook.new_empty(predecessor_codebook.shape),
            successor_codebook.new_empty(successor_codebook.shape),
        )

    def _setup_context(ctx, inputs, output) -> None:
        unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids, gathered, _ = inputs
        ctx.save_for_backward(projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids)
        ctx.unary_gathered = gathered
        ctx.unary_width = unary.shape[-1]
        ctx.unary_dtype = unary.dtype

    def _backward(ctx, grad_scores):
        projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids = ctx.saved_tensors
        # dU of full-vocabulary logits is a zero-filled [N, V] tensor; when U needs no
        # gradient, ask for the gathered form instead (a cast of dS) and drop it.
        wants_unary = ctx.needs_input_grad[0]
        gathered = ctx.unary_gathered or not wants_unary
        grad_unary, grad_projected, grad_predecessor, grad_successor = torch.ops.dflash2.selector_scores_backward(
            grad_scores, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
            gathered, ctx.unary_width if not gathered else grad_scores.shape[-1], ctx.unary_dtype,
        )
        return (grad_unary if wants_unary else None, grad_projected, grad_predecessor, grad_successor,
                None, None, None, None)

    torch.library.register_autograd("dflash2::selector_scores", _backward, setup_context=_setup_context)


def _check(name: str, tensor, *, floating: bool = True) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if floating and tensor.dtype not in _SUPPORTED:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {tensor.dtype}.")
    if not floating and tensor.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must hold integer token ids, got {tensor.dtype}.")


def check_context_ids(predecessor_ids, projected: torch.Tensor, predecessor_codebook: torch.Tensor) -> None:
    """predecessor_ids [...] for P [..., r]: integer ids on P's device, each in [0, V)
    (read on the host: one sync on a GPU, skipped while torch.compile traces)."""
    _check("predecessor_ids", predecessor_ids, floating=False)
    if tuple(predecessor_ids.shape) != tuple(projected.shape[:-1]):
        raise ValueError(f"predecessor_ids must have shape {tuple(projected.shape[:-1])} (hidden_states' leading "
                         f"dims), got {tuple(predecessor_ids.shape)}.")
    if predecessor_ids.device != projected.device:
        raise ValueError(f"predecessor_ids is on {predecessor_ids.device} but hidden_states is on {projected.device}.")
    _check_ids_in_range("predecessor_ids", predecessor_ids, predecessor_codebook.shape[0])


def _check_ids_in_range(name: str, ids: torch.Tensor, vocab: int) -> None:
    """Every id in [0, vocab), read on the host (IndexError naming ``name``): for the
    paths that index with PyTorch, where an id out of range is torch's unnamed
    IndexError on CPU and a device-side assert on CUDA. Skipped while torch.compile traces."""
    if ids.numel() and not torch.compiler.is_compiling():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise IndexError(f"{name} holds {low if low < 0 else high}, out of range for a vocabulary of {vocab}.")


def _reference_without_kernels(reference_fn, predecessor_codebook, predecessor_ids, candidate_ids, *args):
    """What an empty or rank-0 call returns: the reference's result, ids checked first
    as the kernels would check them."""
    vocab = predecessor_codebook.shape[0]
    _check_ids_in_range("predecessor_ids", predecessor_ids, vocab)
    _check_ids_in_range("candidate_ids", candidate_ids, vocab)
    return reference_fn(*args)


# transition_scores has no unary scores: the validation skips them (None is a bad argument).
_NO_UNARY = object()


def _validate(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
              *, unary_gathered: bool) -> None:
    """Clear Python errors, naming the argument, before anything reaches a kernel.
    ``unary`` _NO_UNARY: there is none (transition_scores)."""
    has_unary = unary is not _NO_UNARY
    named = (("projected", projected), ("predecessor_codebook", predecessor_codebook),
             ("successor_codebook", successor_codebook))
    if has_unary:
        named = (("unary_logits" if not unary_gathered else "unary", unary),) + named
    for name, tensor in named:
        _check(name, tensor)
    _check("predecessor_ids", predecessor_ids, floating=False)
    _check("candidate_ids", candidate_ids, floating=False)
    if predecessor_codebook.dim() != 2:
        raise ValueError(f"predecessor_codebook must be [vocab_size, rank], got {tuple(predecessor_codebook.shape)}.")
    if successor_codebook.shape != predecessor_codebook.shape:
        raise ValueError(
            f"successor_codebook must have predecessor_codebook's shape {tuple(predecessor_codebook.shape)}, "
            f"got {tuple(successor_codebook.shape)}."
        )
    if successor_codebook.dtype != predecessor_codebook.dtype:
        raise TypeError(
            f"successor_codebook must have predecessor_codebook's dtype {predecessor_codebook.dtype}, "
            f"got {successor_codebook.dtype}."
        )
    vocab, rank = predecessor_codebook.shape
    lead = tuple(predecessor_ids.shape)
    if tuple(projected.shape) != (*lead, rank):
        raise ValueError(f"projected must have shape {(*lead, rank)} (predecessor_ids' shape + rank), "
                         f"got {tuple(projected.shape)}.")
    if candidate_ids.dim() != len(lead) + 1 or tuple(candidate_ids.shape[:-1]) != lead:
        raise ValueError(f"candidate_ids must have shape {(*lead, 'k')}, got {tuple(candidate_ids.shape)}.")
    width = candidate_ids.shape[-1] if unary_gathered else vocab
    if has_unary and tuple(unary.shape) != (*lead, width):
        what = "unary (the gathered unary scores)" if unary_gathered else "unary_logits"
        raise ValueError(f"{what} must have shape {(*lead, width)}, got {tuple(unary.shape)}.")
    named_all = (*named, ("predecessor_ids", predecessor_ids), ("candidate_ids", candidate_ids))
    device = projected.device
    if any(tensor.device != device for _, tensor in named_all):
        listed = ", ".join(f"{name} on {tensor.device}" for name, tensor in named_all)
        raise ValueError(f"all selector tensors must be on one device, got {listed}.")


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels walk rows with any stride but need unit steps along the last axis."""
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def _as_int64(ids: torch.Tensor) -> torch.Tensor:
    return ids if ids.dtype == torch.int64 else ids.long()


def _nothing_to_fuse(predecessor_codebook, predecessor_ids, candidate_ids) -> bool:
    """No rows, no candidates or rank 0: the result is empty or the gathered unary alone,
    which the reference forms (with its gradients) at no cost."""
    return predecessor_ids.numel() == 0 or candidate_ids.shape[-1] == 0 or predecessor_codebook.shape[1] == 0


def _fused_scores(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
                  *, unary_gathered: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Flatten the leading dims, normalise ids and P's dtype, run the op, restore dims."""
    lead = predecessor_ids.shape
    rows = predecessor_ids.numel()
    k = candidate_ids.shape[-1]
    rank = predecessor_codebook.shape[1]
    if torch.float64 in (unary.dtype, projected.dtype) and predecessor_codebook.dtype != torch.float64:
        # The kernels compute in the codebooks' precision; an fp64 input asks for fp64
        # (README: fp32, fp64 when an input is fp64). A [V, r] copy, for a rare mix of
        # dtypes; autograd casts dA and dB back.
        predecessor_codebook, successor_codebook = predecessor_codebook.double(), successor_codebook.double()
    if projected.dtype != predecessor_codebook.dtype:
        # The kernels read P in the codebook dtype or fp32; fp32 holds any P exactly.
        projected = projected.float()
    # Already flat and int64 (the common call): no reshape or cast, each a dispatcher call.
    flat = len(lead) == 1
    args = (
        _unit_last_stride(unary if flat else unary.reshape(rows, unary.shape[-1])),
        _unit_last_stride(projected if flat else projected.reshape(rows, rank)),
        _unit_last_stride(predecessor_codebook),
        _unit_last_stride(successor_codebook),
        _as_int64(predecessor_ids if flat else predecessor_ids.reshape(rows)),
        _as_int64(candidate_ids if flat else candidate_ids.reshape(rows, k)),
        unary_gathered,
        out_dtype,
    )
    if not plain_eager(*args[:4]):
        scores = torch.ops.dflash2.selector_scores(*args)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
        scores = _EagerSelectorScores.apply(*args)
    else:
        with torch._C._AutoDispatchBelowAutograd():
            scores = torch.ops.dflash2.selector_scores.default(*args)
    return scores if flat else scores.view(*lead, k)


# --- The eager path -------------------------------------------------------------------
#
# In eager mode on plain tensors the op runs under this autograd.Function, its forward
# dispatched below autograd: torch.library's Python autograd registration costs ~20 us a
# call (it rebuilds the call's defaults and an autograd.Function per call), more than the
# selector's own Python layer. Autocast still applies (its key sits above autograd); a
# dispatch mode, functorch transform, tensor subclass or torch.compile takes the op.

class _EagerSelectorScores(torch.autograd.Function):
    """``dflash2::selector_scores`` with its backward, as its torch.library registration
    (_setup_context, _backward) gives them, in the classic ``forward(ctx, ...)`` form."""

    @staticmethod
    def forward(ctx, unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
                unary_gathered, out_dtype):
        inputs = (unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
                  unary_gathered, out_dtype)
        _setup_context(ctx, inputs, None)
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.dflash2.selector_scores.default(*inputs)

    @staticmethod
    def backward(ctx, grad_scores):
        return _backward(ctx, grad_scores)


def _use_reference() -> bool:
    return selected_backend() == "reference" or not EXTENSION_LOADED


def score_candidates(
    unary_logits: torch.Tensor,
    projected: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    predecessor_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
) -> torch.Tensor:
    """speculators' ``score_candidates`` over plain tensors, fused.

    unary_logits: [..., V] float; projected: [..., r] float (P = hidden_projection(h));
    codebooks: [V, r] float, one dtype; predecessor_ids: [...] int; candidate_ids:
    [..., k] int. Returns [..., k] in unary_logits' dtype. Ids must lie in [0, V): on
    CPU others raise IndexError; on CUDA their scores come out NaN (never read out of
    bounds).
    """
    if _use_reference():
        return reference.selector_score_candidates(
            unary_logits, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids
        )
    _validate(unary_logits, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
              unary_gathered=False)
    if _nothing_to_fuse(predecessor_codebook, predecessor_ids, candidate_ids):
        return _reference_without_kernels(
            reference.selector_score_candidates, predecessor_codebook, predecessor_ids, candidate_ids,
            unary_logits, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids
        )
    return _fused_scores(unary_logits, projected, predecessor_codebook, successor_codebook, predecessor_ids,
                         candidate_ids, unary_gathered=False, out_dtype=unary_logits.dtype)


def transition_scores(
    projected: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    predecessor_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
) -> torch.Tensor:
    """T[..., j] = sum_rho A[pred, rho] P[rho] B[cand_j, rho], in the codebook dtype."""
    if _use_reference():
        return reference.selector_transition_scores(
            projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids
        )
    _validate(_NO_UNARY, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
              unary_gathered=True)
    if _nothing_to_fuse(predecessor_codebook, predecessor_ids, candidate_ids):
        return _reference_without_kernels(
            reference.selector_transition_scores, predecessor_codebook, predecessor_ids, candidate_ids,
            projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids
        )
    zeros = predecessor_codebook.new_zeros(candidate_ids.shape)
    return _fused_scores(zeros, projected, predecessor_codebook, successor_codebook, predecessor_ids,
                         candidate_ids, unary_gathered=True, out_dtype=predecessor_codebook.dtype)


def pair_scores(
    projected: torch.Tensor,
    unary: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    candidate_ids: torch.Tensor,
    predecessor_ids: torch.Tensor,
) -> torch.Tensor:
    """NeMo's ``pair_scores`` over plain tensors, fused: unary [..., k] already gathered.

    Returns [..., k] in ``promote_types(unary, promote_types(codebooks, projected))``.
    """
    if _use_reference():
        return reference.selector_pair_scores(
            projected, unary, predecessor_codebook, successor_codebook, candidate_ids, predecessor_ids
        )
    _validate(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids,
              unary_gathered=True)
    out_dtype = torch.promote_types(unary.dtype, torch.promote_types(predecessor_codebook.dtype, projected.dtype))
    if _nothing_to_fuse(predecessor_codebook, predecessor_ids, candidate_ids):
        # The reference's einsum does not promote as documented: cast to the promised dtype.
        return _reference_without_kernels(
            reference.selector_pair_scores, predecessor_codebook, predecessor_ids, candidate_ids,
            projected, unary, predecessor_codebook, successor_codebook, candidate_ids, predecessor_ids
        ).to(out_dtype)
    return _fused_scores(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids,
                         candidate_ids, unary_gathered=True, out_dtype=out_dtype)
