"""Upstream signatures on the fused ops.

:mod:`.nemo`: NeMo Automodel 0.7.0's DFlash 2 pieces (``GroupedDynamicCausalConv``,
``CandidateSelector``, ``grouped_dynamic_convolve``, ``dflash2_rejection_sample``).
``grouped_dynamic_convolve`` is also here, where it has always been.
"""

from . import nemo
from .nemo import grouped_dynamic_convolve

__all__ = ["grouped_dynamic_convolve", "nemo"]
