"""Which implementation runs: the ``DFLASH2_BACKEND`` switch and what is installed.

``DFLASH2_BACKEND`` is read on every call (not at import), so tests and users can flip
it without reloading the package:

- ``auto`` (default): Triton for CUDA tensors; for CPU tensors the C++ kernel when
  the extension is built, the vectorized PyTorch path otherwise (and wherever Triton
  is not importable);
- ``triton``: Triton everywhere; CPU tensors then need ``TRITON_INTERPRET=1``;
- ``reference``: the public functions and modules run the pure-PyTorch reference
  (upstream's code path, native autograd), bypassing the custom ops.
"""

from __future__ import annotations

import functools
import os

BACKENDS = ("auto", "triton", "reference")
BACKEND_ENV = "DFLASH2_BACKEND"


def selected_backend() -> str:
    """The backend the environment asks for, validated."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}; got {value!r}."
        )
    return value


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True

