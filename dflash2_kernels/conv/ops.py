"""The grouped dynamic conv as ``torch.library`` ops: the one place defining it.

``dflash2::grouped_dynamic_conv`` and its backward carry autograd, have a fake impl
(shapes, dtypes, the argument checks), and pick an implementation per call: Triton for
CUDA tensors (or anywhere when ``DFLASH2_BACKEND=triton``); for CPU tensors the C++
kernels (``torch.ops.dflash2.conv_forward_cpu`` / ``conv_backward_cpu``,
csrc/conv_cpu.cpp) when the extension is built; the vectorized PyTorch path otherwise.

On torch >= 2.6 (with Triton installed) they are ``torch.library.triton_op``s:
torch.compile traces into their bodies, so its graph holds each Triton launch as a
``triton_kernel_wrapper_functional`` node (``KernelLaunch.run`` wraps the kernel with
``wrap_triton`` when its tensors are being traced) and the CPU kernels as the ops they
are, and ``mode="reduce-overhead"`` captures the launches in CUDA graphs; calls whose
body cannot be traced (the Triton interpreter's kernels, the vectorized path) stay one
op in the graph. On torch 2.5 they are ``custom_op``s from the same bodies, opaque to
compile.
"""

from __future__ import annotations

import functools

import torch

from .. import _fake_checks as fake_checks
from .. import reference
from .._backend import selected_backend, triton_importable
from .._eager import plain_eager
from .._extension import EXTENSION_LOADED, has_kernel
from .vectorized import conv_backward_vectorized, conv_forward_vectorized

__all__ = ["grouped_dynamic_conv"]


def _flatten(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., H], [..., K, G], [K, H] -> [N, H], [N, K, G], [K, H], unit last stride.

    Leading dims collapse as views whenever strides allow (a side of the projection's
    ``[..., 2, K, G]`` view does), so delta and row-strided x are not copied.
    """
    hidden_size = x.shape[-1]
    kernel_size, num_groups = delta.shape[-2], delta.shape[-1]
    # Already 2-D / 3-D (the common call): no reshape, each a dispatcher call of ~2 us.
    x2 = x if x.dim() == 2 else x.reshape(-1, hidden_size)
    d3 = delta if delta.dim() == 3 else delta.reshape(-1, kernel_size, num_groups)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if d3.stride(-1) != 1:
        d3 = d3.contiguous()
    if base.stride(-1) != 1:
        base = base.contiguous()
    return x2, d3, base


def _flatten_backward(
    grad_out: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_flatten's three, and grad_out as [N, H] with unit last stride, first."""
    x2, d3, base2 = _flatten(x, delta, base)
    dy = grad_out.reshape(x2.shape)
    return (dy if dy.stride(-1) == 1 else dy.contiguous()), x2, d3, base2


def _use_triton(x: torch.Tensor) -> bool:
    backend = selected_backend()
    if backend == "triton":
        if not triton_importable():
            raise RuntimeError("DFLASH2_BACKEND=triton, but triton cannot be imported.")
        from .launch import KERNELS_INTERPRETED

        if not x.is_cuda and not KERNELS_INTERPRETED:
            raise RuntimeError(
                f"DFLASH2_BACKEND=triton got {x.device.type} tensors: Triton runs CUDA tensors, "
                "or CPU tensors when TRITON_INTERPRET=1 is set before dflash2_kernels is imported."
            )
        return True
    return x.is_cuda and triton_importable()


@functools.lru_cache(maxsize=None)  # a dispatcher lookup costs ~20 us, a serving-size call ~250 us
def _cpu_kernel_available() -> bool:
    """Whether the C++ CPU kernels are built (the tests switch them off to run the fallback)."""
    return has_kernel("conv_forward_cpu", "cpu")


# torch 2.6 added triton_op; without Triton there are no kernels to trace (and triton_op
# would warn at import that it cannot look for them).
TRACEABLE = hasattr(torch.library, "triton_op") and triton_importable()


def _define_op(name: str):
    """The decorator making a Python body the op ``name`` (functional: nothing mutated):
    a ``triton_op`` where TRACEABLE, else a ``custom_op``. The fake impl each op
    registers below replaces the body triton_op would use as one, so both torches check
    arguments and give shapes alike, and fake CUDA tensors need no device properties."""
    if not TRACEABLE:
        return torch.library.custom_op(name, mutates_args=())

    def define(body):
        op = torch.library.triton_op(name, mutates_args=())(body)
        _keep_untraceable_calls_opaque(op, body)
        return op

    return define


def _keep_untraceable_calls_opaque(op, body) -> None:
    """A traced call whose body would run code no graph can hold stays the op itself in
    the graph (as a custom_op does), run when the graph runs: see :func:`_untraceable`.
    Every other traced call decomposes into the body as triton_op has it (its
    FunctionalTensorMode rule, which AOTAutograd's functionalization calls)."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    # triton_op's own rule (it also keeps the op whole for torch.export), where torch
    # keeps it; otherwise what that rule does for torch.compile: the body under the mode.
    decompose = getattr(op, "_torch_dispatch_fns", {}).get(FunctionalTensorMode)
    if decompose is None:
        def decompose(mode, func, types, args, kwargs):
            with mode:
                return body(*args, **kwargs)

    def functional(mode, func, types, args, kwargs):
        if _untraceable(args[0]):  # x, or the backward's grad_out (on x's device)
            return mode.__torch_dispatch__(func, types, args, kwargs)
        return decompose(mode, func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, functional)


def _untraceable(x: torch.Tensor) -> bool:
    """Whether a call on x's device runs code that a traced graph cannot hold: the Triton
    interpreter's kernels (TRITON_INTERPRET=1: interpreter objects, which ``wrap_triton``
    refuses) or the vectorized path (it compares data pointers, and loops over chunks
    sized by the data). The compiled Triton kernels and the C++ CPU op trace."""
    if _use_triton(x):
        from .launch import KERNELS_INTERPRETED

        return KERNELS_INTERPRETED
    return not (x.device.type == "cpu" and _cpu_kernel_available())


if EXTENSION_LOADED:
    # Shapes of the raw C++ ops, so that they trace on their own too (opcheck, compile).
    @torch.library.register_fake("dflash2::conv_forward_cpu")
    def _(x, delta, base, block_size, out_dtype):
        op = "conv_forward_cpu"
        fake_checks.one_device(op, x=x, delta=delta, base=base)
        for name, dtype in (("x", x.dtype), ("delta", delta.dtype), ("base", base.dtype), ("out_dtype", out_dtype)):
            fake_checks.float_dtype(op, name, dtype)
        return x.new_empty(x.shape, dtype=out_dtype)

    @torch.library.register_fake("dflash2::conv_backward_cpu")
    def _(grad_out, x, delta, base, block_size):
        op = "conv_backward_cpu"
        fake_checks.one_device(op, grad_out=grad_out, x=x, delta=delta, base=base)
        for name, tensor in (("grad_out", grad_out), ("x", x), ("delta", delta), ("base", base)):
            fake_checks.float_dtype(op, name, tensor.dtype)
        return x.new_empty(x.shape), delta.new_empty(delta.shape), base.new_empty(base.shape)


@_define_op("dflash2::grouped_dynamic_conv")
def grouped_dynamic_conv_op(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """x [..., H], delta [..., K, H/gs], base [K, H] -> [..., H] promote(x, delta)."""
    reference.check_grouped_dynamic_conv_args(x, delta, base, block_size, group_size)
    out_dtype = torch.promote_types(x.dtype, delta.dtype)
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=out_dtype)
    x2, d3, base = _flatten(x, delta, base)
    if _use_triton(x2):
        from .launch import conv_forward_triton

        out = conv_forward_triton(x2, d3, base, block_size, out_dtype)
    elif x2.device.type == "cpu" and _cpu_kernel_available():
        out = torch.ops.dflash2.conv_forward_cpu(x2, d3, base, block_size, out_dtype)
    else:
        out = conv_forward_vectorized(x2, d3, base, block_size, out_dtype)
    return out.view(x.shape)


@grouped_dynamic_conv_op.register_fake
def _(x, delta, base, block_size, group_size):
    reference.check_grouped_dynamic_conv_args(x, delta, base, block_size, group_size)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, delta.dtype))


def _check_backward_args(grad_out, x, delta, base, block_size, group_size) -> None:
    """The forward's checks, then grad_out: a float tensor of x's shape on x's device."""
    reference.check_grouped_dynamic_conv_args(x, delta, base, block_size, group_size)
    reference.require_float_tensor("grad_out", grad_out)
    if grad_out.shape != x.shape:
        raise ValueError(f"grad_out must have x's shape {tuple(x.shape)}, got {tuple(grad_out.shape)}.")
    if grad_out.device != x.device:
        raise ValueError(f"grad_out must be on x's device {x.device}, got {grad_out.device}.")


@_define_op("dflash2::grouped_dynamic_conv_backward")
def grouped_dynamic_conv_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block_size: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx like x, ddelta [..., K, G] in delta's dtype, dbase [K, H] in base's dtype)."""
    _check_backward_args(grad_out, x, delta, base, block_size, group_size)
    if x.numel() == 0:
        return (
            torch.zeros(x.shape, dtype=x.dtype, device=x.device),
            torch.zeros(delta.shape, dtype=delta.dtype, device=x.device),
            torch.zeros(base.shape, dtype=base.dtype, device=x.device),
        )
    dy, x2, d3, base2 = _flatten_backward(grad_out, x, delta, base)
    if _use_triton(x2):
        from .launch import conv_backward_triton

        dx, ddelta, dbase = conv_backward_triton(dy, x2, d3, base2, block_size)
    elif x2.device.type == "cpu" and _cpu_kernel_available():
        dx, ddelta, dbase = torch.ops.dflash2.conv_backward_cpu(dy, x2, d3, base2, block_size)
    else:
        dx, ddelta, dbase = conv_backward_vectorized(dy, x2, d3, base2, block_size)
    return dx.view(x.shape), ddelta.view(delta.shape), dbase


@grouped_dynamic_conv_backward_op.register_fake
def _(grad_out, x, delta, base, block_size, group_size):
    _check_backward_args(grad_out, x, delta, base, block_size, group_size)
    return (
        x.new_empty(x.shape),
        delta.new_empty(delta.shape),
        base.new_empty(base.shape),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, delta, base, block_size, group_size = inputs
    ctx.save_for_backward(x, delta, base)
    ctx.block_size = block_size
    ctx.group_size = group_size


def _backward(ctx, grad_out):
    x, delta, base = ctx.saved_tensors
    dx, ddelta, dbase = grouped_dynamic_conv_backward_op(
        grad_out, x, delta, base, ctx.block_size, ctx.group_size
    )
    return dx, ddelta, dbase, None, None


grouped_dynamic_conv_op.register_autograd(_backward, setup_context=_setup_context)


# --- The eager path -------------------------------------------------------------------
#
# In eager mode on plain tensors the public function calls the kernels (the C++ CPU ones,
# or the Triton launchers on CUDA) through this autograd.Function instead of the custom
# op: the custom op's Python dispatch (its autograd kernel, its device kernel, the checks
# again) cost ~50 us a call against ~7 us for the CPU kernel itself at a serving-size
# 64 x 256 conv, and 4 us for the GPU kernel at 256 x 5120. Anything that observes or
# transforms ops (a dispatch mode such as FakeTensorMode or an op counter, functorch
# transforms, torch.compile, tensor subclasses) still sees the custom op.

_CPU, _TRITON = "cpu", "triton"


def _eager_kernels(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> str | None:
    """Which kernels an eager call on these (checked) tensors runs directly: "cpu",
    "triton", or None for the custom op."""
    if not plain_eager(x, delta, base) or x.numel() == 0:
        return None
    if _use_triton(x):
        return _TRITON
    return _CPU if x.device.type == "cpu" and _cpu_kernel_available() else None


def _kernel_forward(kernels: str, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """The forward on checked operands (x non-empty), shaped as x."""
    x2, d3, base2 = _flatten(x, delta, base)
    out_dtype = torch.promote_types(x.dtype, delta.dtype)
    if kernels == _TRITON:
        from .launch import conv_forward_triton

        out = conv_forward_triton(x2, d3, base2, block_size, out_dtype)
    else:
        out = torch.ops.dflash2.conv_forward_cpu.default(x2, d3, base2, block_size, out_dtype)
    return out if x.dim() == 2 else out.view(x.shape)


def _kernel_backward(kernels: str, grad_out: torch.Tensor, x: torch.Tensor, delta: torch.Tensor,
                     base: torch.Tensor, block_size: int):
    """(dx, ddelta, dbase) on checked operands (x non-empty), shaped as x, delta, base."""
    flat = _flatten_backward(grad_out, x, delta, base)
    if kernels == _TRITON:
        from .launch import conv_backward_triton

        dx, ddelta, dbase = conv_backward_triton(*flat, block_size)
    else:
        dx, ddelta, dbase = torch.ops.dflash2.conv_backward_cpu.default(*flat, block_size)
    return dx.view(x.shape), ddelta.view(delta.shape), dbase


class _EagerConv(torch.autograd.Function):
    """The conv on the kernels directly: arguments already checked, x non-empty. The
    classic ``forward(ctx, ...)`` form: ~5 us a call, where a separate setup_context
    costs ~17 us (functorch transforms, which need that form, take the custom op)."""

    @staticmethod
    def forward(ctx, x, delta, base, block_size, group_size, kernels):
        ctx.save_for_backward(x, delta, base)
        ctx.block_size, ctx.group_size, ctx.kernels = block_size, group_size, kernels
        return _kernel_forward(kernels, x, delta, base, block_size)

    @staticmethod
    def backward(ctx, grad_out):
        x, delta, base = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the backward custom op, whose own backward raises (as on
            # the custom op's path), where the raw kernels' results would silently not be
            # differentiable.
            grads = grouped_dynamic_conv_backward_op(grad_out, x, delta, base, ctx.block_size, ctx.group_size)
        else:
            grads = _kernel_backward(ctx.kernels, grad_out, x, delta, base, ctx.block_size)
        return (*grads, None, None, None)


def grouped_dynamic_conv(
    hidden_states: torch.Tensor,
    delta_kernel: torch.Tensor,
    base_kernel: torch.Tensor,
    *,
    block_size: int,
    group_size: int,
) -> torch.Tensor:
    """Drop-in for speculators' ``grouped_dynamic_conv`` (SPEC section 1).

    hidden_states: [..., H] float; delta_kernel: [..., K, H // group_size] float, any
    strides (typically one side of ``kernel_projection(h).view(..., 2, K, G)``);
    base_kernel: [K, H] float. Returns [..., H] in
    ``promote_types(hidden_states.dtype, delta_kernel.dtype)``; gradients flow to all
    three tensors. Raises speculators' ValueErrors for bad shapes.
    """
    if selected_backend() == "reference":
        return reference.grouped_dynamic_conv(
            hidden_states, delta_kernel, base_kernel, block_size=block_size, group_size=group_size
        )
    # Checked here too, so a float block_size gets this message, not the schema's cast error.
    reference.check_grouped_dynamic_conv_args(
        hidden_states, delta_kernel, base_kernel, block_size, group_size
    )
    kernels = _eager_kernels(hidden_states, delta_kernel, base_kernel)
    if kernels is not None:
        if torch.is_grad_enabled() and (
            hidden_states.requires_grad or delta_kernel.requires_grad or base_kernel.requires_grad
        ):
            return _EagerConv.apply(hidden_states, delta_kernel, base_kernel, block_size, group_size, kernels)
        # Nothing to differentiate: the kernel alone (autograd.Function adds 3-10 us a call).
        return _kernel_forward(kernels, hidden_states, delta_kernel, base_kernel, block_size)
    return grouped_dynamic_conv_op(hidden_states, delta_kernel, base_kernel, block_size, group_size)
