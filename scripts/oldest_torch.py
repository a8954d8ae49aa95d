"""The op tests against the oldest torch the package supports (pyproject.toml's floor), on the CPU.

    python scripts/oldest_torch.py prepare [--background]   # the venv: torch OLDEST_TORCH, numpy, pytest
    python scripts/oldest_torch.py test [PYTEST ARGS]       # build a copy of the tree against it, run OP_TESTS

``make test`` runs both: ``prepare --background`` first, so that the download (PyPI has
no CPU build of torch 2.5.1: its CUDA wheels, about 3.3 GB with the nvidia libraries it
loads at import) overlaps the suite, and ``test`` last, which waits for it. ``test``
copies the working tree (tracked files and untracked ones git does not ignore) to
build/oldest-torch/src, installs that copy into the venv with ``pip install
--no-build-isolation --no-deps -e .`` (a CPU build: DFLASH2_BUILD_CUDA=0, since no CUDA
toolkit matches that torch's CUDA here), and runs the op tests there, so that the main
venv's build is left alone. ``OLDEST_TORCH=skip`` skips both steps, saying so (for a
machine without access to PyPI); CI never sets it.

What the old stack cannot run is skipped by the tests themselves, with the reason
(tests/conftest.py: Triton 3.1's interpreter fails under numpy 2, so the Triton kernels'
interpreter cases do not run there; they run under the newest torch, and compiled for
every architecture in tests/test_triton_aot.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLDEST_TORCH = "2.5.1"
VENV = ROOT / ".venv-oldest"
WORK = ROOT / "build" / "oldest-torch"
SOURCE = WORK / "src"
LOG = WORK / "prepare.log"
STATUS = WORK / "prepare.status"  # the exit code of the last prepare, once it is done
READY = VENV / ".ready"
# The op tests: every op's numerics and its torch.library op (the suite's other files need the
# upstream trainers or torch.distributed features of newer releases).
OP_TESTS = [
    "tests/test_conv_numerics.py",
    "tests/test_conv_cpp_op.py",
    "tests/test_conv_op.py",
    "tests/test_conv_compile_structure.py",
    "tests/test_selector_numerics.py",
    "tests/test_selector_api.py",
    "tests/test_serving.py",
    "tests/test_head.py",
    "tests/test_head_op.py",
    "tests/test_head_triton.py",
    "tests/test_head_topk.py",
]
PACKAGES = ["numpy<2", "pytest", "ninja", "setuptools", "wheel"]
PREPARE_TIMEOUT_S = 40 * 60


def floor_of_pyproject() -> str:
    """The X.Y of pyproject.toml's ``torch>=X.Y``."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch>=(\d+\.\d+)"', text)
    if not match:
        raise SystemExit("pyproject.toml names no torch>=X.Y dependency")
    return match.group(1)


def skipped() -> bool:
    if os.environ.get("OLDEST_TORCH", "").lower() == "skip":
        print(f"oldest torch: skipped (OLDEST_TORCH=skip): torch {OLDEST_TORCH} was not tested", flush=True)
        return True
    return False


def _python() -> Path:
    return VENV / "bin" / "python"


def prepare() -> int:
    """Create the venv and install OLDEST_TORCH and the test tools (a no-op once done)."""
    WORK.mkdir(parents=True, exist_ok=True)
    if READY.exists():
        STATUS.write_text("0")
        return 0
    start = time.monotonic()
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(_python()), "-m", "pip", "install", "--quiet", f"torch=={OLDEST_TORCH}", *PACKAGES]]
    code = 0
    with LOG.open("a") as log:
        for step in steps:
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            code = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
            if code:
                break
        log.write(f"prepare: exit {code} after {time.monotonic() - start:.0f} s\n")
    if not code:
        READY.touch()
    STATUS.write_text(str(code))
    return code


def prepare_in_background() -> int:
    """Start prepare() in a detached process; test() waits for its STATUS."""
    WORK.mkdir(parents=True, exist_ok=True)
    STATUS.unlink(missing_ok=True)
    LOG.write_text("")
    with LOG.open("a") as log:
        subprocess.Popen([sys.executable, __file__, "prepare"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                         start_new_session=True)
    print(f"oldest torch: installing torch {OLDEST_TORCH} into {VENV.name} in the background ({LOG})", flush=True)
    return 0


def _wait_for_prepare() -> int:
    if not STATUS.exists() and not LOG.exists():
        return prepare()
    deadline = time.monotonic() + PREPARE_TIMEOUT_S
    while not STATUS.exists():
        if time.monotonic() > deadline:
            print(f"oldest torch: the install did not finish within {PREPARE_TIMEOUT_S} s ({LOG})", flush=True)
            return 1
        time.sleep(5)
    return int(STATUS.read_text() or 1)


def _copy_tree() -> None:
    """The working tree's files (tracked, and untracked ones git does not ignore) into
    SOURCE, with their times (so that ninja rebuilds only what changed since last time)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    wanted = {name for name in listed if name and (ROOT / name).is_file()}
    if SOURCE.exists():
        for path in list(SOURCE.rglob("*")):
            relative = path.relative_to(SOURCE).as_posix()
            if path.is_file() and relative not in wanted and not relative.startswith(("build/", "dflash2_kernels/_C")) \
                    and "__pycache__" not in relative and ".egg-info" not in relative:
                path.unlink()
    for name in sorted(wanted):
        target = SOURCE / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def test(pytest_args: list[str]) -> int:
    code = _wait_for_prepare()
    if code:
        print(f"oldest torch: installing torch {OLDEST_TORCH} failed (exit {code}); its log:\n{LOG.read_text()[-4000:]}",
              flush=True)
        return code
    floor = floor_of_pyproject()
    if not OLDEST_TORCH.startswith(floor + "."):
        print(f"oldest torch: pyproject.toml promises torch>={floor} but this script tests {OLDEST_TORCH}", flush=True)
        return 1
    _copy_tree()
    env = {**os.environ, "DFLASH2_BUILD_CUDA": "0"}
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    start = time.monotonic()
    build = subprocess.run([str(_python()), "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
                            "-e", "."], cwd=SOURCE, env=env)
    if build.returncode:
        print(f"oldest torch: the CPU build against torch {OLDEST_TORCH} failed", flush=True)
        return build.returncode
    print(f"oldest torch: built against torch {OLDEST_TORCH} in {time.monotonic() - start:.0f} s", flush=True)
    versions = subprocess.run([str(_python()), "-c", "import torch, numpy; import importlib.util as u; "
                               "t = u.find_spec('triton') and __import__('triton').__version__; "
                               "print(f'torch {torch.__version__}, triton {t}, numpy {numpy.__version__}')"],
                              cwd=SOURCE, env=env, capture_output=True, text=True)
    print(f"oldest torch: {versions.stdout.strip() or versions.stderr.strip()[-500:]}", flush=True)
    args = pytest_args or OP_TESTS
    return subprocess.run([str(_python()), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=SOURCE,
                          env=env).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("prepare", "test"))
    parser.add_argument("--background", action="store_true", help="prepare: start the install and return")
    args, rest = parser.parse_known_args(argv)
    if skipped():
        return 0
    if args.step == "prepare":
        return prepare_in_background() if args.background else prepare()
    return test(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
