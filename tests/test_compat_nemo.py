"""dflash2_kernels.compat.nemo against NeMo Automodel 0.7.0's own DFlash 2 classes.

The upstream pieces come from the installed ``nemo-automodel`` (requirements/upstream.txt);
without it this module is skipped. Numbers are held to SPEC section 4: our error against
a float64 evaluation of upstream's own code is at most twice upstream's error in the
input dtype (plus a tiny floor), gradients included.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels.compat import nemo as ours

from .contract import assert_within_contract
from .host_blas import pinned_outputs, replayed_outputs
from .serving_cases import distinct_top_logits

upstream = pytest.importorskip("nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}

# (block_size L, kernel_size K, hidden H, group_size): every L with K = 1, 2, 3, so
# K > L (NeMo's decode step) and L = 1 are in; S = 3L crosses two block edges.
CONV_CASES = [(L, K, {1: 64, 2: 96, 4: 128, 8: 256}[L], 32 if L == 4 else 16) for L in (1, 2, 4, 8) for K in (1, 2, 3)]


def _conv_id(case) -> str:
    return "L{}K{}H{}gs{}".format(*case)


def _conv_judge(monkeypatch, block_size: int, kernel_size: int) -> None:
    """NeMo's own convolve breaks for K > L + 1 (F.pad then grows the block): judge
    those cases by our reference, which is NeMo's arithmetic with taps >= L at zero."""
    if kernel_size > block_size + 1:
        monkeypatch.setattr(upstream, "_grouped_dynamic_convolve", reference.nemo_grouped_dynamic_convolve)


def _grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs)


# --- the grouped dynamic convolution ---------------------------------------------------


def _conv_inputs(case, dtype, device, seed=0):
    block, kernel, hidden, group = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3 * block, hidden, generator=g)
    # A strided dynamic, as NeMo's prepare hands it over: side 1 of [B, S, 2, K, G].
    projected = torch.randn(2, 3 * block, 2, kernel, hidden // group, generator=g) * 0.5
    base = torch.randn(kernel, hidden, generator=g)
    dy = torch.randn(2, 3 * block, hidden, generator=g)
    return [t.to(dtype).to(device) for t in (x, projected, base, dy)]


def _convolve_with_grads(fn, x, projected, base, dy, group, block):
    x, projected, base = (t.detach().requires_grad_() for t in (x, projected, base))
    out = fn(x, projected[..., 1, :, :], base, group, block)
    return (out, *_grads(out, (x, projected, base), dy))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", CONV_CASES, ids=_conv_id)
def test_grouped_dynamic_convolve_within_contract(case, dtype, device, monkeypatch, poison_empty):
    block, kernel, _, group = case
    x, projected, base, dy = _conv_inputs(case, dtype, device)
    got = _convolve_with_grads(ours.grouped_dynamic_convolve, x, projected, base, dy, group, block)
    _conv_judge(monkeypatch, block, kernel)
    expected = _convolve_with_grads(upstream._grouped_dynamic_convolve, x, projected, base, dy, group, block)
    exact = _convolve_with_grads(upstream._grouped_dynamic_convolve, *(t.double() for t in (x, projected, base, dy)),
                                 group, block)
    for name, kernel_result, ref, ex in zip(("out", "dhidden", "ddynamic", "dbase"), got, expected, exact):
        assert_within_contract(f"{_conv_id(case)} {name}", kernel_result, ref, ex)


@pytest.mark.parametrize("case", [c for c in CONV_CASES if c[1] <= c[0] + 1], ids=_conv_id)
def test_reference_is_nemos_arithmetic(case):
    """Where NeMo runs at all, dk.reference's NeMo variant is it, bit for bit."""
    block, _, _, group = case
    x, projected, base, _ = _conv_inputs(case, torch.bfloat16, "cpu", seed=1)
    theirs = upstream._grouped_dynamic_convolve(x, projected[..., 1, :, :], base, group, block)
    assert torch.equal(reference.nemo_grouped_dynamic_convolve(x, projected[..., 1, :, :], base, group, block), theirs)


def test_taps_past_the_block_read_zero():
    """K = 3 over blocks of 1 (NeMo cannot run it): only tap 0 is left."""
    x, projected, base, _ = _conv_inputs((1, 3, 64, 16), torch.float64, "cpu")
    dynamic = projected[..., 0, :, :]
    tap0 = (base[0] + dynamic[..., 0, :].repeat_interleave(16, -1)) * x
    torch.testing.assert_close(ours.grouped_dynamic_convolve(x, dynamic, base, 16, 1), tap0, rtol=0, atol=1e-12)
    torch.testing.assert_close(reference.nemo_grouped_dynamic_convolve(x, dynamic, base, 16, 1), tap0,
                               rtol=0, atol=1e-12)


def test_partial_blocks_are_a_value_error_naming_the_sizes():
    x, projected, base, _ = _conv_inputs((4, 2, 64, 16), torch.float32, "cpu")
    x, dynamic = x[:, :10], projected[:, :10, 1]
    with pytest.raises(RuntimeError):  # NeMo's own failure: a raw reshape error
        upstream._grouped_dynamic_convolve(x, dynamic, base, 16, 4)
    message = "sequence length (10) must be a multiple of block_size (4)."
    with pytest.raises(ValueError, match=re.escape(message)):
        ours.grouped_dynamic_convolve(x, dynamic, base, 16, 4)
    conv = ours.GroupedDynamicCausalConv(64, 2, 16)
    with pytest.raises(ValueError, match=re.escape(message)):
        conv.prepare(x, 4)


def test_speculators_rule_is_unchanged():
    x, projected, base, _ = _conv_inputs((2, 3, 64, 16), torch.float32, "cpu")
    with pytest.raises(ValueError, match=re.escape("kernel_size (3) cannot exceed block_size (2).")):
        dk.grouped_dynamic_conv(x, projected[..., 1, :, :], base, block_size=2, group_size=16)


@pytest.mark.parametrize("args", [(30, 2, 16), (48, 2, 32), (32, 0, 16), (32, -2, 16), (30, 0, 16)])
def test_conv_constructor_errors_are_nemos(args):
    with pytest.raises(ValueError) as theirs:
        upstream.GroupedDynamicCausalConv(*args)
    with pytest.raises(ValueError) as mine:
        ours.GroupedDynamicCausalConv(*args)
    assert str(mine.value) == str(theirs.value)


def test_conv_zero_group_size_is_named():
    with pytest.raises(ZeroDivisionError):  # NeMo's
        upstream.GroupedDynamicCausalConv(32, 2, 0)
    with pytest.raises(ValueError, match=re.escape("conv_group_size must be >= 1, got 0.")):
        ours.GroupedDynamicCausalConv(32, 2, 0)


def _random_conv(case, dtype, device, seed):
    _, kernel, hidden, group = case
    torch.manual_seed(seed)
    conv = upstream.GroupedDynamicCausalConv(hidden, kernel, group)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.3)
    return conv.to(dtype).to(device)


def _module_conv_with_grads(conv, x, y, g1, g2, block):
    x, y = x.detach().requires_grad_(), y.detach().requires_grad_()
    convolved, dynamic = conv.prepare(x, block)
    finished = conv.finish(y, dynamic, block)
    parameters = (conv.base_kernel, conv.kernel_projection.weight)
    return (convolved, finished, *_grads((convolved, finished), (x, y, *parameters), (g1, g2)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", CONV_CASES, ids=_conv_id)
def test_conv_module_within_contract(case, dtype, device, monkeypatch, poison_empty):
    block, kernel, hidden, group = case
    theirs = _random_conv(case, dtype, device, seed=3)
    mine = ours.GroupedDynamicCausalConv(hidden, kernel, group).to(dtype).to(device)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    g = torch.Generator().manual_seed(4)
    x, y, g1, g2 = (torch.randn(2, 3 * block, hidden, generator=g).to(dtype).to(device) for _ in range(4))
    # NeMo's module projects as ours did: the projection is the host BLAS's, and a second
    # call on equal values need not round alike (tests/host_blas.py).
    with pinned_outputs(mine.kernel_projection) as projections:
        got = _module_conv_with_grads(mine, x, y, g1, g2, block)
    _conv_judge(monkeypatch, block, kernel)
    with replayed_outputs(theirs.kernel_projection, projections):
        expected = _module_conv_with_grads(theirs, x, y, g1, g2, block)
    exact = _module_conv_with_grads(copy.deepcopy(theirs).double(), *(t.double() for t in (x, y, g1, g2)), block)
    names = ("prepare", "finish", "dx", "dy", "dbase_kernel", "dkernel_projection")
    for name, kernel_result, ref, ex in zip(names, got, expected, exact):
        assert_within_contract(f"{_conv_id(case)} {name}", kernel_result, ref, ex)


def test_conv_reset_is_the_identity():
    conv = _random_conv(CONV_CASES[4], torch.float32, "cpu", seed=5)
    mine = ours.GroupedDynamicCausalConv.from_upstream(conv)
    mine.reset_parameters()
    assert torch.equal(mine.base_kernel[:, 0], torch.ones_like(mine.base_kernel[:, 0]))
    assert not mine.base_kernel[:, 1:].any() and not mine.kernel_projection.weight.any()
    x = torch.randn(2, 4, 96)
    convolved, dynamic = mine.prepare(x, 2)
    assert torch.equal(convolved, x) and torch.equal(mine.finish(x, dynamic, 2), x)


# --- the candidate selector ------------------------------------------------------------


@pytest.mark.parametrize("args", [(1000, 64, 0, 4), (1000, 64, -3, 4), (1000, 64, 16, 0), (1000, 64, 16, 1001),
                                  (8, 64, 16, 9), (1000, 64, 0, 0)])
def test_selector_constructor_errors_are_nemos(args):
    with pytest.raises(ValueError) as theirs:
        upstream.CandidateSelector(*args)
    with pytest.raises(ValueError) as mine:
        ours.CandidateSelector(*args)
    assert str(mine.value) == str(theirs.value)


def _plain_attributes(module: nn.Module) -> dict:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


@pytest.mark.parametrize("build", [
    lambda m: m.GroupedDynamicCausalConv(96, 2, 16),
    lambda m: m.GroupedDynamicCausalConv(64, 3, 32),
    lambda m: m.CandidateSelector(1000, 64, 16, 8),
    lambda m: m.CandidateSelector(997, 128, 64, 16),
], ids=["conv-K2", "conv-K3", "selector-r16", "selector-r64"])
def test_seeded_construction_is_nemos(build):
    """Same keys, shapes, dtypes, values and attributes, and the same random numbers
    drawn, so a model built with ours initialises every other layer as NeMo's does."""
    torch.manual_seed(7)
    theirs = build(upstream)
    after_theirs = torch.rand(4)
    torch.manual_seed(7)
    mine = build(ours)
    after_mine = torch.rand(4)
    assert torch.equal(after_mine, after_theirs)
    assert list(mine.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert mine.state_dict()[key].dtype == value.dtype and torch.equal(mine.state_dict()[key], value), key
    theirs_attributes = _plain_attributes(theirs)
    assert {k: getattr(mine, k, None) for k in theirs_attributes} == theirs_attributes


def test_selector_reset_is_nemos():
    torch.manual_seed(8)
    selector = ours.CandidateSelector(1000, 64, 32, 8)
    assert not selector.successor_codebook.any()
    predecessor = selector.predecessor_codebook
    assert abs(predecessor.std().item() - 0.02) < 1e-3 and abs(predecessor.mean().item()) < 1e-3
    with torch.no_grad():
        selector.successor_codebook.normal_()
    projection = selector.hidden_projection.weight.clone()
    selector.reset_parameters()
    assert not selector.successor_codebook.any()
    assert torch.equal(selector.hidden_projection.weight, projection)  # left as nn.Linear built it


def _random_selector(vocab, hidden, rank, top_k, dtype, device, seed, scale=0.5):
    torch.manual_seed(seed)
    selector = upstream.CandidateSelector(vocab, hidden, rank, top_k)
    with torch.no_grad():
        selector.predecessor_codebook.normal_(std=scale)
        selector.successor_codebook.normal_(std=scale)
    return selector.to(dtype).to(device)


def _loaded(theirs):
    vocab, rank = theirs.predecessor_codebook.shape
    mine = ours.CandidateSelector(vocab, theirs.hidden_projection.in_features, rank, theirs.top_k)
    mine = mine.to(theirs.predecessor_codebook.dtype).to(theirs.predecessor_codebook.device)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    return mine


# (leading dims, vocab, hidden, rank, k, id range): the last ids draw from 40 tokens, so
# the codebook gradients sum over many repeats.
PAIR_CASES = [((2, 5), 1000, 64, 16, 4, 1000), ((3, 4, 2), 1000, 128, 64, 16, 1000), ((4, 8), 1009, 96, 33, 8, 40)]


def _pair_with_grads(selector, hidden, unary, candidate_ids, predecessor_ids, grad):
    hidden, unary = hidden.detach().requires_grad_(), unary.detach().requires_grad_()
    scores = selector.pair_scores(hidden, unary, candidate_ids, predecessor_ids)
    parameters = (selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight)
    return (scores, *_grads(scores, (hidden, unary, *parameters), grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"lead{c[0]}V{c[1]}H{c[2]}r{c[3]}k{c[4]}ids{c[5]}")
def test_pair_scores_within_contract(case, dtype, device, poison_empty):
    lead, vocab, hidden_size, rank, top_k, ids = case
    theirs = _random_selector(vocab, hidden_size, rank, top_k, dtype, device, seed=9)
    mine = _loaded(theirs)
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(*lead, hidden_size, generator=g).to(dtype).to(device)
    unary = torch.randn(*lead, top_k, generator=g).to(dtype).to(device)
    grad = torch.randn(*lead, top_k, generator=g).to(dtype).to(device)
    candidate_ids = torch.randint(0, ids, (*lead, top_k), generator=g).to(device)
    predecessor_ids = torch.randint(0, ids, lead, generator=g).to(device)
    got = _pair_with_grads(mine, hidden, unary, candidate_ids, predecessor_ids, grad)
    expected = _pair_with_grads(theirs, hidden, unary, candidate_ids, predecessor_ids, grad)
    exact = _pair_with_grads(copy.deepcopy(theirs).double(), hidden.double(), unary.double(), candidate_ids,
                             predecessor_ids, grad.double())
    names = ("scores", "dhidden", "dunary", "dpredecessor", "dsuccessor", "dprojection")
    for name, kernel_result, ref, ex in zip(names, got, expected, exact):
        assert_within_contract(name, kernel_result, ref, ex)


# (batch, draft, vocab, hidden, rank, k)
WALK_CASES = [(1, 7, 1000, 64, 16, 4), (3, 5, 1000, 128, 64, 16), (2, 8, 1500, 96, 32, 8)]


def _block(case, dtype, device, seed):
    batch, draft, vocab, hidden_size, rank, top_k = case
    g = torch.Generator().manual_seed(seed)
    # Distinct top logits: the candidates and their order are unique for every top-k.
    logits = distinct_top_logits((batch, draft), vocab, top_k, dtype, g).to(device)
    hidden = torch.randn(batch, draft, hidden_size, generator=g).to(dtype).to(device)
    anchors = torch.randint(0, vocab, (batch,), generator=g).to(device)
    return hidden, logits, anchors


def _walk_id(case) -> str:
    return "B{}D{}V{}H{}r{}k{}".format(*case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1e-6, 0.99e-5, -0.5])  # NeMo: anything below 1e-5 is greedy
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", WALK_CASES, ids=_walk_id)
def test_greedy_walk_is_nemos_token_for_token(case, dtype, temperature, device):
    _, _, vocab, hidden_size, rank, top_k = case
    theirs = _random_selector(vocab, hidden_size, rank, top_k, dtype, device, seed=11, scale=1.0)
    mine = _loaded(theirs)
    block = _block(case, dtype, device, seed=12)
    path, candidate_ids, draft_probs = mine.walk(*block, temperature)
    their_path, their_candidates, their_probs = theirs.walk(*block, temperature)
    assert draft_probs is None and their_probs is None
    assert candidate_ids.dtype == their_candidates.dtype and torch.equal(candidate_ids, their_candidates)
    assert path.dtype == their_path.dtype and torch.equal(path, their_path)
    # The pair term must matter here, or this test could not tell a walk from a top-1.
    assert not torch.equal(path, candidate_ids[..., 0])


def _scores_along(selector, hidden, logits, anchors, path):
    """NeMo's step scores [B, D, k] at the predecessors the walk actually took."""
    unary, candidate_ids = torch.topk(logits, selector.top_k, dim=-1)
    predecessors = torch.cat([anchors[:, None], path[:, :-1]], dim=1)
    return selector.pair_scores(hidden, unary, candidate_ids, predecessors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", WALK_CASES, ids=_walk_id)
def test_sampled_walk_proposes_the_softmax_along_its_path(case, dtype, temperature, device):
    _, _, vocab, hidden_size, rank, top_k = case
    theirs = _random_selector(vocab, hidden_size, rank, top_k, dtype, device, seed=13, scale=0.3)
    mine = _loaded(theirs)
    block = _block(case, dtype, device, seed=14)
    generator = torch.Generator(device).manual_seed(15)
    path, candidate_ids, draft_probs = mine.walk(*block, temperature, generator=generator)
    their_path, their_candidates, their_probs = theirs.walk(*block, temperature)
    for got, want in ((path, their_path), (candidate_ids, their_candidates), (draft_probs, their_probs)):
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    assert torch.equal(candidate_ids, their_candidates)
    chosen = candidate_ids == path[..., None]
    assert (chosen.sum(-1) == 1).all(), "every path token is exactly one of its candidates"
    assert (draft_probs[chosen] > 0).all()
    expected = torch.softmax(_scores_along(theirs, *block, path).float() / temperature, dim=-1)
    double = copy.deepcopy(theirs).double()
    exact = torch.softmax(_scores_along(double, *(t.double() if t.is_floating_point() else t for t in block), path)
                          / temperature, dim=-1)
    assert_within_contract("draft_probs", draft_probs, expected, exact)


def test_walk_samples_from_the_threshold_up():
    case = WALK_CASES[1]
    theirs = _random_selector(*case[2:], torch.float32, "cpu", seed=16)
    block = _block(case, torch.float32, "cpu", seed=17)
    assert ours.GREEDY_TEMPERATURE_EPS == upstream.GREEDY_TEMPERATURE_EPS
    for temperature in (ours.GREEDY_TEMPERATURE_EPS, upstream.GREEDY_TEMPERATURE_EPS):
        assert theirs.walk(*block, temperature)[2] is not None
        assert _loaded(theirs).walk(*block, temperature)[2] is not None


# --- rejection sampling ----------------------------------------------------------------


def _proposal(draft=5, vocab=1000, top_k=8, seed=18):
    """(draft_tokens [1, D], draft_probs [1, D, k], candidate_ids [1, D, k]): distinct
    candidates per position, the path one of them."""
    g = torch.Generator().manual_seed(seed)
    candidate_ids = torch.stack([torch.randperm(vocab, generator=g)[:top_k] for _ in range(draft)])[None]
    picks = torch.randint(0, top_k, (1, draft, 1), generator=g)
    draft_probs = torch.softmax(torch.randn(1, draft, top_k, generator=g), dim=-1)
    return candidate_ids.gather(-1, picks)[..., 0], draft_probs, candidate_ids


def _one_hot_rows(tokens, vocab, dtype):
    return nn.functional.one_hot(torch.as_tensor(tokens), vocab).to(dtype)


def _both(draft_tokens, target_probs, draft_probs, candidate_ids):
    torch.manual_seed(19)
    theirs = upstream.dflash2_rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids)
    mine = ours.dflash2_rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids,
                                         generator=torch.Generator().manual_seed(20))
    assert type(mine[0]) is type(theirs[0]) is int
    for bonus in (mine[1], theirs[1]):
        assert isinstance(bonus, torch.Tensor) and bonus.dim() == 0 and bonus.dtype == torch.long
    return (mine[0], mine[1].item()), (theirs[0], theirs[1].item())


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_rejection_sample_all_accepted(dtype):
    draft_tokens, draft_probs, candidate_ids = _proposal()
    rows = [*draft_tokens[0].tolist(), 123]  # the verifier agrees, then says 123
    target = _one_hot_rows(rows, 1000, dtype)[None]
    mine, theirs = _both(draft_tokens, target, draft_probs.to(dtype), candidate_ids)
    assert mine == theirs == (5, 123)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_rejection_sample_first_token_rejected(dtype):
    draft_tokens, draft_probs, candidate_ids = _proposal(seed=21)
    outside = next(t for t in range(1000) if t not in candidate_ids[0, 0].tolist())
    target = torch.softmax(torch.randn(1, 6, 1000, generator=torch.Generator().manual_seed(22)), -1).to(dtype)
    target[0, 0] = _one_hot_rows(outside, 1000, dtype)  # no mass on d_0: the residual is p_0 itself
    mine, theirs = _both(draft_tokens, target, draft_probs.to(dtype), candidate_ids)
    assert mine == theirs == (0, outside)


@pytest.mark.parametrize("agreed", [0, 2, 5])
def test_rejection_sample_of_a_one_hot_greedy_draft_is_greedy_verification(agreed):
    draft_tokens, _, candidate_ids = _proposal(seed=23)
    one_hot = (candidate_ids == draft_tokens[..., None]).float()
    verifier = draft_tokens[0].tolist() + [777]
    if agreed < 5:
        verifier[agreed] = next(t for t in range(1000) if t != verifier[agreed])
    target = _one_hot_rows(verifier, 1000, torch.float32)[None]
    mine, theirs = _both(draft_tokens, target, one_hot, candidate_ids)
    accepted, bonus = dk.greedy_verify(draft_tokens, target)
    assert mine == theirs == (agreed, verifier[agreed]) == (accepted.item(), bonus.item())


def test_rejection_sample_refuses_what_nemo_cannot_do():
    draft_tokens, draft_probs, candidate_ids = _proposal()
    target = torch.full((1, 6, 1000), 1e-3)
    with pytest.raises(TypeError, match="draft_probs is None"):
        ours.dflash2_rejection_sample(draft_tokens, target, None, candidate_ids)
    with pytest.raises(ValueError, match=re.escape("draft_tokens must be [1, D]")):
        ours.dflash2_rejection_sample(draft_tokens.repeat(2, 1), target.repeat(2, 1, 1), draft_probs.repeat(2, 1, 1),
                                      candidate_ids.repeat(2, 1, 1))
    target[0, 5] = 0  # all accepted, then nothing to draw from
    target[0, :5] = _one_hot_rows(draft_tokens[0].tolist(), 1000, torch.float32)
    with pytest.raises(RuntimeError):  # NeMo's torch.multinomial
        upstream.dflash2_rejection_sample(draft_tokens, target, draft_probs, candidate_ids)
    with pytest.raises(ValueError, match=re.escape("target_probs[0, 5] has no probability mass")):
        ours.dflash2_rejection_sample(draft_tokens, target, draft_probs, candidate_ids)


# --- from_upstream ---------------------------------------------------------------------


def test_conv_from_upstream_shares_the_parameters():
    theirs = _random_conv(CONV_CASES[4], torch.bfloat16, "cpu", seed=24).eval()
    state = torch.get_rng_state()
    mine = ours.GroupedDynamicCausalConv.from_upstream(theirs)
    assert torch.equal(torch.get_rng_state(), state), "from_upstream must draw no random numbers"
    assert mine.base_kernel is theirs.base_kernel
    assert mine.kernel_projection.weight is theirs.kernel_projection.weight
    assert [id(p) for p in mine.parameters()] == [id(p) for p in theirs.parameters()]
    assert list(mine.state_dict()) == list(theirs.state_dict()) and not mine.training
    assert (mine.kernel_size, mine.group_size) == (theirs.kernel_size, theirs.group_size)
    convolved, _ = mine.prepare(torch.randn(2, 8, 96, dtype=torch.bfloat16), 2)
    convolved.float().square().sum().backward()
    assert theirs.base_kernel.grad is not None and theirs.kernel_projection.weight.grad.any()


def test_selector_from_upstream_shares_the_parameters():
    case = WALK_CASES[2]
    theirs = _random_selector(*case[2:], torch.float32, "cpu", seed=25, scale=1.0)
    state = torch.get_rng_state()
    mine = ours.CandidateSelector.from_upstream(theirs)
    assert torch.equal(torch.get_rng_state(), state), "from_upstream must draw no random numbers"
    for name in ("predecessor_codebook", "successor_codebook"):
        assert getattr(mine, name) is getattr(theirs, name)
    assert mine.hidden_projection.weight is theirs.hidden_projection.weight
    assert list(mine.state_dict()) == list(theirs.state_dict())
    assert (mine.rank, mine.top_k) == (theirs.rank, theirs.top_k)
    block = _block(case, torch.float32, "cpu", seed=26)
    assert all(torch.equal(a, b) for a, b in zip(mine.walk(*block, 0.0)[:2], theirs.walk(*block, 0.0)[:2]))


def test_from_upstream_names_what_is_missing():
    with pytest.raises(TypeError, match="base_kernel must be an nn.Parameter, got NoneType"):
        ours.GroupedDynamicCausalConv.from_upstream(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="predecessor_codebook must be an nn.Parameter, got NoneType"):
        ours.CandidateSelector.from_upstream(nn.Linear(4, 4))
    theirs = upstream.CandidateSelector(100, 32, 8, 4)
    theirs.hidden_projection = nn.Linear(32, 8)  # with a bias: not NeMo's
    with pytest.raises(TypeError, match="hidden_projection must be an nn.Linear without bias"):
        ours.CandidateSelector.from_upstream(theirs)
