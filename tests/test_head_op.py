"""The draft head as an op: torch.library.opcheck, torch.compile(fullgraph=True), the tile
budget, the backends, and the errors of bad arguments."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels.head.tiles import TILE_ENV, tile_rows_for

from .contract import assert_same_within_floor
from .head_cases import make_inputs


def _op_args(weight_grad=False, planes=True, labels=True):
    hidden, weight, target, label_ids = make_inputs(11, 37, 8, labels="given" if labels else None)
    hidden.requires_grad_(True)
    weight.requires_grad_(weight_grad)
    return (hidden, weight, target, None, label_ids, 0b11011, 5, 0.9, 3.0, torch.float32, planes, 4)


@pytest.mark.parametrize("weight_grad,planes,labels", [(False, True, True), (True, False, True),
                                                        (False, False, False)])
def test_opcheck_draft_head(weight_grad, planes, labels):
    torch.library.opcheck(torch.ops.dflash2.draft_head.default, _op_args(weight_grad, planes, labels))


def test_opcheck_draft_head_backward():
    args = _op_args()
    hidden, weight, target, _, labels, mask, top_k, scale, cap, dtype, planes, tile = args
    out = [o.detach() for o in torch.ops.dflash2.draft_head(*args)]
    losses, ids, label_ids, topk_z, label_z, hidden_grads, row_stats = (out[0], out[1], out[3], out[11], out[12],
                                                                        out[13], out[14])
    grads = (torch.randn_like(losses), torch.randn(11, top_k), torch.randn(11))
    for need_weight in (False, True):
        torch.library.opcheck(torch.ops.dflash2.draft_head_backward.default,
                              (*grads, hidden.detach(), weight, target, None, labels, ids, topk_z, label_ids, label_z,
                               hidden_grads, row_stats, mask, top_k, scale, cap, dtype, True, need_weight, tile))


@pytest.mark.compiles
@pytest.mark.parametrize("weight_grad", [False, True])
def test_compiled_draft_head_matches_eager(weight_grad):
    hidden, weight, target, labels = make_inputs(13, 61, 8)
    weight.requires_grad_(weight_grad)

    def step(hidden, weight):
        out = dk.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=("kl_div", "tv", "ce"),
                            top_k=6, softcap=4.0)
        total = out.losses["kl_div"].sum() + 0.5 * out.losses["tv"].sum() + out.losses["ce"].mean()
        return total + out.topk_logits.float().square().sum() + out.label_logit.sum(), out.topk_ids

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [hidden.clone().requires_grad_(True)] + ([weight] if weight_grad else [])
    eager_total, eager_ids = step(leaves[0], weight)
    eager_grads = torch.autograd.grad(eager_total, leaves)
    leaves2 = [hidden.clone().requires_grad_(True)] + ([weight] if weight_grad else [])
    total, ids = compiled(leaves2[0], weight)
    grads = torch.autograd.grad(total, leaves2)
    # The same op on the same values, but the GEMMs run on other buffers: a BLAS without
    # conditional reproducibility (MKL's AVX-512 kernels) may round them differently.
    assert torch.equal(ids, eager_ids)
    assert_same_within_floor("total", total, eager_total)
    for name, got, want in zip(("grad hidden", "grad weight"), grads, eager_grads):
        assert_same_within_floor(name, got, want)


def test_tile_budget_sets_the_chunk_not_the_result(monkeypatch):
    """Chunks of 1, a few and all rows: the same top-k and, up to the host BLAS rounding
    GEMMs of other row counts (or other buffers) differently, the same losses and gradients."""
    hidden, weight, target, labels = make_inputs(50, 300, 8)
    assert tile_rows_for(300, 2, True, True, torch.float32, tile_mb=300 * 4 * 4 * 10 / 2**20) == 10
    assert tile_rows_for(300, 2, True, True, torch.float32, tile_mb=1e-9) == 1
    results = []
    for budget in ("0.001", "0.05", "64"):
        monkeypatch.setenv(TILE_ENV, budget)
        out = dk.draft_head(hidden.requires_grad_(True), weight, target_hidden=target, labels=labels,
                            losses=("kl_div", "ce"), top_k=4)
        (grad,) = torch.autograd.grad(out.losses["kl_div"].sum() + out.losses["ce"].sum(), hidden)
        results.append((out.losses["kl_div"], out.topk_ids, grad))
    for losses, ids, grad in results[1:]:
        assert torch.equal(ids, results[0][1])
        assert_same_within_floor("kl_div", losses, results[0][0])
        assert_same_within_floor("grad hidden", grad, results[0][2])
    monkeypatch.setenv(TILE_ENV, "lots")
    with pytest.raises(ValueError, match=TILE_ENV):
        dk.draft_head(hidden, weight, target_hidden=target)


def test_reference_backend_runs_the_dense_reference(monkeypatch):
    hidden, weight, target, labels = make_inputs(7, 40, 8)
    monkeypatch.setenv("DFLASH2_BACKEND", "reference")
    out = dk.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=("tv", "ce"), top_k=3)
    ref = reference.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=("tv", "ce"), top_k=3)
    for name in ("tv", "ce"):  # the same code on other buffers: up to the host BLAS's rounding
        assert_same_within_floor(name, out.losses[name], ref.losses[name])
    assert torch.equal(out.topk_ids, ref.topk_ids)


def test_serving_form_has_no_target_fields():
    hidden, weight, _, _ = make_inputs(5, 30, 8, target=False, labels=None)
    out = dk.draft_head(hidden, weight, losses=(), top_k=4)
    assert out.losses == {} and out.topk_ids.shape == (5, 4)
    assert out.target_lse is None and out.overlap is None and out.label_ids is None and out.label_in_topk is None


def _bad(**change):
    hidden, weight, target, labels = make_inputs(4, 20, 8)
    kwargs = dict(target_hidden=target, labels=labels, losses=("kl_div",), top_k=3)
    kwargs.update(change)
    return hidden, weight, kwargs


BAD = [
    ("unknown loss", dict(losses=("kl",)), ValueError, "losses"),
    ("loss twice", dict(losses=("tv", "tv")), ValueError, "twice"),
    ("losses as a string", dict(losses="kl_div"), TypeError, "losses"),
    ("soft loss without target", dict(target_hidden=None, labels=None), ValueError, "target_hidden"),
    ("ce with neither", dict(target_hidden=None, labels=None, losses=("ce",)), ValueError, "labels"),
    ("top_k above V", dict(top_k=21), ValueError, "top_k"),
    ("top_k negative", dict(top_k=-1), ValueError, "top_k"),
    ("top_k bool", dict(top_k=True), ValueError, "top_k"),
    ("label out of range", dict(labels=torch.tensor([0, 1, 20, 3])), IndexError, "labels"),
    ("label negative", dict(labels=torch.tensor([0, -1, 2, 3])), IndexError, "labels"),
    ("labels int32", dict(labels=torch.zeros(4, dtype=torch.int32)), TypeError, "labels"),
    ("labels shape", dict(labels=torch.zeros(5, dtype=torch.long)), ValueError, "labels"),
    ("target shape", dict(target_hidden=torch.zeros(4, 9)), ValueError, "target_hidden"),
    ("target_weight shape", dict(target_weight=torch.zeros(20, 9)), ValueError, "target_weight"),
    ("softcap zero", dict(softcap=0.0), ValueError, "softcap"),
    ("softcap negative", dict(softcap=-1.0), ValueError, "softcap"),
    ("logit_scale zero", dict(logit_scale=0.0), ValueError, "logit_scale"),
    ("logit_scale nan", dict(logit_scale=float("nan")), ValueError, "logit_scale"),
    ("logits_dtype int", dict(logits_dtype=torch.int32), TypeError, "logits_dtype"),
    ("tile_mb zero", dict(tile_mb=0), ValueError, "tile_mb"),
    ("target requires grad", dict(target_hidden=torch.zeros(4, 8, requires_grad=True)), ValueError,
     "target_hidden"),
]


@pytest.mark.parametrize("change,error,words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_arguments_are_named(change, error, words):
    hidden, weight, kwargs = _bad(**change)
    with pytest.raises(error, match=words):
        dk.draft_head(hidden, weight, **kwargs)


def test_bad_tensors_are_named():
    hidden, weight, target, labels = make_inputs(4, 20, 8)
    with pytest.raises(ValueError, match="hidden's last dim"):
        dk.draft_head(hidden[:, :5], weight, target_hidden=target)
    with pytest.raises(TypeError, match="hidden"):
        dk.draft_head(hidden.long(), weight, target_hidden=target)
    with pytest.raises(ValueError, match="weight"):
        dk.draft_head(hidden, weight[None], target_hidden=target)
    with pytest.raises(ValueError, match="one device"):
        dk.draft_head(hidden, weight.to("meta"), target_hidden=target)


def test_raw_ops_check_before_touching_memory():
    s, t = torch.randn(3, 10), torch.randn(3, 10)
    with pytest.raises(IndexError, match="labels"):
        torch.ops.dflash2.draft_head_rows_cpu(s, t, torch.tensor([0, 10, 1]), 0b10000, 2, 1.0, 0.0, torch.float32,
                                              None)
    with pytest.raises(ValueError, match="loss_grads"):
        torch.ops.dflash2.draft_head_rows_cpu(s, t, None, 0b1, 2, 1.0, 0.0, torch.float32, torch.empty(1, 3, 9))
    with pytest.raises(ValueError, match="target_logits"):
        torch.ops.dflash2.draft_head_rows_cpu(s, None, None, 0b1, 2, 1.0, 0.0, torch.float32, None)
    with pytest.raises(ValueError, match="grad_losses"):
        torch.ops.dflash2.draft_head_rows_backward_cpu(s, t, None, 0b1, 1.0, 0.0, torch.float32, torch.empty(2, 3))
    with pytest.raises(ValueError, match="tile_rows"):
        hidden, weight, target, labels = make_inputs(4, 20, 8)
        torch.ops.dflash2.draft_head(hidden, weight, target, None, labels, 1, 2, 1.0, 0.0, torch.float32, False, 0)


def test_head_modules_import_no_circle():
    """No module of dflash2_kernels/head imports one that imports it back (lazy imports inside
    functions included): each owns what it shares."""
    import ast
    from pathlib import Path

    folder = Path(dk.__file__).parent / "head"
    modules = {path.stem: path for path in folder.glob("*.py")}
    imports = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        imports[name] = found & set(modules)

    def reachable(start):
        seen, stack = set(), [start]
        while stack:
            for other in imports[stack.pop()] - seen:
                seen.add(other)
                stack.append(other)
        return seen

    assert [name for name in modules if name in reachable(name)] == []
