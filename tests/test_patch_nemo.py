"""dk.patch and dk.patch_nemo against NeMo Automodel 0.7.0's own DFlash 2 draft model.

Training: a tiny random ``Qwen3DFlash2DraftModel`` (tests/upstream_models.py) trains one
real step through NeMo's ``DFlash2TrainerModule`` (anchors, the draft, block CE +
selector CE) before and after the patch, judged against a float64 copy of the
unpatched model (SPEC section 4, as tests/contract.py states it).

Serving: NeMo's own ``spec_generate`` against a tiny random ``Qwen3ForCausalLM``
verifier. At temperature 0 a draft built after ``dk.patch_nemo()`` drafts the same
paths and emits the same tokens as upstream's (and as the verifier's own greedy
decoding). At temperature 1 the emitted tokens must follow the verifier's
distribution: each token's randomised probability integral transform under the
verifier's conditional distribution (tokens in descending probability) is, for a
lossless sampler, i.i.d. uniform on [0, 1), whatever the contexts, which a chi-square
over ten equal bins checks (tests/test_serving_stats.py's test, its significance; seeded,
so deterministic). The same check rejects a verifier that accepts every draft.
Skipped without the nemo-automodel package.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import dflash2_kernels as dk
from dflash2_kernels.compat import nemo as ours

from . import host_blas
from . import upstream_models as um
from .upstream_models import one_thread  # noqa: F401 (a fixture, used below)
from .contract import assert_within_contract
from .test_serving_stats import FAMILY_ALPHA, assert_fits, chi_square

pytestmark = pytest.mark.usefixtures("one_thread")

definitions = pytest.importorskip("nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2")
package = pytest.importorskip("nemo_automodel.components.speculative.dflash")

CONVS = [f"layers.{i}.{side}" for i in range(um.LAYERS) for side in ("attention_conv", "mlp_conv")]
MODULES = CONVS + ["candidate_selector"]
HOME = definitions.__name__
# The names patch_nemo must change: where the four are defined (and looked up by NeMo's
# conv, decoder layer, draft model and spec_generate) and the package's re-exports.
INSTALLED = {
    f"{HOME}._grouped_dynamic_convolve": (definitions, ours.grouped_dynamic_convolve),
    f"{HOME}.GroupedDynamicCausalConv": (definitions, ours.GroupedDynamicCausalConv),
    f"{HOME}.CandidateSelector": (definitions, ours.CandidateSelector),
    f"{HOME}.dflash2_rejection_sample": (definitions, ours.dflash2_rejection_sample),
    f"{package.__name__}.GroupedDynamicCausalConv": (package, ours.GroupedDynamicCausalConv),
    f"{package.__name__}.CandidateSelector": (package, ours.CandidateSelector),
}
PROMPT = torch.tensor([[14, 35, 45, 49, 106]])


@pytest.fixture(autouse=True)
def _restore_nemo():
    """Whatever a test does, NeMo leaves it as it found it (no-op if unpatched)."""
    yield
    dk.unpatch_nemo()


def _value(name: str):
    module, attribute = INSTALLED[name][0], name.rpartition(".")[2]
    return getattr(module, attribute)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


# --- dk.patch(model) -------------------------------------------------------------------


def test_patch_swaps_every_conv_and_selector_around_the_same_parameters():
    model = um.nemo_draft(0)
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    upstream = {name: model.get_submodule(name) for name in MODULES}
    rng = torch.get_rng_state()

    report = dk.patch(model)

    assert torch.equal(torch.get_rng_state(), rng), "patching drew random numbers"
    assert [r.name for r in report.replaced] == MODULES and report.skipped == []
    assert {r.upstream for r in report.replaced} == {f"{HOME}.GroupedDynamicCausalConv", f"{HOME}.CandidateSelector"}
    for name in CONVS:
        conv = model.get_submodule(name)
        assert type(conv) is ours.GroupedDynamicCausalConv
        assert (conv.kernel_size, conv.group_size) == (upstream[name].kernel_size, upstream[name].group_size)
    selector = model.candidate_selector
    assert type(selector) is ours.CandidateSelector
    assert (selector.rank, selector.top_k) == (upstream["candidate_selector"].rank, um.TOP_K)
    assert list(model.state_dict()) == keys
    for name, parameter in model.named_parameters():
        assert parameter is parameters[name], name

    assert dk.patch(model).already == MODULES  # twice: a no-op
    restored = dk.unpatch(model)
    assert [r.name for r in restored.replaced] == MODULES
    assert all(model.get_submodule(name) is upstream[name] for name in MODULES)
    assert all(p is parameters[name] for name, p in model.named_parameters())


def test_a_training_step_after_patch_is_within_contract_and_runs_our_kernels():
    target = um.qwen3_target(0)
    upstream = um.nemo_draft(0)
    exact = copy.deepcopy(upstream).double()
    exact_target = copy.deepcopy(target).double()
    patched = copy.deepcopy(upstream)
    dk.patch(patched)
    batch = um.nemo_batch(0)

    with um.count_dflash2_ops() as nothing:
        expected = um.nemo_loss(um.nemo_trainer(upstream, target), batch)
        expected.loss.backward()
    assert not nothing.counts, f"the unpatched model ran our ops: {nothing.counts}"
    with um.count_dflash2_ops() as ran:
        got = um.nemo_loss(um.nemo_trainer(patched, target), batch)
        got.loss.backward()
    judge = um.nemo_loss(um.nemo_trainer(exact, exact_target), batch.to(torch.float64))
    judge.loss.backward()

    # 4 convs x (prepare, finish), forward and backward; pair_scores once per step.
    assert ran.counts == {"grouped_dynamic_conv": 2 * len(CONVS), "grouped_dynamic_conv_backward": 2 * len(CONVS),
                          "selector_scores": 1, "selector_scores_backward": 1}
    # Some true tokens are among the candidates, or the selector would learn nothing.
    assert got.candidate_recall > 0 and got.selector_loss > 0
    for term in ("loss", "base_loss", "selector_loss"):
        assert_within_contract(term, getattr(got, term).detach(), getattr(expected, term).detach(),
                               getattr(judge, term).detach())
    grads, expected_grads, exact_grads = _grads(patched), _grads(upstream), _grads(exact)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().max() > 0, f"{name}: no gradient"
        assert_within_contract(name, grad, expected_grads[name], exact_grads[name])


# --- dk.patch_nemo() -------------------------------------------------------------------


def test_patch_nemo_installs_ours_everywhere_and_unpatch_restores_it():
    originals = {name: _value(name) for name in INSTALLED}
    before = um.nemo_draft(0, randomise=False)  # upstream's, built before
    batch, target = um.nemo_batch(0), um.qwen3_target(0)

    report = dk.patch_nemo()
    assert INSTALLED.keys() <= {r.name for r in report.replaced}
    for name, (_, installed) in INSTALLED.items():
        assert _value(name) is installed, name

    # A draft built now is ours throughout (NeMo's __init__ reset them as its own) and
    # holds what upstream's holds, bit for bit: the same random numbers were drawn.
    built = um.nemo_draft(0, randomise=False)
    assert {type(built.get_submodule(name)) for name in MODULES} == {ours.GroupedDynamicCausalConv,
                                                                     ours.CandidateSelector}
    assert not built.candidate_selector.successor_codebook.any()  # NeMo's identity start
    assert list(built.state_dict()) == list(before.state_dict())
    for (name, mine), theirs in zip(built.state_dict().items(), before.state_dict().values()):
        assert torch.equal(mine, theirs), name
    # It trains exactly as upstream's draft patched in place.
    twin = copy.deepcopy(before)
    dk.patch(twin)
    losses = []
    for model in (built, twin):
        um.randomise_dflash2_modules(model, torch.Generator().manual_seed(5))
        # Each side from the start of the host variant's BLAS orders (DFLASH2_TEST_BLAS=
        # alternating turns them call by call): the same products, rounded alike.
        with host_blas.emulated():
            losses.append(um.nemo_loss(um.nemo_trainer(model, target), batch).loss)
    assert torch.equal(*losses)
    # Upstream modules that already existed now call our _grouped_dynamic_convolve.
    with um.count_dflash2_ops() as ran:
        um.nemo_loss(um.nemo_trainer(before, target), batch)
    assert ran.counts["grouped_dynamic_conv"] == 2 * len(CONVS) and "selector_scores" not in ran.counts

    again = dk.patch_nemo()
    assert again.replaced == [] and INSTALLED.keys() <= set(again.already)

    undone = dk.unpatch_nemo()
    assert {r.name for r in undone.replaced} == {r.name for r in report.replaced}
    for name, original in originals.items():
        assert _value(name) is original, name
    rebuilt = um.nemo_draft(0, randomise=False)
    assert {type(rebuilt.get_submodule(name)).__module__ for name in MODULES} == {HOME}
    assert dk.unpatch_nemo().replaced == []


# --- spec_generate ---------------------------------------------------------------------


@contextlib.contextmanager
def _recorded_walks(draft: nn.Module):
    """The (path, candidate_ids) of every walk ``draft``'s selector takes meanwhile."""
    selector, walks = draft.candidate_selector, []
    walk = selector.walk

    def recording(*args, **kwargs):
        path, candidates, probs = walk(*args, **kwargs)
        walks.append((path.clone(), candidates.clone()))
        return path, candidates, probs

    selector.walk = recording
    try:
        yield walks
    finally:
        del selector.walk


def _greedy_continuation(target: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The verifier's own greedy decoding, one full forward per token (no cache)."""
    ids = prompt
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_spec_generate_at_temperature_0_matches_upstream_token_for_token():
    # A weak prior: varied greedy continuations, not one token repeated.
    target = um.qwen3_target(0, prior=1.0, spread=0.3)
    upstream = um.nemo_draft(0).eval()
    new_tokens = 24
    with _recorded_walks(upstream) as upstream_walks:
        expected = upstream.spec_generate(target, PROMPT, new_tokens, None, 0.0)

    dk.patch_nemo()
    draft = um.nemo_draft(0).eval()
    assert type(draft.candidate_selector) is ours.CandidateSelector
    with _recorded_walks(draft) as walks, um.count_dflash2_ops() as ran:
        emitted = draft.spec_generate(target, PROMPT, new_tokens, None, 0.0)

    assert emitted.tolist() == expected.tolist()
    assert emitted.tolist() == _greedy_continuation(target, PROMPT, new_tokens).tolist()
    # The same drafts, cycle by cycle: our walk picked upstream's paths.
    assert len(walks) == len(upstream_walks) > 1
    for cycle, ((path, candidates), (upstream_path, upstream_candidates)) in enumerate(zip(walks, upstream_walks)):
        assert path.tolist() == upstream_path.tolist(), f"cycle {cycle}"
        assert candidates.tolist() == upstream_candidates.tolist(), f"cycle {cycle}"
    # Our conv and walk ran (greedy verification is NeMo's own comparison).
    assert ran.counts["grouped_dynamic_conv"] > 0 and ran.counts["select_path"] == len(walks)


def _randomised_pit(tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """u = P(X before token) + v * P(token), tokens ordered by descending probability,
    v ~ U[0, 1): i.i.d. uniform when each token was drawn from its row of ``probs``.

    tokens [N] int64, probs [N, V] float64 -> u [N] float64."""
    order = probs.argsort(dim=-1, descending=True, stable=True)
    ranked = probs.gather(-1, order)
    rank = (order == tokens[:, None]).to(torch.int64).argmax(dim=-1, keepdim=True)
    mass = ranked.gather(-1, rank).squeeze(-1)
    before = ranked.cumsum(-1).gather(-1, rank).squeeze(-1) - mass
    return before + torch.rand(len(tokens), generator=generator, dtype=torch.float64) * mass


def _fit_to_target(draft: nn.Module, target: nn.Module, verify, *, temperature: float, new_tokens: int,
                   seed: int, monkeypatch):
    """The chi-square of the PIT of the tokens ``draft.spec_generate`` emits (with
    ``verify`` as NeMo's module-level ``dflash2_rejection_sample``) against U[0, 1)."""
    with monkeypatch.context() as patched:
        patched.setattr(definitions, "dflash2_rejection_sample", verify)
        torch.manual_seed(seed)  # spec_generate draws from the global generator
        emitted = draft.spec_generate(target, PROMPT, new_tokens, None, temperature)
    assert emitted.shape == (1, PROMPT.shape[1] + new_tokens)
    with torch.inference_mode():
        logits = target(emitted[:, :-1]).logits[0, PROMPT.shape[1] - 1 :].double()
    u = _randomised_pit(emitted[0, PROMPT.shape[1] :], torch.softmax(logits / temperature, dim=-1),
                        torch.Generator().manual_seed(seed))
    bins = 10
    return chi_square(torch.histc(u, bins=bins, min=0.0, max=1.0), torch.full((bins,), 1.0 / bins))


# Emitted tokens per check: at 400 the accept-everything verifier below is rejected at
# p < 1e-4 for each of the seeds 0, 1, 2 (at 200 for none of them).
SAMPLED_TOKENS = 400


def test_spec_generate_at_temperature_1_emits_the_verifiers_distribution(monkeypatch):
    dk.patch_nemo()
    target, draft = um.qwen3_target(0), um.nemo_draft(0).eval()
    assert type(draft.candidate_selector) is ours.CandidateSelector
    assert definitions.dflash2_rejection_sample is ours.dflash2_rejection_sample
    accepted = []

    def ours_counting(*args):
        count, bonus = ours.dflash2_rejection_sample(*args)
        accepted.append(count)
        return count, bonus

    result = _fit_to_target(draft, target, ours_counting, temperature=1.0, new_tokens=SAMPLED_TOKENS, seed=0,
                            monkeypatch=monkeypatch)
    # Ours verified every cycle; drafts were rejected at once, accepted in part and
    # (all D of them) in full, so every branch of rejection sampling ran.
    assert {0, 1, um.BLOCK - 1} <= set(accepted), sorted(set(accepted))
    assert_fits("spec_generate at T=1 (PIT)", result, FAMILY_ALPHA / 2)

    # Power: a verifier that keeps every draft emits the draft's distribution; the same
    # check rejects it.
    def accept_all(draft_tokens, target_probs, draft_probs, candidate_ids):
        return draft_tokens.shape[1], torch.multinomial(target_probs[0, -1], 1)[0]

    broken = _fit_to_target(draft, target, accept_all, temperature=1.0, new_tokens=SAMPLED_TOKENS, seed=0,
                            monkeypatch=monkeypatch)
    assert broken.rejects(FAMILY_ALPHA / 2), broken.detail
