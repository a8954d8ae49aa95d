"""The serving path against its references: top-k, edge scores, the walk, verification.

Every test runs on the C++ CPU twin and, with a GPU, on the CUDA kernels (the `gpu`
marked parameter). Sampling is checked draw by draw here through fixed uniforms;
tests/test_serving_stats.py checks the distributions.
"""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import has_kernel

from .contract import assert_within_contract
from .serving_cases import (
    BLOCK_CASES,
    DEVICES,
    VERIFY_CASES,
    BlockCase,
    as_float64,
    assert_sampled_walk_follows_its_edges,
    block_inputs,
    select_path,
    topk_logits,
    verify_inputs,
    walk_over_edges,
)


def require_kernel(op: str, device: str) -> None:
    if not has_kernel(op, device):
        pytest.skip(f"dflash2::{op} has no {device} kernel in this build")


# --- top-k ---------------------------------------------------------------------------

TOPK_SHAPES = [(3, 1, 1), (5, 37, 7), (4, 1000, 16), (2, 2053, 32), (3, 70_001, 16), (1, 8, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", TOPK_SHAPES, ids=str)
def test_candidate_topk_values_equal_torch_topk(shape, dtype, kind, device):
    require_kernel("candidate_topk", device)
    rows, vocab, top_k = shape
    logits = topk_logits(rows, vocab, dtype, kind).to(device)
    values, ids = dk.candidate_topk(logits, top_k)
    expected = torch.topk(logits, top_k, dim=-1).values
    assert values.dtype == dtype and ids.dtype == torch.int64
    torch.testing.assert_close(values, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(logits.gather(-1, ids), values, rtol=0, atol=0, equal_nan=True)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "a row repeats an index"


@pytest.mark.parametrize("device", DEVICES)
def test_candidate_topk_leading_dims_and_strided_rows(device):
    require_kernel("candidate_topk", device)
    wide = torch.randn(2, 3, 900, generator=torch.Generator().manual_seed(3)).to(device)
    logits = wide[..., 50:850]  # rows 900 apart: not contiguous, unit last stride
    values, ids = dk.candidate_topk(logits, 9)
    expected_values, expected_ids = torch.topk(logits, 9, dim=-1)
    assert values.shape == (2, 3, 9)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


# --- edge scores and the walk ----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.id)
def test_edge_scores_within_contract(case, device):
    require_kernel("select_path", device)
    inputs = block_inputs(case, device)
    edges, candidates = dk.edge_scores(*inputs, case.top_k)
    expected, expected_candidates = reference.serving_edge_scores(*inputs, case.top_k)
    exact, _ = reference.serving_edge_scores(*as_float64(*inputs), case.top_k)
    assert torch.equal(candidates, expected_candidates)
    assert edges.shape == (case.batch, case.draft, case.top_k, case.top_k)
    assert_within_contract(case.id, edges.cpu(), expected.cpu(), exact.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.id)
def test_greedy_walk_follows_its_edges(case, device):
    require_kernel("select_path", device)
    inputs = block_inputs(case, device, seed=1)
    path, candidates, draft_probs = dk.walk(*inputs, case.top_k, 0.0)
    edges, _ = dk.edge_scores(*inputs, case.top_k)
    assert draft_probs is None
    assert torch.equal(path, walk_over_edges(edges, candidates))


FP32_CASES = [c for c in BLOCK_CASES if c.logits_dtype == c.codebook_dtype == torch.float32 and not c.projected_dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: c.id)
def test_greedy_walk_equals_nemo_walk_in_float32(case, device):
    require_kernel("select_path", device)
    inputs = block_inputs(case, device, seed=2)
    path, candidates, _ = dk.walk(*inputs, case.top_k, 0.0)
    expected_path, expected_candidates, _ = reference.serving_walk(*inputs, case.top_k, 0.0)
    assert torch.equal(candidates, expected_candidates)
    assert torch.equal(path, expected_path)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("case", BLOCK_CASES[1:5], ids=lambda c: c.id)
def test_sampled_walk_proposal_is_softmax_along_its_path(case, temperature, device):
    require_kernel("select_path", device)
    inputs = block_inputs(case, device, seed=3, scale=2.0)
    uniforms = torch.rand(case.batch, case.draft, generator=torch.Generator().manual_seed(4)).to(device)
    outputs = select_path(torch.ops.dflash2, *inputs, case.top_k, temperature, uniforms)
    assert_sampled_walk_follows_its_edges(*outputs, uniforms, temperature)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FP32_CASES[:3], ids=lambda c: c.id)
def test_sampled_walk_through_the_public_api_equals_the_reference(case, device):
    """Same generator state -> same uniforms -> the reference draws the same path."""
    require_kernel("select_path", device)
    inputs = block_inputs(case, device, seed=5, scale=2.0)
    generator = torch.Generator(device).manual_seed(11)
    path, candidates, draft_probs = dk.walk(*inputs, case.top_k, 0.7, generator=generator)
    uniforms = torch.rand(case.batch, case.draft, generator=torch.Generator(device).manual_seed(11), device=device)
    expected_path, _, expected_probs = reference.serving_walk(*inputs, case.top_k, 0.7, uniforms)
    torch.testing.assert_close(draft_probs, expected_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(path, expected_path)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_op_returns_one_hot_proposal(device):
    require_kernel("select_path", device)
    case = BLOCK_CASES[2]
    inputs = block_inputs(case, device)
    path, candidates, draft_probs, _ = select_path(torch.ops.dflash2, *inputs, case.top_k, 0.0,
                                                  torch.empty(0, device=device))
    chosen = (candidates == path.unsqueeze(-1)).float()
    assert torch.equal(draft_probs, chosen)


def test_module_walk_uses_its_parameters():
    require_kernel("select_path", "cpu")
    selector = dk.CandidateSelector(300, 24, 16, 6)
    with torch.no_grad():
        selector.successor_codebook.normal_(std=0.5)
        selector.predecessor_codebook.normal_(std=0.5)
    hidden = torch.randn(2, 5, 24)
    logits = torch.randn(2, 5, 300)
    anchors = torch.tensor([3, 299])
    with torch.no_grad():
        path, candidates, probs = selector.walk(hidden, logits, anchors, 0.0)
        projected = selector.hidden_projection(hidden)
        expected = reference.serving_walk(projected, logits, anchors, selector.predecessor_codebook,
                                          selector.successor_codebook, 6, 0.0)
        edges, _ = selector.edge_scores(hidden, logits, anchors)
    assert probs is None and edges.shape == (2, 5, 6, 6)
    assert torch.equal(path, expected[0]) and torch.equal(candidates, expected[1])


# --- verification --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: c.id)
def test_rejection_sample_equals_reference_draw_by_draw(case, device):
    require_kernel("rejection_sample", device)
    tokens, target, proposal, candidates, uniforms = verify_inputs(case, device)
    accepted, bonus = torch.ops.dflash2.rejection_sample(tokens, target, proposal, candidates, uniforms)
    expected_accepted, expected_bonus = reference.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(bonus, expected_bonus)
    if case.proposal == "close":
        assert (accepted == case.draft).any(), "no all-accepted block: the case does not test p_D"
    if case.proposal == "covering":
        assert (accepted < case.draft).any(), "no rejection: the case does not test the empty residual"


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_public_api_draws_from_the_generator(device):
    require_kernel("rejection_sample", device)
    tokens, target, proposal, candidates, _ = verify_inputs(VERIFY_CASES[2], device, seed=9)
    generator = torch.Generator(device).manual_seed(5)
    accepted, bonus = dk.rejection_sample(tokens, target, proposal, candidates, generator=generator)
    uniforms = torch.rand(tokens.shape[0], tokens.shape[1] + 1, device=device,
                          generator=torch.Generator(device).manual_seed(5))
    expected = reference.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert torch.equal(accepted, expected[0]) and torch.equal(bonus, expected[1])


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_never_accepts_a_token_without_target_mass(device):
    require_kernel("rejection_sample", device)
    case = VERIFY_CASES[1]
    tokens, target, proposal, candidates, uniforms = verify_inputs(case, device)
    target = target.clone()
    target[:, 0].scatter_(-1, tokens[:, :1], 0.0)
    accepted, bonus = torch.ops.dflash2.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert (accepted == 0).all()
    assert (bonus != tokens[:, 0]).all() and (bonus >= 0).all() and (bonus < case.vocab).all()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify(device):
    logits = torch.full((3, 4, 6), -1.0, device=device)
    argmax = torch.tensor([[1, 2, 3, 4], [5, 0, 0, 1], [2, 2, 2, 2]], device=device)
    logits.scatter_(-1, argmax.unsqueeze(-1), 1.0)
    draft = torch.tensor([[1, 2, 3], [5, 1, 0], [0, 2, 2]], device=device)
    accepted, bonus = dk.greedy_verify(draft, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert bonus.tolist() == [4, 0, 2]


# --- errors --------------------------------------------------------------------------

SMALL = BlockCase(2, 3, 40, 8, 4)


def _small_block():
    return list(block_inputs(SMALL, "cpu"))


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda x: x.__setitem__(1, x[1].double()), TypeError, "logits"),
        (lambda x: x.__setitem__(1, x[1][:, :, :30]), ValueError, "logits"),
        (lambda x: x.__setitem__(0, x[0][:, :2]), ValueError, "projected"),
        (lambda x: x.__setitem__(2, x[2].float()), TypeError, "anchor_ids"),
        (lambda x: x.__setitem__(2, x[2][:1]), ValueError, "anchor_ids"),
        (lambda x: x.__setitem__(4, x[4][:, :5]), ValueError, "successor_codebook"),
        (lambda x: x.__setitem__(4, x[4].half()), TypeError, "codebooks"),
        (lambda x: x.__setitem__(3, x[3].int()), TypeError, "predecessor_codebook"),
    ],
    ids=["logits-f64", "logits-vocab", "projected-shape", "anchor-float", "anchor-shape", "successor-shape",
         "codebook-dtypes", "codebook-int"],
)
def test_walk_bad_arguments_raise_naming_them(mutate, error, match):
    inputs = _small_block()
    mutate(inputs)
    with pytest.raises(error, match=match):
        dk.walk(*inputs, SMALL.top_k, 0.0)


@pytest.mark.parametrize("top_k, error", [(0, ValueError), (33, ValueError), (41, ValueError), (2.0, TypeError)])
def test_bad_top_k(top_k, error):
    with pytest.raises(error, match="top_k"):
        dk.walk(*_small_block(), top_k, 0.0)
    with pytest.raises(error, match="top_k"):
        dk.candidate_topk(torch.randn(2, 40), top_k)


@pytest.mark.parametrize("temperature, error", [(-0.5, ValueError), (float("nan"), ValueError),
                                                (float("inf"), ValueError), ("hot", TypeError)])
def test_bad_temperature(temperature, error):
    with pytest.raises(error, match="temperature"):
        dk.walk(*_small_block(), SMALL.top_k, temperature)


def test_bad_generator():
    with pytest.raises(TypeError, match="generator"):
        dk.walk(*_small_block(), SMALL.top_k, 1.0, generator=123)


def test_out_of_range_anchor_raises_on_cpu():
    require_kernel("select_path", "cpu")
    inputs = _small_block()
    inputs[2] = torch.tensor([3, SMALL.vocab])
    with pytest.raises(IndexError, match="anchor_ids"):
        dk.walk(*inputs, SMALL.top_k, 0.0)


def _verify_args():
    return list(verify_inputs(VERIFY_CASES[2], "cpu")[:4])


@pytest.mark.parametrize(
    "index, value, error, match",
    [
        (0, lambda x: x.float(), TypeError, "draft_tokens"),
        (0, lambda x: x[:, :2], ValueError, "target_probs"),
        (1, lambda x: x[:, :-1], ValueError, "target_probs"),
        (1, lambda x: x.double(), TypeError, "target_probs"),
        (2, lambda x: x[..., :3], ValueError, "candidate_ids"),
        (3, lambda x: x.float(), TypeError, "candidate_ids"),
        (2, lambda x: x[:1], ValueError, "draft_probs"),
    ],
)
def test_rejection_sample_bad_arguments(index, value, error, match):
    args = _verify_args()
    args[index] = value(args[index])
    with pytest.raises(error, match=match):
        dk.rejection_sample(*args)


@pytest.mark.parametrize("which", [0, 3])
def test_rejection_sample_out_of_range_ids_raise_on_cpu(which):
    require_kernel("rejection_sample", "cpu")
    args = _verify_args()
    args[which] = args[which].clone()
    args[which].view(-1)[1] = -1 if which == 0 else 10**6
    with pytest.raises(IndexError, match="draft_tokens" if which == 0 else "candidate_ids"):
        dk.rejection_sample(*args)


def test_greedy_verify_bad_shapes():
    with pytest.raises(ValueError, match="target_logits"):
        dk.greedy_verify(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(TypeError, match="draft_tokens"):
        dk.greedy_verify(torch.zeros(2, 3), torch.zeros(2, 4, 5))


# --- torch.library and torch.compile ---------------------------------------------------


def test_opcheck_serving_ops():
    for op in ("candidate_topk", "select_path", "rejection_sample"):
        require_kernel(op, "cpu")
    inputs = block_inputs(BlockCase(2, 3, 300, 16, 5), "cpu")
    uniforms = torch.rand(2, 3)
    torch.library.opcheck(torch.ops.dflash2.candidate_topk.default, (inputs[1].view(6, 300), 5))
    for temperature in (0.0, 0.9):
        torch.library.opcheck(
            torch.ops.dflash2.select_path.default,
            (inputs[1], inputs[0], inputs[3], inputs[4], inputs[2], uniforms, 5, temperature, torch.float32),
        )
    torch.library.opcheck(torch.ops.dflash2.rejection_sample.default, verify_inputs(VERIFY_CASES[1], "cpu"))


def test_walk_and_verify_compile_fullgraph():
    require_kernel("select_path", "cpu")
    require_kernel("rejection_sample", "cpu")
    projected, logits, anchors, a, b = block_inputs(BlockCase(2, 4, 500, 16, 6), "cpu")

    def serve(projected, logits, anchors, target):
        path, candidates, _ = dk.walk(projected, logits, anchors, a, b, 6, 0.0)
        one_hot = (candidates == path.unsqueeze(-1)).float()
        return path, dk.rejection_sample(path, target, one_hot, candidates)

    target = torch.softmax(torch.randn(2, 5, 500), -1)
    compiled = torch.compile(serve, fullgraph=True, backend="aot_eager")
    path, (accepted, bonus) = compiled(projected, logits, anchors, target)
    assert torch.equal(path, serve(projected, logits, anchors, target)[0])
    assert accepted.shape == bonus.shape == (2,)
