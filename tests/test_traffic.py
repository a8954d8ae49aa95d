"""Global-memory traffic of the Triton kernels, counted under the interpreter
(benchmarks/traffic_counters.py): each kernel held to its minimum and budget
(benchmarks/traffic_minimum.py) at small shapes, the counter checked on copies whose
every number is known, planted regressions (a second read, a strided access) that the
checks must catch; and the aten counter the eager estimates come from. The CUDA
kernels' twin of this file: tests/emulated/test_traffic_kernels.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import traffic_cases as cases  # noqa: E402
import traffic_minimum as minimum  # noqa: E402
from traffic_counters import AtenTraffic, TritonTraffic  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dflash2_kernels.conv.launch import KERNELS_INTERPRETED  # noqa: E402

interpreted = pytest.mark.skipif(not KERNELS_INTERPRETED, reason="counts the Triton interpreter (TRITON_INTERPRET=1)")

BLOCK = 256


@triton.jit
def _probe_copy_kernel(x_ptr, out_ptr, n, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    """out = 2 x: 0 one read, 1 a second read of the same tile, 2 every other element of x
    (a strided read of twice as many bytes' sectors)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if VARIANT == 2:
        x = tl.load(x_ptr + 2 * offsets, mask=mask)
        tl.store(out_ptr + offsets, x + x, mask=mask)
    else:
        x = tl.load(x_ptr + offsets, mask=mask)
        again = x
        if VARIANT == 1:
            again = tl.load(x_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x + again, mask=mask)


def _probe(variant: int, n: int):
    x = torch.arange(2 * n if variant == 2 else n, dtype=torch.float32)
    out = torch.empty(n)
    with TritonTraffic() as counter:
        _probe_copy_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, VARIANT=variant, BLOCK=BLOCK)
    (launch,) = counter.launches
    return launch, x, out


@interpreted
def test_a_masked_copy_is_counted_exactly():
    n = 1000  # 4 programs, the last one masked past 1000
    launch, x, out = _probe(0, n)
    assert torch.equal(out, 2 * x)
    assert launch.name == "_probe_copy_kernel" and launch.programs == 4
    for kind in (launch.loads, launch.stores):
        assert kind.requests == 4 and kind.bytes == kind.lane_bytes == 4 * n
        assert kind.sectors == 125 and kind.ideal_sectors == 125  # 4000 bytes, sector-aligned
    assert (launch.read_unique_bytes, launch.write_unique_bytes) == (4 * n, 4 * n)
    assert launch.program_unique_bytes_max == 2 * 4 * BLOCK
    assert minimum.check(launch, 8 * n, minimum.budget_for("traffic_probe_kernel")) == []


@interpreted
@pytest.mark.parametrize("variant, problem", [(1, "requested bytes"), (2, "sectors per request")],
                         ids=["second-read", "strided"])
def test_planted_regressions_break_the_budget(variant, problem):
    n = 1024
    launch, x, out = _probe(variant, n)
    assert launch.read_unique_bytes == 4 * n
    problems = minimum.check(launch, 8 * n, minimum.budget_for("traffic_probe_kernel"))
    assert len(problems) == 1 and problem in problems[0], problems


SMALL_VOCAB = 5000  # two segments of 4096, the last one ragged
SMALL_CASES = [
    ("conv forward fp32", cases.conv_forward_case(torch.float32, 512), 24),
    ("conv forward bf16", cases.conv_forward_case(torch.bfloat16, 512), 24),
    ("conv backward fp32", cases.conv_backward_case(torch.float32, 512), 24),
    ("head forward kl_div", cases.head_forward_case(SMALL_VOCAB, ("kl_div",), 16), 2),
    ("head forward ce", cases.head_forward_case(SMALL_VOCAB, ("ce",), 16), 2),
    ("head backward kept planes", cases.head_backward_case(SMALL_VOCAB, False), 2),
    ("head backward recompute", cases.head_backward_case(SMALL_VOCAB, True), 2),
    ("head top-k radix", cases.head_radix_case(SMALL_VOCAB, 80), 2),
    ("head vocab-parallel shard", cases.head_shard_case(SMALL_VOCAB), 2),
]


@interpreted
@pytest.mark.parametrize("make, rows", [c[1:] for c in SMALL_CASES], ids=[c[0] for c in SMALL_CASES])
def test_kernels_within_their_budgets(make, rows):
    run = make(rows, None, "cpu")
    if run.reset:
        run.reset()
    with TritonTraffic() as counter:
        result = run.ours()
    need = run.minimum(result)
    assert [launch.name for launch in counter.launches] == [minimum.kernel_name(key) for key in run.kernels]
    problems = []
    for launch, key in zip(counter.launches, run.kernels):
        problems += minimum.check(launch, need.kernels[key], minimum.budget_for(key), key)
    assert problems == []


ROOT = Path(__file__).resolve().parents[1]


def _package_kernels() -> set[str]:
    """Every kernel a launch can name: the CUDA __global__ functions under csrc/kernels and
    the @triton.jit functions of the package whose names end in _kernel (the helpers they
    call do not)."""
    cuda = {name for path in (ROOT / "csrc" / "kernels").glob("*.cu")
            for name in re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+_kernel)\s*\(",
                                   path.read_text())}
    triton_jit = {name for path in (ROOT / "dflash2_kernels").rglob("*.py")
                  for name in re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", path.read_text())}
    return cuda | triton_jit


def test_every_kernel_of_the_package_has_a_traffic_case():
    """A kernel added without a case here would move bytes nobody counts (issue 33)."""
    text = (ROOT / "benchmarks" / "traffic_cases.py").read_text()
    listed = re.findall(r"kernels=\(([^)]*)\)", text)
    in_cases = {minimum.kernel_name(key) for keys in listed for key in re.findall(r'"([^"]+)"', keys)}
    # Cases that build {kernel key: minimum} first name their keys there.
    in_cases |= {minimum.kernel_name(key)
                 for key in re.findall(r'"(\w+_kernel(?:\[[\w-]+\])?)"(?::|\] =) minimum\.', text)}
    budgeted = {minimum.kernel_name(key) for key in minimum.BUDGETS}
    kernels = _package_kernels()
    assert len(kernels) >= 13, sorted(kernels)  # the scan still finds them
    assert not kernels - in_cases, f"kernels no case in benchmarks/traffic_cases.py runs: {sorted(kernels - in_cases)}"
    assert not kernels - budgeted, f"kernels with no budget in traffic_minimum.py: {sorted(kernels - budgeted)}"


def test_aten_counter_reads_inputs_and_writes_outputs():
    a, b = torch.randn(1000), torch.randn(1000)
    with AtenTraffic() as counter:
        a.view(10, 100)  # a view moves nothing
        total = a + b
        a.add_(b)  # reads a and b, writes a
        total.copy_(b)  # writes total without reading it
        torch.empty(1000)  # an allocation
        torch.mm(a.view(10, 100), b.view(100, 10))
    assert [op.name for op in counter.ops] == ["add", "add_", "copy_", "mm"]
    assert [(op.read_bytes, op.write_bytes) for op in counter.ops[:3]] == [(8000, 4000), (8000, 4000),
                                                                           (4000, 4000)]
    assert counter.ops[3].flops == 2 * 10 * 10 * 100
    assert counter.ops[0].flops == 0
