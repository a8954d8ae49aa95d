"""Counters of the global-memory traffic of every kernel launch, without a GPU.

Three counters, each a context manager that collects one record per launch (or per
aten op) while it is active:

- :class:`EmulatorTraffic`: the CUDA kernels run by the SIMT emulator
  (``torch.ops.dflash2_emulated``, built by ``scripts/asan.py``). Every lane's load
  and store is seen (csrc/emulation/traffic.h); the lanes' n-th accesses from one
  instruction form one warp request, as on a GPU.
- :class:`TritonTraffic`: the Triton kernels under ``TRITON_INTERPRET=1``. Every
  ``tl.load`` / ``tl.store`` (and atomic) of every program, with its mask: a request
  here is one tile access of one program.
- :class:`AtenTraffic`: a TorchDispatchMode that sums what each aten op reads and
  writes (its input and output tensors) and the FLOPs of matrix products: the eager
  reference's traffic, and the torch ops around our kernels.

Per launch: requests; the 32-byte sectors they touch against the sectors their bytes
would fill if packed (sector efficiency: 1 for a coalesced access, 1/8 for a 4-byte
stride-8 one); the bytes requested (each request's unique bytes: a re-read counts
again, a warp's broadcast once); the unique bytes (and sectors) the whole grid reads
and writes; the unique bytes of each program (block) on its own. These are counts of
what the kernels address, not measurements of a GPU: caches, DRAM and timing are the
model's business (benchmarks/traffic_minimum.py).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import numpy as np
import torch

SECTOR = 32  # bytes: the unit in which a GPU's L1/L2 move global memory


_REQUEST_FIELDS = ("requests", "irregular_requests", "sectors", "packed_sectors", "ideal_sectors", "bytes",
                   "lane_bytes")


@dataclass
class Requests:
    """Requests of one kind (loads or stores) of one launch.

    A request is regular when its lanes' addresses step by one constant (a coalesced
    access, a broadcast, a strided one: its bytes could have come packed into
    ceil(bytes / 32) sectors, its ideal), irregular when they do not (a gather through
    indices: its ideal is the sectors it touches). A Triton tile access is regular.
    """

    requests: int = 0
    irregular_requests: int = 0
    sectors: int = 0  # 32-byte sectors touched, summed over requests
    packed_sectors: int = 0  # sum over requests of ceil(unique bytes / 32)
    ideal_sectors: int = 0  # packed for regular requests, touched for irregular ones
    bytes: int = 0  # sum over requests of their unique bytes
    lane_bytes: int = 0  # sum over every lane's (element's) access

    @classmethod
    def from_json(cls, data: dict) -> "Requests":
        return cls(**{k: int(data[k]) for k in _REQUEST_FIELDS})

    def __add__(self, other: "Requests") -> "Requests":
        return Requests(*(getattr(self, k) + getattr(other, k) for k in _REQUEST_FIELDS))

    @property
    def sectors_per_request(self) -> float:
        return self.sectors / self.requests if self.requests else 0.0

    @property
    def ideal_sectors_per_request(self) -> float:
        return self.ideal_sectors / self.requests if self.requests else 0.0

    @property
    def sector_excess(self) -> float:
        """Touched over ideal sectors: 1 at the ideal of the access pattern."""
        return self.sectors / self.ideal_sectors if self.ideal_sectors else 1.0


@dataclass
class LaunchTraffic:
    """What one kernel launch addressed in global memory."""

    kernel: str
    counter: str  # "emulator" or "interpreter"
    programs: int  # blocks (CUDA) or programs (Triton)
    threads_per_program: int
    loads: Requests
    stores: Requests
    read_unique_bytes: int
    read_unique_sectors: int
    write_unique_bytes: int
    write_unique_sectors: int
    program_unique_bytes_sum: int  # each program's own unique bytes (reads and writes), summed
    program_unique_bytes_max: int
    sites: list = field(default_factory=list)  # emulator: per instruction, {"offset", "store", "totals"}

    @property
    def name(self) -> str:
        """The kernel's name without template arguments."""
        return self.kernel.split("<", 1)[0]

    @property
    def unique_bytes(self) -> int:
        return self.read_unique_bytes + self.write_unique_bytes

    @property
    def unique_sector_bytes(self) -> int:
        """Unique bytes rounded out to whole sectors: what DRAM moves if each is fetched once."""
        return (self.read_unique_sectors + self.write_unique_sectors) * SECTOR

    @property
    def requested_bytes(self) -> int:
        return self.loads.bytes + self.stores.bytes

    @property
    def requests(self) -> Requests:
        return self.loads + self.stores

    def as_dict(self) -> dict:
        data = {k: getattr(self, k) for k in ("kernel", "counter", "programs", "threads_per_program",
                                              "read_unique_bytes", "read_unique_sectors", "write_unique_bytes",
                                              "write_unique_sectors", "program_unique_bytes_sum",
                                              "program_unique_bytes_max")}
        data["loads"] = vars(self.loads).copy()
        data["stores"] = vars(self.stores).copy()
        return data


# --- the SIMT emulator's counters --------------------------------------------------------


class EmulatorTraffic:
    """Counts every launch of the emulated CUDA kernels while active.

    ``ops`` is ``torch.ops.dflash2_emulated`` (its library loaded). After the block,
    ``launches`` holds one :class:`LaunchTraffic` per launch, in order.
    """

    def __init__(self, ops):
        self.ops = ops
        self.launches: list[LaunchTraffic] = []

    def __enter__(self) -> "EmulatorTraffic":
        self.ops.traffic_start()
        return self

    def __exit__(self, *exc) -> None:
        for data in json.loads(self.ops.traffic_stop()):
            if not data["ok"]:
                continue  # a failed launch raised in its op; nothing to count
            block = data["block"]
            self.launches.append(LaunchTraffic(
                kernel=data["kernel"], counter="emulator", programs=int(data["blocks"]),
                threads_per_program=block[0] * block[1] * block[2],
                loads=Requests.from_json(data["loads"]), stores=Requests.from_json(data["stores"]),
                read_unique_bytes=data["read_unique_bytes"], read_unique_sectors=data["read_unique_sectors"],
                write_unique_bytes=data["write_unique_bytes"], write_unique_sectors=data["write_unique_sectors"],
                program_unique_bytes_sum=data["block_unique_bytes_sum"],
                program_unique_bytes_max=data["block_unique_bytes_max"], sites=data["sites"]))


# --- the Triton interpreter's counters ----------------------------------------------------


def _popcount(masks: np.ndarray) -> int:
    return int(np.bitwise_count(masks).sum())


def _sector_masks(addresses: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(sectors, byte masks) of accesses of ``size`` bytes at ``addresses`` (uint64),
    an access that straddles a sector split in two."""
    addresses = addresses.astype(np.uint64, copy=False)
    if size > SECTOR:
        pieces = [_sector_masks(addresses + np.uint64(o), min(SECTOR, size - o)) for o in range(0, size, SECTOR)]
        return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])
    offset = (addresses % np.uint64(SECTOR)).astype(np.uint64)
    sector = addresses // np.uint64(SECTOR)
    first = np.minimum(np.uint64(SECTOR) - offset, np.uint64(size))
    full = np.uint64(0xFFFFFFFF)
    masks = ((np.left_shift(np.uint64(1), first) - np.uint64(1)) << offset) & full
    rest = np.uint64(size) - first
    spill = rest > 0
    if spill.any():
        sector = np.concatenate([sector, sector[spill] + np.uint64(1)])
        masks = np.concatenate([masks, np.left_shift(np.uint64(1), rest[spill]) - np.uint64(1)])
    return sector, masks


def _union(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sector-wise OR of (sectors, masks) pairs: unique sectors and their byte masks."""
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    sectors = np.concatenate([p[0] for p in parts])
    masks = np.concatenate([p[1] for p in parts])
    order = np.argsort(sectors, kind="stable")
    sectors, masks = sectors[order], masks[order]
    starts = np.flatnonzero(np.concatenate([[True], sectors[1:] != sectors[:-1]]))
    return sectors[starts], np.bitwise_or.reduceat(masks, starts)


@dataclass
class _OpenLaunch:
    kernel: str
    threads: int
    loads: Requests = field(default_factory=Requests)
    stores: Requests = field(default_factory=Requests)
    read: list = field(default_factory=list)
    written: list = field(default_factory=list)
    program: list = field(default_factory=list)
    programs: int = 0
    program_sum: int = 0
    program_max: int = 0

    def close_program(self) -> None:
        if not self.program:
            return
        _, masks = _union(self.program)
        unique = _popcount(masks)
        self.program_sum += unique
        self.program_max = max(self.program_max, unique)
        # Keep the launch's record to unique sectors every so often (not every program:
        # each union sorts all the launch's sectors so far).
        for kind in (self.read, self.written):
            if len(kind) > 256:
                kind[:] = [_union(kind)]
        self.program = []


class TritonTraffic:
    """Counts every Triton launch run by the interpreter (TRITON_INTERPRET=1) while active.

    Wraps the interpreter's memory operations (masked loads and stores, to which plain
    and descriptor loads and stores come down, and atomics: a read and a write each), so
    it counts any kernel. After the block, ``launches`` holds one :class:`LaunchTraffic`
    per launch, in order.
    """

    def __init__(self):
        self.launches: list[LaunchTraffic] = []
        self._open: _OpenLaunch | None = None

    def __enter__(self) -> "TritonTraffic":
        from triton.runtime import interpreter

        self._stack = contextlib.ExitStack()
        builder = interpreter.InterpreterBuilder
        counter = self

        def patch(owner, name, make):
            original = getattr(owner, name)
            setattr(owner, name, make(original))
            self._stack.callback(setattr, owner, name, original)

        def masked_load(original):
            def wrapper(builder_self, ptrs, mask, *args, **kwargs):
                counter._access(ptrs, mask.data, store=False)
                return original(builder_self, ptrs, mask, *args, **kwargs)
            return wrapper

        def masked_store(original):
            def wrapper(builder_self, ptrs, value, mask, *args, **kwargs):
                counter._access(ptrs, mask.data, store=True)
                return original(builder_self, ptrs, value, mask, *args, **kwargs)
            return wrapper

        def atomic_rmw(original):
            def wrapper(builder_self, op, ptr, val, mask, *args, **kwargs):
                counter._access(ptr, mask.data, store=False)
                counter._access(ptr, mask.data, store=True)
                return original(builder_self, op, ptr, val, mask, *args, **kwargs)
            return wrapper

        def atomic_cas(original):
            def wrapper(builder_self, ptr, *args, **kwargs):
                counter._access(ptr, None, store=False)
                counter._access(ptr, None, store=True)
                return original(builder_self, ptr, *args, **kwargs)
            return wrapper

        def set_grid_idx(original):
            def wrapper(builder_self, *args, **kwargs):
                if counter._open is not None:
                    counter._open.close_program()
                    counter._open.programs += 1
                return original(builder_self, *args, **kwargs)
            return wrapper

        def grid_call(original):
            def wrapper(executor, *args, **kwargs):
                from torch.utils._python_dispatch import _disable_current_modes

                counter._open = _OpenLaunch(executor.fn.__name__, 32 * int(kwargs.get("num_warps", 4)))
                try:
                    # The interpreter's own torch calls (copying arguments to and from its
                    # host view) are not the kernel's traffic: no dispatch mode sees them.
                    with _disable_current_modes():
                        return original(executor, *args, **kwargs)
                finally:
                    counter._close_launch()
            return wrapper

        patch(builder, "create_masked_load", masked_load)
        patch(builder, "create_masked_store", masked_store)
        patch(builder, "create_atomic_rmw", atomic_rmw)
        patch(builder, "create_atomic_cas", atomic_cas)
        patch(builder, "set_grid_idx", set_grid_idx)
        patch(interpreter.GridExecutor, "__call__", grid_call)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _access(self, ptrs, mask, *, store: bool) -> None:
        launch = self._open
        if launch is None:
            return
        element = ptrs.get_element_ty()
        size = max(1, element.primitive_bitwidth // 8)
        addresses = np.asarray(ptrs.data)
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
        addresses = np.unique(addresses.reshape(-1).astype(np.uint64))
        lanes = int(np.asarray(ptrs.data).size if mask is None else
                    np.broadcast_to(np.asarray(mask, dtype=bool), np.asarray(ptrs.data).shape).sum())
        if addresses.size == 0:
            return
        sectors, masks = _union([_sector_masks(addresses, size)])
        unique = _popcount(masks)
        totals = launch.stores if store else launch.loads
        totals.requests += 1
        totals.sectors += int(sectors.size)
        totals.packed_sectors += -(-unique // SECTOR)
        totals.ideal_sectors += -(-unique // SECTOR)
        totals.bytes += unique
        totals.lane_bytes += lanes * size
        (launch.written if store else launch.read).append((sectors, masks))
        launch.program.append((sectors, masks))

    def _close_launch(self) -> None:
        launch, self._open = self._open, None
        launch.close_program()
        read_sectors, read_masks = _union(launch.read)
        written_sectors, written_masks = _union(launch.written)
        self.launches.append(LaunchTraffic(
            kernel=launch.kernel, counter="interpreter", programs=launch.programs,
            threads_per_program=launch.threads, loads=launch.loads, stores=launch.stores,
            read_unique_bytes=_popcount(read_masks), read_unique_sectors=int(read_sectors.size),
            write_unique_bytes=_popcount(written_masks), write_unique_sectors=int(written_sectors.size),
            program_unique_bytes_sum=launch.program_sum, program_unique_bytes_max=launch.program_max))


# --- aten ops: the eager reference and the torch ops around our kernels -------------------

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "einsum"}
# Ops that write their mutated argument without reading it.
_PURE_WRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_", "bernoulli_"}
# Ops that move no tensor data: allocations, metadata.
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
               "lift_fresh", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride", "sym_numel",
               "sym_storage_offset"}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (broadcast dims count once)."""
    if t.numel() == 0:
        return 0
    distinct = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            distinct *= size
    return distinct * t.element_size()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _matmul_flops(name: str, args, out) -> int:
    if name not in _MATMULS:
        return 0
    outs = list(_tensors(out))
    tensors = [a for a in _tensors(args) if a.dim() >= 2]
    if not outs or not tensors:
        return 0
    result = outs[0]
    inner = tensors[-1].shape[-2] if name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul") else \
        tensors[0].shape[-1]
    return 2 * result.numel() * int(inner)


@dataclass
class AtenOp:
    name: str
    read_bytes: int
    write_bytes: int
    flops: int
    dtype: torch.dtype | None


def aten_op(func, args, kwargs, out) -> AtenOp | None:
    """What one aten op moves: its tensor inputs read, its outputs written (a mutated
    argument is written, and read too unless the op only writes it), FLOPs of matrix
    products; None for a view or an op that moves no tensor data."""
    schema = func._schema
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if name in _NO_TRAFFIC:
        return None
    if all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) and schema.returns:
        return None  # a view
    written_ids = set()
    write = 0
    for arg, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]):
        if arg.alias_info is not None and arg.alias_info.is_write:
            for t in _tensors(value):
                written_ids.add(id(t))
                write += tensor_bytes(t)
    read = 0
    for value in list(args) + list(kwargs.values()):
        for t in _tensors(value):
            if id(t) in written_ids and name in _PURE_WRITES:
                continue
            if id(t) in written_ids and "out" in kwargs and any(t is o for o in _tensors(kwargs["out"])):
                continue
            read += tensor_bytes(t)
    if not written_ids:
        write = sum(tensor_bytes(t) for t in _tensors(out))
    dtypes = [t.dtype for t in _tensors(out)] or [t.dtype for t in _tensors(args)]
    return AtenOp(name, read, write, _matmul_flops(name, args, out), dtypes[0] if dtypes else None)


class AtenTraffic:
    """Sums each aten op's traffic while active: bytes of its tensor inputs (read) and
    outputs (written; a mutated argument is written, and read too unless the op only
    writes it), FLOPs of matrix products. View ops move nothing. A custom op of this
    package (``dflash2*``) runs with the mode still active inside it, so the aten ops it
    calls itself (allocations' fills, sorts) are counted; its kernels are the other
    counters' business."""

    def __init__(self):
        self.ops: list[AtenOp] = []

    def __enter__(self) -> "AtenTraffic":
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                namespace = func.namespace
                if namespace.startswith("dflash2"):
                    with self:
                        return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                                               if _on_cpu(args) else
                                               torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), *args, **kwargs)
                out = func(*args, **kwargs)
                counter._record(func, args, kwargs, out)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _record(self, func, args, kwargs, out) -> None:
        op = aten_op(func, args, kwargs, out)
        if op is not None:
            self.ops.append(op)

    @property
    def read_bytes(self) -> int:
        return sum(op.read_bytes for op in self.ops)

    @property
    def write_bytes(self) -> int:
        return sum(op.write_bytes for op in self.ops)

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)


def _on_cpu(args) -> bool:
    return all(t.device.type == "cpu" for t in _tensors(args))
