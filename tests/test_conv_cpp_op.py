"""The raw C++ CPU ops (csrc/conv_cpu.cpp): torch.library's checks, argument errors,
edge layouts, thread-count independence, and the backward's reductions (ddelta, dbase)
against float64 where plain float sums lose accuracy.

Their numerics over the case table are judged against float64 through the public
function, in test_conv_numerics.py (the "cpp" path). These ops carry no autograd of their own
(``dflash2::grouped_dynamic_conv`` does), so they are called on tensors without grad.
"""

from __future__ import annotations

import re

import pytest
import torch

from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_ERROR, has_kernel
from dflash2_kernels.conv import ops  # noqa: F401  (registers the raw ops' fake impls)

from .contract import assert_within_contract
from .conv_cases import ConvCase, conv_with_grads, exact_conv_with_grads

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


# (arguments changed, the exception, the start of the message, which names the argument)
FORWARD_ERRORS = [
    pytest.param(_bad(delta=torch.randn(7, 2, 2)), ValueError, "delta must have shape [8, K, G]", id="delta-rows"),
    pytest.param(_bad(delta=torch.randn(8, 2, 3)), ValueError, "delta's group count (dimension 2) must divide",
                 id="delta-groups"),
    pytest.param(_bad(delta=torch.randn(8, 4)), ValueError, "delta must have 3 dimensions", id="delta-dims"),
    pytest.param(_bad(delta=torch.randn(8, 0, 2)), ValueError, "delta must have at least one tap", id="delta-no-taps"),
    pytest.param(_bad(delta=torch.randn(8, 2, 2, 2)[..., 0]), ValueError, "delta must have a unit last stride",
                 id="delta-stride"),
    pytest.param(_bad(delta=torch.ones(8, 2, 2, dtype=torch.int8)), TypeError,
                 "delta must be float16, bfloat16, float32 or float64", id="delta-dtype"),
    pytest.param(_bad(base=torch.randn(3, 32)), ValueError, "base must have shape [2, 32]", id="base-shape"),
    pytest.param(_bad(base=torch.randn(2, 32, dtype=torch.complex64)), TypeError,
                 "base must be float16, bfloat16, float32 or float64", id="base-dtype"),
    pytest.param(_bad(x=torch.randn(8, 32, 2)[..., 0]), ValueError, "x must have a unit last stride", id="x-stride"),
    pytest.param(_bad(x=torch.randn(8, 32, 2)), ValueError, "x must have 2 dimensions", id="x-dims"),
    pytest.param(_bad(x=torch.ones(8, 32, dtype=torch.int32)), TypeError,
                 "x must be float16, bfloat16, float32 or float64", id="x-dtype"),
    pytest.param(_bad(x=torch.ones(8, 32, dtype=torch.bool)), TypeError,
                 "x must be float16, bfloat16, float32 or float64", id="x-bool"),
    pytest.param(_bad(block_size=0), ValueError, "block_size must be >= 1", id="block-size"),
    pytest.param(_bad(block_size=-7), ValueError, "block_size must be >= 1", id="block-size-negative"),
    pytest.param(_bad(x=None), TypeError, "x must be a tensor, got None", id="x-none"),
    pytest.param(_bad(delta=None), TypeError, "delta must be a tensor, got None", id="delta-none"),
    pytest.param(_bad(base=None), TypeError, "base must be a tensor, got None", id="base-none"),
]


@pytest.mark.parametrize("args,error,message", FORWARD_ERRORS)
def test_forward_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        torch.ops.dflash2.conv_forward_cpu(args["x"], args["delta"], args["base"], args["block_size"], torch.float32)


@pytest.mark.parametrize("args,error,message", FORWARD_ERRORS)
def test_backward_rejects_bad_arguments(args, error, message):
    grad_out = torch.randn(8, 32)
    with pytest.raises(error, match=re.escape(message)):
        torch.ops.dflash2.conv_backward_cpu(grad_out, args["x"], args["delta"], args["base"], args["block_size"])


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_forward_rejects_an_out_dtype_it_cannot_store(out_dtype):
    args = _bad()
    with pytest.raises(TypeError, match=re.escape("out_dtype must be float16, bfloat16, float32 or float64")):
        torch.ops.dflash2.conv_forward_cpu(args["x"], args["delta"], args["base"], 4, out_dtype)


GRAD_OUT_ERRORS = [
    pytest.param(torch.randn(8, 16), ValueError, "grad_out must have x's shape [8, 32]", id="shape"),
    pytest.param(torch.randn(8, 32, 2)[..., 0], ValueError, "grad_out must have a unit last stride", id="stride"),
    pytest.param(torch.randn(32), ValueError, "grad_out must have 2 dimensions", id="dims"),
    pytest.param(torch.ones(8, 32, dtype=torch.int16), TypeError,
                 "grad_out must be float16, bfloat16, float32 or float64", id="dtype"),
    pytest.param(None, TypeError, "grad_out must be a tensor, got None", id="none"),
]


@pytest.mark.parametrize("grad_out,error,message", GRAD_OUT_ERRORS)
def test_backward_rejects_a_bad_grad_out(grad_out, error, message):
    args = _bad()
    with pytest.raises(error, match=re.escape(message)):
        torch.ops.dflash2.conv_backward_cpu(grad_out, args["x"], args["delta"], args["base"], 4)


# --- the backward's reductions against float64 (SPEC section 4) ---------------------------
#
# ddelta sums a group's gs channels, dbase every row of a tap. The reference (torch's
# cascade sums, in the input dtype) is the bar: the kernel's max error against float64
# must stay within twice the reference's. Long groups (gs = 300), one chunk of rows or a
# few (N <= 200), and expanded operands (row stride 0: every row the same, so rounding
# errors of a running sum add up instead of cancelling) are where plain float sums fail.

REDUCTION_DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def _reduction_inputs(rows, hidden, group_size, dtype, *, expanded=(), taps=2, seed=0):
    """(grad_out, x, delta, base) for conv_backward_cpu; the operands named in ``expanded``
    (grad_out, x, delta) are one row expanded over all rows (row stride 0)."""
    g = torch.Generator().manual_seed(seed)
    groups = hidden // group_size

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    def rows_of(name, *shape, scale=1.0):
        if name in expanded:
            return randn(1, *shape, scale=scale).expand(rows, *shape)
        return randn(rows, *shape, scale=scale)

    grad_out = rows_of("grad_out", hidden)
    x = rows_of("x", hidden)
    delta = rows_of("delta", taps, groups, scale=0.5)
    base = randn(taps, hidden)
    return grad_out, x, delta, base


def _assert_backward_within_contract(grad_out, x, delta, base, group_size, block_size=8):
    rows, hidden = x.shape
    case = ConvCase((rows,), hidden, group_size, base.shape[0], block_size, (x.dtype, delta.dtype, base.dtype))
    expected = conv_with_grads(reference.grouped_dynamic_conv, x, delta, base, grad_out, case)[1:]
    exact = exact_conv_with_grads(x, delta, base, grad_out, case)[1:]
    got = torch.ops.dflash2.conv_backward_cpu(grad_out, x, delta, base, block_size)
    for name, kernel, ref, ex in zip(("dx", "ddelta", "dbase"), got, expected, exact):
        assert_within_contract(f"N={rows} H={hidden} gs={group_size} {x.dtype} {name}", kernel, ref, ex)


@pytest.mark.parametrize("dtype", REDUCTION_DTYPES)
@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("rows,hidden", [(1, 300), (1, 600), (2, 300), (8, 300), (64, 300), (200, 600)])
def test_backward_long_groups_within_contract(rows, hidden, seed, dtype):
    """gs = 300: each ddelta is a sum of 300 products (the fuzz found 13x the reference's
    error). With few groups the max error is one or two sums', so seeds vary it."""
    _assert_backward_within_contract(*_reduction_inputs(rows, hidden, 300, dtype, seed=seed), group_size=300)


@pytest.mark.parametrize("dtype", REDUCTION_DTYPES)
@pytest.mark.parametrize("rows", range(1, 201))
def test_backward_few_rows_within_contract(rows, dtype):
    """N = 1 .. 200: dbase is one 64-row chunk's running sum, or a few chunks'."""
    _assert_backward_within_contract(*_reduction_inputs(rows, 256, 16, dtype, seed=rows), group_size=16)


@pytest.mark.parametrize("dtype", REDUCTION_DTYPES)
@pytest.mark.parametrize("rows", [64, 150, 1000])
@pytest.mark.parametrize("expanded", [("grad_out", "x"), ("grad_out", "x", "delta"), ("grad_out",), ("x",)],
                         ids=lambda names: "+".join(names))
def test_backward_expanded_rows_within_contract(expanded, rows, dtype):
    """Expanded (row stride 0) operands: identical rows, so a running sum's errors add up."""
    inputs = _reduction_inputs(rows, 256, 16, dtype, expanded=expanded, seed=rows)
    assert all(t.stride(0) == 0 for t, name in zip(inputs, ("grad_out", "x", "delta")) if name in expanded)
    _assert_backward_within_contract(*inputs, group_size=16)


@pytest.mark.parametrize("dtype", REDUCTION_DTYPES)
def test_backward_long_expanded_groups_within_contract(dtype):
    """Both at once: 300-channel groups of expanded rows."""
    inputs = _reduction_inputs(96, 600, 300, dtype, expanded=("grad_out", "x"), seed=5)
    _assert_backward_within_contract(*inputs, group_size=300)


def _forward_in_float32_op_order(x, delta, base, block_size, out_dtype):
    """The forward as the float kernels round it, one float32 operation at a time (no
    fused multiply-adds): sum = (base_x[0] + delta[n, 0]) * x[n], then for each tap tau
    that stays inside row n's block, sum += (base_x[tau] + delta[n, tau]) * x[n - tau];
    rounded once to out_dtype."""
    rows, hidden = x.shape
    taps, groups = delta.shape[1], delta.shape[2]
    base_x = base.to(x.dtype).float()
    coefficients = delta.float().repeat_interleave(hidden // groups, dim=2)  # [N, K, H]
    xf = x.float()
    position = torch.arange(rows) % block_size
    out = (base_x[0] + coefficients[:, 0]) * xf
    for tau in range(1, taps):
        shifted = torch.zeros_like(xf)
        shifted[tau:] = xf[:-tau]
        term = (base_x[tau] + coefficients[:, tau]) * shifted
        out = torch.where((position >= tau)[:, None], out + term, out)
    return out.to(out_dtype)


@pytest.mark.parametrize("dtypes", [F32, AUTOCAST, (torch.bfloat16,) * 3, (torch.bfloat16, torch.bfloat16, torch.float32),
                                    (torch.float16,) * 3],
                         ids=["f32", "f32x-bf16delta", "bf16", "bf16-f32base", "f16-generic"])
@pytest.mark.parametrize("rows,hidden,group_size,taps,block_size", [
    (40, 64, 16, 2, 8),    # the two-tap register path, 16-lane chunks
    (37, 48, 8, 2, 4),     # 8-lane chunks; a last block cut short
    (45, 96, 16, 3, 8),    # three taps: the general register path
    (30, 36, 12, 2, 8),    # a group size of no lane width: the generic path
    (300, 4096, 16, 2, 8),  # serving width, rows split over the threads
])
def test_forward_rounds_as_float32_in_op_order(rows, hidden, group_size, taps, block_size, dtypes):
    """The float forward kernels give exactly the float32 operations in the documented
    order, bit for bit, on every path (register and generic, 8 and 16 lanes, 2 and 3 taps)."""
    x, delta, base, _ = _raw_inputs(rows, hidden, group_size, taps, dtypes, strided_delta=True, row_strided_x=False)
    out_dtype = torch.promote_types(x.dtype, delta.dtype)
    got = torch.ops.dflash2.conv_forward_cpu(x, delta, base, block_size, out_dtype)
    assert torch.equal(got, _forward_in_float32_op_order(x, delta, base, block_size, out_dtype))
