"""The tuner on a GPU: each member timed on the call's own tensors (CUDA-graph replays),
the winner kept on disk and read back by the next process, nothing timed during a CUDA
graph capture, and a tuned call's results equal the default configuration's."""

from __future__ import annotations

import math

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels.conv import launch as conv_launch
from dflash2_kernels.tuning import SPACES, Tuner
from dflash2_kernels.tuning.tuner import time_launch

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh_tuner(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH2_AUTOTUNE", "retune")
    tuner = Tuner()
    monkeypatch.setattr(conv_launch, "TUNER", tuner)
    return tuner


def _conv_inputs(rows=4096, hidden=5120, dtype=torch.bfloat16):
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    delta = torch.randn(rows, 2, 2, hidden // 16, device="cuda", dtype=dtype)[:, 1]
    base = torch.randn(2, hidden, device="cuda", dtype=torch.float32)
    return x, delta, base


def _conv(x, delta, base):
    return dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)


def test_first_call_times_every_member_and_keeps_the_winner(fresh_tuner, tmp_path, monkeypatch):
    x, delta, base = _conv_inputs()
    with fresh_tuner.forced({"conv_forward": SPACES["conv_forward"].default}):
        expected = _conv(x, delta, base)
    got = _conv(x, delta, base)
    (trial,) = [t for t in fresh_tuner.trials if t["space"] == "conv_forward"]
    assert set(trial["times_ms"]) == {c.name for c in SPACES["conv_forward"].configs}
    assert all(0 < t < 10 for t in trial["times_ms"].values()), trial
    # Every member computes each output the same way (the taps in order): equal bits.
    assert torch.equal(got, expected)
    monkeypatch.setenv("DFLASH2_AUTOTUNE", "1")
    later = Tuner(timer=lambda launch, device_of: pytest.fail("timed again"))
    monkeypatch.setattr(conv_launch, "TUNER", later)
    assert torch.equal(_conv(x, delta, base), expected)
    assert list(tmp_path.glob("tuning/*.json"))


def test_tuned_backward_matches_the_default(fresh_tuner):
    x, delta, base = (t.requires_grad_(True) for t in _conv_inputs(rows=16384, hidden=4096))
    dy = torch.randn(x.shape, device="cuda", dtype=x.dtype)
    tuned = torch.autograd.grad(_conv(x, delta, base), (x, delta, base), dy)
    defaults = {name: space.default for name, space in SPACES.items()}
    with fresh_tuner.forced(defaults):
        default = torch.autograd.grad(_conv(x, delta, base), (x, delta, base), dy)
    assert {t["space"] for t in fresh_tuner.trials} >= {"conv_forward", "conv_backward", "conv_dbase"}
    # dx: each element's taps in order, the same bits; ddelta (a tile's sum over the group's
    # channels, spread over the member's warps) and dbase (fp64 partials over the member's
    # row chunks) may round their last bit differently.
    assert torch.equal(tuned[0], default[0])
    torch.testing.assert_close(tuned[1], default[1])
    torch.testing.assert_close(tuned[2], default[2], rtol=1e-6, atol=1e-6 * default[2].abs().max().item())


def test_nothing_is_timed_in_a_graph_capture(fresh_tuner):
    x, delta, base = _conv_inputs(rows=256)
    out = torch.empty(x.shape, device="cuda", dtype=x.dtype)
    launch = conv_launch.plan_conv_forward(x, delta, base, out, 8, SPACES["conv_forward"].default)
    launch.run(x)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv_launch.plan_conv_forward(x, delta, base, out, 8).run(x)
    assert fresh_tuner.trials == []
    graph.replay()
    torch.testing.assert_close(out, _conv(x, delta, base), rtol=0, atol=0)


def test_time_launch_is_device_time():
    x, delta, base = _conv_inputs(rows=16384)
    out = torch.empty(x.shape, device="cuda", dtype=x.dtype)
    launch = conv_launch.plan_conv_forward(x, delta, base, out, 8, SPACES["conv_forward"].default)
    ms = time_launch(launch, x)
    # 16384 x 5120 bf16 read and written: ~335 MB, under 10 ms on any GPU we ship for.
    assert math.isfinite(ms) and 0 < ms < 10
