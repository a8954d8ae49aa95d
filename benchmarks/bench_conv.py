"""Benchmark the grouped dynamic conv: ours vs the eager reference vs torch.compile of it.

    python benchmarks/bench_conv.py [--out results.jsonl] [--no-compile] [--quick]

Runs on CUDA when present, else on the CPU (the CPU path, at sizes that finish in
a few minutes): fp32, bf16 and the mixed training case (fp32 x, a bf16 strided delta,
as under bf16 autocast), each at a serving size (256 rows: 32 sequences of one 8-token
block) and a training size (4096 rows). Prints a table (median / p20 / p80 ms per call,
effective GB/s over the minimal bytes, percent of the copy bandwidth measured in the
same run, how many times faster ours is) and appends one JSON record per row to --out.
A case's implementations are timed in turns, one call each per repetition
(``common.time_side_by_side``).

On the CPU each case also times its **floor**: a plain PyTorch zero fill of the
results' bytes (out; and dx, ddelta, dbase for the backward), which no implementation
avoids, into tensors kept across calls (ours writes its large results into memory kept
from its previous call, dflash2_kernels.memory: fresh pages' faults are not work it
has to do), and the table gives ours as a percent of it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash2_kernels as dk  # noqa: E402
from dflash2_kernels import reference  # noqa: E402

from common import Row, print_table, start_run, time_cuda_graph, time_side_by_side, write_records  # noqa: E402

BF16 = (torch.bfloat16, torch.bfloat16, torch.bfloat16)
F32 = (torch.float32, torch.float32, torch.float32)
AUTOCAST = (torch.float32, torch.bfloat16, torch.float32)  # speculators under bf16 autocast


@dataclass(frozen=True)
class Shape:
    rows: int
    hidden: int
    dtypes: tuple
    group_size: int = 16
    taps: int = 2
    block_size: int = 8

    @property
    def name(self) -> str:
        kind = {BF16: "bf16", F32: "fp32", AUTOCAST: "fp32 x/bf16 delta"}[self.dtypes]
        return f"{self.rows}x{self.hidden} {kind}"


GPU_SHAPES = [Shape(256, 5120, BF16), Shape(4096, 5120, BF16), Shape(4096, 5120, AUTOCAST),
              Shape(16384, 4096, BF16), Shape(16384, 4096, AUTOCAST)]
CPU_SHAPES = [Shape(rows, 4096, dtypes) for rows in (256, 4096) for dtypes in (F32, BF16, AUTOCAST)]


def make_inputs(shape: Shape, device: torch.device):
    x_dtype, delta_dtype, base_dtype = shape.dtypes
    groups = shape.hidden // shape.group_size
    x = torch.randn(shape.rows, shape.hidden, device=device, dtype=x_dtype)
    # One side of the projection's [N, 2, K, G] output, as the module passes it.
    delta = torch.randn(shape.rows, 2, shape.taps, groups, device=device, dtype=delta_dtype)[:, 1]
    base = torch.randn(shape.taps, shape.hidden, device=device, dtype=base_dtype)
    dy = torch.randn(shape.rows, shape.hidden, device=device, dtype=torch.promote_types(x_dtype, delta_dtype))
    return x, delta, base, dy


def minimal_bytes(shape: Shape, backward: bool) -> int:
    """Bytes a perfect kernel moves: each operand read once, each result written once."""
    x_dtype, delta_dtype, base_dtype = shape.dtypes
    size = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
    out_size = size(torch.promote_types(x_dtype, delta_dtype))
    n_x = shape.rows * shape.hidden
    n_delta = shape.rows * shape.taps * (shape.hidden // shape.group_size)
    n_base = shape.taps * shape.hidden
    inputs = n_x * size(x_dtype) + n_delta * size(delta_dtype) + n_base * size(base_dtype)
    forward = inputs + n_x * out_size  # read x, delta, base; write out
    if not backward:
        return forward
    # the backward reads dy, x, delta, base and writes dx, ddelta, dbase (each input's size)
    return forward + n_x * out_size + 2 * inputs


def fill_floor(shape: Shape, backward: bool, device: torch.device):
    """A zero fill of tensors of the results' shapes and dtypes, kept across calls: out,
    and for the backward also dx, ddelta and dbase."""
    x_dtype, delta_dtype, base_dtype = shape.dtypes
    groups = shape.hidden // shape.group_size
    results = [((shape.rows, shape.hidden), torch.promote_types(x_dtype, delta_dtype))]
    if backward:
        results += [((shape.rows, shape.hidden), x_dtype), ((shape.rows, shape.taps, groups), delta_dtype),
                    ((shape.taps, shape.hidden), base_dtype)]
    kept = [torch.empty(size, dtype=dtype, device=device) for size, dtype in results]
    return lambda: [tensor.zero_() for tensor in kept]


def main() -> None:
    run = start_run(__doc__, quick_help="the serving-size shapes only")
    args, device, env, copy_gbps = run.args, run.device, run.env, run.copy_gbps

    impls = {"ours": dk.grouped_dynamic_conv, "reference": reference.grouped_dynamic_conv}
    if not args.no_compile:
        impls["compiled reference"] = torch.compile(reference.grouped_dynamic_conv, dynamic=False)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    if args.quick:
        shapes = [s for s in shapes if s.rows <= 256] if device.type == "cpu" else shapes[:2]

    rows: list[Row] = []
    for shape in shapes:
        x, delta, base, dy = make_inputs(shape, device)
        kwargs = dict(block_size=shape.block_size, group_size=shape.group_size)
        for backward, label in ((False, "fwd"), (True, "fwd+bwd")):
            calls = {impl: _call(conv, (x, delta, base), dy if backward else None, kwargs)
                     for impl, conv in impls.items()}
            if device.type == "cpu":
                calls["floor"] = fill_floor(shape, backward, device)
            # Every implementation captures: device time from a CUDA-graph replay.
            timings = time_side_by_side(calls, device, graph=True)
            for impl, timing in timings.items():
                rows.append(Row("conv", f"{label} {shape.name}", impl, timing, minimal_bytes(shape, backward),
                                copy_gbps))

        if device.type == "cuda" and shape.rows <= 256:
            with torch.no_grad():
                timing = time_cuda_graph(lambda: dk.grouped_dynamic_conv(x, delta, base, **kwargs), device)
            rows.append(Row("conv", f"fwd {shape.name} graph", "ours", timing, minimal_bytes(shape, False), copy_gbps))

    print_table(rows)
    write_records(rows, env, args.out)


def _call(conv, inputs, dy, kwargs):
    """One call of ``conv``: the forward under no_grad, or (``dy`` given) the forward
    and the backward with gradients for x, delta and base."""
    if dy is None:
        def forward():
            with torch.no_grad():
                return conv(*inputs, **kwargs)
        return forward
    leaves = [t.detach().requires_grad_() for t in inputs]

    def forward_backward():
        return torch.autograd.grad(conv(*leaves, **kwargs), leaves, dy)
    return forward_backward


if __name__ == "__main__":
    main()
