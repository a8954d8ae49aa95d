"""The draft head's three GEMMs per row chunk, accumulated in the compute dtype.

The head takes ``hidden`` in ``weight``'s dtype (as autocast hands a bf16 lm_head its
input) and accumulates every product in float32 (float64 for float64 weights):
- logits   s [R, V]  = h_c W^T, written straight into the chunk's plane;
- hidden   dh [R, H] = dS W (or += over vocabulary slices);
- weight   dW [V, H] += dS^T h_c (or = over vocabulary slices).
dS is in the compute dtype (the CPU driver) or in the weight's dtype (the GPU driver's
planes: the row kernel rounds dL/ds once to it, as a dense backward rounds the gradient
it hands a 16-bit GEMM).

On CUDA a half-precision weight takes ``mm``'s ``out_dtype`` with ``out=``: cuBLAS
accumulates in fp32 and writes the fp32 result into the plane itself (no temporary, no
copy); dW accumulates in place with ``addmm(..., out_dtype=float32, out=dW)``, or, where
a torch build refuses an fp32 accumulator with 16-bit operands, through fp32 products of
vocabulary slices (bounded temporaries, never [V, H]). Torch releases before ``out_dtype``
(2.5 to 2.7) get a 16-bit product copied into the plane. On the CPU, where ``aten::mm``
has no ``out_dtype``, the weight is converted one vocabulary slice at a time (about 8 MiB
each), so no full-size float32 copy of W is ever held.
"""

from __future__ import annotations

import torch

# Bytes of one vocabulary slice of W converted to the compute dtype on the CPU.
SLICE_BYTES = 8 << 20
# Bytes of one fp32 slice of dW where cuBLAS cannot accumulate in place (see the docstring).
_WEIGHT_SLICE_BYTES = 256 << 20
_HAS_OUT_DTYPE = "dtype_out" in torch.ops.aten.mm.overloads()
_addmm_out_dtype_refused = False


def compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the head's logits and sums are held in: float64 for float64 weights, else float32."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def _slices(weight: torch.Tensor, dtype: torch.dtype):
    """(start, stop, rows of weight in dtype), about SLICE_BYTES a slice."""
    vocab, width = weight.shape
    step = max(1, SLICE_BYTES // max(1, width * dtype.itemsize))
    for start in range(0, vocab, step):
        stop = min(vocab, start + step)
        yield start, stop, weight[start:stop].to(dtype)


def _fused_cuda(out: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether cuBLAS can write ``out`` from 16-bit operands directly."""
    return out.is_cuda and _HAS_OUT_DTYPE and all(o.dtype.itemsize == 2 for o in operands)


def project(out: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> None:
    """out [R, V] (compute dtype) = rows [R, H] (weight's dtype) @ weight [V, H]^T."""
    if weight.dtype == out.dtype:
        torch.mm(rows, weight.t(), out=out)
    elif _fused_cuda(out, rows, weight):
        torch.mm(rows, weight.t(), out_dtype=out.dtype, out=out)
    elif out.is_cuda:
        out.copy_(torch.mm(rows, weight.t()))
    else:
        wide = rows.to(out.dtype)
        for start, stop, part in _slices(weight, out.dtype):
            torch.mm(wide, part.t(), out=out[:, start:stop])


def hidden_grad(out: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor, accumulate: bool = False) -> None:
    """out [R, H] (compute dtype) = (or, with ``accumulate``, +=) grad_logits [R, V] (compute
    or weight's dtype) @ weight [V, H]."""
    global _addmm_out_dtype_refused
    if weight.dtype == out.dtype == grad_logits.dtype:
        if accumulate:
            out.addmm_(grad_logits, weight)
        else:
            torch.mm(grad_logits, weight, out=out)
    elif _fused_cuda(out, grad_logits, weight):
        if not accumulate:
            torch.mm(grad_logits, weight, out_dtype=out.dtype, out=out)
            return
        if not _addmm_out_dtype_refused:
            try:
                torch.addmm(out, grad_logits, weight, out_dtype=out.dtype, out=out)
                return
            except RuntimeError as error:  # a torch that wants the accumulator in the operands' dtype
                if "dtype" not in str(error):
                    raise
                _addmm_out_dtype_refused = True
        out += torch.mm(grad_logits, weight, out_dtype=out.dtype)
    elif out.is_cuda:
        product = torch.mm(grad_logits.to(weight.dtype), weight)
        out.add_(product) if accumulate else out.copy_(product)
    else:
        if not accumulate:
            out.zero_()
        for start, stop, part in _slices(weight, out.dtype):
            out.addmm_(grad_logits[:, start:stop].to(out.dtype), part)


def accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, rows: torch.Tensor,
                           accumulate: bool = True) -> None:
    """grad_weight [V, H] (compute dtype) += grad_logits [R, V] (compute or weight's dtype)^T
    @ rows [R, H] (weight's dtype); ``accumulate`` False writes it instead (the first chunk:
    no zero fill of [V, H] before it; or the only product of these rows of dW, which may
    then be in the weight's dtype: one rounding of the GEMM's fp32 sums)."""
    global _addmm_out_dtype_refused
    if not accumulate:
        if grad_logits.dtype == rows.dtype == grad_weight.dtype:
            torch.mm(grad_logits.t(), rows, out=grad_weight)
        elif _fused_cuda(grad_weight, grad_logits, rows):
            torch.mm(grad_logits.t(), rows, out_dtype=grad_weight.dtype, out=grad_weight)
        else:
            grad_weight.zero_()
            accumulate_weight_grad(grad_weight, grad_logits, rows)
        return
    if rows.dtype == grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.t(), rows)
    elif _fused_cuda(grad_weight, grad_logits, rows):
        if not _addmm_out_dtype_refused:
            try:
                torch.addmm(grad_weight, grad_logits.t(), rows, out_dtype=grad_weight.dtype, out=grad_weight)
                return
            except RuntimeError as error:  # a torch that wants the accumulator in the operands' dtype
                if "dtype" not in str(error):
                    raise
                _addmm_out_dtype_refused = True
        width = rows.shape[1]
        step = max(1, _WEIGHT_SLICE_BYTES // (width * grad_weight.element_size()))
        for start in range(0, grad_weight.shape[0], step):
            part = grad_logits[:, start:start + step]
            grad_weight[start:start + step] += torch.mm(part.t(), rows, out_dtype=grad_weight.dtype)
    elif grad_weight.is_cuda:
        grad_weight.add_(torch.mm(grad_logits.t().to(rows.dtype), rows).to(grad_weight.dtype))
    else:
        grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), rows.to(grad_weight.dtype))
