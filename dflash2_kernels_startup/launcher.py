"""``dflash2-run``: run a training command with dflash2_kernels patched into every Python
process it starts.

    dflash2-run [--fused-head] [--package {speculators,nemo}] [--on-unsupported {fail,run}]
                [--any-version] -- COMMAND [ARGS ...]
    python -m dflash2_kernels.run [options] -- COMMAND [ARGS ...]
    dflash2-run [options] --print-env      # the DFLASH2_PATCH=... line the options stand for

COMMAND is anything that starts Python processes of this environment: a console script
(``speculators train ...``, ``automodel config.yaml``), ``python -m module``, a .py file,
``torchrun ...`` (its workers too). The launcher checks that the startup hook is
installed and that the upstream packages asked for are installed at versions this
package was tested against, sets ``DFLASH2_PATCH`` from its options, and replaces itself
with COMMAND (exec: same pid, signals and exit status). Each Python process of COMMAND
that imports speculators or NeMo Automodel then patches it as the import finishes,
before any model is built, and says so once on stderr (dflash2_kernels_startup).
Launchers that start their own processes (SLURM scripts, NeMo's launcher) get the same
by exporting ``DFLASH2_PATCH`` themselves: ``--print-env`` prints the value.

It lives beside the startup hook, outside dflash2_kernels, so that it imports neither
torch nor the package before it execs the command.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import site
import sys

import dflash2_kernels_startup as startup

USAGE_EXAMPLES = """\
examples:
  dflash2-run --fused-head -- speculators train --config config.yaml
  dflash2-run --fused-head -- torchrun --nproc-per-node 8 -m speculators.train --config config.yaml
  dflash2-run --fused-head -- automodel dflash2.yaml --nproc-per-node 8
  export $(dflash2-run --fused-head --print-env)      # SLURM scripts, other launchers
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash2-run",
        description="Run COMMAND with dflash2_kernels patched into every Python process it starts.",
        usage="dflash2-run [options] -- COMMAND [ARGS ...]", epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fused-head", action="store_true",
                        help="also the trainers' fused draft head (dk.patch_*(fused_head=True))")
    parser.add_argument("--package", dest="packages", action="append", choices=list(startup.PACKAGES),
                        help="patch only this upstream package (repeatable; default: each one COMMAND imports)")
    parser.add_argument("--on-unsupported", choices=startup.ON_UNSUPPORTED, default="fail",
                        help="a package not installed, or at a version not tested, or a patch that fails: "
                             "fail the command (default) or run it unpatched, with a message")
    parser.add_argument("--any-version", action="store_true",
                        help="patch upstream versions other than the tested ones too")
    parser.add_argument("--print-env", action="store_true",
                        help="print DFLASH2_PATCH=<value> for these options and exit")
    return parser


def hook_location() -> str | None:
    """The site directory holding dflash2_kernels_startup.pth for this interpreter, or None.
    Only site directories: Python runs no .pth file found elsewhere on sys.path."""
    directories = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    for directory in dict.fromkeys(directories):
        if directory and os.path.isfile(os.path.join(directory, "dflash2_kernels_startup.pth")):
            return directory
    return None


def problems(settings: startup.Settings, explicit_packages: bool) -> list[str]:
    """What stands between ``settings`` and a patched COMMAND in this environment."""
    found = []
    if hook_location() is None:
        found.append("the startup hook is not installed in this environment (no dflash2_kernels_startup.pth "
                     "in site-packages): reinstall dflash2_kernels with pip (`pip install --no-build-isolation .` "
                     "or `pip install -e .`)")
    installed = {name: startup.installed_version(name) for name in settings.packages}
    present = {name: version for name, version in installed.items()
               if version is not None or importlib.util.find_spec(startup.top_level(name)) is not None}
    missing = [startup.PACKAGES[name].distribution for name in settings.packages if name not in present]
    if missing and (explicit_packages or not present):
        found.append(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here")
    for name, version in present.items():
        problem = startup.version_problem(name, version, settings)
        if problem is not None:
            found.append(problem)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = _parser()
    args = parser.parse_args(options)
    settings = startup.Settings(fused_head=args.fused_head, packages=tuple(args.packages or startup.PACKAGES),
                                on_unsupported=args.on_unsupported, any_version=args.any_version)
    if args.print_env:
        print(f"{startup.ENV}={settings.value()}")
        return 0
    if not command:
        parser.error("give the command to run after `--`, e.g. dflash2-run --fused-head -- speculators train ...")
    for problem in problems(settings, explicit_packages=bool(args.packages)):
        if settings.on_unsupported == "fail":
            print(f"dflash2-run: {problem}. Not running the command (--on-unsupported run runs it unpatched).",
                  file=sys.stderr)
            return 2
        print(f"dflash2-run: {problem}; what it affects runs unpatched (--on-unsupported run).", file=sys.stderr)
    env = dict(os.environ, **{startup.ENV: settings.value()})
    print(f"dflash2-run: {startup.ENV}={settings.value()} {shlex.join(command)}", file=sys.stderr, flush=True)
    try:
        os.execvpe(command[0], command, env)
    except OSError as error:
        print(f"dflash2-run: cannot run {command[0]!r}: {error.strerror or error}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
