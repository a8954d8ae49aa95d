"""The fuzz suite (tests/fuzz/): seeded random cases for every public function, module
and raw op, run in child processes so that a crash or a hang fails its target's test
and names the case (a fresh child then carries on after it).

Valid inputs must agree with the float64 reference (SPEC section 4); bad inputs must
raise ValueError, TypeError or IndexError naming the bad argument. On failure a test
prints each class of failing case once, with the command that replays it:
``python -m tests.fuzz.runner TARGET SEED INDEX 1 --traceback``.

Environment (pytest reads options only from the root conftest, so these are variables):

- ``DFLASH2_FUZZ_CASES``: cases per target (default 300; a long run: e.g. 5000)
- ``DFLASH2_FUZZ_SEED``: the seed (default 0, so CI sees the same cases every run)
- ``DFLASH2_FUZZ_JOBS``: child processes at a time (default: the CPU count)
- ``DFLASH2_FUZZ_CASE_TIMEOUT``: seconds one case may run before it counts as a hang (120)
- ``DFLASH2_TEST_BLAS``: a stand-in BLAS rounding order for every case (tests/host_blas.py)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .fuzz.harness import format_report, run_plan
from .fuzz.targets import RAW_OP_PREFIX, TARGETS

CASES = int(os.environ.get("DFLASH2_FUZZ_CASES", "300"))
SEED = int(os.environ.get("DFLASH2_FUZZ_SEED", "0"))
JOBS = int(os.environ.get("DFLASH2_FUZZ_JOBS", "0")) or os.cpu_count() or 1
SELF_TEST = "harness self-test"


@pytest.fixture(scope="module")
def fuzz_runs(request):
    """Start every selected target at once, dealt round-robin to JOBS children (each
    imports torch once), plus the harness's self-test; each test waits for its own."""
    items = request.session.items
    names = [getattr(item, "originalname", None) for item in items]
    selected = list(dict.fromkeys(item.callspec.params["target"] for item, name in zip(items, names)
                                  if name == "test_fuzz_target"))
    # As conftest.py does for every test: the default backend, whatever the caller's shell says.
    env = {name: value for name, value in os.environ.items() if name != "DFLASH2_BACKEND"}
    pool = ThreadPoolExecutor(max_workers=JOBS + 1, thread_name_prefix="fuzz")
    runs = {}
    for group in filter(None, (selected[job::JOBS] for job in range(JOBS))):
        future = pool.submit(run_plan, SEED, [(target, 0, CASES) for target in group], env=env)
        runs.update(dict.fromkeys(group, future))
    if "test_harness_reports_crashes_and_hangs_and_carries_on" in names:
        # Mostly asleep (a 3 s hang), so it may run beside the JOBS busy children.
        runs[SELF_TEST] = pool.submit(run_plan, 0, [("selftest.crash", 0, 4), ("selftest.hang", 0, 4)],
                                      env=env, case_timeout_s=3)
    yield runs
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_target(target, fuzz_runs):
    report = format_report(fuzz_runs[target].result()[target])
    if report:
        pytest.fail(f"fuzz target {target} (seed {SEED}, {CASES} cases):\n{report}", pytrace=False)


def test_harness_reports_crashes_and_hangs_and_carries_on(fuzz_runs):
    """Case 1 of the self-test targets aborts or hangs, case 2 fails (tests/fuzz/selftest.py)."""
    results = fuzz_runs[SELF_TEST].result()
    crash, hang = results["selftest.crash"], results["selftest.hang"]
    assert len(crash.crashes) == 1 and "SIGABRT" in crash.crashes[0], crash.crashes
    assert "case selftest.crash 1 " in crash.crashes[0], crash.crashes[0]
    assert len(hang.crashes) == 1 and "watchdog" in hang.crashes[0], hang.crashes
    assert "case selftest.hang 1 " in hang.crashes[0], hang.crashes[0]
    # A fresh child carried on after each: case 2 ran (and failed, on purpose), 3 passed.
    assert [f["index"] for f in crash.failures] == [2] and [f["index"] for f in hang.failures] == [2]


def test_every_raw_op_has_a_target():
    """A new op in torch.ops.dflash2 gets fuzzed too: it needs a generator in tests/fuzz/targets.py."""
    import dflash2_kernels  # noqa: F401  (registers the ops)

    ops = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
           if name.startswith("dflash2::")}
    fuzzed = {name[len(RAW_OP_PREFIX):] for name in TARGETS if name.startswith(RAW_OP_PREFIX)}
    assert ops <= fuzzed, f"raw ops without a fuzz target: {sorted(ops - fuzzed)}"
