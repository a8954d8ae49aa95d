"""Fused kernels for DFlash 2 speculative decoding.

Public API: :func:`grouped_dynamic_conv` (speculators' signature) and
:class:`GroupedDynamicCausalConv` (speculators' module and checkpoint layout); the
candidate selector's :class:`CandidateSelector` and its functional forms
:func:`score_candidates`, :func:`transition_scores` and :func:`pair_scores`; the
serving path's :func:`candidate_topk`, :func:`edge_scores`, :func:`walk` (also
``CandidateSelector.walk``), :func:`rejection_sample` and :func:`greedy_verify`; the
fused draft head :func:`draft_head` (losses and top-k candidates without [N, V] logits).

Patching upstream: :func:`patch` / :func:`unpatch` swap ours into one speculators or
NeMo draft model in place (sharing its Parameters); :func:`patch_speculators`,
:func:`patch_nemo` and their ``unpatch_*`` install ours in the upstream packages.

Memory: :func:`cpu_cache_bytes` and :func:`empty_cpu_cache` report and release what the
C++ ops keep of their freed large CPU results for reuse (``DFLASH2_CPU_CACHE_MB``).

The build: :func:`build_info` says what the extension was built with, the GPU
architectures its CUDA kernels hold code for, and which implementation each op takes here.
"""

from . import _extension  # registers the compiled ops before anything uses them
from . import compat, reference
from .conv import grouped_dynamic_conv
from .head import DraftHeadOutput, draft_head
from ._build_info import BuildInfo, build_info
from .memory import cpu_cache_bytes, empty_cpu_cache
from .modules import CandidateSelector, GroupedDynamicCausalConv
from .compat.patch import patch, patch_nemo, patch_speculators, unpatch, unpatch_nemo, unpatch_speculators
from .selector import pair_scores, score_candidates, transition_scores
from .serving import candidate_topk, edge_scores, greedy_verify, rejection_sample, walk
from . import distributed  # DTensor sharding rules for the ops above (after they are defined)
from . import _autocast  # torch.autocast rules for the ops above (after they are defined)

__version__ = "0.1.0"

__all__ = [
    "BuildInfo",
    "CandidateSelector",
    "DraftHeadOutput",
    "GroupedDynamicCausalConv",
    "__version__",
    "build_info",
    "candidate_topk",
    "compat",
    "cpu_cache_bytes",
    "draft_head",
    "edge_scores",
    "empty_cpu_cache",
    "greedy_verify",
    "grouped_dynamic_conv",
    "pair_scores",
    "patch",
    "patch_nemo",
    "patch_speculators",
    "reference",
    "rejection_sample",
    "score_candidates",
    "transition_scores",
    "unpatch",
    "unpatch_nemo",
    "unpatch_speculators",
    "walk",
]
