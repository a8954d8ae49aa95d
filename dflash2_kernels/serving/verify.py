"""Verification of a drafted block (SPEC section 3) over the C++ op
``dflash2::rejection_sample`` (kernels in csrc/serving_cpu.cpp and
csrc/kernels/verify_kernels.cu), and greedy verification.

On CUDA the rejection sampling is two kernels plus one ``torch.rand``: a split-vocabulary
pass that finds each sequence's accepted prefix and the mass of its bonus distribution
per slice, then one block per sequence that draws the bonus inside the slice holding
it. No host synchronisation: it captures in a CUDA graph.

The kernels take float16, bfloat16 or float32 target probabilities and vocabularies of
up to 4,194,304 tokens (the CUDA bonus pass keeps one mass per 4,096-token slice in
shared memory); float64 probabilities and larger vocabularies run the PyTorch
reference (in float64, from the same uniforms, so the same draws), also sync-free.
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
    refuse_dtensors,
    require_generator,
    require_ids_in_range,
    require_one_device,
    require_tensor,
    uniforms,
)

__all__ = ["greedy_verify", "rejection_sample"]

# The largest vocabulary the rejection_sample kernels take (kMaxVerifyVocab in
# csrc/kernels/serving_math.h); a larger one runs the reference.
MAX_KERNEL_VOCAB = 1 << 22


if EXTENSION_LOADED:

    @torch.library.register_fake("dflash2::rejection_sample")
    def _(draft_tokens, target_probs, draft_probs, candidate_ids, uniforms):
        op = "rejection_sample"
        fake_checks.one_device(op, draft_tokens=draft_tokens, target_probs=target_probs, draft_probs=draft_probs,
                               candidate_ids=candidate_ids, uniforms=uniforms)
        fake_checks.float_dtype(op, "target_probs", target_probs.dtype, fake_checks.SERVING_FLOATS)
        fake_checks.float_dtype(op, "draft_probs", draft_probs.dtype, (torch.float32,))
        fake_checks.float_dtype(op, "uniforms", uniforms.dtype, (torch.float32,))
        fake_checks.int64_ids(op, draft_tokens=draft_tokens, candidate_ids=candidate_ids)
        batch = draft_tokens.shape[0]
        return draft_tokens.new_empty(batch, dtype=torch.long), draft_tokens.new_empty(batch, dtype=torch.long)


def _validate(draft_tokens, target_probs, draft_probs, candidate_ids) -> None:
    require_tensor("draft_tokens", draft_tokens, dim=2, integer=True)
    require_tensor("target_probs", target_probs, dim=3, floats=SERVING_FLOATS)
    require_tensor("draft_probs", draft_probs, dim=3, floats=SERVING_FLOATS)
    require_tensor("candidate_ids", candidate_ids, dim=3, integer=True)
    require_one_device(draft_tokens=draft_tokens, target_probs=target_probs, draft_probs=draft_probs,
                       candidate_ids=candidate_ids)
    batch, draft = draft_tokens.shape
    if batch < 1 or draft < 1:
        raise ValueError(f"draft_tokens must be [B >= 1, D >= 1], got {tuple(draft_tokens.shape)}.")
    if tuple(target_probs.shape[:2]) != (batch, draft + 1) or target_probs.shape[2] < 1:
        raise ValueError(f"target_probs must be [B, D+1, V] = [{batch}, {draft + 1}, V], "
                         f"got {tuple(target_probs.shape)}.")
    if tuple(draft_probs.shape[:2]) != (batch, draft) or draft_probs.shape[2] < 1:
        raise ValueError(f"draft_probs must be [B, D, k] = [{batch}, {draft}, k], got {tuple(draft_probs.shape)}.")
    if candidate_ids.shape != draft_probs.shape:
        raise ValueError(f"candidate_ids must have draft_probs' shape {tuple(draft_probs.shape)}, "
                         f"got {tuple(candidate_ids.shape)}.")


def rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    candidate_ids: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each drafted block and draw the token after it, losslessly.

    draft_tokens: [B, D] int (the walk's path); target_probs: [B, D+1, V] float16,
    bfloat16, float32 or float64 (the verifier's next-token distributions), any V;
    draft_probs: [B, D, k] float (the walk's proposal q, supported on candidate_ids);
    candidate_ids: [B, D, k] int, any k. Returns (accepted [B] int64, bonus [B] int64):
    d_t is kept while u_t * q_t(d_t) < p_t(d_t); the bonus is drawn from
    normalize(max(p_a - q_a, 0)) at the first rejection a (from p_a when that has no
    mass) or from p_D when all D are accepted, so the emitted tokens follow the
    verifier's distribution exactly. Float64 probabilities (either) or V > 4,194,304
    run the reference, in float64. Token ids outside [0, V) raise IndexError on CPU; on
    CUDA such a draft token is never accepted (and such a candidate takes no mass off
    the residual).
    """
    _validate(draft_tokens, target_probs, draft_probs, candidate_ids)
    require_generator(generator, draft_tokens.device)
    batch, draft = draft_tokens.shape
    draws = uniforms((batch, draft + 1), draft_tokens.device, generator, rows_of=draft_tokens)
    vocab = target_probs.shape[2]
    if (selected_backend() == "reference" or not has_kernel("rejection_sample", draft_tokens.device.type)
            or target_probs.dtype not in KERNEL_FLOATS or draft_probs.dtype not in KERNEL_FLOATS
            or vocab > MAX_KERNEL_VOCAB):
        refuse_dtensors(f"dk.rejection_sample with float64 probabilities, V > {MAX_KERNEL_VOCAB}, no compiled "
                        f"kernel or DFLASH2_BACKEND=reference", draft_tokens=draft_tokens,
                        target_probs=target_probs, draft_probs=draft_probs, candidate_ids=candidate_ids)
        require_ids_in_range("draft_tokens", draft_tokens, vocab)
        require_ids_in_range("candidate_ids", candidate_ids, vocab)
        return reference.rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids, draws)
    return torch.ops.dflash2.rejection_sample(
        draft_tokens.long().contiguous(),
        target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous(),
        draft_probs.float().contiguous(),
        candidate_ids.long().contiguous(),
        draws,
    )


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the longest prefix with d_t == argmax p_t, and argmax p_a.

    draft_tokens: [B, D] int; target_logits: [B, D+1, V] float16, bfloat16, float32 or
    float64 (logits or probabilities: only the argmax matters, taken in their dtype, ties
    to the lower index as torch.argmax). Returns (accepted [B] int64, bonus [B] int64).
    Two small reductions after one argmax; no host synchronisation. A draft token
    outside [0, V) is never the argmax: it is rejected, not an error.
    """
    require_tensor("draft_tokens", draft_tokens, dim=2, integer=True)
    require_tensor("target_logits", target_logits, dim=3, floats=reference.SUPPORTED_DTYPES)
    require_one_device(draft_tokens=draft_tokens, target_logits=target_logits)
    batch, draft = draft_tokens.shape
    if tuple(target_logits.shape[:2]) != (batch, draft + 1) or target_logits.shape[2] < 1:
        raise ValueError(f"target_logits must be [B, D+1, V] = [{batch}, {draft + 1}, V], "
                         f"got {tuple(target_logits.shape)}.")
    return reference.greedy_verify(draft_tokens, target_logits)
