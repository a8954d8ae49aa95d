"""Every fuzz target: its name (what reports and the runner's command line use) and the
generator that draws one of its cases from a :class:`Draw`.

Generators are imported on first use, so naming the targets (pytest's collection) does
not import the package, and the harness's self-test targets run without it.
"""

from __future__ import annotations

import importlib
from typing import Callable

from .case import Case
from .draw import Draw

# name -> "module:function" in tests/fuzz/
TARGETS: dict[str, str] = {
    # public functions and modules
    "grouped_dynamic_conv": "conv:grouped_dynamic_conv_case",
    "compat.grouped_dynamic_convolve": "conv:nemo_case",
    "GroupedDynamicCausalConv": "conv:module_case",
    "score_candidates": "selector:score_candidates_case",
    "pair_scores": "selector:pair_scores_case",
    "transition_scores": "selector:transition_scores_case",
    "CandidateSelector": "selector:module_case",
    "CandidateSelector.serving": "serving:selector_serving_case",
    "candidate_topk": "serving:candidate_topk_case",
    "edge_scores": "serving:edge_scores_case",
    "walk": "serving:walk_case",
    "rejection_sample": "serving:rejection_sample_case",
    "greedy_verify": "serving:greedy_verify_case",
    "draft_head": "head:draft_head_case",
    # raw ops: torch.ops.dflash2.<the name after "op.">
    "op.grouped_dynamic_conv": "conv:conv_op_case",
    "op.grouped_dynamic_conv_backward": "conv:conv_backward_op_case",
    "op.conv_forward_cpu": "conv:conv_forward_cpu_case",
    "op.conv_backward_cpu": "conv:conv_backward_cpu_case",
    "op.selector_scores": "selector:selector_scores_op_case",
    "op.selector_scores_backward": "selector:selector_scores_backward_op_case",
    "op.candidate_topk": "serving:candidate_topk_op_case",
    "op.select_path": "serving:select_path_op_case",
    "op.rejection_sample": "serving:rejection_sample_op_case",
    "op.draft_head": "head:draft_head_op_case",
    "op.draft_head_backward": "head:draft_head_backward_op_case",
    "op.draft_head_rows_cpu": "head:draft_head_rows_cpu_case",
    "op.draft_head_rows_backward_cpu": "head:draft_head_rows_backward_cpu_case",
    "op.draft_head_shard_stats_cpu": "head:draft_head_shard_stats_cpu_case",
    "op.draft_head_shard_rows_cpu": "head:draft_head_shard_rows_cpu_case",
    "op.cpu_cached_empty": "memory:cpu_cached_empty_case",
}

# Misbehaving on purpose: the harness's own test that crashes and hangs are reported.
SELF_TEST_TARGETS: dict[str, str] = {
    "selftest.crash": "selftest:crash_case",
    "selftest.hang": "selftest:hang_case",
}

RAW_OP_PREFIX = "op."


def generator(target: str) -> Callable[[Draw], Case]:
    module, function = {**TARGETS, **SELF_TEST_TARGETS}[target].split(":")
    return getattr(importlib.import_module(f".{module}", __package__), function)


def known(target: str) -> bool:
    return target in TARGETS or target in SELF_TEST_TARGETS


def draw_case(target: str, seed: int, index: int) -> Case:
    """Case ``index`` of ``target`` under ``seed``: the same on every run."""
    return generator(target)(Draw(target, seed, index))
