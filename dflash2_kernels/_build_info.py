"""What the installed build holds and what runs where on this machine: :func:`build_info`.

``print(dk.build_info())`` answers the questions a user of a GPU build has: which torch,
CUDA toolkit and Triton it was built with (and which run now), which GPU architectures its
CUDA kernels were compiled for, what code each visible GPU runs (machine code, PTX the
driver JIT-compiles, or none: the first call of a CUDA kernel op then raises, naming the
command that rebuilds for it), and which implementation each op takes on each device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _extension
from ._backend import BACKEND_ENV, selected_backend, triton_importable
from ._extension import has_kernel

__all__ = ["BuildInfo", "GpuInfo", "build_info"]

# The ops whose CUDA implementation is a compiled CUDA C++ kernel: (what a user calls,
# the C++ op, whether a call without a kernel falls back to the PyTorch reference).
_CUDA_KERNEL_OPS = [
    ("selector (score_candidates, pair_scores, CandidateSelector)", "selector_scores", False),
    ("candidate_topk", "candidate_topk", True),
    ("edge_scores, walk", "select_path", True),
    ("rejection_sample", "rejection_sample", True),
]


@dataclass(frozen=True)
class GpuInfo:
    """A visible GPU: its index, name, compute capability and the build's code it runs
    (``"sm_90"``, ``"compute_120"`` for PTX; None when the build holds none for it)."""

    index: int
    name: str
    capability: tuple[int, int]
    code: str | None


@dataclass(frozen=True)
class BuildInfo:
    """What :func:`build_info` reports. ``built_with``: the versions the extension was
    built with (``torch``, ``torch_cuda``, ``nvcc``, ``triton``; empty where unknown);
    ``running``: the same now; ``cuda_codes``: the CUDA code the extension holds (empty
    for a CPU-only build); ``backends``: op -> device ("cpu", "cuda:0", ...) -> what runs."""

    version: str
    extension: str | None
    extension_error: str | None
    with_cuda: bool
    built_with: dict[str, str]
    cuda_arch_list: str
    cuda_codes: tuple[str, ...]
    running: dict[str, str]
    gpus: tuple[GpuInfo, ...]
    backends: dict[str, dict[str, str]] = field(default_factory=dict)

    def __str__(self) -> str:
        def versions(v: dict[str, str]) -> str:
            parts = [f"torch {v['torch']}" + (f" (CUDA {v['torch_cuda']})" if v.get("torch_cuda") else "")]
            parts += [f"{name} {v[name]}" for name in ("nvcc", "triton") if v.get(name)]
            return ", ".join(parts) if v.get("torch") else "unknown (a build older than build_info)"

        lines = [f"dflash2_kernels {self.version}"]
        if self.extension is None:
            lines.append(f"extension:  not built ({self.extension_error}): PyTorch fallbacks run")
        else:
            lines.append(f"extension:  {self.extension} ({'CUDA' if self.with_cuda else 'CPU-only'} build)")
            lines.append(f"built with: {versions(self.built_with)}")
            if self.with_cuda:
                lines.append(f"CUDA code:  {' '.join(self.cuda_codes) or 'none'} "
                             f"(TORCH_CUDA_ARCH_LIST={self.cuda_arch_list or 'unknown'})")
        lines.append(f"running:    {versions(self.running)}, {BACKEND_ENV}={self.running['backend']}")
        if not self.gpus:
            lines.append("GPUs:       none visible")
        for gpu in self.gpus:
            runs = (f"runs {gpu.code}" + (" (PTX, JIT-compiled by the driver)" if gpu.code.startswith("compute_")
                                          else "")) if gpu.code else "NO CUDA CODE in this build"
            lines.append(f"GPU:        cuda:{gpu.index} {gpu.name}, compute capability "
                         f"{gpu.capability[0]}.{gpu.capability[1]}: {runs}")
        devices = list(next(iter(self.backends.values()), {}))
        width = max(len(op) for op in self.backends)
        lines.append("backends:   " + " | ".join(devices))
        for op, where in self.backends.items():
            lines.append(f"  {op:<{width}}  " + " | ".join(where[d] for d in devices))
        return "\n".join(lines)


def _running() -> dict[str, str]:
    triton_version = ""
    if triton_importable():
        import triton

        triton_version = triton.__version__
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda or "", "triton": triton_version,
            "backend": selected_backend()}


def _gpus(code_for) -> tuple[GpuInfo, ...]:
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        capability = tuple(torch.cuda.get_device_capability(index))
        gpus.append(GpuInfo(index, torch.cuda.get_device_name(index), capability, code_for(*capability)))
    return tuple(gpus)


def _backends(gpus: tuple[GpuInfo, ...]) -> dict[str, dict[str, str]]:
    devices = ["cpu"] + [f"cuda:{gpu.index}" for gpu in gpus]
    backend = selected_backend()
    if backend == "reference":
        return {op: {d: "PyTorch reference" for d in devices}
                for op in ["grouped_dynamic_conv", "draft_head", *(name for name, _, _ in _CUDA_KERNEL_OPS)]}
    triton = triton_importable()
    table: dict[str, dict[str, str]] = {}

    table["grouped_dynamic_conv"] = {"cpu": "Triton (interpreted)" if backend == "triton" else
                                     "C++" if has_kernel("conv_forward_cpu", "cpu") else "PyTorch (vectorized)"}
    table["draft_head"] = {"cpu": "Triton rows (interpreted)" if backend == "triton" else
                           "C++ rows" if has_kernel("draft_head_rows_cpu", "cpu") else "PyTorch reference"}
    for gpu in gpus:
        device = f"cuda:{gpu.index}"
        table["grouped_dynamic_conv"][device] = "Triton" if triton else "PyTorch (vectorized)"
        table["draft_head"][device] = "Triton rows" if triton else "PyTorch reference"

    for name, op, falls_back in _CUDA_KERNEL_OPS:
        fallback = "PyTorch reference" if falls_back or not _extension.EXTENSION_LOADED else "none (the call raises)"
        row = {"cpu": "C++" if has_kernel(op, "cpu") else "PyTorch reference"}
        for gpu in gpus:
            if not has_kernel(op, "cuda"):
                row[f"cuda:{gpu.index}"] = fallback
            elif gpu.code is None:
                row[f"cuda:{gpu.index}"] = "none: no code for this GPU (the first call raises)"
            else:
                row[f"cuda:{gpu.index}"] = f"CUDA C++ ({gpu.code})"
        table[name] = row
    table["greedy_verify"] = {d: "PyTorch" for d in devices}
    return table


def build_info() -> BuildInfo:
    """What the installed build holds and what runs on this machine (``print`` it).

    Reports the versions the compiled extension was built with and those running now,
    the CUDA code it holds (``sm_XY`` machine code, ``compute_XY`` PTX), each visible GPU's
    compute capability and the code it runs, and each op's implementation per device.
    A GPU shown with no code makes the CUDA kernel ops raise on their first call there,
    with the command that rebuilds for it.
    """
    module = _extension.EXTENSION
    built = getattr(module, "build_info", None)
    info = built() if built is not None else {}
    code_for = getattr(module, "cuda_code_for", None) or (lambda major, minor: None)
    gpus = _gpus(code_for)
    from . import __version__

    return BuildInfo(
        version=__version__,
        extension=getattr(module, "__file__", None) if module is not None else None,
        extension_error=_extension.EXTENSION_ERROR,
        with_cuda=bool(info.get("with_cuda", module is not None and has_kernel("selector_scores", "cuda"))),
        built_with={key: info.get(key, "") for key in ("torch", "torch_cuda", "nvcc", "triton")},
        cuda_arch_list=info.get("cuda_arch_list", ""),
        cuda_codes=tuple(info.get("cuda_codes", "").split()),
        running=_running(),
        gpus=gpus,
        backends=_backends(gpus),
    )
