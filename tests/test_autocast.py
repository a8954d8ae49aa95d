"""Our ops inside ``torch.autocast`` behave as upstream's PyTorch does there.

The judge is ``dflash2_kernels.reference`` run inside the same autocast (what upstream's
code returns there): every public function must return the same dtypes, and make no
fp32 copy of a bf16 operand where upstream makes none. The inputs are the mixes real
training hands them (speculators runs ``torch.autocast(bf16)`` over fp32 master weights):
fp32 hidden with a bf16 strided delta and fp32 base for the conv; a bf16 projection (the
autocast Linear's) with fp32 codebooks and bf16 or fp32 unary scores for the selector;
bf16 or fp32 logits for serving; bf16 hidden with an fp32 lm_head for the draft head.

Where our ops register an autocast kernel (``dflash2_kernels._autocast``), they run with
autocast excluded: a backward inside ``torch.autocast`` gives what it gives outside.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import dflash2_kernels as dk
from dflash2_kernels import _autocast
from dflash2_kernels import reference as ref
from dflash2_kernels._extension import EXTENSION_LOADED

from .contract import assert_same_within_floor

BF16, F32 = torch.bfloat16, torch.float32
N, H, GS, K, L = 16, 32, 16, 2, 8        # conv: 16 rows, 2 blocks of 8
V, R, TOPK = 40, 8, 4                    # selector / serving / head
B, D = 2, 3                              # serving: 2 sequences drafting 3 tokens


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- the cases: (ours, upstream's), each a function of fresh inputs -------------------------
#
# A case builder returns (operands, ours, theirs): operands the named tensors of the call
# (the bf16 ones are watched for widening copies), ours() and theirs() the calls.


def conv_case():
    g = _gen(1)
    x = torch.randn(N, H, generator=g)
    # speculators under autocast: the projection's bf16 output, one side of it (strided).
    kernels = torch.randn(N, 2, K, H // GS, generator=g).to(BF16)
    delta, base = kernels[:, 0], torch.randn(K, H, generator=g)
    args = (x, delta, base)
    return ({"x": x, "delta": delta, "base": base},
            lambda: dk.grouped_dynamic_conv(*args, block_size=L, group_size=GS),
            lambda: ref.grouped_dynamic_conv(*args, block_size=L, group_size=GS))


def _selector_operands(unary_dtype, unary_width, seed):
    g = _gen(seed)
    return {
        "unary": torch.randn(N, unary_width, generator=g).to(unary_dtype),
        "projected": torch.randn(N, R, generator=g).to(BF16),
        "predecessor_codebook": torch.randn(V, R, generator=g),
        "successor_codebook": torch.randn(V, R, generator=g),
        "predecessor_ids": torch.randint(0, V, (N,), generator=g),
        "candidate_ids": torch.randint(0, V, (N, TOPK), generator=g),
    }


def score_candidates_case(unary_dtype):
    t = _selector_operands(unary_dtype, V, 2)
    args = (t["unary"], t["projected"], t["predecessor_codebook"], t["successor_codebook"], t["predecessor_ids"],
            t["candidate_ids"])
    return t, lambda: dk.score_candidates(*args), lambda: ref.selector_score_candidates(*args)


def pair_scores_case(unary_dtype):
    t = _selector_operands(unary_dtype, TOPK, 3)
    args = (t["projected"], t["unary"], t["predecessor_codebook"], t["successor_codebook"], t["candidate_ids"],
            t["predecessor_ids"])
    return t, lambda: dk.pair_scores(*args), lambda: ref.selector_pair_scores(*args)


def transition_scores_case(codebook_dtype):
    t = _selector_operands(BF16, TOPK, 4)
    t["predecessor_codebook"] = t["predecessor_codebook"].to(codebook_dtype)
    t["successor_codebook"] = t["successor_codebook"].to(codebook_dtype)
    del t["unary"]
    args = (t["projected"], t["predecessor_codebook"], t["successor_codebook"], t["predecessor_ids"],
            t["candidate_ids"])
    return t, lambda: dk.transition_scores(*args), lambda: ref.selector_transition_scores(*args)


def _serving_operands(logits_dtype, seed):
    g = _gen(seed)
    return {
        "projected": torch.randn(B, D, R, generator=g).to(BF16),
        "logits": torch.randn(B, D, V, generator=g).to(logits_dtype),
        "anchor_ids": torch.randint(0, V, (B,), generator=g),
        "predecessor_codebook": torch.randn(V, R, generator=g),
        "successor_codebook": torch.randn(V, R, generator=g),
    }


def candidate_topk_case(logits_dtype):
    t = _serving_operands(logits_dtype, 5)
    return t, lambda: dk.candidate_topk(t["logits"], TOPK), lambda: ref.candidate_topk(t["logits"], TOPK)


def edge_scores_case(logits_dtype, top_k=TOPK):
    t = _serving_operands(logits_dtype, 6)
    args = tuple(t.values())
    return t, lambda: dk.edge_scores(*args, top_k), lambda: ref.serving_edge_scores(*args, top_k)


def walk_case(logits_dtype, temperature):
    t = _serving_operands(logits_dtype, 7)
    args = tuple(t.values())

    def theirs():
        draws = torch.rand((B, D), generator=_gen(11)) if temperature > 0 else None
        return ref.serving_walk(*args, TOPK, temperature, draws)

    return t, lambda: dk.walk(*args, TOPK, temperature, generator=_gen(11)), theirs


def verify_case(probs_dtype):
    g = _gen(8)
    target = torch.softmax(torch.randn(B, D + 1, V, generator=g), -1).to(probs_dtype)
    cand = torch.randint(0, V, (B, D, TOPK), generator=g)
    q = torch.softmax(torch.randn(B, D, TOPK, generator=g), -1)
    draft = cand[..., 0]
    t = {"draft_tokens": draft, "target_probs": target, "draft_probs": q, "candidate_ids": cand}

    def theirs():
        return ref.rejection_sample(draft, target, q, cand, torch.rand((B, D + 1), generator=_gen(12)))

    return t, lambda: dk.rejection_sample(draft, target, q, cand, generator=_gen(12)), theirs


def greedy_verify_case(logits_dtype):
    g = _gen(9)
    t = {"draft_tokens": torch.randint(0, V, (B, D), generator=g),
         "target_logits": torch.randn(B, D + 1, V, generator=g).to(logits_dtype)}
    return t, lambda: dk.greedy_verify(*t.values()), lambda: ref.greedy_verify(*t.values())


def draft_head_case(logits_dtype):
    g = _gen(10)
    t = {"hidden": torch.randn(N, H, generator=g).to(BF16), "weight": torch.randn(V, H, generator=g),
         "target_hidden": torch.randn(N, H, generator=g).to(BF16)}
    kwargs = dict(target_hidden=t["target_hidden"], losses=("kl_div", "jsd", "ce"), top_k=TOPK,
                  logits_dtype=logits_dtype)
    return (t, lambda: dk.draft_head(t["hidden"], t["weight"], **kwargs),
            lambda: ref.draft_head(t["hidden"], t["weight"], **kwargs))


def _selector_module():
    torch.manual_seed(0)
    return dk.CandidateSelector(vocab_size=V, hidden_size=H, rank=R, top_k=TOPK)  # fp32 master weights


def module_case(method, unary_dtype=BF16):
    """CandidateSelector's methods (P = the autocast Linear's bf16 output) against upstream's
    formulas on the same module's parameters."""
    module = _selector_module()
    g = _gen(13)
    hidden = torch.randn(N, H, generator=g)
    pred = torch.randint(0, V, (N,), generator=g)
    cand = torch.randint(0, V, (N, TOPK), generator=g)
    unary = torch.randn(N, V, generator=g).to(unary_dtype)
    codebooks = (module.predecessor_codebook, module.successor_codebook)
    project = module.hidden_projection
    blocks = hidden[:B * D].view(B, D, H)
    logits = unary[:B * D].view(B, D, V)
    anchors = pred[:B]
    calls = {
        "score_candidates": (lambda: module.score_candidates(unary, hidden, pred, cand),
                             lambda: ref.selector_score_candidates(unary, project(hidden), *codebooks, pred, cand)),
        "select": (lambda: module.select(unary, hidden, pred),
                   lambda: (unary.topk(TOPK, -1).indices, ref.selector_score_candidates(
                       unary, project(hidden), *codebooks, pred, unary.topk(TOPK, -1).indices))),
        "transition_scores": (lambda: module.transition_scores(hidden, pred, cand),
                              lambda: ref.selector_transition_scores(project(hidden), *codebooks, pred, cand)),
        "pair_scores": (lambda: module.pair_scores(hidden, unary[:, :TOPK], cand, pred),
                        lambda: ref.selector_pair_scores(project(hidden), unary[:, :TOPK], *codebooks, cand, pred)),
        "edge_scores": (lambda: module.edge_scores(blocks, logits, anchors),
                        lambda: ref.serving_edge_scores(project(blocks), logits, anchors, *codebooks, TOPK)),
        "walk": (lambda: module.walk(blocks, logits, anchors, 0.0),
                 lambda: ref.serving_walk(project(blocks), logits, anchors, *codebooks, TOPK, 0.0)),
    }
    ours, theirs = calls[method]
    return {"hidden": hidden}, ours, theirs


CASES = {
    "conv": conv_case,
    "score_candidates-bf16_unary": lambda: score_candidates_case(BF16),
    "score_candidates-fp32_unary": lambda: score_candidates_case(F32),
    "pair_scores-bf16_unary": lambda: pair_scores_case(BF16),
    "pair_scores-fp32_unary": lambda: pair_scores_case(F32),
    "transition_scores-fp32_codebooks": lambda: transition_scores_case(F32),
    "transition_scores-bf16_codebooks": lambda: transition_scores_case(BF16),
    "candidate_topk-bf16": lambda: candidate_topk_case(BF16),
    "edge_scores-bf16_logits": lambda: edge_scores_case(BF16),
    "edge_scores-fp32_logits": lambda: edge_scores_case(F32),
    "edge_scores-bf16_logits-reference_path": lambda: edge_scores_case(BF16, top_k=33),
    "walk-greedy": lambda: walk_case(BF16, 0.0),
    "walk-sampled": lambda: walk_case(BF16, 0.7),
    "rejection_sample-bf16": lambda: verify_case(BF16),
    "greedy_verify-bf16": lambda: greedy_verify_case(BF16),
    "draft_head-bf16_logits": lambda: draft_head_case(BF16),
    "draft_head-default_logits": lambda: draft_head_case(None),
    **{f"CandidateSelector.{m}": (lambda m=m: module_case(m)) for m in
       ("score_candidates", "select", "transition_scores", "pair_scores", "edge_scores", "walk")},
}


def _dtypes(result):
    """The dtypes of a result's tensors, in order (a DraftHeadOutput's losses dict included)."""
    return [t.dtype if isinstance(t, torch.Tensor) else t for t in pytree.tree_leaves(result)]


needs_extension = pytest.mark.skipif(not EXTENSION_LOADED, reason="the autocast kernels wrap the compiled ops")


@needs_extension
@pytest.mark.parametrize("name", sorted(CASES))
def test_output_dtypes_are_upstreams_under_autocast(name):
    operands, ours, theirs = CASES[name]()
    with autocast():
        got, want = ours(), theirs()
    assert _dtypes(got) == _dtypes(want)


class _WideningCopies(TorchDispatchMode):
    """Records which watched bf16 operands an aten op read into a wider float result of at
    least the read tensor's size (a cast, or a promoting elementwise op: a widened copy),
    and what reached the dflash2 ops."""

    def __init__(self, operands: dict):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr(): name for name, t in operands.items()
                         if t.dtype in (BF16, torch.float16)}
        self.widened: set[str] = set()
        self.op_inputs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace == "dflash2":
            self.op_inputs.append((func, leaves))
            return out
        wide = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.dtype in (F32, torch.float64)]
        for tensor in leaves:
            name = self.storages.get(tensor.untyped_storage().data_ptr()) if tensor.dtype == BF16 else None
            if name is not None and any(w.numel() >= tensor.numel() for w in wide):
                self.widened.add(name)
        return out


def _widened(operands: dict, call) -> tuple[set, list]:
    with autocast(), _WideningCopies(operands) as mode:
        call()
    return mode.widened, mode.op_inputs


WATCHED = [name for name in sorted(CASES) if not name.startswith("CandidateSelector.")]


@needs_extension
@pytest.mark.parametrize("name", WATCHED)
def test_no_fp32_copy_of_a_bf16_operand_where_upstream_makes_none(name):
    operands, ours, theirs = CASES[name]()
    ours_widened, _ = _widened(operands, ours)
    theirs_widened, _ = _widened(operands, theirs)
    assert ours_widened <= theirs_widened, (ours_widened, theirs_widened)


@needs_extension
def test_the_conv_kernel_reads_the_bf16_strided_delta_in_place():
    """speculators' autocast mix reaches the kernel as it is: fp32 x, the bf16 delta view
    itself (no copy, no cast), fp32 base; the result fp32 as upstream's."""
    operands, ours, _ = conv_case()
    with autocast(), _WideningCopies(operands) as mode:
        out = ours()
    assert out.dtype == F32
    (op, tensors), = [entry for entry in mode.op_inputs if entry[0].name() == "dflash2::grouped_dynamic_conv"]
    x, delta, base = tensors
    assert (x.dtype, delta.dtype, base.dtype) == (F32, BF16, F32)
    assert delta.data_ptr() == operands["delta"].data_ptr() and delta.stride() == operands["delta"].stride()


@needs_extension
def test_pair_scores_and_edges_round_once_to_upstreams_autocast_dtype():
    """Under autocast the pair-form scores and the edges come out in upstream's bf16, from
    the kernels' fp32 sums: the fp32 result outside autocast, rounded once."""
    operands, ours, _ = pair_scores_case(BF16)
    outside = ours()
    with autocast():
        inside = ours()
    assert outside.dtype == F32 and inside.dtype == BF16
    assert torch.equal(inside, outside.to(BF16))
    operands, ours, _ = edge_scores_case(BF16)
    outside, _ = ours()
    with autocast():
        inside, _ = ours()
    assert torch.equal(inside, outside.to(BF16))


@needs_extension
@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen_weight", "weight_grad"])
def test_draft_head_backward_inside_autocast_equals_outside(weight_grad):
    """The head's Python backward (einsum, bmm) runs with autocast excluded: a backward
    inside ``torch.autocast`` gives the gradients it gives outside (up to the host BLAS)."""
    g = _gen(14)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    target = torch.randn(N, H, generator=g)
    grads = []
    for inside in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(weight_grad)
        with torch.autocast("cpu", dtype=BF16, enabled=inside):
            out = dk.draft_head(h, w, target_hidden=target, losses=("kl_div", "ce"), top_k=TOPK)
            (out.losses["kl_div"].sum() + out.losses["ce"].sum() + out.topk_logits.sum()
             + out.label_logit.sum()).backward()
        grads.append((h.grad, w.grad))
    # Not bit for bit: the GEMMs run on other buffers each time, and a BLAS without
    # conditional reproducibility (MKL's AVX-512 kernels) may round them differently; a
    # bf16 einsum, what this guards against, is off by ~1e-2.
    assert_same_within_floor("grad hidden", grads[1][0], grads[0][0])
    if weight_grad:
        assert_same_within_floor("grad weight", grads[1][1], grads[0][1])


@needs_extension
def test_selector_gradients_under_autocast_have_the_operands_dtypes():
    """speculators' step under autocast: bf16 P (the Linear's), fp32 codebooks, bf16 unary;
    the backward reaches every operand in its own dtype, as upstream's."""
    module = _selector_module()
    g = _gen(15)
    hidden = torch.randn(N, H, generator=g)
    unary = torch.randn(N, V, generator=g).to(BF16).requires_grad_()
    pred, cand = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N, TOPK), generator=g)
    with autocast():
        scores = module.score_candidates(unary, hidden, pred, cand)
        pair = module.pair_scores(hidden, unary[:, :TOPK], cand, pred)
    (scores.float().sum() + pair.float().sum()).backward()
    assert scores.dtype == BF16 and pair.dtype == BF16
    assert unary.grad.dtype == BF16
    for parameter in module.parameters():
        assert parameter.grad is not None and parameter.grad.dtype == F32


def test_every_op_has_an_autocast_kernel_or_a_documented_fallthrough():
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("dflash2::")}
    assert ops <= set(_autocast.RULES) | set(_autocast.FALLTHROUGH), ops - set(_autocast.RULES) - set(
        _autocast.FALLTHROUGH)
    for name in _autocast.RULES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash2::{name}", "AutocastCPU"), name


@needs_extension
@pytest.mark.compiles
def test_compiled_calls_under_autocast_equal_eager():
    """torch.compile(fullgraph) traces the autocast kernels: the same dtypes and values as
    eager under autocast, the head's backward included."""
    operands, _, _ = pair_scores_case(BF16)
    args = (operands["projected"], operands["unary"], operands["predecessor_codebook"],
            operands["successor_codebook"], operands["candidate_ids"], operands["predecessor_ids"])
    serving, _, _ = edge_scores_case(BF16)
    g = _gen(16)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    target = torch.randn(N, H, generator=g)

    def step(hidden):
        out = dk.draft_head(hidden, weight, target_hidden=target, losses=("kl_div",), top_k=TOPK)
        return out.losses["kl_div"].sum()

    results = []
    for compiled in (False, True):
        wrap = (lambda f: torch.compile(f, fullgraph=True, backend="aot_eager")) if compiled else (lambda f: f)
        h = hidden.clone().requires_grad_()
        with autocast():
            pair = wrap(dk.pair_scores)(*args)
            edges = wrap(dk.edge_scores)(*serving.values(), TOPK)[0]
            wrap(step)(h).backward()
        results.append((pair, edges, h.grad))
    for eager, compiled in zip(*results):
        assert compiled.dtype == eager.dtype
        # the head's GEMMs may round differently on other buffers (MKL without CNR)
        assert_same_within_floor("compiled", compiled, eager)
    assert results[0][0].dtype == BF16 and results[0][1].dtype == BF16
