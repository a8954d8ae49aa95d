"""The bytes every GPU kernel of the package moves, counted without a GPU, against the
minimum its op must move, and what that predicts on an H200 beside the eager reference.
A model, not a measurement.

    python benchmarks/traffic.py [--only TEXT] [--out FILE.jsonl] [--doc docs/MODELS.md]
                                 [--save docs/results/traffic.jsonl]
    python benchmarks/traffic.py --gpu [--out FILE.jsonl]     # on a GPU machine

Without a GPU (any machine with g++ and the CUDA toolkit's headers): builds the
sanitized test library if needed (scripts/asan.py build: the CUDA kernels compiled as
host code for the SIMT emulator, a few minutes the first time), restarts itself with it
loaded and the Triton interpreter on, and runs every case of benchmarks/traffic_cases.py:
each CUDA kernel in the emulator, each Triton kernel in the interpreter, counting every
load and store (benchmarks/traffic_counters.py), and the eager reference of each op under
an aten dispatch mode that sums what each of its ops reads and writes. The cases run at
two row counts far below the published shapes (SPEC section 5: the emulator and the
interpreter take about a millisecond per block or program); every count is extrapolated
linearly in rows to the published shape, and the tables say so.

Per kernel: unique bytes / the minimum (benchmarks/traffic_minimum.py), requested bytes /
the minimum, sectors per warp request against the ideal of the access pattern, and the
H200 estimate of its DRAM bytes at 4.3 TB/s. Per op: ours (its kernels plus the torch ops
around them) and the eager reference, estimated alike, the predicted H200 speed-up, and
the speed-up measured on the CPU by the op's benchmark (docs/results/records.jsonl: its
largest matching case, named).

Then the whole calls (benchmarks/whole_call.py): every public op's real code on fake CUDA
tensors, its launches, host syncs, bytes over [R, V] planes, GEMM FLOPs and peak memory,
the draft head's beside the dense head it replaces (its own table and records,
docs/results/whole_call.jsonl).

--gpu: on a GPU machine, times each kernel (torch.profiler) and each op at the published
shapes and prints them beside the committed model (docs/results/traffic.jsonl): the first
check of the model. scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
# A fresh clone needs no install: the emulated build it makes is also the package's _C
# (scripts/asan.py's test environment points DFLASH2_EXTENSION_PATH at it).
sys.path.insert(1, str(REPO))

CHILD_FLAG = "DFLASH2_TRAFFIC_CHILD"
MODEL_RECORDS = REPO / "docs" / "results" / "traffic.jsonl"
BENCH_RECORDS = REPO / "docs" / "results" / "records.jsonl"


def _asan_module():
    spec = importlib.util.spec_from_file_location("_dflash2_asan", REPO / "scripts" / "asan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def restart_with_emulator() -> None:
    """Build the emulated library if needed and exec this script again with it loaded."""
    asan = _asan_module()
    print("# building the sanitized test library (scripts/asan.py build) ...", flush=True)
    asan.build(asan=True)
    env = asan.test_environment()
    env[CHILD_FLAG] = "1"
    env["TRITON_INTERPRET"] = "1"
    env["DFLASH2_POISON_OUTPUTS"] = "0"  # a NaN fill of every output is the tests' check, not traffic
    env.pop("DFLASH2_BACKEND", None)
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)


# --- counting -------------------------------------------------------------------------------


@dataclass
class Counted:
    """One case counted at one row count."""

    rows: int
    kernels: list  # (key, LaunchTraffic, minimum bytes)
    op_minimum: int
    around: list  # AtenOp: the torch ops ours runs around its kernels
    eager: list  # AtenOp: the eager reference's ops
    seconds: float  # wall time of the counting


def ops_seconds(low: list, high: list, rows_low: int, rows_high: int, rows: int) -> tuple[float, int, int]:
    """The model's time of a sequence of aten ops at ``rows``, each op's bytes and FLOPs
    extrapolated from its counts at two row counts (the same ops in the same order at
    both; otherwise the totals, spread evenly over the ops). Returns (seconds, bytes, FLOPs)."""
    import traffic_minimum as model

    def at(a, b):
        return max(0.0, extrapolate(a, b, rows_low, rows_high, rows))

    if [op.name for op in low] != [op.name for op in high]:
        total = at(sum(o.read_bytes + o.write_bytes for o in low), sum(o.read_bytes + o.write_bytes for o in high))
        flops = at(sum(o.flops for o in low), sum(o.flops for o in high))
        count = max(1, len(high))
        dtype = high[0].dtype if high else None
        return count * model.kernel_seconds(total / count, flops / count, dtype), round(total), round(flops)
    seconds = total = flops = 0.0
    for a, b in zip(low, high):
        moved = at(a.read_bytes + a.write_bytes, b.read_bytes + b.write_bytes)
        work = at(a.flops, b.flops)
        seconds += model.kernel_seconds(moved, work, b.dtype)
        total += moved
        flops += work
    return seconds, round(total), round(flops)


def count_case(case, rows: int, emulated) -> Counted:
    import traffic_cases
    from traffic_counters import AtenTraffic, EmulatorTraffic, TritonTraffic

    start = time.perf_counter()
    run = case.make(rows, emulated, "cpu")
    if run.reset:
        run.reset()
    counter = EmulatorTraffic(emulated) if case.counter == "emulator" else TritonTraffic()
    with counter, AtenTraffic() as around:
        result = run.ours()
    need = run.minimum(result)
    if len(counter.launches) != len(run.kernels):
        raise SystemExit(f"{case.name}: {len(counter.launches)} launches counted "
                         f"({[l.kernel for l in counter.launches]}), expected {run.kernels}")
    kernels = [(traffic_cases.kernel_key(launch, key), launch, need.kernels[key])
               for launch, key in zip(counter.launches, run.kernels)]
    if run.prepare_reference:
        run.prepare_reference()
    with AtenTraffic() as eager:
        run.reference()
    return Counted(rows, kernels, need.op, around.ops, eager.ops, time.perf_counter() - start)


def extrapolate(low: float, high: float, rows_low: int, rows_high: int, rows: int) -> float:
    """The value at ``rows`` of the line through (rows_low, low) and (rows_high, high)."""
    return low + (high - low) / (rows_high - rows_low) * (rows - rows_low)


KERNEL_FIELDS = ("unique_bytes", "unique_sector_bytes", "requested_bytes", "minimum_bytes", "sectors",
                 "ideal_sectors", "requests", "irregular_requests", "programs", "dram_bytes")


def kernel_numbers(key: str, launch, minimum_bytes: int) -> dict:
    import traffic_minimum as model

    requests = launch.requests
    return dict(unique_bytes=launch.unique_bytes, unique_sector_bytes=launch.unique_sector_bytes,
                requested_bytes=launch.requested_bytes, minimum_bytes=minimum_bytes, sectors=requests.sectors,
                ideal_sectors=requests.ideal_sectors, requests=requests.requests,
                irregular_requests=requests.irregular_requests, programs=launch.programs,
                dram_bytes=model.dram_bytes(launch, model.budget_for(key)))


def case_records(case, low: Counted, high: Counted) -> list[dict]:
    """Records of one case: one per kernel and one for the op, at the published shape."""
    import traffic_minimum as model

    def at_full(a, b):
        return max(0.0, extrapolate(a, b, low.rows, high.rows, case.full_rows))

    records = []
    kernel_seconds = 0.0
    for (key, launch_low, min_low), (_, launch_high, min_high) in zip(low.kernels, high.kernels):
        a, b = kernel_numbers(key, launch_low, min_low), kernel_numbers(key, launch_high, min_high)
        full = {name: at_full(a[name], b[name]) for name in KERNEL_FIELDS}
        budget = model.budget_for(key)
        over = [name for name, ratio, bound in (
            ("unique", full["unique_bytes"] / full["minimum_bytes"], budget.unique),
            ("requested", full["requested_bytes"] / full["minimum_bytes"], budget.requested),
            ("sectors", full["sectors"] / full["ideal_sectors"] if full["ideal_sectors"] else 1.0, budget.sectors))
            if ratio > bound]
        seconds = model.kernel_seconds(full["dram_bytes"])
        kernel_seconds += seconds
        records.append(dict(
            kind="kernel", case=case.name, op=case.op, kernel=key, counter=case.counter, shape=case.shape,
            rows_counted=[low.rows, high.rows], rows=case.full_rows, extrapolated=True,
            **{name: round(value) for name, value in full.items()},
            unique_over_minimum=full["unique_bytes"] / full["minimum_bytes"],
            requested_over_minimum=full["requested_bytes"] / full["minimum_bytes"],
            sectors_over_ideal=full["sectors"] / full["ideal_sectors"] if full["ideal_sectors"] else 1.0,
            sectors_per_request=full["sectors"] / full["requests"] if full["requests"] else 0.0,
            ideal_sectors_per_request=full["ideal_sectors"] / full["requests"] if full["requests"] else 0.0,
            dram_model=budget.dram, h200_model_us=seconds * 1e6, over_budget=over,
            budget=dict(unique=budget.unique, requested=budget.requested, sectors=budget.sectors,
                        why=budget.why)))
    torch_s, _, _ = ops_seconds(low.around, high.around, low.rows, high.rows, case.full_rows)
    eager_s, eager_bytes, eager_flops = ops_seconds(low.eager, high.eager, low.rows, high.rows, case.full_rows)
    ours_s = kernel_seconds + torch_s
    op_minimum = at_full(low.op_minimum, high.op_minimum)
    records.append(dict(
        kind="op", case=case.name, op=case.op, counter=case.counter, shape=case.shape,
        rows_counted=[low.rows, high.rows], rows=case.full_rows, extrapolated=True,
        minimum_bytes=round(op_minimum), minimum_model_us=model.kernel_seconds(op_minimum) * 1e6,
        kernels_model_us=kernel_seconds * 1e6, torch_ops_model_us=torch_s * 1e6, torch_ops=len(high.around),
        ours_model_us=ours_s * 1e6, eager_model_us=eager_s * 1e6, eager_ops=len(high.eager),
        eager_bytes=eager_bytes, eager_flops=eager_flops,
        predicted_speedup=eager_s / ours_s if ours_s else None,
        counting_s=low.seconds + high.seconds, **measured_cpu_speedup(case)))
    return records


# --- the measured CPU speed-ups (the op's benchmark records) --------------------------------


def measured_cpu_speedup(case) -> dict:
    """The speed-up of ours over eager on the CPU from the op's newest benchmark run
    (docs/results/records.jsonl): of the cases with both, those of the same direction
    (forward, or forward + backward for a backward case), then of the same dtype where
    any is, then the op-level ones (the selector's "op" rows), the largest of them."""
    try:
        records = [json.loads(line) for line in BENCH_RECORDS.read_text().splitlines() if line.strip()]
    except OSError:
        return dict(cpu_speedup=None, cpu_case=None)
    eager_impls = ("reference", "torch loop", "torch.topk", "eager")
    by_case: dict = {}
    for r in records:
        # CPU runs only (benchmarks/common.py names a CPU "<machine> (<n> threads)"): a GPU's
        # records sit in the same file.
        on_cpu = re.fullmatch(r".+ \(\d+ threads\)", r.get("device", "")) is not None
        if r.get("bench") == case.op and "timing" in r and on_cpu:
            by_case.setdefault(r["case"], {})[r["impl"]] = r["timing"]["median_ms"]
    names = [n for n, impls in by_case.items() if "ours" in impls and any(k in impls for k in eager_impls)]
    if case.op in ("conv", "selector", "head"):
        names = [n for n in names if ("fwd+bwd" in n) == ("backward" in case.name)]
    for words in ((("fp32", "float32"), ("bf16", "bfloat16")), (("greedy",), ("sampled",))):
        for group in words:
            others = [w for g in words if g is not group for w in g]
            if any(w in case.name for w in group):
                same = [n for n in names if any(w in n for w in group) and not any(w in n for w in others)]
                names = same or names
    if any(n.startswith("op ") for n in names):
        names = [n for n in names if n.startswith("op ")]
    if not names:
        return dict(cpu_speedup=None, cpu_case=None)
    name = max(names, key=lambda n: sum(int(v) for v in re.findall(r"\d+", n)))
    impls = by_case[name]
    eager = next(impls[k] for k in eager_impls if k in impls)
    return dict(cpu_speedup=eager / impls["ours"], cpu_case=f"{case.op}: {name}")


# --- output ------------------------------------------------------------------------------------


def _warp_sectors(r: dict) -> str:
    """Sectors per warp request (ideal): the emulator's requests are a warp's; the
    interpreter's are whole tiles, whose sectors per request say nothing of a warp."""
    if r["counter"] != "emulator":
        return "tiles"
    return f"{r['sectors_per_request']:.2f} ({r['ideal_sectors_per_request']:.2f})"


def _mb(value: float) -> str:
    return f"{value / 1e6:,.1f}"


def _us(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def markdown(records: list[dict], env: dict) -> str:
    import traffic_minimum as model

    kernels = [r for r in records if r["kind"] == "kernel"]
    ops = [r for r in records if r["kind"] == "op"]
    lines = [
        f"**A model, not a measurement.** Bytes counted on the CPU ({env['device']}, commit `{env['commit']}`, "
        f"{env['date'][:10]}): the CUDA kernels in the SIMT emulator, the Triton kernels in the interpreter, "
        f"every load and store; each case counted at two row counts and extrapolated linearly in rows to the "
        f"published shape (SPEC section 5, Qwen3.8-27B: H 5120, V 248,320, r 256, k 16). H200 time per kernel = "
        f"max(DRAM bytes / {model.HBM_BYTES_PER_S / 1e12:.1f} TB/s, FLOPs / peak, "
        f"{model.LAUNCH_FLOOR_S * 1e6:.0f} us); DRAM bytes = unique bytes in whole 32-byte sectors (re-reads "
        "served by the L2) unless the kernel's budget says its re-reads miss (then requested bytes). Regenerate: "
        "`.venv/bin/python benchmarks/traffic.py --doc docs/MODELS.md --save docs/results/traffic.jsonl`.",
        "",
        "| op (published shape) | kernel | counted at rows | unique / min | requested / min | sectors / ideal | "
        "warp sectors / request (ideal) | DRAM MB | H200 model us | budget |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in kernels:
        lines.append(
            f"| {r['case']} ({r['shape']}) | `{r['kernel']}` | {r['rows_counted'][0]}, {r['rows_counted'][1]} -> "
            f"{r['rows']} | {r['unique_over_minimum']:.3f} | {r['requested_over_minimum']:.2f} | "
            f"{r['sectors_over_ideal']:.3f} | {_warp_sectors(r)} | {_mb(r['dram_bytes'])} "
            f"({r['dram_model']}) | {_us(r['h200_model_us'])} | "
            f"{'over: ' + ', '.join(r['over_budget']) if r['over_budget'] else 'within'} |")
    lines += [
        "",
        "Budget: each kernel's bounds in benchmarks/traffic_minimum.py (1.15 x the minimum unless it says why it "
        "needs more), which CI holds at small shapes; here checked at the published shape.",
        "",
        "Per op: ours = its kernels plus the torch ops its launcher or binding runs around them; eager = the "
        "reference (dflash2_kernels/reference.py) on the same inputs, each aten op's inputs read and outputs "
        "written, at the same per-kernel model. An aten op counts as one pass: torch.topk and sort (radix passes) "
        "come out faster than they are, so the eager column is a lower bound. The head's rows exclude the GEMMs "
        "(the logits' cuBLAS products, on both sides). The CPU speed-up is measured: the op's benchmark at its "
        "largest matching case, named (other shapes; the head's includes the GEMMs).",
        "",
        "| op | minimum MB (model us) | ours model us (torch ops) | eager model us (ops) | predicted H200 "
        "speed-up | measured CPU speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in ops:
        cpu = f"{r['cpu_speedup']:.2f}x ({r['cpu_case']})" if r["cpu_speedup"] else "no record"
        lines.append(
            f"| {r['case']} | {_mb(r['minimum_bytes'])} ({_us(r['minimum_model_us'])}) | {_us(r['ours_model_us'])} "
            f"({_us(r['torch_ops_model_us'])}) | {_us(r['eager_model_us'])} ({r['eager_ops']}) | "
            f"{r['predicted_speedup']:.2f}x | {cpu} |")
    return "\n".join(lines)


def write_doc(path: Path, table: str) -> None:
    text = path.read_text()
    begin, end = "<!-- table: traffic -->", "<!-- end table -->"
    block = f"{begin}\n{table}\n{end}"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Memory traffic: a model of every GPU kernel on an H200\n\n" + block + "\n"
    path.write_text(text)


def print_table(records: list[dict]) -> None:
    print(f"{'case':40} {'kernel':46} {'uniq/min':>8} {'req/min':>8} {'sect/ideal':>10} {'warp sect/req':>14} "
          f"{'DRAM MB':>10} {'H200 us':>9}")
    for r in records:
        if r["kind"] == "kernel":
            print(f"{r['case']:40} {r['kernel']:46} {r['unique_over_minimum']:8.3f} {r['requested_over_minimum']:8.2f} "
                  f"{r['sectors_over_ideal']:10.3f} {_warp_sectors(r):>14} {_mb(r['dram_bytes']):>10} "
                  f"{_us(r['h200_model_us']):>9}")
    for r in records:
        if r["kind"] == "kernel" and r["over_budget"]:
            print(f"# over its budget at the published shape: {r['case']} {r['kernel']}: {', '.join(r['over_budget'])}")
    print()
    print(f"{'op':40} {'min us':>9} {'ours us':>9} {'eager us':>9} {'H200 x':>7} {'CPU x':>7}  counted in")
    for r in records:
        if r["kind"] == "op":
            cpu = f"{r['cpu_speedup']:7.2f}" if r["cpu_speedup"] else "      -"
            print(f"{r['case']:40} {_us(r['minimum_model_us']):>9} {_us(r['ours_model_us']):>9} "
                  f"{_us(r['eager_model_us']):>9} {r['predicted_speedup']:7.2f} {cpu}  {r['counting_s']:.0f} s")


# --- the GPU check: measured time beside the model --------------------------------------------


def gpu_check(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import traffic_cases
    import traffic_minimum
    from common import environment, time_side_by_side

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device visible (--device cpu runs the same path on the CPU's kernels)")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    env = environment(device)
    model = {}
    for line in MODEL_RECORDS.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            model[(r["case"], r.get("kernel"))] = r
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | commit {env['commit']}")
    print(f"# model: {MODEL_RECORDS.relative_to(REPO)} (commit {next(iter(model.values()))['commit']})")
    print(f"{'case':40} {'kernel':46} {'measured us':>12} {'model us':>9} {'measured/model':>15}")
    records = []
    for case in traffic_cases.CASES:
        if args.only and args.only not in case.name:
            continue
        rows = args.rows or case.full_rows
        run = case.make(rows, torch.ops.dflash2, device)
        reset = run.reset or (lambda: None)
        reset()
        run.ours()
        synchronize()
        if args.once:
            print(f"{case.name}: one call", flush=True)
            del run
            continue
        reps = 5
        with profile(activities=[activity]) as prof:
            for _ in range(reps):
                reset()
                run.ours()
            synchronize()
        device_us = {}
        for event in prof.key_averages():
            total = getattr(event, "device_time_total", 0) if device.type == "cuda" else event.cpu_time_total
            device_us[event.key] = total / reps
        timing = time_side_by_side({"ours": run.ours}, device, warmup=1, reps=10, budget_s=2.0, warmup_s=0.05,
                                   prepare={"ours": reset})["ours"]
        for key in dict.fromkeys(run.kernels):
            name = traffic_minimum.kernel_name(key)
            # Launches of one kernel (the selector's segmented sum and carry pass, once per
            # codebook) share their measured total.
            launches = sum(traffic_minimum.kernel_name(k) == name for k in run.kernels)
            measured = sum(us for event, us in device_us.items() if name in event) / launches
            predicted = model.get((case.name, key), {}).get("h200_model_us")
            records.append(dict(kind="kernel", case=case.name, kernel=key, measured_us=measured,
                                h200_model_us=predicted, **env))
            ratio = f"{measured / predicted:15.2f}" if predicted else f"{'-':>15}"
            print(f"{case.name:40} {key:46} {measured:12.1f} {predicted or 0:9.1f} {ratio}")
        op = model.get((case.name, None), {})
        records.append(dict(kind="op", case=case.name, measured_us=timing.median_ms * 1e3,
                            device_us=None if timing.device_ms is None else timing.device_ms * 1e3,
                            ours_model_us=op.get("ours_model_us"), **env))
        print(f"{case.name:40} {'(the whole op)':46} {timing.median_ms * 1e3:12.1f} "
              f"{op.get('ours_model_us') or 0:9.1f}")
        del run
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="only the cases whose name contains this text")
    parser.add_argument("--out", help="append the JSON records here")
    parser.add_argument("--doc", help="write the tables into this markdown file (<!-- table: traffic --> block)")
    parser.add_argument("--save", help="write the records here (replacing it): the model the GPU check reads")
    parser.add_argument("--gpu", action="store_true", help="on a GPU: time each kernel beside the committed model")
    parser.add_argument("--device", default="cuda", help="--gpu's device (cpu: a dry run of the path)")
    parser.add_argument("--rows", type=int, help="--gpu: rows (sequences) instead of the published shape's")
    parser.add_argument("--once", action="store_true",
                        help="--gpu: one call of each case, nothing timed (under ncu or compute-sanitizer)")
    args = parser.parse_args()
    if args.gpu:
        gpu_check(args)
        return
    if not os.environ.get(CHILD_FLAG):
        restart_with_emulator()

    import torch

    import traffic_cases
    import traffic_minimum as model
    from common import environment

    torch.ops.load_library(os.environ["DFLASH2_EMULATED_LIB"])
    emulated = torch.ops.dflash2_emulated
    env = environment(torch.device("cpu"))
    env["note"] = model.MODEL_NOTE
    env["load"] = round(os.getloadavg()[0], 1)  # counts do not depend on it; the counting time does
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | commit {env['commit']} | "
          f"load {env['load']}")
    records = []
    for case in traffic_cases.CASES:
        if args.only and args.only not in case.name:
            continue
        counted = [count_case(case, rows, emulated) for rows in case.scaled_rows]
        for record in case_records(case, *counted):
            records.append({"bench": "traffic", **env, **record})
        print(f"# {case.name}: counted at {case.scaled_rows} rows in {sum(c.seconds for c in counted):.0f} s",
              flush=True)
    print()
    print_table(records)
    calls = []
    if not args.only:
        # The whole calls beside the kernels: every public op on fake CUDA tensors (launches,
        # syncs, bytes over planes, GEMM FLOPs, peak; benchmarks/whole_call.py), counted
        # before anything is written (the records name a clean commit).
        import whole_call

        print()
        calls = whole_call.model_rows()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in records + calls:
                f.write(json.dumps(r) + "\n")
    if args.save:
        Path(args.save).write_text("".join(json.dumps(r) + "\n" for r in records))
        if calls:
            Path(args.save).with_name("whole_call.jsonl").write_text("".join(json.dumps(r) + "\n" for r in calls))
    if args.doc:
        write_doc(Path(args.doc), markdown(records, env))
        if calls:
            whole_call.write_tables(Path(args.doc), calls)

if __name__ == "__main__":
    main()
