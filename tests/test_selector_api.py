"""The selector's module, op registration, errors and torch.compile."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_LOADED, has_kernel

from .contract import assert_same_within_floor, assert_within_contract
from .selector_cases import CASES, make_inputs

needs_extension = pytest.mark.skipif(not EXTENSION_LOADED, reason="the compiled extension is not built")


def _upstream_state_dict(vocab, hidden, rank, generator):
    return {
        "predecessor_codebook": torch.randn(vocab, rank, generator=generator),
        "successor_codebook": torch.randn(vocab, rank, generator=generator),
        "hidden_projection.weight": torch.randn(rank, hidden, generator=generator),
    }


def test_state_dict_is_upstreams_and_loads_strictly():
    g = torch.Generator().manual_seed(0)
    positional = dk.CandidateSelector(50, 32, 16, 5)
    keyword = dk.CandidateSelector(vocab_size=50, hidden_size=32, rank=16, top_k=5, initializer_range=0.01)
    upstream = _upstream_state_dict(50, 32, 16, g)
    for module in (positional, keyword):
        assert {k: v.shape for k, v in module.state_dict().items()} == {k: v.shape for k, v in upstream.items()}
        module.load_state_dict(upstream, strict=True)


def test_initialisation_follows_speculators():
    torch.manual_seed(0)
    module = dk.CandidateSelector(vocab_size=4000, hidden_size=64, rank=64, top_k=4, initializer_range=0.05)
    for parameter in (module.predecessor_codebook, module.successor_codebook, module.hidden_projection.weight):
        assert abs(parameter.std().item() - 0.05) < 0.005 and abs(parameter.mean().item()) < 0.005
    with torch.no_grad():
        module.successor_codebook.zero_()
    module.reset_parameters()
    assert module.successor_codebook.std().item() > 0.04


@needs_extension
def test_methods_match_the_reference_module_semantics():
    g = torch.Generator().manual_seed(1)
    module = dk.CandidateSelector(vocab_size=40, hidden_size=24, rank=16, top_k=6)
    hidden = torch.randn(2, 5, 24, generator=g)
    logits = torch.randn(2, 5, 40, generator=g)
    predecessors = torch.randint(0, 40, (2, 5), generator=g)
    projected = module.hidden_projection(hidden)
    a, b = module.predecessor_codebook, module.successor_codebook

    candidates, scores = module.select(logits, hidden, predecessors)
    assert torch.equal(candidates, logits.topk(6, dim=-1).indices)
    expected = reference.selector_score_candidates(logits, projected, a, b, predecessors, candidates)
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(module(logits, hidden, predecessors, candidates), expected)
    torch.testing.assert_close(
        module.transition_scores(hidden, predecessors, candidates),
        reference.selector_transition_scores(projected, a, b, predecessors, candidates),
    )
    torch.testing.assert_close(module.context(hidden, predecessors), a[predecessors] * projected)
    gathered = logits.gather(-1, candidates)
    torch.testing.assert_close(
        module.pair_scores(hidden, gathered, candidates, predecessors),
        reference.selector_pair_scores(projected, gathered, a, b, candidates, predecessors),
    )
    assert module.select(logits, hidden, predecessors, top_k=3)[0].shape == (2, 5, 3)


def test_module_rejects_bad_sizes():
    with pytest.raises(ValueError, match=re.escape("top_k (9) cannot exceed vocab_size (8).")):
        dk.CandidateSelector(8, 16, 4, 9)
    with pytest.raises(ValueError, match="rank must be a positive int, got 0"):
        dk.CandidateSelector(8, 16, 0, 2)


def _good(device="cpu"):
    return list(make_inputs(CASES[1], device)[:6])  # unary, projected, A, B, pred, cand


# (position to replace, replacement, exception, message fragment)
BAD_INPUTS = [
    (5, lambda t: t.float(), TypeError, "candidate_ids must hold integer token ids, got torch.float32."),
    (4, lambda t: t.bool(), TypeError, "predecessor_ids must hold integer token ids, got torch.bool."),
    (0, lambda t: t.int(), TypeError, "unary_logits must be float16, bfloat16, float32 or float64, got torch.int32."),
    (3, lambda t: t.double(), TypeError,
     "successor_codebook must have predecessor_codebook's dtype torch.float32, got torch.float64."),
    (3, lambda t: t[:5], ValueError, "successor_codebook must have predecessor_codebook's shape (7, 12), got (5, 12)."),
    (1, lambda t: t[..., :8], ValueError, "projected must have shape (2, 3, 12)"),
    (5, lambda t: t[0], ValueError, "candidate_ids must have shape (2, 3, 'k'), got (3, 5)."),
    (0, lambda t: t[..., :6], ValueError, "unary_logits must have shape (2, 3, 7), got (2, 3, 6)."),
    (2, lambda t: t.to("meta"), ValueError, "all selector tensors must be on one device"),
    (2, lambda t: t[0], ValueError, "predecessor_codebook must be [vocab_size, rank], got (12,)."),
]


@needs_extension
@pytest.mark.parametrize("index,change,error,message", BAD_INPUTS, ids=[m[:30] for *_, m in BAD_INPUTS])
def test_score_candidates_rejects_bad_inputs(index, change, error, message):
    args = _good()
    args[index] = change(args[index])
    with pytest.raises(error, match=re.escape(message)):
        dk.score_candidates(*args)


@needs_extension
@pytest.mark.parametrize("index,bad_id", [(4, 7), (4, -1), (5, 7), (5, -3)])
def test_out_of_range_ids_raise_index_error_on_cpu(index, bad_id):
    args = _good()
    args[index] = args[index].clone()
    args[index].view(-1)[2] = bad_id
    name = "predecessor_ids" if index == 4 else "candidate_ids"
    with pytest.raises(IndexError, match=f"{name} holds {bad_id} at flat index 2, out of range for a vocabulary of 7"):
        dk.score_candidates(*args)


@needs_extension
def test_raw_op_checks_shapes():
    unary, projected, a, b, pred, cand = _good()
    with pytest.raises(ValueError, match=re.escape("candidate_ids must be [6, k]")):
        torch.ops.dflash2.selector_scores(unary.view(6, 7), projected.view(6, 12), a, b, pred.view(6), cand[0],
                                          False, torch.float32)


RAW_BACKWARD_MISUSE = [
    # (grad_scores dtype, unary_gathered, unary_width, unary_dtype, error, message)
    (torch.int8, False, 7, torch.float32, TypeError, "grad_scores must be float16"),
    (torch.float32, False, 7, torch.int8, TypeError, "unary_dtype must be float16"),
    (torch.float32, False, 1, torch.float32, ValueError, "unary_width must be 7"),
    (torch.float32, False, 0, torch.float32, ValueError, "unary_width must be 7"),
    (torch.float32, True, 7, torch.float32, ValueError, "unary_width must be 5"),
]


@needs_extension
@pytest.mark.parametrize("out_dtype", [torch.bool, torch.int8, torch.int32, torch.int64, torch.complex64], ids=str)
def test_raw_forward_refuses_outputs_it_cannot_store(out_dtype):
    unary, projected, a, b, pred, cand = _good()
    with pytest.raises(TypeError, match="out_dtype must be float16"):
        torch.ops.dflash2.selector_scores(unary.view(6, 7), projected.view(6, 12), a, b, pred.view(6),
                                          cand.view(6, 5), False, out_dtype)


@needs_extension
@pytest.mark.parametrize("grad_dtype, gathered, width, unary_dtype, error, message", RAW_BACKWARD_MISUSE,
                         ids=[m[-1] + f"-{i}" for i, m in enumerate(RAW_BACKWARD_MISUSE)])
def test_raw_backward_refuses_what_it_cannot_read_or_write(grad_dtype, gathered, width, unary_dtype, error,
                                                           message):
    _, projected, a, b, pred, cand = _good()
    grad = torch.ones(6, 5).to(grad_dtype)
    with pytest.raises(error, match=message):
        torch.ops.dflash2.selector_scores_backward(grad, projected.view(6, 12), a, b, pred.view(6), cand.view(6, 5),
                                                   gathered, width, unary_dtype)


@needs_extension
def test_opcheck_cpu():
    unary, projected, a, b, pred, cand = _good()
    args = (unary.view(6, 7), projected.view(6, 12), a, b, pred.view(6), cand.view(6, 5))
    for gathered_unary, gathered in ((args[0], False), (args[0].gather(-1, args[5]), True)):
        for requires_grad in (False, True):
            op_args = [t.detach().requires_grad_(requires_grad) for t in (gathered_unary, *args[1:4])]
            torch.library.opcheck(
                torch.ops.dflash2.selector_scores.default,
                (*op_args, args[4], args[5], gathered, torch.float32),
            )
    grad = torch.randn(6, 5)
    torch.library.opcheck(
        torch.ops.dflash2.selector_scores_backward.default,
        (grad, args[1], a, b, args[4], args[5], False, 7, torch.float32),
    )


@needs_extension
def test_registered_for_cpu_and_for_cuda_when_built_with_cuda():
    assert has_kernel("selector_scores", "cpu") and has_kernel("selector_scores_backward", "cpu")
    built_with_cuda_expected = (
        torch.version.cuda is not None
        and shutil.which("nvcc") is not None
        and os.environ.get("DFLASH2_BUILD_CUDA", "auto").lower() not in ("0", "false", "no")
    )
    if built_with_cuda_expected:
        # CI builds with nvcc: the CUDA sources compiled for sm_90 or the build failed.
        assert has_kernel("selector_scores", "cuda") and has_kernel("selector_scores_backward", "cuda")


@pytest.mark.compiles
@needs_extension
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_fullgraph_compile(compile_backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = dk.CandidateSelector(vocab_size=30, hidden_size=16, rank=8, top_k=4)
    hidden = torch.randn(2, 3, 16, requires_grad=True)
    logits = torch.randn(2, 3, 30, requires_grad=True)
    predecessors = torch.randint(0, 30, (2, 3))

    def step(h, u):
        candidates, scores = module.select(u, h.tanh(), predecessors)
        return scores.square().sum()

    expected = step(hidden, logits)
    expected_grads = torch.autograd.grad(expected, (hidden, logits, module.successor_codebook))
    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    got = compiled(hidden, logits)
    got_grads = torch.autograd.grad(got, (hidden, logits, module.successor_codebook))
    assert_same_within_floor("objective", got, expected)
    for name, a, b in zip(("grad hidden", "grad logits", "grad successor_codebook"), got_grads, expected_grads):
        assert_same_within_floor(name, a, b)


@needs_extension
def test_strided_inputs_match_reference():
    """Row-strided logits and P, a column-major codebook: no wrong answer, no crash."""
    unary, projected, a, b, pred, cand = _good()
    wide_unary = torch.cat([unary, unary], dim=-1)[..., : unary.shape[-1]]  # row stride 2V
    wide_projected = torch.cat([projected, projected], dim=-1)[..., : projected.shape[-1]]
    column_major = a.t().contiguous().t()
    got = dk.score_candidates(wide_unary, wide_projected, column_major, b, pred, cand)
    expected = reference.selector_score_candidates(unary, projected, a, b, pred, cand)
    exact = reference.selector_score_candidates(unary.double(), projected.double(), a.double(), b.double(), pred, cand)
    assert_within_contract("strided scores", got, expected, exact)
