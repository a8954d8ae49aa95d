"""The stand-in BLAS of tests/host_blas.py: each order sums as it says, every product op
is rerouted, float64 and other devices are left alone, and the pinning helpers hand a
module's projection on unchanged."""

from __future__ import annotations

import pytest
import torch

from . import host_blas


def _fma(acc: float, a: float, b: float) -> torch.Tensor:
    return torch.tensor(acc, dtype=torch.float64).add(a * b).float()


def _serial_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    acc = torch.tensor(0.0)
    for x, y in zip(a.double().tolist(), b.double().tolist()):
        acc = _fma(acc.item(), x, y)
    return acc.item()


def _lanes_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    lanes = [torch.tensor(0.0)] * host_blas.LANES
    for i, (x, y) in enumerate(zip(a.double().tolist(), b.double().tolist())):
        lanes[i % host_blas.LANES] = _fma(lanes[i % host_blas.LANES].item(), x, y)
    while len(lanes) > 1:
        half = len(lanes) // 2
        lanes = [(lanes[i] + lanes[i + half]).float() for i in range(half)]
    return lanes[0].item()


def _operands(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 2**-8 .. 2**8: every order rounds differently.
    scale = torch.exp2(torch.randint(-8, 9, (k,), generator=g).float())
    return torch.randn(m, k, generator=g) * scale, torch.randn(k, n, generator=g)


@pytest.mark.parametrize("k", [1, 15, 16, 17, 70])
@pytest.mark.parametrize("order", ["serial", "lanes"])
def test_each_order_sums_as_documented(order, k):
    a, b = _operands(3, k, 4)
    expected = torch.tensor([[(_serial_dot if order == "serial" else _lanes_dot)(a[i], b[:, j]) for j in range(4)]
                             for i in range(3)])
    with host_blas.emulated(order):
        got = a @ b
    assert torch.equal(got, expected)


def test_the_orders_differ_and_alternating_takes_them_in_turn():
    a, b = _operands(5, 300, 6, seed=1)
    with host_blas.emulated("serial"):
        serial = a @ b
    with host_blas.emulated("lanes"):
        lanes = a @ b
    assert not torch.equal(serial, lanes)
    with host_blas.emulated("alternating"):
        calls = [a @ b for _ in range(4)]
    for got, expected in zip(calls, (serial, lanes, serial, lanes)):
        assert torch.equal(got, expected)


def test_every_product_op_is_rerouted():
    a, b = _operands(4, 40, 3, seed=2)
    c = torch.randn(4, 3)
    v = b[:, 0].contiguous()
    with host_blas.emulated("serial"):
        product = a @ b
        results = {
            "addmm": (torch.addmm(c, a, b, beta=0.5, alpha=2.0), (0.5 * c + 2.0 * product.double()).float()),
            "bmm": (torch.bmm(a[None], b[None])[0], product),
            "baddbmm": (torch.baddbmm(c[None], a[None], b[None])[0], (c.double() + product.double()).float()),
            "mv": (torch.mv(a, v), product[:, 0]),
            "addmv": (torch.addmv(c[:, 0], a, v), (c[:, 0].double() + product[:, 0].double()).float()),
            "dot": (torch.dot(a[0], v), product[0, 0]),
            "linear": (torch.nn.functional.linear(a, b.t()), product),
            "einsum": (torch.einsum("mk,kn->mn", a, b), product),
            "bf16": (a.bfloat16() @ b.bfloat16(), None),
        }
    for name, (got, expected) in results.items():
        if expected is not None:
            assert torch.allclose(got.double(), expected.double(), rtol=0, atol=1e-5), name
    # The products themselves are the serial order's bits: mv and dot are its rows.
    assert torch.equal(results["mv"][0], product[:, 0]) and torch.equal(results["dot"][0], product[0, 0])
    assert torch.equal(results["bmm"][0], product) and torch.equal(results["linear"][0], product)
    with host_blas.emulated("serial"):
        bf16 = (a.bfloat16().float() @ b.bfloat16().float()).bfloat16()
    assert torch.equal(results["bf16"][0], bf16)


def test_float64_and_unset_keep_the_hosts_blas():
    a, b = _operands(4, 300, 5, seed=3)
    host64, host32 = a.double() @ b.double(), a @ b
    with host_blas.emulated("serial"):
        assert torch.equal(a.double() @ b.double(), host64)
    with host_blas.emulated(None):
        assert torch.equal(a @ b, host32)


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="DFLASH2_TEST_BLAS"):
        with host_blas.emulated("fastest"):
            pass


def test_pinned_outputs_repeat_the_first_projection_and_replay_it_elsewhere():
    torch.manual_seed(0)
    layer, twin = torch.nn.Linear(300, 7, bias=False), torch.nn.Linear(300, 7, bias=False)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(5, 300, requires_grad=True)
    with host_blas.emulated("alternating"):
        with host_blas.pinned_outputs(layer) as outputs:
            first, second, other = layer(x), layer(x.detach().clone()), layer(2 * x)
        assert len(outputs) == 2 and torch.equal(first, second) and first is outputs[0]
        with host_blas.replayed_outputs(twin, outputs):
            replayed, replayed_other = twin(x), twin(2 * x)
        unpinned = twin(x)
    assert torch.equal(replayed, first) and torch.equal(replayed_other, other)
    assert not torch.equal(unpinned, first)  # without the replay the alternation shows
    # The replayed values differentiate as the twin's own layer: its weight gets the gradient.
    replayed.sum().backward()
    assert twin.weight.grad is not None and layer.weight.grad is None
    assert torch.allclose(twin.weight.grad, x.detach().sum(0).expand(7, 300), atol=1e-4)
