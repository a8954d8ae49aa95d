"""Patched DFlash 2 drafters under the distributed engines they train with, on two gloo
CPU ranks, each judged against one process on the same data.

The drafters are the tiny speculators ``DFlash2DraftModel`` and NeMo
``Qwen3DFlash2DraftModel`` + ``DFlash2TrainerModule`` of ``tests/upstream_models.py``,
patched with ``dk.patch`` (their convs and selector run our ops), set up as the trainers
set them up:

- speculators ``--fsdp-shard``: speculators' own ``apply_fully_sharded`` (``fully_shard``
  on every decoder layer, then the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``), ``torch.autocast(bf16)`` around the forward over fp32 master
  weights, ``clip_grad_norm_(1.0)`` and AdamW, two steps;
- speculators ``--gradient-checkpointing`` under FSDP2 (HF's whole-layer non-reentrant
  checkpointing, hooks and all-gathers inside the checkpointed region), and a selective
  policy that saves our ops (``MUST_SAVE`` on every ``torch.ops.dflash2.*.default``)
  around whole layers that are then sharded (torchtitan's order);
- speculators' draft forward compiled over the FSDP2 model (speculators compiles
  ``DFlash2DraftModel.forward`` whenever CUDA is present); ``aot_eager`` here,
  ``DFLASH2_DISTRIBUTED_COMPILER=inductor`` for Inductor;
- NeMo's bf16 draft under ``DistributedDataParallel`` on the data-parallel submesh of a
  ("dp", "tp") device mesh, as ``train_dflash.py`` wraps it;
- NeMo's activation checkpointing of the draft: its selective policy (SAC: saves
  mm/linear/attention/topk/collectives, recomputes every other op, ours included) and
  its "full" mode (checkpoint wrappers around attention, MLP and the norms);
- the selector called through ``pair_scores`` / ``walk`` / ``select`` when it is sharded
  on its own (its methods gather its parameters), and through ``walk`` when the module
  above it was sharded (a RuntimeError saying what to call).

Every check is SPEC section 4 on the loss of each rank and on every parameter gradient:
the engine's result, against a float64 evaluation of the unpatched upstream model at the
same parameters and data, must be within twice the error of one process on the same
batches (one forward per rank's batch, gradients averaged as the engine averages them),
plus the floor of tests/contract.py. The one process runs the patched model at the
engine's precision (FSDP2's bf16 casts reproduced), and in fp32 also the unpatched
upstream model. In bf16 only the patched one: a loss rounds through thousands of bf16
activations (and, where bf16 logits tie, top-k candidate sets), so which of two
implementations lands nearer float64 is a coin toss at these sizes (the patched model's
loss error was 1.0x to 16x the upstream one's: one process, 2 batches x 2 steps), while the
engine reproduces the patched model's own error. Every rank must end with the same full gradients and parameters, and the sharded
AdamW steps must move the parameters as one process's AdamW does with the same
gradients. Op counts (a dispatch mode in the ranks) show which of our ops ran in the
forward and which ran again in the backward.
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch
from torch.utils._pytree import tree_map

import dflash2_kernels as dk

from . import upstream_models as um
from .contract import assert_same_within_floor, assert_within_contract
from .distributed_support import (
    RANK_TIMEOUT_S,
    WORLD,
    load_rank_results,
    requires_gloo,
    run_ranks,
    save_rank_result,
)
from .upstream_models import one_thread  # noqa: F401 (a fixture, used below)

pytest.importorskip("transformers")
pytestmark = [requires_gloo, pytest.mark.usefixtures("one_thread")]

LR = 1e-3  # AdamW, speculators' and NeMo's optimizer
BF16 = torch.bfloat16
# aot_eager runs the traced graphs on the eager kernels: Dynamo's capture (where a graph
# would break) and AOTAutograd's joint trace through our fake kernels and autograd
# formulas are Inductor's; Inductor's C++ code generation takes minutes on 2 cores.
COMPILER = os.environ.get("DFLASH2_DISTRIBUTED_COMPILER", "aot_eager")
INDUCTOR_TIMEOUT_S = 900  # Inductor's C++ code generation on a 2-core machine: minutes
CONVS = 2 * 2 * um.LAYERS  # per forward: 2 convs a layer, each prepare() + finish()
PATCHED_MODULES = 2 * um.LAYERS + 1  # what dk.patch swaps in either draft: the convs and the selector


def _seed(step: int, rank: int) -> int:
    """The global RNG seed of one rank's forward (the anchors are drawn from it)."""
    return 1000 + 10 * step + rank


# --- both sides: parameters, gradients, op counts ----------------------------------------


def _canonical(name: str) -> str:
    """A parameter's name without the wrappers' levels (checkpoint, compile, DDP)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {_canonical(n): _full(p) for n, p in model.named_parameters()}


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {_canonical(n): _full(p.grad) for n, p in model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def _counting(into: list):
    """Appends {op: calls} of our ops and of aten's softmax (attention's forward: run again
    in a backward only where attention is recomputed) made while the block runs."""
    with um.count_dflash2_ops() as ours, um.count_dflash2_ops("aten") as aten:
        yield
    into.append({**ours.counts, "aten._softmax": aten.counts["_softmax"]})


def _our_ops() -> set:
    """Every op of the dflash2 namespace, as the ``.default`` overloads a selective
    checkpointing policy is handed (an OpOverloadPacket never equals them)."""
    names = [n.partition("::")[2] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dflash2::")]
    return {getattr(torch.ops.dflash2, name).default for name in names}


def _save_our_ops_context():
    """A selective checkpointing context: our ops' outputs saved, every other op recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ours = _our_ops()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in ours else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _recording_backend(graphs: list, compiler: str):
    from .test_patched_training import recording_backend

    return recording_backend(graphs, compiler)


def _op_calls(ops: list[str], op: str) -> int:
    from .test_patched_training import op_calls

    return op_calls(ops, op)


# --- the ranks ------------------------------------------------------------------------------


def _speculators_worker(rank: int, out_dir: str, setup: dict) -> None:
    """speculators' FSDP2 training on this rank's batch: ``setup["steps"]`` steps of
    autocast forward, backward, clip, AdamW; saves parameters before every step and after
    the last, gradients, losses, op counts (and the compiled graphs)."""
    from speculators.train.distributed import apply_fully_sharded
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = setup["param_dtype"]
    model = um.speculators_draft(0)
    fused_head = setup.get("fused_head", False)
    report = dk.patch(model, fused_head=fused_head)
    assert len(report.replaced) == PATCHED_MODULES + int(fused_head) and report.fused_head == fused_head, str(report)
    if setup.get("checkpoint") == "hf":
        model.gradient_checkpointing_enable()  # speculators' --gradient-checkpointing
    elif setup.get("checkpoint") == "save_ours":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                 context_fn=_save_our_ops_context)
    if setup.get("shard_selector"):
        fully_shard(model.candidate_selector,
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    apply_fully_sharded(model, param_dtype=param_dtype)
    graphs: list = []
    compiler = setup.get("compile")
    if compiler:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.forward = torch.compile(model.forward, backend=_recording_backend(graphs, compiler))
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=LR)
    batch = um.speculators_batch(rank)
    result = {"params": [], "grads": [], "losses": [], "forward": [], "backward": []}
    # A dispatch mode cannot run under torch.compile: count only eager runs.
    counting = (lambda into: contextlib.nullcontext()) if compiler else _counting
    for step in range(setup["steps"]):
        result["params"].append(_parameters(model))
        with counting(result["forward"]), torch.autocast("cpu", dtype=BF16, enabled=setup["autocast"]):
            loss, _ = um.speculators_loss(model, batch, seed=_seed(step, rank))
        optimizer.zero_grad()
        with counting(result["backward"]):
            loss.backward()
        result["losses"].append(loss.detach())
        result["grads"].append(_gradients(model))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result.setdefault("graphs_after_step", []).append(len(graphs))
    result["params"].append(_parameters(model))
    if compiler:
        result["graphs"] = graphs
        result["graph_breaks"] = list(torch._dynamo.utils.counters["graph_break"])
    if setup.get("shard_selector"):
        selector = model.candidate_selector
        logits, hidden, predecessors = _select_inputs()
        with torch.no_grad():
            result["select"] = selector.select(logits, hidden, predecessors)
        result["registered"] = sorted(n for n in ("score_candidates", "select") if n in vars(selector))
    save_rank_result(out_dir, rank, result)


def _select_inputs() -> tuple:
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(1, 2 * um.BLOCK, um.VOCAB, generator=generator),
            torch.randn(1, 2 * um.BLOCK, um.HIDDEN, generator=generator),
            torch.randint(0, um.VOCAB, (1, 2 * um.BLOCK), generator=generator))


def _walk_inputs() -> tuple:
    generator = torch.Generator().manual_seed(8)
    batch, draft = 2, um.BLOCK - 1
    return (torch.randn(batch, draft, um.HIDDEN, generator=generator),
            3 * torch.randn(batch, draft, um.VOCAB, generator=generator),
            torch.randint(0, um.VOCAB, (batch,), generator=generator))


def _nemo_checkpointing(draft: torch.nn.Module, mode: str | None) -> None:
    """NeMo's ``apply_draft_activation_checkpointing``, for ``mode`` "selective" or "full"."""
    from nemo_automodel.components.distributed import activation_checkpointing as ac

    layers = list(draft.layers)
    if mode == "selective":
        ac.apply_selective_checkpointing_to_layers(draft, layers, has_kv_sharing=False)
    elif mode == "full":
        ac.apply_submodule_checkpointing(layers, has_kv_sharing=False)


def _nemo_worker(rank: int, out_dir: str, setup: dict) -> None:
    """NeMo's draft training on this rank's batch: one step under DDP on the "dp" submesh
    (``setup["engine"] == "ddp"``), or with the draft's layers, selector and root sharded
    by FSDP2 ("fsdp"), then the selector's walk; saves gradients, losses, op counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dtype = setup["dtype"]
    draft = um.nemo_draft(0).to(dtype)
    report = dk.patch(draft)
    assert len(report.replaced) == PATCHED_MODULES, str(report)
    _nemo_checkpointing(draft, setup.get("checkpoint"))
    trainer = um.nemo_trainer(draft, um.qwen3_target(0).to(dtype))
    result = {"forward": [], "backward": []}
    if setup["engine"] == "ddp":
        # train_dflash.py: DDP over the draft's trainer module, reducing over the
        # data-parallel submesh only (the draft is replicated across tensor parallelism).
        mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
        model = DistributedDataParallel(trainer, broadcast_buffers=False, find_unused_parameters=False,
                                        process_group=mesh["dp"].get_group())
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in draft.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(draft.candidate_selector, mesh=mesh)
        fully_shard(draft, mesh=mesh)
        model = trainer
    batch = um.nemo_batch(rank).to(dtype)
    with _counting(result["forward"]):
        loss = um.nemo_loss(model, batch, seed=_seed(0, rank)).loss
    with _counting(result["backward"]):
        loss.backward()
    result["losses"] = [loss.detach()]
    result["grads"] = [_gradients(trainer)]
    result["params"] = [_parameters(trainer)]
    if setup["engine"] == "fsdp":
        selector = draft.candidate_selector
        hidden, logits, anchors = _walk_inputs()
        with torch.no_grad():
            result["walk"] = [selector.walk(hidden, logits, anchors, 0.0),
                              selector.walk(hidden, logits, anchors, 1.0, generator=torch.Generator().manual_seed(9))]
        result["registered"] = sorted(n for n in ("pair_scores", "walk") if n in vars(selector))
        # A selector inside a sharded draft, not sharded itself: its parameters are the
        # root's sharded DTensors outside the root's forward.
        other = um.nemo_draft(1)
        dk.patch(other)
        fully_shard(other, mesh=mesh)
        try:
            other.candidate_selector.walk(hidden, logits, anchors, 0.0)
        except RuntimeError as error:
            result["unsharded_walk_error"] = str(error)
    save_rank_result(out_dir, rank, result)


# --- one process: the judges ------------------------------------------------------------------


def _load(model: torch.nn.Module, params: dict[str, torch.Tensor], prefix: str = "") -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(params[prefix + name])


def _cast_float_inputs(dtype: torch.dtype):
    """A forward pre-hook casting floating inputs to ``dtype``: FSDP2's
    ``MixedPrecisionPolicy.cast_forward_inputs`` at every sharded module."""
    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


def _mean(per_rank: list[dict], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The engines' gradient averaging: the ranks' gradients summed in ``dtype`` over WORLD."""
    return {name: sum(g[name].to(dtype) for g in per_rank) / WORLD for name in per_rank[0]}


def _speculators_one_process(params: dict, step: int, *, exact: bool, mixed: bool, patched: bool = False):
    """(losses per rank, mean gradients) of the speculators draft (upstream's, or
    ``patched``) at ``params`` on every rank's batch. ``exact``: float64 (at the
    bf16-rounded parameters the ranks compute with, when ``mixed``). Else the ranks'
    precision: fp32, or (``mixed``) FSDP2's bf16 parameters and input casts under bf16
    autocast, bf16 gradients averaged in fp32."""
    model = um.speculators_draft(0, randomise=False)
    if patched:
        dk.patch(model)
    _load(model, params)
    hooks = []
    if exact:
        if mixed:
            _load(model, {n: p.to(BF16) for n, p in params.items()})
        model.double()
    elif mixed:
        for parameter in model.parameters():  # FSDP2 casts the parameters, not the buffers
            parameter.data = parameter.data.to(BF16)
        for module in (model, *model.layers):
            hooks.append(module.register_forward_pre_hook(_cast_float_inputs(BF16), with_kwargs=True))
    losses, grads = [], []
    for rank in range(WORLD):
        batch = um.speculators_batch(rank)
        if exact:
            batch = batch.to(BF16).to(torch.float64) if mixed else batch.to(torch.float64)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16, enabled=mixed and not exact):
            loss, _ = um.speculators_loss(model, batch, seed=_seed(step, rank))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for hook in hooks:
        hook.remove()
    return losses, _mean(grads, torch.float64 if exact else torch.float32)


def _nemo_one_process(params: dict, *, dtype: torch.dtype, exact: bool, patched: bool = False):
    """(losses per rank, mean gradients) of the NeMo draft (upstream's, or ``patched``) at
    ``params``: float64 when ``exact`` (at the ranks' values, inputs rounded as theirs),
    else in ``dtype`` with the gradients averaged in fp32 and rounded once to ``dtype``
    (DDP's bucket)."""
    draft = um.nemo_draft(0, randomise=False).to(dtype)
    if patched:
        dk.patch(draft)
    target = um.qwen3_target(0).to(dtype)
    _load(draft, params, prefix="draft_model.")
    compute = torch.float64 if exact else dtype
    trainer = um.nemo_trainer(draft.to(compute), target.to(compute))
    losses, grads = [], []
    for rank in range(WORLD):
        batch = um.nemo_batch(rank).to(dtype).to(compute)
        trainer.zero_grad(set_to_none=True)
        loss = um.nemo_loss(trainer, batch, seed=_seed(0, rank)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in trainer.named_parameters() if p.requires_grad})
    mean = _mean(grads, torch.float64 if exact else torch.float32)
    return losses, {n: g.to(compute) for n, g in mean.items()}


def _assert_step_within_contract(label: str, got_losses, got_grads, reference, exact) -> None:
    (ref_losses, ref_grads), (exact_losses, exact_grads) = reference, exact
    for rank, (got, ref, truth) in enumerate(zip(got_losses, ref_losses, exact_losses)):
        assert_within_contract(f"{label}, rank {rank}'s loss", got, ref, truth)
    assert got_grads.keys() == ref_grads.keys(), sorted(got_grads.keys() ^ ref_grads.keys())
    for name, got in got_grads.items():
        assert exact_grads[name].abs().max() > 0, f"{label}: {name} got no gradient: the check would be vacuous"
        assert_within_contract(f"{label}, grad of {name}", got, ref_grads[name], exact_grads[name])


def _assert_ranks_agree(ranks: list[dict], key: str) -> None:
    """Every rank ends with the same full gradients (and parameters), bit for bit."""
    for step, first in enumerate(ranks[0][key]):
        for other in ranks[1:]:
            for name, value in first.items():
                assert torch.equal(value, other[key][step][name]), (key, step, name)


def _assert_adamw_steps(ranks: list[dict]) -> None:
    """The sharded AdamW steps (after clip_grad_norm_ over DTensor gradients) moved the full
    parameters as one process's AdamW does with the same gradients; frozen ones stayed."""
    params, grads = ranks[0]["params"], ranks[0]["grads"]
    trainable = {n: params[0][n].clone().requires_grad_(True) for n in grads[0]}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=LR)
    for step, step_grads in enumerate(grads):
        for name, parameter in trainable.items():
            parameter.grad = step_grads[name].clone()
        torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
        optimizer.step()
        for name, value in params[step + 1].items():
            want = trainable[name].detach() if name in trainable else params[0][name]
            assert_same_within_floor(f"after step {step}, {name}", value, want)


def _speculators_judge(ranks: list[dict], *, mixed: bool, label: str) -> None:
    _assert_ranks_agree(ranks, "grads")
    _assert_ranks_agree(ranks, "params")
    with torch.compiler.set_stance("force_eager"):  # speculators compiles its forward where CUDA is
        for step, (params, grads) in enumerate(zip(ranks[0]["params"], ranks[0]["grads"])):
            losses = [r["losses"][step] for r in ranks]
            exact = _speculators_one_process(params, step, exact=True, mixed=mixed)
            for patched in (True, False) if not mixed else (True,):
                reference = _speculators_one_process(params, step, exact=False, mixed=mixed, patched=patched)
                _assert_step_within_contract(f"{label}, step {step}, against one process "
                                             f"{'patched' if patched else 'upstream'}", losses, grads, reference, exact)
    _assert_adamw_steps(ranks)


def _counts(ranks: list[dict], key: str) -> list[dict]:
    """The op counts of every step (the same on every rank). Forward: our ops only
    (speculators' losses call softmax too)."""
    def nonzero(c):
        return {op: n for op, n in c.items() if n and (key == "backward" or not op.startswith("aten."))}

    counts = [nonzero(c) for c in ranks[0][key]]
    assert all([nonzero(c) for c in r[key]] == counts for r in ranks), key
    return counts


FORWARD = {"grouped_dynamic_conv": CONVS, "selector_scores": 1}
BACKWARD = {"grouped_dynamic_conv_backward": CONVS, "selector_scores_backward": 1}


# --- speculators: FSDP2 ------------------------------------------------------------------------


def test_speculators_fsdp_shard_with_bf16_autocast_two_adamw_steps(tmp_path):
    """``--fsdp-shard`` as speculators configures it: per-layer + root ``fully_shard`` with
    bf16 parameters and fp32 reduction, autocast bf16 over fp32 master weights."""
    pytest.importorskip("speculators.train.distributed")
    run_ranks(_speculators_worker, tmp_path, dict(param_dtype=BF16, autocast=True, steps=2))
    ranks = load_rank_results(tmp_path)
    _speculators_judge(ranks, mixed=True, label="fsdp bf16")
    assert _counts(ranks, "forward") == [FORWARD] * 2
    assert _counts(ranks, "backward") == [BACKWARD] * 2


def test_speculators_fsdp_shard_with_the_fused_head(tmp_path):
    """``--fsdp-shard``'s bf16 setting with ``dk.patch(model, fused_head=True)`` before
    sharding (FSDP2 then subclasses the model; the instance-level forward stays): the
    head's losses and gradients through FSDP2's gathered lm_head, against one process."""
    pytest.importorskip("speculators.train.distributed")
    run_ranks(_speculators_worker, tmp_path, dict(param_dtype=BF16, autocast=True, steps=1, fused_head=True))
    ranks = load_rank_results(tmp_path)
    _speculators_judge(ranks, mixed=True, label="fsdp bf16 fused head")
    assert _counts(ranks, "forward") == [{**FORWARD, "draft_head": 1}]
    assert _counts(ranks, "backward") == [{**BACKWARD, "draft_head_backward": 1}]


@pytest.mark.parametrize("policy", ["hf_whole_layers", "save_our_ops"])
def test_speculators_fsdp_shard_with_activation_checkpointing(tmp_path, policy):
    """``--gradient-checkpointing`` (HF: each decoder layer recomputed whole, non-reentrant,
    its FSDP hooks inside the checkpointed region) and a selective policy saving our ops
    (checkpoint wrappers around whole layers, then sharded), fp32 parameters. The backward
    runs the layers' forward again: attention (softmax) in both, our convs only in HF's."""
    pytest.importorskip("speculators.train.distributed")
    checkpoint = {"hf_whole_layers": "hf", "save_our_ops": "save_ours"}[policy]
    run_ranks(_speculators_worker, tmp_path, dict(param_dtype=torch.float32, autocast=False, steps=1,
                                                  checkpoint=checkpoint))
    ranks = load_rank_results(tmp_path)
    _speculators_judge(ranks, mixed=False, label=f"fsdp + {policy}")
    assert _counts(ranks, "forward") == [FORWARD]
    recomputed = {"grouped_dynamic_conv": CONVS} if checkpoint == "hf" else {}
    assert _counts(ranks, "backward") == [{**BACKWARD, **recomputed, "aten._softmax": um.LAYERS}]


# Graph breaks of the compiled speculators forward that are upstream's or FSDP2's, none
# in our code: the attention-mask builder speculators marks torch.compiler.disable,
# FSDP2's hooks (Dynamo skips them), and data-dependent masked_select in its metrics.
UPSTREAM_BREAKS = ("_build_attention_mask", "skipping FSDP hooks", "masked_select")


@pytest.mark.compiles
def test_speculators_compiled_forward_over_fsdp2(tmp_path):
    """speculators' draft forward under ``torch.compile`` over the FSDP2 model (fp32, two
    steps): every call of our ops is inside a graph, forward and backward, no graph
    break is ours, and nothing is compiled again on the second step."""
    pytest.importorskip("speculators.train.distributed")
    run_ranks(_speculators_worker, tmp_path, dict(param_dtype=torch.float32, autocast=False, steps=2,
                                                  compile=COMPILER),
              timeout_s=RANK_TIMEOUT_S if COMPILER == "aot_eager" else INDUCTOR_TIMEOUT_S)
    ranks = load_rank_results(tmp_path)
    for rank in ranks:
        ours = [b for b in rank["graph_breaks"] if "dflash2" in b or not any(u in b for u in UPSTREAM_BREAKS)]
        assert not ours, ours
        first, second = rank["graphs_after_step"]
        assert second == first, f"step 1 compiled {second - first} more graphs (a recompilation)"
        ops = [op for graph in rank["graphs"] for op in graph]
        found = {op: _op_calls(ops, op) for op in {**FORWARD, **BACKWARD}}
        assert found == {**FORWARD, **BACKWARD}, found
    # Inductor also fuses and re-tiles the reductions around our ops (RMSNorm, softmax,
    # the losses): within the contract too (measured once on the dev machine).
    _speculators_judge(ranks, mixed=False, label=f"fsdp + compile({COMPILER})")


def test_speculators_selector_sharded_on_its_own(tmp_path):
    """A selector given its own ``fully_shard`` (inside speculators' per-layer + root
    sharding), called through ``score_candidates`` in the root's forward and through
    ``select`` afterwards: each method gathers the selector's parameters (registered with
    ``register_fsdp_forward_method`` on first call), and both equal one process."""
    pytest.importorskip("speculators.train.distributed")
    run_ranks(_speculators_worker, tmp_path, dict(param_dtype=torch.float32, autocast=False, steps=1,
                                                  shard_selector=True))
    ranks = load_rank_results(tmp_path)
    _speculators_judge(ranks, mixed=False, label="fsdp, selector sharded")
    assert ranks[0]["registered"] == ["score_candidates", "select"]
    model = um.speculators_draft(0)
    dk.patch(model)
    _load(model, ranks[0]["params"][-1])
    with torch.no_grad():
        ids, scores = model.candidate_selector.select(*_select_inputs())
    for rank in ranks:
        # The candidates are the given logits' top-k: exactly. The scores go through the
        # projection's matmul, which a BLAS may round by an ulp otherwise in another process.
        assert torch.equal(rank["select"][0], ids)
        assert_same_within_floor("select's scores", rank["select"][1], scores)


# --- NeMo: DDP, activation checkpointing, a sharded selector -----------------------------------


def _nemo_judge(ranks: list[dict], *, dtype: torch.dtype, label: str) -> None:
    _assert_ranks_agree(ranks, "grads")
    params = ranks[0]["params"][0]
    losses = [r["losses"][0] for r in ranks]
    exact = _nemo_one_process(params, dtype=dtype, exact=True)
    for patched in (True, False) if dtype == torch.float32 else (True,):
        reference = _nemo_one_process(params, dtype=dtype, exact=False, patched=patched)
        _assert_step_within_contract(f"{label}, against one process {'patched' if patched else 'upstream'}",
                                     losses, ranks[0]["grads"][0], reference, exact)


def test_nemo_bf16_draft_under_ddp_on_the_data_parallel_submesh(tmp_path):
    """NeMo's draft in bf16 (its compute dtype) under DDP, reducing over the "dp" submesh of
    a ("dp", "tp") mesh as train_dflash.py does: bf16 gradients, averaged by DDP."""
    pytest.importorskip("nemo_automodel.components.speculative.dflash.dflash2_core")
    run_ranks(_nemo_worker, tmp_path, dict(dtype=BF16, engine="ddp"))
    ranks = load_rank_results(tmp_path)
    _nemo_judge(ranks, dtype=BF16, label="ddp bf16")
    assert _counts(ranks, "forward") == [FORWARD]
    assert _counts(ranks, "backward") == [BACKWARD]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_nemo_activation_checkpointing_under_ddp(tmp_path, mode):
    """NeMo's draft activation checkpointing (fp32 draft, DDP): "selective" wraps whole
    layers with NeMo's SAC policy, which recomputes our convs in the backward; "full"
    wraps attention, MLP and the norms, outside of which the convs sit (saved, not
    recomputed)."""
    pytest.importorskip("nemo_automodel.components.distributed.activation_checkpointing")
    run_ranks(_nemo_worker, tmp_path, dict(dtype=torch.float32, engine="ddp", checkpoint=mode))
    ranks = load_rank_results(tmp_path)
    _nemo_judge(ranks, dtype=torch.float32, label=f"ddp + {mode} checkpointing")
    assert _counts(ranks, "forward") == [FORWARD]
    recomputed = {"grouped_dynamic_conv": CONVS} if mode == "selective" else {}
    assert _counts(ranks, "backward") == [{**BACKWARD, **recomputed, "aten._softmax": um.LAYERS}]


def test_nemo_selector_sharded_on_its_own_and_under_a_sharded_draft(tmp_path):
    """NeMo's draft with its layers, its selector and itself sharded by FSDP2 (fp32): the
    trainer's ``pair_scores`` and serving's ``walk`` gather the selector's parameters and
    equal one process; a selector inside a sharded draft, not sharded itself, called
    through ``walk`` outside the draft's forward, fails with a message naming what to
    call."""
    pytest.importorskip("nemo_automodel.components.speculative.dflash.dflash2_core")
    run_ranks(_nemo_worker, tmp_path, dict(dtype=torch.float32, engine="fsdp"))
    ranks = load_rank_results(tmp_path)
    _nemo_judge(ranks, dtype=torch.float32, label="fsdp, selector sharded")
    assert ranks[0]["registered"] == ["pair_scores", "walk"]
    draft = um.nemo_draft(0)
    dk.patch(draft)
    _load(draft, ranks[0]["params"][0], prefix="draft_model.")
    hidden, logits, anchors = _walk_inputs()
    with torch.no_grad():
        expected = [draft.candidate_selector.walk(hidden, logits, anchors, 0.0),
                    draft.candidate_selector.walk(hidden, logits, anchors, 1.0,
                                                  generator=torch.Generator().manual_seed(9))]
    for rank in ranks:
        for got, want in zip(rank["walk"], expected):  # (path, candidate ids, probabilities or None)
            for a, b in zip(got, want):
                if a is None or not a.is_floating_point():
                    assert (a is None and b is None) or torch.equal(a, b)
                else:  # the projection's matmul: an ulp of BLAS rounding at most
                    assert_same_within_floor("walk's probabilities", a, b)
        message = rank.get("unsharded_walk_error", "")
        assert re.search(r"CandidateSelector: hidden is a plain tensor but the module's parameters are DTensors"
                         r".*register_fsdp_forward_method\(<that module>, '<method>'\)", message, re.S), \
            message or "no error"
