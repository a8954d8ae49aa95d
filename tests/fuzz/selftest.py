"""Targets that misbehave on purpose, for the harness's own test in tests/test_fuzz.py:
case 1 crashes (SIGABRT) or hangs, case 2 fails, every other case passes."""

from __future__ import annotations

import os
import resource
import time

from .case import Agrees, Case, Raises
from .draw import Draw


def _case(draw: Draw, misbehave) -> Case:
    if draw.index == 1:
        return Case("misbehaves on purpose", misbehave, Agrees(lambda result: None))
    if draw.index == 2:  # returns where an error was due: proves a fresh child carried on
        return Case("fails on purpose", lambda: None, Raises(("anything",)))
    return Case("passes", lambda: None, Agrees(lambda result: None))


def _abort_without_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left in the work tree
    os.abort()


def crash_case(draw: Draw) -> Case:
    return _case(draw, _abort_without_core)


def hang_case(draw: Draw) -> Case:
    return _case(draw, lambda: time.sleep(3600))
