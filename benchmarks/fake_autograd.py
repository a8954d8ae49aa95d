"""``torch.autograd.backward`` run node by node from Python, for fake CUDA tensors.

Why: torch's autograd engine stashes the current stream of every CUDA device before it
runs a graph holding a CUDA tensor, and asks the CUDA hooks whether device 0 has a
primary context. On a machine without a driver that raises ("hasPrimaryContext expects
a valid device index") as soon as ``FakeTensorMode`` has installed its no-op CUDA device
guard, which claims one device (torch 2.14.1). So :func:`backward` walks the graph
itself, doing what the engine does that launches work on a GPU, so that a dispatch
mode sees the same aten ops:

- nodes run when every gradient they wait for has arrived, the highest sequence number
  first (the engine's order on one device);
- gradients arriving at one input of a node are summed (``InputBuffer::add``);
- a gradient whose dtype or shape differs from what the node's input expects is cast or
  summed to size first (``validate_outputs``);
- a custom ``autograd.Function`` (and so every ``torch.library.custom_op`` backward)
  gets zeros for gradients that never arrived, unless its ctx said
  ``set_materialize_grads(False)`` (then None); for an output
  the engine knows to be non-differentiable (its metadata is left default-constructed:
  shape [], float32, CPU) the engine fills a tensor of the output's shape, which is not
  visible from Python: here a 0-d tensor on the node's device stands in for it, so the
  launch is counted and its few bytes are not;
- a leaf's gradient is stored as ``.grad`` when it has none (a copy first if its strides
  break the layout contract: the leaf's strides, or contiguous for a leaf that is not
  dense) and added in place otherwise (``AccumulateGrad``).

Not done: tensor and node hooks, ``inputs=``, ``create_graph``; saved tensors are kept
until the graph itself is freed (the engine frees each node's as it runs), so memory
after a node is an upper bound. ``torch.autograd.grad`` is not supported.
"""

from __future__ import annotations

import heapq
import itertools
import weakref

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch.autograd.function import BackwardCFunction, FunctionCtx

# The ctx objects whose Function said set_materialize_grads(False): the flag itself is
# write-only from Python, so the setter is wrapped to remember it (for every Function
# created after this module is imported).
_NOT_MATERIALIZED: weakref.WeakSet = weakref.WeakSet()
_set_materialize_grads = FunctionCtx.set_materialize_grads


def _remembering_set_materialize_grads(self, value: bool) -> None:
    _set_materialize_grads(self, value)
    if value:
        _NOT_MATERIALIZED.discard(self)
    else:
        _NOT_MATERIALIZED.add(self)


FunctionCtx.set_materialize_grads = _remembering_set_materialize_grads


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def _default_constructed(metadata) -> bool:
    """The metadata autograd leaves for an output it does not differentiate."""
    return metadata.device.type == "cpu" and tuple(metadata.shape) == () and metadata.dtype == torch.float32


def _node_device(node) -> torch.device | None:
    for metadata in node._input_metadata:
        if metadata.device.type != "cpu":
            return metadata.device
    return None


def _materialized(node, grads: list) -> list:
    """The zeros a custom Function gets for gradients that never arrived."""
    device = _node_device(node)
    filled = []
    for grad, metadata in zip(grads, node._input_metadata):
        if grad is None:
            if _default_constructed(metadata) and device is not None:
                grad = torch.zeros((), device=device)
            else:
                grad = torch.zeros(tuple(metadata.shape), dtype=metadata.dtype, device=metadata.device)
        filled.append(grad)
    return filled


def _validated(grad: torch.Tensor, metadata) -> torch.Tensor:
    """What the engine makes of a gradient before handing it on: the expected shape, then dtype."""
    if tuple(grad.shape) != tuple(metadata.shape) and not _default_constructed(metadata):
        grad = grad.sum_to_size(tuple(metadata.shape))
    if grad.dtype != metadata.dtype and not _default_constructed(metadata):
        grad = grad.to(metadata.dtype)
    return grad


def _accumulate(node, grad: torch.Tensor | None) -> None:
    """AccumulateGrad: store the leaf's first gradient, add the later ones in place."""
    if grad is None:
        return
    variable = node.variable
    if variable.grad is None:
        # The layout contract: .grad is strided like its variable when that is dense, else
        # contiguous (the engine copies a gradient that breaks it).
        if is_non_overlapping_and_dense(variable):
            strides = variable.stride()
        else:
            strides = _contiguous_strides(variable.shape)
        if grad.stride() != strides:
            grad = torch.empty_strided(variable.shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)
        variable.grad = grad
    else:
        variable.grad.add_(grad)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _call(node, grads: list) -> tuple:
    if type(node).__name__ == "AccumulateGrad":
        _accumulate(node, grads[0])
        return ()
    if isinstance(node, BackwardCFunction):
        # ctx.set_materialize_grads(False): the Function takes None for what never arrived.
        return _as_tuple(node.apply(*(grads if node in _NOT_MATERIALIZED else _materialized(node, grads))))
    return _as_tuple(node(*grads))


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
             inputs=None) -> None:
    """``torch.autograd.backward``'s signature and effect (``.grad`` of the leaves), run
    from Python; see the module docstring for what differs."""
    if create_graph or inputs is not None:
        raise NotImplementedError("fake_autograd.backward: create_graph and inputs= are not supported")
    roots = _as_list(tensors)
    grads = _as_list(grad_tensors if grad_tensors is not None else grad_variables)
    grads += [None] * (len(roots) - len(grads))
    with torch.no_grad():
        seeds = []
        for tensor, grad in zip(roots, grads):
            if not tensor.requires_grad:
                raise RuntimeError("element of tensors does not require grad and does not have a grad_fn")
            if grad is None:
                if tensor.numel() != 1:
                    raise RuntimeError("grad can be implicitly created only for scalar outputs")
                grad = torch.ones_like(tensor, memory_format=torch.preserve_format)
            edge = torch.autograd.graph.get_gradient_edge(tensor)
            seeds.append((edge.node, edge.output_nr, grad))
        _run(seeds)


def _run(seeds: list) -> None:
    waiting: dict = {}  # node -> gradients still to arrive
    stack = [node for node, _, _ in seeds]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for following, _ in node.next_functions:
            if following is None:
                continue
            waiting[following] = waiting.get(following, 0) + 1
            if following not in seen:
                seen.add(following)
                stack.append(following)
    buffers: dict = {}
    for node, index, grad in seeds:
        _add(buffers, node, index, grad)
    order = itertools.count()
    ready = []
    for node in dict.fromkeys(node for node, _, _ in seeds):
        if not waiting.get(node):
            heapq.heappush(ready, (-node._sequence_nr(), next(order), node))
    while ready:
        _, _, node = heapq.heappop(ready)
        inputs = buffers.pop(node, None) or [None] * len(node._input_metadata)
        outputs = _call(node, inputs)
        del inputs
        for position, (following, index) in enumerate(node.next_functions):
            if following is None:
                continue
            grad = outputs[position] if position < len(outputs) else None
            if grad is not None:
                _add(buffers, following, index, _validated(grad, following._input_metadata[index]))
            waiting[following] -= 1
            if waiting[following] == 0:
                heapq.heappush(ready, (-following._sequence_nr(), next(order), following))
        del outputs


def _add(buffers: dict, node, index: int, grad: torch.Tensor) -> None:
    slots = buffers.setdefault(node, [None] * len(node._input_metadata))
    slots[index] = grad if slots[index] is None else slots[index] + grad
