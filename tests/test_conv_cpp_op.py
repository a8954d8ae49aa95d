"""The raw C++ CPU ops (csrc/conv_cpu.cpp): torch.library's checks, argument errors,
edge layouts and thread-count independence.

Their numerics are judged against float64 through the public function, in
test_conv_numerics.py (the "cpp" path). These ops carry no autograd of their own
(``dflash2::grouped_dynamic_conv`` does), so they are called on tensors without grad.
"""

from __future__ import annotations

import re

import pytest
import torch

from dflash2_kernels._extension import EXTENSION_ERROR, has_kernel
from dflash2_kernels.conv import ops  # noqa: F401  (registers the raw ops' fake impls)

pytestmark = pytest.mark.skipif(
    not has_kernel("conv_forward_cpu", "cpu"),
    reason=f"the C++ extension lacks the conv's CPU kernel (import error: {EXTENSION_ERROR})",
)

F32 = (torch.float32, torch.float32, torch.float32)
AUTOCAST = (torch.float32, torch.bfloat16, torch.float32)

# (rows, hidden, group size, taps, block size, (x, delta, base) dtypes, strided delta, row-strided x)
OPCHECK_CASES = [
    pytest.param(16, 32, 16, 2, 8, F32, False, False, id="f32"),
    pytest.param(13, 48, 16, 2, 8, F32, True, False, id="f32-strided-delta"),
    pytest.param(19, 48, 8, 3, 4, F32, True, True, id="f32-K3-row-strided-x"),
    pytest.param(24, 64, 16, 2, 8, AUTOCAST, True, False, id="f32x-bf16delta"),
    pytest.param(11, 32, 16, 2, 8, (torch.bfloat16,) * 3, False, False, id="bf16"),
    pytest.param(9, 24, 8, 2, 4, (torch.float64,) * 3, False, False, id="f64"),
]


def _raw_inputs(rows, hidden, group_size, taps, dtypes, strided_delta, row_strided_x, seed=0):
    """x [N, H], delta [N, K, G], base [K, H], grad_out [N, H] as the op receives them."""
    g = torch.Generator().manual_seed(seed)
    x_dtype, delta_dtype, base_dtype = dtypes
    groups = hidden // group_size
    x = torch.randn(rows, hidden + (8 if row_strided_x else 0), generator=g).to(x_dtype)[:, :hidden]
    if strided_delta:
        delta = torch.randn(rows, 2, taps, groups, generator=g).to(delta_dtype)[:, 1]
    else:
        delta = torch.randn(rows, taps, groups, generator=g).to(delta_dtype)
    base = torch.randn(taps, hidden, generator=g).to(base_dtype)
    grad_out = torch.randn(rows, hidden, generator=g).to(torch.promote_types(x_dtype, delta_dtype))
    return x, delta, base, grad_out


@pytest.mark.parametrize("rows,hidden,group_size,taps,block_size,dtypes,strided_delta,row_strided_x", OPCHECK_CASES)
def test_opcheck_conv_forward_cpu(rows, hidden, group_size, taps, block_size, dtypes, strided_delta, row_strided_x):
    x, delta, base, grad_out = _raw_inputs(rows, hidden, group_size, taps, dtypes, strided_delta, row_strided_x)
    torch.library.opcheck(torch.ops.dflash2.conv_forward_cpu.default, (x, delta, base, block_size, grad_out.dtype))


@pytest.mark.parametrize("rows,hidden,group_size,taps,block_size,dtypes,strided_delta,row_strided_x", OPCHECK_CASES)
def test_opcheck_conv_backward_cpu(rows, hidden, group_size, taps, block_size, dtypes, strided_delta, row_strided_x):
    x, delta, base, grad_out = _raw_inputs(rows, hidden, group_size, taps, dtypes, strided_delta, row_strided_x)
    torch.library.opcheck(torch.ops.dflash2.conv_backward_cpu.default, (grad_out, x, delta, base, block_size))


def test_backward_reads_an_expanded_grad_out():
    """grad_out with row stride 0 (one row expanded) gives what its contiguous copy gives."""
    x, delta, base, _ = _raw_inputs(40, 32, 16, 2, F32, True, False)
    grad_row = torch.randn(1, 32, generator=torch.Generator().manual_seed(1))
    expanded = grad_row.expand(40, 32)
    assert expanded.stride() == (0, 1)
    got = torch.ops.dflash2.conv_backward_cpu(expanded, x, delta, base, 8)
    expected = torch.ops.dflash2.conv_backward_cpu(expanded.contiguous(), x, delta, base, 8)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_zero_rows():
    """N == 0: an empty output; empty dx and ddelta; dbase all zero."""
    x, delta, base, grad_out = _raw_inputs(0, 32, 16, 2, AUTOCAST, True, False)
    out = torch.ops.dflash2.conv_forward_cpu(x, delta, base, 8, torch.float32)
    dx, ddelta, dbase = torch.ops.dflash2.conv_backward_cpu(grad_out, x, delta, base, 8)
    assert out.shape == (0, 32) and dx.shape == (0, 32) and ddelta.shape == (0, 2, 2)
    assert dbase.dtype == base.dtype and torch.equal(dbase, torch.zeros(2, 32))


def test_backward_is_independent_of_the_thread_count():
    """dbase sums fixed 64-row chunks in chunk order, whatever the threads: bitwise equal."""
    x, delta, base, grad_out = _raw_inputs(1000, 64, 16, 2, F32, True, False, seed=2)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(torch.ops.dflash2.conv_backward_cpu(grad_out, x, delta, base, 8))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def _bad(**change):
    """Valid forward arguments (x [8, 32], delta [8, 2, 2], base [2, 32]) with some replaced."""
    args = dict(x=torch.randn(8, 32), delta=torch.randn(8, 2, 2), base=torch.randn(2, 32), block_size=4)
    args.update(change)
    return args


# (arguments changed, the start of the message, which names the argument)
FORWARD_ERRORS = [
    pytest.param(_bad(delta=torch.randn(7, 2, 2)), "delta must have shape [8, K, G]", id="delta-rows"),
    pytest.param(_bad(delta=torch.randn(8, 2, 3)), "delta's group count (dimension 2) must divide", id="delta-groups"),
    pytest.param(_bad(delta=torch.randn(8, 4)), "delta must have 3 dimensions", id="delta-dims"),
    pytest.param(_bad(delta=torch.randn(8, 0, 2)), "delta must have at least one tap", id="delta-no-taps"),
    pytest.param(_bad(delta=torch.randn(8, 2, 2, 2)[..., 0]), "delta must have a unit last stride", id="delta-stride"),
    pytest.param(_bad(base=torch.randn(3, 32)), "base must have shape [2, 32]", id="base-shape"),
    pytest.param(_bad(x=torch.randn(8, 32, 2)[..., 0]), "x must have a unit last stride", id="x-stride"),
    pytest.param(_bad(x=torch.ones(8, 32, dtype=torch.int32)), "x must be float16, bfloat16, float32 or float64", id="x-dtype"),
    pytest.param(_bad(block_size=0), "block_size must be >= 1", id="block-size"),
]


@pytest.mark.parametrize("args,message", FORWARD_ERRORS)
def test_forward_rejects_bad_arguments(args, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.dflash2.conv_forward_cpu(args["x"], args["delta"], args["base"], args["block_size"], torch.float32)


@pytest.mark.parametrize("args,message", FORWARD_ERRORS)
def test_backward_rejects_bad_arguments(args, message):
    grad_out = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.dflash2.conv_backward_cpu(grad_out, args["x"], args["delta"], args["base"], args["block_size"])


def test_rejects_a_bad_out_dtype_or_grad_out():
    args = _bad()
    with pytest.raises(RuntimeError, match=re.escape("out_dtype must be float16, bfloat16, float32 or float64")):
        torch.ops.dflash2.conv_forward_cpu(args["x"], args["delta"], args["base"], 4, torch.int64)
    with pytest.raises(RuntimeError, match=re.escape("grad_out must have x's shape [8, 32]")):
        torch.ops.dflash2.conv_backward_cpu(torch.randn(8, 16), args["x"], args["delta"], args["base"], 4)
