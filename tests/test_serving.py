"""The serving path against its references: top-k, edge scores, the walk, verification.

Every test runs on the C++ CPU twin and, with a GPU, on the CUDA kernels (the `gpu`
marked parameter). Sampling is checked draw by draw here through fixed uniforms;
tests/test_serving_stats.py checks the distributions. The "wide" tests cover what the
kernels do not take (k > 32, float64), where the serving functions run the reference.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import has_kernel

from .contract import assert_within_contract
from .serving_cases import (
    BLOCK_CASES,
    DEVICES,
    F32,
    F64,
    KERNEL_TOP_K,
    VERIFY_CASES,
    WIDE_BLOCK_CASES,
    WIDE_VERIFY_CASES,
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
    """Same generator state -> same uniforms -> the reference draws the same path, and
    its proposal q along it within SPEC section 4 of softmax(exact edges / T)."""
    require_kernel("select_path", device)
    inputs = block_inputs(case, device, seed=5, scale=2.0)
    generator = torch.Generator(device).manual_seed(11)
    path, candidates, draft_probs = dk.walk(*inputs, case.top_k, 0.7, generator=generator)
    uniforms = torch.rand(case.batch, case.draft, generator=torch.Generator(device).manual_seed(11), device=device)
    expected_path, _, expected_probs = reference.serving_walk(*inputs, case.top_k, 0.7, uniforms)
    assert torch.equal(path, expected_path)
    assert_within_contract(case.id, draft_probs.cpu(), expected_probs.cpu(),
                           _exact_proposal(inputs, candidates, path, case.top_k, 0.7))


def _exact_proposal(inputs, candidates, path, top_k, temperature):
    """softmax(E / T) in float64 along a sampled path: [B, D, k], the rows it read."""
    exact_edges, _ = reference.serving_edge_scores(*as_float64(*inputs), top_k)
    choices = (candidates == path.unsqueeze(-1)).int().argmax(-1)  # [B, D]: where each step went
    rows = torch.cat([torch.zeros_like(choices[:, :1]), choices[:, :-1]], dim=1)  # the row each step read
    exact_rows = exact_edges.gather(2, rows[..., None, None].expand(-1, -1, 1, top_k)).squeeze(2)
    return (exact_rows / temperature).softmax(-1).cpu()


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
        (lambda x: x.__setitem__(1, x[1].int()), TypeError, "logits"),
        (lambda x: x.__setitem__(1, x[1].to(torch.complex64)), TypeError, "logits"),
        (lambda x: x.__setitem__(1, x[1][:, :, :30]), ValueError, "logits"),
        (lambda x: x.__setitem__(0, x[0][:, :2]), ValueError, "projected"),
        (lambda x: x.__setitem__(2, x[2].float()), TypeError, "anchor_ids"),
        (lambda x: x.__setitem__(2, x[2][:1]), ValueError, "anchor_ids"),
        (lambda x: x.__setitem__(4, x[4][:, :5]), ValueError, "successor_codebook"),
        (lambda x: x.__setitem__(4, x[4].half()), TypeError, "successor_codebook"),
        (lambda x: x.__setitem__(4, x[4].double()), TypeError, "successor_codebook"),
        (lambda x: x.__setitem__(3, x[3].int()), TypeError, "predecessor_codebook"),
        (lambda x: x.__setitem__(0, x[0].bool()), TypeError, "projected"),
    ],
    ids=["logits-int", "logits-complex", "logits-vocab", "projected-shape", "anchor-float", "anchor-shape",
         "successor-shape", "codebook-dtypes", "codebook-dtypes-f64", "codebook-int", "projected-bool"],
)
def test_walk_bad_arguments_raise_naming_them(mutate, error, match):
    inputs = _small_block()
    mutate(inputs)
    with pytest.raises(error, match=match):
        dk.walk(*inputs, SMALL.top_k, 0.0)


@pytest.mark.parametrize("top_k, error", [(0, ValueError), (-3, ValueError), (41, ValueError), (2**63, ValueError),
                                          (2.0, TypeError), (True, TypeError), (None, TypeError)])
def test_bad_top_k(top_k, error):
    """k must lie in [1, V] (V = 40 here): any such k is served, so 33 is not an error."""
    match = r"top_k must be in \[1, vocab_size=40\]" if error is ValueError else "top_k"
    with pytest.raises(error, match=match):
        dk.walk(*_small_block(), top_k, 0.0)
    with pytest.raises(error, match=match):
        dk.edge_scores(*_small_block(), top_k)
    with pytest.raises(error, match=match):
        dk.candidate_topk(torch.randn(2, 40), top_k)
    with pytest.raises(error, match=match):
        dk.candidate_topk(torch.randn(2, 40, dtype=torch.float64), top_k)


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
        (1, lambda x: x.to(torch.int32), TypeError, "target_probs"),
        (1, lambda x: x.to(torch.complex64), TypeError, "target_probs"),
        (2, lambda x: x.long(), TypeError, "draft_probs"),
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


@pytest.mark.compiles
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


# --- wide: every k in [1, V] and float64 (the reference path) ----------------------------

WIDE_TOPK_SHAPES = [(3, 300, 33), (2, 2053, 48), (4, 1000, 64), (3, 40, 40), (2, 5000, 100), (2, 7, 7)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", WIDE_TOPK_SHAPES, ids=str)
def test_wide_candidate_topk_values_equal_torch_topk(shape, dtype, kind, device):
    rows, vocab, top_k = shape
    if dtype != torch.float64 and top_k <= KERNEL_TOP_K:
        pytest.skip("on the kernels: test_candidate_topk_values_equal_torch_topk")
    logits = topk_logits(rows, vocab, dtype, kind).to(device)
    values, ids = dk.candidate_topk(logits, top_k)
    expected = torch.topk(logits, top_k, dim=-1).values
    assert values.dtype == dtype and ids.dtype == torch.int64 and values.shape == (rows, top_k)
    torch.testing.assert_close(values, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(logits.gather(-1, ids), values, rtol=0, atol=0, equal_nan=True)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "a row repeats an index"


def test_wide_cases_run_the_reference_and_the_others_the_kernels(monkeypatch):
    """What routes where: k > 32 or any float64 input to the reference, the rest to the op."""
    serving_walk = importlib.import_module("dflash2_kernels.serving.walk")  # the module, not the function

    def no_kernel(*args):
        raise AssertionError("the fused op ran")

    monkeypatch.setattr(serving_walk, "_select_path", no_kernel)
    for case in WIDE_BLOCK_CASES:
        assert not case.on_kernels
        inputs = block_inputs(case, "cpu")
        dk.walk(*inputs, case.top_k, 0.0)
        dk.edge_scores(*inputs, case.top_k)
    if has_kernel("select_path", "cpu"):
        case = BLOCK_CASES[2]
        assert case.on_kernels
        with pytest.raises(AssertionError, match="the fused op ran"):
            dk.walk(*block_inputs(case, "cpu"), case.top_k, 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WIDE_BLOCK_CASES, ids=lambda c: c.id)
def test_wide_edge_scores_within_contract(case, device):
    inputs = block_inputs(case, device)
    edges, candidates = dk.edge_scores(*inputs, case.top_k)
    expected, expected_candidates = reference.serving_edge_scores(*inputs, case.top_k)
    exact, _ = reference.serving_edge_scores(*as_float64(*inputs), case.top_k)
    assert edges.dtype == reference.serving_score_dtype(inputs[1], inputs[0], inputs[3])
    assert candidates.dtype == torch.int64 and torch.equal(candidates, expected_candidates)
    assert edges.shape == (case.batch, case.draft, case.top_k, case.top_k)
    assert_within_contract(case.id, edges.cpu(), expected.cpu(), exact.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WIDE_BLOCK_CASES, ids=lambda c: c.id)
def test_wide_greedy_walk_equals_the_reference_walk(case, device):
    """Token for token: the reference (NeMo's walk), and the argmax walk over the edges."""
    inputs = block_inputs(case, device, seed=2)
    path, candidates, draft_probs = dk.walk(*inputs, case.top_k, 0.0)
    expected_path, expected_candidates, _ = reference.serving_walk(*inputs, case.top_k, 0.0)
    edges, _ = dk.edge_scores(*inputs, case.top_k)
    assert draft_probs is None
    assert path.dtype == candidates.dtype == torch.int64 and path.shape == (case.batch, case.draft)
    assert torch.equal(candidates, expected_candidates)
    assert torch.equal(path, expected_path)
    assert torch.equal(path, walk_over_edges(edges, candidates))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("case", WIDE_BLOCK_CASES, ids=lambda c: c.id)
def test_wide_sampled_walk_proposal_is_softmax_along_its_path(case, temperature, device):
    """q = softmax(edge row / T) along the path, each draw at its uniform, and the
    reference's draws from the same generator state (over the fallback's float64
    transitions: the same bits on every host)."""
    inputs = block_inputs(case, device, seed=3, scale=2.0)
    path, candidates, draft_probs = dk.walk(*inputs, case.top_k, temperature,
                                            generator=torch.Generator(device).manual_seed(21))
    uniforms = torch.rand(case.batch, case.draft, generator=torch.Generator(device).manual_seed(21), device=device)
    edges, _ = dk.edge_scores(*inputs, case.top_k)
    assert draft_probs.dtype == torch.float32 and draft_probs.shape == (case.batch, case.draft, case.top_k)
    assert_sampled_walk_follows_its_edges(path, candidates, draft_probs, edges, uniforms, temperature)
    expected_path, _, expected_probs = reference.serving_walk(*inputs, case.top_k, temperature, uniforms,
                                                              transition_dtype=torch.float64)
    assert torch.equal(path, expected_path)
    torch.testing.assert_close(draft_probs, expected_probs, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c for c in FP32_CASES if c.top_k > 1][:2], ids=lambda c: c.id)
def test_kernels_and_reference_draw_the_same_tokens(case, device, monkeypatch):
    """One generator state, the same uniforms on either path: the kernels' sampled walk
    and the reference's (DFLASH2_BACKEND=reference) choose the same tokens."""
    require_kernel("select_path", device)
    inputs = block_inputs(case, device, seed=5, scale=2.0)
    results = []
    for backend in ("auto", "reference"):
        monkeypatch.setenv("DFLASH2_BACKEND", backend)
        results.append(dk.walk(*inputs, case.top_k, 0.7, generator=torch.Generator(device).manual_seed(3)))
    (path, candidates, probs), (ref_path, ref_candidates, ref_probs) = results
    assert torch.equal(candidates, ref_candidates) and torch.equal(path, ref_path)
    assert_within_contract(case.id, probs.cpu(), ref_probs.cpu(), _exact_proposal(inputs, candidates, path,
                                                                                   case.top_k, 0.7))


WIDE_ON_CPU = [BlockCase(2, 3, 40, 8, 36), BlockCase(2, 3, 40, 8, 4, F64, F64), BlockCase(2, 3, 40, 8, 4, F32, F64)]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("bad_id", [40, -1, 2**40])
@pytest.mark.parametrize("case", WIDE_ON_CPU, ids=lambda c: c.id)
def test_wide_out_of_range_anchor_raises_on_cpu(case, bad_id, backend, monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", backend)
    inputs = list(block_inputs(case, "cpu"))
    inputs[2] = torch.tensor([3, bad_id])
    message = f"anchor_ids holds {bad_id} at flat index 1, out of range for a vocabulary of 40"
    with pytest.raises(IndexError, match=re.escape(message)):
        dk.walk(*inputs, case.top_k, 0.0)
    with pytest.raises(IndexError, match=re.escape(message)):
        dk.walk(*inputs, case.top_k, 1.0)
    with pytest.raises(IndexError, match=re.escape(message)):
        dk.edge_scores(*inputs, case.top_k)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reference_gives_a_bad_anchor_the_cuda_kernels_rule(temperature):
    """The reference is total (it is the CUDA path beyond the kernels, which cannot raise
    without a sync): an anchor outside [0, V) gives its sequence NaN edges at t = 0 and
    path -1; the other sequences are as with good anchors."""
    case = BlockCase(3, 4, 300, 32, 40)
    projected, logits, anchors, a, b = block_inputs(case, "cpu", seed=6)
    bad = torch.tensor([int(anchors[0]), case.vocab, -3])
    uniforms = torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
    edges, candidates = reference.serving_edge_scores(projected, logits, bad, a, b, case.top_k)
    path, _, probs = reference.serving_walk(projected, logits, bad, a, b, case.top_k, temperature, uniforms)
    good_edges, _ = reference.serving_edge_scores(projected, logits, anchors, a, b, case.top_k)
    good_path, _, _ = reference.serving_walk(projected, logits, anchors, a, b, case.top_k, temperature, uniforms)
    for sequence in (1, 2):
        assert edges[sequence, 0].isnan().all() and (path[sequence] == -1).all()
        assert torch.equal(edges[sequence, 1:], good_edges[sequence, 1:])
    assert torch.equal(edges[0], good_edges[0]) and torch.equal(path[0], good_path[0])
    if temperature > 0:
        assert probs[1:, 0].isnan().all() and not probs[0].isnan().any()


@pytest.mark.gpu
def test_wide_out_of_range_anchor_on_cuda_gives_nan_edges_and_no_path():
    """No host sync on CUDA beyond the kernels either: the kernels' NaN / -1 rule."""
    case = BlockCase(3, 4, 300, 32, 40)
    projected, logits, anchors, a, b = block_inputs(case, "cuda", seed=6)
    anchors = torch.tensor([5, case.vocab, -3], device="cuda")
    edges, _ = dk.edge_scores(projected, logits, anchors, a, b, case.top_k)
    path, _, _ = dk.walk(projected, logits, anchors, a, b, case.top_k, 0.0)
    for sequence in (1, 2):
        assert edges[sequence, 0].isnan().all() and (path[sequence] == -1).all()
        assert not edges[sequence, 1:].isnan().any()
    assert not edges[0].isnan().any() and (path[0] >= 0).all()


@pytest.mark.parametrize("case", [BlockCase(2, 3, 300, 16, 48), BlockCase(2, 3, 300, 16, 8, F64, F64),
                                  BlockCase(2, 3, 300, 16, 8)], ids=lambda c: c.id)
def test_temperature_rounding_to_zero_as_a_float32_walks_greedily(case):
    inputs = block_inputs(case, "cpu", seed=2)
    path, candidates, draft_probs = dk.walk(*inputs, case.top_k, 1e-50, generator=torch.Generator())
    assert draft_probs is None
    assert torch.equal(path, dk.walk(*inputs, case.top_k, 0.0)[0])
    with pytest.raises(ValueError, match="temperature"):
        dk.walk(*inputs, case.top_k, 1e300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_module_walk_with_top_k_64(dtype):
    """A selector that trains with top_k 64 serves with it too."""
    torch.manual_seed(0)
    selector = dk.CandidateSelector(300, 24, 16, 64).to(dtype)
    with torch.no_grad():
        selector.successor_codebook.normal_(std=0.5)
        selector.predecessor_codebook.normal_(std=0.5)
    hidden = torch.randn(2, 5, 24, dtype=dtype)
    logits = torch.randn(2, 5, 300, dtype=dtype)
    anchors = torch.tensor([3, 299])
    with torch.no_grad():
        path, candidates, probs = selector.walk(hidden, logits, anchors, 0.0)
        projected = selector.hidden_projection(hidden)
        expected = reference.serving_walk(projected, logits, anchors, selector.predecessor_codebook,
                                          selector.successor_codebook, 64, 0.0)
        edges, edge_candidates = selector.edge_scores(hidden, logits, anchors)
        sampled, sampled_candidates, q = selector.walk(hidden, logits, anchors, 1.3,
                                                       generator=torch.Generator().manual_seed(8))
    assert probs is None and edges.shape == (2, 5, 64, 64) and edges.dtype == dtype
    assert torch.equal(path, expected[0]) and torch.equal(candidates, expected[1])
    assert torch.equal(edge_candidates, candidates) and torch.equal(path, walk_over_edges(edges, candidates))
    uniforms = torch.rand(2, 5, generator=torch.Generator().manual_seed(8))
    assert q.dtype == torch.float32 and q.shape == (2, 5, 64)
    assert_sampled_walk_follows_its_edges(sampled, sampled_candidates, q, edges, uniforms, 1.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WIDE_VERIFY_CASES, ids=lambda c: c.id)
def test_wide_rejection_sample_equals_reference_draw_by_draw(case, device):
    """float64 probabilities: the reference in float64, from the generator's uniforms."""
    tokens, target, proposal, candidates, _ = verify_inputs(case, device)
    accepted, bonus = dk.rejection_sample(tokens, target, proposal, candidates,
                                          generator=torch.Generator(device).manual_seed(7))
    uniforms = torch.rand(case.batch, case.draft + 1, generator=torch.Generator(device).manual_seed(7),
                          device=device)
    expected_accepted, expected_bonus = reference.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert accepted.dtype == bonus.dtype == torch.int64 and accepted.shape == bonus.shape == (case.batch,)
    assert torch.equal(accepted, expected_accepted)
    assert torch.equal(bonus, expected_bonus)
    assert ((bonus >= 0) & (bonus < case.vocab)).all()
    if case.proposal == "close":
        assert (accepted == case.draft).any(), "no all-accepted block: the case does not test p_D"
    if case.proposal == "covering":
        assert (accepted < case.draft).any(), "no rejection: the case does not test the empty residual"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", VERIFY_CASES[1:5], ids=lambda c: c.id)
def test_rejection_sample_draws_the_same_tokens_from_float64_probabilities(case, device):
    """The same probabilities held in float64 (the reference) or float32 (the kernels):
    one generator state, the same draws."""
    tokens, target, proposal, candidates, _ = verify_inputs(case, device)
    got = dk.rejection_sample(tokens, target, proposal, candidates, generator=torch.Generator(device).manual_seed(2))
    wide = dk.rejection_sample(tokens, target.double(), proposal.double(), candidates,
                               generator=torch.Generator(device).manual_seed(2))
    assert torch.equal(got[0], wide[0]) and torch.equal(got[1], wide[1])


def test_rejection_sample_beyond_the_kernels_vocabulary():
    """V > 4,194,304: the raw op refuses it, the public function runs the reference."""
    vocab = (1 << 22) + 1
    batch, draft, top_k = 3, 1, 4
    target = torch.zeros(batch, draft + 1, vocab)
    target[:, :, [5, vocab - 2, vocab - 1]] = torch.tensor([0.25, 0.25, 0.5])
    candidates = torch.tensor([5, vocab - 1, 9, 11]).expand(batch, draft, top_k).contiguous()
    proposal = torch.tensor([0.1, 0.6, 0.2, 0.1]).expand(batch, draft, top_k).contiguous()
    tokens = torch.tensor([[vocab - 1], [9], [5]])
    accepted, bonus = dk.rejection_sample(tokens, target, proposal, candidates,
                                          generator=torch.Generator().manual_seed(4))
    uniforms = torch.rand(batch, draft + 1, generator=torch.Generator().manual_seed(4))
    expected = reference.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert torch.equal(accepted, expected[0]) and torch.equal(bonus, expected[1])
    assert accepted[1] == 0 and bonus[1] in (5, vocab - 2, vocab - 1)  # token 9 has no target mass
    if has_kernel("rejection_sample", "cpu"):
        with pytest.raises(ValueError, match="vocabulary of 1 to 4194304"):
            torch.ops.dflash2.rejection_sample(tokens, target, proposal, candidates, uniforms)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("which, bad_id", [(0, -1), (0, 300), (3, 10**6), (3, -5)])
def test_wide_rejection_sample_out_of_range_ids_raise_on_cpu(which, bad_id, backend, monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", backend)
    args = list(verify_inputs(WIDE_VERIFY_CASES[4], "cpu")[:4])
    args[which] = args[which].clone()
    args[which].view(-1)[1] = bad_id
    name = "draft_tokens" if which == 0 else "candidate_ids"
    with pytest.raises(IndexError, match=re.escape(f"{name} holds {bad_id} at flat index 1, out of range for a "
                                                   "vocabulary of 300")):
        dk.rejection_sample(*args)


def test_reference_gives_out_of_range_verify_ids_the_cuda_kernels_rule():
    """A draft token outside [0, V) has no target mass (never accepted); a candidate
    outside it takes no mass off the residual (it is ignored)."""
    tokens, target, proposal, candidates, uniforms = verify_inputs(VerifyCase(32, 3, 40, 6, F64, "close"), "cpu")
    bad_tokens = tokens.clone()
    bad_tokens[:, 0] = torch.tensor([-1, 40] * 16)
    accepted, bonus = reference.rejection_sample(bad_tokens, target, proposal, candidates, uniforms)
    assert (accepted == 0).all() and ((bonus >= 0) & (bonus < 40)).all()
    bad_candidates = candidates.clone()
    bad_candidates[:, :, -1] = 10**6
    accepted, bonus = reference.rejection_sample(tokens, target, proposal, bad_candidates, uniforms)
    trimmed = reference.rejection_sample(tokens, target, proposal[..., :-1], candidates[..., :-1], uniforms)
    assert torch.equal(accepted, trimmed[0]) and torch.equal(bonus, trimmed[1])


@pytest.mark.gpu
def test_wide_rejection_sample_out_of_range_draft_token_on_cuda_is_never_accepted():
    tokens, target, proposal, candidates, _ = verify_inputs(WIDE_VERIFY_CASES[0], "cuda", seed=3)
    tokens = tokens.clone()
    tokens[:, 0] = torch.tensor([-1, WIDE_VERIFY_CASES[0].vocab] * (tokens.shape[0] // 2), device="cuda")
    accepted, bonus = dk.rejection_sample(tokens, target, proposal, candidates)
    assert (accepted == 0).all() and (bonus >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_in_float64(device):
    """The argmax is taken in float64: 1 + 1e-12 beats 1 (a tie, to the lower index, in float32)."""
    logits = torch.full((2, 3, 6), -1.0, dtype=torch.float64, device=device)
    logits[:, :, 1] = 1.0
    logits[:, :, 4] = 1.0 + 1e-12
    logits[1, 1, 2] = 5.0
    draft = torch.tensor([[4, 4], [4, 4]], device=device)
    accepted, bonus = dk.greedy_verify(draft, logits)
    assert accepted.tolist() == [2, 1] and bonus.tolist() == [4, 2]
    expected = reference.greedy_verify(draft, logits)
    assert torch.equal(accepted, expected[0]) and torch.equal(bonus, expected[1])
    accepted32, bonus32 = dk.greedy_verify(draft, logits.float())
    assert accepted32.tolist() == [0, 0] and bonus32.tolist() == [1, 1]
    ties = torch.zeros(1, 2, 5, dtype=torch.float64, device=device)  # all tied: torch.argmax's first index
    assert dk.greedy_verify(torch.tensor([[0]], device=device), ties)[1].tolist() == [0]


@pytest.mark.compiles
def test_wide_walk_and_verify_compile_fullgraph():
    projected, logits, anchors, a, b = block_inputs(BlockCase(2, 4, 500, 16, 48), "cpu")

    def serve(projected, logits, anchors, target):
        path, candidates, _ = dk.walk(projected, logits, anchors, a, b, 48, 0.0)
        one_hot = (candidates == path.unsqueeze(-1)).double()
        return path, dk.rejection_sample(path, target, one_hot, candidates)

    target = torch.softmax(torch.randn(2, 5, 500, dtype=torch.float64), -1)
    compiled = torch.compile(serve, fullgraph=True, backend="aot_eager")
    path, (accepted, bonus) = compiled(projected, logits, anchors, target)
    assert torch.equal(path, serve(projected, logits, anchors, target)[0])
    assert accepted.shape == bonus.shape == (2,)


@pytest.mark.parametrize("value", [0.7, 1 / 3, -2.5, 1e-5, 0.99e-5, 3.4028234663852886e38, 3.4028235677973366e38,
                                   3.5e38, -1e39, 2.0 ** -126, 2.0 ** -149, 1.5 * 2.0 ** -149, 2.0 ** -150,
                                   2.0 ** -150 * 1.0000001, 1e-50, 0.0, -0.0, float("inf")])
def test_temperature_rounds_to_float32_as_the_kernels_take_it(value):
    """as_float32 (traceable by every supported torch.compile) is IEEE round-to-nearest-even."""
    import math
    import struct

    from dflash2_kernels.serving._checks import as_float32

    if 0 < abs(value) < 2.0 ** -126 and struct.unpack("f", struct.pack("f", 2.0 ** -149))[0] == 0:
        pytest.skip("this process flushes float32 subnormals to zero (a library set FTZ/DAZ): C's and IEEE's "
                    "rounding of a subnormal temperature differ here")
    try:
        expected = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # struct refuses what float32 rounds to infinity
        expected = math.copysign(math.inf, value)
    got = as_float32(value)
    assert got == expected and math.copysign(1.0, got) == math.copysign(1.0, expected), (value, got, expected)
