"""Whether the tests may run the Triton kernels under Triton's interpreter (no GPU).

The interpreter runs the kernels on CPU tensors through numpy, and some Triton releases'
interpreters are wrong under some numpy releases: they raise, or worse, write wrong
values. That is the interpreter's fault, not our kernels', so on such a pair the tests do
not interpret (tests/conftest.py leaves TRITON_INTERPRET unset) and every test that needs
the interpreter skips with :data:`SKIP_REASON`, which names the fault and the fix.

Imports nothing of this package: conftest decides before dflash2_kernels is imported
(triton.jit reads TRITON_INTERPRET when the kernels are defined).
"""

from __future__ import annotations

import importlib.metadata
import re

# (oldest and newest faulty Triton release, numpy release from which it fails, what was seen).
# Releases between the rows were not tried: a fault there fails the tests, as it should.
KNOWN_FAULTS = [
    ((0, 0), (3, 1), (2, 0), "raises 'only 0-dimensional arrays can be converted to Python scalars' (numpy "
                             "2.4.6) or writes NaN where the kernel writes numbers (numpy 2.2.6), where numpy "
                             "1.26.4 runs it right (seen with torch 2.5.1, Triton 3.1.0)"),
    ((3, 6), (3, 6), (2, 4), "breaks on numpy 2.4 and newer (seen with torch 2.11.0, Triton 3.6.0: DESIGN.md)"),
]


def _release(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def interpreter_fault(triton_version: str | None, numpy_version: str | None) -> str | None:
    """Why this Triton's interpreter cannot be trusted with this numpy, or None."""
    triton, numpy = _release(triton_version), _release(numpy_version)
    if triton is None or numpy is None:
        return None
    for oldest, newest, numpy_from, seen in KNOWN_FAULTS:
        if oldest <= triton <= newest and numpy >= numpy_from:
            limit = ".".join(map(str, numpy_from))
            return (f"Triton {triton_version}'s interpreter is wrong under numpy {numpy_version}: it {seen}. "
                    f"Not our kernels' fault: with numpy<{limit} (or a GPU) these tests run")
    return None


FAULT = interpreter_fault(_version("triton"), _version("numpy"))
SKIP_REASON = FAULT or "needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)"


def _rounds_float_scalars(triton_version: str | None) -> bool:
    """Triton 3.1's interpreter hands a kernel's float arguments over as Python floats, which
    its tl ops turn into fp32 constants (an fp64 logit_scale of -1.3 loses its low bits);
    its compiler honours the kernels' ``tl.float64`` annotations, and Triton 3.8's
    interpreter keeps them fp64 (seen with torch 2.5.1, Triton 3.1.0)."""
    release = _release(triton_version)
    return release is not None and release <= (3, 1)


FP64_SCALARS_FAULT = ("Triton's interpreter rounds float scalar arguments to fp32 (Triton 3.1); its compiled kernels "
                      "and later interpreters do not" if _rounds_float_scalars(_version("triton")) else None)
