"""Which configuration of a kernel's space a launch uses, and the timing that decides it.

Per (space, shape class, GPU), the first match of:

1. a configuration forced by :meth:`Tuner.forced` (the tests);
2. this process's earlier choice;
3. the shipped table (``shipped.json``: winners the GPU script measured, per GPU name);
4. the on-disk cache (``$DFLASH2_CACHE_DIR`` or ``~/.cache/dflash2_kernels``, one file per
   GPU name and Triton version; an entry counts only for the same space digest);
5. timing every member on the call's own tensors (CUDA-graph replays of the launch, device
   time only), remembered in 2 and 4.

The default (``configs[0]``) runs wherever no timing can: CPU tensors (the interpreter),
fake tensors, compile tracing, CUDA graph capture, and under ``DFLASH2_AUTOTUNE=0``.
``DFLASH2_AUTOTUNE=retune`` skips 3 and 4 (the GPU script's measurements).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from .._eager import plain_eager
from .space import Config, Space

ENV = "DFLASH2_AUTOTUNE"
SHIPPED_TABLE = Path(__file__).with_name("shipped.json")
_GRAPH_LAUNCHES = 10  # launches a timed graph replays: tiny kernels' device time, no host gaps
_TIMED_REPLAYS = 5


_MODES = {"": "on", "1": "on", "on": "on", "0": "off", "off": "off", "retune": "retune"}


def _mode() -> str:
    """DFLASH2_AUTOTUNE, read at each shape class's first launch: "on", "off" or "retune"."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in _MODES:
        raise ValueError(f"{ENV} must be 1 (tune; the default), 0 (the default configurations) or retune, "
                         f"got {value!r}.")
    return _MODES[value]


def cache_dir() -> Path:
    root = os.environ.get("DFLASH2_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dflash2_kernels")
    return Path(root) / "tuning"


def _triton_version() -> str:
    import triton

    return triton.__version__


def key_text(key: tuple) -> str:
    """A shape class as the JSON tables store it (dtypes by name)."""
    return json.dumps([k if isinstance(k, (bool, int, float, str)) else str(k).removeprefix("torch.") for k in key],
                      separators=(",", ":"))


class Tuner:
    """The process's choices; ``device_name`` and ``timer`` are injectable for tests."""

    def __init__(self, device_name: Callable[[int], str] | None = None,
                 timer: Callable | None = None, shipped_path: Path = SHIPPED_TABLE):
        self._chosen: dict = {}
        self._forced: dict = {}
        self._device_name = device_name or torch.cuda.get_device_name
        self._names: dict = {}
        self._timer = timer or time_launch
        self._shipped_path = shipped_path
        self._shipped = None
        self._disk: dict = {}
        self._lock = threading.Lock()
        self.trials: list = []  # what each timing measured: the GPU script's records

    # --- the hot path -------------------------------------------------------------------
    def choose(self, space: Space, key: tuple, device_of: torch.Tensor,
               trial: Callable[[Config], object] | None = None) -> Config:
        """The configuration for a launch of ``space`` at shape class ``key`` on
        ``device_of``'s device. ``trial(config)`` builds that configuration's
        KernelLaunch on the call's own buffers (for timing; None: no timing)."""
        if self._forced:
            forced = self._forced.get(space.name)
            if forced is not None:
                return forced
        device = device_of.device
        try:
            chosen = self._chosen.get((space.name, key, device.index))
        except TypeError:  # symbolic sizes (a dynamic-shape compile trace): nothing to look up
            return space.default
        if chosen is not None:
            return chosen
        return self._resolve(space, key, device_of, trial)

    # --- the first launch of a shape class ----------------------------------------------
    def _resolve(self, space, key, device_of, trial) -> Config:
        device = device_of.device
        if not self.on_gpu(device_of):
            return space.default
        mode = _mode()
        if mode == "off":
            return self._remember(space, key, device.index, space.default)
        gpu = self._gpu_name(device.index)
        if gpu is None:  # no device answers: fake CUDA tensors on a machine without a GPU
            return space.default
        if mode == "on":
            known = self._known(space, key, gpu)
            if known is not None:
                return self._remember(space, key, device.index, known)
        if trial is None or len(space.configs) == 1 or not self.can_time(device_of):
            return space.default  # not remembered: a later eager call may still time it
        with self._lock:
            config = self._time_space(space, key, gpu, device_of, trial)
        self._store(space, key, gpu, config)
        return self._remember(space, key, device.index, config)

    @staticmethod
    def on_gpu(device_of: torch.Tensor) -> bool:
        """Whether the launch runs compiled on a GPU (not the interpreter, not meta)."""
        return device_of.device.type == "cuda" and not _INTERPRETED

    @staticmethod
    def can_time(device_of: torch.Tensor) -> bool:
        """Whether kernels may run now for timing: plain eager tensors, no capture."""
        return plain_eager(device_of) and not torch.cuda.is_current_stream_capturing()

    def _remember(self, space, key, index, config) -> Config:
        self._chosen[(space.name, key, index)] = config
        return config

    def _gpu_name(self, index) -> str | None:
        if index not in self._names:  # index None: the current device's
            try:
                self._names[index] = self._device_name(index)
            except (RuntimeError, AssertionError):  # torch without CUDA, or no driver
                self._names[index] = None
        return self._names[index]

    def _known(self, space: Space, key: tuple, gpu: str) -> Config | None:
        text = key_text(key)
        for table in (self._shipped_table().get(gpu, {}), self._disk_table(gpu)):
            entry = table.get(space.name)
            if entry and entry.get("digest") == space.digest:
                name = entry.get("winners", {}).get(text)
                config = space.named(name) if name else None
                if config is not None:
                    return config
        return None

    def _time_space(self, space: Space, key: tuple, gpu: str, device_of, trial) -> Config:
        kept, times = None, {}
        for config in space.configs:  # one at a time: a trial's buffers go before the next's
            launch = trial(config)
            if kept is None:
                kept = {name: launch.args[name].clone() for name in space.mutates}
            try:
                times[config.name] = self._timer(launch, device_of)
            except Exception as error:  # a configuration this GPU cannot run (resources)
                times[config.name] = float("inf")
                warnings.warn(f"dflash2_kernels: {space.name} configuration {config.name} failed on {gpu}: "
                              f"{type(error).__name__}: {error}", stacklevel=3)
            for name, copy in kept.items():
                launch.args[name].copy_(copy)
        best = min(space.configs, key=lambda c: (times[c.name], c is not space.default))
        if times[best.name] == float("inf"):
            best = space.default  # nothing ran: the default's own error will surface
        self.trials.append({"space": space.name, "key": key_text(key), "gpu": gpu, "times_ms": times,
                            "default": space.default.name, "winner": best.name})
        return best

    # --- tables -------------------------------------------------------------------------
    def _shipped_table(self) -> dict:
        if self._shipped is None:
            try:
                self._shipped = json.loads(self._shipped_path.read_text())
            except FileNotFoundError:
                self._shipped = {}
        return self._shipped

    def _disk_path(self, gpu: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in gpu)
        return cache_dir() / f"{safe}--triton-{_triton_version()}.json"

    def _disk_table(self, gpu: str) -> dict:
        if gpu not in self._disk:
            try:
                self._disk[gpu] = json.loads(self._disk_path(gpu).read_text())
            except (OSError, ValueError):  # none yet, unreadable or torn: timed again
                self._disk[gpu] = {}
        return self._disk[gpu]

    def _store(self, space: Space, key: tuple, gpu: str, config: Config) -> None:
        """Adds the winner to the GPU's file, merged with what other processes wrote since."""
        path = self._disk_path(gpu)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                table = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                table = {}
            entry = table.get(space.name)
            if not entry or entry.get("digest") != space.digest:
                entry = table[space.name] = {"digest": space.digest, "winners": {}}
            entry["winners"][key_text(key)] = config.name
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(table, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, path)
            self._disk[gpu] = table
        except OSError as error:
            warnings.warn(f"dflash2_kernels: cannot write the tuning cache {path}: {error}", stacklevel=3)

    # --- control ------------------------------------------------------------------------
    @contextlib.contextmanager
    def forced(self, choices: dict):
        """Launch these configurations ({space name: Config}) whatever the tables say."""
        before = self._forced
        self._forced = {**before, **choices}
        try:
            yield
        finally:
            self._forced = before

    def reset(self) -> None:
        """Forget this process's choices and the tables read (the environment is read again)."""
        self._chosen.clear()
        self._disk.clear()
        self._shipped = None


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def time_launch(launch, device_of: torch.Tensor) -> float:
    """Device milliseconds of one launch: the median replay of a CUDA graph holding
    _GRAPH_LAUNCHES of it (the first launch, outside, compiles it)."""
    launch.run(device_of)
    stream = torch.cuda.Stream(device_of.device)
    stream.wait_stream(torch.cuda.current_stream(device_of.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        launch.run(device_of)  # a launch on the capture stream before capture: Triton's lazy init
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(_GRAPH_LAUNCHES):
                launch.run(device_of)
    torch.cuda.current_stream(device_of.device).wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(_TIMED_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / _GRAPH_LAUNCHES)
    return sorted(times)[len(times) // 2]


TUNER = Tuner()
