"""GPU-only behaviour of the conv: real shapes, CUDA graphs, streams, int64 offsets."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from .contract import assert_within_contract
from .conv_cases import AUTOCAST, BF16, F32, ConvCase, conv_with_grads, exact_conv_with_grads, make_inputs

pytestmark = pytest.mark.gpu

REAL_CASES = [
    ConvCase((1, 4096), 5120, 16, 2, 8, BF16, strided_delta=True),
    ConvCase((2, 4096), 4096, 16, 2, 8, AUTOCAST, strided_delta=True),
    ConvCase((32, 8), 5120, 16, 2, 8, BF16, strided_delta=True),  # serving: 32 requests x block 8
    ConvCase((1, 4099), 6656, 16, 2, 16, F32, x_row_stride=True),
]


@pytest.mark.parametrize("case", REAL_CASES, ids=lambda c: c.id)
def test_real_shapes_within_contract(case, poison_empty):
    x, delta, base, dy = make_inputs(case, "cuda")
    exact = exact_conv_with_grads(x, delta, base, dy, case)
    expected = conv_with_grads(reference.grouped_dynamic_conv, x, delta, base, dy, case)
    got = conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, case)
    for name, kernel, ref, ex in zip(("out", "dx", "ddelta", "dbase"), got, expected, exact):
        assert_within_contract(f"{case.id} {name}", kernel, ref, ex)


def test_backward_is_bitwise_deterministic_at_training_shape():
    case = REAL_CASES[0]
    x, delta, base, dy = make_inputs(case, "cuda", seed=7)
    first = conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, case)
    second = conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, case)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_forward_replays_under_cuda_graph():
    case = REAL_CASES[2]
    x, delta, base, _ = make_inputs(case, "cuda")
    kwargs = dict(block_size=case.block_size, group_size=case.group_size)
    dk.grouped_dynamic_conv(x, delta, base, **kwargs)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dk.grouped_dynamic_conv(x, delta, base, **kwargs)
    fresh_x, fresh_delta, _, _ = make_inputs(case, "cuda", seed=11)
    x.copy_(fresh_x)
    delta.copy_(fresh_delta)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, dk.grouped_dynamic_conv(x, delta, base, **kwargs), rtol=0, atol=0)


def test_runs_on_the_current_stream():
    case = REAL_CASES[1]
    x, delta, base, dy = make_inputs(case, "cuda")
    expected = conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = conv_with_grads(dk.grouped_dynamic_conv, x, delta, base, dy, case)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.compiles
def test_fullgraph_compile_on_cuda():
    torch._dynamo.reset()
    module = dk.GroupedDynamicCausalConv(256, block_size=8, kernel_size=2, group_size=16).cuda()
    with torch.no_grad():
        module.kernel_projection.weight.normal_(std=0.05)
    h = torch.randn(4, 64, 256, device="cuda", requires_grad=True)

    def step(hidden):
        prepared, kernels = module.prepare(hidden)
        return module.finish(prepared.sin(), kernels)

    expected = step(h)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(h)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert module.base_kernel.grad is not None


def test_rows_beyond_int32_element_offsets():
    """N x H > 2**31 elements: offsets must be int64 all the way."""
    hidden, group_size, block = 5120, 16, 8
    rows = (2**31 // hidden + 64) // block * block
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    delta = torch.randn(rows, 2, hidden // group_size, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(2, hidden, device="cuda", dtype=torch.bfloat16)
    out = dk.grouped_dynamic_conv(x, delta, base, block_size=block, group_size=group_size)
    tail = slice(rows - 4 * block, rows)  # block-aligned, so positions agree
    expected = reference.grouped_dynamic_conv(
        x[tail].double(), delta[tail].double(), base.double(), block_size=block, group_size=group_size
    )
    torch.testing.assert_close(out[tail].double(), expected, rtol=2e-2, atol=2e-2)

    dy = torch.randn_like(x)
    x.requires_grad_()
    delta.requires_grad_()
    dx, ddelta = torch.autograd.grad(
        dk.grouped_dynamic_conv(x, delta, base, block_size=block, group_size=group_size), (x, delta), dy
    )
    x_tail = x[tail].detach().double().requires_grad_()
    d_tail = delta[tail].detach().double().requires_grad_()
    ref_dx, ref_ddelta = torch.autograd.grad(
        reference.grouped_dynamic_conv(x_tail, d_tail, base.double(), block_size=block, group_size=group_size),
        (x_tail, d_tail),
        dy[tail].double(),
    )
    torch.testing.assert_close(dx[tail].double(), ref_dx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ddelta[tail].double(), ref_ddelta, rtol=2e-2, atol=5e-2)
