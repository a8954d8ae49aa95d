"""Bad input gets a clear Python exception naming the argument, before any launch."""

from __future__ import annotations

import re

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels.conv import launch

CONV_FUNCTIONS = [
    pytest.param(dk.grouped_dynamic_conv, id="fused"),
    pytest.param(reference.grouped_dynamic_conv, id="reference"),
]


def _inputs(lead=(2, 8), hidden=32, kernel_size=2, groups=2, dtype=torch.float32):
    x = torch.randn(*lead, hidden, dtype=dtype)
    delta = torch.randn(*lead, kernel_size, groups, dtype=dtype)
    base = torch.randn(kernel_size, hidden, dtype=dtype)
    return x, delta, base


# (arguments changed, exception, exact message) - the first four are speculators' words.
ERROR_CASES = [
    (dict(group_size=5), ValueError, "hidden_size (32) must be divisible by group_size (5)."),
    (dict(block_size=1), ValueError, "kernel_size (2) cannot exceed block_size (1)."),
    (dict(base=torch.randn(2, 16)), ValueError, "base_kernel must have shape [kernel_size, hidden_size], got (2, 16)."),
    (dict(base=torch.randn(32), block_size=64), ValueError, "base_kernel must have shape [kernel_size, hidden_size], got (32,)."),
    (dict(delta=torch.randn(2, 8, 2, 3)), ValueError, "delta_kernel must have shape (2, 8, 2, 2), got (2, 8, 2, 3)."),
    (dict(delta=torch.randn(16, 2, 2)), ValueError, "delta_kernel must have shape (2, 8, 2, 2), got (16, 2, 2)."),
    (dict(block_size=0), ValueError, "block_size must be >= 1, got 0."),
    (dict(group_size=0), ValueError, "group_size must be >= 1, got 0."),
    (dict(group_size=-16), ValueError, "group_size must be >= 1, got -16."),
    (dict(block_size=8.0), TypeError, "block_size must be an int, got float."),
    (dict(x=torch.ones(2, 8, 32, dtype=torch.int32)), TypeError, "hidden_states must have a floating-point dtype (float16, bfloat16, float32 or float64), got torch.int32."),
    (dict(delta=torch.ones(2, 8, 2, 2, dtype=torch.long)), TypeError, "delta_kernel must have a floating-point dtype (float16, bfloat16, float32 or float64), got torch.int64."),
    (dict(base=torch.ones(2, 32, dtype=torch.bool)), TypeError, "base_kernel must have a floating-point dtype (float16, bfloat16, float32 or float64), got torch.bool."),
    (dict(delta=torch.ones(2, 8, 2, 2, dtype=torch.float8_e4m3fn)), TypeError, "got torch.float8_e4m3fn."),
    (dict(x=[1.0, 2.0]), TypeError, "hidden_states must be a torch.Tensor, got list."),
    (dict(x=torch.tensor(1.0)), ValueError, "hidden_states must have at least one dimension [..., hidden_size]."),
    (dict(base=torch.randn(2, 32, device="meta")), ValueError, "must be on one device, got cpu, cpu and meta."),
]


@pytest.mark.parametrize("conv", CONV_FUNCTIONS)
@pytest.mark.parametrize("change,error,message", ERROR_CASES, ids=[f"{i}-{next(iter(c[0]))}" for i, c in enumerate(ERROR_CASES)])
def test_conv_rejects_bad_arguments(conv, change, error, message):
    x, delta, base = _inputs()
    args = dict(x=x, delta=delta, base=base, block_size=8, group_size=16)
    args.update(change)
    with pytest.raises(error, match=re.escape(message)):
        conv(args["x"], args["delta"], args["base"], block_size=args["block_size"], group_size=args["group_size"])


def test_raw_op_rejects_bad_shapes_too():
    x, delta, base = _inputs()
    with pytest.raises(ValueError, match=re.escape("delta_kernel must have shape (2, 8, 2, 2)")):
        torch.ops.dflash2.grouped_dynamic_conv(x, delta[..., :1], base, 8, 16)


def test_module_rejects_bad_sizes():
    with pytest.raises(ValueError, match=re.escape("hidden_size (30) must be divisible by group_size (16).")):
        dk.GroupedDynamicCausalConv(30, block_size=8, kernel_size=2, group_size=16)
    with pytest.raises(ValueError, match=re.escape("kernel_size (9) cannot exceed block_size (8).")):
        dk.GroupedDynamicCausalConv(32, block_size=8, kernel_size=9, group_size=16)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        dk.GroupedDynamicCausalConv(32, block_size=0, kernel_size=2, group_size=16)


@pytest.mark.parametrize("seq_len,message", [
    (12, "sequence length (12) must be a multiple of block_size (8)."),
])
def test_nemo_rejects_partial_blocks(seq_len, message):
    x, delta, base = _inputs(lead=(2, seq_len))
    for fn in (reference.nemo_grouped_dynamic_convolve, dk.compat.grouped_dynamic_convolve):
        with pytest.raises(ValueError, match=re.escape(message)):
            fn(x, delta, base, 16, 8)
    with pytest.raises(ValueError, match=re.escape("hidden must have shape [batch, sequence, hidden]")):
        dk.compat.grouped_dynamic_convolve(x[0], delta[0], base, 16, 8)


def test_empty_input_returns_empty_result_and_zero_gradients():
    x, delta, base = _inputs(lead=(0, 8))
    x.requires_grad_()
    delta.requires_grad_()
    base.requires_grad_()
    out = dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)
    assert out.shape == (0, 8, 32) and out.dtype == torch.float32
    out.sum().backward()
    assert base.grad.shape == base.shape and not base.grad.any()
    assert x.grad.shape == x.shape and delta.grad.shape == delta.shape


def test_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", "cuda")
    x, delta, base = _inputs()
    with pytest.raises(ValueError, match="DFLASH2_BACKEND must be one of auto, triton, reference; got 'cuda'"):
        dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)


def test_forced_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", "triton")
    monkeypatch.setattr(launch, "KERNELS_INTERPRETED", False)
    x, delta, base = _inputs()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)


def test_grid_overflow_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(launch, "_MAX_PROGRAMS", 3)
    x, delta, base = _inputs(lead=(1000,))
    with pytest.raises(ValueError, match="exceed the grid limit 3"):
        launch.conv_forward_triton(x, delta, base, 8, torch.float32)
