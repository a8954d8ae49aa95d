"""The fused draft head (SPEC section 7): :func:`draft_head` over the custom ops
``dflash2::draft_head`` / ``dflash2::draft_head_backward`` (ops.py), the row kernels
(csrc/head_cpu.cpp on the CPU, row_kernels.py in Triton on CUDA) and the GEMMs they share
with any dense implementation (gemm.py)."""

from . import ops, rows_fake  # registers the custom ops and the C++ row ops' fake impls
from .api import DraftHeadOutput, draft_head

__all__ = ["DraftHeadOutput", "draft_head"]
