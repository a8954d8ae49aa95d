"""Whether dflash2_kernels is pip-installed here (make env's editable install counts), and
so has its startup hook: a bare checkout on PYTHONPATH has none, and the tests that run
commands through dflash2-run skip there (an install without the hook fails
tests/test_launcher.py::test_the_hook_is_installed_with_the_package)."""

from __future__ import annotations

from importlib import metadata

import pytest


def pip_installed() -> bool:
    try:
        metadata.distribution("dflash2-kernels")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_install = pytest.mark.skipif(not pip_installed(), reason="dflash2_kernels is not pip-installed: no startup hook")
