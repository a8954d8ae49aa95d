"""The emulated CUDA kernels: torch.ops.dflash2_emulated.*, the package's CUDA kernels
run on CPU tensors by the SIMT runtime (csrc/emulation/), built with AddressSanitizer.

Run through ``python scripts/asan.py test`` (part of ``make test``): it builds the
sanitized library, preloads the sanitizer's runtime, and points DFLASH2_EMULATED_LIB
at the library. A plain ``pytest`` skips this directory, saying so.
"""

from __future__ import annotations

import os

import pytest
import torch

LIBRARY = os.environ.get("DFLASH2_EMULATED_LIB")
# Every schedule-dependent result must be the same under each of these seeds.
SCHEDULE_SEEDS = (1, 2, 3)


def pytest_collection_modifyitems(config, items):
    if LIBRARY:
        return
    skip = pytest.mark.skip(reason="emulated CUDA kernels: run `python scripts/asan.py test` (make test does)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def emulated():
    """torch.ops.dflash2_emulated, loaded once."""
    torch.ops.load_library(LIBRARY)
    return torch.ops.dflash2_emulated


def run_schedules(emulated, call):
    """call() under every schedule seed; the results must agree bit for bit. Returns one."""
    results = []
    for seed in SCHEDULE_SEEDS:
        emulated.set_schedule_seed(seed)
        result = call()
        results.append(result if isinstance(result, tuple) else (result,))
    first = results[0]
    for seed, other in zip(SCHEDULE_SEEDS[1:], results[1:]):
        for index, (a, b) in enumerate(zip(first, other)):
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b), (
                f"output {index} differs between schedule seeds {SCHEDULE_SEEDS[0]} and {seed}: a race or an "
                "ordering assumption"
            )
    return first if len(first) > 1 else first[0]
