"""Run code on fake CUDA tensors and count what one call costs on a GPU, with no GPU.

    with FakeCuda():                              # fake CUDA tensors; nothing needs a driver
        x = torch.empty(4096, 5120, device="cuda", dtype=torch.bfloat16)
        with CallCounter(plane=lambda t: ...) as count:
            y = dk.grouped_dynamic_conv(...)
        with CallCounter() as grad:
            torch.autograd.backward(y, dy)
    count.launches, count.syncs, count.peak_bytes, count.device_seconds, count.summary()

(``CallCounter`` alone enters a ``FakeCuda`` of its own for its block.)

:class:`FakeCuda` enters ``FakeTensorMode``, so ``device="cuda"`` makes fake tensors
(shapes, strides, dtypes; no data), stubs what needs a driver (``torch.cuda``'s device
properties of an H200, device guards, memory info, stream capture), gives each fake
storage its own ``data_ptr`` (aliasing checks compare them), tells code that asks
``isinstance(t, torch._subclasses.FakeTensor)`` that no tensor is fake (so it reads
values where it would on a GPU: counted syncs), sets ``DFLASH2_BACKEND=auto`` (a GPU's
default path), stops every Triton launch of the package (all go through
``conv.launch.KernelLaunch.run``) and runs ``torch.autograd.backward`` node by node
(benchmarks/fake_autograd.py: torch's engine cannot run fake CUDA graphs without a
driver). Everything is restored on exit.

:class:`CallCounter` pushes a dispatch mode above the fake mode that sees every op:

- an aten op on CUDA tensors is one device launch: its bytes as
  traffic_counters.aten_op counts them (inputs read, outputs written), the FLOPs of
  matrix products (mm, addmm, bmm, baddbmm, addbmm and their ``out_dtype`` overloads).
  Views, allocations and metadata-only ops launch nothing;
- a Triton launch of ours is recorded (kernel, programs, constexprs, arguments) and not
  run; its bytes come from benchmarks/whole_call_kernels.py;
- a ``torch.library.custom_op`` of ours (``dflash2::...`` defined in Python) runs its
  real Python implementation with the mode active, so its inner ops and launches count;
  a C++ op of ours is not run (no GPU): it is recorded as the launches its CUDA binding
  makes (whole_call_kernels.CUDA_OPS) and returns its fake implementation's outputs;
- host syncs: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``; ``.tolist()``
  of n elements is n of them here, one copy on a GPU) answered with 0 of its dtype
  without calling down; blocking copies between the CPU and the GPU; data-dependent
  output ops (nonzero, masked_select, unique, repeat_interleave without output_size,
  indexing with a boolean mask), which answer with their largest output;
- the peak of live bytes of CUDA storages allocated inside the block (each storage's
  size, freed when torch frees it; the caching allocator's rounding is not modelled).

The H200 time is a model, not a measurement: per launch
traffic_minimum.kernel_seconds(bytes, FLOPs, dtype) summed (the device's time); the host
floor is launches x HOST_LAUNCH_S + syncs x HOST_SYNC_S (assumed, see below). An aten op
counts as one launch (a GPU sort or top-k runs several kernels).
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensor, FakeTensorMode)
from torch.utils._python_dispatch import TorchDispatchMode

import fake_autograd
import traffic_minimum
import whole_call_kernels
from traffic_counters import aten_op, tensor_bytes

REPO = Path(__file__).resolve().parents[1]

# Host cost of one launch from Python: DESIGN.md's published figures are 5-10 us for an
# aten op, 6-27 us for a Triton launch, 3-5 us for CompiledKernel.run itself: 5 us is a floor.
HOST_LAUNCH_S = 5e-6
# A host sync: a device-to-host copy of a few bytes and the stream drained: assumed, not measured.
HOST_SYNC_S = 10e-6

H200 = SimpleNamespace(
    name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=150_121_152_512,
    warp_size=32, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232_448, L2_cache_size=50 * 2**20, is_integrated=False, is_multi_gpu_board=False,
)

# Ops that launch nothing (beyond traffic_counters' allocations and metadata): views that
# carry no alias annotation, and in-place metadata changes.
_METADATA_ONLY = {"_unsafe_view", "as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_", "detach_",
                  "swapdims_", "swapaxes_", "resize_as_", "_resize_output_", "record_stream", "_reshape_alias"}
_GEMM_OPERANDS = {"mm": ("self", "mat2"), "addmm": ("mat1", "mat2"), "bmm": ("self", "mat2"),
                  "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"), "_scaled_mm": ("self", "mat2")}
_COPIES = {"_to_copy", "copy_", "copy"}

_ACTIVE: list["FakeCuda"] = []


# --- what a call launched -----------------------------------------------------------------


@dataclass
class Launch:
    """One device launch: ``kind`` "triton" or "cuda" (ours) or "aten" (torch's kernels,
    including those our C++ bindings call: ``inside`` names the op then)."""

    kind: str
    name: str
    read_bytes: int
    write_bytes: int
    flops: int = 0
    dtype: torch.dtype | None = None
    modelled: bool = True  # False: bytes = every tensor argument read once (no model of the kernel)
    plane: bool = False  # touched a tensor the counter's plane predicate picks
    inside: str = ""  # the op of ours whose binding launched it
    site: str = ""  # where in the Python code (for plane ops)
    detail: dict = field(default_factory=dict)  # Triton: programs, constexprs, arguments

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def seconds(self) -> float:
        """The model's H200 time of this launch."""
        return traffic_minimum.kernel_seconds(self.bytes, self.flops, self.dtype or torch.float32)


@dataclass
class Sync:
    """One host sync: ``what`` caused it, ``site`` where (innermost frames of the repo's code)."""

    what: str
    site: str
    after: int  # launches before it


@dataclass
class CallCount:
    """What one block of code launched on the (fake) GPU."""

    launches: list = field(default_factory=list)
    syncs: list = field(default_factory=list)
    data_dependent: list = field(default_factory=list)  # op names whose output size depends on data
    peak_bytes: int = 0
    cpu_ops: int = 0  # aten ops on CPU tensors only (host work, not launches)
    other_ops: list = field(default_factory=list)  # ops of other namespaces, passed through uncounted
    host_launch_s: float = HOST_LAUNCH_S
    host_sync_s: float = HOST_SYNC_S

    def by_kind(self) -> dict:
        counts = {"triton": 0, "cuda": 0, "aten": 0}
        for launch in self.launches:
            counts[launch.kind] += 1
        return counts

    @property
    def gemm_flops(self) -> int:
        return sum(launch.flops for launch in self.launches)

    @property
    def bytes(self) -> int:
        return sum(launch.bytes for launch in self.launches)

    @property
    def plane_launches(self) -> list:
        """Aten launches other than GEMMs that read or wrote a plane (copies, casts, fills, ...)."""
        return [launch for launch in self.launches if launch.kind == "aten" and launch.plane and not launch.flops]

    @property
    def plane_bytes(self) -> int:
        return sum(launch.bytes for launch in self.plane_launches)

    @property
    def plane_ops(self) -> list:
        return [launch.name for launch in self.plane_launches]

    @property
    def unmodelled(self) -> list:
        return sorted({launch.name for launch in self.launches if not launch.modelled})

    @property
    def device_seconds(self) -> float:
        return sum(launch.seconds for launch in self.launches)

    @property
    def host_seconds(self) -> float:
        """The host floor: every launch issued, every sync waited for, and nothing else."""
        return len(self.launches) * self.host_launch_s + len(self.syncs) * self.host_sync_s

    def summary(self) -> dict:
        """The counts as JSON-ready numbers."""
        return dict(
            launches=self.by_kind(), syncs=len(self.syncs), sync_sites=[f"{s.what} @ {s.site}" for s in self.syncs],
            data_dependent=self.data_dependent, bytes=self.bytes, gemm_flops=self.gemm_flops,
            plane_bytes=self.plane_bytes, plane_ops=_tally(self.plane_ops), peak_bytes=self.peak_bytes,
            device_s=self.device_seconds, host_floor_s=self.host_seconds,
            bound="host" if self.host_seconds > self.device_seconds else "device",
            unmodelled=self.unmodelled, cpu_ops=self.cpu_ops)


def _tally(names: list) -> dict:
    counts: dict = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


# --- the fake device ----------------------------------------------------------------------


class _NoDeviceGuard:
    """``torch.cuda.device(...)``: one device, nothing to switch."""

    def __init__(self, device=None):
        self.idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCuda:
    """Fake CUDA tensors with no driver: the fake mode, the stubs, the launches stopped."""

    def __init__(self):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.counters: list = []  # the CallCounters open inside, innermost last

    def __enter__(self) -> "FakeCuda":
        from dflash2_kernels.conv import launch

        stack = self._stack = contextlib.ExitStack()
        cuda = torch.cuda

        def patch(owner, name, value):
            if name in vars(owner):
                stack.callback(setattr, owner, name, vars(owner)[name])
            else:
                stack.callback(delattr, owner, name)
            setattr(owner, name, value)

        # The path a GPU takes by default (the tests may have set another).
        previous = os.environ.get("DFLASH2_BACKEND")
        os.environ["DFLASH2_BACKEND"] = "auto"
        stack.callback(_restore_env, "DFLASH2_BACKEND", previous)
        patch(cuda, "get_device_properties", lambda device=None: H200)
        patch(cuda, "get_device_capability", lambda device=None: (H200.major, H200.minor))
        patch(cuda, "get_device_name", lambda device=None: H200.name)
        patch(cuda, "mem_get_info", self._mem_get_info)
        patch(cuda, "device", _NoDeviceGuard)
        patch(cuda, "current_device", lambda: 0)
        patch(cuda, "device_count", lambda: 1)
        patch(cuda, "is_current_stream_capturing", lambda: False)
        patch(cuda, "synchronize", self._synchronize)
        # Code that skips reading values from fake tensors (head/checks.has_data asks
        # isinstance(t, torch._subclasses.FakeTensor)) must take the path it takes on a GPU:
        # the reads are counted as syncs and answered with 0.
        patch(torch._subclasses, "FakeTensor", _NotFake)
        # Fake tensors all answer data_ptr() 0: aliasing checks would see every pair alias.
        patch(FakeTensor, "data_ptr", _fake_data_ptr)
        # A function, not the bound method: KernelLaunch.run binds the launch as its first argument.
        patch(launch.KernelLaunch, "run", lambda kernel_launch, device_of=None: self._kernel_launch(kernel_launch))
        patch(torch.autograd, "backward", fake_autograd.backward)
        patch(torch.autograd, "grad", _no_grad_api)
        stack.enter_context(self.mode)
        _ACTIVE.append(self)
        stack.callback(_ACTIVE.remove, self)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _kernel_launch(self, kernel_launch) -> None:
        if self.counters:
            self.counters[-1].triton_launch(kernel_launch)

    def _synchronize(self, device=None) -> None:
        if self.counters:
            self.counters[-1].sync("torch.cuda.synchronize")

    def _mem_get_info(self, device=None) -> tuple[int, int]:
        live = sum(counter.live_bytes for counter in self.counters)
        return H200.total_memory - live, H200.total_memory


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class _NotFake:
    """What ``torch._subclasses.FakeTensor`` names inside FakeCuda: no tensor is one."""


def _fake_data_ptr(tensor: torch.Tensor) -> int:
    """A distinct, 512-byte aligned address per storage (as the caching allocator gives),
    plus the view's offset."""
    return tensor.untyped_storage()._cdata * 512 + tensor.storage_offset() * tensor.element_size()


def _no_grad_api(*args, **kwargs):
    raise NotImplementedError("torch.autograd.grad on fake CUDA tensors: benchmarks/fake_autograd.py runs "
                              "torch.autograd.backward only")


# --- counting ------------------------------------------------------------------------------


class CallCounter:
    """Counts what the block launches on the fake GPU; yields a :class:`CallCount`.

    ``plane``: a predicate on tensors (e.g. ``lambda t: t.dim() >= 2 and t.shape[-1] == V
    and t.numel() > V``): aten launches touching such a tensor are marked, their bytes
    summed in ``plane_bytes``. ``triton`` / ``cuda_ops``: the byte registries
    (default: benchmarks/whole_call_kernels.py's).
    """

    def __init__(self, plane: Callable[[torch.Tensor], bool] | None = None, *, triton: dict | None = None,
                 cuda_ops: dict | None = None, host_launch_s: float = HOST_LAUNCH_S,
                 host_sync_s: float = HOST_SYNC_S):
        self.plane = plane
        self.triton = whole_call_kernels.TRITON if triton is None else triton
        self.cuda_ops = whole_call_kernels.CUDA_OPS if cuda_ops is None else cuda_ops
        self.result = CallCount(host_launch_s=host_launch_s, host_sync_s=host_sync_s)
        self.live_bytes = 0
        self._live: set = set()
        self._own: FakeCuda | None = None

    def __enter__(self) -> CallCount:
        if not _ACTIVE:
            self._own = FakeCuda().__enter__()
        self._fake = _ACTIVE[-1]
        self._fake.counters.append(self)
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        return self.result

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._fake.counters.remove(self)
        if self._own is not None:
            self._own.__exit__(*exc)

    # --- records

    def add(self, launch: Launch) -> None:
        self.result.launches.append(launch)

    def sync(self, what: str) -> None:
        self.result.syncs.append(Sync(what, _site(), len(self.result.launches)))

    def triton_launch(self, kernel_launch) -> None:
        kernel = kernel_launch.kernel
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        bytes_of = self.triton.get(name)
        read, write = (bytes_of or whole_call_kernels.unmodelled_bytes)(kernel_launch)
        tensors = [v for v in kernel_launch.args.values() if isinstance(v, torch.Tensor)]
        self.add(Launch("triton", name, read, write, dtype=tensors[0].dtype if tensors else None,
                        modelled=bytes_of is not None,
                        detail=dict(programs=kernel_launch.programs, num_warps=kernel_launch.num_warps,
                                    constexprs={k: str(v) for k, v in kernel_launch.constexprs.items()},
                                    args={k: _describe(v) for k, v in kernel_launch.args.items()})))

    def cuda_op(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::", 1)[1]
        work_of = self.cuda_ops.get(name)
        if work_of is None:
            read = sum(tensor_bytes(t) for t in _tensors((args, kwargs)))
            self.add(Launch("cuda", name, read, 0, modelled=False, inside=func._schema.name))
            return
        for work in work_of(_named(func, args, kwargs), out):
            self.add(Launch(work.kind, work.name, work.read, work.write, plane=self._touches_plane(work.touches),
                            inside=func._schema.name))

    def aten(self, func, args, kwargs, out) -> None:
        tensors = [*_tensors((args, kwargs)), *_tensors(out)]
        if not any(t.device.type == "cuda" for t in tensors):
            self.result.cpu_ops += any(t.device.type == "cpu" for t in tensors)
            return
        name = func.overloadpacket.__name__
        if name in _COPIES and _blocking_cross_device(func, args, kwargs, out):
            self.sync(f"{name} between cpu and cuda")
        self.allocated(func, args, kwargs, out)
        if name in _METADATA_ONLY:
            return
        op = aten_op(func, args, kwargs, out)
        if op is None:
            return
        flops, dtype = _gemm(func, args, kwargs)
        plane = self._touches_plane(tensors)
        self.add(Launch("aten", name, op.read_bytes, op.write_bytes, flops, dtype or op.dtype, plane=plane,
                        site=_site() if plane and not flops else ""))

    def _touches_plane(self, tensors) -> bool:
        return self.plane is not None and any(self.plane(t) for t in tensors)

    # --- live memory

    def allocated(self, func, args, kwargs, out) -> None:
        """Storages the op's non-aliasing outputs hold that no input holds: newly allocated."""
        if any(r.alias_info is not None for r in func._schema.returns):
            return
        inputs = {_storage_key(t) for t in _tensors((args, kwargs)) if t.device.type == "cuda"}
        for tensor in _tensors(out):
            if tensor.device.type != "cuda":
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            size = storage.nbytes()
            self._live.add(key)
            self.live_bytes += size
            self.result.peak_bytes = max(self.result.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self._live.discard(key)
        self.live_bytes -= size


class _CountingMode(TorchDispatchMode):
    def __init__(self, counter: CallCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if func is torch.ops.aten._local_scalar_dense.default:
            # A fake tensor holds no value to read: 0, and a sync where it is a GPU's.
            if args[0].device.type == "cuda":
                counter.sync("item")
            else:
                counter.result.cpu_ops += 1
            return _zero(args[0].dtype)
        namespace = func.namespace
        if namespace == "dflash2":
            return self._our_op(func, args, kwargs)
        if namespace == "aten" and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            # Below autograd (inside our ops) a composite op reaches the mode whole: what it
            # runs on a GPU is its decomposition (``to`` -> ``_to_copy``, or nothing).
            with self:
                return func.decompose(*args, **kwargs)
        if namespace != "aten":
            if namespace != "prim":  # prim.device and the like: metadata
                counter.result.other_ops.append(str(func))
            return func(*args, **kwargs)
        handler = DATA_DEPENDENT.get(func.overloadpacket.__name__)
        out = None if handler is None else handler(func, args, kwargs)
        if out is not None:
            name = func.overloadpacket.__name__
            counter.result.data_dependent.append(name)
            counter.sync(name)
            counter.aten(func, args, kwargs, out)
            return out
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException) as error:
            raise RuntimeError(f"{func}: its output depends on data the fake tensors do not hold; give it a "
                               f"handler in fake_cuda.DATA_DEPENDENT") from error
        counter.aten(func, args, kwargs, out)
        return out

    def _our_op(self, func, args, kwargs):
        from torch._library.custom_ops import OPDEFS

        definition = OPDEFS.get(func._schema.name)
        if definition is not None:
            # Under the fake mode the op would run its fake impl: run the real one, counted.
            with self:
                out = definition._init_fn(*args, **kwargs)
            return out
        out = func(*args, **kwargs)  # a C++ op: its fake impl's outputs; nothing runs
        if any(t.device.type == "cuda" for t in _tensors((args, kwargs))):
            self.counter.cuda_op(func, args, kwargs, out)
            self.counter.allocated(func, args, kwargs, out)
        else:
            self.counter.result.cpu_ops += 1
        return out


# --- data-dependent output sizes: answered with the largest ---------------------------------


def _nonzero(func, args, kwargs):
    tensor = args[0]
    return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)


def _masked_select(func, args, kwargs):
    tensor, mask = args[0], args[1]
    size = torch.broadcast_shapes(tensor.shape, mask.shape).numel()
    return torch.empty((size,), dtype=tensor.dtype, device=tensor.device)


def _unique(func, args, kwargs):
    tensor = args[0]
    named = _named(func, args, kwargs)
    inverse, counts = named.get("return_inverse", False), named.get("return_counts", False)
    device = tensor.device
    values = torch.empty((tensor.numel(),), dtype=tensor.dtype, device=device)
    return (
        values, torch.empty(tensor.shape if inverse else (0,), dtype=torch.long, device=device),
        torch.empty((tensor.numel(),) if counts else (0,), dtype=torch.long, device=device))


def _repeat_interleave(func, args, kwargs):
    named = _named(func, args, kwargs)
    if named.get("output_size") is not None:
        return None
    repeats = named["repeats"]
    # Unknowable without the counts: each element once.
    return torch.empty((repeats.numel(),), dtype=torch.long, device=repeats.device)


def _boolean_index(func, args, kwargs):
    """x[mask]: the mask's nonzero (a sync), then an index with every element selected."""
    named = _named(func, args, kwargs)
    indices = named["indices"]
    if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return None
    expanded = []
    for index in indices:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            expanded += [torch.empty((index.numel(),), dtype=torch.long, device=index.device)] * index.dim()
        else:
            expanded.append(index)
    args = list(args)
    args[1] = expanded
    return func(*args, **kwargs)


DATA_DEPENDENT = {"nonzero": _nonzero, "masked_select": _masked_select, "_unique2": _unique,
                  "unique_consecutive": _unique, "unique_dim": _unique, "repeat_interleave": _repeat_interleave,
                  "index": _boolean_index, "index_put": _boolean_index, "index_put_": _boolean_index,
                  "_index_put_impl_": _boolean_index}


# --- helpers ---------------------------------------------------------------------------------


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _named(func, args, kwargs) -> dict:
    named = {}
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            named[argument.name] = args[position]
        elif argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
        else:
            named[argument.name] = argument.default_value if argument.has_default_value() else None
    return named


def _gemm(func, args, kwargs) -> tuple[int, torch.dtype | None]:
    """FLOPs of a matrix product and the dtype its tensor cores run in (its operands')."""
    operands = _GEMM_OPERANDS.get(func.overloadpacket.__name__)
    if operands is None:
        return 0, None
    named = _named(func, args, kwargs)
    a, b = named[operands[0]], named[operands[1]]
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1], a.dtype


def _blocking_cross_device(func, args, kwargs, out) -> bool:
    named = _named(func, args, kwargs)
    if named.get("non_blocking"):
        return False
    devices = {t.device.type for t in (*_tensors(args), *_tensors(out))}
    return {"cpu", "cuda"} <= devices


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _zero(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return 0.0
    if dtype.is_complex:
        return 0j
    return 0


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} stride {list(value.stride())}"
    return value if isinstance(value, (int, float, bool, str)) or value is None else str(value)


_HERE = {Path(__file__).resolve(), Path(fake_autograd.__file__).resolve()}


def _site(depth: int = 3) -> str:
    """The innermost frames of this repository's code (and upstream's trainers' code), outside
    this counter: where a sync or a plane op came from."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < depth:
        path = Path(frame.f_code.co_filename)
        installed = "site-packages" in path.parts
        if path not in _HERE and ("dflash2_kernels" in path.parts or "speculators" in path.parts
                                  or (path.is_relative_to(REPO) and not installed)):
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else Path(*path.parts[-3:])
            frames.append(f"{where}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(frames)
