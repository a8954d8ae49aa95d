"""The fused head's training forward under the trainers' own ``torch.compile``.

speculators compiles ``DFlash2DraftModel.forward`` whenever CUDA is available
(``conditional_torch_compile``); NeMo Automodel compiles the draft model in place (its
recipe's ``compile:`` block: ``compile_module_inplace``) and never the trainer module. On
this CPU machine the same wrapping is applied by hand, with ``aot_eager`` (Inductor's
C++ code generation takes minutes on two cores): with ``fused_head=True`` the step must
stay compiled, break the graph only where upstream's code does (the same number of graphs,
every break inside upstream's code), and equal the uncompiled step within SPEC section 4.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels.compat import speculators_head
from dflash2_kernels.compat.compiled import is_compiled, uncompiled

from . import upstream_models as um
from .test_fused_head_trainers import (
    _assert_grads_within_contract,
    _assert_nemo_metrics,
    _assert_same_value,
    _speculators_step,
)
from .test_patched_training import op_calls, recording_backend
from .upstream_models import one_thread  # noqa: F401 (a fixture, used below)

pytestmark = [pytest.mark.compiles, pytest.mark.usefixtures("one_thread")]

speculators_core = pytest.importorskip("speculators.models.dflash2.core")
nemo_compile = pytest.importorskip("nemo_automodel.components.utils.compile_utils")
COMPILER = "aot_eager"


@pytest.fixture
def compiled_class_forward(monkeypatch):
    """``DFlash2DraftModel.forward`` as ``conditional_torch_compile`` leaves it where CUDA
    is available (compiled with aot_eager here, every graph's ops recorded); yields
    (upstream's plain forward, the recorded graphs)."""
    cls = speculators_core.DFlash2DraftModel
    plain, graphs = cls.forward, []
    monkeypatch.setattr(cls, "forward", torch.compile(plain, backend=recording_backend(graphs, COMPILER)))
    torch._dynamo.reset()
    yield plain, graphs
    dk.unpatch_speculators()
    torch._dynamo.reset()


def _graphs_and_breaks(fn, **kwargs) -> tuple[int, list[tuple[str, str]]]:
    """torch._dynamo.explain's graph count and (reason, file of the innermost frame) of each break."""
    torch.manual_seed(0)
    explained = torch._dynamo.explain(fn)(**kwargs)
    return explained.graph_count, [(r.reason.splitlines()[0], r.user_stack[-1].filename if r.user_stack else "")
                                   for r in explained.break_reasons]


def test_speculators_fused_forward_is_compiled_as_upstreams(compiled_class_forward):
    plain_forward, graphs_run = compiled_class_forward
    upstream = um.speculators_draft(0)
    compiled, eager = copy.deepcopy(upstream), copy.deepcopy(upstream)
    exact = copy.deepcopy(upstream).double()
    report = dk.patch(compiled, fused_head=True)
    dk.patch(eager, fused_head=True)
    forward = compiled.forward.__func__
    assert is_compiled(forward) and uncompiled(forward) is speculators_head.fused_forward
    assert "fused_forward (compiled as upstream's)" in str(report)

    # Graph breaks: the same graphs as upstream's forward, every break in upstream's code.
    batch = um.speculators_batch(0)
    kwargs, _ = speculators_core.DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    kwargs.update(batch.kwargs())
    upstream_graphs, upstream_breaks = _graphs_and_breaks(types.MethodType(plain_forward, upstream), **kwargs)
    graphs, breaks = _graphs_and_breaks(types.MethodType(speculators_head.fused_forward, eager), **kwargs)
    assert graphs == upstream_graphs, (breaks, upstream_breaks)
    assert {reason for reason, _ in breaks} == {reason for reason, _ in upstream_breaks}
    assert all("/speculators/" in where and "dflash2_kernels" not in where for _, where in breaks), breaks

    # The compiled step (by upstream's own backend: it recorded the head) against the
    # uncompiled one, both judged by float64.
    loss, metrics = _speculators_step(compiled, batch)
    ops = [op for graph in graphs_run for op in graph]
    assert ops.count("dflash2.draft_head.default") == 1 and ops.count("dflash2.draft_head_backward.default") == 1
    with torch.compiler.set_stance("force_eager"):
        expected, expected_metrics = _speculators_step(eager, batch)
        judge, judge_metrics = _speculators_step(exact, batch.to(torch.float64))
    _assert_same_value("loss", loss, expected, judge)
    for name, value in metrics.items():
        _assert_same_value(name, value, expected_metrics[name], judge_metrics[name])
    _assert_grads_within_contract(compiled, eager, exact)


def test_patch_speculators_installs_a_compiled_forward(compiled_class_forward):
    """The class-level install, as on a CUDA machine: compiled, once, and undone."""
    cls = speculators_core.DFlash2DraftModel
    upstream_compiled = cls.forward
    report = dk.patch_speculators(fused_head=True)
    assert is_compiled(cls.forward) and uncompiled(cls.forward) is speculators_head.fused_forward
    assert "DFlash2DraftModel.forward" in str(report) and "(compiled as upstream's)" in str(report)
    again = dk.patch_speculators(fused_head=True)
    assert again.fused_head and not [r for r in again.replaced if r.name.endswith(".forward")]
    dk.unpatch_speculators()
    assert cls.forward is upstream_compiled


def test_nemo_draft_stays_compiled_under_the_fused_head():
    """NeMo compiles the draft in place before it builds the trainer; the fused trainer
    forward calls that compiled draft, whose graphs our conv leaves whole."""
    target = um.qwen3_target(0, bias=False)
    upstream_draft = um.nemo_draft(0)
    exact = um.nemo_trainer(copy.deepcopy(upstream_draft).double(), copy.deepcopy(target).double())
    trainers, graphs = {}, {"upstream": [], "compiled": []}
    for name in ("upstream", "compiled", "eager"):
        draft = copy.deepcopy(upstream_draft)
        if name != "eager":
            config = nemo_compile.CompileConfig(enabled=True, backend=recording_backend(graphs[name], COMPILER))
            nemo_compile.compile_module_inplace(draft, config)
        trainers[name] = um.nemo_trainer(draft, target)
    for name in ("compiled", "eager"):
        assert dk.patch(trainers[name], fused_head=True).fused_head
    assert trainers["compiled"].draft_model._compiled_call_impl is not None

    batch = um.nemo_batch(0)
    steps = {}
    for name in ("upstream", "compiled"):
        torch._dynamo.reset()
        steps[name] = um.nemo_loss(trainers[name], batch)
        steps[name].loss.backward()
    torch._dynamo.reset()
    with um.count_dflash2_ops() as ran:  # a dispatch mode: eager runs only
        expected = um.nemo_loss(trainers["eager"], batch)
        expected.loss.backward()
    # The same graphs as upstream's compiled draft (forward and backward), every conv of
    # the eager step inside them.
    assert len(graphs["compiled"]) == len(graphs["upstream"]) > 0
    ops = [op for graph in graphs["compiled"] for op in graph]
    for op in ("grouped_dynamic_conv", "grouped_dynamic_conv_backward"):
        assert op_calls(ops, op) == ran.counts[op] > 0, (op, ran.counts)
    judge = um.nemo_loss(exact, batch.to(torch.float64))
    judge.loss.backward()
    _assert_nemo_metrics(steps["compiled"], expected, judge)
    _assert_grads_within_contract(trainers["compiled"], trainers["eager"], exact)
