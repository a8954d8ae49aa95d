"""dk.draft_head against the float64 evaluation of SPEC section 7's dense formulas, with
SPEC section 4's bar (the dense reference run in the input dtype sets it), on the CPU
kernels (csrc/head_cpu.cpp) and the chunked custom ops around them."""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from .contract import assert_within_contract, contract_floor
from .head_cases import exact, make_inputs, nan_and_inf_inputs, objective, upstream_weights

ALL = ("kl_div", "rkl", "jsd", "tv", "ce")
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

# rows, vocab, width, hidden dtype, weight dtype, losses, top_k, logit_scale, softcap, labels, tile_mb.
# The CPU kernel walks a row in lanes of 8 floats (4 doubles): vocabularies 1, 7, 8, 9 and
# 1000 cross that edge; tile_mb 0.02 makes chunks of a few rows, so rows cross chunk edges.
CASES = [
    (1, 1, 8, F32, F32, ("kl_div",), 1, 1.0, None, "given", None),
    (5, 7, 8, F32, F32, ALL, 0, 1.0, None, "given", None),
    (9, 8, 16, F32, F32, ("tv",), 8, 1.0, None, "none", None),
    (13, 9, 16, F64, F64, ALL, 9, 1.0, None, "given", 0.001),
    (33, 1000, 24, F32, F32, ("kl_div", "tv"), 16, 1.0, None, "given", 0.02),
    (33, 1000, 24, F32, F32, ALL, 16, 0.8, 3.0, "given", 0.02),
    (21, 515, 32, F64, F64, ALL, 5, -1.3, 2.0, "given", 0.01),
    (24, 777, 32, BF16, BF16, ("kl_div", "tv"), 16, 1.0, None, "given", 0.02),
    (24, 777, 32, F16, F16, ("jsd", "ce"), 16, 1.0, 4.0, "given", 0.02),
    (24, 777, 32, F32, BF16, ("kl_div", "rkl"), 16, 1.0, None, "given", 0.02),
    (40, 300, 16, F32, F32, ("ce",), 4, 1.0, None, "given-no-target", 0.01),
    (17, 300, 16, F32, F32, (), 4, 1.0, None, "none-no-target", None),
]


def _case_id(case):
    rows, vocab, width, hd, wd, losses, k, scale, cap, labels, tile = case
    names = str(hd).removeprefix("torch.") + ("" if wd == hd else "/" + str(wd).removeprefix("torch."))
    return f"{rows}x{vocab}x{width}-{names}-{'+'.join(losses) or 'serving'}-k{k}-s{scale}-c{cap}-{labels}"


def _run(case, *, weight_grad=False, lead=None, strided=False, device="cpu"):
    """(hidden, weight, kwargs, ours, ref, ours' gradients or None): ours on ``device`` (its
    results brought back to the CPU, with their gradients taken there), the rest on the CPU."""
    rows, vocab, width, hidden_dtype, weight_dtype, losses, top_k, scale, cap, labels, tile = case
    has_target = not labels.endswith("no-target")
    hidden, weight, target_hidden, label_ids = make_inputs(
        rows, vocab, width, hidden_dtype=hidden_dtype, weight_dtype=weight_dtype, target=has_target,
        labels="given" if labels.startswith("given") else None, lead=lead)
    if strided:  # every other column of a wider tensor
        wide = torch.zeros(*hidden.shape[:-1], 2 * width, dtype=hidden.dtype)
        wide[..., ::2] = hidden
        hidden = wide[..., ::2]
    hidden.requires_grad_(True)
    weight.requires_grad_(weight_grad)
    kwargs = dict(target_hidden=target_hidden, labels=label_ids, losses=losses, top_k=top_k, logit_scale=scale,
                  softcap=cap)
    ref = reference.draft_head(hidden, weight, **kwargs)
    if device == "cpu":
        return hidden, weight, kwargs, dk.draft_head(hidden, weight, tile_mb=tile, **kwargs), ref, None
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    leaves = [hidden.detach().to(device).requires_grad_(True)]
    leaves += [weight.detach().to(device).requires_grad_(True)] if weight_grad else []
    ours = dk.draft_head(leaves[0], leaves[-1] if weight_grad else weight.to(device), tile_mb=tile, **moved)
    weights = [w.to(device) if isinstance(w, torch.Tensor) else {k: v.to(device) for k, v in w.items()}
               for w in upstream_weights(ours, case[6])]
    grads = torch.autograd.grad(objective(ours.losses, ours.topk_logits, ours.label_logit, weights), leaves)
    on_cpu = ours._replace(**{f: (None if v is None else {k: x.detach().cpu() for k, x in v.items()}
                                  if isinstance(v, dict) else v.detach().cpu()) for f, v in ours._asdict().items()})
    return hidden, weight, kwargs, on_cpu, ref, [g.cpu() for g in grads]


def _check_case(case, hidden, weight, kwargs, ours, ref, ours_grads=None):
    rows, vocab, width, hidden_dtype, weight_dtype, losses, top_k, scale, cap, labels, tile = case
    logits_dtype = hidden.dtype
    truth = exact(hidden, weight, kwargs["target_hidden"], kwargs["labels"], losses, scale, cap)
    for name in losses:
        assert_within_contract(f"loss {name}", ours.losses[name].reshape(-1), ref.losses[name].reshape(-1),
                               truth["losses"][name])
    z64, t64 = truth["z"].detach(), truth["t"]
    assert_within_contract("draft_lse", ours.draft_lse.reshape(-1), ref.draft_lse.reshape(-1),
                           torch.logsumexp(z64, -1))
    count = ours.draft_lse.numel()
    ids = ours.topk_ids.reshape(count, top_k)
    # The top-k: the float64 logits at our ids must be a top-k of the float64 logits, to
    # within SPEC section 4's bar on the logits (the input dtype's reference sets it).
    z_ref = reference.draft_head_logits(hidden.detach(), weight.detach(), scale, cap).reshape(-1, vocab)
    tolerance = 2 * (z_ref.double() - z64).abs().max().item() + contract_floor(logits_dtype, z64.abs().max().item())
    _assert_a_top_k(ids, z64.to(logits_dtype).double(), tolerance)
    assert_within_contract("topk_logits", ours.topk_logits.reshape(count, top_k), z_ref.to(logits_dtype).gather(-1, ids),
                           z64.gather(-1, ids))
    assert ours.topk_logits.dtype == logits_dtype
    if t64 is not None:
        assert_within_contract("target_lse", ours.target_lse.reshape(-1), ref.target_lse.reshape(-1),
                               torch.logsumexp(t64, -1))
        overlap = torch.minimum(torch.softmax(t64, -1), torch.softmax(z64, -1)).sum(-1)
        assert_within_contract("overlap", ours.overlap.reshape(-1), ref.overlap.reshape(-1), overlap)
        t_ref = reference.draft_head_logits(kwargs["target_hidden"], weight.detach(), scale, cap).reshape(-1, vocab)
        assert_within_contract("target_logits_at_topk", ours.target_logits_at_topk.reshape(count, top_k),
                               t_ref.float().gather(-1, ids), t64.gather(-1, ids))
    if ours.label_ids is not None:
        label = ours.label_ids.reshape(-1)
        if kwargs["labels"] is not None:
            assert torch.equal(label, kwargs["labels"].reshape(-1))
        safe = torch.where(label == reference.IGNORE_INDEX, 0, label)
        assert_within_contract("label_logit", ours.label_logit.reshape(-1),
                               z_ref.to(logits_dtype).gather(-1, safe[:, None]).squeeze(-1),
                               z64.gather(-1, safe[:, None]).squeeze(-1))
        in_topk = ((ids == safe[:, None]).any(-1) & (label != reference.IGNORE_INDEX))
        assert torch.equal(ours.label_in_topk.reshape(-1), in_topk)
    # Gradients of one objective over every differentiable output, at our ids.
    weights = upstream_weights(ours, top_k)
    leaves = [hidden] + ([weight] if weight.requires_grad else [])
    grads = ours_grads or torch.autograd.grad(objective(ours.losses, ours.topk_logits, ours.label_logit, weights),
                                              leaves)
    ref_label = None
    if ours.label_ids is not None:
        ref_label = z_ref.to(logits_dtype).gather(-1, safe[:, None])
    with torch.enable_grad():
        z_ref_g = reference.draft_head_logits(hidden, weight, scale, cap).reshape(-1, vocab).to(logits_dtype)
    ref_obj = objective(ref.losses, z_ref_g.gather(-1, ids),
                        None if ref_label is None else z_ref_g.gather(-1, safe[:, None]), weights)
    ref_grads = torch.autograd.grad(ref_obj, leaves)
    truth_leaves = [truth["hidden"]] + ([truth["weight"]] if weight.requires_grad else [])
    exact_obj = objective(truth["losses"], truth["z"].gather(-1, ids),
                          None if ref_label is None else truth["z"].gather(-1, safe[:, None]), weights)
    exact_grads = torch.autograd.grad(exact_obj, truth_leaves)
    for name, got, want, true in zip(("grad hidden", "grad weight"), grads, ref_grads, exact_grads):
        assert got.dtype == want.dtype
        assert_within_contract(name, got, want, true)


def _assert_a_top_k(ids, rounded, tolerance):
    """ids [N, K] are distinct per row and pick values within tolerance of the K largest of rounded [N, V]."""
    if ids.shape[-1] == 0:
        return
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an id repeats within a row"
    best = rounded.sort(-1, descending=True).values[:, : ids.shape[-1]]
    picked = rounded.gather(-1, ids).sort(-1, descending=True).values
    assert (picked - best).abs().max().item() <= tolerance


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_draft_head_matches_float64(case, poison_empty):
    hidden, weight, kwargs, ours, ref, _ = _run(case)
    _check_case(case, hidden, weight, kwargs, ours, ref)


@pytest.mark.parametrize("case", [CASES[4], CASES[6], CASES[9], CASES[10]], ids=_case_id)
def test_draft_head_weight_grad(case, poison_empty):
    """weight requiring grad: dW accumulated over row chunks in float32, dh by recompute."""
    hidden, weight, kwargs, ours, ref, _ = _run(case, weight_grad=True)
    _check_case(case, hidden, weight, kwargs, ours, ref)


def test_draft_head_leading_dims_and_strides():
    case = CASES[5]
    hidden, weight, kwargs, ours, ref, _ = _run(case, lead=(3, 11), strided=True)
    assert ours.topk_ids.shape == (3, 11, case[6]) and ours.losses["kl_div"].shape == (3, 11)
    _check_case(case, hidden, weight, kwargs, ours, ref)


def test_draft_head_empty_rows():
    hidden, weight, target, labels = make_inputs(1, 50, 8, lead=(0, 3))
    out = dk.draft_head(hidden.requires_grad_(), weight, target_hidden=target, labels=labels,
                        losses=("kl_div", "ce"), top_k=4)
    assert out.topk_ids.shape == (0, 3, 4) and out.losses["ce"].shape == (0, 3)
    (grad,) = torch.autograd.grad(out.losses["kl_div"].sum() + out.topk_logits.sum(), hidden)
    assert grad.shape == hidden.shape


def test_draft_head_ties_take_the_lower_id():
    """Duplicated W rows give equal logits: the lower id ranks first, the k-th place included.
    Inputs are small dyadic numbers, so every logit is exact in float32 whatever order a
    BLAS sums in (an edge tile's kernel may sum a duplicated row in another order)."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randint(-4, 5, (6, 8), generator=gen).float() / 4
    weight = torch.randint(-8, 9, (40, 8), generator=gen).float() / 16
    target = torch.randint(-4, 5, (6, 8), generator=gen).float() / 4
    weight[[3, 17, 30]] = weight[9].clone()
    weight[[5, 6]] = weight[31].clone()
    for dtype in (F32, BF16):
        out = dk.draft_head(hidden, weight, target_hidden=target, top_k=12, logits_dtype=dtype)
        rounded = reference.draft_head_logits(hidden.double(), weight.double()).to(dtype)
        order = torch.sort(rounded, dim=-1, descending=True, stable=True).indices[:, :12]
        # Exact logits (multiples of 1/64 below 8): bf16 rounds ours and float64's alike.
        assert torch.equal(out.topk_ids, order)
        assert torch.equal(out.draft_argmax, order[:, 0])


def test_draft_head_nan_and_inf_rows():
    hidden, weight, target, labels = nan_and_inf_inputs()
    kwargs = dict(target_hidden=target, labels=labels, losses=ALL, top_k=4)
    ours = dk.draft_head(hidden, weight, **kwargs)
    ref = reference.draft_head(hidden, weight, **kwargs)
    exact = reference.draft_head(hidden.double(), weight.double(), **{**kwargs, "target_hidden": target.double()})
    for name in ALL:
        got, want, true = ours.losses[name], ref.losses[name], exact.losses[name]
        finite = torch.isfinite(true)
        special, wanted = got.double()[~finite], true[~finite]
        assert ((special == wanted) | (special.isnan() & wanted.isnan())).all(), (name, special, wanted)
        assert_within_contract(name, got[finite], want[finite], true[finite])
    assert torch.isnan(ours.draft_lse[1]) and not torch.isnan(ours.draft_lse[0])
    assert torch.equal(ours.draft_argmax, ref.draft_argmax)  # NaN ranks first, as torch.argmax has it


def test_draft_head_never_holds_n_by_v():
    """No tensor of N x V elements (or more) is created, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows, vocab = 512, 2000
    hidden, weight, target, labels = make_inputs(rows, vocab, 16, labels="given")
    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    largest.append((tensor.numel(), str(func)))
            return out

    hidden.requires_grad_(True)
    for weight_grad in (False, True):
        weight.requires_grad_(weight_grad)
        largest.clear()
        with Sizes():
            out = dk.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=ALL, top_k=16,
                                tile_mb=1.0)
            sum(loss.sum() for loss in out.losses.values()).backward()
        biggest = max(largest)
        assert biggest[0] < rows * vocab // 4, biggest


def test_draft_head_training_vocab():
    """V = 248,320: the sums over one row, against float64 (fp32 logits, kl_div + tv + ce)."""
    case = (3, 248_320, 16, F32, F32, ("kl_div", "tv", "ce"), 16, 1.0, None, "given", None)
    hidden, weight, kwargs, ours, ref, _ = _run(case)
    _check_case(case, hidden, weight, kwargs, ours, ref)


def test_draft_head_training_rows_weight_grad():
    """N = 65,536 rows reduce into dW: the float32 accumulation over row chunks, against float64."""
    case = (65_536, 48, 8, F32, F32, ("kl_div",), 4, 1.0, None, "none", 2.0)
    hidden, weight, kwargs, ours, ref, _ = _run(case, weight_grad=True)
    _check_case(case, hidden, weight, kwargs, ours, ref)
