"""The serving path (SPEC sections 2 and 3): the candidates' top-k, the all-pairs edge
scores and the walk (CUDA C++ with a C++ CPU twin), and batched lossless verification."""

from .verify import greedy_verify, rejection_sample
from .walk import candidate_topk, edge_scores, walk

__all__ = ["candidate_topk", "edge_scores", "greedy_verify", "rejection_sample", "walk"]
