"""The candidate selector's fused scoring ops (CUDA C++ with a C++ CPU twin)."""

from .ops import pair_scores, score_candidates, transition_scores

__all__ = ["pair_scores", "score_candidates", "transition_scores"]
