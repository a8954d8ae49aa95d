"""Upstream signatures: NeMo Automodel's conv on the fused op."""

from .nemo import grouped_dynamic_convolve

__all__ = ["grouped_dynamic_convolve"]
