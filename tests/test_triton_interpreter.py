"""The rule that keeps a Triton interpreter known to be wrong under this numpy from judging
our kernels (tests/triton_interpreter.py): which pairs it refuses, and what it says."""

from __future__ import annotations

import pytest

from .triton_interpreter import KNOWN_FAULTS, interpreter_fault


@pytest.mark.parametrize("triton, numpy, faulty", [
    ("3.1.0", "2.4.6", True),   # torch 2.5.1's Triton: raises
    ("3.1.0", "2.2.6", True),   # ... or writes NaN
    ("3.1.0", "1.26.4", False),
    ("3.0.0", "2.0.0", True),
    ("3.6.0", "2.4.6", True),
    ("3.6.0", "2.3.5", False),
    ("3.8.0", "2.4.6", False),  # the newest torch's, as CI runs it
    ("3.2.0", "2.4.6", False),  # not tried: not refused (a fault there fails the tests)
    ("3.1.0", None, False),
    (None, "2.4.6", False),
    ("3.1.0+git1234", "2.1.0.dev0", True),
])
def test_the_interpreter_is_refused_exactly_where_it_is_known_to_be_wrong(triton, numpy, faulty):
    reason = interpreter_fault(triton, numpy)
    assert (reason is not None) == faulty, reason
    if faulty:
        assert f"Triton {triton}'s interpreter" in reason and f"numpy {numpy}" in reason and "numpy<" in reason


def test_every_known_fault_names_a_range_and_what_was_seen():
    for oldest, newest, numpy_from, seen in KNOWN_FAULTS:
        assert oldest <= newest and len(numpy_from) == 2 and "seen with" in seen
