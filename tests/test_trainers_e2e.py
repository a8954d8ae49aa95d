"""End to end: speculators' and NeMo Automodel's own training entry points, run unpatched
and through ``dflash2-run`` (the kernels, and the kernels + the fused head), on a tiny
random Qwen3 verifier and synthetic data made here (tests/e2e/data.py).

What runs (tests/e2e/driver.py, in child processes with a timeout):

- speculators: the ``speculators train`` command's own app, with the three CPU shims of
  tests/e2e/speculators_driver.py (the trainer's ``get_local_rank`` -> "cpu", the
  checkpointer's ``get_current_device`` -> "cpu", ``torch.accelerator.synchronize`` a
  no-op); AdamW (speculators' default Muon runs its Newton-Schulz step in bf16, which
  magnifies fp32 rounding differences).
- NeMo: the DFlash 2 recipe's own entry point (the module ``automodel`` runs in-process
  for one device and torchrun runs on every worker), with the CPU shim of
  tests/e2e/nemo_driver.py (its target loader, which places every model on CUDA).

Three processes, in order, each running both trainers (they share the imports, most of
the cost): through ``dflash2-run`` (kernels): 4 optimizer steps from scratch, saving a
checkpoint, then a run resuming from it for a second epoch; unpatched: the same from
scratch (float32, and the judge in float64 from the same initial weights), then runs
resuming the patched run's checkpoint and its own; through ``dflash2-run --fused-head``:
from scratch, then resuming the unpatched run's checkpoint. Same seed everywhere.

The judge (SPEC section 4, per logged step loss): |patched - exact| <= 2 x |reference -
exact| + 4 eps(fp32) |exact| + 1e-6, where exact is the float64 run and reference the
unpatched float32 one. A step's loss carries the rounding of every step before it, so
the reference's error at step k is taken as its largest over steps 0..k of that run.

The ``gpu`` tests run the commands themselves (``speculators train``, ``automodel``),
patched and not, on CUDA: no shim, the trainers' GPU defaults.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .contract import contract_floor
from .e2e import data
from .e2e.install import needs_install

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "tests" / "e2e"
# Seconds per child process: each takes 10-30 s on a busy 2-core machine (mostly
# imports); the bound only keeps a hung trainer from hanging CI.
TIMEOUT_S = 600
STEPS = 4  # optimizer steps per epoch on this data
# How each trainer's console prints a step's loss (the gpu tests read these).
SPECULATORS_LOSS = r"train/loss=([-+.\deE]+)"
NEMO_LOSS = r"\| epoch=\d+ step=\d+ loss=([-+.\d]+)"

pytestmark = [
    pytest.mark.skipif(bool(os.environ.get("DFLASH2_EXTENSION_PATH")),
                       reason="the trainers' loops run once, on the installed build (the sanitized half runs the "
                              "kernels' own tests)"),
    needs_install,
]


def needs(*packages: str):
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def dflash2_run(*options: str) -> list[str]:
    """The launcher as a user runs it: the console script (python -m dflash2_kernels.run
    where the environment has no script directory)."""
    script = Path(sys.executable).with_name("dflash2-run")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "dflash2_kernels.run"]
    return [*launcher, *options, "--"]


def child(command: list[str], cwd: Path) -> str:
    """Run ``command`` as a trainer runs: one OpenMP thread (two threads on a busy 2-core
    machine wait on each other), no DFLASH2_PATCH of ours, wide console lines. Its stderr."""
    env = {key: value for key, value in os.environ.items() if key != "DFLASH2_PATCH"}
    env.update(OMP_NUM_THREADS="1", COLUMNS="4000",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{command} ran past {TIMEOUT_S} s:\n{error.stdout}\n{error.stderr}")
    output = result.stdout + result.stderr
    (cwd / f"{Path(command[-1]).stem}.out").write_text(output)
    assert result.returncode == 0, f"{command} exited {result.returncode}; its output ends:\n{output[-6000:]}"
    return output


def patch_messages(output: str, about: str = "") -> list[str]:
    """What the process said it patched (the lines about ``about``, e.g. "speculators")."""
    said = re.findall(r"^dflash2_kernels \(pid \d+[^)]*\): (.*)$", output, re.MULTILINE)
    return [line for line in said if about in line]


def contract_failures(label: str, losses: list[float], reference: list[float], exact: list[float]) -> list[str]:
    """The steps where ``losses`` miss SPEC section 4 against ``exact``, the reference's
    error being its largest so far (module docstring)."""
    assert len(losses) == len(reference) == len(exact) > 0, (label, losses, reference, exact)
    failures, reference_error = [], 0.0
    for step, (loss, ref, x) in enumerate(zip(losses, reference, exact)):
        reference_error = max(reference_error, abs(ref - x))
        bound = 2 * reference_error + contract_floor(torch.float32, abs(x))
        if not (math.isfinite(loss) and abs(loss - x) <= bound):
            failures.append(f"{label} step {step}: {loss!r} vs exact {x!r}: error {abs(loss - x):.3g} > {bound:.3g} "
                            f"(reference {ref!r})")
    return failures


def assert_within_contract(runs: dict, pairs: list[tuple[str, str, str]], key: str = "loss") -> None:
    failures = []
    for test, reference, exact in pairs:
        failures += contract_failures(test, [r[key] for r in runs[test]], [r[key] for r in runs[reference]],
                                      [r[key] for r in runs[exact]])
    assert not failures, "\n".join(failures)


FRESH_PAIRS = [("kernels", "upstream", "exact"), ("fused", "upstream", "exact")]
# A patched run's checkpoint trains on unpatched as it does patched, and the reverse.
RESUMED_PAIRS = [("kernels_resumed", "upstream_resumes_kernels", "exact_resumes_kernels"),
                 ("fused_resumes_upstream", "upstream_resumed", "exact_resumed")]


def assert_fresh_runs_agree(runs: dict, output: dict, steps: list, *, about: str, replaced: str, forward: str):
    """From scratch: every run logged ``steps``; the patched ones are within SPEC section 4;
    each patched process said once that it patched ``about`` (package and version), listing
    ``replaced`` and, with the fused head, ``forward``; the unpatched one said nothing."""
    for name in ("upstream", "kernels", "fused", "exact"):
        assert [r["step"] for r in runs[name]] == steps, (name, runs[name])
    assert_within_contract(runs, FRESH_PAIRS)
    assert patch_messages(output["upstream"]) == []
    for name, head in (("kernels", False), ("fused", True)):
        messages = patch_messages(output[name], about.split()[0])
        assert len(messages) == 1, output[name]
        assert messages[0].startswith(f"patched {about} (kernels" + (" + fused head)" if head else ")")), messages
        assert replaced in messages[0] and (forward in messages[0]) == head, messages


def printed_losses(output: str, pattern: str) -> list[float]:
    return [float(value) for value in re.findall(pattern, output)]


def assert_console_shows(output: str, pattern: str, logged: list[float], decimals: int) -> None:
    """The losses the console printed (``pattern``, ``decimals`` places) are ``logged``."""
    printed = printed_losses(output, pattern)
    assert printed == pytest.approx(logged, abs=0.6 * 10 ** -decimals), (printed, logged)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The verifier and both trainers' data, made once for the module."""
    root = tmp_path_factory.mktemp("trainers")
    data.verifier(root / "verifier")
    return root


# --- speculators ------------------------------------------------------------------------


def speculators_argv(root: Path, save: Path, epochs: int) -> list[str]:
    return ["--verifier-name-or-path", str(root / "verifier"), "--data-path", str(root / "speculators_data"),
            "--save-path", str(save), "--log-dir", str(root / "logs"), "--speculator-type", "dflash2",
            "--num-layers", "1", "--target-layer-ids", *map(str, data.TARGET_LAYER_IDS),
            "--mask-token-id", str(data.MASK_TOKEN), "--block-size", "4", "--conv-kernel-size", "2",
            "--conv-group-size", "16", "--selector-rank", "16", "--selector-top-k", "8", "--total-seq-len", "64",
            "--epochs", str(epochs), "--lr", "1e-3", "--optimizer", "adamw", "--seed", "0",
            "--train-data-ratio", "0.75", "--num-workers", "0",
            # The CPU's: the default fused loss is Triton, flex attention has no CPU backward.
            "--loss-implementation", "eager", "--draft-attn-impl", "sdpa"]


def speculators_run(root: Path, name: str, *, resume: str | None, float64: bool) -> dict:
    save = root / "checkpoints" / name
    run = {"argv": speculators_argv(root, save, epochs=2 if resume else 1), "log": str(root / f"{name}.jsonl"),
           "float64": float64}
    if resume:
        run["resume"] = [str(root / "checkpoints" / resume), str(save)]
    return run


def speculators_records(root: Path, name: str) -> list[dict]:
    """A run's logged metrics: each train step's (epoch, step, loss), then each validation
    epoch's loss (under step "val")."""
    records = []
    for line in (root / f"{name}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train" in record:
            records.append({"epoch": record["epoch"], "step": record["global_step"], "loss": record["train"]["loss"]})
        else:
            records.append({"epoch": record["epoch"], "step": "val", "loss": record["val"]["loss_epoch"]})
    return records


@needs("speculators")
def test_speculators_patched_losses_equal_unpatched(trainer_runs):
    assert_fresh_runs_agree(trainer_runs[0]["speculators"], trainer_runs[1], [*range(STEPS), "val"],
                            about="speculators 0.9.0", replaced="model_definitions.GroupedDynamicCausalConv",
                            forward="DFlash2DraftModel.forward")


@needs("speculators")
def test_speculators_checkpoints_resume_across_patching(trainer_runs):
    runs = trainer_runs[0]["speculators"]
    resumed = [*range(STEPS, 2 * STEPS), "val"]
    for name in ("kernels_resumed", "upstream_resumes_kernels", "upstream_resumed", "fused_resumes_upstream"):
        assert [r["step"] for r in runs[name]] == resumed, (name, runs[name])  # epoch 1 only, steps go on
        assert {r["epoch"] for r in runs[name]} == {1}, (name, runs[name])
    assert_within_contract(runs, RESUMED_PAIRS)


@needs("speculators")
def test_speculators_console_losses(trainer_runs):
    """The console's 3-decimal ``train/loss=`` (what the gpu test reads) is the logged loss."""
    runs = trainer_runs[0]["speculators"]
    logged = [r["loss"] for name in ("fused", "fused_resumes_upstream") for r in runs[name] if r["step"] != "val"]
    assert_console_shows(trainer_runs[1]["fused"], SPECULATORS_LOSS, logged, decimals=3)


# --- NeMo Automodel ---------------------------------------------------------------------


def nemo_config(root: Path, name: str, *, resume: str | None = None) -> Path:
    """A recipe YAML (recipe_args, as NeMo's DFlash 2 examples have them) for a tiny run."""
    lines = ["recipe: TrainDFlash2Recipe", "dist_env:", "  backend: gloo", "recipe_args:",
             f"  target_model_name_or_path: {root / 'verifier'}", f"  train_data_path: {root / 'chat.jsonl'}",
             "  seq_length: 48", "  micro_batch_size: 2", f"  num_epochs: {2 if resume else 1}",
             f"  output_dir: {root / 'nemo' / name}", "  block_size: 4", f"  mask_token_id: {data.MASK_TOKEN}",
             "  draft_num_hidden_layers: 1", f"  target_layer_ids: {data.TARGET_LAYER_IDS}",
             "  attention_backend: sdpa", "  num_anchors: 8", "  conv_kernel_size: 2", "  conv_group_size: 16",
             "  selector_rank: 16", "  selector_top_k: 8", "  log_every_steps: 1",
             "  save_checkpoint_every_epoch: true", "  shuffle_seed: 0", "optimizer:", "  lr: 1.0e-3"]
    if resume:
        lines += ["checkpoint:", f"  restore_from: {root / 'nemo' / resume / 'checkpoints' / f'epoch_1_step_{STEPS}'}"]
    path = root / "nemo" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def nemo_run(root: Path, name: str, *, resume: str | None, float64: bool) -> dict:
    return {"config": str(nemo_config(root, name, resume=resume)), "log": str(root / "nemo" / f"{name}.jsonl"),
            "float64": float64, "seed": 0}


# --- the three processes, both trainers in each -------------------------------------


RUNS = {  # process: its runs, in order (a resumed run names the run whose checkpoint it starts from)
    "kernels": [("kernels", None, False), ("kernels_resumed", "kernels", False)],
    "upstream": [("exact", None, True), ("upstream", None, False),
                 ("upstream_resumes_kernels", "kernels", False), ("exact_resumes_kernels", "kernels", True),
                 ("upstream_resumed", "upstream", False), ("exact_resumed", "upstream", True)],
    "fused": [("fused", None, False), ("fused_resumes_upstream", "upstream", False)],
}
LAUNCHERS = {"kernels": ["--on-unsupported", "fail"], "upstream": None, "fused": ["--fused-head"]}
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("speculators", "nemo_automodel", "torchdata")}


@pytest.fixture(scope="module")
def trainer_runs(workdir):
    """Every run of both trainers (those installed): {trainer: {run: records}}, and each
    process's output {process: text}."""
    trainers = [name for name, present in (("speculators", HAVE["speculators"]),
                                           ("nemo", HAVE["nemo_automodel"] and HAVE["torchdata"])) if present]
    if "speculators" in trainers:
        data.speculators_data(workdir / "speculators_data", workdir / "verifier")
    if "nemo" in trainers:
        (workdir / "nemo").mkdir()
        data.nemo_data(workdir / "chat.jsonl")
    output = {}
    for process, runs in RUNS.items():
        plan = []
        for name, resume, float64 in runs:
            if "speculators" in trainers:
                plan.append({"trainer": "speculators",
                             **speculators_run(workdir, name, resume=resume, float64=float64)})
            if "nemo" in trainers:
                plan.append({"trainer": "nemo", **nemo_run(workdir, name, resume=resume, float64=float64)})
        plan.sort(key=lambda spec: spec["trainer"] != "speculators")
        (workdir / f"{process}.json").write_text(json.dumps(plan))
        launcher = [] if LAUNCHERS[process] is None else dflash2_run(*LAUNCHERS[process])
        output[process] = child([*launcher, sys.executable, str(E2E / "driver.py"), str(workdir / f"{process}.json")],
                                workdir)
    names = [name for runs in RUNS.values() for name, _, _ in runs]
    records = {}
    if "speculators" in trainers:
        records["speculators"] = {name: speculators_records(workdir, name) for name in names}
    if "nemo" in trainers:
        records["nemo"] = {name: [json.loads(line) for line in (workdir / "nemo" / f"{name}.jsonl").read_text()
                                  .splitlines()] for name in names}
    return records, output


@needs("nemo_automodel", "torchdata")
def test_nemo_patched_losses_equal_unpatched(trainer_runs):
    assert_fresh_runs_agree(trainer_runs[0]["nemo"], trainer_runs[1], list(range(1, STEPS + 1)),
                            about="nemo-automodel 0.7.0", replaced="draft_qwen3_dflash2.CandidateSelector",
                            forward="DFlash2TrainerModule.forward")


@needs("nemo_automodel", "torchdata")
def test_nemo_checkpoints_resume_across_patching(trainer_runs):
    runs = trainer_runs[0]["nemo"]
    for name in ("kernels_resumed", "upstream_resumes_kernels", "upstream_resumed", "fused_resumes_upstream"):
        assert [(r["epoch"], r["step"]) for r in runs[name]] == [(1, s) for s in range(STEPS + 1, 2 * STEPS + 1)], \
            (name, runs[name])
    assert_within_contract(runs, RESUMED_PAIRS)


@needs("nemo_automodel", "torchdata")
def test_nemo_console_losses(trainer_runs):
    """The console's 4-decimal ``loss=`` (what the gpu test reads) is the logged loss."""
    logged = [r["loss"] for name in ("fused", "fused_resumes_upstream") for r in trainer_runs[0]["nemo"][name]]
    assert_console_shows(trainer_runs[1]["fused"], NEMO_LOSS, logged, decimals=4)


# --- the commands themselves, on a GPU --------------------------------------------------


def console_script(name: str) -> str:
    """An installed command: beside this Python's executable (a venv), else on the PATH (a
    ``pip install --target`` directory's bin/, as scripts/gpu_check.sh installs wheels)."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else (shutil.which(name) or str(beside))


@pytest.mark.gpu
@needs("speculators")
def test_speculators_train_command_on_gpu(workdir):
    """``speculators train`` as a user types it (its GPU defaults: flex attention, the
    fused Triton loss, torch.compile), unpatched and through ``dflash2-run --fused-head``,
    float32 hidden states; then the unpatched command resumes the patched run's checkpoint.
    The console prints 3 decimals; the two runs' losses agree within 0.5%."""
    data_path = workdir / "speculators_data"
    if not data_path.exists():
        data.speculators_data(data_path, workdir / "verifier")
    speculators = console_script("speculators")

    def argv(save: str, epochs: int) -> list[str]:
        args = speculators_argv(workdir, workdir / "gpu" / save, epochs)
        cpu_only = args.index("--loss-implementation")
        return [*args[:cpu_only], "--hidden-states-dtype", "float32"]

    upstream = printed_losses(child([speculators, "train", *argv("upstream", 1)], workdir), SPECULATORS_LOSS)
    output = child([*dflash2_run("--fused-head"), speculators, "train", *argv("fused", 1)], workdir)
    fused = printed_losses(output, SPECULATORS_LOSS)
    assert len(patch_messages(output, "speculators")) == 1, output
    assert len(upstream) == STEPS and fused == pytest.approx(upstream, rel=5e-3), (fused, upstream)
    shutil.copytree(workdir / "gpu" / "fused", workdir / "gpu" / "resumed", symlinks=True)
    resumed = child([speculators, "train", *argv("resumed", 2)], workdir)
    assert "Resuming training on epoch 1" in resumed, resumed[-3000:]
    assert len(printed_losses(resumed, SPECULATORS_LOSS)) == STEPS, resumed[-3000:]


@pytest.mark.gpu
@needs("nemo_automodel", "torchdata")
def test_nemo_automodel_command_on_gpu(workdir):
    """``automodel config.yaml --nproc-per-node 1`` (NeMo's CLI, which runs the recipe
    in-process for one device; its GPU defaults: bf16 compute, flex attention, NCCL),
    unpatched and through ``dflash2-run --fused-head``; then the unpatched command resumes
    the patched run's checkpoint. bf16 compute: the losses agree within 2%."""
    (workdir / "nemo").mkdir(exist_ok=True)
    if not (workdir / "chat.jsonl").exists():
        data.nemo_data(workdir / "chat.jsonl")
    automodel = console_script("automodel")

    def config(name: str, resume: str | None = None) -> str:
        path = nemo_config(workdir, f"gpu_{name}", resume=f"gpu_{resume}" if resume else None)
        cpu_only = ("dist_env:", "  backend: gloo", "  attention_backend: sdpa")
        path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if line not in cpu_only))
        return str(path)

    upstream = printed_losses(child([automodel, config("upstream"), "--nproc-per-node", "1"], workdir), NEMO_LOSS)
    output = child([*dflash2_run("--fused-head"), automodel, config("fused"), "--nproc-per-node", "1"], workdir)
    fused = printed_losses(output, NEMO_LOSS)
    assert len(patch_messages(output, "nemo-automodel")) == 1, output
    assert len(upstream) == STEPS and fused == pytest.approx(upstream, rel=2e-2), (fused, upstream)
    resumed = child([automodel, config("resumed", resume="fused"), "--nproc-per-node", "1"], workdir)
    assert "Resuming from checkpoint" in resumed and len(printed_losses(resumed, NEMO_LOSS)) == STEPS, resumed[-3000:]
