"""One call to put the fused kernels under an upstream DFlash 2 draft model.

Two scopes:

- :func:`patch` / :func:`unpatch`: one model, in place. Every DFlash 2 conv and
  candidate selector of a ``speculators`` or NeMo Automodel draft becomes ours
  (speculators' -> :class:`dflash2_kernels.GroupedDynamicCausalConv` /
  :class:`dflash2_kernels.CandidateSelector`, NeMo's -> the
  :mod:`dflash2_kernels.compat.nemo` classes), around the very same ``Parameter``
  objects: an optimizer built before keeps stepping them, ``state_dict`` keys and
  values do not change.
- :func:`patch_speculators` / :func:`patch_nemo` and their ``unpatch_*``: the
  upstream package itself. Ours is installed at every name through which upstream
  code reaches these classes and functions, so models built afterwards are built
  from ours, and upstream modules that already exist call our functions.

Modules are found by class name and structure (parameter names and shapes,
attributes), never by ``isinstance``: the upstream packages stay optional, and a
vendored copy of upstream's code is recognised too. Every call returns a
:class:`PatchReport` of what changed, what was ours already, and what looked like a
conv or selector but was left alone, and why.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .. import conv, modules
from . import nemo, nemo_head, speculators_head
from .compiled import compiled_like, is_compiled, uncompiled

__all__ = [
    "PatchReport",
    "Replacement",
    "Skipped",
    "patch",
    "patch_nemo",
    "patch_speculators",
    "unpatch",
    "unpatch_nemo",
    "unpatch_speculators",
]

# Where ours keeps the upstream module it replaced: an instance attribute, not a
# submodule, so it is in neither state_dict nor modules() and travels with deepcopy
# (which keeps the two sharing the copied Parameters).
_ORIGINAL = "_dflash2_upstream_module"

_CONV = "GroupedDynamicCausalConv"
_SELECTOR = "CandidateSelector"
_CONV_PARAMETERS = frozenset({"base_kernel", "kernel_projection.weight"})
_SELECTOR_PARAMETERS = frozenset({"predecessor_codebook", "successor_codebook", "hidden_projection.weight"})
_SPECULATORS, _NEMO = "speculators", "nemo"
_UPSTREAM_PACKAGE = {"speculators": _SPECULATORS, "nemo_automodel": _NEMO}
# What looks like one of ours by name (class or attribute), for the report's list of
# modules left alone.
_LOOKS_LIKE = re.compile(r"(dynamic|causal).*conv|conv.*(dynamic|causal)|selector|^(attention|mlp)_conv$",
                         re.IGNORECASE)


@dataclass(frozen=True)
class Replacement:
    """One swap at ``name`` (a module's qualified name in the model, or
    ``package.module.attr``) between the upstream class or function and ours, both fully
    qualified: a patch put ``ours`` where ``upstream`` was, an unpatch the reverse."""

    name: str
    upstream: str
    ours: str


@dataclass(frozen=True)
class Skipped:
    """Something left as it was: its ``name``, its class (qualified) and why."""

    name: str
    kind: str
    reason: str


@dataclass
class PatchReport:
    """What one patch or unpatch call did.

    ``replaced``: each swap made (for the ``unpatch*`` calls: each original put back).
    ``already``: names left alone because they hold what this call would put there (a
    second patch is a no-op and says so here). ``skipped``: names that looked like a
    DFlash 2 conv or selector (or an installed name someone changed since), and why
    they were not touched. ``fused_head``: whether, after this call, the training
    forwards it was asked to fuse (``fused_head=True``) compute their head with
    :func:`dflash2_kernels.draft_head` (False when it was not asked, or found none).
    """

    action: str
    replaced: list[Replacement] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    fused_head: bool = False

    def __str__(self) -> str:
        lines = [f"dflash2_kernels.{self.action}: {len(self.replaced)} replaced, {len(self.already)} already done, "
                 f"{len(self.skipped)} skipped" + ("; fused head: on" if self.fused_head else "")]
        undo = self.action.startswith("unpatch")
        lines += [f"  replaced {r.name}: " + (f"{r.ours} -> {r.upstream}" if undo else f"{r.upstream} -> {r.ours}")
                  for r in self.replaced]
        lines += [f"  already  {name}" for name in self.already]
        lines += [f"  skipped  {s.name} ({s.kind}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def _qualified(obj) -> str:
    """module.qualname of a class or function; of its type for anything else."""
    if not hasattr(obj, "__qualname__"):
        obj = type(obj)
    return f"{obj.__module__}.{obj.__qualname__}"


# --- one model -------------------------------------------------------------------------


def _ours() -> dict[tuple[str, str], type]:
    return {
        (_SPECULATORS, _CONV): modules.GroupedDynamicCausalConv,
        (_SPECULATORS, _SELECTOR): modules.CandidateSelector,
        (_NEMO, _CONV): nemo.GroupedDynamicCausalConv,
        (_NEMO, _SELECTOR): nemo.CandidateSelector,
    }


def _flavour(module: nn.Module, kind: str) -> str | None:
    """speculators' or NeMo's variant of ``kind``: from the defining package when it is
    one of the two, else from what only one of them has (speculators' conv keeps its
    block size, NeMo's selector its rank and a walk)."""
    package = type(module).__module__.partition(".")[0]
    if package in _UPSTREAM_PACKAGE:
        return _UPSTREAM_PACKAGE[package]
    if kind == _CONV:
        return _SPECULATORS if hasattr(module, "block_size") else _NEMO
    nemo_like = hasattr(module, "rank") and callable(getattr(module, "walk", None))
    speculators_like = callable(getattr(module, "score_candidates", None))
    if nemo_like != speculators_like:
        return _NEMO if nemo_like else _SPECULATORS
    return None


def _hooks(module: nn.Module) -> list[str]:
    """What would not carry over to ours: torch hooks, an instance-level forward."""
    found = [name for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
             if getattr(module, name, None)]
    if "forward" in vars(module):
        found.append("an instance-level forward")
    return found


def _why_not(module: nn.Module, kind: str, flavour: str | None) -> str | None:
    """Why ``module`` (class named ``kind``) cannot be swapped for ours, or None if it can."""
    expected = _CONV_PARAMETERS if kind == _CONV else _SELECTOR_PARAMETERS
    names = {name for name, _ in module.named_parameters()}
    if names != expected:
        return f"parameters {sorted(names)}, expected {sorted(expected)}"
    if flavour is None:
        return "cannot tell speculators' variant from NeMo's (neither score_candidates alone nor rank and walk)"
    hooks = _hooks(module)
    if hooks:
        return f"has {', '.join(hooks)}, which would not carry over to ours"
    return None


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(ours around ``module``'s parameters, None) or (None, why not), for a module whose
    class is named like an upstream conv or selector."""
    kind = type(module).__name__
    flavour = _flavour(module, kind)
    reason = _why_not(module, kind, flavour)
    if reason is not None:
        return None, reason
    try:
        ours = _ours()[flavour, kind].from_upstream(module)
    except (TypeError, ValueError) as error:
        return None, str(error)
    object.__setattr__(ours, _ORIGINAL, module)
    return ours, None


def _upstream_base(module: nn.Module) -> str | None:
    """The upstream conv or selector class ``module``'s class derives from (under any name),
    or None for upstream's own classes and for copies of them."""
    for base in type(module).__mro__[1:]:
        if base.__name__ in (_CONV, _SELECTOR) and base.__module__.partition(".")[0] in _UPSTREAM_PACKAGE:
            return _qualified(base)
    return None


def _swap_children(model: nn.Module, swaps: dict[int, nn.Module]) -> None:
    """Point every reference to a swapped module (a module shared by two parents has two)
    at its replacement."""
    for parent in model.modules():
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in swaps:
                setattr(parent, child_name, swaps[id(child)])


def _ours_classes() -> tuple[type, ...]:
    return tuple(set(_ours().values()))


# --- the fused head: the trainers' training forwards ------------------------------------


@dataclass(frozen=True)
class _Trainer:
    """An upstream training forward that fused_head replaces: the attributes ours reads,
    where the class is defined, and ours."""

    attributes: tuple[str, ...]
    home: str
    forward: Callable


_TRAINERS = {
    "DFlash2DraftModel": _Trainer(("lm_head", "verifier_lm_head", "candidate_selector", "_backbone_forward",
                                   "_predecessor_ids", "block_size"),
                                  "speculators.models.dflash2.core", speculators_head.fused_forward),
    "DFlash2TrainerModule": _Trainer(("draft_model", "lm_head", "loss_fn", "_prepare_block_inputs",
                                      "_build_block_targets", "_depth_weights"),
                                     "nemo_automodel.components.speculative.dflash.dflash2_core",
                                     nemo_head.fused_forward),
}
_FUSED_FORWARDS = frozenset(trainer.forward for trainer in _TRAINERS.values())
_NO_TRAINER = ("no speculators DFlash2DraftModel or NeMo DFlash2TrainerModule below the model: nothing projects "
               "to the vocabulary here")


def _instance_forward(module: nn.Module):
    """The function behind an instance-level ``forward`` (None when there is none)."""
    forward = vars(module).get("forward")
    return getattr(forward, "__func__", forward)


def _trainer_class(module: nn.Module) -> type | None:
    """The upstream trainer class ``module`` is an instance of, by name through its MRO (so
    FSDP2's ``FSDPDFlash2DraftModel`` and subclasses are found too), or None."""
    return next((cls for cls in type(module).__mro__ if cls.__name__ in _TRAINERS), None)


def _why_not_fused(module: nn.Module, cls: type) -> str | None:
    """Why ``module``'s training forward cannot be replaced by ours, or None if it can."""
    missing = [name for name in _TRAINERS[cls.__name__].attributes if not hasattr(module, name)]
    if missing:
        return f"has no {', '.join(missing)}: not the upstream layout fused_head was written against"
    if "forward" in vars(module):
        return "has an instance-level forward already (not ours): left to it"
    if type(module).forward is not cls.forward:
        return (f"its forward is {_qualified(type(module).forward)}, not {cls.__name__}'s: a subclass's override "
                "would be lost")
    return None


def _fuse_heads(model: nn.Module, report: PatchReport) -> None:
    """Give every upstream trainer module at or below ``model`` our fused-head training
    forward, as an instance attribute."""
    found = False
    for name, module in model.named_modules():
        cls = _trainer_class(module)
        if cls is None:
            continue
        found = True
        trainer = _TRAINERS[cls.__name__]
        label = f"{name or '<the model itself>'}.forward"
        if trainer.forward in (uncompiled(_instance_forward(module)), uncompiled(type(module).forward)):
            report.already.append(label)  # by an earlier patch, or the package's (class-level)
            report.fused_head = True
            continue
        reason = _why_not_fused(module, cls)
        if reason is not None:
            report.skipped.append(Skipped(label, _qualified(type(module)), reason))
            continue
        upstream = type(module).forward
        # Compiled where upstream's is (speculators' conditional_torch_compile on CUDA).
        module.forward = types.MethodType(compiled_like(upstream, trainer.forward), module)
        report.replaced.append(Replacement(label, _qualified(upstream), _fused_name(upstream, trainer.forward)))
        report.fused_head = True
    if not found:
        report.skipped.append(Skipped("fused_head", _qualified(type(model)), _NO_TRAINER))


def _fused_name(upstream, ours) -> str:
    return _qualified(ours) + (" (compiled as upstream's)" if is_compiled(upstream) else "")


def _unfuse_heads(model: nn.Module, report: PatchReport) -> None:
    for name, module in model.named_modules():
        ours = uncompiled(_instance_forward(module))
        if ours in _FUSED_FORWARDS:
            del module.forward
            report.replaced.append(Replacement(f"{name or '<the model itself>'}.forward",
                                               _qualified(type(module).forward), _qualified(ours)))


def patch(model: nn.Module, *, fused_head: bool = False) -> PatchReport:
    """Swap every DFlash 2 conv and candidate selector of ``model`` for ours, in place.

    ``model``: an ``nn.Module`` holding speculators' or NeMo's
    ``GroupedDynamicCausalConv`` / ``CandidateSelector`` anywhere below it (a draft
    model, a trainer module around one, a wrapper). A module is swapped when its class
    has upstream's name and it has upstream's parameters (names, shapes) and size
    attributes; ours is built around the very same Parameter objects, takes its
    training flag, and remembers the original for :func:`unpatch`. Left alone, and
    listed in the report with the reason: a module with hooks (they would not carry
    over), a subclass of upstream's classes (its overrides would be lost), a module
    whose parameters or attributes do not match, the model itself (nothing to swap it
    in: use ``from_upstream``), and anything else named like a conv or selector.
    Patching twice is a no-op: the second report lists the modules as ``already``.

    Only modules change. NeMo's ``spec_generate`` also calls the module-level
    ``dflash2_rejection_sample``: :func:`patch_nemo` swaps that one.

    ``fused_head=True`` also gives every speculators ``DFlash2DraftModel`` and NeMo
    ``DFlash2TrainerModule`` at or below ``model`` a training forward (an instance
    attribute: the class is untouched) that computes the losses, the selector's
    candidates and every logged metric with :func:`dflash2_kernels.draft_head`, never
    holding [N, V] logits (docs/integration.md, "The fused head in the training step"); the report
    lists those forwards and says ``fused head: on``. Where the class's forward is
    compiled (speculators compiles it whenever CUDA is available), ours is compiled by the
    same ``torch.compile`` (compat/compiled.py). Off by default until it is measured on a
    GPU.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
    _check_flag(fused_head)
    report = PatchReport("patch")
    ours_classes = _ours_classes()
    swaps: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        label, kind, base = name or "<the model itself>", type(module).__name__, _upstream_base(module)
        if isinstance(module, ours_classes):
            report.already.append(label)
        elif base is not None:
            report.skipped.append(Skipped(label, _qualified(type(module)),
                                          f"a subclass of {base}: swapping it would drop its overrides"))
        elif kind in (_CONV, _SELECTOR):
            ours, reason = (None, "it is the model itself: use from_upstream") if module is model \
                else _replacement(module)
            if ours is None:
                report.skipped.append(Skipped(label, _qualified(type(module)), reason))
                continue
            swaps[id(module)] = ours
            report.replaced.append(Replacement(label, _qualified(type(module)), _qualified(type(ours))))
        elif _LOOKS_LIKE.search(kind) or _LOOKS_LIKE.search(name.rpartition(".")[2]):
            if not _inside_ours(model, name, ours_classes):
                report.skipped.append(Skipped(label, _qualified(type(module)),
                                              f"not a DFlash 2 conv or selector (class {kind})"))
    _swap_children(model, swaps)
    if fused_head:
        _fuse_heads(model, report)
    return report


def _check_flag(fused_head) -> None:
    if not isinstance(fused_head, bool):
        raise TypeError(f"fused_head must be a bool, got {type(fused_head).__name__}.")


def _inside_ours(model: nn.Module, name: str, ours_classes: tuple[type, ...]) -> bool:
    """Whether ``name`` is a submodule of one of ours (ours' kernel_projection is no news)."""
    parts = name.split(".")
    return any(isinstance(model.get_submodule(".".join(parts[:i])), ours_classes) for i in range(1, len(parts)))


def _share_parameters(source: nn.Module, target: nn.Module) -> None:
    """Make ``target`` hold ``source``'s current Parameter objects under the same names
    (ours may have been given new ones since, e.g. by ``load_state_dict(assign=True)``)."""
    for name, parameter in source.named_parameters():
        owner_path, _, leaf = name.rpartition(".")
        owner = target.get_submodule(owner_path) if owner_path else target
        setattr(owner, leaf, parameter)
    target.train(source.training)


def unpatch(model: nn.Module) -> PatchReport:
    """Put back every upstream module :func:`patch` swapped out of ``model``, in place.

    Each original returns holding ours' current Parameter objects (the same ones, unless
    something replaced them since) and ours' training flag. A module that is ours but
    not through :func:`patch` (built from ours, e.g. after :func:`patch_speculators`)
    has no original and stays; the report lists it. A fused-head training forward
    (``patch(model, fused_head=True)``) is removed: the class's own runs again.
    Unpatching a model with nothing to put back is a no-op: an empty report, not an error, so that unpatching in a
    ``finally`` never masks the error that got there.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
    report = PatchReport("unpatch")
    ours_classes = _ours_classes()
    swaps: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not isinstance(module, ours_classes):
            continue
        label = name or "<the model itself>"
        original = vars(module).get(_ORIGINAL)
        if original is None:
            report.skipped.append(Skipped(label, _qualified(type(module)),
                                          "built as ours, not by dflash2_kernels.patch: no original to put back"))
        elif module is model:
            report.skipped.append(Skipped(label, _qualified(type(module)), "it is the model itself"))
        else:
            _share_parameters(module, original)
            swaps[id(module)] = original
            report.replaced.append(Replacement(label, _qualified(type(original)), _qualified(type(module))))
    _swap_children(model, swaps)
    _unfuse_heads(model, report)
    return report


# --- the upstream packages -------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """One upstream object to replace: where it is defined, and a factory for ours."""

    module: str
    attribute: str
    ours: Callable[[], object]


def _speculators_targets() -> list[_Target]:
    home = "speculators.models.dflash2.model_definitions"
    return [
        _Target(home, "grouped_dynamic_conv", lambda: conv.grouped_dynamic_conv),
        _Target(home, _CONV, lambda: modules.GroupedDynamicCausalConv),
        _Target(home, _SELECTOR, lambda: modules.CandidateSelector),
    ]


def _nemo_targets() -> list[_Target]:
    home = "nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2"
    return [
        _Target(home, "_grouped_dynamic_convolve", lambda: nemo.grouped_dynamic_convolve),
        _Target(home, _CONV, lambda: nemo.GroupedDynamicCausalConv),
        _Target(home, _SELECTOR, lambda: nemo.CandidateSelector),
        _Target(home, "dflash2_rejection_sample", lambda: nemo.dflash2_rejection_sample),
    ]


# package -> [(module object, attribute, upstream object, ours)], for the unpatch_* calls.
_INSTALLED: dict[str, list[tuple[object, str, object, object]]] = {}


def _upstream_objects(package: str, targets: list[_Target]) -> list[tuple[object, object]]:
    """[(upstream object, ours)] for ``targets``, importing their homes; upstream's
    objects are the ones recorded at the first install (the homes hold ours after it)."""
    recorded = {id(ours): original for _, _, original, ours in _INSTALLED.get(package, [])}
    pairs = []
    for target in targets:
        try:
            home = importlib.import_module(target.module)
        except ImportError as error:
            raise ImportError(f"dflash2_kernels.patch_{package} needs {target.module} ({error}).") from error
        if not hasattr(home, target.attribute):
            raise AttributeError(f"{target.module} has no {target.attribute}: not the upstream version this "
                                 "package was written against (requirements/upstream.txt).")
        ours = target.ours()
        current = getattr(home, target.attribute)
        original = recorded.get(id(ours), current) if current is ours else current
        if original is not ours:  # ours already there, not by us: nothing upstream to find
            pairs.append((original, ours))
    return pairs


def _aliases(root: str, originals: dict[int, object]) -> list[tuple[object, str]]:
    """Every (module, attribute) of the ``root`` package now imported that holds one of
    ``originals``: the homes and every module that imported a name from them."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == root or name.startswith(root + ".")):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in originals and originals[id(value)] is value:
                found.append((module, attribute))
    return found


def _holder_name(holder) -> str:
    """A module's name, or a class's qualified name (a fused forward is a class attribute)."""
    return _qualified(holder) if isinstance(holder, type) else holder.__name__


def _install_fused_forward(package: str, class_name: str, report: PatchReport) -> None:
    """Make upstream's trainer class ``class_name`` train with our fused-head forward."""
    trainer = _TRAINERS[class_name]
    try:
        cls = getattr(importlib.import_module(trainer.home), class_name)
    except (ImportError, AttributeError) as error:
        raise ImportError(f"dflash2_kernels.patch_{package}(fused_head=True) needs {trainer.home}.{class_name} "
                          f"({error}).") from error
    current = vars(cls).get("forward")
    if uncompiled(current) is trainer.forward:
        report.already.append(f"{_qualified(cls)}.forward")
    else:
        ours = compiled_like(current, trainer.forward)  # compiled where upstream's is
        _INSTALLED.setdefault(package, []).append((cls, "forward", current, ours))
        cls.forward = ours
        report.replaced.append(Replacement(f"{_qualified(cls)}.forward", _qualified(current),
                                           _fused_name(current, trainer.forward)))
    report.fused_head = True


def _install(package: str, root: str, targets: list[_Target]) -> PatchReport:
    report = PatchReport(f"patch_{package}")
    pairs = _upstream_objects(package, targets)
    originals = {id(original): original for original, _ in pairs}
    ours_of = {id(original): ours for original, ours in pairs}
    installed = _INSTALLED.setdefault(package, [])
    for module, attribute, _, ours in installed:
        if getattr(module, attribute, None) is ours:
            report.already.append(f"{_holder_name(module)}.{attribute}")
            report.fused_head |= uncompiled(ours) in _FUSED_FORWARDS
    # Scanned again on every call: a module imported since the last one may hold an
    # upstream name of its own.
    for module, attribute in _aliases(root, originals):
        original = getattr(module, attribute)
        ours = ours_of[id(original)]
        setattr(module, attribute, ours)
        installed.append((module, attribute, original, ours))
        report.replaced.append(Replacement(f"{module.__name__}.{attribute}", _qualified(original), _qualified(ours)))
    return report


def _uninstall(package: str) -> PatchReport:
    report = PatchReport(f"unpatch_{package}")
    for module, attribute, original, ours in reversed(_INSTALLED.pop(package, [])):
        name = f"{_holder_name(module)}.{attribute}"
        current = getattr(module, attribute, None)
        if current is ours:
            setattr(module, attribute, original)
            report.replaced.append(Replacement(name, _qualified(original), _qualified(ours)))
        else:
            # Someone installed something else there since: theirs wins.
            report.skipped.append(Skipped(name, _qualified(current),
                                          f"no longer holds ours ({_qualified(ours)}): left as it is"))
    return report


def patch_speculators(*, fused_head: bool = False) -> PatchReport:
    """Install ours in ``speculators`` (``speculators.models.dflash2``), at every name that
    holds its ``grouped_dynamic_conv``, ``GroupedDynamicCausalConv`` or
    ``CandidateSelector``: ``model_definitions`` (where they are defined, and where
    upstream's conv and decoder layer look them up) and every ``speculators`` module
    that imported one (``core`` builds the selector from its own ``CandidateSelector``).

    A ``DFlash2DraftModel`` built afterwards is built from ours; upstream modules that
    already exist call our ``grouped_dynamic_conv`` (use :func:`patch` to swap them).
    Idempotent: a second call replaces nothing again (the report lists those names as
    ``already``) and picks up upstream modules imported since. ImportError when
    speculators is not installed; AttributeError, before anything changes, when its
    layout is not the one this package knows.

    ``fused_head=True`` also replaces ``DFlash2DraftModel.forward`` (the class's, so
    every draft model, built before or after, trains with it) by one that computes its
    losses, candidates and metrics with :func:`dflash2_kernels.draft_head`, never
    holding [N, V] logits; the report says ``fused head: on``. On a machine with CUDA
    upstream's forward is compiled (``conditional_torch_compile``): ours is then compiled
    by the same ``torch.compile``. ``fused_head=False`` installs no forward and removes
    none (:func:`unpatch_speculators` does).
    """
    _check_flag(fused_head)
    report = _install(_SPECULATORS, "speculators", _speculators_targets())
    if fused_head:
        _install_fused_forward(_SPECULATORS, "DFlash2DraftModel", report)
    return report


def unpatch_speculators() -> PatchReport:
    """Put back at every name :func:`patch_speculators` changed the object that was there
    (unless it holds something else by now: that is left, and reported). Models built
    while patched keep ours. A no-op (an empty report) when nothing is installed."""
    return _uninstall(_SPECULATORS)


def patch_nemo(*, fused_head: bool = False) -> PatchReport:
    """Install ours in NeMo Automodel, at every name that holds ``draft_qwen3_dflash2``'s
    ``_grouped_dynamic_convolve``, ``GroupedDynamicCausalConv``, ``CandidateSelector`` or
    ``dflash2_rejection_sample``: that module (where NeMo's conv, decoder layer, draft
    model and ``spec_generate`` look them up) and every ``nemo_automodel`` module that
    imported one (``nemo_automodel.components.speculative.dflash`` re-exports the two
    classes).

    A ``Qwen3DFlash2DraftModel`` built afterwards is built from ours (its ``__init__``
    resets every instance of the module-level classes, now ours); ``spec_generate``
    runs our walk and rejection sampling; NeMo modules that already exist call our
    ``_grouped_dynamic_convolve``. Idempotent, and errors, as :func:`patch_speculators`.

    ``fused_head=True`` also replaces ``DFlash2TrainerModule.forward`` by one that
    computes the CE, the selector's candidates and every ``DFlash2StepMetrics`` field
    with :func:`dflash2_kernels.draft_head` (vocab-parallel when the target's lm_head
    is sharded by tensor parallelism), never holding [B, S, V] logits.
    """
    _check_flag(fused_head)
    report = _install(_NEMO, "nemo_automodel", _nemo_targets())
    if fused_head:
        _install_fused_forward(_NEMO, "DFlash2TrainerModule", report)
    return report


def unpatch_nemo() -> PatchReport:
    """Undo :func:`patch_nemo`, as :func:`unpatch_speculators` undoes its counterpart."""
    return _uninstall(_NEMO)
