"""Where one call's time goes: torch.profiler over a few calls of a benchmark case.

``profile_calls(fn, device)`` runs ``fn()`` a few times under torch.profiler, each call
inside a ``record_function`` range (the host's time until the call returns) nested in a
second range that also holds the device synchronisation (the call as eager sees it). On
CUDA every device activity (kernel, memcpy, memset) that starts inside the outer range
belongs to the call; the L2 flush that the caller may run between calls lies outside it.
The result, per call:

- ``call_ms``: wall time of the call and its synchronisation; ``host_ms``: until it
  returned (Python, dispatch, launches);
- ``device_ms``: the sum of the call's device activities' durations;
- ``gpu_idle_ms``: from the call's start to its last device activity's end, the time no
  device activity ran (the device waiting for the host: launch latency and gaps);
- ``kernels``: per name, launches, device ms and its group: ``ours`` (this package's
  Triton and CUDA kernels), ``cublas`` (GEMMs) or ``aten`` (copies, casts, elementwise,
  reductions: everything else).

On the CPU (the dry run of scripts/gpu_check.sh) there are no device activities: the
"kernels" are the torch ops run inside the call, each with its self CPU time, grouped as
``ours`` (``dflash2::`` ops), ``blas`` (matrix products) or ``aten``; ``device_ms`` is
their sum.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CALL_RANGE = "dflash2_bench::call"
SYNCED_RANGE = "dflash2_bench::call_synced"

# cuBLAS, cuBLASLt and CUTLASS kernels as the profiler names them on sm_80..sm_120.
_GEMM_NAME = re.compile(r"gemm|gemv|cublas|cutlass|nvjet|xmma|splitkreduce|s\d{3,4}gemm", re.IGNORECASE)
_BLAS_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::addmv", "aten::mv"}


@functools.cache
def our_kernel_names() -> frozenset[str]:
    """Names of this package's device kernels: every Triton kernel (a ``def ..._kernel``
    under ``@triton.jit``) and every CUDA ``__global__`` function, read from the sources."""
    names: set[str] = set()
    for path in (REPO / "dflash2_kernels").rglob("*.py"):
        names.update(re.findall(r"@triton\.jit\s*(?:\([^)]*\))?\s*def\s+(\w+)\s*\(", path.read_text()))
    for path in (REPO / "csrc").rglob("*.cu"):
        names.update(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", path.read_text()))
    return frozenset(n for n in names if n.endswith("_kernel"))


def kernel_group(name: str) -> str:
    """``ours``, ``cublas`` or ``aten`` for a device kernel's name as the profiler gives it
    (a Triton kernel's function name; a CUDA kernel's demangled signature)."""
    words = set(re.findall(r"\w+", name))
    if words & our_kernel_names():
        return "ours"
    return "cublas" if _GEMM_NAME.search(name) else "aten"


def cpu_op_group(name: str) -> str:
    """``ours``, ``blas`` or ``aten`` for a torch op run on the CPU."""
    if name.startswith("dflash2::"):
        return "ours"
    return "blas" if name in _BLAS_OPS else "aten"


@dataclass
class KernelTime:
    name: str
    group: str
    launches: int  # over all profiled calls
    device_ms: float  # per call


@dataclass
class CallProfile:
    calls: int
    call_ms: float  # medians over the profiled calls
    host_ms: float
    device_ms: float
    gpu_idle_ms: float | None  # None on the CPU
    launches_per_call: float
    groups_ms: dict[str, float]  # per call, means over the profiled calls (the times above: medians)
    kernels: list[KernelTime] = field(default_factory=list)

    def record(self, top: int = 12) -> dict:
        """JSON-ready, the ``top`` kernels by device time (the rest summed into one entry)."""
        kept = sorted(self.kernels, key=lambda k: -k.device_ms)
        rest = kept[top:]
        entries = [asdict(k) for k in kept[:top]]
        if rest:
            entries.append({"name": f"({len(rest)} more)", "group": "", "launches": sum(k.launches for k in rest),
                            "device_ms": sum(k.device_ms for k in rest)})
        out = asdict(self)
        out["kernels"] = entries
        return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _subtree(event) -> list:
    found, stack = [], list(event.cpu_children)
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(child.cpu_children)
    return found


def _is_device(event) -> bool:
    """A device activity (kernel, memcpy, memset), not the device side of a user range."""
    return event.device_type != torch.autograd.DeviceType.CPU and not getattr(event, "is_user_annotation", False)


def profile_calls(fn, device: torch.device, *, calls: int = 3, before_each=None) -> CallProfile:
    """``calls`` profiled calls of ``fn()`` (after the caller's warm-up); ``before_each``
    (optional) runs before each call, outside the ranges (an L2 flush)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            if before_each is not None:
                before_each()
                sync()
            with record_function(SYNCED_RANGE):
                with record_function(CALL_RANGE):
                    fn()
                sync()
    return summarize(list(prof.events()), calls, cuda)


def summarize(events: list, calls: int, cuda: bool) -> CallProfile:
    """The CallProfile of ``calls`` profiled calls from the profiler's events
    (``torch.autograd.profiler_util.FunctionEvent``: name, device_type, time_range,
    cpu_children, self_cpu_time_total, is_user_annotation)."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    synced = sorted((e for e in cpu if e.name == SYNCED_RANGE), key=lambda e: e.time_range.start)
    inner = sorted((e for e in cpu if e.name == CALL_RANGE), key=lambda e: e.time_range.start)
    if len(synced) != calls or len(inner) != calls:
        raise RuntimeError(f"profile_calls: found {len(synced)} and {len(inner)} ranges for {calls} calls")
    device_events = sorted((e for e in events if _is_device(e)), key=lambda e: e.time_range.start)

    per_kernel: dict[str, list] = {}
    call_ms, host_ms, device_ms, idle_ms, launches = [], [], [], [], []
    for outer, call in zip(synced, inner):
        call_ms.append(outer.time_range.elapsed_us() / 1e3)
        host_ms.append(call.time_range.elapsed_us() / 1e3)
        if cuda:
            mine = [e for e in device_events if outer.time_range.start <= e.time_range.start <= outer.time_range.end]
            items = [(e.name, kernel_group(e.name), e.time_range.elapsed_us()) for e in mine]
            idle_ms.append(_idle_us(mine, call.time_range.start) / 1e3)
        else:
            items = [(e.name, cpu_op_group(e.name), e.self_cpu_time_total) for e in _subtree(call)
                     if e.self_cpu_time_total > 0]
        launches.append(len(items))
        device_ms.append(sum(us for _, _, us in items) / 1e3)
        for name, group, us in items:
            entry = per_kernel.setdefault(name, [group, 0, 0.0])
            entry[1] += 1
            entry[2] += us
    kernels = [KernelTime(name, group, count, total_us / 1e3 / calls)
               for name, (group, count, total_us) in per_kernel.items()]
    groups: dict[str, float] = {}
    for k in kernels:
        groups[k.group] = groups.get(k.group, 0.0) + k.device_ms
    return CallProfile(calls=calls, call_ms=_median(call_ms), host_ms=_median(host_ms), device_ms=_median(device_ms),
                       gpu_idle_ms=_median(idle_ms) if cuda else None, launches_per_call=sum(launches) / calls,
                       groups_ms=groups, kernels=kernels)


def _idle_us(activities: list, call_start_us: float) -> float:
    """From ``call_start_us`` to the last activity's end, the time covered by none."""
    if not activities:
        return 0.0
    busy, reach = 0.0, call_start_us
    for e in activities:
        start, end = max(e.time_range.start, reach), e.time_range.end
        if end > start:
            busy += end - start
            reach = end
    return max(reach - call_start_us - busy, 0.0)
