"""The whole-call GPU model (benchmarks/fake_cuda.py, benchmarks/whole_call.py): the
counter on code whose every count is known (aten launches, host syncs, GEMM FLOPs and
bytes, Triton launches stopped and recorded, C++ ops recorded as their CUDA kernels,
the plane split, peak bytes), the Python backward against torch's engine on real
tensors, and the conv's and selector's calls held to their launch and sync budgets.
The draft head's budgets: tests/test_head_whole_call.py (whole_call.HEAD_SCENARIOS)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytest.importorskip("triton")  # every Triton launch goes through conv.launch.KernelLaunch

import fake_autograd  # noqa: E402
import whole_call  # noqa: E402
from fake_cuda import CallCounter, FakeCuda  # noqa: E402

from dflash2_kernels._extension import EXTENSION_LOADED  # noqa: E402
from dflash2_kernels.conv.launch import KernelLaunch  # noqa: E402

needs_extension = pytest.mark.skipif(not EXTENSION_LOADED, reason="the C++ ops are not built")


def test_three_aten_ops_and_one_item_are_three_launches_and_one_sync():
    with FakeCuda():
        x = torch.empty(1024, device="cuda")
        with CallCounter() as count:
            y = (x + 1) * 2
            assert y.sum().item() == 0  # a fake tensor holds no value: the counter answers 0
    assert count.by_kind() == {"triton": 0, "cuda": 0, "aten": 3}
    assert [launch.name for launch in count.launches] == ["add", "mul", "sum"]
    assert [sync.what for sync in count.syncs] == ["item"]
    assert count.syncs[0].after == 3
    assert "test_whole_call.py" in count.syncs[0].site


def test_bool_int_and_host_copies_are_syncs_views_and_allocations_are_not_launches():
    with FakeCuda():
        x = torch.empty(64, 8, device="cuda")
        with CallCounter() as count:
            x.view(8, 64).t()[0]  # views: nothing launched
            torch.empty(16, device="cuda")  # an allocation: nothing launched
            assert not bool((x > 0).any())
            assert int(x[0, 0]) == 0
            x.cpu()
            torch.ones(3).to("cuda")
    assert [launch.name for launch in count.launches] == ["gt", "any", "_to_copy", "_to_copy"]
    assert [sync.what for sync in count.syncs] == ["item", "item", "_to_copy between cpu and cuda",
                                                   "_to_copy between cpu and cuda"]
    assert count.cpu_ops == 1  # torch.ones on the CPU


def test_data_dependent_ops_sync_and_answer_their_largest_output():
    with FakeCuda():
        x = torch.empty(5, 7, device="cuda")
        with CallCounter() as count:
            picked = x[x > 0]
            where = torch.nonzero(x)
    assert picked.shape == (35,) and where.shape == (35, 2)
    assert count.data_dependent == ["index", "nonzero"]
    assert len(count.syncs) == 2


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_an_mm_counts_2mnk_flops_and_its_operands_and_output_bytes(out_dtype):
    m, k, n = 96, 160, 224
    with FakeCuda():
        a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
        with CallCounter() as count:
            out = torch.mm(a, b) if out_dtype is None else torch.mm(a, b, out_dtype=out_dtype)
    (launch,) = count.launches
    assert launch.flops == count.gemm_flops == 2 * m * n * k
    assert launch.read_bytes == (m * k + k * n) * 2
    assert launch.write_bytes == m * n * out.element_size()
    assert launch.dtype == torch.bfloat16  # the tensor cores' rate is the operands'


def test_batched_and_accumulating_products_count_every_flop():
    with FakeCuda():
        bias = torch.empty(6, 5, device="cuda")
        a, b = torch.empty(4, 6, 3, device="cuda"), torch.empty(4, 3, 5, device="cuda")
        acc = torch.empty(6, 5, device="cuda")
        with CallCounter() as count:
            torch.bmm(a, b)
            torch.baddbmm(torch.empty(4, 6, 5, device="cuda"), a, b)
            torch.addbmm(bias, a, b)
            torch.addmm(bias, a[0], b[0], out_dtype=torch.float32, out=acc)
    flops = [launch.flops for launch in count.launches]
    assert flops == [2 * 4 * 6 * 5 * 3] * 3 + [2 * 6 * 5 * 3]


class _ExplodingKernel:
    """A kernel that fails if anything launches it."""

    __name__ = "exploding_kernel"

    def __getitem__(self, grid):
        raise AssertionError("the counter ran a Triton launch")


def test_a_triton_launch_is_recorded_not_run():
    with FakeCuda():
        x = torch.empty(256, 128, device="cuda", dtype=torch.float16)
        out = torch.empty(256, 128, device="cuda")
        launch = KernelLaunch(_ExplodingKernel(), 12, dict(x_ptr=x, out_ptr=out, n=256), dict(BLOCK=64), 4)
        with CallCounter() as count:
            launch.run(x)
    (recorded,) = count.launches
    assert (recorded.kind, recorded.name, recorded.detail["programs"]) == ("triton", "exploding_kernel", 12)
    assert recorded.detail["constexprs"] == {"BLOCK": "64"} and recorded.detail["num_warps"] == 4
    # No model of this kernel: every tensor argument read once, and marked so.
    assert not recorded.modelled and count.unmodelled == ["exploding_kernel"]
    assert (recorded.read_bytes, recorded.write_bytes) == (256 * 128 * 2 + 256 * 128 * 4, 0)


def test_the_conv_kernel_moves_its_minimum_times_its_budget():
    import traffic_minimum
    from dflash2_kernels.conv.launch import plan_conv_forward

    rows, hidden, taps, groups = 64, 256, 2, 16
    with FakeCuda():
        x = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
        delta = torch.empty(rows, 2, taps, groups, device="cuda", dtype=torch.bfloat16)[:, 0]
        base = torch.empty(taps, hidden, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
        with CallCounter() as count:
            plan_conv_forward(x, delta, base, out, 8).run(x)
    (launch,) = count.launches
    reads = 2 * rows * hidden + (rows + rows * 7 // 8) * groups * 2 + taps * hidden * 2  # x, used delta, base
    budget = traffic_minimum.BUDGETS["grouped_dynamic_conv_fwd_kernel"].unique
    assert launch.write_bytes == rows * hidden * 2
    assert launch.read_bytes == round(reads * budget)


@needs_extension
def test_a_cpp_cuda_op_is_recorded_as_the_kernels_its_binding_launches():
    with FakeCuda():
        logits = torch.empty(32, 50_000, device="cuda", dtype=torch.bfloat16)
        with CallCounter() as count:
            values, ids = torch.ops.dflash2.candidate_topk(logits, 8)
    assert values.shape == ids.shape == (32, 8) and ids.dtype == torch.long
    assert [(launch.kind, launch.name) for launch in count.launches] == [
        ("cuda", "topk_partial_kernel"), ("cuda", "topk_merge_kernel")]
    assert {launch.inside for launch in count.launches} == {"dflash2::candidate_topk"}
    assert count.launches[0].read_bytes >= logits.numel() * 2  # reads the logits once at least


@needs_extension
def test_the_selector_backward_binding_counts_its_fills_and_sorts():
    rows, vocab, rank, top_k = 64, 1000, 32, 4
    with FakeCuda():
        grad = torch.empty(rows, top_k, device="cuda")
        projected = torch.empty(rows, rank, device="cuda")
        codebook = torch.empty(vocab, rank, device="cuda")
        pred = torch.empty(rows, device="cuda", dtype=torch.long)
        cand = torch.empty(rows, top_k, device="cuda", dtype=torch.long)
        with CallCounter() as count:
            torch.ops.dflash2.selector_scores_backward(grad, projected, codebook, codebook, pred, cand, False, vocab,
                                                        torch.float32)
    assert [launch.name for launch in count.launches] == [
        "zeros", "zeros", "zeros", "sort", "sort", "selector_backward_rows_kernel", "selector_segment_chunks_kernel",
        "selector_segment_carry_kernel", "selector_segment_chunks_kernel", "selector_segment_carry_kernel"]
    assert count.launches[0].write_bytes == rows * vocab * 4  # dU [N, V] zero-filled


def test_a_plane_predicate_splits_the_bytes_of_aten_ops():
    vocab = 1000
    with FakeCuda():
        plane = torch.empty(8, vocab, device="cuda")
        small = torch.empty(8, 4, device="cuda")
        weight = torch.empty(vocab, 16, device="cuda")
        rows = torch.empty(8, 16, device="cuda")
        with CallCounter(plane=lambda t: t.dim() == 2 and t.shape[-1] == vocab) as count:
            plane.exp()  # a plane op: 32,000 bytes read and written
            small * 2
            rows @ weight.t()  # writes a plane, but a GEMM: not in the split
    assert count.plane_ops == ["exp"]
    assert count.plane_bytes == 2 * 8 * vocab * 4
    assert [launch.plane for launch in count.launches] == [True, False, True]


def test_peak_bytes_count_live_allocations_made_inside_only():
    mib = 2**20
    with FakeCuda():
        before = torch.empty(mib, device="cuda", dtype=torch.uint8)  # not counted: existed before
        with CallCounter() as count:
            a = torch.empty(4 * mib, device="cuda", dtype=torch.uint8)
            b = torch.empty(8 * mib, device="cuda", dtype=torch.uint8)
            view = a[: mib]
            del a  # its storage lives on through the view
            c = torch.empty(2 * mib, device="cuda", dtype=torch.uint8)  # 14 MiB live
            del view, b
            d = before + 1  # 1 MiB
        del c, d
    assert count.peak_bytes == 14 * mib


def _graph(x, w):
    """A graph with every case the engine handles: two paths into x (summed), a broadcast
    (summed to size), a cast, a custom Function with a non-differentiable output and an
    output nobody differentiates (materialised zeros)."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ids = x.argmax(-1)
            ctx.mark_non_differentiable(ids)
            return 2 * x, ids, x.exp()

        @staticmethod
        def backward(ctx, grad, grad_ids, grad_exp):
            return 2 * grad + grad_exp

    doubled, _, _ = Twice.apply(x)
    return (doubled * w).float().sum() + x.sum(0).pow(2).sum()


def test_the_python_backward_matches_torchs_engine_on_real_tensors():
    torch.manual_seed(0)
    x0, w0 = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    grads = []
    for backward in (torch.autograd.backward, fake_autograd.backward):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        backward(_graph(x, w))
        backward(_graph(x, w))  # the second accumulates into .grad
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


# --- the calls held to their budgets -------------------------------------------------------------


def test_conv_training_call_launches_and_syncs():
    counted = whole_call.count_scenario("conv training")
    # speculators' fp32 base with bf16 activations: the kernels round the base as they load
    # it; the backward's second launch sums the dbase partials into base's dtype.
    assert counted.forward.by_kind() == {"triton": 1, "cuda": 0, "aten": 0}
    assert counted.backward.by_kind() == {"triton": 2, "cuda": 0, "aten": 0}
    assert not counted.forward.syncs and not counted.backward.syncs
    assert counted.forward.unmodelled == counted.backward.unmodelled == []


def test_conv_serving_call_launches_and_syncs():
    counted = whole_call.count_scenario("conv serving")
    assert counted.forward.by_kind() == {"triton": 1, "cuda": 0, "aten": 0} and not counted.forward.syncs
    assert counted.backward is None


@needs_extension
@pytest.mark.parametrize("name", ["selector score_candidates", "selector pair_scores"])
def test_selector_call_launches_and_syncs(name):
    counted = whole_call.count_scenario(name)
    # As found: forward = the projection P = W h (cuBLAS) + ours; backward = dU (a copy of dS,
    # or [N, V] zeros for full-vocabulary logits), dA and dB zero-filled, two id sorts, our
    # five kernels, and the projection's two products.
    assert counted.forward.by_kind() == {"triton": 0, "cuda": 1, "aten": 1}
    assert counted.backward.by_kind()["cuda"] == 5 and len(counted.backward.launches) <= 12
    assert not counted.forward.syncs and not counted.backward.syncs
    assert counted.forward.gemm_flops == 2 * whole_call.ROWS * whole_call.HIDDEN * whole_call.RANK


def test_the_dense_head_counts_its_logits_gemms_and_planes():
    counted = whole_call.count_scenario("dense ce")
    logits = 2 * whole_call.ROWS * whole_call.VOCAB * whole_call.HIDDEN
    assert counted.forward.gemm_flops == logits and counted.backward.gemm_flops == logits  # W frozen: dh only
    assert counted.forward.peak_bytes >= whole_call.ROWS * whole_call.VOCAB * 2  # the [N, V] bf16 logits
    assert counted.forward.plane_bytes > 0


def test_every_scenario_is_named_and_the_head_ones_are_listed_for_their_tests():
    assert set(whole_call.HEAD_SCENARIOS) <= set(whole_call.SCENARIOS)
    assert {"head ce", "head kl_div", "head kl_div+tv", "head ce, trainable lm_head", "head serving",
            "head ce, N 16384", "head kl_div, N 16384"} == set(whole_call.HEAD_SCENARIOS)
    for name in whole_call.HEAD_SCENARIOS:
        assert whole_call.SCENARIOS[whole_call.SCENARIOS[name].dense].op == "dense head"


def test_records_are_json_and_the_doc_table_is_replaced_in_place(tmp_path):
    scenario = whole_call.SCENARIOS["conv training"]
    rows = whole_call.records(scenario, whole_call.count_scenario(scenario.name), {"commit": "test"})
    assert [r["direction"] for r in rows] == ["forward", "backward"]
    json.dumps(rows)
    doc = tmp_path / "doc.md"
    doc.write_text(f"# t\n\n{whole_call.DOC_MARKER}\n| old |\n|---|\n| row |\n{whole_call.DOC_END}\n\nafter\n")
    whole_call.write_doc(doc, whole_call.markdown(rows))
    whole_call.write_doc(doc, whole_call.markdown(rows))
    text = doc.read_text()
    assert "| old |" not in text and "| conv training | 1/0/0 · 2/0/0 |" in text and "commit `test`" in text
    assert text.count("| conv training |") == 1 and text.endswith(f"\n{whole_call.DOC_END}\n\nafter\n")
