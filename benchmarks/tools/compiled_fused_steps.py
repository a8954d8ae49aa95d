"""The trainers' steps with the fused head under their own torch.compile, on a GPU: run and
timed against upstream's (scripts/gpu_check.sh, step ``fused_compiled``).

    python benchmarks/tools/compiled_fused_steps.py [--trainers speculators nemo]

- speculators: ``DFlash2DraftModel.forward`` is compiled by ``conditional_torch_compile``
  (CUDA is up, Inductor); ``dk.patch(model, fused_head=True)`` compiles the fused forward
  by the same compile. Upstream: the unpatched model, its compiled forward.
- NeMo: the draft compiled in place as its recipe's ``compile:`` block does
  (``compile_module_inplace``, Inductor), the trainer around it; ours: the same with
  ``dk.patch(trainer, fused_head=True)``.

One mid-sized drafter (bench_step.py's builders: H 1024, V 32768, 2 layers, 64 anchors of
8 rows, bf16): big enough that the head is a real share of the step, small enough that
four cold Inductor compiles fit the check's budget. Prints per trainer and side: whether
the forward is compiled, the first step (compile included), the median of the timed steps
(CUDA events), the peak memory and the loss. Exit status 1 when a step fails, a loss is
not finite, or a fused forward that should be compiled is not.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dflash2_kernels as dk  # noqa: E402
from benchmarks import bench_step as bs  # noqa: E402
from dflash2_kernels.compat.compiled import is_compiled  # noqa: E402

SIZE = bs.Size(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=3072, vocab=32_768, tokens=1024,
               anchors=64, requests=8)
DTYPE = torch.bfloat16
REPS = 10


def _time(step) -> tuple[float, float, float, float]:
    """(first step s, median ms of REPS steps, peak MiB of one step, last loss)."""
    start = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    step()
    samples = []
    for _ in range(REPS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        samples.append(begin.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    return first, sorted(samples)[len(samples) // 2], peak, float(loss)


def speculators_sides(device) -> list[tuple[str, bool, object]]:
    sides = []
    for fused in (False, True):
        model = bs.speculators_model(SIZE, device, DTYPE)
        if fused:
            report = dk.patch(model, fused_head=True)
            print("#", str(report).splitlines()[0])
        forward = vars(model).get("forward", type(model).forward)
        compiled = is_compiled(getattr(forward, "__func__", forward))
        sides.append(("ours+head" if fused else "upstream", compiled,
                      bs.train_step_fn(model, SIZE, device, DTYPE, compiled=True)))
    return sides


def nemo_sides(device) -> list[tuple[str, bool, object]]:
    from nemo_automodel.components.utils.compile_utils import CompileConfig, compile_module_inplace

    sides = []
    for fused in (False, True):
        trainer = bs.nemo_trainer_model(SIZE, device, DTYPE)
        compile_module_inplace(trainer.draft_model, CompileConfig(enabled=True))
        if fused:
            dk.patch(trainer, fused_head=True)
        compiled = trainer.draft_model._compiled_call_impl is not None
        sides.append(("ours+head" if fused else "upstream", compiled,
                      bs.nemo_train_step_fn(trainer, SIZE, device, DTYPE, compiled=True)))
    return sides


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", nargs="+", choices=["speculators", "nemo"], default=["speculators", "nemo"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    device = torch.device("cuda")
    print(f"# {SIZE.name}, {SIZE.anchors} anchors ({SIZE.anchors * SIZE.block} rows), T {SIZE.tokens}, bf16, "
          f"{torch.cuda.get_device_name()}")
    failed = False
    for trainer in args.trainers:
        sides = speculators_sides(device) if trainer == "speculators" else nemo_sides(device)
        results = {}
        for impl, compiled, step in sides:
            try:
                first, median, peak, loss = _time(step)
            except Exception as error:  # reported, and the other sides still run
                print(f"{trainer:11} {impl:9} FAILED: {type(error).__name__}: {error}")
                failed = True
                continue
            results[impl] = median
            failed |= not math.isfinite(loss) or not compiled
            print(f"{trainer:11} {impl:9} compiled {compiled!s:5} first step {first:6.1f} s  median {median:8.2f} ms "
                  f"peak {peak:8.1f} MiB  loss {loss:.4f}", flush=True)
        if len(results) == 2:
            print(f"{trainer:11} ours+head / upstream: {results['ours+head'] / results['upstream']:.2f}x the time")
        torch._dynamo.reset()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
