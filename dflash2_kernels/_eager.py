"""When an eager call may skip a custom op's Python dispatch and call its kernels directly."""

from __future__ import annotations

import torch

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_eager(*tensors: torch.Tensor) -> bool:
    """True in plain eager mode on plain tensors: no torch.compile trace, tensor subclass,
    dispatch mode (FakeTensorMode, an op counter) or functorch transform, each of which
    must see the custom op instead."""
    # is_compiling first: Dynamo folds it to True and traces none of the rest.
    return (
        not torch.compiler.is_compiling()
        and all(type(t) in _PLAIN_TENSORS for t in tensors)
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
    )
