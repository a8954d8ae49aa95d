"""NeMo Automodel's DFlash 2 recipe on the CPU: its own entry point, run in this process
(by tests/e2e/driver.py).

A run: {"config": YAML, "log": PATH, "float64": bool, "seed": int}. :func:`run` calls
``nemo_automodel.recipes.llm.train_dflash2.main`` (the recipe module that ``automodel``
runs in-process for one device and that torchrun runs on every worker for several) with
the YAML, and writes the loss of every optimizer step the recipe logs
(``log_every_steps: 1``) to ``log`` as JSON lines, at full precision (the console prints
4 decimals): the record's own arguments, read by a handler on the recipe's logger.

Shims, exactly what the CPU needs: ``automodel config.yaml`` refuses to start without a
GPU unless it runs under torchrun (InteractiveLauncher counts GPUs), so this calls the
recipe module it would run; and the recipe loads its frozen target with
``NeMoAutoModelForCausalLM.from_pretrained``, which places every model on
``cuda:current_device()`` unconditionally: the shim loads the same checkpoint with
transformers' ``AutoModelForCausalLM`` (the HF class NeMo's loader wraps for a Qwen3) on
the CPU, in the recipe's dtype. The recipe builds the draft before it seeds anything, so
torch is seeded before each run. ``float64``: the judge's run, with the recipe's compute
dtype (float32 on the CPU, for the target and the draft alike) set to float64.

Run through ``dflash2-run`` the process is patched when the recipe imports NeMo's dflash
package, before the recipe builds anything.
"""

from __future__ import annotations

import json
import logging

import torch


class CpuTargetLoader:
    """``NeMoAutoModelForCausalLM`` for a CPU run: the HF model of the checkpoint."""

    @staticmethod
    def from_pretrained(path, *, torch_dtype=torch.float32, trust_remote_code=False, attn_implementation=None,
                        **_distributed_kwargs):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                    attn_implementation=attn_implementation or "sdpa")


class StepLog(logging.Handler):
    """The recipe's per-step log record (``epoch=%d step=%d loss=%.4f ...``), unformatted."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("epoch=%d step=%d loss=") and record.args:
            epoch, step, loss = record.args[:3]
            with open(self.path, "a") as log:
                log.write(json.dumps({"epoch": int(epoch), "step": int(step), "loss": float(loss)}) + "\n")


def prepare() -> None:
    """The shim, once per process (before the first run)."""
    from nemo_automodel.recipes.llm import train_dflash

    train_dflash.NeMoAutoModelForCausalLM = CpuTargetLoader


def run(spec: dict) -> None:
    from nemo_automodel.recipes.llm import train_dflash, train_dflash2

    build_target = train_dflash.TrainDFlashRecipe._build_target_model

    def build_float64_target(self, *args, **kwargs):
        self.compute_dtype = torch.float64
        return build_target(self, *args, **kwargs)

    recipe_logger = logging.getLogger(train_dflash.__name__)
    handler = StepLog(spec["log"])
    recipe_logger.addHandler(handler)
    if spec.get("float64"):
        train_dflash.TrainDFlashRecipe._build_target_model = build_float64_target
    torch.manual_seed(spec.get("seed", 0))
    try:
        train_dflash2.main(spec["config"])
    finally:
        recipe_logger.removeHandler(handler)
        train_dflash.TrainDFlashRecipe._build_target_model = build_target
