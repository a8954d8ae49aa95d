"""Bad and edge inputs at every entry point: raw ops refuse what their kernels cannot
handle (naming the argument), and empty sizes give the reference's empty results."""

from __future__ import annotations

import os
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


def _raw_calls(namespace="dflash2"):
    """(op name, callable taking the tensor list, tensor list) for every C++ op of
    torch.ops.<namespace>: dflash2 (CPU kernels), or dflash2_emulated (the CUDA
    bindings and kernels run on CPU tensors, in the sanitized build; no conv ops)."""
    ops = getattr(torch.ops, namespace)
    x, delta, base = _conv_args()
    unary, projected, a, b, pred, cand, grad = _selector_args()
    projected_block, logits, anchors, pa, pb = block_inputs(BlockCase(2, 3, 50, 8, 4), "cpu")
    tokens, target, proposal, candidates, uniforms = verify_inputs(VERIFY_CASES[1], "cpu")
    calls = [
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
    return [call for call in calls if namespace == "dflash2" or not call[0].startswith("conv_")]


# Each op's tensor arguments, in the order _raw_calls passes them (the schema's names).
TENSOR_NAMES = {
    "conv_forward_cpu": ("x", "delta", "base"),
    "conv_backward_cpu": ("grad_out", "x", "delta", "base"),
    "selector_scores": ("unary", "projected", "predecessor_codebook", "successor_codebook", "predecessor_ids",
                        "candidate_ids"),
    "selector_scores_backward": ("grad_scores", "projected", "predecessor_codebook", "successor_codebook",
                                 "predecessor_ids", "candidate_ids"),
    "candidate_topk": ("logits",),
    "select_path": ("logits", "projected", "predecessor_codebook", "successor_codebook", "anchor_ids", "uniforms"),
    "rejection_sample": ("draft_tokens", "target_probs", "draft_probs", "candidate_ids", "uniforms"),
}
NAMESPACES = ["dflash2", "dflash2_emulated"]


def _ops_in(namespace):
    """torch.ops.<namespace>'s calls; the emulated ops only in the sanitized test build."""
    if namespace == "dflash2_emulated":
        library = os.environ.get("DFLASH2_EMULATED_LIB")
        if not library:
            pytest.skip("emulated CUDA kernels: run `python scripts/asan.py test`")
        torch.ops.load_library(library)
    return {name: (call, tensors) for name, call, tensors in _raw_calls(namespace)}


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
@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("op", MULTI_TENSOR_OPS)
def test_raw_ops_name_a_none_tensor(op, namespace):
    """torch's schema hands None for a Tensor to the op as an undefined tensor: each op
    refuses it first, naming the argument (not torch's "tensor does not have a device")."""
    ops = _ops_in(namespace)
    if op not in ops:
        pytest.skip(f"{namespace} has no {op}")
    call, tensors = ops[op]
    for index, name in enumerate(TENSOR_NAMES[op]):
        args = list(tensors)
        args[index] = None
        with pytest.raises(TypeError, match=f"^{name} must be a tensor, got None$"):
            call(args)


@needs_extension
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_greedy_select_path_still_needs_a_uniforms_tensor(namespace):
    """uniforms is read only when sampling, but the schema takes a tensor: None is refused
    greedy too (the Python wrapper passes an empty tensor)."""
    call, tensors = _ops_in(namespace)["select_path"]
    ops = getattr(torch.ops, namespace)
    with pytest.raises(TypeError, match="^uniforms must be a tensor, got None$"):
        ops.select_path(*tensors[:5], None, 4, 0.0, torch.float32)
    assert ops.select_path(*tensors[:5], torch.empty(0), 4, 0.0, torch.float32)[0].shape == (2, 3)


def _strided(tensor):
    """The same values with last stride 2."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    wide[..., ::2] = tensor
    return wide[..., ::2]


# (op, index of the tensor replaced, how, exception, message start): the raw ops' dtype
# and layout errors name the argument they are about.
RAW_ARGUMENT_ERRORS = [
    ("selector_scores", 2, lambda t: t.to(torch.int16), TypeError,
     "predecessor_codebook must be float16, bfloat16, float32 or float64, got Short"),
    ("selector_scores", 3, lambda t: t.to(torch.bool), TypeError,
     "successor_codebook must have predecessor_codebook's dtype Float, got Bool"),
    ("selector_scores", 3, lambda t: t.to(torch.bfloat16), TypeError,
     "successor_codebook must have predecessor_codebook's dtype Float, got BFloat16"),
    ("selector_scores", 1, _strided, ValueError, "projected must have a unit last stride"),
    ("selector_scores", 2, _strided, ValueError, "predecessor_codebook must have a unit last stride"),
    ("selector_scores", 3, _strided, ValueError, "successor_codebook must have a unit last stride"),
    ("selector_scores", 0, _strided, ValueError, "unary must have a unit last stride"),
    ("selector_scores", 4, lambda t: t.int(), TypeError, "predecessor_ids must be int64, got Int"),
    ("selector_scores", 5, lambda t: t.int(), TypeError, "candidate_ids must be int64, got Int"),
    ("selector_scores_backward", 2, lambda t: t.to(torch.complex64), TypeError,
     "predecessor_codebook must be float16, bfloat16, float32 or float64, got ComplexFloat"),
    ("selector_scores_backward", 3, lambda t: t.double(), TypeError,
     "successor_codebook must have predecessor_codebook's dtype Float, got Double"),
    ("selector_scores_backward", 3, _strided, ValueError, "successor_codebook must have a unit last stride"),
    ("select_path", 2, lambda t: t.to(torch.int8), TypeError,
     "predecessor_codebook must be float16, bfloat16 or float32, got Char"),
    ("select_path", 3, lambda t: t.half(), TypeError,
     "successor_codebook must have predecessor_codebook's dtype Float, got Half"),
    ("select_path", 5, lambda t: t.double(), TypeError, "uniforms must be float32, got Double"),
    ("rejection_sample", 0, lambda t: t.int(), TypeError, "draft_tokens must be int64, got Int"),
    ("rejection_sample", 3, lambda t: t.int(), TypeError, "candidate_ids must be int64, got Int"),
    ("rejection_sample", 2, lambda t: t.half(), TypeError, "draft_probs must be float32, got Half"),
    ("rejection_sample", 4, lambda t: t.double(), TypeError, "uniforms must be float32, got Double"),
]


@needs_extension
@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("op,index,change,error,message", RAW_ARGUMENT_ERRORS,
                         ids=[f"{e[0]}-{TENSOR_NAMES[e[0]][e[1]]}-{e[4].split(' ')[-1]}" for e in RAW_ARGUMENT_ERRORS])
def test_raw_op_errors_name_the_argument(op, index, change, error, message, namespace):
    call, tensors = _ops_in(namespace)[op]
    args = list(tensors)
    args[index] = change(args[index])
    with pytest.raises(error, match=re.escape(message)):
        call(args)


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
