"""The selector's fused op against the float64 judge by the numerical contract."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_LOADED

from .contract import assert_within_contract
from .selector_cases import CASES, exact_scores_with_grads, make_inputs, scores_with_grads

pytestmark = pytest.mark.skipif(not EXTENSION_LOADED, reason="the compiled extension is not built")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
OUTPUTS = ("scores", "d_unary", "d_projected", "d_predecessor_codebook", "d_successor_codebook")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_score_candidates_within_contract(case, device, poison_empty):
    inputs = make_inputs(case, device)
    exact = exact_scores_with_grads(*inputs)
    expected = scores_with_grads(reference.selector_score_candidates, *inputs)
    got = scores_with_grads(dk.score_candidates, *inputs)
    for name, kernel, ref, ex in zip(OUTPUTS, got, expected, exact):
        assert_within_contract(f"{case.id} {name}", kernel, ref, ex)


def _pair_inputs(case, device):
    unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad = make_inputs(case, device)
    gathered = unary.gather(-1, candidate_ids)
    return gathered, projected, predecessor, successor, predecessor_ids, candidate_ids, grad


def _pair_scores_reordered(fn):
    # scores_with_grads passes (unary, projected, A, B, pred, cand); pair_scores' order differs.
    return lambda u, p, a, b, pred, cand: fn(p, u, a, b, cand, pred)


# NeMo's einsum needs the gate (A[pred] * P, promoted) in B's dtype.
PAIR_CASES = [c for c in CASES if torch.promote_types(c.codebook_dtype, c.projected_dtype) == c.codebook_dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: c.id)
def test_pair_scores_within_contract(case, device, poison_empty):
    inputs = _pair_inputs(case, device)
    exact = scores_with_grads(
        _pair_scores_reordered(reference.selector_pair_scores), *(t.double() if t.is_floating_point() else t
                                                                   for t in inputs)
    )
    expected = scores_with_grads(_pair_scores_reordered(reference.selector_pair_scores), *inputs)
    got = scores_with_grads(_pair_scores_reordered(dk.pair_scores), *inputs)
    for name, kernel, ref, ex in zip(OUTPUTS, got, expected, exact):
        assert_within_contract(f"{case.id} {name}", kernel, ref, ex)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_bitwise_deterministic(device):
    case = CASES[1]  # repeated ids: the segmented sums add several terms per id
    inputs = make_inputs(case, device, seed=5)
    first = scores_with_grads(dk.score_candidates, *inputs)
    second = scores_with_grads(dk.score_candidates, *inputs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [c for c in CASES if c.lead != (0,)], ids=lambda c: c.id)
def test_cpu_forward_orders_give_the_same_bits(case, monkeypatch):
    """The CPU forward sums each transition term in row order or, for a large batch over
    a large codebook, in candidate-id order (csrc/selector_cpu.cpp): the same lane_dot
    either way, so the same bits, for both unary forms."""
    unary, projected, predecessor, successor, predecessor_ids, candidate_ids, _ = make_inputs(case, "cpu")
    gathered = unary.gather(-1, candidate_ids)
    results = {}
    for order in ("row", "candidate"):
        monkeypatch.setenv("DFLASH2_SELECTOR_ORDER", order)
        results[order] = (
            dk.score_candidates(unary, projected, predecessor, successor, predecessor_ids, candidate_ids),
            dk.transition_scores(projected, predecessor, successor, predecessor_ids, candidate_ids),
            dk.pair_scores(projected, gathered, predecessor, successor, candidate_ids, predecessor_ids),
        )
    for by_row, by_candidate in zip(results["row"], results["candidate"]):
        assert by_row.dtype == by_candidate.dtype and torch.equal(by_row, by_candidate)


@pytest.mark.parametrize("device", DEVICES)
def test_transition_scores_match_reference(device):
    case = CASES[2]
    _, projected, predecessor, successor, predecessor_ids, candidate_ids, _ = make_inputs(case, device)
    got = dk.transition_scores(projected, predecessor, successor, predecessor_ids, candidate_ids)
    expected = reference.selector_transition_scores(projected, predecessor, successor, predecessor_ids,
                                                    candidate_ids)
    exact = reference.selector_transition_scores(projected.double(), predecessor.double(), successor.double(),
                                                 predecessor_ids, candidate_ids)
    assert got.dtype == predecessor.dtype
    assert_within_contract("transition scores", got, expected, exact)


@pytest.mark.parametrize("device", DEVICES)
def test_unary_without_grad_gets_none(device):
    unary, projected, predecessor, successor, predecessor_ids, candidate_ids, grad = make_inputs(CASES[0], device)
    projected.requires_grad_()
    scores = dk.score_candidates(unary, projected, predecessor, successor, predecessor_ids, candidate_ids)
    (d_projected,) = torch.autograd.grad(scores, (projected,), grad)
    judged = []
    for dtype in (projected.dtype, torch.float64):
        leaf = projected.detach().to(dtype).requires_grad_()
        scores = reference.selector_score_candidates(unary.to(dtype), leaf, predecessor.to(dtype),
                                                     successor.to(dtype), predecessor_ids, candidate_ids)
        judged.append(torch.autograd.grad(scores, (leaf,), grad.to(dtype))[0])
    assert_within_contract("d_projected", d_projected, *judged)
