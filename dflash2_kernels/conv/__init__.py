"""The grouped dynamic causal conv: Triton kernels, launchers, the vectorized path, the op."""

from .ops import grouped_dynamic_conv

__all__ = ["grouped_dynamic_conv"]
