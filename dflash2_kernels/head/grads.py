"""The draft head's backward, shared by the single-process op (ops.py) and the vocab-parallel
shard (shard.py): the gradients w.r.t. hidden and weight from the losses' upstream
gradients (through the forward's dL_l/dh planes, or through a recompute of each chunk's
logits) plus the top-k and label logits' own few terms per row.

The top-k and label logits' gradients are K + 1 entries per row: they go through the W
rows they came from, outside the GEMM over V, whose rounding would otherwise grow with V.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import gemm
from .checks import IGNORE_INDEX
from .rows import logit_slope
from .tiles import chunk_planes

# Bytes of the W rows the backward gathers at once for the top-k logits' gradient.
SPARSE_BYTES = 32 << 20


class SparseLogits(NamedTuple):
    """The differentiable logits picked per row and their upstream gradients: topk_ids
    [N, K] and label_ids [N] index weight's rows (a label -100 or -1 contributes nothing,
    nor does a top-k entry whose grad_topk is 0); topk_z [N, K], label_z [N] are the
    transformed logits there (for dz/ds)."""

    grad_topk: torch.Tensor  # [N, K]
    grad_label: torch.Tensor  # [N]
    topk_ids: torch.Tensor  # [N, K] int64
    topk_z: torch.Tensor  # [N, K]
    label_ids: torch.Tensor  # [N] int64
    label_z: torch.Tensor  # [N]
    logit_scale: float
    softcap: float

    def rows(self, start: int, stop: int) -> SparseLogits:
        return self._replace(grad_topk=self.grad_topk[start:stop], grad_label=self.grad_label[start:stop],
                             topk_ids=self.topk_ids[start:stop], topk_z=self.topk_z[start:stop],
                             label_ids=self.label_ids[start:stop], label_z=self.label_z[start:stop])

    def coefficients(self, dtype: torch.dtype):
        """dL/ds at the top-k entries [R, K] and at the label [R] (0 where no label logit
        exists), and the label's column with ignored rows and no-label rows at 0."""
        topk = self.grad_topk.to(dtype) * logit_slope(self.topk_z, self.logit_scale, self.softcap)
        label = self.grad_label.to(dtype) * logit_slope(self.label_z, self.logit_scale, self.softcap)
        label = torch.where(self.label_ids == -1, torch.zeros_like(label), label)
        column = torch.where((self.label_ids == IGNORE_INDEX) | (self.label_ids == -1), 0, self.label_ids)
        return topk, label, column


def scatter_sparse_grads(grad_logits: torch.Tensor, sparse: SparseLogits) -> None:
    """grad_logits [R, V] += the top-k and label logits' gradients at their entries (for dW)."""
    topk, label, column = sparse.coefficients(grad_logits.dtype)
    grad_logits.scatter_add_(1, sparse.topk_ids, topk)  # ids are distinct within a row
    grad_logits.scatter_add_(1, column.unsqueeze(1), label.unsqueeze(1))


def add_sparse_grads(grad_hidden: torch.Tensor, sparse: SparseLogits, weight: torch.Tensor) -> None:
    """grad_hidden [R, H] += the top-k and label logits' gradients through the W rows they
    came from: K + 1 terms per row, not a sum over V."""
    rows, width = grad_hidden.shape
    if weight.shape[0] == 0:  # an empty vocabulary shard: no logit here
        return
    dtype = grad_hidden.dtype
    top_k = sparse.topk_ids.shape[1]
    chunk = max(1, SPARSE_BYTES // max(1, (top_k + 1) * width * dtype.itemsize))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        part = sparse.rows(start, stop)
        topk, label, column = part.coefficients(dtype)
        if top_k:
            picked = weight[part.topk_ids].to(dtype)  # [R, K, H]
            grad_hidden[start:stop] += torch.bmm(topk.unsqueeze(1), picked).squeeze(1)
        grad_hidden[start:stop] += label.unsqueeze(1) * weight[column].to(dtype)


def grads_from_planes(grad_losses: torch.Tensor, hidden_grads: torch.Tensor, sparse: SparseLogits,
                      weight: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """hidden's gradient [N, H] (dtype) from the forward's dL_l/dh planes [N, L, H] (or [0]:
    none) scaled by grad_losses [L, N], plus the sparse terms."""
    grad_hidden = torch.zeros(shape, dtype=dtype, device=weight.device)
    if hidden_grads.numel():
        grad_hidden += torch.einsum("ln,nlh->nh", grad_losses.to(dtype), hidden_grads)
    add_sparse_grads(grad_hidden, sparse, weight)
    return grad_hidden


# rows_backward(start, stop, s, t, weights): s [R, V] raw logits of rows [start, stop) (and
# t the target's, or None) -> s holds sum_l weights[l] dL_l/ds (the dense part).
RowsBackward = Callable[[int, int, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def recomputed_grads(grad_losses: torch.Tensor, sparse: SparseLogits, hidden: torch.Tensor, weight: torch.Tensor,
                     target_hidden, target_weight, rows_backward: RowsBackward, need_hidden: bool,
                     need_weight: bool, tile_rows: int):
    """Each chunk's logits again, turned into dL/ds in place by ``rows_backward``, then dh
    [N, H] and dW [V, H] (compute dtype; None where not needed) from them."""
    dtype = gemm.compute_dtype(weight.dtype)
    rows, width = hidden.shape
    vocab = weight.shape[0]
    chunk = min(rows, tile_rows)
    target_weight = weight if target_weight is None else target_weight
    grad_hidden = torch.zeros((rows, width), dtype=dtype, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros((vocab, width), dtype=dtype, device=hidden.device) if need_weight else None
    logits = chunk_planes((chunk, vocab), dtype, hidden.device)
    target_logits = chunk_planes((chunk, vocab), dtype, hidden.device) if target_hidden is not None else None
    weights = grad_losses.to(dtype)
    for start in range(0, rows, max(chunk, 1)):
        stop = min(rows, start + chunk)
        count = stop - start
        rows_in = hidden[start:stop].to(weight.dtype)
        part = sparse.rows(start, stop)
        if vocab:
            s = logits[:count]
            gemm.project(s, rows_in, weight)
            t = None
            if target_logits is not None:
                t = target_logits[:count]
                gemm.project(t, target_hidden[start:stop].to(target_weight.dtype), target_weight)
            rows_backward(start, stop, s, t, weights[:, start:stop].contiguous())
            if need_hidden:
                gemm.hidden_grad(grad_hidden[start:stop], s, weight)
            if need_weight:
                scatter_sparse_grads(s, part)
                gemm.accumulate_weight_grad(grad_weight, s, rows_in)
        if need_hidden:
            add_sparse_grads(grad_hidden[start:stop], part, weight)
    return grad_hidden, grad_weight
