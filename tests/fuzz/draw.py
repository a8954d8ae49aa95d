"""The seeded random source of a case: sizes biased to edges, dtypes, tensors, layouts.

One :class:`Draw` per case, seeded from (target, seed, index) alone, so a case is the
same on every run and machine and can be replayed by itself.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SERVING_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# Dtypes no float argument accepts: integers, bool, complex, 8-bit floats.
NON_FLOATS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
              torch.complex128, torch.float8_e4m3fn)
# Dtypes no id argument accepts.
NON_INTEGERS = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.complex64)


class Draw:
    """Random choices for one case. ``np`` draws sizes and choices; ``torch`` tensors."""

    def __init__(self, target: str, seed: int, index: int) -> None:
        self.target, self.seed, self.index = target, seed, index
        # crc32, not hash(): Python salts str hashes per process.
        self.np = np.random.default_rng([zlib.crc32(target.encode()), seed, index])
        self.torch = torch.Generator().manual_seed(int(self.np.integers(0, 2**62)))

    # --- choices -------------------------------------------------------------------------

    def chance(self, probability: float) -> bool:
        return bool(self.np.random() < probability)

    def pick(self, options):
        """One element of a sequence, uniformly."""
        return options[int(self.np.integers(0, len(options)))]

    def integer(self, low: int, high: int) -> int:
        """Uniform in [low, high]."""
        return int(self.np.integers(low, high + 1))

    def size(self, low: int, high: int, edges=()) -> int:
        """A size in [low, high]: a third of the time an edge (low, high, or one given)."""
        if self.chance(1 / 3):
            return int(self.pick([low, high, *edges]))
        # Log-uniform, so small sizes (where edge bugs live) come up often.
        return int(round(np.exp(self.np.uniform(np.log(low + 1), np.log(high + 1))) - 1))

    def lead_dims(self, max_dims: int, max_rows: int, *, min_dims: int = 0, allow_empty: bool = True) -> tuple:
        """Leading dims whose product is at most max_rows; sometimes one of them is 0."""
        dims = []
        budget = max_rows
        for _ in range(self.integer(min_dims, max_dims)):
            size = self.size(1, max(1, budget))
            dims.append(size)
            budget = max(1, budget // size)
        if allow_empty and dims and self.chance(0.08):
            dims[self.integer(0, len(dims) - 1)] = 0
        return tuple(dims)

    def dtype(self, options=FLOATS) -> torch.dtype:
        return self.pick(options)

    # --- tensors -------------------------------------------------------------------------

    def randn(self, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        """N(0, scale^2) drawn in float64, then rounded to dtype."""
        return (torch.randn(tuple(shape), generator=self.torch, dtype=torch.float64) * scale).to(dtype)

    def ids(self, shape, vocab: int) -> torch.Tensor:
        """int64 ids in [0, vocab), with 0 and vocab - 1 over-represented (edge rows)."""
        ids = torch.randint(0, vocab, tuple(shape), generator=self.torch)
        if ids.numel() and self.chance(0.5):
            edge = torch.rand(tuple(shape), generator=self.torch) < 0.3
            ends = torch.where(torch.rand(tuple(shape), generator=self.torch) < 0.5, 0, vocab - 1)
            ids = torch.where(edge, ends, ids)
        return ids

    def sprinkle(self, tensor: torch.Tensor, values, fraction: float = 0.05) -> torch.Tensor:
        """A copy with some elements replaced by values drawn from ``values`` (e.g. NaN, -inf)."""
        out = tensor.contiguous().clone()
        if out.numel() == 0:
            return out
        flat = out.view(-1)
        count = max(1, int(fraction * flat.numel()))
        positions = torch.randint(0, flat.numel(), (count,), generator=self.torch)
        for position in positions.tolist():
            flat[position] = float(self.pick(values))
        return out

    def layout(self, tensor: torch.Tensor, *, unit_last_stride: bool = False, expand: bool = True) -> torch.Tensor:
        """The tensor in a random memory layout: contiguous, row-strided (a slice of a wider
        buffer), permuted leading dims, a non-unit last stride, or a broadcast (stride-0)
        dim. All but the broadcast keep the values; the broadcast copies row 0 along a dim.
        """
        choices = ["contiguous", "row_strided"]
        if tensor.dim() >= 2:
            choices.append("permuted")
        if not unit_last_stride and tensor.dim() >= 1 and tensor.shape[-1] > 1:
            choices.append("last_strided")
        if expand and tensor.dim() >= 2 and any(size > 1 for size in tensor.shape[:-1]):
            choices.append("broadcast")
        how = self.pick(choices)
        if how == "row_strided" and tensor.dim() >= 1:
            pad = self.integer(1, 5)
            wide = torch.zeros(*tensor.shape[:-1], tensor.shape[-1] + pad, dtype=tensor.dtype)
            wide[..., : tensor.shape[-1]] = tensor
            return wide[..., : tensor.shape[-1]]
        if how == "permuted":
            lead = tensor.dim() - (1 if unit_last_stride else 0)
            order = [int(i) for i in self.np.permutation(lead)] + list(range(lead, tensor.dim()))
            inverse = [order.index(i) for i in range(tensor.dim())]
            return tensor.permute(order).contiguous().permute(inverse)
        if how == "last_strided":
            wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
            wide[..., ::2] = tensor
            return wide[..., ::2]
        if how == "broadcast":
            dims = [d for d in range(tensor.dim() - 1) if tensor.shape[d] > 1]
            dim = self.pick(dims)
            return tensor.narrow(dim, 0, 1).expand(tensor.shape)
        return tensor.contiguous()
