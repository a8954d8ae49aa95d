"""Running a test's ranks: two gloo CPU processes, a free port, a timeout.

:func:`run_ranks` starts ``WORLD`` processes, each of which joins a gloo process group
on a free loopback port (one OpenMP thread each: two ranks share a 2-core machine),
runs ``worker(rank, out_dir, *args)`` and leaves the group. A rank that raises fails
the test with its traceback (the others are killed); ranks that are not done within
the timeout are killed and the test fails, so that a hung collective cannot hang the
suite. The workers hand their results back as files under ``out_dir``
(``torch.save``), which the test then judges in its own process.

The ranks are forked from one forkserver that has imported torch, this package and
the upstream trainers once (:data:`PRELOAD`): started fresh, each rank would import
them again, ~15-25 s per test on the 2-core dev machine, against ~1 s per test for a
fork. The forkserver starts with CUDA hidden, so the ranks are CPU-only processes on a
GPU machine too (FSDP2's default mesh would otherwise be a CUDA one, and speculators
would compile its draft's forward, as it does whenever CUDA is present).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import multiprocessing
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch

WORLD = 2
# A test's ranks, start to finish: a few seconds each; the first test of a session
# also waits for the forkserver's imports (up to ~60 s on a loaded 2-core machine).
RANK_TIMEOUT_S = 180

# Imported once by the forkserver (those that import in this process: an optional
# trainer that is not installed is left out; a test that needs it skips before its ranks).
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "dflash2_kernels",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "speculators.models.dflash2",
    "speculators.train.distributed",
    "nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2",
    "nemo_automodel.components.speculative.dflash.dflash2_core",
    "nemo_automodel.components.distributed.activation_checkpointing",
    "tests.upstream_models",
)
# The ranks' environment: loopback only whatever the host's network, one thread, no GPU.
# (Set around the forkserver's start, which every rank inherits; this process keeps its own.)
RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

requires_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 (an optional trainer may fail in any way: leave it out)
        return False
    return True


def _start_forkserver() -> None:
    """Start the session's forkserver (a no-op once it runs), with :data:`PRELOAD` and
    :data:`RANK_ENV`. The modules are imported here first: the forkserver dies on an
    import that raises anything but ImportError, so only those that import cleanly in
    this process are handed to it."""
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload([m for m in PRELOAD if _importable(m)])
    env = dict(RANK_ENV)
    if not Path("/sys/class/net/lo").exists():
        del env["GLOO_SOCKET_IFNAME"]  # gloo picks an interface itself
    with _environment(env):
        forkserver.ensure_running()


def _rank_main(rank: int, world: int, port: int, timeout_s: float, worker: Callable, out_dir: str, args: tuple) -> None:
    """One rank: join the group, run the worker, leave the group. A rank killed by a
    signal (an abort in gloo's C++ at teardown) leaves its threads' Python stacks in
    rank{rank}.fault for the parent's message."""
    import faulthandler

    import torch.distributed as dist

    fault_log = open(Path(out_dir, f"rank{rank}.fault"), "w")  # noqa: SIM115  (open until the process ends)
    faulthandler.enable(file=fault_log, all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        worker(rank, out_dir, *args)
    except BaseException:
        # Kept beside the results too: the parent's message names the rank that failed.
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
        gc.collect()  # gloo's threads go while the interpreter is whole (docs/distributed.md)


def run_ranks(worker: Callable, out_dir: Path, *args, world: int = WORLD, timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Run ``worker(rank, str(out_dir), *args)`` on ``world`` gloo ranks; fail the test
    if one raises or they are not all done within ``timeout_s``.

    ``worker`` and ``args`` are pickled: a module-level function and plain data."""
    import torch.multiprocessing as mp

    _start_forkserver()
    start = time.monotonic()
    context = mp.start_processes(_rank_main, args=(world, free_port(), timeout_s / 2, worker, str(out_dir), args),
                                 nprocs=world, join=False, start_method="forkserver")
    deadline = start + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks of {worker.__name__} did not finish within {timeout_s} s")
    except mp.ProcessRaisedException as error:
        pytest.fail(f"a rank of {worker.__name__} raised:\n{error}", pytrace=False)
    except mp.ProcessExitedException as error:
        errors = "".join(p.read_text() for p in sorted(Path(out_dir).glob("rank*.error")))
        faults = "".join(f"{p.name}:\n{p.read_text()}" for p in sorted(Path(out_dir).glob("rank*.fault"))
                         if p.stat().st_size)
        pytest.fail(f"a rank of {worker.__name__} died: {error}\n{errors}{faults}", pytrace=False)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def save_rank_result(out_dir: str, rank: int, result) -> None:
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def load_rank_results(out_dir: Path, world: int = WORLD) -> list:
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
