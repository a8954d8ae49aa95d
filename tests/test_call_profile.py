"""The GPU run's measuring code, judged on the CPU: benchmarks/call_profile.py's per-call
attribution of device activities (synthetic profiler events shaped like a CUDA trace: the
flush outside the call, kernels inside it, gaps between them), its kernel groups, a real
CPU profile of one of our ops, common.py's three times per call and the profile records
that --profile writes, and profile_report.py's tables with the whole-call model beside
the measured call."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import call_profile  # noqa: E402
import common  # noqa: E402
import profile_report  # noqa: E402

import dflash2_kernels as dk  # noqa: E402

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


class Span:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


def event(name, start, end, device=CPU, children=(), self_us=0.0, annotation=False):
    return SimpleNamespace(name=name, device_type=device, time_range=Span(start, end), cpu_children=list(children),
                           self_cpu_time_total=self_us, is_user_annotation=annotation)


def cuda_trace():
    """Two calls. Each: a flush kernel before the ranges, then the call (host 0..40 us after
    its start), a Triton kernel of ours, a cuBLAS GEMM after a 10 us gap, an aten cast."""
    events = []
    for t0 in (0.0, 1000.0):
        events.append(event("at::native::vectorized_elementwise_kernel<FillFunctor>", t0, t0 + 50, CUDA))
        events += [event(call_profile.SYNCED_RANGE, t0 + 100, t0 + 400), event(call_profile.CALL_RANGE, t0 + 100, t0 + 140),
                   # the range's device-side twin: an annotation, no work of its own
                   event(call_profile.CALL_RANGE, t0 + 110, t0 + 390, CUDA, annotation=True),
                   event("draft_head_scan_kernel", t0 + 110, t0 + 210, CUDA),
                   event("nvjet_hsh_256x128_2x1_v_bz_coopA_NTN", t0 + 220, t0 + 320, CUDA),
                   event("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>(int, ...)",
                         t0 + 320, t0 + 330, CUDA)]
    return events


def test_device_activities_are_attributed_to_their_call_and_the_idle_time_is_the_gaps():
    profile = call_profile.summarize(cuda_trace(), calls=2, cuda=True)
    assert profile.call_ms == pytest.approx(0.3) and profile.host_ms == pytest.approx(0.04)
    assert profile.device_ms == pytest.approx(0.21)  # the flush and the annotation are not the call's
    assert profile.launches_per_call == 3
    # idle: 10 us from the call's start to the first kernel, 10 us between the two kernels
    assert profile.gpu_idle_ms == pytest.approx(0.02)
    assert profile.groups_ms == pytest.approx({"ours": 0.1, "cublas": 0.1, "aten": 0.01})
    by_name = {k.name: k for k in profile.kernels}
    assert by_name["draft_head_scan_kernel"].launches == 2


def test_a_missing_range_is_an_error_not_a_wrong_profile():
    events = [e for e in cuda_trace() if not (e.name == call_profile.CALL_RANGE and e.device_type == CPU)][1:]
    with pytest.raises(RuntimeError, match="ranges for 2 calls"):
        call_profile.summarize(events, calls=2, cuda=True)


@pytest.mark.parametrize("name, group", [
    ("draft_head_sweep_kernel", "ours"),
    ("grouped_dynamic_conv_bwd_kernel", "ours"),
    ("void (anonymous namespace)::topk_merge_kernel(TopkParams, TopkOutputs)", "ours"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "cublas"),
    ("nvjet_hsh_256x128_2x1_v_bz_coopA_NTN", "cublas"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16>(Params)", "cublas"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)", "aten"),
    ("Memcpy DtoD (Device -> Device)", "aten"),
])
def test_kernel_groups(name, group):
    assert call_profile.kernel_group(name) == group


def test_our_kernel_names_are_read_from_the_sources():
    names = call_profile.our_kernel_names()
    assert {"draft_head_scan_kernel", "draft_head_sparse_add_kernel", "grouped_dynamic_conv_fwd_kernel",
            "topk_merge_kernel", "verify_mass_kernel"} <= names
    assert all(n.endswith("_kernel") for n in names)


def test_a_cpu_profile_of_our_op_names_it_and_its_time():
    x = torch.randn(64, 128)
    delta = torch.randn(64, 2, 8)
    base = torch.randn(2, 128)
    profile = call_profile.profile_calls(lambda: dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16),
                                         torch.device("cpu"), calls=2)
    assert profile.calls == 2 and profile.gpu_idle_ms is None
    assert profile.call_ms >= profile.host_ms > 0
    ours = [k for k in profile.kernels if k.group == "ours"]
    assert ours and all(k.name.startswith("dflash2::") for k in ours) and ours[0].launches == 2
    record = profile.record(top=1)
    assert record["kernels"][0]["device_ms"] == max(k.device_ms for k in profile.kernels)
    assert record["kernels"][-1]["name"] == f"({len(profile.kernels) - 1} more)"


def test_profile_mode_writes_three_times_and_the_profile(tmp_path, monkeypatch):
    out = tmp_path / "profile.jsonl"
    monkeypatch.setattr(common, "PROFILE_OUT", str(out))
    x = torch.randn(32, 64)
    timings = common.time_side_by_side({"ours": lambda: x.sum(), "other": lambda: x.mul(2)}, torch.device("cpu"),
                                       reps=50, budget_s=5)
    rows = [common.Row("unit", "sum 32x64", impl, t, x.numel() * 4, copy_gbps=1.0) for impl, t in timings.items()]
    common.write_records(rows, {"device": "cpu", "date": "d", "commit": "c", "torch": "t"}, str(tmp_path / "b.jsonl"))
    bench = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    profiles = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in profiles] == ["ours", "other"]
    assert all("profile" not in r["timing"] and r["timing"]["host_ms"] is not None for r in bench)
    assert profiles[0]["profile"]["calls"] == 3 and profiles[0]["profile"]["kernels"]
    assert "aten::mul" in {k["name"] for k in profiles[1]["profile"]["kernels"]}


def test_bandwidth_and_floor_ratios_divide_by_the_device_time():
    timing = common.Timing(2.0, 1.5, 2.5, host_ms=1.8, device_ms=0.5, device_method="graph")
    row = common.Row("unit", "case", "ours", timing, bytes=10**9, copy_gbps=4000.0)
    assert row.gbps == pytest.approx(2000.0)
    assert common.Row("unit", "case", "ours", common.Timing(2.0, 1.5, 2.5), 10**9, 4000.0).gbps == pytest.approx(500.0)


def test_the_report_puts_the_model_beside_the_measured_call():
    model = profile_report.read_jsonl(profile_report.MODEL_RECORDS)
    profile = call_profile.summarize(cuda_trace(), calls=2, cuda=True).record()
    env = {"device": "NVIDIA H200", "date": "2026-12-05", "commit": "abc", "torch": "2.11", "triton": "3.6"}
    records = [{**env, "bench": "conv", "case": "fwd+bwd 16384x4096 bf16", "impl": "ours", "call_ms": 0.3,
                "host_ms": 0.04, "device_ms": 0.2, "device_method": "graph", "profile": profile},
               {**env, "bench": "conv", "case": "fwd+bwd 16384x4096 bf16", "impl": "reference", "call_ms": 3.0,
                "host_ms": 0.4, "device_ms": 2.0, "device_method": "graph", "profile": profile}]
    text = profile_report.tables(records, model)
    conv = [m for m in model if m["scenario"] == "conv training"]
    launches = sum(sum(m["launches"].values()) for m in conv)
    ours_line = next(line for line in text.splitlines() if "| ours |" in line)
    assert ours_line.endswith(f"| {launches}, {profile_report.ms(sum(m['h200_device_ms'] for m in conv))} |")
    assert "(graph)" in ours_line and "draft_head_scan_kernel" in ours_line
    assert next(line for line in text.splitlines() if "| reference |" in line).endswith("| — |")
