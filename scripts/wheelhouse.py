"""The wheels that speculators and NeMo Automodel need on the offline GPU machine, built and checked.

    python scripts/wheelhouse.py build [--out .whl] [--python-version 3.12] [--no-nemo] [--max-mib 40]
    python scripts/wheelhouse.py check [--wheels .whl] [--keep]

The GPU machine (the device tool's nvidia-h200: Python 3.12.3, torch 2.11.0, transformers
5.17.0, ...; requirements/gpu_image.txt lists what it holds) has no network and neither
upstream package. ``build`` resolves speculators 0.9.0 and NeMo Automodel 0.7.0 (the pins
of requirements/upstream.txt) down to what the image lacks: it downloads a wheel with
``pip download --no-deps`` for CPython 3.12 on manylinux x86_64, reads its METADATA's
Requires-Dist (markers evaluated for Linux x86_64 CPython 3.12; ``extra ==`` lines only for
extras asked for), skips what the image holds (never torch, torchvision, torchaudio,
triton, nvidia-*) and what LEFT_OUT names, and goes on with the rest. A version that needs
another version of an image package than the image's is passed over for an older one,
unless CARRY_OVER names that package (transformers: NeMo pins 5.18.0); the versions
requirements/upstream.txt pins, which the CPU tests run, are taken where allowed. One
version of each package (two stop the install). It prints every wheel with its size and
the total, fails above ``--max-mib`` (the wheels travel with the working tree: 64 MiB a
call, all paths together), and writes ``OUT/MANIFEST.txt`` (package, version, KiB, what
needs it, then the notes). Both packages fit: about 26 MiB, of which NeMo and what only
it needs (torchao, transformers 5.18.0, ...) are 19; ``--no-nemo`` leaves them out. On
the GPU machine::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

``check`` shows the bundle installs and imports on an environment like the image's, here
on the CPU. Binary wheels for 3.12 do not install on another Python, so it resolves the
same packages for the running interpreter, preferring the versions in ``--wheels`` (an
error if any name or version differs), installs them with the GPU's pip command into a
scratch ``site`` and runs ``smoke`` in ``python -S -s`` with a PYTHONPATH of only: that
``site``; the image's own versions of packages it holds at another version than the
venv's, where a wheel for this Python exists (huggingface-hub 1.33.0, tokenizers 0.23.2,
...); the venv's distributions that the image also holds (each one's top-level modules and
dist-info symlinked into a scratch ``image``: what the image lacks is not visible, so a
missing wheel fails the import instead of being found in the venv); and the repo
(dflash2_kernels, tests/upstream_models.py). ``smoke`` imports what the benchmarks, tests
and dflash2_kernels use of both packages, trains a step of a tiny DFlash 2 draft with
each (upstream, then with dflash2_kernels' fused head), and fails if any module came from
the venv's site-packages. Not stood in for: the image's versions with no wheel for this
Python (numpy 2.5.2; torch 2.11.0 is never downloaded), and those the image list does not
give (the build prints the requirements that leaves unverified).

Network: ``pip download`` only (the build machine has it; the GPU machine has none).
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "requirements" / "upstream.txt"
IMAGE_LIST = ROOT / "requirements" / "gpu_image.txt"
DEFAULT_OUT = ROOT / ".whl"
MANIFEST = "MANIFEST.txt"
BUILDING = ".building"  # build's scratch folder inside --out (the install's *.whl does not reach into it)
IMAGE_PYTHON = "3.12.3"  # /opt/torch/.venv/bin/python3 on the GPU machine
MAX_MIB = 40.0  # leaves room under the 64 MiB a device call carries for the tree itself
ROOTS = ("speculators",)
NEMO = "nemo-automodel"
PIP_TIMEOUT_S = 300
SMOKE_TIMEOUT_S = 300
# pip matches a manylinux_2_N tag only when N is named: the ones these wheels use.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# Never carried, whatever asks: the image's own CUDA build of them is what runs there.
NEVER = frozenset({"torch", "torchvision", "torchaudio", "triton"})
NEVER_PREFIXES = ("nvidia-",)

# Requirements of the upstream packages that are not carried: heavy, and imported by none
# of the modules the benchmarks, tests and dflash2_kernels use, which ``check`` proves by
# importing those without them (SPECULATORS_IMPORTS, NEMO_IMPORTS: speculators' package,
# command, dflash2 model, config, proposals, losses and trainer; NeMo's speculative.dflash
# modules, its `automodel` command and DFlash 2 recipe) and training a step.
LEFT_OUT = {
    # NeMo: only nemo_automodel/_transformers/tokenization/tokenization_mistral_common.py
    # imports it (Mistral tokenizers). 6.3 MiB, plus jsonschema, pydantic-extra-types and
    # pycountry; its newest release wants numpy<2.4 on Python 3.12 (the image has 2.5.2).
    "mistral-common": "NeMo's Mistral tokenizers only (6.3 MiB and more; wants numpy<2.4)",
    # NeMo: rope='quack' in its llama model, loaded lazily; its kernels need
    # nvidia-cutlass-dsl, which the image lacks and this bundle never carries (nvidia-*).
    "quack-kernels": "NeMo's rope='quack' only; needs nvidia-cutlass-dsl, never carried",
}

# Image packages carried at another version when a pick needs one the image lacks (rather
# than passing that pick over): name -> why that is the right call.
CARRY_OVER = {
    # NeMo Automodel 0.7.0 pins transformers==5.18.0 (the image: 5.17.0). Its dflash modules
    # run on 5.17.0, but its recipes do not: nemo_automodel._transformers.auto_config
    # imports transformers.utils.hub.resolve_revision, which 5.17.0 lacks (the `automodel`
    # command and TrainDFlash2Recipe, which tests/test_trainers_e2e.py runs). 5.18.0 (12 MiB)
    # is also the version the CPU venv tests (requirements/upstream.txt), and meets the
    # image's huggingface-hub 1.33.0, tokenizers 0.23.2 and safetensors 0.8.0.
    "transformers": "NeMo 0.7.0 pins ==5.18.0; its recipes import resolve_revision, new in 5.18.0",
}


class WheelhouseError(Exception):
    """A failure to report as one clear line (no traceback)."""


# --- what the image holds ---------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """The image's distributions: canonical name -> version, or None where not read."""

    versions: dict[str, str | None]

    def kind(self, name: str) -> str:
        """'never', 'image', 'left out' or 'bundle': what becomes of a requirement on ``name``."""
        name = canonicalize_name(name)
        if name in NEVER or name.startswith(NEVER_PREFIXES):
            return "never"
        if name in self.versions:
            return "image"
        if name in LEFT_OUT:
            return "left out"
        return "bundle"


def read_image(path: Path = IMAGE_LIST) -> Image:
    """requirements/gpu_image.txt: NAME or NAME==VERSION a line, '#' comments."""
    versions: dict[str, str | None] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = (part.strip() for part in line.partition("=="))
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", name) or (sep and not valid_version(version)):
            raise WheelhouseError(f"{path}:{number}: expected NAME or NAME==VERSION, got {line!r}")
        versions[canonicalize_name(name)] = version or None
    return Image(versions)


def valid_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def read_upstream(path: Path = UPSTREAM) -> dict[str, Requirement]:
    """requirements/upstream.txt's requirements by canonical name."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(req.name): req for req in map(Requirement, filter(None, lines))}


def pinned_versions(requirements: Iterable[Requirement]) -> dict[str, str]:
    """{name: version} for every ``name==version`` among ``requirements``."""
    pins = {}
    for req in requirements:
        exact = [spec.version for spec in req.specifier if spec.operator == "=="]
        if len(exact) == 1:
            pins[canonicalize_name(req.name)] = exact[0]
    return pins


# --- requirements and markers -----------------------------------------------------------


def full_python_version(python_version: str) -> str:
    """'3.12' -> '3.12.3' (the image's), '3.11' -> '3.11.0', 'X.Y.Z' unchanged."""
    parts = python_version.split(".")
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts) or parts[0] != "3":
        raise WheelhouseError(f"--python-version must be 3.Y or 3.Y.Z, got {python_version!r}")
    if len(parts) == 3:
        return python_version
    return IMAGE_PYTHON if IMAGE_PYTHON.startswith(python_version + ".") else python_version + ".0"


def marker_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker variables of CPython ``python_version`` on Linux x86_64."""
    full = full_python_version(python_version)
    return {
        "implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
        "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
        "platform_system": "Linux", "platform_version": "", "python_full_version": full,
        "python_version": ".".join(full.split(".")[:2]), "sys_platform": "linux",
    }


def active_requirements(lines: Iterable[str], environment: dict[str, str],
                        extras: Iterable[str] = ()) -> list[Requirement]:
    """The Requires-Dist ``lines`` that apply in ``environment``: no marker, or one true
    with no extra or one of ``extras`` (so ``extra == "dev"`` lines drop out unless asked)."""
    choices = ("", *sorted(extras))
    active = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**environment, "extra": extra}) for extra in choices):
            active.append(req)
    return active


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) of the wheel at ``path``."""
    name, version, _, _ = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.namelist() if m.count("/") == 1 and m.endswith(".dist-info/METADATA")]
        if len(members) != 1:
            raise WheelhouseError(f"{path.name}: expected one *.dist-info/METADATA, found {members}")
        metadata = email.parser.Parser().parsestr(archive.read(members[0]).decode("utf-8"))
    return canonicalize_name(name), str(version), metadata.get_all("Requires-Dist") or []


def wheels_by_name(directory: Path) -> dict[str, list[Path]]:
    """The ``*.whl`` files in ``directory``, by canonical distribution name."""
    found: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(directory.glob("*.whl")):
        found[canonicalize_name(parse_wheel_filename(path.name)[0])].append(path)
    return found


# --- downloading ------------------------------------------------------------------------


Fetch = Callable[[list[str], Path], None]


def pip_download(python_version: str) -> Fetch:
    """A fetch: ``pip download --no-deps`` of each requirement string for CPython
    ``python_version`` on manylinux x86_64, binary wheels only, into a directory."""
    def fetch(specs: list[str], dest: Path) -> None:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", python_version, "--implementation", "cp", "--progress-bar", "off",
                   "--disable-pip-version-check", "-q", *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest),
                   *specs]
        run_pip(command, f"pip download {' '.join(specs)}")
    return fetch


def run_pip(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise WheelhouseError(f"{what}: no answer in {PIP_TIMEOUT_S} s (no network?)") from error
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        hint = " (no index reachable, or no such release)" if "from versions: none" in output else ""
        tail = "\n".join(output.splitlines()[-6:])
        raise WheelhouseError(f"{what} failed (exit {done.returncode}){hint}:\n{tail}")


# --- resolving --------------------------------------------------------------------------


@dataclass
class Pick:
    """One wheel of the bundle, and the requirements it brings in the target environment."""

    name: str
    version: str
    path: Path
    requires: list[Requirement]
    extras: frozenset[str] = frozenset()
    needed_by: list[str] = field(default_factory=list)  # "speculators 0.9.0: datasets<=5.1.0,>=4.0.0"

    @property
    def size(self) -> int:
        return self.path.stat().st_size


@dataclass
class Resolution:
    """The bundle (picks, by name) and what the resolution says about the rest."""

    picks: dict[str, Pick]
    left_out: dict[str, list[str]] = field(default_factory=dict)  # name -> what asked for it
    carried: dict[str, str] = field(default_factory=dict)  # image package carried -> the image's version
    passed_over: list[str] = field(default_factory=list)  # versions refused for the image's versions
    # image package -> ["spec (requirer)"]: requirements on an image version not read
    unverified: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # requirements on what is neither there nor carried

    @property
    def total(self) -> int:
        return sum(pick.size for pick in self.picks.values())


def kind_of(name: str, image: Image, carried: set[str]) -> str:
    """Image.kind, but 'bundle' for the image packages carried at another version."""
    return "bundle" if name in carried else image.kind(name)


def image_shortfalls(requires: list[Requirement], image: Image, carried: set[str]) -> list[Requirement]:
    """The requirements among ``requires`` on an image package (not carried) whose read
    version they do not allow."""
    short = []
    for req in requires:
        name = canonicalize_name(req.name)
        version = image.versions.get(name)
        if version and kind_of(name, image, carried) in ("image", "never") and \
                not req.specifier.contains(Version(version).public, prereleases=True):
            short.append(req)
    return short


def resolve(roots: list[Requirement], image: Image, environment: dict[str, str], dest: Path, fetch: Fetch,
            prefer: dict[str, str] | None = None, max_tries: int = 8) -> Resolution:
    """Download into ``dest`` one wheel of every package that ``roots`` need, transitively,
    in ``environment``, and that the image lacks (Image.kind 'bundle').

    A candidate version is the one ``prefer`` names where every requirement seen allows
    it, else pip's newest allowed. One that needs another version of an image package
    than the image's is passed over (at most ``max_tries`` times a package), unless
    CARRY_OVER names that package: then it is carried too, at a version every requirement
    on it allows. Raises WheelhouseError when nothing fits or a final pick misses a
    requirement.
    """
    prefer = prefer or {}
    wanted: dict[str, SpecifierSet] = defaultdict(SpecifierSet)
    extras: dict[str, set[str]] = defaultdict(set)
    excluded: dict[str, set[str]] = defaultdict(set)
    needed_by: dict[str, list[str]] = defaultdict(list)
    picks: dict[str, Pick] = {}
    carried: set[str] = set()
    passed_over: list[str] = []
    pending: list[str] = []

    def want(req: Requirement, requirer: str) -> None:
        name = canonicalize_name(req.name)
        if kind_of(name, image, carried) != "bundle":
            return
        wanted[name] &= req.specifier
        extras[name] |= set(req.extras)
        needed_by[name].append(f"{requirer}: {req}")
        pending.append(name)

    def settled(name: str) -> bool:
        pick = picks.get(name)
        return (pick is not None and pick.version not in excluded[name] and extras[name] <= pick.extras
                and wanted[name].contains(pick.version, prereleases=True))

    def spec(name: str) -> str:
        preferred = prefer.get(name)
        if preferred and preferred not in excluded[name] and wanted[name].contains(preferred, prereleases=True):
            return f"{name}=={preferred}"
        clauses = [str(wanted[name])] if str(wanted[name]) else []
        clauses += [f"!={version}" for version in sorted(excluded[name])]
        return name + ",".join(clauses)

    for root in roots:
        want(root, "requirements/upstream.txt")
    while pending:
        todo = sorted({name for name in pending if not settled(name)})
        pending.clear()
        for name in todo:
            picks.pop(name, None)
            for stale in wheels_by_name(dest).get(name, []):
                stale.unlink()
        specs = {name: spec(name) for name in todo}
        try:
            fetch(list(specs.values()), dest)
        except WheelhouseError:
            for name, one in specs.items():  # one at a time, to name the one that fails
                try:
                    fetch([one], dest)
                except WheelhouseError as error:
                    raise WheelhouseError(f"no wheel of {one} for Python {environment['python_version']} "
                                          f"(needed by {'; '.join(needed_by[name])}): {error}") from error
        found = wheels_by_name(dest)
        for name in todo:
            if len(found.get(name, [])) != 1:
                raise WheelhouseError(f"pip download {specs[name]} left {found.get(name, [])} in {dest}")
            path = found[name][0]
            _, version, lines = wheel_metadata(path)
            requires = active_requirements(lines, environment, extras[name])
            short = image_shortfalls(requires, image, carried)
            stuck = [req for req in short if canonicalize_name(req.name) not in CARRY_OVER]
            if stuck:
                image_has = ", ".join(f"{req} (image: {image.versions[canonicalize_name(req.name)]})"
                                      for req in stuck)
                passed_over.append(f"{name} {version}: needs {image_has}")
                excluded[name].add(version)
                path.unlink()
                if len(excluded[name]) >= max_tries:
                    raise WheelhouseError(f"{name}: {len(excluded[name])} versions passed over, none fits the "
                                          f"image: {passed_over[-1]}")
                pending.append(name)
                continue
            picks[name] = Pick(name, version, path, requires, frozenset(extras[name]))
            for req in short:  # carried from now on, at what every pick asks of it
                carried.add(canonicalize_name(req.name))
                for pick in picks.values():
                    for earlier in pick.requires:
                        if canonicalize_name(earlier.name) == canonicalize_name(req.name) and pick.name != name:
                            want(earlier, f"{pick.name} {pick.version}")
            for req in requires:
                want(req, f"{name} {version}")
    resolution = audit(roots, picks, image, carried)
    resolution.passed_over = passed_over
    return resolution


def audit(roots: list[Requirement], picks: dict[str, Pick], image: Image, carried: set[str]) -> Resolution:
    """The final picks reached from ``roots`` (others' wheels deleted: left by a re-pick),
    each pick's ``needed_by`` from the final picks alone, and every requirement checked:
    a bundled one met by its pick, an image one by the image's version where read."""
    resolution = Resolution({})
    left_out: dict[str, list[str]] = defaultdict(list)
    unverified: dict[str, list[str]] = defaultdict(list)
    queue = [("requirements/upstream.txt", root) for root in roots]
    while queue:
        requirer, req = queue.pop(0)
        name = canonicalize_name(req.name)
        kind = kind_of(name, image, carried)
        version = image.versions.get(name)
        if kind == "left out":
            left_out[name].append(requirer)
        elif kind in ("image", "never"):
            if name not in image.versions:
                resolution.missing.append(f"{requirer} needs {req}: not in the image, and never carried")
            elif version is None and str(req.specifier):
                unverified[name].append(f"{req.specifier} ({requirer})")
            elif version and not req.specifier.contains(Version(version).public, prereleases=True):
                raise WheelhouseError(f"{requirer} needs {req}, the image has {version}")
        else:
            pick = picks.get(name)
            if pick is None or not req.specifier.contains(pick.version, prereleases=True):
                got = f"{pick.version}" if pick else "nothing"
                raise WheelhouseError(f"{requirer} needs {req}, the bundle has {got}")
            if name not in resolution.picks:
                resolution.picks[name] = pick
                pick.needed_by = []
                queue.extend((f"{name} {pick.version}", dep) for dep in pick.requires)
                if name in carried:
                    resolution.carried[name] = version
            pick.needed_by.append(f"{requirer}: {req}")
    for name, pick in picks.items():
        if name not in resolution.picks:
            pick.path.unlink(missing_ok=True)
    resolution.picks = dict(sorted(resolution.picks.items()))
    resolution.left_out = dict(sorted(left_out.items()))
    resolution.unverified = dict(sorted(unverified.items()))
    return resolution


# --- reporting --------------------------------------------------------------------------


def mib(size: int) -> float:
    return size / 2**20


def check_size(resolution: Resolution, max_mib: float) -> None:
    """Raise WheelhouseError when the wheels together are over ``max_mib`` MiB."""
    total = mib(resolution.total)
    if total > max_mib:
        raise WheelhouseError(f"the bundle is {total:.1f} MiB, above --max-mib {max_mib:g}: leave out more "
                              "(LEFT_OUT in scripts/wheelhouse.py) or build without NeMo (--no-nemo)")


def listing(resolution: Resolution) -> list[str]:
    """One line a wheel: name, version, KiB, the first requirer; then the total."""
    width = max((len(pick.path.name) for pick in resolution.picks.values()), default=0)
    lines = [f"  {pick.path.name:<{width}} {pick.size / 1024:>8.1f} KiB  <- {pick.needed_by[0]}"
             for pick in resolution.picks.values()]
    lines.append(f"  total: {len(resolution.picks)} wheels, {mib(resolution.total):.1f} MiB")
    return lines


def notes(resolution: Resolution) -> list[str]:
    """What was left out, carried over the image's, passed over, missing and left
    unverified, one line each."""
    lines = [f"left out {name} (needed by {', '.join(by)}): {LEFT_OUT[name]}"
             for name, by in resolution.left_out.items()]
    lines += [f"carried over the image's {name} {version}: {CARRY_OVER[name]}"
              for name, version in resolution.carried.items()]
    lines += [f"passed over: {line}" for line in resolution.passed_over]
    lines += [f"missing: {line}" for line in resolution.missing]
    lines += [f"unverified, the image's version not read: {name} {', '.join(specs)}"
              for name, specs in resolution.unverified.items()]
    return lines


def manifest_text(resolution: Resolution, python_version: str) -> str:
    """MANIFEST.txt: a header, 'name version KiB needed-by' a wheel, then the notes as comments."""
    lines = [f"# Wheels for CPython {full_python_version(python_version)} on manylinux x86_64, by "
             "scripts/wheelhouse.py build: what speculators (and NeMo Automodel) need beyond the GPU image",
             "# (requirements/gpu_image.txt). Install: python3 -m pip install -q --no-index --no-deps "
             "--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site",
             "# package version KiB needed-by"]
    for pick in resolution.picks.values():
        lines.append(f"{pick.name} {pick.version} {pick.size / 1024:.1f} {'; '.join(pick.needed_by)}")
    lines += [f"# {line}" for line in notes(resolution)]
    lines.append(f"# total: {len(resolution.picks)} wheels, {mib(resolution.total):.1f} MiB")
    return "\n".join(lines) + "\n"


# --- build ------------------------------------------------------------------------------


def roots_of(upstream: dict[str, Requirement], with_nemo: bool) -> list[Requirement]:
    names = ROOTS + ((NEMO,) if with_nemo else ())
    missing = [name for name in names if name not in upstream]
    if missing:
        raise WheelhouseError(f"{UPSTREAM} pins no {', '.join(missing)}")
    return [upstream[name] for name in names]


def prepare_out(out: Path) -> None:
    """``out`` must be absent or a wheelhouse (only wheels and the manifest in it)."""
    if out.exists() and not out.is_dir():
        raise WheelhouseError(f"--out {out} is a file, not a directory")
    if out.is_dir():
        shutil.rmtree(out / BUILDING, ignore_errors=True)  # an interrupted build's
        strangers = [p.name for p in out.iterdir() if not (p.suffix == ".whl" or p.name == MANIFEST)]
        if strangers:
            raise WheelhouseError(f"--out {out} holds more than wheels ({', '.join(strangers[:5])}): "
                                  "name an empty or wheel-only directory")
    out.mkdir(parents=True, exist_ok=True)


def build(out: Path, python_version: str, with_nemo: bool, max_mib: float,
          fetch: Fetch | None = None) -> Resolution:
    """Resolve, download, list and size-check the bundle, then replace ``out``'s wheels and
    manifest with it (``out`` is left as it was when anything fails)."""
    full_python_version(python_version)  # checks the argument before any download
    prepare_out(out)
    upstream = read_upstream()
    roots = roots_of(upstream, with_nemo)
    scratch = out / BUILDING
    scratch.mkdir()
    try:
        resolution = resolve(roots, read_image(), marker_environment(python_version), scratch,
                             fetch or pip_download(python_version), prefer=pinned_versions(upstream.values()))
        print(f"wheelhouse: {', '.join(map(str, roots))} for Python {python_version}, beyond the GPU image:")
        print("\n".join(listing(resolution)))
        for line in notes(resolution):
            print(f"  {line}")
        check_size(resolution, max_mib)
        for old in [*out.glob("*.whl"), out / MANIFEST]:
            old.unlink(missing_ok=True)
        for pick in resolution.picks.values():
            pick.path = Path(shutil.move(pick.path, out / pick.path.name))
        (out / MANIFEST).write_text(manifest_text(resolution, python_version))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return resolution


# --- check ------------------------------------------------------------------------------


def read_bundle(wheels: Path) -> dict[str, str]:
    """{name: version} of the wheels in ``wheels``; one version of each."""
    if not wheels.is_dir():
        raise WheelhouseError(f"--wheels {wheels} is not a directory: run `scripts/wheelhouse.py build` first")
    found = wheels_by_name(wheels)
    twice = {name: [p.name for p in paths] for name, paths in found.items() if len(paths) > 1}
    if twice:
        raise WheelhouseError(f"--wheels {wheels} holds two versions of {twice}: the install would stop")
    if not found:
        raise WheelhouseError(f"--wheels {wheels} holds no wheels: run `scripts/wheelhouse.py build` first")
    return {name: str(parse_wheel_filename(paths[0].name)[1]) for name, paths in found.items()}


def owners_of(site: Path) -> tuple[dict[tuple[str, ...], set[str]], dict[str, str]]:
    """For the distributions installed in ``site``: {path prefix: names of the distributions
    with files under it} (RECORD's files, relative to ``site``), and {name: version}."""
    owners: dict[tuple[str, ...], set[str]] = defaultdict(set)
    versions = {}
    for dist in importlib.metadata.distributions(path=[str(site)]):
        name = canonicalize_name(dist.metadata["Name"])
        versions[name] = dist.version
        for file in dist.files or ():  # no RECORD: nothing of it is exposed
            parts = Path(file).parts
            if parts and parts[0] not in ("..", "__pycache__"):
                for depth in range(1, len(parts) + 1):
                    owners[parts[:depth]].add(name)
    return owners, versions


def expose(site: Path, keep: set[str], dest: Path) -> None:
    """Symlink into ``dest`` what of ``site`` belongs to the distributions ``keep`` names:
    a top-level module or folder whole when only kept distributions own files there, else
    (a namespace shared with others) a real folder, filled the same way a level down."""
    owners, _ = owners_of(site)
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
    for prefix in owners:
        children[prefix[:-1]].append(prefix)

    def place(prefix: tuple[str, ...]) -> None:
        who = owners[prefix]
        if who <= keep:
            (dest.joinpath(*prefix)).symlink_to(site.joinpath(*prefix))
        elif who & keep:
            dest.joinpath(*prefix).mkdir()
            for child in sorted(children[prefix]):
                place(child)

    dest.mkdir(parents=True, exist_ok=True)
    for top in sorted(children[()]):
        place(top)


def image_stand_ins(image: Image, venv: dict[str, str], bundled: Iterable[str], dest: Path,
                    python_version: str) -> list[str]:
    """Download into ``dest`` the image's own version of each package it holds at a read
    version that differs from the venv's, where a wheel for ``python_version`` exists (not
    torch and the like, nor what the bundle carries); one line a package saying what
    stands in for it."""
    lines = []
    for name, version in sorted(image.versions.items()):
        if version is None or image.kind(name) == "never" or name not in venv or name in bundled:
            continue
        if Version(venv[name]) == Version(version):
            continue
        try:
            pip_download(python_version)([f"{name}=={version}"], dest)
            lines.append(f"{name}: the image's {version} (the venv has {venv[name]})")
        except WheelhouseError:
            lines.append(f"{name}: the venv's {venv[name]} (pip download of the image's {version} for Python "
                         f"{python_version} failed: no such wheel?)")
    return lines


def pip_install(wheels: Iterable[Path], target: Path) -> None:
    """The GPU machine's install command, into ``target``."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(target),
               *map(str, wheels)]
    run_pip(command, f"pip install --target {target}")


def check(wheels: Path, keep: bool = False) -> int:
    """Build the bundle of ``wheels``' packages and versions for this Python, install it,
    and run ``smoke`` on it and the image's stand-ins alone; the number of wheels."""
    artifact = read_bundle(wheels)
    upstream = read_upstream()
    roots = roots_of(upstream, NEMO in artifact)
    image = read_image()
    python_version = ".".join(map(str, sys.version_info[:3]))
    site = Path(sysconfig.get_paths()["purelib"])
    work = Path(tempfile.mkdtemp(prefix="wheelhouse-check-"))
    try:
        start = time.monotonic()
        resolution = resolve(roots, image, marker_environment(python_version), work / "bundle",
                             pip_download(python_version), prefer=artifact)
        here = {name: pick.version for name, pick in resolution.picks.items()}
        if here != artifact:
            differ = sorted(set(here.items()) ^ set(artifact.items()))
            raise WheelhouseError(f"for Python {python_version} the resolution differs from --wheels {wheels}: "
                                  f"{differ}; this check would not test what ships")
        print(f"wheelhouse check: the same {len(here)} packages and versions as {wheels}, for Python "
              f"{python_version} ({mib(resolution.total):.1f} MiB), {time.monotonic() - start:.0f} s")
        _, venv = owners_of(site)
        (work / "stand-ins").mkdir()
        for line in image_stand_ins(image, venv, artifact, work / "stand-ins", python_version):
            print(f"  image stand-in: {line}")
        stand_ins = set(wheels_by_name(work / "stand-ins"))
        # Neither what stands in nor what the bundle carries: nothing behind them to fall back on.
        expose(site, (set(image.versions) & set(venv)) - stand_ins - set(artifact), work / "image")
        pip_install(sorted((work / "bundle").glob("*.whl")), work / "site")
        if stand_ins:
            pip_install(sorted((work / "stand-ins").glob("*.whl")), work / "stand-ins-site")
        path = [work / "site", work / "stand-ins-site", work / "image", ROOT]
        env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR") if key in os.environ}
        env.update(PYTHONPATH=os.pathsep.join(map(str, path)), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-S", "-s", str(Path(__file__).resolve()), "smoke", "--forbid", str(site)]
        command += ["--nemo"] if NEMO in artifact else []
        print(f"  smoke: PYTHONPATH={env['PYTHONPATH']} {' '.join(command)}", flush=True)
        try:
            done = subprocess.run(command, env=env, cwd=work, timeout=SMOKE_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise WheelhouseError(f"smoke: not done in {SMOKE_TIMEOUT_S} s") from error
        if done.returncode != 0:
            raise WheelhouseError(f"smoke failed (exit {done.returncode}): the bundle does not import or train "
                                  "on the image's packages alone (output above)")
    finally:
        if keep:
            print(f"  kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return len(artifact)


# --- smoke (inside check's isolated interpreter) ----------------------------------------


# What the benchmarks, the tests and dflash2_kernels import of the upstream packages:
# {module: names it must have}.
SPECULATORS_IMPORTS = {
    # Its models package imports eagle3, whose data module imports speculators.train.data:
    # openai, datasets and hs_connectors at import time.
    "speculators": ("DFlash2DraftModel",),
    "speculators.__main__": ("app",),  # the `speculators` command (tests/e2e)
    # benchmarks/bench_step.py and tests/upstream_models.py
    "speculators.config": ("SpeculatorsConfig", "VerifierConfig"),
    "speculators.models.dflash2": ("DFlash2DraftModel", "DFlash2SpeculatorConfig", "core", "metrics"),
    "speculators.proposals.greedy": ("GreedyTokenProposalConfig",),
    # dflash2_kernels.compat.speculators_head
    "speculators.losses": ("utils", "dflash_loss_decay", "dpace_loss_decay", "compound_loss"),
    "speculators.models.metrics": ("compute_accepted_length_counts", "compute_accuracy_multi_step"),
    # tests/e2e/speculators_driver.py: `speculators train`
    "speculators.train.trainer": (),
    "speculators.train.checkpointer": (),
    "speculators.train.cli": (),
}
NEMO_IMPORTS = {
    # Its __init__ imports every dflash module (and, through them, NeMo's distributed
    # parallelizer, which imports megatron_fsdp where it is installed).
    "nemo_automodel.components.speculative.dflash": (),
    "nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2": ("Qwen3DFlash2DraftModel",
                                                                         "dflash2_rejection_sample"),
    "nemo_automodel.components.speculative.dflash.dflash2_core": ("DFlash2TrainerModule", "DFlash2StepMetrics"),
    "nemo_automodel.components.speculative.dflash.core": ("compute_acceptance_stats",),
    # tests/test_trainers_e2e.py: the `automodel` command and NeMo's DFlash 2 recipe
    "nemo_automodel.cli.app": ("main",),
    "nemo_automodel.recipes.llm.train_dflash2": ("TrainDFlash2Recipe",),
}


def smoke(forbid: Path, nemo: bool) -> None:
    """Import what the benchmarks and tests use of the upstream packages, and train one
    step of a tiny DFlash 2 draft (tests/upstream_models.py) upstream's way and with
    dflash2_kernels' fused head, on the CPU; fail if any module came from ``forbid``."""
    import torch

    for module, names in {**SPECULATORS_IMPORTS, **(NEMO_IMPORTS if nemo else {})}.items():
        missing = [name for name in names if not hasattr(importlib.import_module(module), name)]
        if missing:
            raise SystemExit(f"smoke: {module} has no {', '.join(missing)}")

    import dflash2_kernels as dk

    # By path: a wheel that ships a top-level ``tests`` package would shadow the repo's.
    spec = importlib.util.spec_from_file_location("upstream_models", ROOT / "tests" / "upstream_models.py")
    um = sys.modules["upstream_models"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(um)

    def step(loss: torch.Tensor, label: str) -> None:
        loss.backward()
        if not torch.isfinite(loss):
            raise SystemExit(f"smoke: {label}: loss {loss.item()}")
        print(f"  smoke: {label}: loss {loss.item():.4f}, backward done")

    batch = um.speculators_batch(0)
    step(um.speculators_loss(um.speculators_draft(0), batch)[0], "speculators DFlash2DraftModel step")
    fused = um.speculators_draft(0)
    dk.patch(fused, fused_head=True)
    step(um.speculators_loss(fused, batch)[0], "speculators step, dflash2_kernels fused head")
    if nemo:
        batch = um.nemo_batch(0)
        step(um.nemo_loss(um.nemo_trainer(um.nemo_draft(0), um.qwen3_target(0)), batch).loss,
             "NeMo DFlash2TrainerModule step")
        trainer = um.nemo_trainer(um.nemo_draft(0), um.qwen3_target(0, bias=False))
        dk.patch(trainer, fused_head=True)
        step(um.nemo_loss(trainer, batch).loss, "NeMo step, dflash2_kernels fused head")
    leaks = sorted(name for name, module in list(sys.modules.items())
                   if str(getattr(module, "__file__", None) or "").startswith(str(forbid)))
    if leaks:
        raise SystemExit(f"smoke: imported from {forbid} after all: {leaks[:10]}")
    for module, dist in (("speculators", "speculators"), ("nemo_automodel", "nemo-automodel"),
                         ("transformers", "transformers"), ("huggingface_hub", "huggingface-hub"),
                         ("torch", "torch"), ("dflash2_kernels", None)):
        if module in sys.modules:
            version = importlib.metadata.version(dist) if dist else "(the repo)"
            print(f"  smoke: {module} {version} from {Path(sys.modules[module].__file__).parent.parent}")


# --- command line -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_args = commands.add_parser("build", help="download the bundle into --out")
    build_args.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the wheelhouse directory (.whl)")
    build_args.add_argument("--python-version", default="3.12", help="the target CPython, 3.Y or 3.Y.Z (3.12)")
    build_args.add_argument("--no-nemo", action="store_true", help="speculators alone, without NeMo Automodel")
    build_args.add_argument("--max-mib", type=float, default=MAX_MIB, help=f"fail above this size ({MAX_MIB:g})")
    check_args = commands.add_parser("check", help="install and import the bundle on the image's packages alone")
    check_args.add_argument("--wheels", type=Path, default=DEFAULT_OUT, help="the built wheelhouse (.whl)")
    check_args.add_argument("--keep", action="store_true", help="keep the scratch directories")
    smoke_args = commands.add_parser("smoke", help="(run by check, in its isolated interpreter)")
    smoke_args.add_argument("--forbid", type=Path, required=True, help="no module may come from here")
    smoke_args.add_argument("--nemo", action="store_true", help="NeMo Automodel too")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # in order with pip's and the smoke's output
    start = time.monotonic()
    try:
        if args.command == "build":
            resolution = build(args.out.resolve(), args.python_version, not args.no_nemo, args.max_mib)
            print(f"wheelhouse: {len(resolution.picks)} wheels, {mib(resolution.total):.1f} MiB, built in "
                  f"{args.out} for Python {args.python_version} ({time.monotonic() - start:.0f} s)")
        elif args.command == "check":
            count = check(args.wheels.resolve(), args.keep)
            size = sum(path.stat().st_size for path in args.wheels.glob("*.whl"))
            print(f"wheelhouse: {count} wheels, {mib(size):.1f} MiB, imports ok ({time.monotonic() - start:.0f} s)")
        else:
            smoke(args.forbid, args.nemo)
    except WheelhouseError as error:
        print(f"wheelhouse: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
