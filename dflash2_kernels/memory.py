"""The CPU result cache of the C++ ops (csrc/cpu_result_cache.h).

CPU results and kernel temporaries of 64 KiB and up (the selector's dense ``[N, V]``
unary gradient and its ``[V, r]`` codebook gradients, the conv's outputs, the selector
backward's ``[N, r]`` buffers, the draft head's per-chunk ``[R, V]`` planes through
``torch.ops.dflash2.cpu_cached_empty``) are placed in memory kept from earlier calls once their
tensors are freed, instead of fresh pages that fault in on first write: a training
step allocates the same ones every step. ``DFLASH2_CPU_CACHE_MB`` (read on every
call; default 1024, ``0`` keeps nothing) bounds what is kept. Like
``torch.cuda.empty_cache``, :func:`empty_cpu_cache` hands the kept memory back to the
system; memory of live tensors is never kept or reused.
"""

from __future__ import annotations

import sys

from . import _extension


def _module():
    return sys.modules.get(f"{__package__}._C") if _extension.EXTENSION_LOADED else None


def cpu_cache_bytes() -> int:
    """Bytes of freed CPU results kept for reuse now (0 without the compiled extension)."""
    module = _module()
    return module.cpu_cache_bytes() if module is not None else 0


def empty_cpu_cache() -> None:
    """Unmap every kept block of the CPU result cache (a no-op without the extension)."""
    module = _module()
    if module is not None:
        module.empty_cpu_cache()
