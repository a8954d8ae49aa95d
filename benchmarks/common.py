"""Timing, roofline and reporting shared by the benchmarks.

Times are per call: median, p20 and p80 over repetitions. On CUDA each repetition is
timed with events after the L2 cache is flushed (so a 40 MB operand is not served
from a 50 MB L2); on CPU with ``time.perf_counter``. The roofline is the device's
copy bandwidth, measured in the same run: bytes read + written by a large
``Tensor.copy_``, per second.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import dflash2_kernels

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _summary(samples_ms: list[float]) -> Timing:
    return Timing(statistics.median(samples_ms), _quantile(samples_ms, 0.2), _quantile(samples_ms, 0.8))


def _warm_up(fn, warmup: int, warmup_s: float) -> None:
    """``warmup`` calls and at least ``warmup_s`` seconds: a process's first calls also
    grow the allocator's heap and start the thread pool, page faults and all."""
    warmup_end = time.perf_counter() + warmup_s
    for _ in range(max(warmup, 1)):
        fn()
    while time.perf_counter() < warmup_end:
        fn()


class _CallTimer:
    """Milliseconds of one call: on CUDA with events, after flushing the L2 cache."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None
        if self.flush is not None:
            torch.cuda.synchronize(device)

    def __call__(self, fn) -> float:
        if self.flush is None:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def time_fn(fn, device: torch.device, *, warmup: int = 3, reps: int = 20, budget_s: float = 10.0,
            warmup_s: float = 0.25) -> Timing:
    """Per-call time of ``fn()``, after a warm-up (``_warm_up``); stops early once
    ``budget_s`` seconds are spent."""
    return time_side_by_side({"fn": fn}, device, warmup=warmup, reps=reps, budget_s=budget_s,
                             warmup_s=warmup_s)["fn"]


def time_side_by_side(fns: dict, device: torch.device, *, warmup: int = 3, reps: int = 20, budget_s: float = 30.0,
                      warmup_s: float = 0.25, prepare: dict | None = None) -> dict:
    """Per-call times of a case's implementations ({name: fn} to {name: Timing}), taken
    in turns: each repetition calls every function once, in order, so that a change of
    load on a shared machine lands on all of them alike instead of on whichever was
    running (this project's CPU VMs moved one row by up to 2x within minutes). Each is
    warmed up first; stops early once ``budget_s`` seconds are spent. ``prepare``
    ({name: callable}, optional) runs untimed before each of that name's warm-ups and
    calls (bench_step.py: put a shared model in that side's state)."""
    prepare = prepare or {}
    untimed = lambda name: prepare.get(name, lambda: None)()  # noqa: E731
    for name, fn in fns.items():
        untimed(name)
        _warm_up(fn, warmup, warmup_s)
    timer = _CallTimer(device)
    samples: dict = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s
    for rep in range(reps):
        for name, fn in fns.items():
            untimed(name)
            samples[name].append(timer(fn))
        if time.perf_counter() > deadline and rep >= 2:
            break
    return {name: _summary(values) for name, values in samples.items()}


def device_kernel_ms(fn, device: torch.device, calls: int = 3) -> float | None:
    """Per call of ``fn()``, the device time of the work it launches: the sum of its kernels'
    (and memory copies' and sets') durations as torch.profiler records them, whatever time
    the host adds around them (launch overheads, syncs, gaps). None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    total_us = 0.0
    for event in prof.key_averages():
        total_us += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return total_us / 1e3 / calls


def time_cuda_graph(fn, device: torch.device, *, calls_per_graph: int = 20, reps: int = 50) -> Timing:
    """Per-call time of ``fn()`` replayed from a CUDA graph of ``calls_per_graph`` calls."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls_per_graph)
    return _summary(samples)


def settled_peak_bytes(fn, device: torch.device) -> int | None:
    """peak_extra_bytes of one more call of ``fn``, after one unmeasured call (first calls
    compile, or allocate what later calls reuse) and, on the CPU, with freed heap memory
    handed back to the OS first."""
    fn()
    gc.collect()
    if device.type == "cpu":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    return peak_extra_bytes(fn, device)


def peak_extra_bytes(fn, device: torch.device) -> int | None:
    """Peak memory ``fn()`` needs beyond what was allocated before it: the CUDA caching
    allocator's peak on GPU; on Linux CPUs the process's peak resident set (reset
    through /proc/self/clear_refs), after the C++ ops' kept results are released
    (dflash2_kernels.empty_cpu_cache), so that every result ours needs counts as new
    memory. None where neither is available."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    dflash2_kernels.empty_cpu_cache()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - before) * 1024
    except OSError:
        return None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    numel = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(numel, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device, warmup=3, reps=20)
    return 2 * numel / (timing.median_ms * 1e-3) / 1e9


def git_commit() -> str:
    if os.environ.get("DFLASH2_COMMIT"):
        return os.environ["DFLASH2_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(),
    }


@dataclass
class Run:
    """What every benchmark starts from: its options, the device, provenance, roofline."""

    args: argparse.Namespace
    device: torch.device
    env: dict
    copy_gbps: float


def start_run(description: str, quick_help: str) -> Run:
    """Parse the shared options, pick the device, measure its copy bandwidth, print the header."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="append JSON records here")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    copy_gbps = copy_bandwidth_gbps(device)
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | commit {env['commit']}")
    print(f"# copy bandwidth (read + write): {copy_gbps:.1f} GB/s")
    return Run(args, device, env, copy_gbps)


@dataclass
class Row:
    """One measured (case, implementation) pair."""

    bench: str
    case: str
    impl: str
    timing: Timing
    bytes: int
    copy_gbps: float
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / (self.timing.median_ms * 1e-3) / 1e9

    def record(self, env: dict) -> dict:
        return {**env, **asdict(self), "gbps": self.gbps, "pct_copy_bw": 100 * self.gbps / self.copy_gbps}


FLOOR_IMPL = "floor"


def print_table(rows: list[Row], baseline_impl: str = "ours") -> None:
    """A fixed-width table; speedups are the baseline's against each other implementation.
    Rows carrying ``extra['peak_extra_mib']`` get a memory column; rows of the shared
    floor (impl ``floor``: the work every implementation must do, timed alone) get ours
    as a percent of it."""
    ours = {r.case: r for r in rows if r.impl == baseline_impl}
    with_memory = any("peak_extra_mib" in r.extra for r in rows)
    with_floor = any(r.impl == FLOOR_IMPL for r in rows)
    header = f"{'case':58} {'impl':18} {'median ms':>10} {'p20 ms':>9} {'p80 ms':>9} {'GB/s':>8} {'%copy':>6} {'ours x':>7}"
    header += f" {'peak MiB':>9}" if with_memory else ""
    header += f" {'ours %floor':>11}" if with_floor else ""
    print(header)
    print("-" * len(header))
    first_seen = {case: i for i, case in reversed(list(enumerate(r.case for r in rows)))}
    for r in sorted(rows, key=lambda r: first_seen[r.case]):  # stable: each case's rows together
        base = ours.get(r.case)
        speedup = f"{r.timing.median_ms / base.timing.median_ms:7.2f}" if base and r is not base else "       "
        line = (
            f"{r.case:58} {r.impl:18} {r.timing.median_ms:10.4f} {r.timing.p20_ms:9.4f} {r.timing.p80_ms:9.4f} "
            f"{r.gbps:8.1f} {100 * r.gbps / r.copy_gbps:6.1f} {speedup}"
        )
        if with_memory:
            peak = r.extra.get("peak_extra_mib")
            line += f" {peak:9.1f}" if peak is not None else f" {'-':>9}"
        if with_floor and r.impl == FLOOR_IMPL and base:
            line += f" {100 * base.timing.median_ms / r.timing.median_ms:10.0f}%"
        print(line)


def write_records(rows: list[Row], env: dict, path: str | None) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r.record(env)) + "\n")
