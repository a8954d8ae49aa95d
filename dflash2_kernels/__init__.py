"""Fused kernels for DFlash 2 speculative decoding.

Public API: :func:`grouped_dynamic_conv` (speculators' signature) and
:class:`GroupedDynamicCausalConv` (speculators' module and checkpoint layout).
"""

from . import compat, reference
from .conv import grouped_dynamic_conv
from .modules import GroupedDynamicCausalConv

__version__ = "0.1.0"

__all__ = ["GroupedDynamicCausalConv", "compat", "grouped_dynamic_conv", "reference", "__version__"]
