"""The custom ops under torch.library's checks and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels.conv import ops
from dflash2_kernels.conv.launch import KERNELS_INTERPRETED
from dflash2_kernels.conv.ops import grouped_dynamic_conv_backward_op, grouped_dynamic_conv_op

from .contract import assert_within_contract
from .triton_interpreter import SKIP_REASON as INTERPRETER_SKIP_REASON

HAS_CUDA = torch.cuda.is_available()
BACKENDS = [
    pytest.param("auto", "cpu", id="auto-cpu"),  # the C++ kernel when built, else the vectorized path
    pytest.param("vectorized", "cpu", id="vectorized"),
    pytest.param(
        "triton",
        "cuda" if HAS_CUDA else "cpu",
        id="triton",
        marks=pytest.mark.skipif(not HAS_CUDA and not KERNELS_INTERPRETED, reason=INTERPRETER_SKIP_REASON),
    ),
]


def _op_args(device, dtype=torch.float32, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 48, generator=g, dtype=dtype).to(device)
    projection = torch.randn(2, 12, 2, 2, 3, generator=g, dtype=dtype).to(device)
    delta = projection[..., 1, :, :]  # strided, as in the module
    base = torch.randn(2, 48, generator=g, dtype=dtype).to(device)
    for t in (x, delta, base):
        t.requires_grad_(requires_grad)
    return x, delta, base, 8, 16


def _select(backend, monkeypatch):
    if backend == "vectorized":
        monkeypatch.setattr(ops, "_cpu_kernel_available", lambda: False)
        backend = "auto"
    monkeypatch.setenv("DFLASH2_BACKEND", backend)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_opcheck_forward(backend, device, monkeypatch):
    _select(backend, monkeypatch)
    torch.library.opcheck(grouped_dynamic_conv_op, _op_args(device))
    torch.library.opcheck(grouped_dynamic_conv_op, _op_args(device, requires_grad=False))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_opcheck_backward(backend, device, monkeypatch):
    _select(backend, monkeypatch)
    x, delta, base, block_size, group_size = _op_args(device, requires_grad=False)
    dy = torch.randn_like(x)
    torch.library.opcheck(grouped_dynamic_conv_backward_op, (dy, x, delta, base, block_size, group_size))


class _ConvBlock(torch.nn.Module):
    """A sublayer sandwich as in a DFlash 2 decoder layer: prepare, an MLP, finish."""

    def __init__(self, hidden):
        super().__init__()
        self.conv = dk.GroupedDynamicCausalConv(hidden, block_size=8, kernel_size=2, group_size=16)
        self.mlp = torch.nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.conv.kernel_projection.weight.normal_(std=0.1)
            self.conv.base_kernel.normal_()

    def forward(self, h):
        prepared, kernels = self.conv.prepare(h)
        return h + self.conv.finish(torch.nn.functional.gelu(self.mlp(prepared)), kernels)


@pytest.mark.compiles
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_forward_and_backward(compile_backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ConvBlock(32)
    h = torch.randn(2, 16, 32)

    def run(module, inputs):
        inputs = inputs.detach().requires_grad_()
        out = module(inputs)
        out.square().sum().backward()
        return [out.detach()] + [p.grad for p in module.parameters()] + [inputs.grad]

    exact = run(copy.deepcopy(model).double(), h.double())
    expected = run(copy.deepcopy(model), h)
    got = run(torch.compile(model, fullgraph=True, backend=compile_backend), h)
    # Inductor fuses the surrounding Linear/GELU differently from eager (its own erf, other
    # sums): judged as SPEC section 4 judges a kernel, eager fp32 being the reference.
    names = ["out"] + [f"grad {name}" for name, _ in model.named_parameters()] + ["grad h"]
    for name, a, b, c in zip(names, got, expected, exact):
        assert_within_contract(name, a, b, c)


def _public_conv_with_grads(x, delta, base, block_size, group_size, dy):
    leaves = [t.detach().requires_grad_() for t in (x, delta, base)]
    out = dk.grouped_dynamic_conv(*leaves, block_size=block_size, group_size=group_size)
    return (out.detach(), *torch.autograd.grad(out, leaves, dy))


EAGER_ROUTES = [
    pytest.param("auto", "cpu", "cpu", id="cpu-kernels",
                 marks=pytest.mark.skipif(not ops._cpu_kernel_available(), reason="the C++ CPU kernels are not built")),
    pytest.param("triton", "cuda" if HAS_CUDA else "cpu", "triton", id="triton",
                 marks=pytest.mark.skipif(not HAS_CUDA and not KERNELS_INTERPRETED, reason=INTERPRETER_SKIP_REASON)),
]


@pytest.mark.parametrize("backend,device,kernels", EAGER_ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_eager_path_equals_the_custom_op(backend, device, kernels, dtype, monkeypatch):
    """In eager mode the public function skips the custom op's dispatch (ops._EagerConv,
    on the C++ CPU kernels or the Triton launchers); under a dispatch mode it takes the
    custom op. Both must give the same bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _select(backend, monkeypatch)

    class SeenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    x, delta, base, block_size, group_size = _op_args(device, dtype, requires_grad=False)
    # speculators' form: a base wider than the activations, rounded inside the kernels
    base = base.float()
    dy = torch.randn(x.shape, dtype=dtype).to(device)
    assert ops._eager_kernels(x, delta, base) == kernels
    eager = _public_conv_with_grads(x, delta, base, block_size, group_size, dy)
    with SeenOps() as seen:
        through_op = _public_conv_with_grads(x, delta, base, block_size, group_size, dy)
    assert {"dflash2::grouped_dynamic_conv", "dflash2::grouped_dynamic_conv_backward"} <= seen.names
    for a, b in zip(eager, through_op):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # With nothing to differentiate the eager path calls the kernel alone: the same bits,
    # and a result outside autograd.
    with torch.no_grad():
        no_grad = dk.grouped_dynamic_conv(x, delta, base, block_size=block_size, group_size=group_size)
    plain = dk.grouped_dynamic_conv(x, delta, base, block_size=block_size, group_size=group_size)
    for out in (no_grad, plain):
        assert out.grad_fn is None and not out.requires_grad and torch.equal(out, eager[0])


@pytest.mark.parametrize("route", ["public", "custom op"])
def test_double_backward_raises(route):
    """No second derivative is registered: asking for one raises on either route, never
    a silent None or zero."""
    x, delta, base, block_size, group_size = _op_args("cpu")
    if route == "public":
        out = dk.grouped_dynamic_conv(x, delta, base, block_size=block_size, group_size=group_size)
    else:
        out = grouped_dynamic_conv_op(x, delta, base, block_size, group_size)
    (dx,) = torch.autograd.grad(out.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        torch.autograd.grad(dx.sum(), [x, delta], allow_unused=True)
