"""Upstream DFlash 2 pieces after ``dk.patch``, in the settings training and serving use:

- one training step (forward, unary + selector loss, backward, SGD update) of a
  patched decoder layer (speculators' and NeMo's ``Qwen3DFlash2DecoderLayer``) plus a
  patched selector, captured whole by ``torch.compile(fullgraph=True)``: one graph, no
  break, our ops inside it, and the loss and gradients of the eager patched step;
- DistributedDataParallel over two CPU processes (gloo): the all-reduced gradients of
  one step equal those of one process on the same global batch;
- a serving step (draft logits -> ``selector.walk`` -> ``dk.rejection_sample`` /
  ``dk.greedy_verify``) captured in a CUDA graph and replayed (``gpu``: CUDA only).

Sizes are the tiny ones of ``tests/upstream_models.py`` (H 64, 2 layers there, one
here, a vocabulary of a few hundred), so every test runs in seconds on two CPU cores.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dflash2_kernels as dk
from dflash2_kernels._extension import EXTENSION_LOADED

from . import upstream_models as um
from .contract import assert_same_within_floor, assert_within_contract
from .distributed_support import WORLD, load_rank_results, requires_gloo, run_ranks, save_rank_result

pytest.importorskip("transformers")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The layer's inputs: BATCH sequences of QUERY draft rows (QUERY / um.BLOCK blocks)
# attending to CONTEXT target positions.
BATCH, QUERY, CONTEXT = 2, 16, 12
LR = 0.1


# --- a patched layer + selector, its inputs and loss -------------------------------------


class LayerStep(nn.Module):
    """One upstream DFlash 2 decoder layer, a selector and an LM head: forward returns the
    training loss, unary cross-entropy + the selector's K-way cross-entropy.

    ``flavour`` "speculators": speculators' ``Qwen3DFlash2DecoderLayer`` and
    ``CandidateSelector``, scored with ``score_candidates`` over full-vocabulary logits,
    supervised with speculators' own ``selector_training_candidates``. "nemo": NeMo's,
    scored with ``pair_scores`` over top-k values, supervised as NeMo's
    ``DFlash2TrainerModule`` does (positions whose target missed the top-k are masked).
    Both selector losses here are plain means over rows, so the loss of a batch is the
    mean of the losses of its equal halves (what DDP's gradient averaging assumes).
    Every other row's selector target is one of its own candidates (as a trained
    draft's mostly is), the others keep their random token, so that both the
    target-among-candidates and the target-missing branches run.
    """

    def __init__(self, flavour: str, seed: int = 0) -> None:
        super().__init__()
        self.flavour = flavour
        config = um.nemo_draft_config()
        torch.manual_seed(seed)
        if flavour == "speculators":
            from speculators.models.dflash2 import model_definitions as upstream

            self.layer = upstream.Qwen3DFlash2DecoderLayer(config, 0, block_size=um.BLOCK, conv_kernel_size=um.TAPS,
                                                          conv_group_size=um.GROUP)
            self.selector = upstream.CandidateSelector(vocab_size=um.VOCAB, hidden_size=um.HIDDEN, rank=um.RANK,
                                                       top_k=um.TOP_K)
        else:
            from nemo_automodel.components.speculative.dflash import draft_qwen3_dflash2 as upstream

            self.layer = upstream.Qwen3DFlash2DecoderLayer(config, 0)
            self.selector = upstream.CandidateSelector(um.VOCAB, um.HIDDEN, um.RANK, um.TOP_K)
        self.head = nn.Linear(um.HIDDEN, um.VOCAB, bias=False)
        um.randomise_dflash2_modules(self, torch.Generator().manual_seed(seed + 1))

    def forward(self, x, context, cos, sin, targets, predecessors):
        """x [B, Q, H], context [B, C, H], cos/sin [B, C+Q, head_dim], targets and
        predecessors [B, Q] int64 -> the scalar fp32 loss."""
        kwargs = dict(target_hidden=context, hidden_states=x, attention_mask=None, position_embeddings=(cos, sin))
        if self.flavour == "nemo":
            kwargs["conv_block_size"] = um.BLOCK
        hidden = self.layer(**kwargs)
        logits = self.head(hidden)
        unary_loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        candidate_ids = logits.topk(um.TOP_K, dim=-1).indices
        rows = torch.arange(targets.shape[-1], device=targets.device).expand_as(targets)
        own = candidate_ids.gather(-1, (rows % um.TOP_K).unsqueeze(-1)).squeeze(-1)
        targets = torch.where(rows % 2 == 1, own, targets)
        if self.flavour == "speculators":
            from speculators.models.dflash2.metrics import selector_training_candidates

            candidate_ids, target_index, _ = selector_training_candidates(candidate_ids, targets)
            scores = self.selector.score_candidates(logits, hidden, predecessors, candidate_ids)
            selector_loss = F.cross_entropy(scores.flatten(0, 1).float(), target_index.flatten())
        else:
            scores = self.selector.pair_scores(hidden, logits.gather(-1, candidate_ids), candidate_ids, predecessors)
            hits = candidate_ids == targets.unsqueeze(-1)
            nll = F.cross_entropy(scores.flatten(0, 1).float(), hits.long().argmax(-1).flatten(), reduction="none")
            selector_loss = (nll * hits.any(-1).flatten()).mean()
        return unary_loss + selector_loss


def patched_step_model(flavour: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: torch.device = DEVICE) -> LayerStep:
    """A :class:`LayerStep` with its two convs and its selector swapped for ours by ``dk.patch``."""
    pytest.importorskip("speculators" if flavour == "speculators" else "nemo_automodel")
    model = LayerStep(flavour, seed).to(device, dtype)
    report = dk.patch(model)
    assert len(report.replaced) == 3 and not report.skipped, str(report)
    return model


def layer_inputs(seed: int = 0, batch: int = BATCH, dtype: torch.dtype = torch.float32,
                 device: torch.device = DEVICE) -> tuple:
    """(x, context, cos, sin, targets, predecessors) for :meth:`LayerStep.forward`: x
    [B, Q, H], context [B, C, H], cos/sin [B, C+Q, head_dim] in ``dtype``; targets and
    predecessors [B, Q] int64, uniform over the vocabulary."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, QUERY, um.HIDDEN, generator=generator, dtype=torch.float64)
    context = torch.randn(batch, CONTEXT, um.HIDDEN, generator=generator, dtype=torch.float64)
    positions = torch.arange(CONTEXT + QUERY).expand(batch, -1)
    cos, sin = Qwen3RotaryEmbedding(um.nemo_draft_config())(x.float(), positions)
    targets = torch.randint(0, um.VOCAB, (batch, QUERY), generator=generator)
    predecessors = torch.randint(0, um.VOCAB, (batch, QUERY), generator=generator)
    floats = [t.to(device, dtype) for t in (x, context, cos, sin)]
    return (*floats, targets.to(device), predecessors.to(device))


def make_train_step(model: nn.Module, forward=None):
    """step(*inputs) -> (loss, gradients): forward (``model``, or ``forward`` standing for
    it), loss, backward, an SGD update in place.

    The update is written out rather than ``torch.optim.SGD.step()``: the optimizers'
    step puts a ``torch._dynamo.graph_break()`` on each side of itself by design
    (torch/optim/optimizer.py), which ``fullgraph=True`` rejects. The gradients are
    returned (cloned) before they are cleared, so the two runs can be compared."""
    parameters = list(model.parameters())
    forward = model if forward is None else forward

    def step(*inputs):
        loss = forward(*inputs)
        loss.backward()
        grads = [p.grad.clone() for p in parameters]
        with torch.no_grad():
            for p in parameters:
                p.sub_(LR * p.grad)
                p.grad = None
        return loss.detach(), grads

    return step


# Where torch.compile traces into our conv ops (triton_ops, torch >= 2.6: conv/ops.py), a
# graph holds their bodies' kernels instead of the ops: each call of the op is one of these.
TRACED_BODY_CALLS = {
    "grouped_dynamic_conv": ("dflash2.conv_forward_cpu.default",
                             "triton_kernel_wrapper_functional:grouped_dynamic_conv_fwd_kernel"),
    "grouped_dynamic_conv_backward": ("dflash2.conv_backward_cpu.default",
                                      "triton_kernel_wrapper_functional:grouped_dynamic_conv_bwd_kernel"),
}


def op_calls(ops: list[str], op: str) -> int:
    """The calls of our op ``op`` (``grouped_dynamic_conv``, ``selector_scores``, ...) that
    recorded graph ops (recording_backend's) hold: the op itself, or its traced body's kernel."""
    return sum(ops.count(name) for name in (f"dflash2.{op}.default", *TRACED_BODY_CALLS.get(op, ())))


def recording_backend(graphs: list[list[str]], compiler: str):
    """A torch.compile backend that records the ops of every graph AOTAutograd produces
    (after its decompositions: what really runs), then runs it: "aot_eager" as traced,
    "inductor" through Inductor's code generation. A Triton launch is recorded as its
    wrapper and kernel: ``triton_kernel_wrapper_functional:<kernel>``."""
    def ops(gm) -> list[str]:
        return [_op_name(node) for node in gm.graph.nodes if node.op == "call_function"]

    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(gm, example_inputs, *args, **kwargs):
            graphs.append(ops(gm))
            return compile_fx_inner(gm, example_inputs, *args, **kwargs)

        return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(ops(gm))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record, inference_compiler=record)


def _op_name(node) -> str:
    if "kernel_idx" not in node.kwargs:
        return str(node.target)
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    return f"{node.target}:{getattr(kernel, 'fn', kernel).__name__}"


# --- torch.compile of the whole training step -------------------------------------------


# On CPU the graph runs as AOTAutograd traced it (aot_eager): Dynamo's capture, where a
# graph break would happen, and AOTAutograd's joint forward/backward trace through our
# fake kernels and autograd formulas are the same as Inductor's; only Inductor's C++
# code generation is skipped, which took ~2 minutes for this one step on the 2-core dev
# machine. On CUDA the step goes through Inductor.
COMPILER = "inductor" if DEVICE.type == "cuda" else "aot_eager"
# Recent torch (2.14 here) can trace loss.backward() into the graph, behind an opt-in
# flag. A torch without the flag stops there: the forward and loss are then one graph,
# AOTAutograd's backward a second, and the update runs eagerly.
WHOLE_STEP = hasattr(torch._dynamo.config, "trace_autograd_ops")


@pytest.mark.compiles
@pytest.mark.parametrize("flavour", ["speculators", "nemo"])
def test_compiled_training_step_is_one_graph_and_equals_eager(flavour):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_model, compiled_model = patched_step_model(flavour), patched_step_model(flavour)
    exact_model = patched_step_model(flavour, dtype=torch.float64)
    eager_step, exact_step = make_train_step(eager_model), make_train_step(exact_model)
    graphs: list[list[str]] = []
    backend = recording_backend(graphs, COMPILER)
    if WHOLE_STEP:
        compiled_step = torch.compile(make_train_step(compiled_model), fullgraph=True, backend=backend)
        tracing = torch._dynamo.config.patch(trace_autograd_ops=True)
    else:
        compiled_step = make_train_step(compiled_model, torch.compile(compiled_model, fullgraph=True, backend=backend))
        tracing = contextlib.nullcontext()
    with tracing:
        for step in range(2):  # the second step runs on updated parameters: no recompilation
            inputs = layer_inputs(seed=step)
            expected_loss, expected_grads = eager_step(*inputs)
            loss, grads = compiled_step(*inputs)
            exact_loss, exact_grads = exact_step(*layer_inputs(seed=step, dtype=torch.float64))
            # aot_eager runs the same ATen kernels as eager, AOTAutograd may sum a
            # parameter's gradient contributions in another order; Inductor also fuses and
            # re-tiles the reductions (RMSNorm, softmax, the losses). Either way the compiled
            # step is judged as SPEC section 4 judges a kernel: against the float64 step,
            # the eager fp32 step setting the bar (the loss, a scalar: the floor, a few ulps).
            assert_within_contract(f"step {step} loss", loss, expected_loss, exact_loss)
            for name, got, want, true in zip([n for n, _ in compiled_model.named_parameters()], grads,
                                             expected_grads, exact_grads):
                assert want.abs().max() > 0, f"{name} got no gradient: the check would be vacuous"
                assert_within_contract(f"step {step}, grad of {name}", got, want, true)
    # The parameters after two updates (LR * grad each), judged the same way.
    for (name, p), q, r in zip(compiled_model.named_parameters(), eager_model.parameters(), exact_model.parameters()):
        assert_within_contract(f"{name} after two steps", p.detach(), q.detach(), r.detach())

    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    # One graph holding forward, backward and update (or AOTAutograd's forward and
    # backward graphs), and our kernels in it (not upstream's PyTorch: patch() replaced it).
    assert len(graphs) == (1 if WHOLE_STEP else 2), [len(g) for g in graphs]
    ops = [op for graph in graphs for op in graph]
    for op in ("grouped_dynamic_conv", "grouped_dynamic_conv_backward", "selector_scores", "selector_scores_backward"):
        assert op_calls(ops, op) > 0, (op, sorted({o for o in ops if "dflash2" in o or "triton" in o}))


# --- DistributedDataParallel over two processes -----------------------------------------


def _ddp_worker(rank: int, out_dir: str) -> None:
    """One DDP rank (tests/distributed_support.py's process group): its half of the
    global batch, one step; saves its gradients."""
    from torch.nn.parallel import DistributedDataParallel

    cpu = torch.device("cpu")
    model = DistributedDataParallel(patched_step_model("speculators", device=cpu))
    inputs = layer_inputs(seed=3, batch=WORLD * BATCH, device=cpu)
    local = [t[rank * BATCH:(rank + 1) * BATCH] for t in inputs]
    model(*local).backward()
    save_rank_result(out_dir, rank, {n: p.grad for n, p in model.module.named_parameters()})


def _global_batch_grads(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    cpu = torch.device("cpu")  # gloo: the ranks run on the CPU
    model = patched_step_model("speculators", dtype=dtype, device=cpu)
    model(*layer_inputs(seed=3, batch=WORLD * BATCH, dtype=dtype, device=cpu)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@requires_gloo
def test_ddp_gradients_equal_one_process_on_the_global_batch(tmp_path):
    pytest.importorskip("speculators")
    run_ranks(_ddp_worker, tmp_path)
    ranks = load_rank_results(tmp_path)
    single, exact = _global_batch_grads(torch.float32), _global_batch_grads(torch.float64)
    assert ranks[0].keys() == single.keys()
    for name, want in single.items():
        # All-reduce leaves every rank the same tensor, bit for bit.
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        # The loss is a mean over rows and the halves are equal, so the mean of the two
        # ranks' gradients is the global batch's gradient. Both fp32 runs approximate the
        # same float64 value, rounded in other orders (per-half sums, then the
        # all-reduce): SPEC section 4 with the single process as the reference.
        assert_within_contract(name, ranks[0][name], want, exact[name])
        assert want.abs().max() > 0, f"{name} got no gradient: the check would be vacuous"


# --- serving step in a CUDA graph -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not EXTENSION_LOADED, reason="the serving kernels need the built extension")
@pytest.mark.parametrize("flavour", ["speculators", "nemo"])
def test_serving_step_replays_from_a_cuda_graph_as_eager(flavour):
    """Draft logits from the head, the patched selector's walk, then verification, all in
    one CUDA graph: a replay gives eager's results, greedy and sampled (same RNG state)."""
    model = patched_step_model(flavour).eval()
    selector = model.selector
    batch, draft = 4, um.BLOCK - 1
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(batch, draft, um.HIDDEN, device="cuda", generator=generator)
    anchors = torch.randint(0, um.VOCAB, (batch,), device="cuda", generator=generator)
    target_logits = 3 * torch.randn(batch, draft + 1, um.VOCAB, device="cuda", generator=generator)
    target_probs = torch.softmax(target_logits, -1)

    @torch.no_grad()
    def serve():
        logits = model.head(hidden)
        greedy_path, _, _ = selector.walk(hidden, logits, anchors, 0.0)
        greedy = dk.greedy_verify(greedy_path, target_logits)
        # Uniforms from the default CUDA generator, which graphs replay with fresh offsets.
        path, candidates, probs = selector.walk(hidden, logits, anchors, 1.0)
        sampled = dk.rejection_sample(path, target_probs, probs, candidates)
        return greedy_path, *greedy, path, candidates, probs, *sampled

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        serve()  # warm-up (lazy initialisation, allocator) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = serve()

    for seed in (1, 2):
        # New inputs in the captured buffers; the same RNG state for eager and replay.
        hidden.copy_(torch.randn_like(hidden))
        torch.cuda.manual_seed(seed)
        expected = serve()
        torch.cuda.manual_seed(seed)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected):
            if got.is_floating_point():
                # Same kernels, inputs and uniforms; cuBLAS may pick another algorithm
                # for the head inside a capture: an ulp or so.
                assert_same_within_floor("replayed", got, want)
            else:  # ids, counts: exactly
                assert torch.equal(got, want), (seed, got, want)
        greedy_path, accepted, bonus, path, candidates, probs, sampled_accepted, sampled_bonus = captured
        assert (candidates == path.unsqueeze(-1)).any(-1).all()
        assert ((sampled_accepted >= 0) & (sampled_accepted <= draft)).all()
        assert ((sampled_bonus >= 0) & (sampled_bonus < um.VOCAB)).all()

