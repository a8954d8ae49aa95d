"""The GPU architectures a CUDA build targets and what runs where.

- the list a build takes (dflash2_kernels/_cuda_archs.py): TORCH_CUDA_ARCH_LIST, else the
  visible GPUs', else every target the toolkit offers, plus PTX of the newest;
- CUDA's compatibility rules as the extension applies them at run time (csrc/cuda_arch.h,
  through ``_C.cuda_code_for``), and the error a GPU without code gets;
- :func:`dflash2_kernels.build_info`, also with a GPU faked;
- the built library's cubins and PTX, read with cuobjdump, against what it says it holds.

The emulated CUDA bindings' check of the device (the error raised by the op itself) is in
tests/emulated/test_device_code.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import _cuda_archs as archs
from dflash2_kernels import _extension
from dflash2_kernels._extension import has_kernel

CUDA_13_0 = [(7, 5), (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]
CUDA_12_8 = [(5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 1), (12, 0)]
CUDA_12_4 = [(5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0)]
FULL_13_0 = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"
KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "kernels"


def _offered(listing):
    return lambda: listing


@pytest.mark.parametrize("environ, gpus, offered, expected", [
    ({}, [], CUDA_13_0, FULL_13_0),
    ({}, [], CUDA_12_8, FULL_13_0),
    ({}, [], CUDA_12_4, "8.0;8.6;8.9;9.0+PTX"),  # an older toolkit: what it offers from sm_80 up
    ({}, [(9, 0)], CUDA_13_0, "9.0+PTX"),
    ({}, [(9, 0), (8, 6), (9, 0)], CUDA_13_0, "8.6;9.0+PTX"),
    ({}, [(12, 1)], CUDA_12_8, FULL_13_0),  # a GPU the toolkit cannot target: the default list (its PTX)
    ({"TORCH_CUDA_ARCH_LIST": "7.5"}, [(9, 0)], CUDA_13_0, "7.5"),
    ({"TORCH_CUDA_ARCH_LIST": "Hopper"}, [], CUDA_13_0, "Hopper"),  # as given: torch reads names
])
def test_the_architectures_a_build_takes(environ, gpus, offered, expected):
    arch_list, why = archs.choose_arch_list(environ, gpus, _offered(offered))
    assert arch_list == expected, why


def test_torch_cuda_arch_list_wins_without_asking_the_toolkit():
    def no_toolkit():
        raise AssertionError("the toolkit was asked")

    assert archs.choose_arch_list({"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}, [(9, 0)], no_toolkit) == \
        ("8.0;9.0", "set in the environment")


def test_a_toolkit_without_any_target_says_how_to_choose():
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        archs.choose_arch_list({}, [], _offered([(5, 0), (7, 5)]))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_the_toolkit_here_offers_the_targets_from_sm_80():
    offered = archs.toolkit_archs("nvcc")
    assert offered == sorted(offered) and (8, 0) in offered
    chosen = archs.default_arch_list(offered)
    assert chosen.endswith("+PTX") and chosen.startswith("8.0;")


def test_code_and_cmake_spellings():
    assert archs.codes_of_arch_list(FULL_13_0) == ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120",
                                                   "compute_120"]
    assert archs.codes_of_arch_list("9.0a 10.0+PTX") == ["sm_90a", "sm_100", "compute_100"]
    assert archs.cmake_architectures("8.6;12.0+PTX") == "86-real;120-real;120-virtual"
    with pytest.raises(ValueError, match="'Ampere'"):
        archs.codes_of_arch_list("Ampere")


def test_torch_hands_nvcc_the_code_we_record(monkeypatch):
    """setup.py records the code from torch's own -gencode flags: the same as our reading
    of the list (and it also reads torch's named architectures)."""
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    for arch_list in (FULL_13_0, "9.0", "8.0;9.0a+PTX"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        assert archs.codes_of_gencode_flags(_get_cuda_arch_flags()) == archs.codes_of_arch_list(arch_list)


# --- CUDA's rules at run time (csrc/cuda_arch.h) ----------------------------------------------

needs_module = pytest.mark.skipif(not hasattr(_extension.EXTENSION, "cuda_code_for"),
                                  reason="the extension is not built (or predates cuda_code_for)")
DEFAULT_CODES = "sm_80 sm_86 sm_89 sm_90 sm_100 sm_120 compute_120"


@needs_module
@pytest.mark.parametrize("codes, capability, expected", [
    (DEFAULT_CODES, (7, 5), None),  # older than every code
    (DEFAULT_CODES, (8, 0), "sm_80"),
    (DEFAULT_CODES, (8, 6), "sm_86"),
    (DEFAULT_CODES, (8, 7), "sm_86"),  # Jetson Orin: the same major's lower minor
    (DEFAULT_CODES, (8, 9), "sm_89"),
    (DEFAULT_CODES, (9, 0), "sm_90"),
    (DEFAULT_CODES, (10, 0), "sm_100"),
    (DEFAULT_CODES, (10, 3), "sm_100"),  # B300
    (DEFAULT_CODES, (11, 0), None),  # Jetson Thor: no sm_11x code, and compute_120 PTX is newer
    (DEFAULT_CODES, (12, 1), "sm_120"),  # DGX Spark
    (DEFAULT_CODES, (13, 0), "compute_120"),  # a later GPU JIT-compiles the PTX
    ("sm_90", (10, 0), None),  # machine code never crosses a major
    ("sm_90a", (9, 0), "sm_90a"),
    ("sm_80 sm_90a", (9, 0), "sm_90a"),
    ("sm_86 compute_80", (9, 0), "compute_80"),
    ("sm_90a compute_90a", (10, 0), None),  # arch-specific code: that capability alone
    ("sm_100f", (10, 3), "sm_100f"),
    ("sm_100f", (11, 0), None),
    ("", (9, 0), None),
])
def test_which_code_a_gpu_runs(codes, capability, expected):
    assert _extension.EXTENSION.cuda_code_for(*capability, codes) == expected


@needs_module
def test_the_error_for_a_gpu_without_code_says_how_to_rebuild():
    message = _extension.EXTENSION.missing_code_message(1, 7, 5)
    info = dk.build_info()
    assert "cuda:1" in message and "compute capability 7.5 (sm_75)" in message
    assert 'TORCH_CUDA_ARCH_LIST="7.5+PTX" pip install --no-build-isolation' in message
    assert all(code in message for code in info.cuda_codes)
    assert f'TORCH_CUDA_ARCH_LIST="{info.cuda_arch_list}"' in message


# --- build_info ----------------------------------------------------------------------------


def test_build_info_reports_the_build_and_this_machine():
    info = dk.build_info()
    text = str(info)
    assert info.running["torch"] == torch.__version__ and f"torch {torch.__version__}" in text
    assert set(info.backends["grouped_dynamic_conv"]) == {"cpu"} | {f"cuda:{g.index}" for g in info.gpus}
    if info.extension is None:
        assert "not built" in text
        return
    assert info.built_with["torch"] in ("", torch.__version__)  # "": a build that does not record it
    assert info.with_cuda == has_kernel("selector_scores", "cuda")
    if info.with_cuda:
        assert info.cuda_codes and all(re.fullmatch(r"(sm|compute)_\d+[af]?", c) for c in info.cuda_codes)
        assert "CUDA code:  " + " ".join(info.cuda_codes) in text
    cpu = "C++" if has_kernel("conv_forward_cpu", "cpu") else "PyTorch (vectorized)"
    assert info.backends["grouped_dynamic_conv"]["cpu"] == cpu


@pytest.mark.parametrize("capability", [(7, 5), (9, 0)])
def test_build_info_on_a_faked_gpu(monkeypatch, capability):
    """What a user of a GPU the build lacks code for is told: no code, the first call of
    the CUDA kernel ops raises; on a GPU it has code for, the code each one runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Faked GPU")
    info = dk.build_info()
    (gpu,) = info.gpus
    expected_code = _extension.EXTENSION.cuda_code_for(*capability) if info.with_cuda else None
    assert gpu.capability == capability and gpu.code == expected_code
    selector = info.backends["selector (score_candidates, pair_scores, CandidateSelector)"]["cuda:0"]
    topk = info.backends["candidate_topk"]["cuda:0"]
    if not info.with_cuda:
        assert topk == "PyTorch reference"
    elif expected_code is None:
        assert selector == topk == "none: no code for this GPU (the first call raises)"
        assert "NO CUDA CODE in this build" in str(info)
    else:
        assert selector == topk == f"CUDA C++ ({expected_code})"
        assert f"compute capability {capability[0]}.{capability[1]}: runs {expected_code}" in str(info)


# --- the built library itself ------------------------------------------------------------------


def _library_and_tool():
    info = dk.build_info()
    if not info.with_cuda:
        pytest.skip("a CPU-only build: no CUDA code to list")
    tool = archs.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's) to read the library with")
    return info, tool


def test_the_library_holds_the_code_it_reports():
    """cuobjdump's listing of the built _C: every CUDA kernel file's machine code for each
    sm_XY and PTX for each compute_XY that build_info reports, and nothing else."""
    info, tool = _library_and_tool()

    def listing(flag: str, suffix: str) -> dict[str, set[str]]:
        out = subprocess.run([tool, flag, info.extension], capture_output=True, text=True, check=True).stdout
        found: dict[str, set[str]] = {}
        for source, arch in re.findall(rf"(\w+?)(?:\.cu)?\.(sm_\d+[af]?)\.{suffix}", out):
            found.setdefault(source, set()).add(arch)
        return found

    machine = {c for c in info.cuda_codes if c.startswith("sm_")}
    ptx = {"sm_" + c.partition("_")[2] for c in info.cuda_codes if c.startswith("compute_")}
    kernel_files = {path.stem for path in KERNELS.glob("*.cu")}
    cubins, ptxs = listing("--list-elf", "cubin"), listing("--list-ptx", "ptx")
    assert set(cubins) == kernel_files, cubins
    for source in kernel_files:
        assert cubins[source] == machine, f"{source}: cubins {sorted(cubins[source])}, reported {sorted(machine)}"
        assert ptxs.get(source, set()) == ptx, f"{source}: PTX {sorted(ptxs.get(source, ()))}, reported {sorted(ptx)}"


def test_the_library_kernels_fit_their_architectures():
    """Every CUDA kernel of the built library, for every architecture it holds: registers a
    thread and shared memory a block within that architecture's limits, no spill."""
    info, tool = _library_and_tool()
    dump = subprocess.run([tool, "--dump-resource-usage", info.extension], capture_output=True, text=True,
                          check=True).stdout
    rows = archs.resource_usage(dump)
    held = {f"sm_{major}{minor}" for major, minor in {row["arch"] for row in rows}}
    assert held == {c for c in info.cuda_codes if c.startswith("sm_")}
    assert archs.over_limits(rows) == []
    assert all(row["local"] == 0 for row in rows), [row["function"] for row in rows if row["local"]]
