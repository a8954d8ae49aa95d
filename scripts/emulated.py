"""Build and test the CUDA kernels on the CPU, through the SIMT runtime (csrc/emulation/).

    python scripts/emulated.py build            # build/emulated/: the op library and the runtime's self-test
    python scripts/emulated.py test [ARGS...]   # build, then pytest tests/emulated ARGS under AddressSanitizer

The build is incremental (ninja, with the compiler's header dependencies), so an edit
anywhere under csrc/ rebuilds exactly what it affects. Both targets are built with
AddressSanitizer where the compiler has it (``--no-asan`` to skip): an out-of-bounds
read or write in a kernel then aborts with a report. A library built with the
sanitizer needs its runtime loaded first, so ``test`` runs pytest in a fresh process
with ``LD_PRELOAD`` set (the sanitizer's runtime, then the C++ runtime, whose
``__cxa_throw`` the sanitizer otherwise intercepts too early at import).

What it builds:
- ``libdflash2_emulated.so``: the kernels of csrc/kernels/*.cu compiled as host C++ and
  the CUDA bindings compiled for CPU tensors, as ``torch.ops.dflash2_emulated.*``;
- ``simt_selftest``: tests/simt/simt_selftest.cpp, the runtime's own tests (no torch).

Needs the CUDA toolkit's headers (cuda_fp16.h, cuda_bf16.h, cuda_runtime_api.h; no
GPU, no nvcc), ninja and g++.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "emulated"
LIBRARY = BUILD / "libdflash2_emulated.so"
SELFTEST = BUILD / "simt_selftest"

RUNTIME_SOURCES = ["csrc/emulation/simt.cpp", "csrc/emulation/fiber.cpp"]
LIBRARY_SOURCES = RUNTIME_SOURCES + [
    "csrc/emulation/registration.cpp",
    "csrc/emulation/selector_kernels.cpp",
    "csrc/emulation/serving_kernels.cpp",
    "csrc/emulation/verify_kernels.cpp",
    "csrc/emulation/selector_bindings.cpp",
    "csrc/emulation/serving_bindings.cpp",
]
SELFTEST_SOURCES = RUNTIME_SOURCES + ["tests/simt/simt_selftest.cpp"]
# The sources that include torch's headers (the others need only the CUDA toolkit's).
TORCH_SOURCES = {
    "csrc/emulation/registration.cpp",
    "csrc/emulation/selector_bindings.cpp",
    "csrc/emulation/serving_bindings.cpp",
}
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer"]


def cuda_include_dir() -> Path:
    """A directory holding the CUDA toolkit's cuda_fp16.h, cuda_bf16.h and cuda_runtime_api.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    dirs = [Path(c) / "include" for c in candidates if c]
    # CUDA builds of torch bring the runtime headers in their nvidia-* wheels.
    site = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    dirs += sorted(site.glob("*/include"))
    for directory in dirs:
        if all((directory / name).exists() for name in ("cuda_fp16.h", "cuda_bf16.h", "cuda_runtime_api.h")):
            return directory
    raise SystemExit(
        "emulated build: no CUDA headers (cuda_fp16.h, cuda_bf16.h, cuda_runtime_api.h) found; set CUDA_HOME. "
        f"Looked in: {', '.join(map(str, dirs))}"
    )


def compiler_has_asan(cxx: str) -> bool:
    probe = subprocess.run(
        [cxx, *ASAN_FLAGS, "-x", "c++", "-", "-o", os.devnull],
        input="int main() { return 0; }",
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


def sanitizer_preload(cxx: str) -> str:
    """LD_PRELOAD for a process that loads the ASan-built library: libasan, then libstdc++."""
    libraries = []
    for name in ("libasan.so", "libstdc++.so"):
        path = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path):
            raise SystemExit(f"emulated build: {cxx} does not know where {name} is")
        libraries.append(os.path.realpath(path))
    return " ".join(libraries)


def ninja_file(cxx: str, asan: bool) -> str:
    import torch
    from torch.utils import cpp_extension

    common = ["-std=c++20", "-O2", "-g1", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", "-Wno-sign-compare"]
    common += ["-DDFLASH2_EMULATED", f"-I{ROOT / 'csrc'}", f"-isystem{cuda_include_dir()}"]
    if asan:
        common += ASAN_FLAGS
    torch_flags = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    torch_flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    torch_libs = [f"-L{path}" for path in cpp_extension.library_paths()]
    torch_libs += [f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths()]
    torch_libs += ["-lc10", "-ltorch", "-ltorch_cpu"]
    link = ["-pthread"] + (ASAN_FLAGS if asan else [])

    def quote(words):
        return " ".join(shlex.quote(w) for w in words)

    lines = [
        f"cxx = {cxx}",
        f"common = {quote(common)}",
        f"torch_flags = {quote(torch_flags)}",
        "rule compile",
        "  command = $cxx $common $extra -MMD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $in",
        "rule link",
        "  command = $cxx $in -o $out $flags",
        "  description = link $out",
    ]

    def objects(sources):
        names = []
        for source in sources:
            obj = "obj/" + source.replace("/", "_").replace(".cpp", ".o")
            if obj not in compiled:
                compiled.add(obj)
                lines.append(f"build {obj}: compile {ROOT / source}")
                lines.append(f"  extra = {'$torch_flags' if source in TORCH_SOURCES else ''}")
            names.append(obj)
        return names

    compiled: set[str] = set()
    lines.append(f"build {LIBRARY.name}: link {' '.join(objects(LIBRARY_SOURCES))}")
    lines.append(f"  flags = -shared {quote(link + torch_libs)}")
    lines.append(f"build {SELFTEST.name}: link {' '.join(objects(SELFTEST_SOURCES))}")
    lines.append(f"  flags = {quote(link)}")
    return "\n".join(lines) + "\n"


def build(asan: bool) -> None:
    cxx = os.environ.get("CXX", "g++")
    asan = asan and compiler_has_asan(cxx)
    BUILD.mkdir(parents=True, exist_ok=True)
    text = ninja_file(cxx, asan)
    path = BUILD / "build.ninja"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    (BUILD / "asan").write_text("1\n" if asan else "0\n")
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
    subprocess.run([ninja, "-C", str(BUILD), "-j", jobs], check=True)


def test_environment() -> dict[str, str]:
    env = dict(os.environ)
    env["DFLASH2_EMULATED_LIB"] = str(LIBRARY)
    env["DFLASH2_SIMT_SELFTEST"] = str(SELFTEST)
    env["DFLASH2_POISON_OUTPUTS"] = "1"
    if (BUILD / "asan").read_text().strip() == "1":
        env["LD_PRELOAD"] = sanitizer_preload(os.environ.get("CXX", "g++"))
        # torch leaks by design at exit; what matters here is every out-of-bounds access.
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:" + env.get("ASAN_OPTIONS", "")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "test"])
    parser.add_argument("--no-asan", action="store_true", help="build without AddressSanitizer")
    args, pytest_args = parser.parse_known_args()
    build(asan=not args.no_asan)
    if args.command == "test":
        command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "emulated"), *pytest_args]
        os.execve(sys.executable, command, test_environment())


if __name__ == "__main__":
    main()
