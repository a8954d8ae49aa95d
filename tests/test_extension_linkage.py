"""The compiled extension runs on the process's C++ runtime, not a copy of its own.

A _C.so that carries a static copy of libstdc++ (LDFLAGS=-static-libstdc++, or a toolchain
that links it so by default) has iostreams whose locale was never initialised: every check
message that formats an integer comes out cut short ("delta must have shape [") or, as on
a GPU machine on 2026-12-04, crashes the process. setup.py links the shared libstdc++
first; these tests say so when a build does not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from dflash2_kernels._extension import EXTENSION

pytestmark = pytest.mark.skipif(EXTENSION is None, reason="no compiled extension")

# Defined once, in libstdc++.so: defined in _C.so too means a static copy is linked in.
LIBSTDCXX_OWNED = {
    "_ZNSt6locale7classicEv": "std::locale::classic()",
    "_ZNSt8ios_base4InitC1Ev": "std::ios_base::Init::Init()",
    "_ZNSo9_M_insertIlEERSoT_": "std::ostream::_M_insert<long>(long)",
}


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_extension_defines_no_symbol_of_libstdcxx():
    listed = subprocess.run(["nm", "-D", "--defined-only", EXTENSION.__file__], capture_output=True, text=True,
                            check=True).stdout
    defined = {line.split()[-1].split("@")[0] for line in listed.splitlines() if line.strip()}
    copied = sorted(name for mangled, name in LIBSTDCXX_OWNED.items() if mangled in defined)
    assert not copied, (f"{EXTENSION.__file__} defines {', '.join(copied)}: a static copy of libstdc++ is linked in "
                        "(look for -static-libstdc++ in LDFLAGS or the compiler's specs)")


def test_integers_in_check_messages_are_formatted():
    """In a child process: a crash there is this test's failure, not the session's end."""
    code = ("import torch, dflash2_kernels\n"
            "try:\n"
            "    torch.ops.dflash2.conv_forward_cpu(torch.randn(8, 32), torch.randn(7, 2, 2), torch.randn(2, 32), 4,\n"
            "                                       torch.float32)\n"
            "except ValueError as error:\n"
            "    print(error)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"the op's check crashed the process (exit {child.returncode}): {child.stderr[-2000:]}"
    assert "delta must have shape [8, K, G] (x's row count), got [7, 2, 2]." in child.stdout, child.stdout
