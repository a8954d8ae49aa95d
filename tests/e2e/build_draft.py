"""A worker that builds a speculators DFlash 2 draft the usual way and trains one step
under DDP (gloo, CPU), saying what it ran: the process dflash2-run is tested on.

    torchrun --nproc-per-node 2 tests/e2e/build_draft.py OUT_DIR    (or: python ... OUT_DIR)

Nothing here patches anything: run through ``dflash2-run`` the hook does, when
speculators is imported. Each worker writes OUT_DIR/rank{R}.json: the classes of the
draft's convs and selector, the module of ``DFlash2DraftModel.forward``, the
``torch.ops.dflash2`` calls its step made, and the step's loss.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.upstream_models import (  # noqa: E402
    count_dflash2_ops, speculators_batch, speculators_draft, speculators_loss)


def main() -> None:
    out = Path(sys.argv[1])
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    from speculators.models.dflash2 import DFlash2DraftModel

    model = speculators_draft(seed=0)  # DFlash2DraftModel(config), as speculators' trainer builds it
    kinds = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                    if type(m).__name__ in ("GroupedDynamicCausalConv", "CandidateSelector")})
    step = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    with count_dflash2_ops() as calls:
        loss, _ = speculators_loss(step, speculators_batch(seed=rank))
        loss.backward()
    record = {"rank": rank, "modules": kinds, "forward": DFlash2DraftModel.forward.__module__,
              "ops": dict(sorted(calls.counts.items())), "loss": loss.item()}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if distributed:
        # Teardown in the order torch documents (the DDP wrapper, whose reducer holds the
        # group's work, before the group; no rank destroys it while its peer may still talk
        # to it), then a collection while the interpreter is whole: left to Py_Finalize,
        # gloo's worker thread is torn down mid-finalization and aborts the process
        # ("terminate called without an active exception"; an upstream torch issue with no
        # code of ours in it: docs/distributed.md, scripts/repro_gloo_teardown_abort.py).
        del step, loss
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    main()
