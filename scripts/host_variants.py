"""The numerics and fuzz tests under the CPU dispatch paths a user's machine may take.

    python scripts/host_variants.py [--quick] [--as-is] [--cases N] [--seeds 0,1] [--only NAMES] [--list]

Users run the suite on other CPUs than CI's: Intel with AVX-512 (MKL's AVX-512 kernels,
torch's AVX-512 kernels, our C++ AVX-512 kernels), AMD (MKL's AVX2 kernels), CPUs
without AVX2. Each variant below is an environment that makes this machine take one of
those paths; a variant that cannot change anything here (an ISA this CPU lacks, a
switch its MKL ignores on this CPU) is reported and not run, so that the table says
what was and was not exercised. A probe in a child process decides: the CPU's AVX-512
flags, and the bits of a few MKL products under the variant's environment against the
plain environment's.

Each variant runs its test files (the contract-judged ones its path can change) with
the fuzz suite at ``--cases`` cases per target under the first seed, then the fuzz suite
alone under each other seed. ``--quick``: the variants marked for CI (``make test``
runs them after the suite); ``--as-is``: this machine's own paths first (``make
check-cpu``: a user's check of their CPU). Exit status 0 when every run passed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# The judges that compare our results with a reference (SPEC section 4): a test file that
# imports one of them, directly or through a helper module of tests/, is judged by the
# host's rounding as well as ours, so it runs under the variants (reference_files()).
JUDGES = ("tests.contract", "tests.fuzz.judges")
# Test files that run only in another build (scripts/asan.py: the emulated CUDA kernels).
OTHER_BUILDS = ("tests/emulated/",)
# The contract-judged files whose references or modules call a BLAS product.
BLAS_FILES = [
    "tests/test_selector_numerics.py",
    "tests/test_serving.py",
    "tests/test_compat_nemo.py",
    "tests/test_patch_speculators.py",
    "tests/test_patch_nemo.py",
    "tests/test_head.py",
]
NUMERICS = ["tests/test_conv_numerics.py", "tests/test_conv_cpp_op.py", *BLAS_FILES]
FUZZ = "tests/test_fuzz.py"
# float64 finite differences: the same on every dispatch path, and the slowest test here.
DESELECT = "not gradcheck"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: Path) -> set[str]:
    """The tests.* modules ``path`` imports (relative imports resolved; ``from . import x``
    names the module x where tests/ has one)."""
    package = _module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "tests" or name.startswith("tests.")}


def reference_files() -> list[str]:
    """Every test file (tests/**/test_*.py, but those of OTHER_BUILDS) that reaches one of
    JUDGES through its imports: a new one is covered by the variants without a list to
    keep. Helpers reached: tests/*.py and tests/fuzz/*.py modules."""
    modules = {_module_name(path): path for path in TESTS.rglob("*.py")}
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    judged = set(JUDGES)
    changed = True
    while changed:  # the modules that reach a judge, to a fixed point
        changed = False
        for name, imported in graph.items():
            if name not in judged and imported & judged:
                judged.add(name)
                changed = True
    files = []
    for name in sorted(judged):
        relative = modules[name].relative_to(ROOT).as_posix()
        if modules[name].name.startswith("test_") and not relative.startswith(OTHER_BUILDS):
            files.append(relative)
    return files


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict
    stands_for: str
    files: tuple = tuple(NUMERICS)
    needs: str = "always"  # always | avx512 | mkl-bits: what must hold for it to reach a new path
    quick: bool = True  # run by --quick (CI)
    # It changes the bits of the GEMMs inside our own ops (the head's chunks, the
    # projections of our modules): MKL's switches do; the stand-in BLAS, a dispatch mode
    # that never enters a custom op, does not. Such a variant runs every reference file.
    own_gemms: bool = False


VARIANTS = [
    Variant("as-is", {}, "this machine's own paths", quick=False),
    # make test's sanitized half (scripts/asan.py) runs the whole suite this way already.
    Variant("no-avx512-kernels", {"DFLASH2_DISABLE_AVX512": "1"},
            "a CPU without AVX-512: our C++ kernels' AVX2 and default clones", needs="avx512", quick=False),
    Variant("aten-default", {"ATEN_CPU_CAPABILITY": "default"},
            "a CPU without AVX2: torch's scalar kernels (the references' sums, the random draws)"),
    Variant("aten-avx2", {"ATEN_CPU_CAPABILITY": "avx2"},
            "an AVX2 CPU on an AVX-512 one: torch's AVX2 kernels", needs="avx512"),
    Variant("mkl-compatible", {"MKL_CBWR": "COMPATIBLE"},
            "MKL's most portable kernels (other summation orders, thread-count dependent, on any CPU)",
            files=tuple(BLAS_FILES), needs="mkl-bits", own_gemms=True),
    Variant("mkl-avx2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
            "MKL's AVX2 kernels on an Intel AVX-512 CPU (on AMD MKL runs those already and ignores this)",
            files=tuple(BLAS_FILES), needs="mkl-bits", own_gemms=True),
    Variant("blas-alternating", {"DFLASH2_TEST_BLAS": "alternating"},
            "a BLAS rounding two calls on equal values differently (MKL without conditional "
            "reproducibility, e.g. its AVX-512 kernels at other operand addresses)", files=tuple(BLAS_FILES)),
    Variant("blas-serial", {"DFLASH2_TEST_BLAS": "serial"},
            "a BLAS summing each product first to last (a GEMM micro-kernel's order)",
            files=tuple(BLAS_FILES), quick=False),
    Variant("blas-lanes", {"DFLASH2_TEST_BLAS": "lanes"},
            "a BLAS summing in 16 lanes (an AVX-512 dot product's order)", files=tuple(BLAS_FILES), quick=False),
]

_PROBE = r"""
import hashlib, json, torch
g = torch.Generator().manual_seed(0)
shapes = [(14, 104, 624), (1, 104, 624), (64, 200, 700), (3, 33, 5000), (96, 96, 256)]
digest = hashlib.sha256()
for m, n, k in shapes:
    a = torch.randn(m, k, generator=g); w = torch.randn(n, k, generator=g)
    digest.update(torch.nn.functional.linear(a, w).numpy().tobytes())
    digest.update((a @ w[0]).numpy().tobytes())
    digest.update(torch.bmm(a[None], w.t()[None]).numpy().tobytes())
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "mkl": digest.hexdigest()}))
"""


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_avx512() -> bool:
    """What our C++ kernels require for their AVX-512 path (csrc/cpu_row_kernel.h)."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


def probe(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def reach(variant: Variant, plain: dict) -> str | None:
    """None when the variant reaches a path the plain run does not, else why not."""
    if variant.needs == "avx512" and not has_avx512():
        return "this CPU has no AVX-512: the plain run takes that path already"
    if variant.needs == "mkl-bits":
        if probe(variant.env)["mkl"] == plain["mkl"]:
            return "MKL computes the same bits as the plain run here (it ignores this switch on this CPU)"
    return None


def pytest(args: list[str], env: dict) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", DESELECT, *args],
                         env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    if run.returncode:
        sys.stdout.write(run.stdout[-20000:] + run.stderr[-4000:])
    return run.returncode, (lines[-1] if lines else run.stderr.strip()[-200:])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the variants CI runs")
    parser.add_argument("--as-is", action="store_true", help="also this machine's own paths, first")
    parser.add_argument("--cases", type=int, default=40, help="fuzz cases per target and seed (default 40)")
    parser.add_argument("--seeds", default="0,1", help="fuzz seeds (default 0,1)")
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--list", action="store_true", help="say which variants reach a new path here; run none")
    parser.add_argument("--every-own-gemms", action="store_true",
                        help="every variant that changes our own GEMMs' bits runs the reference files (default: "
                             "the first that reaches here, in VARIANTS order)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s] or [0]
    chosen = [v for v in VARIANTS
              if (v.name in args.only.split(",") if args.only else
                  (v.quick or not args.quick) and (v.name != "as-is" or args.as_is))]
    plain = probe({})
    print(f"host: ATen capability {plain['aten']}, AVX-512 {'yes' if has_avx512() else 'no'}", flush=True)
    why_not = {v.name: None if v.name == "as-is" else reach(v, plain) for v in chosen}
    own = [v.name for v in chosen if v.own_gemms and why_not[v.name] is None]
    full = set(own if args.every_own_gemms else own[:1])
    references = reference_files()
    if not own:
        print("no chosen variant changes the bits of our own GEMMs on this machine: the reference files "
              f"({len(references)}) run only as they are", flush=True)
    failed, rows = 0, []
    for variant in chosen:
        settings = " ".join(f"{k}={v}" for k, v in variant.env.items()) or "(none)"
        files = list(variant.files)
        if variant.name in full:
            files += [f for f in references if f not in files]
        if why_not[variant.name] or args.list:
            what = why_not[variant.name] or "reaches a new path here"
            if variant.name in full:
                what += f"; would run every reference file ({len(references)})"
            rows.append((variant.name, settings, what, "-"))
            continue
        start = time.monotonic()
        results = []
        for index, seed in enumerate(seeds):
            env = {**variant.env, "DFLASH2_FUZZ_CASES": str(args.cases), "DFLASH2_FUZZ_SEED": str(seed)}
            code, last = pytest((files if index == 0 else []) + [FUZZ], env)
            failed += code != 0
            results.append(f"seed {seed}: {last}")
        label = variant.name + (f" (+ every reference file, {len(references)})" if variant.name in full else "")
        rows.append((label, settings, "; ".join(results), f"{time.monotonic() - start:.0f} s"))
        print(" | ".join(rows[-1]), flush=True)
    print("\nvariant | environment | result | time")
    for row in rows:
        print(" | ".join(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
