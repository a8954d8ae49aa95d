"""``speculators train`` on the CPU: the command's own entry point, run in this process
(by tests/e2e/driver.py).

A run: {"argv": [...], "log": PATH, "float64": bool, and optionally "resume":
[CHECKPOINTS, SAVE_PATH]: CHECKPOINTS, an earlier run's save path, is copied to
SAVE_PATH (the run's ``--save-path``) first, so the run resumes from it}. :func:`run`
calls the ``speculators`` console script's own app (``speculators.__main__.app``) with
``train`` + argv, as the command does, and writes every metric record its trainer logs
(train step losses, validation epoch losses) to ``log`` as JSON lines, at full precision
(the console prints 3 decimals).

The trainer cannot run without CUDA: it moves the model and every batch with
``.to(get_local_rank())`` (cuda:N), its checkpointer loads a checkpoint onto
``get_current_device()`` ("cuda:0" without an accelerator), and its step timer calls
``torch.accelerator.synchronize()``. The three shims below point exactly those at the
CPU; everything else is upstream's (CLI, config resolution, data loading, optimizer,
scheduler, logging, checkpoint save and resume). ``float64``: the judge's run: the
draft built (and seeded) as in the others, then moved to float64 as the trainer sets it
up, before it loads a checkpoint and builds its optimizer; float64 hidden states.

Run through ``dflash2-run`` the process is patched when speculators is imported, which
happens before the shims are applied (they import ``speculators.train.trainer``).
"""

from __future__ import annotations

import json
import logging
import shutil

import torch


def cpu_shims() -> None:
    from speculators.train import checkpointer, trainer

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None


class MetricLog(logging.Handler):
    """Every mapping the trainer logs to ``speculators.metrics``, as one JSON line."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if isinstance(message, dict) and ("train" in message or "val" in message):
            with open(self.path, "a") as log:
                log.write(json.dumps(message, default=float) + "\n")


def add_metric_log(path: str) -> None:
    """Attach MetricLog after upstream's own metric-logger set-up (a dictConfig that
    would drop a handler attached before it)."""
    from speculators.train import cli

    original = getattr(cli.setup_metric_logger, "__wrapped__", cli.setup_metric_logger)

    def setup_metric_logger(*args, **kwargs):
        original(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(MetricLog(path))

    setup_metric_logger.__wrapped__ = original
    cli.setup_metric_logger = setup_metric_logger


def prepare() -> None:
    """The shims, once per process (before the first run)."""
    cpu_shims()


def run(spec: dict) -> None:
    from speculators.__main__ import app
    from speculators.train import trainer

    if "resume" in spec:
        shutil.copytree(*spec["resume"], symlinks=True)
    add_metric_log(spec["log"])
    setup_model = trainer.Trainer.setup_model

    def setup_float64_model(self):
        self.model.to(torch.float64)
        setup_model(self)

    if spec.get("float64"):
        trainer.Trainer.setup_model = setup_float64_model
    try:
        dtype = "float64" if spec.get("float64") else "float32"
        app(["train", *spec["argv"], "--hidden-states-dtype", dtype], standalone_mode=False)
    finally:
        trainer.Trainer.setup_model = setup_model
