"""torch.compile sees into the conv ops (issue 39 item 2).

On torch >= 2.6 ``dflash2::grouped_dynamic_conv`` and its backward are triton_ops
(conv/ops.py): the graphs AOTAutograd traces hold their bodies, each Triton launch a
``triton_kernel_wrapper_functional`` node naming our kernel and the CPU kernels as the
ops they are, never the ops themselves, so that Inductor schedules the launches and
``mode="reduce-overhead"`` captures them in CUDA graphs. Where CUDA is absent the CUDA
graphs' structure is traced on fake CUDA tensors in a child process
(tests/conv_compile_graph.py); where it is present the compiled conv runs under
``reduce-overhead``. On torch 2.5 the ops stay custom_ops: one node in the graph.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels.conv import ops
from dflash2_kernels.conv.launch import KERNELS_INTERPRETED

from . import upstream_models as um
from .contract import assert_within_contract
from .upstream_models import one_thread  # noqa: F401 (a fixture, used below)

pytestmark = pytest.mark.compiles

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
OPAQUE_OPS = {"dflash2.grouped_dynamic_conv.default", "dflash2.grouped_dynamic_conv_backward.default"}
needs_traceable = pytest.mark.skipif(
    not ops.TRACEABLE, reason=f"torch {torch.__version__} has no torch.library.triton_op (2.6+) or Triton is "
                              "missing: the conv ops are custom_ops, opaque to torch.compile")


class _Recorder:
    """A torch.compile backend keeping AOTAutograd's forward and backward graphs (one of
    each per compiled region), run as traced (aot_eager: the graphs' own ops, nothing fused)."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        self.backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"))

    def _keep(self, name):
        from torch._functorch.aot_autograd import make_boxed_func

        def compiler(graph, example_inputs):
            self.graphs[name].append(graph)
            return make_boxed_func(graph.forward)

        return compiler

    def targets(self, name: str) -> list[str]:
        """The call targets of every ``name`` graph's nodes, in order."""
        return [str(node.target) for graph in self.graphs[name] for node in graph.graph.nodes
                if node.op == "call_function"]


def _conv_inputs(device, dtype=torch.float32):
    """x [2, 12, 48], delta a strided [2, 12, 2, 3] side of a projection, base [2, 48], dy like x."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 48, generator=g, dtype=dtype)
    delta = torch.randn(2, 12, 2, 2, 3, generator=g, dtype=dtype)[..., 1, :, :]
    base = torch.randn(2, 48, generator=g, dtype=dtype)
    dy = torch.randn(2, 12, 48, generator=g, dtype=dtype)
    return [t.to(device) for t in (x, delta, base, dy)]


def _conv(x, delta, base):
    return dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)


def _run(fn, x, delta, base, dy):
    """(out, dx, ddelta, dbase) of fn on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, delta, base)]
    out = fn(*leaves)
    out.backward(dy)
    return [out.detach()] + [leaf.grad for leaf in leaves]


# --- the graphs on CUDA tensors, traced on the CPU ----------------------------------------


def _cuda_graphs(*arguments: str) -> dict:
    """tests/conv_compile_graph.py's graphs, from a child without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-m", "tests.conv_compile_graph", *arguments], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def _launches(nodes: list[dict]) -> list[tuple[str, list[str]]]:
    """(kernel, the arguments it writes) of each Triton launch, after checking that the
    graph holds launches as functional wrapper nodes and never the ops themselves."""
    targets = {node["target"] for node in nodes}
    assert not any("dflash2" in target for target in targets), f"an op of ours stayed opaque: {targets}"
    assert {node["target"] for node in nodes if "kernel" in node} == {"triton_kernel_wrapper_functional"}
    return [(node["kernel"], node["clones"]) for node in nodes if "kernel" in node]


FORWARD_LAUNCHES = [("grouped_dynamic_conv_fwd_kernel", ["out_ptr"])]
BACKWARD_LAUNCHES = [
    ("grouped_dynamic_conv_bwd_kernel", ["dx_ptr", "ddelta_ptr", "dbase_partial_ptr"]),
    ("grouped_dynamic_conv_dbase_kernel", ["dbase_ptr"]),
]


@needs_traceable
def test_the_cuda_graphs_hold_our_triton_launches_and_not_the_ops():
    """Forward: the forward kernel, writing out alone; backward: the gradients' kernel and
    the dbase sum, writing only their outputs (so Inductor copies no input)."""
    graphs = _cuda_graphs()
    assert _launches(graphs["forward"]) == FORWARD_LAUNCHES
    assert _launches(graphs["backward"]) == BACKWARD_LAUNCHES
    # Each launch keeps the warps and pipeline stages its plan chose (AOTAutograd runs the
    # bodies twice, collecting metadata and then tracing: the same plans each time).
    traced = {(node["kernel"], *node["warps_stages"]) for name in ("forward", "backward")
              for node in graphs[name] if "kernel" in node}
    assert traced == {tuple(plan) for plan in graphs["planned"]}


@needs_traceable
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_one_cuda_graph_serves_every_sequence_length(direction):
    """With batch and sequence dims dynamic (training's packed sequences vary in length,
    and torch.compile makes the dims dynamic on the first new length) the launches take
    the row count as a symbol: one graph, no recompile per length."""
    nodes = _cuda_graphs("--dynamic", direction)[direction]
    expected = FORWARD_LAUNCHES if direction == "forward" else BACKWARD_LAUNCHES
    assert _launches(nodes) == expected
    symbolic = [node["symbolic"] for node in nodes if "kernel" in node]
    assert "n_rows" in symbolic[0], symbolic
    if direction == "backward":
        assert "n_chunks" in symbolic[1], symbolic


# --- the graphs on CPU tensors -------------------------------------------------------------


def _compiled_equals_eager_on_cpu() -> "_Recorder":
    """fullgraph compile of forward and backward on CPU tensors: the same bits as eager;
    the recorder holds the graphs."""
    torch._dynamo.reset()
    recorder = _Recorder()
    inputs = _conv_inputs("cpu")
    got = _run(torch.compile(_conv, fullgraph=True, backend=recorder.backend), *inputs)
    expected = _run(_conv, *inputs)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    return recorder


@pytest.mark.parametrize("route", [
    pytest.param("cpu-kernels", marks=pytest.mark.skipif(not ops._cpu_kernel_available(),
                                                         reason="the C++ CPU kernels are not built")),
    "vectorized",
])
def test_cpu_compile_traces_into_the_ops_and_matches_eager(route, monkeypatch):
    """fullgraph compile of forward and backward on CPU tensors, the same bits as eager.
    On torch >= 2.6 the graphs call the C++ CPU kernels directly; the vectorized path
    (no C++ kernels: it compares data pointers, loops over data-sized chunks) stays the
    ops, as everything does on torch 2.5."""
    if route == "vectorized":
        monkeypatch.setattr(ops, "_cpu_kernel_available", lambda: False)
    recorder = _compiled_equals_eager_on_cpu()
    forward, backward = recorder.targets("forward"), recorder.targets("backward")
    if route == "vectorized" or not ops.TRACEABLE:
        assert forward.count("dflash2.grouped_dynamic_conv.default") == 1, forward
        assert backward.count("dflash2.grouped_dynamic_conv_backward.default") == 1, backward
        return
    assert not (set(forward) | set(backward)) & OPAQUE_OPS
    assert forward.count("dflash2.conv_forward_cpu.default") == 1, forward
    assert backward.count("dflash2.conv_backward_cpu.default") == 1, backward


@needs_traceable
@pytest.mark.skipif(not KERNELS_INTERPRETED, reason="the Triton kernels are compiled here, not interpreted")
@pytest.mark.skipif(HAS_CUDA, reason="CUDA tensors take compiled kernels")
def test_interpreted_triton_calls_stay_the_op_in_the_graph(monkeypatch):
    """Under TRITON_INTERPRET=1 (DFLASH2_BACKEND=triton on CPU tensors) the kernels are
    interpreter objects that no graph can hold: the compiled graphs call the ops, which
    run the interpreter, as a custom op would."""
    monkeypatch.setenv("DFLASH2_BACKEND", "triton")
    recorder = _compiled_equals_eager_on_cpu()
    assert "dflash2.grouped_dynamic_conv.default" in recorder.targets("forward")
    assert "dflash2.grouped_dynamic_conv_backward.default" in recorder.targets("backward")


# --- speculators' DFlash 2 training forward -----------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_speculators_training_forward_compiles_with_our_conv_traced_in():
    """speculators' ``DFlash2DraftModel.forward`` compiled as upstream compiles it (plain
    ``torch.compile``: its own graph breaks, a ``compiler.disable``d anchor draw and
    dynamic-shape ops, rule out ``fullgraph``), patched with our modules, on CPU tensors:
    no graph break more than upstream's, every conv of the draft's layers traced into
    (the C++ CPU kernels in the graphs, not the op), and the loss and every gradient
    within SPEC section 4's contract of unpatched eager fp32, judged against fp64."""
    pytest.importorskip("speculators.models.dflash2.model_definitions")
    from speculators.models.dflash2 import DFlash2DraftModel

    # upstream's forward is torch.compile'd where CUDA is present: compile its own function.
    forward = getattr(DFlash2DraftModel.forward, "_torchdynamo_orig_callable", DFlash2DraftModel.forward)
    upstream = um.speculators_draft(0)
    exact = copy.deepcopy(upstream).double()
    ours = copy.deepcopy(upstream)
    dk.patch(ours)
    batch = um.speculators_batch(0)

    def compiled_step(model):
        torch._dynamo.reset()
        recorder = _Recorder()
        step = torch.compile(functools.partial(forward, model), backend=recorder.backend)
        train_kwargs, _ = DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
        train_kwargs.update(batch.kwargs())
        torch.manual_seed(0)  # the anchors, as um.speculators_loss draws them
        _, loss, _ = step(**train_kwargs)
        loss.backward()
        return recorder, loss.detach()

    upstream_graphs, _ = compiled_step(copy.deepcopy(upstream))
    graphs, loss = compiled_step(ours)
    expected, _ = um.speculators_loss(upstream, batch)
    expected.backward()
    exact_loss, _ = um.speculators_loss(exact, batch.to(torch.float64))
    exact_loss.backward()

    for name in ("forward", "backward"):
        assert len(graphs.graphs[name]) == len(upstream_graphs.graphs[name]), name
    convs = 2 * 2 * um.LAYERS  # two convs a layer, each convolving twice (prepare, finish)
    forward_targets, backward_targets = graphs.targets("forward"), graphs.targets("backward")
    if ops.TRACEABLE and ops._cpu_kernel_available():
        assert forward_targets.count("dflash2.conv_forward_cpu.default") == convs
        assert backward_targets.count("dflash2.conv_backward_cpu.default") == convs
        assert not set(forward_targets + backward_targets) & OPAQUE_OPS
    else:
        assert forward_targets.count("dflash2.grouped_dynamic_conv.default") == convs
    assert_within_contract("loss", loss, expected.detach(), exact_loss.detach())
    exact_grads = dict(exact.named_parameters())
    for name, parameter in upstream.named_parameters():
        if parameter.requires_grad:
            got = ours.get_parameter(name).grad
            assert got is not None, name
            assert_within_contract(name, got, parameter.grad, exact_grads[name].grad)


# --- CUDA graphs ---------------------------------------------------------------------------


class _ConvSublayer(torch.nn.Module):
    """A sublayer between the two convs of a DFlash 2 layer: prepare, a Linear, finish."""

    def __init__(self, hidden):
        super().__init__()
        self.conv = dk.GroupedDynamicCausalConv(hidden, block_size=8, kernel_size=2, group_size=16)
        self.linear = torch.nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.conv.kernel_projection.weight.normal_(std=0.1)
            self.conv.base_kernel.normal_()

    def forward(self, h):
        prepared, kernels = self.conv.prepare(h)
        return h + self.conv.finish(self.linear(prepared), kernels)


@pytest.mark.gpu
@needs_traceable
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_reduce_overhead_captures_the_conv_in_cuda_graphs():
    """mode="reduce-overhead": forward and backward, our launches inside Inductor's
    graphs, replay from CUDA graphs (no cudagraph skip: a host sync, a CPU tensor or an
    input mutated outside the graph would cause one) and stay within SPEC section 4's
    contract of eager fp32, judged against fp64, on every step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _ConvSublayer(64).cuda()
    exact_model = copy.deepcopy(model).double()
    compiled = torch.compile(copy.deepcopy(model), mode="reduce-overhead", fullgraph=True)

    def step(module, h, dy):
        h = h.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        out = module(h)
        out.backward(dy)
        # cloned: a CUDA graph's outputs are overwritten by its next replay
        return [out.detach().clone(), h.grad.clone()] + [p.grad.clone() for p in module.parameters()]

    for seed in range(4):  # warm-up, recording, then replays
        g = torch.Generator(device="cuda").manual_seed(seed)
        h = torch.randn(2, 32, 64, device="cuda", generator=g)
        dy = torch.randn(2, 32, 64, device="cuda", generator=g)
        got, expected = step(compiled, h, dy), step(model, h, dy)
        exact = step(exact_model, h.double(), dy.double())
        for index, (a, b, c) in enumerate(zip(got, expected, exact)):
            assert_within_contract(f"step {seed} result {index}", a, b, c)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
