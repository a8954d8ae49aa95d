"""Test set-up: where Triton runs, the GPU marker, NaN-poisoned allocations (torch.empty
in Python, every allocation of the C++ ops).

Without CUDA, Triton kernels run under the interpreter on CPU tensors; that must be
decided before ``triton.jit`` wraps the kernels, so it happens here, before any test
module imports dflash2_kernels. With CUDA the same tests run the compiled kernels.
"""

import os

import pytest
import torch

from .triton_interpreter import FAULT as INTERPRETER_FAULT

if not torch.cuda.is_available():
    if INTERPRETER_FAULT:  # tests/triton_interpreter.py: its tests skip, saying why
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")

# The C++ ops fill every tensor they allocate with NaN (integers: their lowest value)
# before their kernels run: an element a kernel leaves unwritten fails the checks.
os.environ.setdefault("DFLASH2_POISON_OUTPUTS", "1")
# On a GPU the tests judge the default configurations (a test's first call per shape would
# otherwise time every member: minutes over the suite); tests/test_tuning_configs.py forces
# each member and tests/test_tuner_gpu.py tunes.
os.environ.setdefault("DFLASH2_AUTOTUNE", "0")

from . import host_blas  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "compiles: runs torch.compile (no stand-in BLAS there: tests/host_blas.py)")


def pytest_report_header(config):
    if INTERPRETER_FAULT and not torch.cuda.is_available():
        return f"Triton kernels not run: {INTERPRETER_FAULT}"
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    monkeypatch.delenv("DFLASH2_BACKEND", raising=False)


@pytest.fixture(autouse=True)
def _host_blas(request):
    """DFLASH2_TEST_BLAS: every CPU matrix product in a stand-in BLAS's order
    (tests/host_blas.py), except in tests marked ``compiles``: torch.compile refuses
    the Python dispatch mode that reroutes them."""
    if request.node.get_closest_marker("compiles"):
        yield
        return
    with host_blas.emulated():
        yield


@pytest.fixture
def poison_empty(monkeypatch):
    """Make every floating ``torch.empty`` NaN, so an unwritten output element fails."""
    original = torch.empty

    def poisoned(*args, **kwargs):
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    return poisoned
