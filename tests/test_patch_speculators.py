"""dk.patch and dk.patch_speculators against speculators 0.9.0's own DFlash 2 draft model.

A tiny random ``DFlash2DraftModel`` (tests/upstream_models.py) trains one real step
(``forward``: anchors, the draft backbone, unary KL + selector cross-entropy) before
and after the patch. The judge is a float64 copy of the unpatched model (SPEC section
4): the loss and every parameter gradient of the patched model in fp32 must be within
twice the unpatched fp32 model's error against it, plus the tiny floor of
tests/contract.py. Skipped without the speculators package.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dflash2_kernels as dk

from . import upstream_models as um
from .upstream_models import one_thread  # noqa: F401 (a fixture, used below)
from .contract import assert_within_contract

pytestmark = pytest.mark.usefixtures("one_thread")

speculators_core = pytest.importorskip("speculators.models.dflash2.core")
definitions = pytest.importorskip("speculators.models.dflash2.model_definitions")

CONVS = [f"layers.{i}.{side}" for i in range(um.LAYERS) for side in ("attention_conv", "mlp_conv")]
MODULES = CONVS + ["candidate_selector"]
UPSTREAM_CONV = "speculators.models.dflash2.model_definitions.GroupedDynamicCausalConv"
UPSTREAM_SELECTOR = "speculators.models.dflash2.model_definitions.CandidateSelector"
# The names patch_speculators must change: where the three are defined, and core's
# own CandidateSelector (core imported the name; the draft model is built from it).
INSTALLED = {
    "speculators.models.dflash2.model_definitions.grouped_dynamic_conv": dk.grouped_dynamic_conv,
    "speculators.models.dflash2.model_definitions.GroupedDynamicCausalConv": dk.GroupedDynamicCausalConv,
    "speculators.models.dflash2.model_definitions.CandidateSelector": dk.CandidateSelector,
    "speculators.models.dflash2.core.CandidateSelector": dk.CandidateSelector,
}


@pytest.fixture(autouse=True)
def _restore_speculators():
    """Whatever a test does, speculators leaves it as it found it (no-op if unpatched)."""
    yield
    dk.unpatch_speculators()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _installed_value(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr({"speculators.models.dflash2.model_definitions": definitions,
                    "speculators.models.dflash2.core": speculators_core}[module], attribute)


# --- dk.patch(model) -------------------------------------------------------------------


def test_patch_swaps_every_conv_and_selector_around_the_same_parameters():
    model = um.speculators_draft(0)
    model.layers[1].mlp_conv.eval()  # the training flag travels per module
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    upstream = {name: model.get_submodule(name) for name in MODULES}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = torch.get_rng_state()

    report = dk.patch(model)

    assert torch.equal(torch.get_rng_state(), rng), "patching drew random numbers"
    assert [r.name for r in report.replaced] == MODULES
    assert {r.upstream for r in report.replaced} == {UPSTREAM_CONV, UPSTREAM_SELECTOR}
    assert report.already == [] and report.skipped == []
    for name in CONVS:
        conv, original = model.get_submodule(name), upstream[name]
        assert type(conv) is dk.GroupedDynamicCausalConv
        for attribute in ("block_size", "kernel_size", "group_size", "num_groups", "training"):
            assert getattr(conv, attribute) == getattr(original, attribute), (name, attribute)
    assert type(model.candidate_selector) is dk.CandidateSelector
    assert model.candidate_selector.top_k == upstream["candidate_selector"].top_k == um.TOP_K
    # The very same Parameter objects, under the very same keys, in the same order.
    assert list(model.state_dict()) == keys
    for name, parameter in model.named_parameters():
        assert parameter is parameters[name], name
    assert optimizer.param_groups[0]["params"] == list(parameters.values())
    # ... so an optimizer built before the patch steps ours.
    before = model.candidate_selector.successor_codebook.detach().clone()
    loss, _ = um.speculators_loss(model, um.speculators_batch(0))
    loss.backward()
    optimizer.step()
    assert not torch.equal(model.candidate_selector.successor_codebook, before)


def test_a_training_step_after_patch_is_within_contract_and_runs_our_kernels():
    upstream = um.speculators_draft(0)
    exact = copy.deepcopy(upstream).double()
    ours = copy.deepcopy(upstream)
    dk.patch(ours)
    batch = um.speculators_batch(0)

    with um.count_dflash2_ops() as nothing:
        expected, expected_metrics = um.speculators_loss(upstream, batch)
        expected.backward()
    assert not nothing.counts, f"the unpatched model ran our ops: {nothing.counts}"
    with um.count_dflash2_ops() as ran:
        loss, metrics = um.speculators_loss(ours, batch)
        loss.backward()
    exact_loss, exact_metrics = um.speculators_loss(exact, batch.to(torch.float64))
    exact_loss.backward()

    # Each of the 4 convs convolves twice (prepare, finish), forward and backward; the
    # selector scores the whole packed batch once.
    assert ran.counts == {"grouped_dynamic_conv": 2 * len(CONVS), "grouped_dynamic_conv_backward": 2 * len(CONVS),
                          "selector_scores": 1, "selector_scores_backward": 1}
    assert metrics["selector_loss_sum"] > 0 and metrics["unary_loss_sum"] > 0
    assert_within_contract("loss", loss.detach(), expected.detach(), exact_loss.detach())
    for term in ("unary_loss_sum", "selector_loss_sum"):
        assert_within_contract(term, metrics[term], expected_metrics[term], exact_metrics[term])
    grads, expected_grads, exact_grads = _grads(ours), _grads(upstream), _grads(exact)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().max() > 0, f"{name}: no gradient"
        assert_within_contract(name, grad, expected_grads[name], exact_grads[name])


def test_patching_twice_is_a_noop_and_unpatch_puts_the_originals_back():
    model = um.speculators_draft(0)
    upstream = {name: model.get_submodule(name) for name in MODULES}
    parameters = dict(model.named_parameters())
    batch = um.speculators_batch(0)
    expected, _ = um.speculators_loss(model, batch)
    dk.patch(model)
    patched = {name: model.get_submodule(name) for name in MODULES}

    again = dk.patch(model)
    assert again.replaced == [] and again.already == MODULES
    assert all(model.get_submodule(name) is patched[name] for name in MODULES)
    assert "0 replaced, 5 already done" in str(again)

    restored = dk.unpatch(model)
    assert [r.name for r in restored.replaced] == MODULES
    assert {r.upstream for r in restored.replaced} == {UPSTREAM_CONV, UPSTREAM_SELECTOR}
    assert f"replaced candidate_selector: dflash2_kernels.modules.CandidateSelector -> {UPSTREAM_SELECTOR}" \
        in str(restored)
    for name in MODULES:
        assert model.get_submodule(name) is upstream[name], name
    for name, parameter in model.named_parameters():
        assert parameter is parameters[name], name
    loss, _ = um.speculators_loss(model, batch)
    assert torch.equal(loss, expected)  # upstream's own code again, bit for bit

    # Nothing to put back: a no-op with an empty report, not an error.
    empty = dk.unpatch(model)
    assert empty.replaced == [] and empty.skipped == []


def test_unpatch_gives_the_originals_ours_current_parameters():
    model = um.speculators_draft(0)
    dk.patch(model)
    # A copy of a patched model unpatches to copies of the originals, around its own
    # (copied) parameters: deepcopy keeps the originals and ours sharing them.
    copied = copy.deepcopy(model)
    copied_parameters = dict(copied.named_parameters())
    assert [r.name for r in dk.unpatch(copied).replaced] == MODULES
    assert type(copied.candidate_selector) is definitions.CandidateSelector
    for name, parameter in copied.named_parameters():
        assert parameter is copied_parameters[name], name
    # New Parameters given to ours since the patch go back with the originals.
    fresh = {name: torch.zeros_like(value) for name, value in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)
    assigned = dict(model.named_parameters())
    dk.unpatch(model)
    assert type(model.layers[0].attention_conv) is definitions.GroupedDynamicCausalConv
    for name, parameter in model.named_parameters():
        assert parameter is assigned[name], name


def test_the_report_names_what_it_left_alone_and_why():
    hooked = definitions.GroupedDynamicCausalConv(64, block_size=4, kernel_size=2, group_size=16)
    hooked.register_forward_hook(lambda *args: None)

    class MySelector(definitions.CandidateSelector):
        pass

    # A vendored copy of speculators' conv: upstream's class name and structure, defined
    # elsewhere. Recognised by structure, so swapped.
    Vendored = type("GroupedDynamicCausalConv", (nn.Module,), {})
    vendored = Vendored()
    vendored.block_size, vendored.kernel_size, vendored.group_size, vendored.num_groups = 4, 2, 16, 4
    vendored.base_kernel = nn.Parameter(torch.randn(2, 2, 64))
    vendored.kernel_projection = nn.Linear(64, 16, bias=False)
    # Upstream's selector name over other parameters.
    Imposter = type("CandidateSelector", (nn.Module,), {})
    imposter = Imposter()
    imposter.weight = nn.Parameter(torch.zeros(3))

    model = nn.Module()
    model.hooked = hooked
    model.mine = MySelector(vocab_size=32, hidden_size=64, rank=8, top_k=4)
    model.attention_conv = nn.Conv1d(4, 4, 2)
    model.vendored = vendored
    model.imposter = imposter
    report = dk.patch(model)

    ours_conv = "dflash2_kernels.modules.GroupedDynamicCausalConv"
    assert [(r.name, r.ours) for r in report.replaced] == [("vendored", ours_conv)]
    assert model.vendored.base_kernel is vendored.base_kernel
    reasons = {s.name: s.reason for s in report.skipped}
    assert reasons.keys() == {"hooked", "mine", "attention_conv", "imposter"}
    assert "hook" in reasons["hooked"]
    assert "subclass of " + UPSTREAM_SELECTOR in reasons["mine"]
    assert "not a DFlash 2 conv or selector" in reasons["attention_conv"]
    assert "weight" in reasons["imposter"] and "predecessor_codebook" in reasons["imposter"]
    text = str(report)
    assert "1 replaced, 0 already done, 4 skipped" in text
    assert "skipped  mine (" in text and "replaced vendored: " in text

    lone = definitions.CandidateSelector(vocab_size=32, hidden_size=64, rank=8, top_k=4)
    assert "model itself" in dk.patch(lone).skipped[0].reason
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        dk.patch("not a model")


# --- from_upstream ---------------------------------------------------------------------


def test_from_upstream_shares_parameters_and_computes_what_upstream_does():
    torch.manual_seed(0)
    conv = definitions.GroupedDynamicCausalConv(64, block_size=4, kernel_size=2, group_size=16)
    selector = definitions.CandidateSelector(vocab_size=um.VOCAB, hidden_size=64, rank=8, top_k=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
    rng = torch.get_rng_state()
    our_conv = dk.GroupedDynamicCausalConv.from_upstream(conv)
    our_selector = dk.CandidateSelector.from_upstream(selector.eval())
    assert torch.equal(torch.get_rng_state(), rng)
    assert our_conv.base_kernel is conv.base_kernel
    assert our_conv.kernel_projection.weight is conv.kernel_projection.weight
    assert [p for p in our_selector.parameters()] == [p for p in selector.parameters()]
    assert our_selector.top_k == 4 and our_selector.initializer_range == 0.02 and not our_selector.training

    g = torch.Generator().manual_seed(1)
    h, sub = torch.randn(2, 8, 64, generator=g), torch.randn(2, 8, 64, generator=g)
    (prepared, kernels), (expected, expected_kernels) = our_conv.prepare(h), conv.prepare(h)
    torch.testing.assert_close(prepared, expected)
    torch.testing.assert_close(our_conv.finish(sub, kernels), conv.finish(sub, expected_kernels))
    logits = torch.randn(2, 8, um.VOCAB, generator=g)
    predecessors = torch.randint(0, um.VOCAB, (2, 8), generator=g)
    torch.testing.assert_close(our_selector.select(logits, h, predecessors),
                               selector.select(logits, h, predecessors))


def test_from_upstream_names_what_is_wrong():
    conv = definitions.GroupedDynamicCausalConv(64, block_size=4, kernel_size=2, group_size=16)
    del conv.block_size
    with pytest.raises(ValueError, match="no block_size attribute"):
        dk.GroupedDynamicCausalConv.from_upstream(conv)
    conv = definitions.GroupedDynamicCausalConv(64, block_size=4, kernel_size=2, group_size=16)
    conv.kernel_projection = nn.Linear(64, 8, bias=False)
    with pytest.raises(ValueError, match=r"kernel_projection.weight must have shape \(16, 64\)"):
        dk.GroupedDynamicCausalConv.from_upstream(conv)
    selector = definitions.CandidateSelector(vocab_size=32, hidden_size=64, rank=8, top_k=4)
    selector.hidden_projection = nn.Linear(64, 8, bias=True)
    with pytest.raises(TypeError, match="hidden_projection must be an nn.Linear without bias"):
        dk.CandidateSelector.from_upstream(selector)
    selector = definitions.CandidateSelector(vocab_size=32, hidden_size=64, rank=8, top_k=4)
    selector.top_k = 33
    with pytest.raises(ValueError, match="top_k"):
        dk.CandidateSelector.from_upstream(selector)


# --- dk.patch_speculators() ------------------------------------------------------------


def test_patch_speculators_installs_ours_everywhere_and_unpatch_restores_it():
    originals = {name: _installed_value(name) for name in INSTALLED}
    before = um.speculators_draft(0, randomise=False)  # upstream's, built before
    batch = um.speculators_batch(0)

    report = dk.patch_speculators()
    assert INSTALLED.keys() <= {r.name for r in report.replaced}
    for name, ours in INSTALLED.items():
        assert _installed_value(name) is ours, name

    # A model built now is built from ours, with the same random numbers upstream drew.
    built = um.speculators_draft(0, randomise=False)
    assert {type(built.get_submodule(name)) for name in MODULES} == {dk.GroupedDynamicCausalConv,
                                                                     dk.CandidateSelector}
    assert list(built.state_dict()) == list(before.state_dict())
    for (name, ours), theirs in zip(built.state_dict().items(), before.state_dict().values()):
        assert torch.equal(ours, theirs), name
    # It trains exactly as upstream's model patched in place; unpatch has no original
    # to put back in it.
    twin = copy.deepcopy(before)
    dk.patch(twin)
    for model in (built, twin):
        um.randomise_dflash2_modules(model, torch.Generator().manual_seed(5))
    assert torch.equal(um.speculators_loss(built, batch)[0], um.speculators_loss(twin, batch)[0])
    kept = dk.unpatch(built)
    assert kept.replaced == [] and [s.name for s in kept.skipped] == MODULES
    assert all("no original to put back" in s.reason for s in kept.skipped)
    # Upstream modules that already existed now call our grouped_dynamic_conv.
    with um.count_dflash2_ops() as ran:
        um.speculators_loss(before, batch)
    assert ran.counts["grouped_dynamic_conv"] == 2 * len(CONVS) and "selector_scores" not in ran.counts

    again = dk.patch_speculators()
    assert again.replaced == [] and INSTALLED.keys() <= set(again.already)

    undone = dk.unpatch_speculators()
    assert {r.name for r in undone.replaced} == {r.name for r in report.replaced}
    for name, original in originals.items():
        assert _installed_value(name) is original, name
    rebuilt = um.speculators_draft(0, randomise=False)
    assert [type(rebuilt.get_submodule(name)).__module__ for name in MODULES] == [definitions.__name__] * 5
    assert dk.unpatch_speculators().replaced == []  # idempotent too


def test_unpatch_speculators_leaves_a_name_someone_changed_since():
    upstream = speculators_core.CandidateSelector
    dk.patch_speculators()
    theirs = type("CandidateSelector", (nn.Module,), {})
    speculators_core.CandidateSelector = theirs
    try:
        report = dk.unpatch_speculators()
        assert speculators_core.CandidateSelector is theirs
        assert [s.name for s in report.skipped] == ["speculators.models.dflash2.core.CandidateSelector"]
        assert "left as it is" in str(report)
        assert definitions.CandidateSelector is upstream  # the others came back
    finally:
        speculators_core.CandidateSelector = upstream
