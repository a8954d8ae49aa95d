"""The fused draft head (SPEC section 7): :func:`draft_head` over the custom ops
``dflash2::draft_head`` / ``dflash2::draft_head_backward`` (ops.py), one driver per device
(cpu_driver.py over the C++ row kernels of csrc/head_cpu.cpp; gpu_driver.py over the
Triton kernels of scan_kernels.py, sweep_kernels.py, backward_kernels.py, topk_kernels.py)
and the GEMMs they share (gemm.py); vocab parallel in vocab_parallel.py and shard*.py."""

from . import ops, rows_fake  # registers the custom ops and the C++ row ops' fake impls
from .api import DraftHeadOutput, draft_head

__all__ = ["DraftHeadOutput", "draft_head"]
