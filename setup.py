"""Build the dflash2_kernels extension.

    pip install --no-build-isolation .      # the build sees the torch already installed

A CUDA build (``CUDAExtension``: C++ CPU kernels + CUDA kernels) when a CUDA toolkit
and a CUDA build of torch are present, also with no GPU visible; a CPU-only build
(``CppExtension``) otherwise. Switches:

- ``DFLASH2_BUILD_CUDA=1`` forces the CUDA build (fails if impossible), ``=0`` skips it;
- ``TORCH_CUDA_ARCH_LIST`` picks the architectures. Without it: the visible GPUs' (plus
  PTX of the newest); with no GPU visible, every architecture of the GPUs drafters use
  that the toolkit offers, plus PTX of the newest (CUDA 13.0: ``8.0;8.6;8.9;9.0;10.0;12.0+PTX``;
  dflash2_kernels/_cuda_archs.py). The build prints the list it took and why;
- ``MAX_JOBS`` bounds parallel compile jobs (torch's own switch).

The Triton kernels need no build: they compile at run time.

Besides dflash2_kernels, the build installs the startup hook that ``dflash2-run`` and
``DFLASH2_PATCH`` rely on: the torch-free package ``dflash2_kernels_startup`` and
``dflash2_kernels_startup.pth`` at the top of site-packages (``build_startup_hook``
below), in the wheel of ``pip install .`` and in the editable one of ``pip install -e .``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from setuptools import Command, setup
from setuptools.command.build import build

STARTUP_PTH = "dflash2_kernels_startup.pth"

HERE = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home() -> str | None:
    """A CUDA toolkit directory holding bin/nvcc and include/cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        # A wrapper script (`exec /opt/cuda-X/bin/nvcc "$@"`) hides the toolkit; read it.
        with open(nvcc, "rb") as script:
            head = script.read(4096)
        if head.startswith(b"#!"):
            for word in head.decode(errors="ignore").split():
                if word.endswith("/bin/nvcc"):
                    candidates.append(os.path.dirname(os.path.dirname(word)))
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    return None


def _want_cuda(torch) -> bool:
    switch = os.environ.get("DFLASH2_BUILD_CUDA", "auto").lower()
    possible = torch.version.cuda is not None and os.environ.get("CUDA_HOME") is not None
    if switch in ("0", "false", "no"):
        return False
    if switch in ("1", "true", "yes"):
        if not possible:
            raise RuntimeError(
                "DFLASH2_BUILD_CUDA=1 but no CUDA build is possible: "
                f"torch.version.cuda={torch.version.cuda}, CUDA toolkit={os.environ.get('CUDA_HOME')}"
            )
        return True
    return possible


def _cuda_archs():
    """dflash2_kernels/_cuda_archs.py, by path: the package cannot be imported before it is built."""
    spec = importlib.util.spec_from_file_location("_dflash2_cuda_archs", os.path.join(HERE, "dflash2_kernels",
                                                                                        "_cuda_archs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else ""


def _triton_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:
        return ""
    try:
        return version("triton")
    except PackageNotFoundError:
        return ""


def _cuda_arch_flags(torch, cuda_home: str) -> list[str]:
    """Sets TORCH_CUDA_ARCH_LIST (_cuda_archs' rule) and returns the defines that tell the
    extension what it holds (csrc/cuda_arch.h, csrc/registration.cpp)."""
    archs = _cuda_archs()
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    arch_list, why = archs.choose_arch_list(os.environ, capabilities, lambda: archs.toolkit_archs(nvcc))
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    try:  # the -gencode flags torch will hand nvcc (it also reads torch's named architectures)
        from torch.utils.cpp_extension import _get_cuda_arch_flags

        codes = archs.codes_of_gencode_flags(_get_cuda_arch_flags())
    except ImportError:
        codes = archs.codes_of_arch_list(arch_list)
    print(f"dflash2_kernels: CUDA code for {' '.join(codes)} (TORCH_CUDA_ARCH_LIST={arch_list}: {why})")
    return [f'-DDFLASH2_CUDA_CODES="{" ".join(codes)}"', f'-DDFLASH2_CUDA_ARCH_LIST="{arch_list}"',
            f'-DDFLASH2_BUILD_TORCH_CUDA="{torch.version.cuda}"', f'-DDFLASH2_BUILD_NVCC="{_nvcc_version(nvcc)}"',
            f'-DDFLASH2_BUILD_TRITON="{_triton_version()}"']


def _extensions():
    cuda_home = _find_cuda_home()
    if cuda_home and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # No -std: torch.utils.cpp_extension picks the standard its headers need (C++20 for torch 2.14).
    # No fused multiply-adds: the CPU twin of the serving kernels rounds each product and sum
    # as the CUDA kernels do (__fmul_rn, __fadd_rn), so both compute bitwise equal edges.
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off", f'-DDFLASH2_BUILD_TORCH="{torch.__version__}"']
    # The process's libstdc++, never a static copy (LDFLAGS=-static-libstdc++ or a toolchain
    # that defaults to it): a second copy of the iostreams and locale in _C.so has no
    # initialised locale, so every check message formatting an integer comes out cut short
    # or crashes the process (seen on a GPU machine; tests/test_extension_linkage.py). An explicit
    # -lstdc++ here binds every std:: symbol to the shared library before the compiler
    # driver's own (static) -lstdc++ at the end of the line is read.
    link_flags = ["-fopenmp"] + (["-Wl,-Bdynamic", "-lstdc++"] if sys.platform.startswith("linux") else [])
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_glue = [s for s in cpu_sources if s.endswith("_cuda.cpp")]
    cpu_sources = [s for s in cpu_sources if s not in cuda_glue]
    if _want_cuda(torch):
        extension = CUDAExtension(
            "dflash2_kernels._C",
            cpu_sources + cuda_glue + sorted(glob.glob("csrc/kernels/*.cu")),
            include_dirs=[os.path.abspath("csrc")],
            define_macros=[("DFLASH2_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags + _cuda_arch_flags(torch, os.environ["CUDA_HOME"]),
                                "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=link_flags,
        )
    else:
        extension = CppExtension(
            "dflash2_kernels._C",
            cpu_sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return [extension], {"build_ext": BuildExtension}


class build_startup_hook(Command):
    """Put dflash2_kernels_startup.pth at the top of site-packages. A wheel installs what
    ``build_lib`` holds there; an editable wheel (PEP 660) holds only a finder for the
    package's modules, and takes its other top-level files from the directory setuptools
    unpacks it in, ``install_lib`` in editable mode: the .pth is written there instead."""

    description = "add the startup hook's .pth file (see dflash2_kernels_startup/__init__.py)"
    user_options: list = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(STARTUP_PTH, os.path.join(target, STARTUP_PTH), preserve_mode=False)

    def get_outputs(self):
        return [os.path.join(self.build_lib, STARTUP_PTH)]

    def get_output_mapping(self):
        return {}

    def get_source_files(self):
        return [STARTUP_PTH]


class build_with_startup_hook(build):
    sub_commands = build.sub_commands + [("build_startup_hook", None)]


ext_modules, cmdclass = _extensions()
cmdclass.update(build=build_with_startup_hook, build_startup_hook=build_startup_hook)
setup(ext_modules=ext_modules, cmdclass=cmdclass)
