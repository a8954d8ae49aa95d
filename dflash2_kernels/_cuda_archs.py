"""The GPU architectures a CUDA build holds code for, and each one's limits.

Standard library only: setup.py loads this file by path at build time (the package cannot
be imported before it is built), ``make cuda-check`` and CMakeLists.txt run it as a
script (the default list; the compiled kernels against each architecture's limits), and
the tests import it.

Which architectures a build targets (:func:`choose_arch_list`, called by setup.py):

- ``TORCH_CUDA_ARCH_LIST`` set: that list, as given (torch's syntax: ``"8.0;9.0+PTX"``);
- a GPU visible: the architecture of every visible GPU, plus PTX of the newest;
- no GPU visible: every architecture of :data:`TARGETS` the CUDA toolkit offers
  (``nvcc --list-gpu-arch``), plus PTX of the newest, which the driver JIT-compiles for
  GPUs newer than the toolkit.

CUDA's compatibility rules decide where that code runs: machine code for sm_XY runs on
compute capability X.Z with Z >= Y (the same major); PTX for compute_XY on X.Y and every
later one. So 8.7 / 8.8 run sm_86's code, 10.3 (B300) sm_100's, 12.1 (DGX Spark)
sm_120's; 11.0 (Jetson Thor) runs none of the default list (a rebuild for it:
``TORCH_CUDA_ARCH_LIST=11.0``). csrc/cuda_arch.h applies the same rules at run time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys

# The compute capabilities of the GPUs drafters train and serve on, in order.
TARGETS: dict[tuple[int, int], str] = {
    (8, 0): "A100",
    (8, 6): "A10, A40, RTX 3090",
    (8, 9): "L4, L40S, RTX 4090",
    (9, 0): "H100, H200",
    (10, 0): "B200, GB200",
    (12, 0): "RTX 5090, RTX PRO 6000",
}
# What one thread block may use on each of them: shared memory (KiB; CUDA programming
# guide, "Technical specifications per compute capability"), registers.
SHARED_MEMORY_KIB: dict[tuple[int, int], int] = {
    (8, 0): 163, (8, 6): 99, (8, 9): 99, (9, 0): 227, (10, 0): 227, (12, 0): 99,
}
REGISTERS_PER_THREAD = 255
REGISTERS_PER_MULTIPROCESSOR = 65_536

_ENTRY = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def arch_name(capability: tuple[int, int]) -> str:
    """(9, 0) -> "9.0" (TORCH_CUDA_ARCH_LIST's spelling)."""
    return f"{capability[0]}.{capability[1]}"


def toolkit_archs(nvcc: str = "nvcc") -> list[tuple[int, int]]:
    """The compute capabilities ``nvcc`` can compile for (``--list-gpu-arch``), ascending.
    RuntimeError when nvcc cannot say."""
    try:
        listing = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(f"`{nvcc} --list-gpu-arch` failed ({error}): set TORCH_CUDA_ARCH_LIST to choose the "
                           "architectures (e.g. TORCH_CUDA_ARCH_LIST=\"8.0;9.0+PTX\")") from error
    found = {(int(m.group(1)[:-1]), int(m.group(1)[-1])) for m in re.finditer(r"^compute_(\d{2,3})$", listing, re.M)}
    return sorted(found)


def default_arch_list(offered) -> str:
    """The list for a build that sees no GPU: :data:`TARGETS` that ``offered`` holds, plus
    PTX of the newest. ValueError when it holds none of them."""
    chosen = [arch_name(target) for target in TARGETS if target in set(offered)]
    if not chosen:
        raise ValueError(f"the CUDA toolkit offers none of {', '.join(map(arch_name, TARGETS))} "
                         f"(it offers {', '.join(map(arch_name, offered)) or 'nothing'}): "
                         "set TORCH_CUDA_ARCH_LIST to choose the architectures")
    return ";".join(chosen) + "+PTX"


def visible_arch_list(capabilities, offered) -> str | None:
    """The list for the visible GPUs: each one's architecture, plus PTX of the newest; None
    when the toolkit cannot compile for one of them (the default list then stands)."""
    wanted = sorted(set(capabilities))
    if not wanted or any(c not in set(offered) for c in wanted):
        return None
    return ";".join(arch_name(c) for c in wanted) + "+PTX"


def choose_arch_list(environ, capabilities, offered_fn) -> tuple[str, str]:
    """(TORCH_CUDA_ARCH_LIST to build with, why). ``capabilities``: the visible GPUs'
    compute capabilities; ``offered_fn()``: the toolkit's (:func:`toolkit_archs`), asked
    only when needed."""
    given = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given:
        return given, "set in the environment"
    offered = offered_fn()
    visible = visible_arch_list(capabilities, offered)
    if visible is not None:
        return visible, "the visible GPU" + ("s" if len(set(capabilities)) > 1 else "")
    unsupported = sorted(set(capabilities) - set(offered))
    why = "no GPU visible" if not capabilities else \
        f"the toolkit cannot compile for the visible {', '.join(map(arch_name, unsupported))}"
    return default_arch_list(offered), f"{why}: the default list"


def codes_of_gencode_flags(flags) -> list[str]:
    """The code a build holds, from nvcc's ``-gencode=arch=compute_XY,code=sm_XY`` flags:
    ["sm_80", ..., "compute_120"], machine code first, each ascending."""
    codes = {m.group(1) for flag in flags for m in re.finditer(r"code=\[?((?:sm|compute)_\d+[af]?)", flag)}
    return _sorted_codes(codes)


def codes_of_arch_list(arch_list: str) -> list[str]:
    """The same from a numeric TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX"); ValueError naming an
    entry it cannot read (torch's named architectures need torch's own parser)."""
    codes = set()
    for entry in arch_list.replace(" ", ";").split(";"):
        if not entry:
            continue
        match = _ENTRY.match(entry)
        if match is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {entry!r} is not of the form 8.6, 9.0a or 12.0+PTX")
        number = match.group(1) + match.group(2) + match.group(3)
        codes.add(f"sm_{number}")
        if match.group(4):
            codes.add(f"compute_{number}")
    return _sorted_codes(codes)


def _sorted_codes(codes) -> list[str]:
    def key(code: str):
        kind, _, number = code.partition("_")
        return (kind == "compute", int(re.match(r"\d+", number).group()), number)

    return sorted(codes, key=key)


def cmake_architectures(arch_list: str) -> str:
    """CMAKE_CUDA_ARCHITECTURES for a numeric TORCH_CUDA_ARCH_LIST: "8.0;9.0+PTX" ->
    "80-real;90-real;90-virtual"."""
    spelled = []
    for code in codes_of_arch_list(arch_list):
        kind, _, number = code.partition("_")
        spelled.append(f"{number}-{'real' if kind == 'sm' else 'virtual'}")
    return ";".join(spelled)


# --- what compiled kernels use (cuobjdump --dump-resource-usage) ----------------------------


def find_cuobjdump() -> str | None:
    """A cuobjdump: on PATH, in the CUDA toolkit, or the one Triton ships; None if none."""
    candidates = [shutil.which("cuobjdump")]
    candidates += [os.path.join(home, "bin", "cuobjdump") for home in
                   (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if home]
    spec = importlib.util.find_spec("triton")  # located, not imported
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in candidates if c and os.path.exists(c)), None)


def resource_usage(dump: str) -> list[dict]:
    """Per function and architecture of ``cuobjdump --dump-resource-usage`` output: arch
    (major, minor), function, registers, stack, local and (static) shared bytes."""
    rows, arch, function = [], None, None
    for line in dump.splitlines():
        line = line.strip()
        if line.startswith("Fatbin"):
            arch = None  # "Fatbin ptx code" sections hold no machine code
        elif match := re.match(r"arch = sm_(\d+)[af]?$", line):
            number = match.group(1)
            arch = (int(number[:-1]), int(number[-1]))
        elif line.startswith("Function ") and arch is not None:
            function = line[len("Function "):].rstrip(":")
        elif line.startswith("REG:") and function is not None:
            fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line))
            rows.append({"arch": arch, "function": function, "registers": int(fields["REG"]),
                         "stack": int(fields["STACK"]), "local": int(fields["LOCAL"]),
                         "shared": int(fields["SHARED"])})
            function = None
    return rows


def over_limits(rows) -> list[str]:
    """What in :func:`resource_usage`'s rows exceeds its architecture's limits: registers a
    thread, static shared memory a block (spills are ptxas's to report: -warn-spills)."""
    problems = []
    for row in rows:
        name, arch = row["function"], row["arch"]
        if row["registers"] > REGISTERS_PER_THREAD:
            problems.append(f"sm_{arch[0]}{arch[1]} {name}: {row['registers']} registers a thread")
        limit = SHARED_MEMORY_KIB.get(arch, min(SHARED_MEMORY_KIB.values())) * 1024
        if row["shared"] > limit:
            problems.append(f"sm_{arch[0]}{arch[1]} {name}: {row['shared']} bytes of shared memory, over {limit}")
    return problems


def check_resources(paths, cuobjdump: str | None) -> int:
    """``make cuda-check``'s second half: the compiled kernels of ``paths`` (objects,
    archives, libraries) within every architecture's limits. 0 when they are (or when no
    cuobjdump can read them: said so), 1 otherwise."""
    if cuobjdump is None:
        print("resource check skipped: no cuobjdump (CUDA toolkit, or Triton's)")
        return 0
    rows = []
    for path in paths:
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, check=True)
        rows += resource_usage(dump.stdout)
    for arch in sorted({row["arch"] for row in rows}):
        of_arch = [row for row in rows if row["arch"] == arch]
        print(f"sm_{arch[0]}{arch[1]}: {len(of_arch)} kernels, at most {max(r['registers'] for r in of_arch)} "
              f"registers a thread and {max(r['shared'] for r in of_arch)} bytes of static shared memory")
    problems = over_limits(rows)
    print("\n".join(problems) or "within every architecture's limits")
    return 1 if problems or not rows else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The default CUDA architecture list (no GPU visible); "
                                                 "--check-resources: compiled kernels against its limits.")
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--cmake", action="store_true", help="as CMAKE_CUDA_ARCHITECTURES")
    parser.add_argument("--check-resources", nargs="+", metavar="FILE", help="objects or libraries to check")
    args = parser.parse_args(argv)
    if args.check_resources:
        return check_resources(args.check_resources, find_cuobjdump())
    arch_list = default_arch_list(toolkit_archs(args.nvcc))
    print(cmake_architectures(arch_list) if args.cmake else arch_list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
