"""Timing, roofline and reporting shared by the benchmarks.

Each case's implementation gets three times per call (``Timing``):

- call time (median, p20, p80 over repetitions): the wall time of the call and a device
  synchronisation, as eager code sees it; on CUDA each repetition starts after the L2
  cache is flushed (so a 40 MB operand is not served from a 50 MB L2) and synchronised;
- host time: until the call returned (Python, dispatch, launches), the host's share;
- device time, on CUDA: from a CUDA-graph replay of the call where the benchmark says it
  captures (``time_side_by_side(graph=...)``), else the sum of its kernels' durations in a
  torch.profiler profile (``call_profile.profile_calls``); percent of the copy bandwidth
  and of the floor come from it.

With ``--profile PATH`` a benchmark also writes each case's per-kernel profile (ours /
cuBLAS / other aten kernels, launches, host time, the device's idle time) to PATH
(benchmarks/profile_report.py makes the tables); ``--max-reps N`` caps the repetitions
(the CPU dry run of scripts/gpu_check.sh). The roofline is the device's
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
    """Per call, in ms: the call time's median and quantiles, the host's share, the
    device's time and how it was taken ("graph" or "profiler"; None off CUDA), and the
    per-kernel profile (``call_profile.CallProfile.record``) where one was taken."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    host_ms: float | None = None
    device_ms: float | None = None
    device_method: str | None = None
    profile: dict | None = field(default=None, repr=False)

    @property
    def work_ms(self) -> float:
        """The device time where measured, else the call time: what bandwidth and floor
        ratios divide by."""
        return self.device_ms if self.device_ms is not None else self.median_ms


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _summary(samples_ms: list[float], host_ms: list[float] | None = None) -> Timing:
    return Timing(statistics.median(samples_ms), _quantile(samples_ms, 0.2), _quantile(samples_ms, 0.8),
                  host_ms=statistics.median(host_ms) if host_ms else None)


def _warm_up(fn, warmup: int, warmup_s: float) -> None:
    """``warmup`` calls and at least ``warmup_s`` seconds: a process's first calls also
    grow the allocator's heap and start the thread pool, page faults and all."""
    warmup_end = time.perf_counter() + warmup_s
    for _ in range(max(warmup, 1)):
        fn()
    while time.perf_counter() < warmup_end:
        fn()


class _CallTimer:
    """One call's wall time and its host share (ms): on CUDA after flushing the L2 cache,
    from a synchronised start to the synchronisation after the call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None
        if self.flush is not None:
            torch.cuda.synchronize(device)

    def flush_l2(self) -> None:
        if self.flush is not None:
            self.flush.zero_()

    def __call__(self, fn) -> tuple[float, float]:
        if self.flush is not None:
            self.flush.zero_()
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        if self.flush is not None:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        return (end - start) * 1e3, (returned - start) * 1e3


# Set by start_run: --profile PATH keeps each case's per-kernel profile (Timing.profile),
# appended to PATH by write_records; --max-reps N caps every timing's repetitions (and its
# warm-up at one call): a dry run's time.
PROFILE_OUT: str | None = None
MAX_REPS: int | None = None
_PROFILED_CALLS = 3


def time_fn(fn, device: torch.device, *, warmup: int = 3, reps: int = 20, budget_s: float = 10.0,
            warmup_s: float = 0.25, graph: bool = False) -> Timing:
    """Per-call time of ``fn()``, after a warm-up (``_warm_up``); stops early once
    ``budget_s`` seconds are spent."""
    return time_side_by_side({"fn": fn}, device, warmup=warmup, reps=reps, budget_s=budget_s,
                             warmup_s=warmup_s, graph=graph)["fn"]


def time_side_by_side(fns: dict, device: torch.device, *, warmup: int = 3, reps: int = 20, budget_s: float = 30.0,
                      warmup_s: float = 0.25, prepare: dict | None = None, graph=False) -> dict:
    """Per-call times of a case's implementations ({name: fn} to {name: Timing}), taken
    in turns: each repetition calls every function once, in order, so that a change of
    load on a shared machine lands on all of them alike instead of on whichever was
    running (this project's CPU VMs moved one row by up to 2x within minutes). Each is
    warmed up first; stops early once ``budget_s`` seconds are spent. ``prepare``
    ({name: callable}, optional) runs untimed before each of that name's warm-ups and
    calls (bench_step.py: put a shared model in that side's state).

    On CUDA each also gets its device time: replayed from a
    CUDA graph where ``graph`` allows (True, or a collection of names: calls that capture,
    with no host sync and no state that a replay would not update), else from a
    torch.profiler profile of a few calls. Under --profile (``PROFILE_OUT``) every
    implementation is profiled, on the CPU too."""
    profiling = PROFILE_OUT is not None
    prepare = prepare or {}
    untimed = lambda name: prepare.get(name, lambda: None)()  # noqa: E731
    if MAX_REPS is not None:
        warmup, reps, warmup_s = min(warmup, 1), min(reps, MAX_REPS), 0.0
    for name, fn in fns.items():
        untimed(name)
        _warm_up(fn, warmup, warmup_s)
    timer = _CallTimer(device)
    samples: dict = {name: [] for name in fns}
    host: dict = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s
    for rep in range(reps):
        for name, fn in fns.items():
            untimed(name)
            call_ms, host_ms = timer(fn)
            samples[name].append(call_ms)
            host[name].append(host_ms)
        if time.perf_counter() > deadline and rep >= 2:
            break
    timings = {name: _summary(samples[name], host[name]) for name in fns}
    if device.type == "cuda" or profiling:
        for name, fn in fns.items():
            _device_time(timings[name], fn, device, timer, lambda: untimed(name),
                         graph is True or (graph is not False and name in graph))
    return timings


def _device_time(timing: Timing, fn, device: torch.device, timer: _CallTimer, prepare, graph: bool) -> None:
    """Fill ``timing``'s device time (and its profile under --profile)."""
    from call_profile import profile_calls

    prepare()
    profile = profile_calls(fn, device, calls=_PROFILED_CALLS, before_each=timer.flush_l2)
    if PROFILE_OUT is not None:
        timing.profile = profile.record()
    if device.type != "cuda":
        return
    timing.device_ms, timing.device_method = profile.device_ms, "profiler"
    if graph:
        try:
            replayed = time_cuda_graph(fn, device, expected_ms=timing.median_ms)
        except Exception:  # noqa: BLE001  (a call that syncs or draws from an uncapturable generator)
            torch.cuda.synchronize(device)
        else:
            timing.device_ms, timing.device_method = replayed.median_ms, "graph"


def time_cuda_graph(fn, device: torch.device, *, calls_per_graph: int | None = None, reps: int | None = None,
                    expected_ms: float | None = None) -> Timing:
    """Per-call time of ``fn()`` replayed from a CUDA graph of ``calls_per_graph`` calls
    (default: enough for ~1 ms a replay, at most 20, from ``expected_ms``, a call's time),
    ``reps`` replays (default: ~0.3 s of them, 5 to 50)."""
    expected_ms = max(expected_ms or 0.05, 1e-3)
    if calls_per_graph is None:
        calls_per_graph = max(1, min(20, round(1.0 / expected_ms)))
    if reps is None:
        reps = max(5, min(50, round(300.0 / (expected_ms * calls_per_graph))))
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
    parser.add_argument("--profile", metavar="PATH", help="append each case's per-kernel profile here (torch.profiler)")
    parser.add_argument("--max-reps", type=int, metavar="N", help="at most N timed repetitions a case (a dry run)")
    args = parser.parse_args()
    if args.max_reps is not None and args.max_reps < 1:
        parser.error(f"--max-reps: expected at least 1, got {args.max_reps}")
    global PROFILE_OUT, MAX_REPS
    PROFILE_OUT, MAX_REPS = args.profile, args.max_reps
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
        """Minimal bytes over the device time (the call time where none was measured)."""
        return self.bytes / (self.timing.work_ms * 1e-3) / 1e9

    def record(self, env: dict) -> dict:
        record = {**env, **asdict(self), "gbps": self.gbps, "pct_copy_bw": 100 * self.gbps / self.copy_gbps}
        record["timing"].pop("profile")
        return record

    def profile_record(self, env: dict) -> dict | None:
        """The per-kernel profile beside the row's three times, or None where none was taken."""
        t = self.timing
        if t.profile is None:
            return None
        return {**env, "bench": self.bench, "case": self.case, "impl": self.impl, "call_ms": t.median_ms,
                "host_ms": t.host_ms, "device_ms": t.device_ms, "device_method": t.device_method,
                "profile": t.profile}


FLOOR_IMPL = "floor"


def print_table(rows: list[Row], baseline_impl: str = "ours") -> None:
    """A fixed-width table; speedups (call time) are the baseline's against each other
    implementation. Rows with a device time get host and device columns (GB/s and %copy
    are then the device's); rows carrying ``extra['peak_extra_mib']`` get a memory column;
    rows of the shared floor (impl ``floor``: the work every implementation must do,
    timed alone) get ours as a percent of it (device times where both have one)."""
    ours = {r.case: r for r in rows if r.impl == baseline_impl}
    with_device = any(r.timing.device_ms is not None for r in rows)
    with_memory = any("peak_extra_mib" in r.extra for r in rows)
    with_floor = any(r.impl == FLOOR_IMPL for r in rows)
    header = f"{'case':58} {'impl':18} {'median ms':>10} {'p20 ms':>9} {'p80 ms':>9}"
    header += f" {'host ms':>9} {'device ms':>10} {'how':>5}" if with_device else ""
    header += f" {'GB/s':>8} {'%copy':>6} {'ours x':>7}"
    header += f" {'peak MiB':>9}" if with_memory else ""
    header += f" {'ours %floor':>11}" if with_floor else ""
    print(header)
    print("-" * len(header))
    first_seen = {case: i for i, case in reversed(list(enumerate(r.case for r in rows)))}
    for r in sorted(rows, key=lambda r: first_seen[r.case]):  # stable: each case's rows together
        base = ours.get(r.case)
        t = r.timing
        speedup = f"{t.median_ms / base.timing.median_ms:7.2f}" if base and r is not base else "       "
        line = f"{r.case:58} {r.impl:18} {t.median_ms:10.4f} {t.p20_ms:9.4f} {t.p80_ms:9.4f}"
        if with_device:
            line += f" {_cell(t.host_ms, 9)} {_cell(t.device_ms, 10)} {(t.device_method or '-')[:5]:>5}"
        line += f" {r.gbps:8.1f} {100 * r.gbps / r.copy_gbps:6.1f} {speedup}"
        if with_memory:
            line += f" {_cell(r.extra.get('peak_extra_mib'), 9, 1)}"
        if with_floor and r.impl == FLOOR_IMPL and base:
            both = t.device_ms is not None and base.timing.device_ms is not None
            ratio = base.timing.work_ms / t.work_ms if both else base.timing.median_ms / t.median_ms
            line += f" {100 * ratio:10.0f}%"
        print(line)


def _cell(value: float | None, width: int, digits: int = 4) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def write_records(rows: list[Row], env: dict, path: str | None) -> None:
    """Append the rows' records to ``path`` and, under --profile, their profiles to its PATH."""
    targets = [(path, [r.record(env) for r in rows])]
    if PROFILE_OUT is not None:
        targets.append((PROFILE_OUT, [p for r in rows if (p := r.profile_record(env)) is not None]))
    for target, records in targets:
        if not target:
            continue
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
