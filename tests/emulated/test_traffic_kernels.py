"""Global-memory traffic of the CUDA kernels, counted in the SIMT emulator
(csrc/emulation/traffic.h): each kernel of each op held to its minimum and budget
(benchmarks/traffic_minimum.py) at small shapes, the counters checked on a copy whose
every number is known, and planted regressions (a second read, a strided access) that
the checks must catch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import traffic_cases as cases  # noqa: E402
import traffic_minimum as minimum  # noqa: E402
from traffic_counters import AtenTraffic, EmulatorTraffic  # noqa: E402

COPY = 2048  # elements of the probe's copy: 8 blocks of 256 threads, 64 warps


def counted(emulated, call):
    with EmulatorTraffic(emulated) as counter:
        result = call()
    return counter.launches, result


def test_a_coalesced_copy_is_counted_exactly(emulated):
    x = torch.arange(COPY, dtype=torch.float32)
    launches, out = counted(emulated, lambda: emulated.traffic_probe(x, 0))
    assert torch.equal(out, 2 * x)
    (launch,) = launches
    assert launch.name == "traffic_probe_kernel" and launch.programs == COPY // 256
    warps = COPY // 32
    for kind in (launch.loads, launch.stores):
        # One request per warp, 32 lanes x 4 bytes = 4 full sectors, nothing irregular.
        assert (kind.requests, kind.sectors, kind.ideal_sectors, kind.irregular_requests) == (warps, 4 * warps,
                                                                                           4 * warps, 0)
        assert kind.bytes == kind.lane_bytes == 4 * COPY
        assert kind.sectors_per_request == 4.0
    assert (launch.read_unique_bytes, launch.write_unique_bytes) == (4 * COPY, 4 * COPY)
    assert launch.unique_sector_bytes == 8 * COPY
    assert launch.program_unique_bytes_sum == 8 * COPY and launch.program_unique_bytes_max == 8 * 256
    assert minimum.check(launch, 8 * COPY, minimum.budget_for("traffic_probe_kernel")) == []


def test_counting_stops_and_costs_no_records(emulated):
    x = torch.ones(256)
    with EmulatorTraffic(emulated) as counter:
        pass
    emulated.traffic_probe(x, 0)  # not counted
    assert counter.launches == []


@pytest.mark.parametrize("variant, problem", [(1, "requested bytes"), (2, "sectors per request")],
                         ids=["second-read", "strided"])
def test_planted_regressions_break_the_budget(emulated, variant, problem):
    x = torch.arange(COPY, dtype=torch.float32)
    launches, out = counted(emulated, lambda: emulated.traffic_probe(x, variant))
    (launch,) = launches
    # The same bytes once each: only the way they are read differs from variant 0.
    assert (launch.read_unique_bytes, launch.write_unique_bytes) == (4 * COPY, 4 * COPY)
    problems = minimum.check(launch, 8 * COPY, minimum.budget_for("traffic_probe_kernel"))
    assert len(problems) == 1 and problem in problems[0], problems
    if variant == 2:
        # A warp reads one column of a 32 x 8 tile: 32 sectors for 4 sectors' bytes.
        assert launch.loads.sectors_per_request == 32.0 and launch.loads.ideal_sectors_per_request == 4.0


SMALL_VOCAB = 4096
SMALL_CASES = [
    ("selector forward fp32", cases.selector_forward_case(SMALL_VOCAB, torch.float32), 8),
    ("selector forward bf16", cases.selector_forward_case(SMALL_VOCAB, torch.bfloat16), 8),
    ("selector backward fp32", cases.selector_backward_case(SMALL_VOCAB, torch.float32), 8),
    ("candidate_topk bf16", cases.topk_case(3 * SMALL_VOCAB, torch.bfloat16), 1),
    ("candidate_topk fp32", cases.topk_case(3 * SMALL_VOCAB, torch.float32), 1),
    ("walk greedy bf16", cases.walk_case(SMALL_VOCAB, torch.bfloat16, 0.0), 1),
    ("walk sampled fp32", cases.walk_case(SMALL_VOCAB, torch.float32, 1.0), 1),
    ("rejection_sample", cases.rejection_case(3 * SMALL_VOCAB), 1),
]


@pytest.mark.parametrize("make, rows", [c[1:] for c in SMALL_CASES], ids=[c[0] for c in SMALL_CASES])
def test_kernels_within_their_budgets(emulated, make, rows):
    run = make(rows, emulated, "cpu")
    launches, result = counted(emulated, run.ours)
    need = run.minimum(result)
    assert [launch.name for launch in launches] == [minimum.kernel_name(key) for key in run.kernels]
    problems = []
    for launch, key in zip(launches, run.kernels):
        problems += minimum.check(launch, need.kernels[key], minimum.budget_for(key), key)
    assert problems == []


def test_the_bindings_aten_ops_are_counted_around_the_kernels(emulated):
    """The dispatch mode sees the aten ops a CUDA binding runs itself (the selector
    backward's zero-filled dense gradients and its sorts), not only the op."""
    run = cases.selector_backward_case(SMALL_VOCAB, torch.float32)(4, emulated, "cpu")
    with AtenTraffic() as around:
        run.ours()
    names = {op.name for op in around.ops}
    assert "sort" in names and ({"zero_", "zeros", "fill_"} & names), names
    dense = 2 * SMALL_VOCAB * cases.RANK * 4  # dA and dB [V, r] fp32
    assert around.write_bytes >= dense
