"""The serving path's CUDA kernels (csrc/kernels/serving_kernels.cu, verify_kernels.cu),
run by the SIMT runtime: the top-k partial and merge, select_path (edges, the last-block
counter, the walk), and the rejection sampler's mass and bonus passes. Judged against
the references and the C++ CPU twin, bitwise equal across schedules."""

from __future__ import annotations

import pytest
import torch

from dflash2_kernels import reference
from dflash2_kernels._extension import has_kernel

from ..contract import assert_within_contract
from ..serving_cases import (
    BLOCK_CASES,
    VERIFY_CASES,
    BlockCase,
    VerifyCase,
    as_float64,
    assert_sampled_walk_follows_its_edges,
    block_inputs,
    select_path,
    topk_logits,
    verify_inputs,
    walk_over_edges,
)
from .conftest import run_schedules

# --- top-k ---------------------------------------------------------------------------

# Below one 1,024-element slice, several slices with a ragged end, k at the 32-lane limit.
TOPK_SHAPES = [(3, 1, 1), (5, 37, 7), (4, 1000, 16), (2, 2053, 32), (2, 9001, 16), (1, 8, 8)]


@pytest.mark.parametrize("kind", ["random", "ties", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", TOPK_SHAPES, ids=str)
def test_candidate_topk_equals_torch_topk(emulated, shape, dtype, kind):
    rows, vocab, top_k = shape
    logits = topk_logits(rows, vocab, dtype, kind)
    values, ids = run_schedules(emulated, lambda: emulated.candidate_topk(logits, top_k))
    expected_values, _ = torch.topk(logits, top_k, dim=-1)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(logits.gather(-1, ids), values, rtol=0, atol=0, equal_nan=True)
    if has_kernel("candidate_topk", "cpu"):  # the twin breaks ties the same way: identical ids
        assert torch.equal(ids, torch.ops.dflash2.candidate_topk(logits, top_k)[1])


def test_candidate_topk_unaligned_rows_take_the_scalar_path(emulated):
    wide = torch.randn(3, 1031, generator=torch.Generator().manual_seed(3))
    logits = wide[:, 1:1030]  # rows 1031 floats apart: no 16-byte alignment
    values, ids = run_schedules(emulated, lambda: emulated.candidate_topk(logits, 12))
    expected_values, expected_ids = torch.topk(logits, 12, dim=-1)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


# --- select_path: edges, the counter, the walk ---------------------------------------------


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.id)
def test_select_path_edges_and_greedy_walk(emulated, case):
    inputs = block_inputs(case, "cpu")
    path, candidates, draft_probs, edges = run_schedules(
        emulated, lambda: select_path(emulated, *inputs, case.top_k, 0.0, torch.empty(0)))
    expected, expected_candidates = reference.serving_edge_scores(*inputs, case.top_k)
    exact, _ = reference.serving_edge_scores(*as_float64(*inputs), case.top_k)
    assert torch.equal(candidates, expected_candidates)
    assert_within_contract(case.id, edges, expected, exact)
    assert torch.equal(path, walk_over_edges(edges, candidates))
    assert torch.equal(draft_probs, (candidates == path.unsqueeze(-1)).float())


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.id)
def test_select_path_equals_the_cpu_twin(emulated, case):
    """The same top-k order, the same edge arithmetic (16 interleaved partial sums,
    combined pairwise, no fused multiply-add): the same bits, so the same greedy path."""
    if not has_kernel("select_path", "cpu"):
        pytest.skip("the C++ CPU twin is not built")
    inputs = block_inputs(case, "cpu", seed=1)
    emulated.set_schedule_seed(1)
    got = select_path(emulated, *inputs, case.top_k, 0.0, torch.empty(0))
    twin = select_path(torch.ops.dflash2, *inputs, case.top_k, 0.0, torch.empty(0))
    for name, a, b in zip(("path", "candidate_ids", "draft_probs", "edges"), got, twin):
        assert torch.equal(a, b), f"{name} differs from the CPU twin"


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("case", BLOCK_CASES[1:5], ids=lambda c: c.id)
def test_sampled_walk_proposal_is_softmax_along_its_path(emulated, case, temperature):
    inputs = block_inputs(case, "cpu", seed=3, scale=2.0)
    uniforms = torch.rand(case.batch, case.draft, generator=torch.Generator().manual_seed(4))
    outputs = run_schedules(emulated, lambda: select_path(emulated, *inputs, case.top_k, temperature, uniforms))
    assert_sampled_walk_follows_its_edges(*outputs, uniforms, temperature)


def test_out_of_range_anchor_gives_nan_edges_and_no_path(emulated):
    case = BlockCase(3, 4, 300, 32, 8)
    projected, logits, anchors, a, b = block_inputs(case, "cpu", seed=6)
    anchors = torch.tensor([5, case.vocab, -3])
    path, candidates, _, edges = run_schedules(
        emulated, lambda: select_path(emulated, projected, logits, anchors, a, b, case.top_k, 0.0, torch.empty(0)))
    for sequence in (1, 2):
        assert edges[sequence, 0].isnan().all() and (path[sequence] == -1).all()
        assert not edges[sequence, 1:].isnan().any()
    assert not edges[0].isnan().any() and (path[0] >= 0).all()
    expected, _ = reference.serving_edge_scores(projected[:1], logits[:1], anchors[:1], a, b, case.top_k)
    exact, _ = reference.serving_edge_scores(*as_float64(projected[:1], logits[:1], anchors[:1], a, b), case.top_k)
    assert_within_contract("valid sequence", edges[:1], expected, exact)


@pytest.mark.parametrize("case, scale, seed", [(BlockCase(2, 3, 500, 256, 16), 4.0, 8),
                                               (BlockCase(4, 7, 2000, 256, 32), 0.5, 1)], ids=["k16", "k32"])
def test_edge_dot_products_are_summed_pairwise(emulated, case, scale, seed):
    """r = 256 fp32: each edge is a 256-term dot product. Held to the reference's own
    error (1x, tighter than SPEC's 2x): on these inputs one serial chain of fused
    multiply-adds is 1.3-1.7x the reference, the 16 interleaved partial sums combined
    pairwise 0.3-0.5x (numpy simulation of both orders against float64)."""
    inputs = block_inputs(case, "cpu", seed=seed, scale=scale)
    _, _, _, edges = select_path(emulated, *inputs, case.top_k, 0.0, torch.empty(0))
    expected, _ = reference.serving_edge_scores(*inputs, case.top_k)
    exact, _ = reference.serving_edge_scores(*as_float64(*inputs), case.top_k)
    kernel_error = (edges.double() - exact).abs().max().item()
    reference_error = (expected.double() - exact).abs().max().item()
    assert kernel_error <= reference_error, f"edge error {kernel_error:.3e} > reference {reference_error:.3e}"


# --- rejection sampling ----------------------------------------------------------------


@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.id)
def test_rejection_sample_equals_reference_draw_by_draw(emulated, case):
    tokens, target, proposal, candidates, uniforms = verify_inputs(case, "cpu")
    accepted, bonus = run_schedules(
        emulated, lambda: emulated.rejection_sample(tokens, target, proposal, candidates, uniforms))
    expected_accepted, expected_bonus = reference.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(bonus, expected_bonus)
    if has_kernel("rejection_sample", "cpu"):
        twin_accepted, twin_bonus = torch.ops.dflash2.rejection_sample(tokens, target, proposal, candidates, uniforms)
        assert torch.equal(accepted, twin_accepted) and torch.equal(bonus, twin_bonus)


def test_rejection_never_accepts_a_token_without_target_mass(emulated):
    case = VERIFY_CASES[1]
    tokens, target, proposal, candidates, uniforms = verify_inputs(case, "cpu")
    target = target.clone()
    target[:, 0].scatter_(-1, tokens[:, :1], 0.0)
    accepted, bonus = emulated.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert (accepted == 0).all()
    assert (bonus != tokens[:, 0]).all() and (bonus >= 0).all() and (bonus < case.vocab).all()


def test_out_of_range_draft_token_is_never_accepted(emulated):
    """On CUDA a bad id cannot raise without a host sync: it has no target mass."""
    tokens, target, proposal, candidates, uniforms = verify_inputs(VERIFY_CASES[1], "cpu", seed=3)
    tokens = tokens.clone()
    tokens[:, 0] = torch.tensor([-1, VERIFY_CASES[1].vocab] * (tokens.shape[0] // 2))
    accepted, bonus = run_schedules(
        emulated, lambda: emulated.rejection_sample(tokens, target, proposal, candidates, uniforms))
    assert (accepted == 0).all() and (bonus >= 0).all()


def test_rejection_row_without_mass_gives_bonus_minus_one(emulated):
    tokens, target, proposal, candidates, uniforms = verify_inputs(VERIFY_CASES[2], "cpu")
    target = target.clone()
    target[0] = 0.0
    accepted, bonus = emulated.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert accepted[0] == 0 and bonus[0] == -1
    assert (bonus[1:] >= 0).all()


@pytest.mark.parametrize("vocab", [300, 5000], ids=["one-slice", "two-slices"])
def test_rejection_sample_with_more_candidates_than_a_slice_holds(emulated, vocab):
    """k = 100: a 4,096-token slice can hold more candidates than the 64 kept in shared
    memory; the bonus then reads the whole candidate row, with the same sums."""
    case = VerifyCase(24, 3, vocab, 100)
    tokens, target, proposal, candidates, uniforms = verify_inputs(case, "cpu", seed=4)
    accepted, bonus = run_schedules(
        emulated, lambda: emulated.rejection_sample(tokens, target, proposal, candidates, uniforms))
    expected_accepted, expected_bonus = reference.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert torch.equal(accepted, expected_accepted) and torch.equal(bonus, expected_bonus)
    assert (accepted < case.draft).any(), "no rejection: the residual was never drawn from"


@pytest.mark.parametrize("ops_name", ["emulated", "cpu"])
def test_rejection_sample_vocabulary_limits_are_the_same_everywhere(emulated, ops_name):
    ops = emulated if ops_name == "emulated" else torch.ops.dflash2
    if ops_name == "cpu" and not has_kernel("rejection_sample", "cpu"):
        pytest.skip("the C++ CPU twin is not built")
    tokens = torch.zeros(1, 1, dtype=torch.long)
    proposal = torch.ones(1, 1, 1)
    candidates = torch.zeros(1, 1, dtype=torch.long).view(1, 1, 1)
    uniforms = torch.rand(1, 2)
    for vocab in (0, (1 << 22) + 1):
        with pytest.raises(ValueError, match="vocabulary of 1 to 4194304"):
            ops.rejection_sample(tokens, torch.zeros(1, 2, vocab), proposal, candidates, uniforms)


@pytest.mark.parametrize("ops_name", ["emulated", "cpu"])
def test_temperature_that_rounds_to_zero_is_greedy(emulated, ops_name):
    """The kernels take a float32 temperature: 1e-50 is 0 there, so the walk is greedy
    (one-hot proposals, no uniforms read) on every backend."""
    ops = emulated if ops_name == "emulated" else torch.ops.dflash2
    if ops_name == "cpu" and not has_kernel("select_path", "cpu"):
        pytest.skip("the C++ CPU twin is not built")
    case = BLOCK_CASES[1]
    inputs = block_inputs(case, "cpu", seed=2)
    path, candidates, draft_probs, _ = select_path(ops, *inputs, case.top_k, 1e-50, torch.empty(0))
    greedy = select_path(ops, *inputs, case.top_k, 0.0, torch.empty(0))
    assert torch.equal(path, greedy[0])
    assert torch.equal(draft_probs, (candidates == path.unsqueeze(-1)).float())
    with pytest.raises(ValueError, match="temperature"):
        select_path(ops, *inputs, case.top_k, 1e300, torch.rand(case.batch, case.draft))
