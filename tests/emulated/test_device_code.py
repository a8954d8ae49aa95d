"""The CUDA bindings refuse a GPU the build holds no code for (csrc/device_binding.h).

The emulated library stands for a build of the default list (sm_80, sm_86, sm_89, sm_90,
sm_100, sm_120 and compute_120 PTX: scripts/asan.py), and its GPU reports the compute
capability a test sets. On a GPU without code, the first call of each CUDA kernel op
raises, naming the device's capability, what the build holds and the command that
rebuilds for it, instead of CUDA's "no kernel image"; on every GPU some of its code runs
on, the op runs.
"""

from __future__ import annotations

import pytest
import torch

from ..selector_cases import CASES, make_inputs

HOLDS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120 (PTX)")


@pytest.fixture
def capability(emulated):
    """Sets the emulated GPU's compute capability; 9.0 again afterwards."""
    yield lambda major, minor: emulated.set_device_capability(major, minor)
    emulated.set_device_capability(9, 0)


def _topk(emulated):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    return emulated.candidate_topk(logits, 4)


def _scores(emulated):
    unary, projected, predecessor, successor, pred, cand, _ = make_inputs(CASES[0], "cpu")
    return emulated.selector_scores(unary, projected, predecessor, successor, pred, cand, False, torch.float32)


@pytest.mark.parametrize("op", [_topk, _scores], ids=["serving", "selector"])
@pytest.mark.parametrize("major, minor", [(7, 5), (11, 0)])
def test_a_gpu_without_code_gets_the_rebuild_command(emulated, capability, op, major, minor):
    capability(major, minor)
    with pytest.raises(RuntimeError) as raised:
        op(emulated)
    message = str(raised.value)
    assert f"compute capability {major}.{minor} (sm_{major}{minor})" in message
    assert all(code in message for code in HOLDS), message
    assert f'TORCH_CUDA_ARCH_LIST="{major}.{minor}+PTX" pip install --no-build-isolation' in message
    assert "no kernel image" not in message


@pytest.mark.parametrize("op", [_topk, _scores], ids=["serving", "selector"])
@pytest.mark.parametrize("major, minor", [(8, 0), (8, 7), (10, 3), (12, 1), (13, 0)])
def test_every_gpu_some_code_runs_on_runs_the_op(emulated, capability, op, major, minor):
    expected = op(emulated)
    capability(major, minor)
    got = op(emulated)
    for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert torch.equal(a, b)


def test_a_capability_must_be_major_dot_minor(emulated):
    with pytest.raises(RuntimeError, match="major in"):
        emulated.set_device_capability(9, 10)
