"""A minimal reproducer of an upstream torch abort at the exit of a 2-rank gloo run; no code of ours.

    for i in $(seq 20); do torchrun --standalone --nproc-per-node 2 \\
        scripts/repro_gloo_teardown_abort.py teardown || echo "run $i failed"; done

One DDP step of a ``Linear`` on two gloo ranks, then exit:

- ``bare``: no teardown;
- ``teardown``: as torch documents it (drop the DDP wrapper, barrier, destroy_process_group);
- ``collect``: the same, then ``gc.collect()`` while the interpreter is whole.

Under load (two busy loops beside it on the 2-core VM, torch 2.14.1, Python 3.11,
2026-12-05), a rank aborted with "terminate called without an active exception" (exit
-6) in 2 of 12 ``bare`` runs, 5 of 44 ``teardown`` runs and 0 of 36 ``collect`` runs.
gdb on the aborting rank: the ``pt_gloo_runloop`` thread (c10d::ProcessGroupGloo::runLoop)
is being force-unwound (``__pthread_unwind`` from a thread exit) while the main thread is
in ``Py_FinalizeEx``'s garbage collection; the unwind meets a frame that may not throw and
``std::terminate`` aborts. Collecting before finalization lets the group's objects and
threads go while the interpreter still runs (pytorch/pytorch PR #179291 describes the same
mechanism for groups never destroyed).
"""

import gc
import sys

import torch
import torch.distributed as dist

MODES = ("bare", "teardown", "collect")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "teardown"
    if mode not in MODES:
        raise SystemExit(f"mode: one of {', '.join(MODES)}, got {mode!r}")
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
    loss = model(torch.randn(64, 256)).square().mean()
    loss.backward()
    if mode == "bare":
        return
    del model, loss
    dist.barrier()
    dist.destroy_process_group()
    if mode == "collect":
        gc.collect()


if __name__ == "__main__":
    main()
