"""``dflash2-run`` and the startup hook it relies on (dflash2_kernels_startup): installed by
the package's own install, inert unless ``DFLASH2_PATCH`` is set, patching every process
of a command (torchrun's two workers here) before a model is built, and refusing, or
running unpatched, as asked, an upstream version it was not tested against.

The trainers' own loops through the launcher: tests/test_trainers_e2e.py. Child
processes, each with a timeout; a fake ``speculators`` 9.9.9 (a distribution's metadata
and an empty ``speculators.models.dflash2``, first on PYTHONPATH) stands for an untested
version.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dflash2_kernels_startup as startup
from dflash2_kernels_startup import launcher

from .e2e.install import needs_install

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
# The console script (fast: it imports neither torch nor dflash2_kernels), where the
# environment has one; `python -m dflash2_kernels.run` is tested in test_launcher_usage.
SCRIPT = Path(sys.executable).with_name("dflash2-run")
DFLASH2_RUN = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "dflash2_kernels.run"]
MODULES = ("import sys; "
           "print(sorted(m for m in ('torch', 'dflash2_kernels', 'dflash2_kernels_startup') if m in sys.modules))")


def run(command: list[str], *, patch: str | None = None, pythonpath: list[Path] = (), cwd: Path = ROOT):
    """``command`` in a child process with DFLASH2_PATCH=``patch`` (unset: None)."""
    env = {key: value for key, value in os.environ.items() if key != "DFLASH2_PATCH"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*pythonpath, ROOT, *filter(None, [env.get("PYTHONPATH")])]))
    if patch is not None:
        env["DFLASH2_PATCH"] = patch
    try:
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{command} ran past {TIMEOUT_S} s:\n{error.stdout}\n{error.stderr}")


def said(stderr: str) -> list[str]:
    """What the hook said in each process: [(pid, rank or None, message)]."""
    return re.findall(r"^dflash2_kernels \(pid (\d+)(?:, rank (\d+))?\): (.*)$", stderr, re.MULTILINE)


def test_settings_round_trip():
    for value in ("1", "kernels", "fused_head", "fused_head,nemo", "speculators,on_unsupported=run,any_version"):
        settings = startup.Settings.parse(value)
        assert startup.Settings.parse(settings.value()).value() == settings.value()
    assert startup.Settings.parse("fused_head").fused_head and not startup.Settings.parse("1").fused_head
    assert startup.Settings.parse("nemo").packages == ("nemo",)
    assert startup.Settings.parse("kernels").packages == ("speculators", "nemo")
    assert startup.Settings.parse("on_unsupported=run").on_unsupported == "run"
    for off in ("", "0", "off", " false ", "no"):
        assert startup.Settings.parse(off) is None
    for bad in ("fused-head", "kernels,on_unsupported=maybe", "megatron"):
        with pytest.raises(ValueError, match=re.escape(repr(bad.split(",")[-1]))):
            startup.Settings.parse(bad)


def test_tested_versions_are_the_pinned_ones():
    pins = dict(line.split("==") for line in (ROOT / "requirements" / "upstream.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for upstream in startup.PACKAGES.values():
        assert upstream.tested == (pins[upstream.distribution],)


@needs_install
def test_the_hook_is_installed_with_the_package():
    """pip's install (editable here, as `make env` does) put the .pth in site-packages."""
    location = launcher.hook_location()
    assert location is not None, "no dflash2_kernels_startup.pth in site-packages: reinstall the package"
    installed = (Path(location) / "dflash2_kernels_startup.pth").read_text()
    assert installed == (ROOT / "dflash2_kernels_startup.pth").read_text()


@needs_install
def test_inert_unless_set():
    """Unset or off, nothing of ours is imported; set, only the hook, and nothing is said
    (the process imports neither upstream package)."""
    for patch, loaded in ((None, []), ("0", ["dflash2_kernels_startup"]), ("fused_head", ["dflash2_kernels_startup"])):
        result = run([sys.executable, "-c", MODULES], patch=patch)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.replace("'", '"')) == loaded, (patch, result.stdout)
        assert said(result.stderr) == [], result.stderr


@pytest.fixture
def untested_speculators(tmp_path) -> Path:
    """A directory holding speculators 9.9.9: its metadata and an empty dflash2 model package."""
    package = tmp_path / "speculators" / "models" / "dflash2"
    package.mkdir(parents=True)
    for directory in (package, package.parent, package.parent.parent):
        (directory / "__init__.py").write_text("")
    (package / "__init__.py").write_text("print('imported speculators.models.dflash2')\n")
    info = tmp_path / "speculators-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: speculators\nVersion: 9.9.9\n")
    return tmp_path


IMPORT_SPECULATORS = [sys.executable, "-c", "import speculators.models.dflash2"]
UNTESTED = "speculators 9.9.9 is not a version dflash2_kernels was tested against (0.9.0)"


@needs_install
def test_untested_version_fails_or_runs_unpatched(untested_speculators):
    fake = [untested_speculators]
    failed = run(IMPORT_SPECULATORS, patch="fused_head", pythonpath=fake)
    assert failed.returncode != 0 and "PatchError" in failed.stderr and UNTESTED in failed.stderr, failed.stderr
    assert "on_unsupported=run" in failed.stderr  # how to run it anyway

    unpatched = run(IMPORT_SPECULATORS, patch="fused_head,on_unsupported=run", pythonpath=fake)
    assert unpatched.returncode == 0, unpatched.stderr
    assert "imported speculators.models.dflash2" in unpatched.stdout
    [(_, _, message)] = said(unpatched.stderr)
    assert message.startswith("speculators not patched: " + UNTESTED) and "running unpatched" in message

    # The launcher checks before it runs anything, in the environment it was started in.
    refused = run([*DFLASH2_RUN, "--package", "speculators", "--", *IMPORT_SPECULATORS], pythonpath=fake)
    assert refused.returncode == 2 and UNTESTED in refused.stderr, refused.stderr
    assert "imported" not in refused.stdout
    ran = run([*DFLASH2_RUN, "--on-unsupported", "run", "--", *IMPORT_SPECULATORS], pythonpath=fake)
    assert ran.returncode == 0 and "imported speculators.models.dflash2" in ran.stdout, ran.stderr
    assert "running unpatched" in ran.stderr


@needs_install
def test_a_bad_switch_or_a_failed_patch_fails_the_import(untested_speculators):
    fake = [untested_speculators]
    bad = run(IMPORT_SPECULATORS, patch="fused-head", pythonpath=fake)
    assert bad.returncode != 0 and "PatchError" in bad.stderr and "unknown item 'fused-head'" in bad.stderr
    # any_version lets the patch try: this speculators has none of the names it replaces.
    failed = run(IMPORT_SPECULATORS, patch="kernels,any_version", pythonpath=fake)
    assert failed.returncode != 0 and "patch_speculators failed: ImportError" in failed.stderr, failed.stderr


def no_exec(*args):
    raise AssertionError(f"the launcher ran {args} where it should have refused")


def test_launcher_refuses_a_missing_package(monkeypatch, capsys):
    monkeypatch.setattr(os, "execvpe", no_exec)
    monkeypatch.setattr(launcher, "hook_location", lambda: "site-packages")
    monkeypatch.setattr(startup, "installed_version", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    assert launcher.main(["--package", "nemo", "--", "true"]) == 2
    assert "nemo-automodel is not installed here" in capsys.readouterr().err
    assert launcher.main(["--", "true"]) == 2  # neither of the two
    assert "speculators and nemo-automodel are not installed here" in capsys.readouterr().err


def test_launcher_usage(monkeypatch, capsys):
    monkeypatch.setattr(os, "execvpe", no_exec)
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["--fused-head"])
    assert exit_.value.code == 2 and "give the command to run after `--`" in capsys.readouterr().err
    assert launcher.main(["--fused-head", "--package", "nemo", "--print-env"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == "DFLASH2_PATCH=kernels,fused_head,nemo,on_unsupported=fail"
    assert startup.Settings.parse(printed.partition("=")[2]).packages == ("nemo",)
    missing = run([sys.executable, "-m", "dflash2_kernels.run", "--on-unsupported", "run", "--",
                   "no-such-command-dflash2"])
    assert missing.returncode == 127 and "cannot run 'no-such-command-dflash2'" in missing.stderr


UPSTREAM_TEARDOWN_ABORT = "terminate called without an active exception"


def _teardown_abort_note(stderr: str, out: Path) -> str:
    """A failure message's first line when a rank aborted at exit after both ranks wrote
    their records: the upstream gloo teardown abort (docs/distributed.md), not our ops."""
    if UPSTREAM_TEARDOWN_ABORT in stderr and all((out / f"rank{rank}.json").exists() for rank in (0, 1)):
        return ("both ranks finished and wrote their records, then one aborted at exit: the upstream gloo "
                "teardown abort (docs/distributed.md, scripts/repro_gloo_teardown_abort.py), not a failure "
                "of our ops\n")
    return ""


@needs_install
@pytest.mark.skipif(importlib.util.find_spec("speculators") is None, reason="needs speculators")
@pytest.mark.skipif(bool(os.environ.get("DFLASH2_EXTENSION_PATH")),
                    reason="three processes: run once, on the installed build (the sanitized half runs the ops' tests)")
def test_torchrun_workers_are_patched(tmp_path):
    """``dflash2-run --fused-head -- torchrun --nproc-per-node 2 ...``: both workers build a
    speculators draft the usual way and get ours, and train a DDP step (gloo) on our ops;
    torchrun's agent, which never imports speculators, patches nothing."""
    torchrun = Path(sys.executable).with_name("torchrun")
    assert SCRIPT.exists() and torchrun.exists(), "the venv's console scripts (make env)"
    result = run([str(SCRIPT), "--fused-head", "--", str(torchrun), "--standalone", "--nproc-per-node", "2",
                  str(ROOT / "tests" / "e2e" / "build_draft.py"), str(tmp_path)])
    assert result.returncode == 0, _teardown_abort_note(result.stderr, tmp_path) + result.stderr[-6000:]
    messages = said(result.stderr)
    assert sorted(rank for _, rank, _ in messages) == ["0", "1"], result.stderr
    assert len({pid for pid, _, _ in messages}) == 2
    for _, _, message in messages:
        assert message.startswith("patched speculators 0.9.0 (kernels + fused head) before any model is built")
        assert message.endswith("speculators.models.dflash2.core.DFlash2DraftModel.forward")
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["modules"] == ["dflash2_kernels.modules.CandidateSelector",
                                     "dflash2_kernels.modules.GroupedDynamicCausalConv"], record
        assert record["forward"] == "dflash2_kernels.compat.speculators_head", record
        for op in ("grouped_dynamic_conv", "grouped_dynamic_conv_backward", "selector_scores", "draft_head",
                   "draft_head_backward"):
            assert record["ops"].get(op, 0) > 0, (op, record)
        assert record["loss"] > 0


@needs_install
@pytest.mark.skipif(None in (importlib.util.find_spec("speculators"), importlib.util.find_spec("nemo_automodel")),
                    reason="needs speculators and nemo_automodel")
def test_example_scripts(tmp_path):
    """examples/dflash2_run_*.sh start the trainers' commands through dflash2-run: stand-ins
    for `speculators`, `torchrun` and `automodel` print the switch and their arguments."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("speculators", "torchrun", "automodel"):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $DFLASH2_PATCH $*"\n')
        (stubs / name).chmod(0o755)
    env_path = os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    switch = "kernels,fused_head,on_unsupported=fail"
    cases = {("dflash2_run_speculators.sh", "1"): f"speculators {switch} train --config c.yaml",
             ("dflash2_run_speculators.sh", "8"): f"torchrun {switch} --nproc-per-node 8 -m speculators.train "
                                                  "--config c.yaml",
             ("dflash2_run_nemo.sh", "2"): f"automodel {switch} c.yaml --nproc-per-node 2"}
    for (script, gpus), expected in cases.items():
        result = subprocess.run(["bash", str(ROOT / "examples" / script), "c.yaml", gpus], capture_output=True,
                                text=True, timeout=TIMEOUT_S, env={**os.environ, "PATH": env_path})
        assert result.returncode == 0 and result.stdout.strip() == expected, (script, result.stdout, result.stderr)
