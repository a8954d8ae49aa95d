"""A replacement forward compiled the way the upstream forward it replaces was.

speculators decorates ``DFlash2DraftModel.forward`` with ``conditional_torch_compile``
(``torch.compile`` whenever CUDA is available): a forward put in its place uncompiled
would run the whole training step (decoder layers, norms, losses) eager. So the fused
head's forward is wrapped by the very ``torch.compile`` context that wraps upstream's
(the same backend, mode, options, ``dynamic`` and ``fullgraph``; a
``torch.compiler.disable`` stays a disable), and left alone when upstream's is plain.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["compiled_like", "is_compiled", "uncompiled"]


def is_compiled(fn) -> bool:
    """Whether ``fn`` is a ``torch.compile`` (or ``torch.compiler.disable``) wrapper."""
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def uncompiled(fn):
    """The function under every ``torch.compile`` wrapper of ``fn`` (``fn`` itself if none)."""
    while is_compiled(fn):
        fn = fn._torchdynamo_orig_callable
    return fn


def _context_of(wrapper):
    """The dynamo context that made ``wrapper`` (it holds the backend and its options),
    read from the wrapper's closure; None where this torch keeps it elsewhere."""
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:
        return None
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


@functools.lru_cache(maxsize=None)  # one wrapper per upstream forward, shared by every model, as upstream's
def compiled_like(upstream: Callable, ours: Callable) -> Callable:
    """``ours`` compiled as ``upstream`` is: by upstream's own dynamo context when it is a
    ``torch.compile`` wrapper (``torch.compile(ours)`` with its defaults, as
    ``conditional_torch_compile`` applies it, where the context cannot be read), else
    ``ours`` unchanged."""
    if not is_compiled(upstream):
        return ours
    context = _context_of(upstream)
    return context(ours) if context is not None else torch.compile(ours)
