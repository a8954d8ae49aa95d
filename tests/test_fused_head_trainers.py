"""``fused_head=True``: speculators' and NeMo's training steps on dk.draft_head.

The real trainers (speculators 0.9.0's ``DFlash2DraftModel.forward``, NeMo Automodel
0.7.0's ``DFlash2TrainerModule.forward``) run one step on tiny random drafters
(tests/upstream_models.py) unpatched, patched with the fused head, and unpatched in
float64. The judge is SPEC section 4: the fused step's loss, every metric it logs and
every parameter's gradient within twice the unpatched fp32 step's error against the
float64 step (counts and ids: equal). Every loss speculators accepts is run (its names
and JSON mixes), both position weightings, the evaluation (no-grad) path, and a memory
check: the profiler's allocation sizes show the dense head's [N, V] tensors in the
unpatched step and none in the fused one. Skipped without the upstream packages.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dflash2_kernels as dk

from . import upstream_models as um
from .contract import assert_within_contract
from .upstream_models import one_thread  # noqa: F401 (a fixture, used below)

pytestmark = pytest.mark.usefixtures("one_thread")

speculators_core = pytest.importorskip("speculators.models.dflash2.core")
nemo_core = pytest.importorskip("nemo_automodel.components.speculative.dflash.dflash2_core")

# Every loss_fn speculators' trainer accepts: the seven names, and JSON mixes (a mix logs
# each term too) that reach every one of the head's rows.
LOSS_FNS = ["kl_div", "rkl", "jsd", "tv", "ce", "nla", "lk_hybrid", '{"ce": 0.1, "tv": 0.9}',
            '{"kl_div": 0.5, "jsd": 0.2, "nla": 0.1, "lk_hybrid": 0.2}']


@pytest.fixture(autouse=True)
def _restore_upstream():
    yield
    dk.unpatch_speculators()
    dk.unpatch_nemo()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _assert_same_value(name: str, got, expected, exact) -> None:
    """A float within SPEC 4 of the float64 value; an integer (a count) equal.

    Most of these are scalars (a loss, a metric): a scalar's reference error is one
    sample of rounding and may be 0 by chance, so its bar is twice that plus SPEC 4's
    floor, 4 fp32 ulps of the value + 1e-6 (tests/contract.py): e.g. NeMo's selector
    loss of ~7 may be off by ~4.4e-6 where upstream's happened to be exact.
    """
    got, expected, exact = (torch.as_tensor(v).detach() for v in (got, expected, exact))
    if got.is_floating_point():
        assert_within_contract(name, got, expected, exact)
    else:
        assert got.dtype == expected.dtype and torch.equal(got, expected), f"{name}: {got} != {expected}"


def _assert_grads_within_contract(ours, upstream, exact) -> None:
    grads, expected, judge = _grads(ours), _grads(upstream), _grads(exact)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        if expected[name] is None:
            assert grad is None, f"{name}: a gradient where upstream has none"
            continue
        assert grad is not None and grad.abs().max() > 0, f"{name}: no gradient"
        assert_within_contract(name, grad, expected[name], judge[name])


# --- speculators ------------------------------------------------------------------------


def _speculators_step(model, batch, loss_fn="kl_div", weighting="fixed-exp-decay", *, backward=True):
    """speculators' trainer step with ``loss_fn``: (loss, metrics), anchors seeded."""
    kwargs, _ = speculators_core.DFlash2DraftModel.get_trainer_kwargs(
        loss_fn=loss_fn, loss_implementation="eager", per_position_loss_weight=weighting)
    kwargs.update(batch.kwargs())
    torch.manual_seed(0)
    _, loss, metrics = model(**kwargs)
    if backward:
        loss.backward()
    return loss.detach(), metrics


def _speculators_three(seed=0):
    upstream = um.speculators_draft(seed)
    exact = copy.deepcopy(upstream).double()
    ours = copy.deepcopy(upstream)
    report = dk.patch(ours, fused_head=True)
    assert report.fused_head and "fused head: on" in str(report)
    return upstream, ours, exact


@pytest.mark.parametrize("loss_fn, weighting", [(name, "fixed-exp-decay") for name in LOSS_FNS]
                         + [("ce", "dpace")])
def test_speculators_step_with_the_fused_head_is_within_contract(loss_fn, weighting):
    upstream, ours, exact = _speculators_three()
    batch = um.speculators_batch(0)
    expected, expected_metrics = _speculators_step(upstream, batch, loss_fn, weighting)
    with um.count_dflash2_ops() as ran:
        loss, metrics = _speculators_step(ours, batch, loss_fn, weighting)
    judge, judge_metrics = _speculators_step(exact, batch.to(torch.float64), loss_fn, weighting)

    assert ran.counts["draft_head"] == 1 and ran.counts["draft_head_backward"] == 1, ran.counts
    assert metrics["selector_loss_sum"] > 0 and metrics["unary_loss_sum"] > 0
    _assert_same_value("loss", loss, expected, judge)
    assert list(metrics) == list(expected_metrics), "the metrics' names (or order) changed"
    for name, value in metrics.items():
        _assert_same_value(name, value, expected_metrics[name], judge_metrics[name])
    _assert_grads_within_contract(ours, upstream, exact)


def test_speculators_evaluation_step_with_the_fused_head_matches():
    upstream, ours, exact = _speculators_three(1)
    batch = um.speculators_batch(1)
    results = []
    for model, data in ((upstream, batch), (ours, batch), (exact, batch.to(torch.float64))):
        model.eval()
        with torch.no_grad():
            results.append(_speculators_step(model, data, "kl_div", backward=False))
    (expected, expected_metrics), (loss, metrics), (judge, judge_metrics) = results
    _assert_same_value("loss", loss, expected, judge)
    assert list(metrics) == list(expected_metrics)
    for name, value in metrics.items():
        _assert_same_value(name, value, expected_metrics[name], judge_metrics[name])


def test_speculators_bf16_autocast_step_is_within_contract():
    # speculators' FSDP policy trains an fp32 master copy under bf16 autocast: the dense
    # logits are bf16 there, and the fused head rounds its logits to bf16 as they are.
    upstream, ours, exact = _speculators_three(2)
    batch = um.speculators_batch(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_metrics = _speculators_step(upstream, batch, '{"kl_div": 0.5, "tv": 0.5}')
        loss, metrics = _speculators_step(ours, batch, '{"kl_div": 0.5, "tv": 0.5}')
    judge, judge_metrics = _speculators_step(exact, batch.to(torch.float64), '{"kl_div": 0.5, "tv": 0.5}')
    # These scalars are means over rows of values computed from bf16 logits (autocast's
    # [N, V] in upstream's step, ours rounded to bf16 before the top-k): each is one sample
    # of bf16 rounding, and upstream's error may cancel by chance (seeds 2-4 here: ours
    # 1e-5 to 6e-2 off, upstream 3e-6 to 5e-2, the bf16 candidates deciding the selector's
    # loss). Their bar: twice upstream's error plus one bf16 ulp of the value, the size of
    # one such sample; SPEC 4's fp32 floor (4 fp32 ulps) is far below it. The gradients,
    # tensors, get SPEC 4's bar as it is.
    for name, got, want, exact_value in [("loss", loss, expected, judge)] + [
            (name, metrics[name], expected_metrics[name], judge_metrics[name])
            for name in ("unary_loss_sum", "selector_loss_sum", "kl_div_loss_sum", "tv_loss_sum", "accept_rate_sum")]:
        error = (got.double() - exact_value).abs().item()
        bar = 2 * (want.double() - exact_value).abs().item() + torch.finfo(torch.bfloat16).eps * exact_value.abs().item()
        assert error <= bar, f"{name}: error {error:.3e} > {bar:.3e}"
    _assert_grads_within_contract(ours, upstream, exact)


# --- NeMo Automodel ---------------------------------------------------------------------


def _nemo_three(seed=0):
    target = um.qwen3_target(seed, bias=False)
    upstream = um.nemo_trainer(um.nemo_draft(seed), target)
    exact = um.nemo_trainer(copy.deepcopy(upstream.draft_model).double(), copy.deepcopy(target).double())
    ours = um.nemo_trainer(copy.deepcopy(upstream.draft_model), target)
    report = dk.patch(ours, fused_head=True)
    assert report.fused_head
    return upstream, ours, exact


def _assert_nemo_metrics(got, expected, judge) -> None:
    for field in dataclasses.fields(got):
        _assert_same_value(field.name, getattr(got, field.name), getattr(expected, field.name),
                           getattr(judge, field.name))


def test_nemo_step_with_the_fused_head_is_within_contract():
    upstream, ours, exact = _nemo_three()
    batch = um.nemo_batch(0)
    expected = um.nemo_loss(upstream, batch)
    expected.loss.backward()
    with um.count_dflash2_ops() as ran:
        got = um.nemo_loss(ours, batch)
        got.loss.backward()
    judge = um.nemo_loss(exact, batch.to(torch.float64))
    judge.loss.backward()

    assert ran.counts["draft_head"] == 1 and ran.counts["draft_head_backward"] == 1, ran.counts
    assert got.candidate_recall > 0 and got.selector_loss > 0
    _assert_nemo_metrics(got, expected, judge)
    _assert_grads_within_contract(ours, upstream, exact)


def test_nemo_step_with_an_output_transform_and_the_evaluation_path():
    # Muse Glimmer's transform: logits * output_multiplier, then a tanh softcap.
    upstream, ours, exact = _nemo_three(1)
    for trainer in (upstream, ours, exact):
        trainer.draft_model.output_multiplier = 1.7
        trainer.draft_model.final_logit_softcapping = 3.0
    batch = um.nemo_batch(1)
    expected = um.nemo_loss(upstream, batch)
    expected.loss.backward()
    got = um.nemo_loss(ours, batch)
    got.loss.backward()
    judge = um.nemo_loss(exact, batch.to(torch.float64))
    judge.loss.backward()
    _assert_nemo_metrics(got, expected, judge)
    _assert_grads_within_contract(ours, upstream, exact)

    with torch.no_grad():
        evaluated = [um.nemo_loss(trainer.eval(), data) for trainer, data in
                     ((upstream, batch), (ours, batch), (exact, batch.to(torch.float64)))]
    _assert_nemo_metrics(evaluated[1], evaluated[0], evaluated[2])


# --- no [N, V] tensor in the step ------------------------------------------------------

WIDE_VOCAB = 4096  # N rows x V: far above every other tensor of these steps


def _largest_allocation(step) -> int:
    """The largest single allocation (bytes) any op made while ``step()`` ran, forward and
    backward, inside our custom ops too (the profiler's allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return max((event.self_cpu_memory_usage for event in prof.events()), default=0)


@pytest.mark.parametrize("trainer", ["speculators", "nemo"])
def test_the_fused_step_allocates_no_rows_by_vocabulary_tensor(trainer, monkeypatch):
    # Chunks of a few rows (the default budget would hold these tiny steps in one).
    monkeypatch.setenv("DFLASH2_HEAD_TILE_MB", "0.25")
    if trainer == "speculators":
        upstream = um.speculators_draft(0, vocab=WIDE_VOCAB)
        batch = um.speculators_batch(0, tokens=96, max_anchors=16, vocab=WIDE_VOCAB)
        rows = batch.max_anchors * um.BLOCK

        def step(model):
            return lambda: _speculators_step(model, batch)
    else:
        # Frozen, as NeMo's recipe keeps the target (else its embeddings' [V, H] gradient
        # would be the step's largest tensor, in both steps).
        target = um.qwen3_target(0, vocab=WIDE_VOCAB, bias=False).requires_grad_(False)
        upstream = um.nemo_trainer(um.nemo_draft(0, vocab=WIDE_VOCAB), target)
        batch = um.nemo_batch(0, vocab=WIDE_VOCAB)
        rows = batch.input_ids.shape[0] * upstream.num_anchors * (um.BLOCK - 1)

        def step(model):
            return lambda: um.nemo_loss(model, batch).loss.backward()
    ours = copy.deepcopy(upstream)
    dk.patch(ours, fused_head=True)
    logits_bytes = rows * WIDE_VOCAB * 4

    dense = _largest_allocation(step(upstream))
    fused = _largest_allocation(step(ours))
    # The detector sees the dense head (so it can fail), and the fused step's largest
    # allocation is a fraction of it.
    assert dense >= logits_bytes, f"the unpatched step's largest allocation {dense} < N x V x 4 = {logits_bytes}"
    assert fused < logits_bytes // 2, f"the fused step allocated {fused} bytes in one piece (N x V x 4 = {logits_bytes})"


# --- the patch calls --------------------------------------------------------------------


def test_fused_head_is_off_by_default_and_unpatch_removes_it():
    model = um.speculators_draft(0)
    plain = dk.patch(model)
    assert not plain.fused_head and "fused head" not in str(plain) and "forward" not in vars(model)
    fused = dk.patch(model, fused_head=True)
    assert fused.fused_head and [r.name for r in fused.replaced] == ["<the model itself>.forward"]
    assert fused.replaced[0].ours == "dflash2_kernels.compat.speculators_head.fused_forward"
    again = dk.patch(model, fused_head=True)
    assert again.fused_head and "<the model itself>.forward" in again.already and not again.replaced
    undone = dk.unpatch(model)
    assert "forward" not in vars(model)
    assert "<the model itself>.forward" in [r.name for r in undone.replaced]


def test_patch_speculators_fused_head_trains_every_draft_model_and_unpatch_restores_it():
    upstream_forward = speculators_core.DFlash2DraftModel.forward
    before = um.speculators_draft(0)  # built before the patch: the class's forward is shared
    report = dk.patch_speculators(fused_head=True)
    assert report.fused_head
    assert "speculators.models.dflash2.core.DFlash2DraftModel.forward" in [r.name for r in report.replaced]
    with um.count_dflash2_ops() as ran:
        _speculators_step(before, um.speculators_batch(0), backward=False)
    assert ran.counts["draft_head"] == 1
    assert dk.patch_speculators().fused_head  # still on: fused_head=False removes nothing
    dk.unpatch_speculators()
    assert speculators_core.DFlash2DraftModel.forward is upstream_forward


def test_patch_nemo_fused_head_replaces_the_trainers_forward():
    upstream_forward = nemo_core.DFlash2TrainerModule.forward
    report = dk.patch_nemo(fused_head=True)
    assert report.fused_head and "fused head: on" in str(report)
    trainer = um.nemo_trainer(um.nemo_draft(0), um.qwen3_target(0, bias=False))
    with um.count_dflash2_ops() as ran:
        um.nemo_loss(trainer, um.nemo_batch(0))
    assert ran.counts["draft_head"] == 1
    dk.unpatch_nemo()
    assert nemo_core.DFlash2TrainerModule.forward is upstream_forward


def test_fused_head_names_what_it_cannot_do():
    with pytest.raises(TypeError, match="fused_head must be a bool"):
        dk.patch(torch.nn.Linear(2, 2), fused_head="yes")
    with pytest.raises(TypeError, match="fused_head must be a bool"):
        dk.patch_speculators(fused_head=1)
    report = dk.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)), fused_head=True)
    assert not report.fused_head and [s.name for s in report.skipped] == ["fused_head"]
    assert "no speculators DFlash2DraftModel or NeMo DFlash2TrainerModule" in report.skipped[0].reason

    # A biased verifier head cannot be fused: an error naming it, not a silently wrong loss.
    trainer = um.nemo_trainer(um.nemo_draft(0), um.qwen3_target(0))
    dk.patch(trainer, fused_head=True)
    with pytest.raises(ValueError, match="lm_head's bias"):
        um.nemo_loss(trainer, um.nemo_batch(0))

    # A loss function of the user's own: the fused head cannot compute it, and says which.
    model = um.speculators_draft(0)
    dk.patch(model, fused_head=True)
    kwargs, _ = speculators_core.DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    kwargs.update(um.speculators_batch(0).kwargs())
    kwargs["loss_config"] = {"mine": (lambda logits, targets: logits.sum(-1), 1.0)}
    with pytest.raises(ValueError, match=r"loss_config\['mine'\]"):
        model(**kwargs)


# --- on a GPU (tests_gpu in scripts/gpu_check.sh) ----------------------------------------


@pytest.mark.gpu
def test_nemo_step_with_the_fused_head_on_cuda_is_within_contract():
    # NeMo's trainer compiles nothing (speculators compiles its forward whenever CUDA is
    # up), so its step shows the head's CUDA path (cuBLAS, the Triton row kernel) alone.
    upstream, ours, exact = _nemo_three(3)
    upstream.cuda()
    ours.cuda()
    for trainer in (upstream, ours):
        trainer.lm_head.cuda()
        trainer.embed_tokens.cuda()
    batch = um.nemo_batch(3)
    on_gpu = um.NemoBatch(*(t.cuda() for t in (batch.input_ids, batch.hidden_states, batch.loss_mask)))
    expected = um.nemo_loss(upstream, on_gpu)
    expected.loss.backward()
    with um.count_dflash2_ops() as ran:
        got = um.nemo_loss(ours, on_gpu)
        got.loss.backward()
    judge = um.nemo_loss(exact, batch.to(torch.float64))
    judge.loss.backward()
    assert ran.counts["draft_head"] == 1, ran.counts
    for field in dataclasses.fields(got):
        _assert_same_value(field.name, getattr(got, field.name).cpu(), getattr(expected, field.name).cpu(),
                           getattr(judge, field.name))
    grads, expected_grads, judge_grads = _grads(ours), _grads(upstream), _grads(exact)
    for name, grad in grads.items():
        assert_within_contract(name, grad.cpu(), expected_grads[name].cpu(), judge_grads[name])
