"""Bad and edge inputs at every entry point: raw ops refuse what their kernels cannot
handle (naming the argument), and empty sizes give the reference's empty results."""

from __future__ import annotations

import re

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import EXTENSION_LOADED

from .selector_cases import SelectorCase, make_inputs
from .serving_cases import BlockCase, VERIFY_CASES, block_inputs, verify_inputs

needs_extension = pytest.mark.skipif(not EXTENSION_LOADED, reason="the compiled extension is not built")


def _to_meta(args, index):
    args = list(args)
    args[index] = args[index].to("meta")
    return args


def _conv_args():
    x = torch.randn(8, 32)
    delta = torch.randn(8, 2, 2)
    base = torch.randn(2, 32)
    return x, delta, base


def _selector_args():
    unary, projected, a, b, pred, cand, grad = make_inputs(SelectorCase((6,), 20, 8, 4), "cpu")
    return unary, projected, a, b, pred, cand, grad


def _raw_calls():
    """(op name, callable taking the tensor list, tensor list) for every C++ op."""
    ops = torch.ops.dflash2
    x, delta, base = _conv_args()
    unary, projected, a, b, pred, cand, grad = _selector_args()
    projected_block, logits, anchors, pa, pb = block_inputs(BlockCase(2, 3, 50, 8, 4), "cpu")
    tokens, target, proposal, candidates, uniforms = verify_inputs(VERIFY_CASES[1], "cpu")
    return [
        ("conv_forward_cpu", lambda t: ops.conv_forward_cpu(*t, 4, torch.float32), [x, delta, base]),
        ("conv_backward_cpu", lambda t: ops.conv_backward_cpu(*t, 4), [x, x, delta, base]),
        ("selector_scores", lambda t: ops.selector_scores(*t, False, torch.float32), [unary, projected, a, b, pred,
                                                                                        cand]),
        ("selector_scores_backward", lambda t: ops.selector_scores_backward(*t, False, 20, torch.float32),
         [grad, projected, a, b, pred, cand]),
        ("candidate_topk", lambda t: ops.candidate_topk(*t, 4), [logits.view(6, 50)]),
        ("select_path", lambda t: ops.select_path(*t, 4, 1.0, torch.float32),
         [logits, projected_block, pa, pb, anchors, torch.rand(2, 3)]),
        ("rejection_sample", lambda t: ops.rejection_sample(*t), [tokens, target, proposal, candidates, uniforms]),
    ]


# candidate_topk takes one tensor: meta alone is a valid, shape-only call.
MULTI_TENSOR_OPS = ["conv_forward_cpu", "conv_backward_cpu", "selector_scores", "selector_scores_backward",
                    "select_path", "rejection_sample"]


@needs_extension
@pytest.mark.parametrize("op", MULTI_TENSOR_OPS)
def test_raw_ops_refuse_cpu_mixed_with_meta(op):
    """A meta tensor among CPU ones sends the call to the fake implementation, which
    must refuse it as the kernel would, not return an uninitialised tensor."""
    call, tensors = next((call, tensors) for name, call, tensors in _raw_calls() if name == op)
    for index in range(len(tensors)):
        with pytest.raises(ValueError, match="must be on one device"):
            call(_to_meta(tensors, index))


@needs_extension
@pytest.mark.parametrize("function", ["score_candidates", "pair_scores", "transition_scores"])
@pytest.mark.parametrize("top_k, rank", [(0, 8), (3, 0), (0, 0)], ids=["k0", "rank0", "both0"])
def test_empty_candidates_or_rank_give_the_reference_result(function, top_k, rank):
    case = SelectorCase((2, 3), 20, rank, top_k)
    unary, projected, a, b, pred, cand, _ = make_inputs(case, "cpu")
    projected.requires_grad_()
    if function == "score_candidates":
        args = (unary, projected, a, b, pred, cand)
    elif function == "pair_scores":
        args = (projected, unary.gather(-1, cand), a, b, cand, pred)
    else:
        args = (projected, a, b, pred, cand)
    got = getattr(dk, function)(*args)
    expected = getattr(reference, {"score_candidates": "selector_score_candidates",
                                   "pair_scores": "selector_pair_scores",
                                   "transition_scores": "selector_transition_scores"}[function])(*args)
    assert got.shape == expected.shape == (2, 3, top_k) and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)
    got.sum().backward()  # the gradients of an empty or rank-0 result exist too


@pytest.mark.parametrize("function", ["score_candidates", "pair_scores"])
def test_none_for_the_unary_scores_is_named(function):
    _, projected, a, b, pred, cand, _ = _selector_args()
    with pytest.raises(TypeError, match=r"unary(_logits)? must be a torch.Tensor, got NoneType"):
        if function == "score_candidates":
            dk.score_candidates(None, projected, a, b, pred, cand)
        else:
            dk.pair_scores(projected, None, a, b, cand, pred)


@needs_extension
def test_pair_scores_without_candidates_keeps_the_promised_dtype():
    projected = torch.randn(2, 5, dtype=torch.float64)
    unary = torch.randn(2, 0)
    codebook = torch.randn(10, 5, dtype=torch.float16)
    pred, cand = torch.zeros(2, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)
    assert dk.pair_scores(projected, unary, codebook, codebook, cand, pred).dtype == torch.float64


def test_transition_scores_checks_its_own_arguments_first():
    _, projected, a, b, pred, cand, _ = _selector_args()
    with pytest.raises(TypeError, match="projected must be a torch.Tensor"):
        dk.transition_scores(None, a, b, pred, cand)
    with pytest.raises(ValueError, match=re.escape("candidate_ids must have shape")):
        dk.transition_scores(projected, a, b, pred, cand[:3])


def test_select_top_k_is_what_the_caller_says():
    selector = dk.CandidateSelector(30, 12, 8, 5)
    logits, hidden, pred = torch.randn(4, 30), torch.randn(4, 12), torch.randint(0, 30, (4,))
    ids, scores = selector.select(logits, hidden, pred, top_k=0)
    assert ids.shape == scores.shape == (4, 0)
    assert selector.select(logits, hidden, pred)[0].shape == (4, 5)
    for bad in (-1, 31):
        with pytest.raises(ValueError, match=r"top_k must be in \[0, vocab_size=30\]"):
            selector.select(logits, hidden, pred, top_k=bad)
    with pytest.raises(TypeError, match="top_k must be an int"):
        selector.select(logits, hidden, pred, top_k=2.0)


@pytest.mark.parametrize("method", ["score_candidates", "select", "context", "pair_scores", "walk"])
def test_selector_methods_name_a_hidden_of_the_wrong_width(method):
    selector = dk.CandidateSelector(30, 12, 8, 5)
    wrong = torch.randn(2, 3, 11)
    logits, pred, cand = torch.randn(2, 3, 30), torch.randint(0, 30, (2, 3)), torch.randint(0, 30, (2, 3, 5))
    calls = {
        "score_candidates": lambda: selector.score_candidates(logits, wrong, pred, cand),
        "select": lambda: selector.select(logits, wrong, pred),
        "context": lambda: selector.context(wrong, pred),
        "pair_scores": lambda: selector.pair_scores(wrong, logits[..., :5], cand, pred),
        "walk": lambda: selector.walk(wrong, logits, pred[:, 0], 0.0),
    }
    with pytest.raises(ValueError, match=r"hidden(_states)? must be \[\.\.\., hidden_size=12\]"):
        calls[method]()


def test_conv_one_dimensional_base_kernel_is_named():
    x, delta, base = _conv_args()
    with pytest.raises(ValueError, match=re.escape("base_kernel must have shape [kernel_size, hidden_size], got (32,)")):
        dk.grouped_dynamic_conv(x, delta, base[0], block_size=4, group_size=16)


@pytest.mark.parametrize("name", ["block_size", "group_size"])
def test_conv_sizes_beyond_int64_are_value_errors(name):
    x, delta, base = _conv_args()
    sizes = {"block_size": 4, "group_size": 16, name: 2**63}
    with pytest.raises(ValueError, match=re.escape(f"{name} must be < 2**63")):
        dk.grouped_dynamic_conv(x, delta, base, **sizes)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_conv_with_no_channels_is_empty_on_every_backend(backend, monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", backend)
    x = torch.randn(2, 5, 0)
    delta = torch.randn(2, 5, 2, 0)
    base = torch.randn(2, 0)
    out = dk.grouped_dynamic_conv(x, delta, base, block_size=4, group_size=16)
    assert out.shape == (2, 5, 0)
