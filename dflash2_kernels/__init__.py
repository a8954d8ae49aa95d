"""Fused kernels for DFlash 2 speculative decoding.

Public API: :func:`grouped_dynamic_conv` (speculators' signature) and
:class:`GroupedDynamicCausalConv` (speculators' module and checkpoint layout); the
candidate selector's :class:`CandidateSelector` and its functional forms
:func:`score_candidates`, :func:`transition_scores` and :func:`pair_scores`.
"""

from . import _extension  # registers the compiled ops before anything uses them
from . import compat, reference
from .conv import grouped_dynamic_conv
from .modules import CandidateSelector, GroupedDynamicCausalConv
from .selector import pair_scores, score_candidates, transition_scores

__version__ = "0.1.0"

__all__ = [
    "CandidateSelector",
    "GroupedDynamicCausalConv",
    "__version__",
    "compat",
    "grouped_dynamic_conv",
    "pair_scores",
    "reference",
    "score_candidates",
    "transition_scores",
]
