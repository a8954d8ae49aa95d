"""The selector's CUDA kernels (csrc/kernels/selector_kernels.cu), run by the SIMT runtime:
the forward, the backward's row pass, its segmented chunk sums and carry pass, against
the float64 judge (SPEC section 4), bitwise equal across schedules."""

from __future__ import annotations

import pytest
import torch

from dflash2_kernels import reference

from ..contract import assert_within_contract
from ..selector_cases import CASES, F32, SelectorCase, exact_scores_with_grads, make_inputs, scores_with_grads
from .conftest import run_schedules

OUTPUTS = ("scores", "d_unary", "d_projected", "d_predecessor_codebook", "d_successor_codebook")

EMULATED_CASES = [
    *CASES,
    # Runs of one id far longer than a 64-entry segment chunk, for both codebooks: the
    # carry pass adds leading pieces across many chunks.
    SelectorCase((150,), 3, 16, 5),
    SelectorCase((70,), 2, 8, 4),
    # Rank past one warp's vector pass (32 lanes x 4 fp32), not a multiple of it.
    SelectorCase((3,), 20, 300, 6),
]


def fused_scores_with_grads(ops, unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad, *,
                            gathered: bool):
    """(S, dU, dP, dA, dB) from the raw forward and backward ops, as the autograd wrapper
    in dflash2_kernels/selector/ops.py calls them: flattened rows, P in the codebook
    dtype or fp32."""
    lead = predecessor_ids.shape
    k = candidate_ids.shape[-1]
    rank = predecessor.shape[1]
    p = projected if projected.dtype == predecessor.dtype else projected.float()
    rows_u = unary.reshape(-1, unary.shape[-1])
    rows_p = p.reshape(-1, rank)
    pred = predecessor_ids.reshape(-1)
    cand = candidate_ids.reshape(-1, k)
    out_dtype = unary.dtype if not gathered else torch.promote_types(
        unary.dtype, torch.promote_types(predecessor.dtype, projected.dtype))
    scores = ops.selector_scores(rows_u, rows_p, predecessor, successor, pred, cand, gathered, out_dtype)
    d_unary, d_projected, d_predecessor, d_successor = ops.selector_scores_backward(
        grad.reshape(-1, k).to(out_dtype), rows_p, predecessor, successor, pred, cand, gathered,
        unary.shape[-1], unary.dtype)
    return (scores.view(*lead, k), d_unary.view(unary.shape), d_projected.to(projected.dtype).view(projected.shape),
            d_predecessor, d_successor)


@pytest.mark.parametrize("case", EMULATED_CASES, ids=lambda c: c.id)
def test_score_candidates_kernels_within_contract(emulated, case):
    inputs = make_inputs(case, "cpu")
    got = run_schedules(emulated, lambda: fused_scores_with_grads(emulated, *inputs, gathered=False))
    exact = exact_scores_with_grads(*inputs)
    expected = scores_with_grads(reference.selector_score_candidates, *inputs)
    for name, kernel, ref, ex in zip(OUTPUTS, got, expected, exact):
        assert_within_contract(f"{case.id} {name}", kernel, ref, ex)


def _pair_scores_reordered(fn):
    return lambda u, p, a, b, pred, cand: fn(p, u, a, b, cand, pred)


PAIR_CASES = [c for c in EMULATED_CASES
              if torch.promote_types(c.codebook_dtype, c.projected_dtype) == c.codebook_dtype]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: c.id)
def test_pair_scores_kernels_within_contract(emulated, case):
    unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad = make_inputs(case, "cpu")
    gathered = unary.gather(-1, candidate_ids)
    inputs = (gathered, projected, predecessor, successor, predecessor_ids, candidate_ids, grad)
    got = run_schedules(emulated, lambda: fused_scores_with_grads(emulated, *inputs, gathered=True))
    pair = _pair_scores_reordered(reference.selector_pair_scores)
    exact = scores_with_grads(pair, *(t.double() if t.is_floating_point() else t for t in inputs))
    expected = scores_with_grads(pair, *inputs)
    for name, kernel, ref, ex in zip(OUTPUTS, got, expected, exact):
        assert_within_contract(f"{case.id} {name}", kernel, ref, ex)


def test_gathered_backward_returns_a_fresh_unary_gradient(emulated):
    """dU of gathered logits is dS itself in value, never the same tensor (the schema
    promises outputs that alias no input)."""
    unary, projected, predecessor, successor, pred, cand, grad = make_inputs(CASES[0], "cpu")
    grad_scores = grad.contiguous()
    d_unary, *_ = emulated.selector_scores_backward(grad_scores, projected, predecessor, successor, pred, cand, True,
                                                    cand.shape[-1], grad_scores.dtype)
    assert torch.equal(d_unary, grad_scores)
    assert d_unary.data_ptr() != grad_scores.data_ptr()


def test_out_of_range_ids_give_nan_scores_and_no_gradient(emulated):
    case = SelectorCase((4,), 30, 40, 6)
    unary, projected, predecessor, successor, pred, cand, grad = make_inputs(case, "cpu", seed=3)
    pred = pred.clone()
    cand = cand.clone()
    pred[1] = case.vocab  # the whole row has no context
    cand[2, 3] = -1
    cand[3, 0] = 10**9
    scores = run_schedules(emulated, lambda: emulated.selector_scores(unary, projected, predecessor, successor, pred,
                                                                      cand, False, F32))
    bad = torch.zeros_like(scores, dtype=torch.bool)
    bad[1] = True
    bad[2, 3] = bad[3, 0] = True
    assert scores[bad].isnan().all() and not scores[~bad].isnan().any()
    expected, exact = (reference.selector_score_candidates(
        *(t.to(dtype) for t in (unary, projected, predecessor, successor)), pred.clamp(0, 29), cand.clamp(0, 29))[~bad]
        for dtype in (F32, torch.float64))
    assert_within_contract("valid scores", scores[~bad], expected, exact)

    _, d_projected, d_predecessor, d_successor = run_schedules(
        emulated, lambda: emulated.selector_scores_backward(grad, projected, predecessor, successor, pred, cand, False,
                                                            case.vocab, F32))
    assert (d_projected[1] == 0).all(), "a row without a valid predecessor has no gradient"
    for table in (d_predecessor, d_successor):
        assert not table.isnan().any()


def test_codebook_gradients_are_deterministic_at_scale(emulated):
    """Thousands of repeated ids: the segmented sums cross many chunks in both passes."""
    case = SelectorCase((2048,), 5, 8, 3)
    unary, projected, predecessor, successor, pred, cand, grad = make_inputs(case, "cpu", seed=7)
    _, _, d_predecessor, d_successor = run_schedules(
        emulated, lambda: emulated.selector_scores_backward(grad, projected, predecessor, successor, pred, cand, False,
                                                            case.vocab, F32))
    exact = exact_scores_with_grads(unary, projected, predecessor, successor, pred, cand, grad)
    expected = scores_with_grads(reference.selector_score_candidates, unary, projected, predecessor, successor, pred,
                                 cand, grad)
    assert_within_contract("dA", d_predecessor, expected[3], exact[3])
    assert_within_contract("dB", d_successor, expected[4], exact[4])


@pytest.mark.parametrize("ops_name", ["emulated", "cpu"])
def test_empty_codebooks_are_an_error(emulated, ops_name):
    """V = 0: no row 0 to stand in for a bad id on CUDA; an error on every backend."""
    ops = emulated if ops_name == "emulated" else torch.ops.dflash2
    empty = torch.zeros(0, 8)
    projected = torch.randn(3, 8)
    ids = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="V >= 1"):
        ops.selector_scores(torch.zeros(3, 0), projected, empty, empty, ids, ids.view(3, 1), False, F32)
    with pytest.raises(ValueError, match="V >= 1"):
        ops.selector_scores_backward(torch.ones(3, 1), projected, empty, empty, ids, ids.view(3, 1), False, 0, F32)
