"""NeMo's DFlash 2 training step with the fused head under its tensor-parallel layout.

NeMo's TP plans shard the target's lm_head with ``ColwiseParallel(output_layouts=
Shard(-1), use_local_output=False)``: its weight is a DTensor Shard(0) over the
vocabulary, and upstream's step gathers the [B, S, V] logits on every rank with
``full_tensor()``. On 2 gloo ranks, the lm_head sharded that way (an odd vocabulary:
uneven shards), the fused step (``dk.patch(trainer, fused_head=True)``) runs the head
vocab-parallel. The judge: one process's unpatched step (fp32) and its float64 copy, SPEC
section 4 on the loss, every ``DFlash2StepMetrics`` field and every draft gradient, on
every rank; and no collective of the step moves more than the gathered top-k (W x N x
(K + 1)) or the hidden states' gradient (N x H), never N x V.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import dflash2_kernels as dk

from . import upstream_models as um
from .contract import assert_within_contract
from .distributed_support import load_rank_results, requires_gloo, run_ranks, save_rank_result

pytest.importorskip("nemo_automodel.components.speculative.dflash.dflash2_core")

pytestmark = requires_gloo

WORLD = 2
VOCAB = 131  # shards of 66 and 65 rows
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")


def _metrics(out) -> dict[str, torch.Tensor]:
    return {field.name: getattr(out, field.name).detach() for field in dataclasses.fields(out)}


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in trainer.draft_model.named_parameters() if p.requires_grad}


def _record_collectives(sizes: list[int]) -> None:
    """Wrap torch.distributed's collectives so that each call records its tensor's size."""
    import torch.distributed as dist

    def recording(collective):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            sizes.append(max((t.numel() for t in tensors), default=0))
            return collective(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, recording(getattr(dist, name)))


def _tp_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    target = um.qwen3_target(0, vocab=VOCAB, bias=False).requires_grad_(False)
    parallelize_module(target.lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    trainer = um.nemo_trainer(um.nemo_draft(0, vocab=VOCAB), target)
    report = dk.patch(trainer, fused_head=True)
    assert report.fused_head, str(report)
    sizes: list[int] = []
    _record_collectives(sizes)
    batch = um.nemo_batch(0, vocab=VOCAB)
    out = um.nemo_loss(trainer, batch)
    out.loss.backward()
    save_rank_result(out_dir, rank, {"metrics": _metrics(out), "grads": _grads(trainer),
                                     "local_vocab": target.lm_head.weight.to_local().shape[0],
                                     "largest_collective": max(sizes, default=0), "collectives": len(sizes),
                                     "rows": batch.input_ids.shape[0] * trainer.num_anchors * (um.BLOCK - 1),
                                     "top_k": trainer.draft_model.candidate_selector.top_k})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fused_head_tp")
    run_ranks(_tp_worker, out_dir, world=WORLD)
    return load_rank_results(out_dir)


@pytest.fixture(scope="module")
def one_process():
    """(upstream fp32, float64): the unpatched step in this process, the lm_head whole."""
    target = um.qwen3_target(0, vocab=VOCAB, bias=False).requires_grad_(False)
    upstream = um.nemo_trainer(um.nemo_draft(0, vocab=VOCAB), target)
    exact = um.nemo_trainer(copy.deepcopy(upstream.draft_model).double(), copy.deepcopy(target).double())
    results = []
    for trainer, batch in ((upstream, um.nemo_batch(0, vocab=VOCAB)),
                           (exact, um.nemo_batch(0, vocab=VOCAB).to(torch.float64))):
        out = um.nemo_loss(trainer, batch)
        out.loss.backward()
        results.append((_metrics(out), _grads(trainer)))
    return results


def test_the_lm_head_is_vocab_sharded_unevenly(ranks):
    assert [r["local_vocab"] for r in ranks] == [66, 65]


@pytest.mark.parametrize("rank", range(WORLD))
def test_the_fused_tp_step_equals_one_process_within_contract(ranks, one_process, rank):
    (expected, expected_grads), (exact, exact_grads) = one_process
    got = ranks[rank]
    assert got["metrics"]["candidate_recall"] > 0 and got["metrics"]["selector_loss"] > 0
    for name, value in got["metrics"].items():
        if value.is_floating_point():
            assert_within_contract(name, value, expected[name], exact[name])
        else:
            assert torch.equal(value, expected[name]), f"{name}: {value} != {expected[name]}"
    assert got["grads"].keys() == expected_grads.keys()
    for name, grad in got["grads"].items():
        assert grad is not None and grad.abs().max() > 0, f"{name}: no gradient"
        assert_within_contract(name, grad, expected_grads[name], exact_grads[name])


def test_no_collective_moves_rows_by_vocabulary(ranks):
    for got in ranks:
        rows, top_k = got["rows"], got["top_k"]
        assert got["collectives"] > 0, "the fused head ran no collective: it cannot have merged the shards"
        # The largest things sent: the gathered top-k (W x N x (K + 1): the target's argmax
        # rides along) and the backward's all-reduce of dL/dhidden (N x H); N x V never.
        bound = max(WORLD * rows * (top_k + 1), rows * um.HIDDEN)
        assert bound < rows * VOCAB
        assert got["largest_collective"] <= bound, (got["largest_collective"], bound)
