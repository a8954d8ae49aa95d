"""GPU-only behaviour of the serving path: real shapes against the CPU twin, bad ids,
unwritten outputs, CUDA graphs and streams."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_LOADED

from .serving_cases import BlockCase, VerifyCase, block_inputs, verify_inputs, walk_over_edges

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not EXTENSION_LOADED, reason="extension not built")]

REAL = BlockCase(32, 7, 248_320, 256, 16, torch.bfloat16, torch.bfloat16)


@pytest.fixture
def dirty_cuda_memory():
    """Fill the caching allocator's free blocks with NaN bytes, so a kernel output that
    is never written shows up as NaN (floats) or an absurd id (int64)."""
    junk = torch.full((256 << 20,), float("nan"), device="cuda")
    del junk
    yield


def _select(inputs, top_k, temperature, uniforms):
    projected, logits, anchors, a, b = inputs
    score_dtype = reference.serving_score_dtype(logits, projected, a)
    return torch.ops.dflash2.select_path(logits, projected, a, b, anchors, uniforms, top_k, temperature, score_dtype)


def test_real_block_matches_the_cpu_twin(dirty_cuda_memory):
    inputs = block_inputs(REAL, "cuda", seed=7, scale=1.0)
    uniforms = torch.rand(REAL.batch, REAL.draft, device="cuda")
    for temperature in (0.0, 1.0):
        path, candidates, probs, edges = _select(inputs, REAL.top_k, temperature, uniforms)
        cpu = _select([t.cpu() for t in inputs], REAL.top_k, temperature, uniforms.cpu())
        assert torch.equal(candidates.cpu(), cpu[1])
        # fp32 sums in another order: a bf16 score may round one ulp apart.
        ulp = torch.finfo(torch.bfloat16).eps * cpu[3].float().abs().clamp_min(1)
        assert ((edges.cpu().float() - cpu[3].float()).abs() <= ulp).all()
        assert not torch.isnan(probs).any() and not torch.isnan(edges).any()
        if temperature == 0.0:
            assert torch.equal(path, walk_over_edges(edges, candidates))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_real_vocabulary_topk_with_ties(dtype, dirty_cuda_memory):
    logits = torch.randn(REAL.batch * REAL.draft, REAL.vocab, device="cuda").to(dtype)  # bf16: ties at the top
    values, ids = dk.candidate_topk(logits, 32)
    torch.testing.assert_close(values, torch.topk(logits, 32).values, rtol=0, atol=0)
    assert torch.equal(logits.gather(-1, ids), values)
    cpu_values, cpu_ids = torch.ops.dflash2.candidate_topk(logits.cpu(), 32)
    assert torch.equal(ids.cpu(), cpu_ids), "CUDA and CPU break ties by the same total order"


def test_topk_of_unaligned_rows_takes_the_scalar_path():
    logits = torch.randn(6, 5001, device="cuda")[:, 1:]  # row starts off 16-byte alignment
    values, ids = dk.candidate_topk(logits, 16)
    expected_values, expected_ids = torch.topk(logits, 16)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


def test_out_of_range_anchor_gives_minus_one_path_not_a_fault():
    case = BlockCase(3, 4, 500, 32, 8)
    projected, logits, anchors, a, b = block_inputs(case, "cuda")
    anchors[1] = case.vocab + 5
    path, candidates, probs = dk.walk(projected, logits, anchors, a, b, case.top_k, 0.0)
    edges, _ = dk.edge_scores(projected, logits, anchors, a, b, case.top_k)
    torch.cuda.synchronize()
    assert (path[1] == -1).all() and (path[[0, 2]] >= 0).all()
    assert torch.isnan(edges[1, 0]).all() and not torch.isnan(edges[[0, 2]]).any()


def test_rejection_real_vocabulary_matches_the_cpu_twin(dirty_cuda_memory):
    case = VerifyCase(32, 7, 248_320, 16, proposal="close")
    args = verify_inputs(case, "cuda", seed=3)
    accepted, bonus = torch.ops.dflash2.rejection_sample(*args)
    cpu_accepted, cpu_bonus = torch.ops.dflash2.rejection_sample(*(t.cpu() for t in args))
    assert torch.equal(accepted.cpu(), cpu_accepted)
    assert torch.equal(bonus.cpu(), cpu_bonus)


def test_rejection_invalid_draft_token_is_rejected_on_cuda():
    tokens, target, proposal, candidates, uniforms = verify_inputs(VerifyCase(8, 3, 50, 4), "cuda")
    tokens[:, 1] = 10**6
    accepted, bonus = torch.ops.dflash2.rejection_sample(tokens, target, proposal, candidates, uniforms)
    assert (accepted <= 1).all() and (bonus >= 0).all() and (bonus < 50).all()


def test_walk_and_verify_capture_in_one_cuda_graph():
    case = BlockCase(8, 7, 32_000, 256, 16, torch.bfloat16, torch.bfloat16)
    projected, logits, anchors, a, b = block_inputs(case, "cuda", seed=4)
    target = torch.softmax(torch.randn(case.batch, case.draft + 1, case.vocab, device="cuda"), -1)

    def serve():
        path, candidates, probs = dk.walk(projected, logits, anchors, a, b, case.top_k, 1.0)
        accepted, bonus = dk.rejection_sample(path, target, probs, candidates)
        greedy_path, _, _ = dk.walk(projected, logits, anchors, a, b, case.top_k, 0.0)
        return path, candidates, probs, accepted, bonus, greedy_path

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        serve()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = serve()
    logits.copy_(block_inputs(case, "cuda", seed=5)[1])
    graph.replay()
    torch.cuda.synchronize()
    path, candidates, probs, accepted, bonus, greedy_path = outputs
    eager_greedy, eager_candidates, _ = dk.walk(projected, logits, anchors, a, b, case.top_k, 0.0)
    assert torch.equal(greedy_path, eager_greedy) and torch.equal(candidates, eager_candidates)
    assert (candidates == path.unsqueeze(-1)).any(-1).all(), "the sampled path left its candidates"
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[..., 0]))
    assert ((accepted >= 0) & (accepted <= case.draft)).all()
    assert ((bonus >= 0) & (bonus < case.vocab)).all()


def test_runs_on_the_current_stream():
    case = BlockCase(4, 7, 50_000, 256, 16, torch.bfloat16, torch.bfloat16)
    inputs = block_inputs(case, "cuda", seed=6)
    expected = dk.walk(*inputs, case.top_k, 0.0)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            path = dk.walk(*inputs, case.top_k, 0.0)[0]
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(path, expected)


def test_host_uniforms_are_an_error_not_a_fault():
    case = BlockCase(2, 3, 300, 32, 8)
    projected, logits, anchors, a, b = block_inputs(case, "cuda")
    with pytest.raises(ValueError, match="uniforms must be on cuda"):
        torch.ops.dflash2.select_path(logits, projected, a, b, anchors, torch.rand(2, 3), case.top_k, 1.0,
                                      torch.float32)
    torch.cuda.synchronize()
