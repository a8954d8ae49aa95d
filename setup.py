"""Build the dflash2_kernels extension.

    pip install --no-build-isolation .      # the build sees the torch already installed

A CUDA build (``CUDAExtension``: C++ CPU kernels + CUDA kernels) when a CUDA toolkit
and a CUDA build of torch are present, also with no GPU visible; a CPU-only build
(``CppExtension``) otherwise. Switches:

- ``DFLASH2_BUILD_CUDA=1`` forces the CUDA build (fails if impossible), ``=0`` skips it;
- ``TORCH_CUDA_ARCH_LIST`` picks the architectures (default ``9.0+PTX``: sm_90 code plus
  PTX that later GPUs JIT-compile). It is never left to detection: with no GPU
  visible, detection yields an empty list;
- ``MAX_JOBS`` bounds parallel compile jobs (torch's own switch).

The Triton kernels need no build: they compile at run time.

Besides dflash2_kernels, the build installs the startup hook that ``dflash2-run`` and
``DFLASH2_PATCH`` rely on: the torch-free package ``dflash2_kernels_startup`` and
``dflash2_kernels_startup.pth`` at the top of site-packages (``build_startup_hook``
below), in the wheel of ``pip install .`` and in the editable one of ``pip install -e .``.
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import Command, setup
from setuptools.command.build import build

STARTUP_PTH = "dflash2_kernels_startup.pth"


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


def _extensions():
    cuda_home = _find_cuda_home()
    if cuda_home and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # No -std: torch.utils.cpp_extension picks the standard its headers need (C++20 for torch 2.14).
    # No fused multiply-adds: the CPU twin of the serving kernels rounds each product and sum
    # as the CUDA kernels do (__fmul_rn, __fadd_rn), so both compute bitwise equal edges.
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_glue = [s for s in cpu_sources if s.endswith("_cuda.cpp")]
    cpu_sources = [s for s in cpu_sources if s not in cuda_glue]
    if _want_cuda(torch):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0+PTX")
        extension = CUDAExtension(
            "dflash2_kernels._C",
            cpu_sources + cuda_glue + sorted(glob.glob("csrc/kernels/*.cu")),
            include_dirs=[os.path.abspath("csrc")],
            define_macros=[("DFLASH2_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        extension = CppExtension(
            "dflash2_kernels._C",
            cpu_sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
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
