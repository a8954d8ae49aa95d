"""The SIMT runtime's own tests (tests/simt/simt_selftest.cpp), each in its own process:
known answers for every primitive, and planted bugs that it must report."""

from __future__ import annotations

import os
import subprocess

import pytest

SELFTEST = os.environ.get("DFLASH2_SIMT_SELFTEST")


def _cases() -> list[str]:
    if not SELFTEST:
        return ["(not built)"]
    listing = subprocess.run([SELFTEST, "--list"], capture_output=True, text=True, check=True)
    return listing.stdout.split()


def _run(case: str, **env: str) -> subprocess.CompletedProcess:
    # The self-test is its own executable, built with the sanitizer linked in: no preload.
    environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    environment.update(env)
    return subprocess.run([SELFTEST, case], capture_output=True, text=True, timeout=120, env=environment)


@pytest.mark.parametrize("case", [c for c in _cases() if c != "planted_spin"])
def test_simt_selftest(case):
    result = _run(case)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_spinning_kernel_is_stopped_by_the_watchdog():
    result = _run("planted_spin", DFLASH2_EMULATION_TIMEOUT_S="1")
    assert result.returncode != 0
    assert "planted_spin_kernel" in result.stderr and "without finishing" in result.stderr, result.stderr
