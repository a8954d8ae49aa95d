"""The sanitized test build: the C++ extension with AddressSanitizer, CUDA kernels included
(run on the CPU by the SIMT runtime, csrc/emulation/), and the suite run against it.

    python scripts/asan.py build            # build/asan/: the extension and the runtime's self-test
    python scripts/asan.py test [ARGS...]   # build, then pytest ARGS (default: tests/) under the sanitizer

One library, ``build/asan/_C.so``, holds the C++ CPU kernels and their ops
(``torch.ops.dflash2.*``, CPU only) and the CUDA kernels compiled as host C++ with the
CUDA bindings compiled for CPU tensors (``torch.ops.dflash2_emulated.*``). ``test`` runs
pytest in a fresh process with that library as ``dflash2_kernels._C``
(DFLASH2_EXTENSION_PATH), the sanitizer's runtime preloaded (then the C++ runtime, whose
``__cxa_throw`` the sanitizer otherwise intercepts too early at import), and every
allocation of the C++ ops NaN-poisoned: an out-of-bounds read or write in any kernel,
CPU or CUDA, aborts with a report. ``--no-asan`` builds without the sanitizer.

The build is incremental (ninja, with the compiler's header dependencies): an edit
anywhere under csrc/ rebuilds exactly what it affects. It is a test build, made by the
test command (``make test``), never by ``pip install``. Needs g++, ninja and the CUDA
toolkit's headers (cuda_fp16.h, cuda_bf16.h, cuda_runtime_api.h; no GPU, no nvcc).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "asan"
LIBRARY = BUILD / "_C.so"
SELFTEST = BUILD / "simt_selftest"

RUNTIME_SOURCES = ["csrc/emulation/simt.cpp", "csrc/emulation/fiber.cpp", "csrc/emulation/traffic.cpp"]
# The CPU kernels and the op library as setup.py builds them (the CUDA bindings are the
# emulated ones), plus the emulated CUDA kernels and their op library.
CPU_SOURCES = sorted(
    str(path.relative_to(ROOT)) for path in (ROOT / "csrc").glob("*.cpp") if not path.name.endswith("_cuda.cpp")
)
EMULATED_SOURCES = [
    "csrc/emulation/registration.cpp",
    "csrc/emulation/selector_kernels.cpp",
    "csrc/emulation/serving_kernels.cpp",
    "csrc/emulation/verify_kernels.cpp",
    "csrc/emulation/selector_bindings.cpp",
    "csrc/emulation/serving_bindings.cpp",
    "csrc/emulation/traffic_probe_kernels.cpp",
]
# The kernel files: their sanitizer checks are calls, which the traffic counters hook
# (csrc/emulation/traffic.h). Without the sanitizer, kernel-address instrumentation
# makes the same calls and needs no runtime.
KERNEL_SOURCES = {
    "csrc/emulation/selector_kernels.cpp",
    "csrc/emulation/serving_kernels.cpp",
    "csrc/emulation/verify_kernels.cpp",
    "csrc/emulation/traffic_probe_kernels.cpp",
}
KERNEL_CALL_CHECKS = ["--param", "asan-instrumentation-with-call-threshold=0"]
KERNEL_CALLS_WITHOUT_ASAN = ["-fsanitize=kernel-address", "--param", "asan-stack=0", "--param", "asan-globals=0"]
LIBRARY_SOURCES = CPU_SOURCES + EMULATED_SOURCES + RUNTIME_SOURCES
SELFTEST_SOURCES = RUNTIME_SOURCES + ["tests/simt/simt_selftest.cpp"]
# The sources that include torch's (and Python's) headers; the others need only the CUDA toolkit's.
TORCH_SOURCES = set(CPU_SOURCES) | {
    "csrc/emulation/registration.cpp",
    "csrc/emulation/selector_bindings.cpp",
    "csrc/emulation/serving_bindings.cpp",
}
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer"]
# Test files that run none of the C++ code this build sanitizes (by default `test` leaves
# them out; name them to run them): Triton compiled ahead of time in child processes
# without the sanitizer, the plots, the launcher and the trainers' end-to-end runs (their
# own processes, which skip under the sanitizer), the tuner and its spaces' members (Triton
# kernels and Python only).
NO_CPP_CODE = ["tests/test_triton_aot.py", "tests/test_plot.py", "tests/test_launcher.py",
               "tests/test_trainers_e2e.py", "tests/test_tuning_configs.py", "tests/test_tuner.py"]
# The CUDA bindings compiled for the emulator check the emulated GPU's compute capability
# against the code a build holds (csrc/device_binding.h): here the default list of a CUDA
# 13.0 build, so that the tests can see which capabilities run and the error the others get.
BINDING_SOURCES = {"csrc/emulation/selector_bindings.cpp", "csrc/emulation/serving_bindings.cpp"}


def emulated_build_codes() -> list[str]:
    """-D flags naming the code the emulated build stands for: every architecture of
    dflash2_kernels/_cuda_archs.py's TARGETS, plus PTX of the newest."""
    spec = importlib.util.spec_from_file_location("_dflash2_cuda_archs", ROOT / "dflash2_kernels" / "_cuda_archs.py")
    archs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(archs)
    arch_list = archs.default_arch_list(archs.TARGETS)
    codes = " ".join(archs.codes_of_arch_list(arch_list))
    return [f'-DDFLASH2_CUDA_CODES="{codes}"', f'-DDFLASH2_CUDA_ARCH_LIST="{arch_list}"']


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
        "sanitized build: no CUDA headers (cuda_fp16.h, cuda_bf16.h, cuda_runtime_api.h) found; set CUDA_HOME. "
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
            raise SystemExit(f"sanitized build: {cxx} does not know where {name} is")
        libraries.append(os.path.realpath(path))
    return " ".join(libraries)


def ninja_file(cxx: str, asan: bool) -> str:
    import torch
    from torch.utils import cpp_extension

    # -fvisibility=hidden keeps this library's symbols (the kernels' launchers) from
    # binding to another build's; PyInit__C is exported explicitly by Python's headers.
    common = ["-std=c++20", "-O2", "-g1", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", "-Wno-sign-compare"]
    common += ["-DDFLASH2_EMULATED", f"-I{ROOT / 'csrc'}", f"-isystem{cuda_include_dir()}"]
    if asan:
        common += ASAN_FLAGS
    torch_flags = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    torch_flags.append(f"-isystem{sysconfig.get_paths()['include']}")
    torch_flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    torch_libs = [f"-L{path}" for path in cpp_extension.library_paths()]
    torch_libs += [f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths()]
    torch_libs += ["-lc10", "-ltorch", "-ltorch_cpu"]
    link = ["-pthread", "-fopenmp"] + (ASAN_FLAGS if asan else [])

    def quote(words):
        return " ".join(shlex.quote(w) for w in words)

    kernel_flags = KERNEL_CALL_CHECKS if asan else KERNEL_CALL_CHECKS + KERNEL_CALLS_WITHOUT_ASAN
    lines = [
        f"cxx = {cxx}",
        f"common = {quote(common)}",
        f"torch_flags = {quote(torch_flags)}",
        f"kernel_flags = {quote(kernel_flags)}",
        f"binding_flags = {quote(emulated_build_codes())}",
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
                extra = ["$torch_flags"] * (source in TORCH_SOURCES) + ["$kernel_flags"] * (source in KERNEL_SOURCES) \
                    + ["$binding_flags"] * (source in BINDING_SOURCES)
                lines.append(f"  extra = {' '.join(extra)}")
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
    env["DFLASH2_EXTENSION_PATH"] = str(LIBRARY)
    env["DFLASH2_EMULATED_LIB"] = str(LIBRARY)
    env["DFLASH2_SIMT_SELFTEST"] = str(SELFTEST)
    env["DFLASH2_POISON_OUTPUTS"] = "1"
    # The installed half runs the AVX-512 kernels where the CPU has them; this half runs
    # their AVX2 and default twins (csrc/cpu_row_kernel.h).
    env["DFLASH2_DISABLE_AVX512"] = "1"
    # This build has CPU kernels only (the CUDA kernels are the emulated ops): tests
    # that expect CUDA kernels wherever nvcc exists read this switch.
    env["DFLASH2_BUILD_CUDA"] = "0"
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
        default = [str(ROOT / "tests")] + [f"--ignore={ROOT / name}" for name in NO_CPP_CODE]
        command = [sys.executable, "-m", "pytest", *(pytest_args or default)]
        os.execve(sys.executable, command, test_environment())


if __name__ == "__main__":
    main()
