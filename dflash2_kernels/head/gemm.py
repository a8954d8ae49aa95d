"""The draft head's three GEMMs per row chunk, accumulated in the compute dtype.

The head takes ``hidden`` in ``weight``'s dtype (as autocast hands a bf16 lm_head its
input) and accumulates every product in float32 (float64 for float64 weights):
- logits   s [R, V]  = h_c W^T
- hidden   dh [R, H] = dS W
- weight   dW [V, H] += dS^T h_c

Where weight is already in the compute dtype these are plain ``torch.mm`` calls. A
half-precision weight takes ``mm``'s ``out_dtype`` on CUDA (cuBLAS accumulates in fp32
and rounds nothing but the operand dS of the two backward products, as a dense bf16
backward does); on the CPU, where ``aten::mm`` has no ``out_dtype``, it is converted
to the compute dtype one vocabulary slice at a time (about 8 MiB each), so no
full-size float32 copy of W is ever held.
"""

from __future__ import annotations

import torch

# Bytes of one vocabulary slice of W converted to the compute dtype on the CPU.
SLICE_BYTES = 8 << 20


def compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the head's logits and sums are held in: float64 for float64 weights, else float32."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def _slices(weight: torch.Tensor, dtype: torch.dtype):
    vocab, width = weight.shape
    step = max(1, SLICE_BYTES // max(1, width * dtype.itemsize))
    for start in range(0, vocab, step):
        stop = min(vocab, start + step)
        yield start, stop, weight[start:stop].to(dtype)


def project(out: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> None:
    """out [R, V] (compute dtype) = rows [R, H] (weight's dtype) @ weight [V, H]^T."""
    if weight.dtype == out.dtype:
        torch.mm(rows, weight.t(), out=out)
    elif out.is_cuda:
        out.copy_(torch.mm(rows, weight.t(), out_dtype=out.dtype))
    else:
        wide = rows.to(out.dtype)
        for start, stop, part in _slices(weight, out.dtype):
            torch.mm(wide, part.t(), out=out[:, start:stop])


def hidden_grad(out: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor) -> None:
    """out [R, H] (compute dtype) = grad_logits [R, V] (compute dtype) @ weight [V, H]."""
    if weight.dtype == out.dtype:
        torch.mm(grad_logits, weight, out=out)
    elif out.is_cuda:
        out.copy_(torch.mm(grad_logits.to(weight.dtype), weight, out_dtype=out.dtype))
    else:
        out.zero_()
        for start, stop, part in _slices(weight, out.dtype):
            out.addmm_(grad_logits[:, start:stop], part)


def accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, rows: torch.Tensor) -> None:
    """grad_weight [V, H] (compute dtype) += grad_logits [R, V]^T @ rows [R, H] (weight's dtype)."""
    if rows.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), rows)
    elif grad_weight.is_cuda:
        grad_weight.add_(torch.mm(grad_logits.t().to(rows.dtype), rows, out_dtype=grad_weight.dtype))
    else:
        grad_weight.addmm_(grad_logits.t(), rows.to(grad_weight.dtype))
