"""GPU-only behaviour of the selector: real shapes, bad ids, graphs, streams, compile."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_LOADED

from .contract import assert_within_contract
from .selector_cases import SelectorCase, exact_scores_with_grads, make_inputs, scores_with_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not EXTENSION_LOADED, reason="extension not built")]

REAL = SelectorCase((2, 1024), 248_320, 256, 16, torch.bfloat16, torch.bfloat16, torch.bfloat16)
AUTOCAST = SelectorCase((4096,), 32_000, 256, 16, torch.bfloat16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("case", [REAL, AUTOCAST], ids=lambda c: c.id)
def test_real_shapes_within_contract(case):
    inputs = make_inputs(case, "cuda")
    exact = exact_scores_with_grads(*inputs)
    expected = scores_with_grads(reference.selector_score_candidates, *inputs)
    got = scores_with_grads(dk.score_candidates, *inputs)
    for name, kernel, ref, ex in zip(("S", "dU", "dP", "dA", "dB"), got, expected, exact):
        assert_within_contract(f"{case.id} {name}", kernel, ref, ex)


def test_out_of_range_ids_give_nan_not_a_fault():
    unary, projected, a, b, pred, cand, _ = make_inputs(SelectorCase((8,), 50, 32, 5), "cuda")
    pred[1] = 50
    cand[3, 2] = -4
    cand[5, 0] = 10**9
    scores = torch.ops.dflash2.selector_scores(unary, projected, a, b, pred, cand, False, torch.float32)
    torch.cuda.synchronize()
    assert torch.isnan(scores[1]).all()
    assert torch.isnan(scores[3, 2]) and torch.isnan(scores[5, 0])
    good = torch.ones_like(scores, dtype=torch.bool)
    good[1] = False
    good[3, 2] = False
    good[5, 0] = False
    assert not torch.isnan(scores[good]).any()


def test_heavy_repeats_cross_many_segment_chunks():
    """Every row picks from 3 tokens: each id's run spans many 64-entry chunks."""
    case = SelectorCase((4096,), 3, 256, 16)
    inputs = make_inputs(case, "cuda", seed=2)
    exact = exact_scores_with_grads(*inputs)
    expected = scores_with_grads(reference.selector_score_candidates, *inputs)
    got = scores_with_grads(dk.score_candidates, *inputs)
    for name, kernel, ref, ex in zip(("S", "dU", "dP", "dA", "dB"), got, expected, exact):
        assert_within_contract(f"repeats {name}", kernel, ref, ex)
    again = scores_with_grads(dk.score_candidates, *inputs)
    for first, second in zip(got, again):
        assert torch.equal(first, second)


def test_forward_replays_under_cuda_graph():
    unary, projected, a, b, pred, cand, _ = make_inputs(SelectorCase((256,), 1000, 256, 16), "cuda")
    args = (unary, projected, a, b, pred, cand)
    dk.score_candidates(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scores = dk.score_candidates(*args)
    projected.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(scores, dk.score_candidates(*args), rtol=0, atol=0)


def test_runs_on_the_current_stream():
    inputs = make_inputs(SelectorCase((512,), 5000, 256, 16), "cuda")
    expected = scores_with_grads(dk.score_candidates, *inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = scores_with_grads(dk.score_candidates, *inputs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for x, y in zip(got, expected):
        assert torch.equal(x, y)


@pytest.mark.compiles
def test_fullgraph_compile_on_cuda():
    torch._dynamo.reset()
    module = dk.CandidateSelector(vocab_size=1000, hidden_size=128, rank=64, top_k=8).cuda()
    hidden = torch.randn(4, 16, 128, device="cuda", requires_grad=True)
    logits = torch.randn(4, 16, 1000, device="cuda", requires_grad=True)
    predecessors = torch.randint(0, 1000, (4, 16), device="cuda")

    def step(h, u):
        return module.select(u, h, predecessors)[1].float().square().sum()

    expected = step(hidden, logits)
    got = torch.compile(step, fullgraph=True)(hidden, logits)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    got.backward()
    assert module.successor_codebook.grad is not None


def test_host_grad_scores_is_an_error_not_a_fault():
    """A CPU dS with CUDA operands dispatches to the CUDA kernel: it must be refused
    before a kernel reads a host pointer (which would poison the CUDA context)."""
    _, projected, predecessor, successor, pred, cand, grad = make_inputs(SelectorCase((6,), 50, 16, 5), "cuda")
    with pytest.raises(ValueError, match="grad_scores must be on cuda"):
        torch.ops.dflash2.selector_scores_backward(grad.cpu(), projected, predecessor, successor, pred, cand, True,
                                                   5, torch.float32)
    torch.cuda.synchronize()  # the context is still healthy
