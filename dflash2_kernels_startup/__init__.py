"""dflash2_kernels' startup hook: patch speculators and NeMo Automodel as they are imported,
in every Python process of this environment that has ``DFLASH2_PATCH`` set. The launcher
that sets it, ``dflash2-run``, is :mod:`.launcher`. Neither imports torch.

``dflash2_kernels_startup.pth``, at the top of site-packages (``pip install .`` and the
editable ``pip install -e .`` both put it there, see setup.py), imports this package when
``DFLASH2_PATCH`` is set, and calls :func:`install`; unset or empty, the hook costs one
environment lookup per interpreter start and imports nothing. Set to anything but an
off value (``0``, ``off``, ``false``, ``no``), :func:`install` puts a finder at the head
of ``sys.meta_path`` and returns: still nothing of torch or of dflash2_kernels is
imported. When a process imports the
upstream package that defines the DFlash 2 classes (``speculators.models.dflash2``,
``nemo_automodel.components.speculative.dflash``), the finder lets it execute, then
imports ``dflash2_kernels`` and calls ``dk.patch_speculators`` / ``dk.patch_nemo``
before anything else can use it, so every model the trainer builds is built from ours;
the process says so once on stderr. Processes that never import either package
(torchrun's agent, compile workers, pip) only carry the idle finder.

``DFLASH2_PATCH``: comma-separated items (``dflash2-run`` writes it from its options):

=======================  ==================================================================
``kernels`` (or ``1``)   the conv, the selector and the serving path (always, when set)
``fused_head``           also the trainers' fused draft head (``fused_head=True``)
``speculators``/``nemo`` patch only these packages (default: each one a process imports)
``on_unsupported=fail``  (default) an upstream version this package was not tested
                         against, or a patch that fails: the import of that package
                         raises :class:`PatchError`, so the command fails
``on_unsupported=run``   the same says why on stderr and the process runs unpatched
``any_version``          patch untested versions too (patch_* still refuse a layout
                         they do not know)
=======================  ==================================================================

A malformed value fails the same way as an unsupported package (and only then: a
process that imports neither package is left alone), never silently.
"""

from __future__ import annotations

import os
import sys

ENV = "DFLASH2_PATCH"
OFF_VALUES = frozenset({"", "0", "off", "false", "no"})
ON_UNSUPPORTED = ("fail", "run")


class _Upstream:
    """One upstream package: its distribution name, the tested versions, the module whose
    import triggers the patch (it imports every module the patch replaces names in), and
    the dflash2_kernels function that patches it."""

    __slots__ = ("distribution", "tested", "trigger", "patch")

    def __init__(self, distribution: str, tested: tuple[str, ...], trigger: str, patch: str):
        self.distribution, self.tested, self.trigger, self.patch = distribution, tested, trigger, patch


# The tested versions are requirements/upstream.txt's pins (tests/test_launcher.py checks them).
PACKAGES = {
    "speculators": _Upstream("speculators", ("0.9.0",), "speculators.models.dflash2", "patch_speculators"),
    "nemo": _Upstream("nemo-automodel", ("0.7.0",), "nemo_automodel.components.speculative.dflash", "patch_nemo"),
}


class PatchError(RuntimeError):
    """A process asked to run patched (``DFLASH2_PATCH``, ``on_unsupported=fail``) imported an
    upstream package that could not be patched. Raised from that import, so the command fails
    before it builds a model. Not an ImportError: code that tolerates a missing optional package
    must not swallow it."""


class Settings:
    """What ``DFLASH2_PATCH`` asks for. :meth:`parse` reads a value, :meth:`value` writes one."""

    __slots__ = ("fused_head", "packages", "on_unsupported", "any_version")

    def __init__(self, *, fused_head: bool = False, packages: tuple[str, ...] = tuple(PACKAGES),
                 on_unsupported: str = "fail", any_version: bool = False):
        unknown = [name for name in packages if name not in PACKAGES]
        if unknown or not packages:
            raise ValueError(f"packages must be a non-empty subset of {sorted(PACKAGES)}, got {list(packages)}.")
        if on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {on_unsupported!r}.")
        self.fused_head = bool(fused_head)
        self.packages = tuple(name for name in PACKAGES if name in packages)
        self.on_unsupported = on_unsupported
        self.any_version = bool(any_version)

    @classmethod
    def parse(cls, value: str) -> "Settings | None":
        """The settings a ``DFLASH2_PATCH`` value asks for; None for an off value.
        ValueError naming the item for anything it does not know."""
        if value.strip().lower() in OFF_VALUES:
            return None
        fused_head = any_version = False
        packages: list[str] = []
        on_unsupported = "fail"
        for item in (part.strip() for part in value.split(",")):
            key, _, setting = item.partition("=")
            if item in ("", "kernels", "1", "on", "true", "yes"):
                continue
            if item == "fused_head":
                fused_head = True
            elif item == "any_version":
                any_version = True
            elif item in PACKAGES:
                packages.append(item)
            elif key == "on_unsupported" and setting in ON_UNSUPPORTED:
                on_unsupported = setting
            else:
                raise ValueError(
                    f"{ENV}={value!r}: unknown item {item!r}; known: kernels, fused_head, "
                    f"{', '.join(PACKAGES)}, on_unsupported=fail|run, any_version.")
        return cls(fused_head=fused_head, packages=tuple(packages) or tuple(PACKAGES),
                   on_unsupported=on_unsupported, any_version=any_version)

    def value(self) -> str:
        """The ``DFLASH2_PATCH`` value that :meth:`parse` reads back as these settings."""
        items = ["kernels"] + (["fused_head"] if self.fused_head else [])
        if self.packages != tuple(PACKAGES):
            items += list(self.packages)
        items.append(f"on_unsupported={self.on_unsupported}")
        return ",".join(items + (["any_version"] if self.any_version else []))


def top_level(name: str) -> str:
    """The import name of upstream package ``name`` (a key of PACKAGES)."""
    return PACKAGES[name].trigger.partition(".")[0]


def installed_version(name: str) -> str | None:
    """The installed version of upstream package ``name`` (a key of PACKAGES), from its
    metadata without importing it; None when it has none (not installed, or a bare checkout)."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGES[name].distribution)
    except metadata.PackageNotFoundError:
        return None


def version_problem(name: str, version: str | None, settings: Settings) -> str | None:
    """Why ``name`` at ``version`` is not to be patched under ``settings``, or None."""
    upstream = PACKAGES[name]
    if settings.any_version:
        return None
    if version is None:
        return (f"no installed {upstream.distribution} distribution found (its version is unknown; "
                f"tested: {', '.join(upstream.tested)}; any_version patches it anyway)")
    if version not in upstream.tested:
        return (f"{upstream.distribution} {version} is not a version dflash2_kernels was tested against "
                f"({', '.join(upstream.tested)}); any_version (dflash2-run --any-version) patches it anyway")
    return None


def _process() -> str:
    rank = os.environ.get("RANK")
    return f"pid {os.getpid()}" + (f", rank {rank}" if rank is not None else "")


def say(message: str) -> None:
    """One message on stderr, naming this process (and its torchrun rank)."""
    sys.stderr.write(f"dflash2_kernels ({_process()}): {message}\n")
    sys.stderr.flush()


def _summary(name: str, version: str | None, settings: Settings, report) -> str:
    names = [replacement.name for replacement in report.replaced] + list(report.already)
    what = "kernels + fused head" if report.fused_head else "kernels"
    if settings.fused_head and not report.fused_head:
        what += " (fused head asked for, not installed)"
    skipped = f"; {len(report.skipped)} left alone: " + "; ".join(
        f"{s.name} ({s.reason})" for s in report.skipped) if report.skipped else ""
    return (f"patched {PACKAGES[name].distribution} {version or '(version unknown)'} ({what}) before any model "
            f"is built: {', '.join(names)}{skipped}")


def patch_package(name: str, settings: Settings) -> None:
    """Patch upstream package ``name`` (its trigger module imported) as ``settings`` ask, and
    say what was done; PatchError (``on_unsupported=fail``) or a message (``run``) when it
    cannot be."""
    version = installed_version(name)
    problem = version_problem(name, version, settings)
    if problem is None:
        try:
            import dflash2_kernels

            report = getattr(dflash2_kernels, PACKAGES[name].patch)(fused_head=settings.fused_head)
        except Exception as error:  # any failure of the patch is reported the same way
            problem = f"{PACKAGES[name].patch} failed: {type(error).__name__}: {error}"
        else:
            say(_summary(name, version, settings, report))
            return
    refuse(f"{PACKAGES[name].distribution} not patched: {problem}", settings.on_unsupported)


def refuse(message: str, on_unsupported: str) -> None:
    """PatchError with ``message`` (``fail``), or ``message`` on stderr and the process goes on
    unpatched (``run``)."""
    if on_unsupported == "fail":
        raise PatchError(f"dflash2_kernels ({_process()}): {message}. To run unpatched instead: "
                         f"{ENV}=...,on_unsupported=run (dflash2-run --on-unsupported run).")
    say(f"{message}; running unpatched (on_unsupported=run)")


class _PatchAfterExec:
    """A module's loader that patches its upstream package once the module has executed.
    Everything but ``exec_module`` is the wrapped loader's."""

    def __init__(self, loader, on_executed):
        self._loader, self._on_executed = loader, on_executed

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        # The module keeps its own loader (reload, source lookups, resource readers).
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._on_executed()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PatchOnImport:
    """A ``sys.meta_path`` finder: finds nothing itself, but hands each trigger module's
    spec (found by the finders after it) a loader that patches its package once it has run."""

    def __init__(self, settings: Settings | None, error: str | None = None):
        self.settings, self.error = settings, error
        packages = settings.packages if settings is not None else tuple(PACKAGES)
        self.pending = {PACKAGES[name].trigger: name for name in packages}

    def find_spec(self, fullname, path=None, target=None):
        name = self.pending.pop(fullname, None)
        if name is None:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing to run (a namespace package, or not there): nothing to patch
        spec.loader = _PatchAfterExec(spec.loader, lambda: self._on_executed(name))
        return spec

    def _on_executed(self, name: str) -> None:
        try:
            if self.error is not None:
                refuse(f"{PACKAGES[name].distribution} not patched: {self.error}", "fail")
            patch_package(name, self.settings)
        except PatchError:
            # The failed import leaves nothing in sys.modules: an import tried again fails again.
            self.pending[PACKAGES[name].trigger] = name
            raise


def install(value: str | None = None) -> PatchOnImport | None:
    """Read ``DFLASH2_PATCH`` (or ``value``) and, unless it is off, put the finder at the head
    of ``sys.meta_path`` (once per process). The finder, or None when off."""
    value = os.environ.get(ENV, "") if value is None else value
    for finder in sys.meta_path:
        if isinstance(finder, PatchOnImport):
            return finder
    try:
        settings = Settings.parse(value)
        error = None
    except ValueError as exc:
        settings, error = None, str(exc)
    if settings is None and error is None:
        return None
    finder = PatchOnImport(settings, error)
    sys.meta_path.insert(0, finder)
    return finder
