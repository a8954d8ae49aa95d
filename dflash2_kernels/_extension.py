"""The compiled extension, when it was built: ``dflash2_kernels._C``.

Importing it registers the C++ ops (``torch.ops.dflash2.*``) and their CPU and, in a
CUDA build, CUDA kernels. A pure-Python install (no build) leaves the ops missing;
callers fall back to the PyTorch paths. ``DFLASH2_EXTENSION_PATH`` names another build
of ``_C`` to load instead (the tests' sanitized build: scripts/asan.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


def _load_extension_from(path: str) -> None:
    spec = importlib.util.spec_from_file_location(f"{__package__}._C", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"DFLASH2_EXTENSION_PATH={path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


try:
    if os.environ.get("DFLASH2_EXTENSION_PATH"):
        _load_extension_from(os.environ["DFLASH2_EXTENSION_PATH"])
    else:
        from . import _C  # noqa: F401

    EXTENSION_LOADED = True
    EXTENSION_ERROR: str | None = None
except ImportError as error:  # not built: pure-Python fallbacks take over
    EXTENSION_LOADED = False
    EXTENSION_ERROR = str(error)
# The loaded module (its build_info, cuda_code_for: build_info.py), None when not built.
EXTENSION = sys.modules.get(f"{__package__}._C") if EXTENSION_LOADED else None


# Registration does not change while a graph is traced: torch.compile takes the answer
# as a constant instead of tracing the (untraceable) dispatcher query. Torch 2.5's dynamo
# stores that constant in the compiled caller's module under the function's own name,
# overwriting a global of that name there (a caller's imported ``has_kernel``): the
# function is named so that no caller has such a global.
@torch.compiler.assume_constant_result
def _dflash2_op_has_kernel(op_name: str, device_type: str) -> bool:
    """Whether ``torch.ops.dflash2.<op_name>`` has a kernel for ``device_type``."""
    if not EXTENSION_LOADED:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash2::{op_name}", key)


has_kernel = _dflash2_op_has_kernel
