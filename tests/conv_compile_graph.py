"""The graphs torch.compile's AOTAutograd traces for the conv ops on CUDA tensors, with no GPU.

Run as ``python -m tests.conv_compile_graph [--dynamic] [forward|backward ...]`` (default
both) in a process without ``TRITON_INTERPRET`` (the interpreter's kernels cannot be put
in a graph, so the ops keep them out of it: conv/ops.py). Prints JSON: per graph
("forward": ``dflash2::grouped_dynamic_conv``, "backward":
``dflash2::grouped_dynamic_conv_backward``, each traced alone on fake CUDA tensors, fp32
x [2, 12, 48], delta a strided [2, 12, 2, 3] side of a projection, base [2, 48]) the call
targets of its nodes in order, and for each Triton launch the kernel's name, its warps
and stages, the arguments the functional node clones (the ones the kernel writes) and
the scalar arguments left symbolic; under "planned", each launch the launchers planned
while tracing (kernel, warps, stages), in order. ``--dynamic``: through torch.compile
with the batch and sequence dims marked dynamic (training's packed sequences vary in
length), so that one graph serves every length.

Fake CUDA tensors need no driver; what the tracing asks of one is stubbed: the device's
properties (an H200's SM count, for the backward's grid) and Triton's target (sm_90, for
the TTIR that tells which arguments a kernel writes). Forward and backward are traced
apart: torch's autograd engine cannot run a fake CUDA backward without a driver.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

_H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                        total_memory=150_121_152_512, warp_size=32)


class _Sm90Driver:
    """What ``generate_ttir`` asks of Triton's driver: the target to lower for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _stub_the_device() -> None:
    import triton

    torch.cuda.get_device_properties = lambda device=None: _H200
    torch.cuda.get_device_name = lambda device=None: _H200.name
    torch.cuda.current_device = lambda: 0
    triton.runtime.driver.set_active(_Sm90Driver())


def _describe(graph: torch.fx.GraphModule) -> list[dict]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    nodes = []
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        entry = {"target": str(node.target)}
        if "kernel_idx" in node.kwargs:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            entry["kernel"] = getattr(kernel, "fn", kernel).__name__
            # wrap_triton turns the launch's num_warps/num_stages into a one-config autotuner
            config = kernel.configs[0] if getattr(kernel, "configs", None) else None
            entry["warps_stages"] = [config.num_warps, config.num_stages] if config else None
            entry["clones"] = list(node.kwargs.get("tensors_to_clone", ()))
            entry["symbolic"] = sorted(name for name, value in node.kwargs["kwargs"].items()
                                       if isinstance(value, torch.fx.Node) and "val" in value.meta
                                       and not isinstance(value.meta["val"], torch.Tensor))
        nodes.append(entry)
    return nodes


def trace_graphs(names=("forward", "backward"), dynamic: bool = False) -> dict:
    """{name: nodes} for "forward" and/or "backward" (see the module's docstring)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    import dflash2_kernels as dk
    from dflash2_kernels.conv import ops

    assert ops.TRACEABLE, "the conv ops are not triton_ops on this torch"
    graphs = {}

    def record(name):
        def compiler(graph, example_inputs):
            graphs[name] = graph
            return graph

        return compiler

    def forward(x, delta, base):
        return dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16)

    def backward(dy, x, delta, base):
        return ops.grouped_dynamic_conv_backward_op(dy, x, delta, base, 8, 16)

    def trace(name, fn, *inputs):
        if not dynamic:
            return aot_function(fn, fw_compiler=record(name))(*inputs)
        for tensor in inputs[:-1]:  # all but base [K, H]: batch and sequence
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 1)
        return torch.compile(fn, backend=aot_autograd(fw_compiler=record(name)), fullgraph=True)(*inputs)

    # What the launchers planned, kernel by kernel: the graph's launches must keep it.
    from dflash2_kernels.conv.launch import KernelLaunch

    planned, run = [], KernelLaunch.run

    def recording_run(launch, device_of):
        planned.append([launch.kernel.__name__, launch.num_warps, launch.num_stages])
        return run(launch, device_of)

    KernelLaunch.run = recording_run
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(2, 12, 48, device="cuda")
        delta = torch.randn(2, 12, 2, 2, 3, device="cuda")[..., 1, :, :]
        base = torch.randn(2, 48, device="cuda")
        if "forward" in names:
            trace("forward", forward, x, delta, base)
        if "backward" in names:
            trace("backward", backward, torch.randn_like(x), x, delta, base)
    KernelLaunch.run = run
    return {**{name: _describe(graph) for name, graph in graphs.items()}, "planned": planned}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"
    os.environ["DFLASH2_BACKEND"] = "auto"  # Triton for CUDA tensors
    _stub_the_device()
    arguments = sys.argv[1:]
    names = [name for name in arguments if name != "--dynamic"] or ["forward", "backward"]
    print(json.dumps(trace_graphs(names, dynamic="--dynamic" in arguments)))


if __name__ == "__main__":
    main()
