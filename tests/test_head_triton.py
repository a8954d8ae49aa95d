"""dk.draft_head on its GPU driver (dflash2_kernels/head/gpu_driver.py: the Triton scan,
merge, sweep, finish and backward kernels), on CPU tensors under Triton's interpreter
(DFLASH2_BACKEND=triton) without a GPU and on CUDA with one, against the float64
evaluation of SPEC section 7 with SPEC section 4's bar (tests/test_head.py's judge).

The table crosses the kernels' edges: rows split into segments of 4096 fp32 (2048 fp64,
half that with a softcap) with a ragged last one, chunks of a few rows, the candidates'
limit K = 64 and the radix select above it, every plane dtype (fp32, fp64, and the 16-bit
gradient planes of a 16-bit lm_head), the losses whose gradients need a row sum (rkl, jsd,
tv: a read after the finish), the serving form, labels from the target's argmax, the
backward from the kept planes and the recompute (a trainable lm_head).
"""

from __future__ import annotations

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from .head_cases import gpu_driver_runs, make_inputs, nan_and_inf_inputs
from .test_head import ALL, _case_id, _check_case, _run
from .triton_interpreter import FP64_SCALARS_FAULT
from .triton_interpreter import SKIP_REASON as INTERPRETER_SKIP_REASON

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    if not gpu_driver_runs():
        pytest.skip(INTERPRETER_SKIP_REASON)
    if not HAS_CUDA:
        monkeypatch.setenv("DFLASH2_BACKEND", "triton")


# rows, vocab, width, hidden dtype, weight dtype, losses, top_k, logit_scale, softcap, labels, tile_mb.
CASES = [
    (7, 9000, 16, F32, F32, ("kl_div", "tv"), 16, 1.0, None, "given", 0.5),  # 3 segments, 3-row chunks
    (5, 2500, 16, F64, F64, ALL, 9, -1.3, 2.0, "given", None),  # fp64 with a softcap: segments of 1024
    (6, 4500, 16, F16, F16, ("jsd", "ce"), 16, 1.0, 4.0, "given", 0.1),  # fp16 planes, softcap: 2048
    (6, 5000, 16, BF16, BF16, ("kl_div",), 64, 1.0, None, "given", None),  # the candidates' K limit
    (6, 5000, 16, BF16, BF16, ("ce",), 65, 1.0, None, "given", None),  # the radix select
    (5, 700, 16, F32, BF16, ("rkl", "tv"), 8, 1.0, None, "none", None),  # row-sum planes, target's labels
    (5, 33, 8, F32, F32, ALL, 33, 0.7, None, "given", None),  # K = V, every loss (the recompute)
    (9, 300, 16, F32, F32, (), 16, 1.0, None, "none-no-target", None),  # serving
    (4, 4097, 8, F32, F32, ("ce",), 4, 1.0, None, "given-no-target", 0.05),  # one entry in the last segment
]


def _skip_rounded_scalars(case) -> None:
    """fp64 planes with a scale or softcap that fp32 does not hold, where the interpreter
    would round them (tests/triton_interpreter.py): its fault, not the kernels'."""
    scalars = (case[7], case[8] or 1.0)
    if not HAS_CUDA and FP64_SCALARS_FAULT and case[4] == F64 and any(float(torch.tensor(v, dtype=F32)) != v
                                                                       for v in scalars):
        pytest.skip(FP64_SCALARS_FAULT)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_head_matches_float64(case, poison_empty):
    _skip_rounded_scalars(case)
    hidden, weight, kwargs, ours, ref, grads = _run(case, device=DEVICE)
    _check_case(case, hidden, weight, kwargs, ours, ref, grads)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5], CASES[8]], ids=_case_id)
def test_triton_head_weight_grad(case, poison_empty):
    """A trainable lm_head: the backward recomputes each chunk, dS in the weight's dtype."""
    hidden, weight, kwargs, ours, ref, grads = _run(case, weight_grad=True, device=DEVICE)
    _check_case(case, hidden, weight, kwargs, ours, ref, grads)


def test_triton_head_leading_dims_and_strides():
    case = (33, 1000, 24, F32, F32, ALL, 16, 0.8, 3.0, "given", 0.1)  # chunks of a few rows
    hidden, weight, kwargs, ours, ref, grads = _run(case, lead=(3, 11), strided=True, device=DEVICE)
    assert ours.topk_ids.shape == (3, 11, 16) and ours.losses["kl_div"].shape == (3, 11)
    _check_case(case, hidden, weight, kwargs, ours, ref, grads)


def _on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def test_triton_head_ties_take_the_lower_id():
    """Duplicated W rows tie exactly (small dyadic inputs): the lower id ranks first, the K-th
    place included, and a segment with more tied candidates than it keeps picks exactly K."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randint(-4, 5, (6, 8), generator=gen).float() / 4
    weight = torch.randint(-8, 9, (5000, 8), generator=gen).float() / 16
    weight[100:4500] = weight[9].clone()  # thousands of ties in one segment
    weight[[3, 17, 30, 4600]] = weight[31].clone()
    # Row 0 sees column 0 of W: ten values three times each above 4,400 ties at the 40th
    # place (the exact K-th key, one distinct key a step); row 5 sees all zeros.
    hidden[0] = 0.0
    hidden[0, 0] = 1.0
    hidden[5] = 0.0
    weight[:, 0] = torch.randint(-16, 16, (5000,), generator=gen).float() / 8
    weight[100:4500, 0] = 3.0
    weight[torch.arange(30) * 7 + 4600 - 210, 0] = 4.0 + (torch.arange(30) // 3).float() / 4
    for dtype in (F32, BF16):
        out = dk.draft_head(*_on_device(hidden, weight), top_k=40, losses=(), logits_dtype=dtype)
        rounded = reference.draft_head_logits(hidden.double(), weight.double()).to(dtype)
        order = torch.sort(rounded, dim=-1, descending=True, stable=True).indices[:, :40]
        assert torch.equal(out.topk_ids.cpu(), order)
        assert torch.equal(out.draft_argmax.cpu(), order[:, 0])


def test_triton_head_nan_and_inf_rows():
    hidden, weight, target, labels = nan_and_inf_inputs()
    kwargs = dict(losses=ALL, top_k=4)
    ours = dk.draft_head(*_on_device(hidden, weight), target_hidden=target.to(DEVICE), labels=labels.to(DEVICE),
                         **kwargs)
    exact = reference.draft_head(hidden.double(), weight.double(), target_hidden=target.double(), labels=labels,
                                 **kwargs)
    for name in ALL:
        got, true = ours.losses[name].cpu().double(), exact.losses[name]
        finite = torch.isfinite(true)
        assert ((got[~finite] == true[~finite]) | (got[~finite].isnan() & true[~finite].isnan())).all(), name
        assert torch.isfinite(got[finite]).all(), name
    assert torch.isnan(ours.draft_lse[1]) and not torch.isnan(ours.draft_lse[0])
    assert torch.equal(ours.draft_argmax.cpu(), exact.draft_argmax)  # NaN ranks first, as torch.argmax


def test_bad_label_on_the_device_path_gives_nan_not_a_stray_read(monkeypatch):
    """On a GPU no host sync checks the labels: a label outside [0, V) makes its row's ce and
    label logit NaN, the other rows untouched (the CPU check is switched off to see it here)."""
    from dflash2_kernels.head import checks

    real = checks.has_data
    monkeypatch.setattr(checks, "has_data", lambda tensor: False if tensor.dtype == torch.long else real(tensor))
    hidden, weight, _, labels = make_inputs(4, 300, 8, target=False, labels="given")
    labels[2] = 300
    labels[3] = -7
    out = dk.draft_head(*_on_device(hidden, weight), labels=labels.to(DEVICE), losses=("ce",), top_k=3)
    ce, logit = out.losses["ce"].cpu(), out.label_logit.cpu()
    assert torch.isnan(ce[2:]).all() and torch.isnan(logit[2:]).all()
    assert torch.isfinite(ce[:2]).all() and torch.isfinite(logit[1:2]).all()


def test_bad_ids_in_a_raw_backward_give_nan(monkeypatch):
    """The raw backward op on the device path: a top-k id outside [0, V) reads no W row and
    makes its row's gradient NaN (the CPU tensors' IndexError is switched off to see it)."""
    from dflash2_kernels.head import ops

    monkeypatch.setattr(ops, "has_data", lambda tensor: False)
    hidden, weight, target, labels = make_inputs(3, 40, 8)
    args = (hidden.to(DEVICE), weight.to(DEVICE), target.to(DEVICE), None, labels.to(DEVICE), 1, 4, 1.0, 0.0, F32,
            True, 8)
    out = torch.ops.dflash2.draft_head(*args)
    ids = out[1].clone()
    ids[1, 2] = 40
    grad_hidden, _ = torch.ops.dflash2.draft_head_backward(
        torch.ones_like(out[0]), torch.ones_like(out[2]), None, *args[:5], ids, out[11], out[3], out[12], out[13],
        out[14], 1, 4, 1.0, 0.0, F32, True, False, 8)
    grad_hidden = grad_hidden.cpu()
    assert torch.isnan(grad_hidden[1]).all() and torch.isfinite(grad_hidden[[0, 2]]).all()


def test_opcheck_triton_path():
    hidden, weight, target, labels = (t.to(DEVICE) for t in make_inputs(11, 37, 8))
    hidden.requires_grad_(True)
    args = (hidden, weight, target, None, labels, 0b11011, 5, 0.9, 3.0, F32, True, 4)
    torch.library.opcheck(torch.ops.dflash2.draft_head.default, args)
    out = [o.detach() for o in torch.ops.dflash2.draft_head(*args)]
    grads = (torch.randn_like(out[0]), torch.randn(11, 5, device=DEVICE), torch.randn(11, device=DEVICE))
    torch.library.opcheck(torch.ops.dflash2.draft_head_backward.default,
                          (*grads, hidden.detach(), weight, target, None, labels, out[1], out[11], out[3], out[12],
                           out[13], out[14], 0b11011, 5, 0.9, 3.0, F32, True, False, 4))


def test_empty_rows():
    hidden, weight, target, labels = make_inputs(1, 50, 8, lead=(0, 3))
    out = dk.draft_head(hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE), target_hidden=target.to(DEVICE),
                        labels=labels.to(DEVICE), losses=("kl_div", "ce"), top_k=4)
    assert out.topk_ids.shape == (0, 3, 4) and out.losses["ce"].shape == (0, 3)


@pytest.mark.parametrize("weight_dtype, vocab, losses", [(BF16, 300, ()), (F32, 9000, ("ce",))])
def test_recompute_keeps_the_top_k_gradient_through_w_exact(weight_dtype, vocab, losses):
    """A trainable lm_head's backward takes the top-k and label logits' gradients to dh
    through their W rows, not through the dL/ds plane's product over V: large upstream
    gradients there (1000) would otherwise be rounded with the plane (16-bit: off by ~4)
    or at every step of the fp32 product's sum over V (MKL_CBWR=COMPATIBLE showed ~30 x
    fp32's rounding at V 9,000). dh against float64, to a few times fp32's rounding of
    its largest value."""
    hidden, weight, _, labels = make_inputs(6, vocab, 16, hidden_dtype=F32, weight_dtype=weight_dtype,
                                            labels="given")
    hidden = hidden.to(DEVICE).requires_grad_(True)
    weight = weight.to(DEVICE).requires_grad_(True)
    out = dk.draft_head(hidden, weight, labels=labels.to(DEVICE), losses=losses, top_k=4, logits_dtype=F32)
    gen = torch.Generator().manual_seed(5)
    grad_topk = 1000 * torch.randn(6, 4, generator=gen, dtype=torch.float64)
    grad_label = 1000 * torch.randn(6, generator=gen, dtype=torch.float64)
    grad_ce = torch.rand(6, generator=gen, dtype=torch.float64)
    outputs, upstream = [out.topk_logits, out.label_logit], [grad_topk.float(), grad_label.float()]
    if losses:
        outputs.append(out.losses["ce"])
        upstream.append(grad_ce.float())
    grad_hidden, _ = torch.autograd.grad(outputs, [hidden, weight], [g.to(DEVICE) for g in upstream])
    h64 = hidden.detach().cpu().double().requires_grad_(True)
    w64 = weight.detach().cpu().double()
    z = h64 @ w64.T
    column = torch.where(labels == reference.IGNORE_INDEX, 0, labels)
    objective = (grad_topk.float().double() * z.gather(1, out.topk_ids.cpu())).sum()
    objective = objective + (grad_label.float().double() * z.gather(1, column[:, None]).squeeze(1)).sum()
    if losses:
        ce = torch.logsumexp(z, -1) - z.gather(1, column[:, None]).squeeze(1)
        objective = objective + (grad_ce.float().double() * torch.where(labels == reference.IGNORE_INDEX, 0, ce)).sum()
    exact, = torch.autograd.grad(objective, h64)
    scale = exact.abs().max().item()
    error = (grad_hidden.cpu().double() - exact).abs().max().item()
    assert error <= 8 * 2**-24 * scale, error / scale / 2**-24
