"""The module: upstream's parameter layout, identity init, prepare/finish semantics."""

from __future__ import annotations

import torch

import dflash2_kernels as dk
from dflash2_kernels import reference


def _upstream_state_dict(hidden, kernel_size, group_size, generator):
    """A state dict in speculators' GroupedDynamicCausalConv layout, random values."""
    groups = hidden // group_size
    return {
        "base_kernel": torch.randn(2, kernel_size, hidden, generator=generator),
        "kernel_projection.weight": torch.randn(2 * kernel_size * groups, hidden, generator=generator) * 0.1,
    }


def test_state_dict_is_upstreams_key_for_key_and_loads_strictly():
    g = torch.Generator().manual_seed(0)
    module = dk.GroupedDynamicCausalConv(64, block_size=8, kernel_size=2, group_size=16)
    upstream = _upstream_state_dict(64, 2, 16, g)
    ours = module.state_dict()
    assert list(ours) == list(upstream)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in upstream.items()}
    module.load_state_dict(upstream, strict=True)
    assert torch.equal(module.base_kernel, upstream["base_kernel"])


def test_reset_parameters_makes_both_convolutions_the_identity():
    module = dk.GroupedDynamicCausalConv(48, block_size=8, kernel_size=3, group_size=16)
    with torch.no_grad():
        module.base_kernel.normal_()
        module.kernel_projection.weight.normal_()
    module.reset_parameters()
    h = torch.randn(3, 8, 48)
    prepared, kernels = module.prepare(h)
    torch.testing.assert_close(prepared, h, rtol=0, atol=0)
    torch.testing.assert_close(module.finish(h * 2, kernels), h * 2, rtol=0, atol=0)


def test_prepare_and_finish_match_upstream_semantics():
    g = torch.Generator().manual_seed(1)
    module = dk.GroupedDynamicCausalConv(32, block_size=8, kernel_size=2, group_size=16)
    module.load_state_dict(_upstream_state_dict(32, 2, 16, g))
    h = torch.randn(2, 12, 32, generator=g)  # 12 % 8 != 0: blocks straddle sequences
    sub = torch.randn(2, 12, 32, generator=g)

    prepared, kernels = module.prepare(h)
    projected = torch.nn.functional.linear(h, module.kernel_projection.weight).view(2, 12, 2, 2, 2)
    expected_prepared = reference.grouped_dynamic_conv(
        h, projected[..., 0, :, :], module.base_kernel[0], block_size=8, group_size=16
    )
    expected_finished = reference.grouped_dynamic_conv(
        sub, projected[..., 1, :, :], module.base_kernel[1], block_size=8, group_size=16
    )
    torch.testing.assert_close(prepared, expected_prepared)
    torch.testing.assert_close(kernels, projected[..., 1, :, :])
    torch.testing.assert_close(module.finish(sub, kernels), expected_finished)


def test_gradients_reach_every_parameter():
    module = dk.GroupedDynamicCausalConv(32, block_size=8, kernel_size=2, group_size=16)
    h = torch.randn(16, 32, requires_grad=True)
    prepared, kernels = module.prepare(h)
    module.finish(prepared.tanh(), kernels).square().sum().backward()
    assert module.base_kernel.grad.abs().sum() > 0
    assert module.kernel_projection.weight.grad.abs().sum() > 0
    assert h.grad.abs().sum() > 0
