"""Fuzz cases for the fused draft head (SPEC section 7): ``dk.draft_head``, the custom ops
``dflash2::draft_head`` / ``dflash2::draft_head_backward`` and the C++ row ops
``dflash2::draft_head_rows_cpu`` / ``dflash2::draft_head_rows_backward_cpu``.

Valid results are judged against the dense formulas in float64 with SPEC section 4's bar
(the dense reference, ``dk.reference``, run in the input dtypes sets it): every loss,
``draft_lse``, ``target_lse``, ``overlap``, ``topk_logits``, ``label_logit``,
``target_logits_at_topk`` and the gradients w.r.t. hidden (and weight when it requires
grad) of one objective over every differentiable output (tests/head_cases.py's). Ids are
judged by what they pick: ``topk_ids`` (and the argmaxes, a top-1) must be a top-k,
logit descending, of logits within the kernel's error bound of the float64 ones rounded
to ``logits_dtype``, ties (values that round alike anywhere within the bound) to the
lower id. Where the head picks the label itself (ce without labels: the target argmax),
the float64 losses are evaluated at the label it picked, once that is shown an argmax.

The raw ops are judged by the same rules: ``draft_head`` like the public function (plus
its raw outputs: ``topk_z``, ``label_z``, the per-loss dL/dh planes), ``draft_head_backward``
by the gradients of the objective it is handed the upstream gradients of, the row ops
against the float64 formulas on the raw logits they are given (and what they leave in
place: the transformed logits, dL/ds). Bad arguments of the row ops must raise before the
tensors they write in place are touched.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from ..head_cases import exact, make_inputs, objective, upstream_weights
from ..triton_interpreter import FAULT as INTERPRETER_FAULT
from .case import Agrees, Call, Case
from .conv import backend
from .draw import FLOATS, NON_FLOATS, Draw
from .judges import assert_contract, assert_equal
from .mutations import (
    Mutation,
    at_op_boundary,
    bad_case,
    float_tensor_mutations,
    size_mutations,
    with_dim_resized,
    with_extra_dim,
)

BAD_FRACTION = 0.5
LOSSES = reference.DRAFT_HEAD_LOSSES  # bit i of a loss mask is LOSSES[i]
SOFT = reference.SOFT_LOSSES
IGNORE = reference.IGNORE_INDEX
MAX_VOCAB = 600
MAX_WIDTH = 48
MAX_ROWS = 40
# The CPU row kernel walks a row in lanes of 8 floats / 4 doubles: vocabularies at the edges.
VOCAB_EDGES = (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 64, 65)
SCALES = (1.0, 1.0, 1.0, 0.5, 1.7, -1.3, -1.0, 4.0)
SOFTCAPS = (0.5, 2.0, 3.0, 30.0)
TILE_MBS = (None, None, None, 1e-4, 0.003, 0.02, 0.5)
HEAD_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_FRACTION = 0.15  # valid cases run on the GPU driver (Triton's interpreter without a GPU)
MAX_TRITON_ENTRIES = 6000  # rows x V of such a case: the interpreter takes ~1 ms a program
NOT_HEAD_DTYPES = NON_FLOATS  # integers, bool, complex, 8-bit floats: no logits_dtype


def _mask(names) -> int:
    return sum(1 << LOSSES.index(name) for name in names)


def _names_of(mask: int) -> tuple[str, ...]:
    return tuple(name for i, name in enumerate(LOSSES) if mask >> i & 1)


def draw_triton(draw: Draw, setup) -> bool:
    """Whether a valid case runs on the GPU driver: a few small ones, where Triton can run
    (CUDA, or an interpreter not known to be wrong: tests/triton_interpreter.py)."""
    small = setup.rows * setup.vocab <= MAX_TRITON_ENTRIES
    usable = torch.cuda.is_available() or not INTERPRETER_FAULT
    return small and usable and _triton_importable() and draw.chance(TRITON_FRACTION)


def _triton_importable() -> bool:
    from dflash2_kernels._backend import triton_importable

    return triton_importable()


def on_driver(triton: bool):
    """The case's backend: the GPU driver's Triton kernels, or the default (the CPU's)."""
    return backend("triton") if triton else contextlib.nullcontext()


def _compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """What the head holds its logits and sums in (head/gemm.py)."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def poisoned_empty():
    """Every ``torch.empty`` (the custom ops' Python allocations) NaN-filled (integers:
    their lowest value), as the C++ ops' are: an unwritten element fails its check."""
    original = torch.empty

    def poisoned(*args, **kwargs):
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        elif tensor.dtype in (torch.int64, torch.int32):
            tensor.fill_(torch.iinfo(tensor.dtype).min)
        return tensor

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = original


# --- drawing one head call ----------------------------------------------------------------------


@dataclass
class Setup:
    """One draft head call's inputs, as the head takes them (softcap None: no tanh)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    target_hidden: torch.Tensor | None
    target_weight: torch.Tensor | None
    labels: torch.Tensor | None
    losses: tuple[str, ...]
    top_k: int
    logit_scale: float
    softcap: float | None
    logits_dtype: torch.dtype  # resolved (the public function's None: hidden's dtype)
    kind: str

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def width(self) -> int:
        return self.weight.shape[1]

    @property
    def rows(self) -> int:
        return math.prod(self.hidden.shape[:-1])

    @property
    def compute(self) -> torch.dtype:
        return _compute_dtype(self.weight.dtype)


def draw_losses(draw: Draw, has_target: bool, has_labels: bool) -> tuple[str, ...]:
    """A subset of the losses the inputs allow, in a random order; () a fifth of the time."""
    allowed = [name for name in LOSSES if (name in SOFT and has_target) or
               (name == "ce" and (has_target or has_labels))]
    if not allowed or draw.chance(0.2):
        return ()
    chosen = [name for name in allowed if draw.chance(0.45)] or [draw.pick(allowed)]
    return tuple(chosen[i] for i in draw.np.permutation(len(chosen)))


def draw_labels(draw: Draw, lead: tuple, vocab: int) -> torch.Tensor:
    """int64 labels in [0, V) (edges over-represented), -100 on some rows (or all)."""
    labels = draw.ids(lead, vocab)
    if labels.numel() and draw.chance(0.6):
        labels = draw.sprinkle(labels, (IGNORE,), draw.pick([0.1, 0.3, 1.0]))
    return labels


def draw_top_k(draw: Draw, vocab: int) -> int:
    return int(draw.pick([0, 1, min(vocab, 16), vocab, draw.integer(0, vocab), draw.integer(0, min(vocab, 40))]))


def draw_lead(draw: Draw) -> tuple:
    """Leading dims 0 to 2 deep (no leading dim: hidden [H], one row), at most MAX_ROWS rows."""
    if draw.chance(0.12):
        return ()
    return draw.lead_dims(2, MAX_ROWS, min_dims=1)


def draw_setup(draw: Draw, *, flat: bool = False, special: bool = True) -> Setup:
    """hidden [..., H] (flat: [N, H]), weight [V, H] and everything else, valid.

    Kinds: "random"; "ties" (duplicated W rows: equal logits, the lower id first);
    "nan" (NaN in some hidden / target rows: no gradients, forward judged only).
    """
    vocab = draw.size(1, MAX_VOCAB, edges=VOCAB_EDGES)
    width = draw.size(1, MAX_WIDTH, edges=(8, 16))
    lead = (draw.size(0, MAX_ROWS, edges=(1, 2)),) if flat else draw_lead(draw)
    hidden_dtype = draw.dtype(FLOATS)
    weight_dtype = hidden_dtype if draw.chance(0.6) else draw.pick([torch.bfloat16, *FLOATS])
    has_target = draw.chance(0.7)
    kind = draw.pick(["random"] * 8 + ["ties"] + (["nan"] if special else []))
    hidden, weight, target_hidden, _ = make_inputs(
        None, vocab, width, hidden_dtype=hidden_dtype, weight_dtype=weight_dtype, target=has_target, labels=None,
        lead=lead, seed=draw.integer(0, 2**31), scale=draw.pick([1.0, 1.0, 0.3, 3.0]))
    if kind == "ties" and vocab > 1:
        copies = torch.randint(0, vocab, (draw.integer(1, max(1, vocab // 2)), 2), generator=draw.torch)
        for source, dest in copies.tolist():
            weight[dest] = weight[source]
    target_weight = None
    if has_target and draw.chance(0.3):
        noise = torch.randn(weight.shape, generator=draw.torch, dtype=torch.float64) * 0.5 / width ** 0.5
        target_dtype = weight_dtype if draw.chance(0.6) else draw.dtype(FLOATS)
        target_weight = draw.layout((weight.double() + noise).to(target_dtype), expand=False)
    if has_target and draw.chance(0.2):
        target_hidden = target_hidden.to(draw.dtype(FLOATS))
    if kind == "nan" and hidden.numel():
        hidden = draw.sprinkle(hidden, (float("nan"),), 0.02)
        if target_hidden is not None and draw.chance(0.5):
            target_hidden = draw.sprinkle(target_hidden, (float("nan"),), 0.02)
    has_labels = draw.chance(0.5)
    losses = draw_losses(draw, has_target, has_labels)
    labels = draw_labels(draw, lead, vocab) if has_labels else None
    softcap = draw.pick(SOFTCAPS) if draw.chance(0.35) else None
    logits_dtype = hidden_dtype if draw.chance(0.6) else draw.dtype(HEAD_FLOATS)
    return Setup(
        hidden=draw.layout(hidden), weight=draw.layout(weight, expand=False),
        target_hidden=None if target_hidden is None else draw.layout(target_hidden),
        target_weight=target_weight, labels=None if labels is None else draw.layout(labels),
        losses=losses, top_k=draw_top_k(draw, vocab), logit_scale=float(draw.pick(SCALES)), softcap=softcap,
        logits_dtype=logits_dtype, kind=kind)


# --- the float64 side ---------------------------------------------------------------------------


def transform(s: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """z = softcap * tanh(scale * s / softcap) (scale * s without softcap), in s's dtype:
    reference.draft_head_logits after its GEMM."""
    z = s * logit_scale if logit_scale != 1.0 else s
    return softcap * torch.tanh(z / softcap) if softcap is not None else z


def exact_head(setup: Setup, labels, *, hidden_grad=False, weight_grad=False) -> dict:
    """tests/head_cases.py's ``exact`` (losses, z, t, label, safe, float64 leaves), with the
    target's logits from target_weight when one is given (``exact`` takes weight's)."""
    hidden = setup.hidden.detach().requires_grad_(hidden_grad)
    weight = setup.weight.detach().requires_grad_(weight_grad)
    separate = setup.target_weight is not None
    names = setup.losses if not separate else tuple(name for name in setup.losses if name == "ce")
    truth = exact(hidden, weight, None if separate else setup.target_hidden, labels, names, setup.logit_scale,
                  setup.softcap)
    if separate:
        th = setup.target_hidden.detach().to(setup.target_weight.dtype).double().reshape(-1, setup.width)
        truth["t"] = reference.draft_head_logits(th, setup.target_weight.detach().double(), setup.logit_scale,
                                                 setup.softcap)
        soft = tuple(name for name in setup.losses if name in SOFT)
        rows = reference.draft_head_row_losses(truth["z"], truth["t"], truth["safe"], soft)
        for name in soft:
            truth["losses"][name] = rows[name] if truth["label"] is None else \
                torch.where(truth["label"] == IGNORE, torch.zeros_like(rows[name]), rows[name])
    return truth


def _finite_max(tensor: torch.Tensor) -> float:
    finite = tensor[torch.isfinite(tensor)]
    return finite.abs().max().item() if finite.numel() else 0.0


def error_bound(computed: torch.Tensor, exact64: torch.Tensor) -> float:
    """How far the kernel's logits may be from the float64 ones: twice a dense evaluation's
    error in the compute dtype, plus a floor (as tests/test_head.py bounds its top-k)."""
    both = torch.isfinite(computed) & torch.isfinite(exact64)
    error = (computed.double() - exact64)[both].abs().max().item() if both.any() else 0.0
    return 2 * error + 1e-6 * (1 + _finite_max(exact64))


def _compute_logits(hidden, weight, setup: Setup) -> torch.Tensor:
    """The logits as a dense evaluation in the compute dtype gives them (hidden taken in weight's dtype)."""
    compute = _compute_dtype(weight.dtype)
    rows = hidden.detach().to(weight.dtype).to(compute).reshape(-1, setup.width)
    return reference.draft_head_logits(rows, weight.detach().to(compute), setup.logit_scale, setup.softcap)


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(dtype).double()


def assert_a_top_k(name: str, ids, exact64: torch.Tensor, bound: float, dtype: torch.dtype) -> None:
    """ids [R, K] are a top-K, logit descending, of some logits within ``bound`` of
    ``exact64`` [R, V] rounded to ``dtype`` (NaN ranks first), and where two values round
    alike anywhere within the bound (a sure tie) the lower id comes first. Rounding is
    monotone, so the values an entry may take lie in [round(x - bound), round(x + bound)]."""
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int64, f"{name}: not an int64 tensor: {ids!r}"
    rows, vocab = exact64.shape
    assert ids.dim() == 2 and ids.shape[0] == rows, f"{name}: shape {tuple(ids.shape)} for {rows} rows"
    k = ids.shape[1]
    if rows == 0 or k == 0:
        return
    assert ((ids >= 0) & (ids < vocab)).all(), f"{name}: an id outside [0, {vocab}): {ids.min()}..{ids.max()}"
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), f"{name}: an id repeats within a row"
    nan = exact64.isnan()
    low = _rounded(exact64 - bound, dtype).masked_fill(nan, math.inf)
    high = _rounded(exact64 + bound, dtype).masked_fill(nan, math.inf)
    sure = low == high
    picked_low, picked_high, picked_sure = low.gather(1, ids), high.gather(1, ids), sure.gather(1, ids)
    order = picked_high[:, :-1] >= picked_low[:, 1:]
    if not order.all():
        row, j = (~order).nonzero()[0].tolist()
        raise AssertionError(f"{name}: row {row} not descending at place {j}: id {ids[row, j]} "
                             f"(<= {picked_high[row, j]:.9g}) before id {ids[row, j + 1]} "
                             f"(>= {picked_low[row, j + 1]:.9g})")
    tied = picked_sure[:, :-1] & picked_sure[:, 1:] & (picked_low[:, :-1] == picked_low[:, 1:])
    if (tied & (ids[:, :-1] > ids[:, 1:])).any():
        row = (tied & (ids[:, :-1] > ids[:, 1:])).nonzero()[0, 0].item()
        raise AssertionError(f"{name}: row {row}: tied values not in id order: {ids[row].tolist()}")
    if k == vocab:
        return
    chosen = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, ids, True)
    best_left = low.masked_fill(chosen, -math.inf).max(1).values
    worst_taken = picked_high.min(1).values
    beaten = worst_taken < best_left
    if beaten.any():
        row = beaten.nonzero()[0, 0].item()
        left = low[row].masked_fill(chosen[row], -math.inf).argmax().item()
        raise AssertionError(f"{name}: row {row}: id {left} (>= {best_left[row]:.9g}) left out, but a picked id "
                             f"is at most {worst_taken[row]:.9g}; ids {ids[row].tolist()[:12]}")
    # The k-th place's sure ties: an id left out that surely ties the last picked value
    # must come after every picked id of that value.
    last = picked_low[:, -1]
    for row in torch.nonzero(picked_sure[:, -1]).flatten().tolist():
        value = last[row]
        same_taken = ids[row][picked_sure[row] & (picked_low[row] == value)]
        same_left = torch.nonzero(sure[row] & (low[row] == value) & ~chosen[row]).flatten()
        if same_left.numel() and same_left.min() < same_taken.max():
            raise AssertionError(f"{name}: row {row}: id {same_left.min().item()} ties the k-th value {value.item()} "
                                 f"but was left out for id {same_taken.max().item()}")


def _label_used(setup: Setup, label_ids) -> torch.Tensor | None:
    """The labels the losses are evaluated at: as given, else the head's target argmax."""
    if setup.labels is not None:
        return setup.labels.reshape(setup.hidden.shape[:-1])
    if label_ids is None:
        return None
    return label_ids.reshape(setup.hidden.shape[:-1])


# --- the judge of one head result (public or raw op) ---------------------------------------


@dataclass
class Flat:
    """A head's results over N flat rows (None where a field does not exist)."""

    losses: dict
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor
    label_ids: torch.Tensor | None
    label_logit: torch.Tensor | None
    draft_lse: torch.Tensor
    target_lse: torch.Tensor | None
    draft_argmax: torch.Tensor
    target_argmax: torch.Tensor | None
    at_topk: torch.Tensor | None
    overlap: torch.Tensor | None


def judge_forward(setup: Setup, got: Flat) -> dict:
    """Every forward result against float64 (SPEC sections 4 and 7). Returns what the
    gradient judge reuses: ids, the label used, its safe column."""
    rows, vocab, k = setup.rows, setup.vocab, setup.top_k
    has_target = setup.target_hidden is not None
    cd = setup.compute
    ids = got.topk_ids
    assert tuple(ids.shape) == (rows, k), f"topk_ids: shape {tuple(ids.shape)}, expected {(rows, k)}"
    # The ids and argmaxes first: the float64 losses need the label the head picked.
    z64_plain = exact(setup.hidden.detach(), setup.weight.detach(), None, None, (), setup.logit_scale,
                      setup.softcap)["z"].detach()
    z_bound = error_bound(_compute_logits(setup.hidden, setup.weight, setup), z64_plain)
    assert_a_top_k("topk_ids", ids, z64_plain, z_bound, setup.logits_dtype)
    assert_a_top_k("draft_argmax", got.draft_argmax.reshape(rows, 1), z64_plain, z_bound, setup.logits_dtype)
    if k:
        assert_equal("draft_argmax (topk_ids[..., 0])", got.draft_argmax, ids[:, 0])
    label_ids = None
    if has_target:
        target_weight = setup.weight if setup.target_weight is None else setup.target_weight
        th = setup.target_hidden.detach().to(target_weight.dtype).double().reshape(-1, setup.width)
        t64 = reference.draft_head_logits(th, target_weight.detach().double(), setup.logit_scale, setup.softcap)
        t_bound = error_bound(_compute_logits(setup.target_hidden, target_weight, setup), t64)
        assert_a_top_k("target_argmax", got.target_argmax.reshape(rows, 1), t64, t_bound, setup.logits_dtype)
    if setup.labels is not None or has_target:
        assert got.label_ids is not None, "label_ids missing (labels or target_hidden given)"
        want = setup.labels.reshape(-1) if setup.labels is not None else got.target_argmax
        assert_equal("label_ids", got.label_ids, want)
        label_ids = got.label_ids
    else:
        assert got.label_ids is None and got.label_logit is None, "label fields without labels or target_hidden"
    labels = _label_used(setup, label_ids)
    truth = exact_head(setup, labels)
    z64, t64 = truth["z"].detach(), truth["t"]
    ref = reference.draft_head(setup.hidden.detach(), setup.weight.detach(), target_hidden=setup.target_hidden,
                               target_weight=setup.target_weight, labels=labels, losses=setup.losses, top_k=k,
                               logit_scale=setup.logit_scale, softcap=setup.softcap, logits_dtype=setup.logits_dtype)
    assert set(got.losses) == set(setup.losses), f"losses {sorted(got.losses)} != {sorted(setup.losses)}"
    for name in setup.losses:
        assert_contract(f"losses[{name!r}]", got.losses[name], ref.losses[name].reshape(-1),
                        truth["losses"][name].reshape(-1))
    assert_contract("draft_lse", got.draft_lse, ref.draft_lse.reshape(-1), torch.logsumexp(z64, -1))
    z_in = reference.draft_head_logits(setup.hidden.detach(), setup.weight.detach(), setup.logit_scale,
                                       setup.softcap).reshape(-1, vocab)
    assert got.topk_logits.dtype == setup.logits_dtype, f"topk_logits {got.topk_logits.dtype}"
    assert_contract("topk_logits", got.topk_logits, z_in.to(setup.logits_dtype).gather(-1, ids),
                    z64.gather(-1, ids), compute_dtype=cd)
    safe = None
    if label_ids is not None:
        safe = torch.where(label_ids == IGNORE, 0, label_ids)
        assert_contract("label_logit", got.label_logit, z_in.to(setup.logits_dtype).gather(-1, safe[:, None])[:, 0],
                        z64.gather(-1, safe[:, None])[:, 0], compute_dtype=cd)
    if has_target:
        assert_contract("target_lse", got.target_lse, ref.target_lse.reshape(-1), torch.logsumexp(t64, -1))
        overlap = torch.minimum(torch.softmax(t64, -1), torch.softmax(z64, -1)).sum(-1)
        assert_contract("overlap", got.overlap, ref.overlap.reshape(-1), overlap)
        target_weight = setup.weight if setup.target_weight is None else setup.target_weight
        t_in = reference.draft_head_logits(setup.target_hidden, target_weight.detach(), setup.logit_scale,
                                           setup.softcap).reshape(-1, vocab)
        stat = torch.float64 if z_in.dtype == torch.float64 else torch.float32  # the reference's statistics dtype
        assert_contract("target_logits_at_topk", got.at_topk, t_in.to(stat).gather(-1, ids).float(),
                        t64.gather(-1, ids))
    return dict(ids=ids, labels=labels, safe=safe)


def judge_grads(setup: Setup, grads: dict, ids, labels, safe, weights) -> None:
    """Gradients of objective(losses, topk_logits, label_logit) w.r.t. hidden (and weight)
    against the dense reference's in the input dtypes and float64's, at the head's ids."""
    if not grads:
        return
    leaves = {"hidden": setup.hidden.detach().requires_grad_("hidden" in grads),
              "weight": setup.weight.detach().requires_grad_("weight" in grads)}
    ref = reference.draft_head(leaves["hidden"], leaves["weight"], target_hidden=setup.target_hidden,
                               target_weight=setup.target_weight, labels=labels, losses=setup.losses,
                               top_k=setup.top_k, logit_scale=setup.logit_scale, softcap=setup.softcap,
                               logits_dtype=setup.logits_dtype)
    z_ref = reference.draft_head_logits(leaves["hidden"], leaves["weight"], setup.logit_scale,
                                        setup.softcap).reshape(-1, setup.vocab).to(setup.logits_dtype)
    ref_objective = objective(ref.losses, z_ref.gather(-1, ids), None if safe is None else
                              z_ref.gather(-1, safe[:, None]), weights)
    wanted = [name for name in ("hidden", "weight") if name in grads]
    in_dtype = dict(zip(wanted, torch.autograd.grad(ref_objective, [leaves[n] for n in wanted],
                                                    allow_unused=True, materialize_grads=True)))
    truth = exact_head(setup, labels, hidden_grad="hidden" in grads, weight_grad="weight" in grads)
    exact_objective = objective(truth["losses"], truth["z"].gather(-1, ids), None if safe is None else
                                truth["z"].gather(-1, safe[:, None]), weights)
    exact_grads = dict(zip(wanted, torch.autograd.grad(exact_objective, [truth[n] for n in wanted],
                                                       allow_unused=True, materialize_grads=True)))
    for name in wanted:
        assert_contract(f"grad {name}", grads[name], in_dtype[name], exact_grads[name], compute_dtype=setup.compute)


# --- dk.draft_head ---------------------------------------------------------------------------------


def _public_kwargs(setup: Setup, logits_dtype, tile_mb) -> dict:
    return dict(target_hidden=setup.target_hidden, target_weight=setup.target_weight, labels=setup.labels,
                losses=setup.losses, top_k=setup.top_k, logit_scale=setup.logit_scale, softcap=setup.softcap,
                logits_dtype=logits_dtype, tile_mb=tile_mb)


def _flat_public(out, rows: int, k: int) -> Flat:
    def flat(tensor, *tail):
        return None if tensor is None else tensor.detach().reshape(rows, *tail)

    return Flat({name: flat(loss) for name, loss in out.losses.items()}, flat(out.topk_ids, k),
                flat(out.topk_logits, k), flat(out.label_ids), flat(out.label_logit), flat(out.draft_lse),
                flat(out.target_lse), flat(out.draft_argmax), flat(out.target_argmax),
                flat(out.target_logits_at_topk, k), flat(out.overlap))


def _assert_public_shapes(setup: Setup, out) -> None:
    lead, k = tuple(setup.hidden.shape[:-1]), setup.top_k
    assert isinstance(out, reference.DraftHeadOutput), f"expected a DraftHeadOutput, got {type(out).__name__}"
    for name, loss in out.losses.items():
        assert loss.shape == lead and loss.dtype == torch.float32, f"losses[{name!r}]: {loss.dtype} {loss.shape}"
    expected = dict(topk_ids=((*lead, k), torch.int64), topk_logits=((*lead, k), setup.logits_dtype),
                    draft_lse=(lead, torch.float32), draft_argmax=(lead, torch.int64))
    has_target, has_label = setup.target_hidden is not None, setup.labels is not None or setup.target_hidden is not None
    if has_target:
        expected.update(target_lse=(lead, torch.float32), target_argmax=(lead, torch.int64),
                        target_logits_at_topk=((*lead, k), torch.float32), overlap=(lead, torch.float32))
    if has_label:
        expected.update(label_ids=(lead, torch.int64), label_logit=(lead, setup.logits_dtype),
                        label_in_topk=(lead, torch.bool))
    for field in out._fields:
        value = getattr(out, field)
        if field == "losses":
            continue
        if field not in expected:
            assert value is None, f"{field}: expected None, got {value!r}"
            continue
        shape, dtype = expected[field]
        assert isinstance(value, torch.Tensor), f"{field}: expected a tensor, got {value!r}"
        assert tuple(value.shape) == shape and value.dtype == dtype, \
            f"{field}: {value.dtype} {tuple(value.shape)}, expected {dtype} {shape}"
    if has_label:
        ids, labels = out.topk_ids.reshape(setup.rows, k), out.label_ids.reshape(-1)
        in_topk = (ids == labels[:, None]).any(-1) & (labels != IGNORE)
        assert_equal("label_in_topk", out.label_in_topk.reshape(-1), in_topk)


GRAD_MODES = ("hidden", "hidden", "hidden", "hidden and weight", "weight", "none", "no_grad")


def draft_head_case(draw: Draw) -> Case:
    """dk.draft_head(hidden [..., H], weight [V, H], *, target_hidden, target_weight, labels,
    losses, top_k, logit_scale, softcap, logits_dtype, tile_mb) -> DraftHeadOutput."""
    setup = draw_setup(draw)
    logits_dtype = None if setup.logits_dtype == setup.hidden.dtype and draw.chance(0.7) else setup.logits_dtype
    tile_mb = draw.pick(TILE_MBS)
    kwargs = _public_kwargs(setup, logits_dtype, tile_mb)
    call = Call(dk.draft_head, dict(hidden=setup.hidden, weight=setup.weight, **kwargs), keywords=tuple(kwargs))
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, public_mutations(draw, setup, kwargs))
    mode = "none" if setup.kind == "nan" else draw.pick(GRAD_MODES)
    wanted = [name for name in ("hidden", "weight") if name in mode]
    seed = draw.integer(0, 2**31)
    triton = draw_triton(draw, setup)

    def run():
        leaves = {"hidden": setup.hidden.detach().requires_grad_("hidden" in wanted),
                  "weight": setup.weight.detach().requires_grad_("weight" in wanted)}
        with poisoned_empty(), on_driver(triton), (torch.no_grad() if mode == "no_grad" else contextlib.nullcontext()):
            out = dk.draft_head(leaves["hidden"], leaves["weight"], **kwargs)
            grads = {}
            if wanted:
                weights = upstream_weights(out, setup.top_k, seed)
                total = objective(out.losses, out.topk_logits, out.label_logit, weights)
                values = torch.autograd.grad(total, [leaves[n] for n in wanted], allow_unused=True,
                                             materialize_grads=True)
                grads = dict(zip(wanted, values))
        return out, grads

    def judge(result) -> None:
        out, grads = result
        _assert_public_shapes(setup, out)
        for name, grad in grads.items():
            leaf = getattr(setup, name)
            assert grad.shape == leaf.shape and grad.dtype == leaf.dtype, \
                f"grad {name}: {grad.dtype} {tuple(grad.shape)} for {leaf.dtype} {tuple(leaf.shape)}"
        seen = judge_forward(setup, _flat_public(out, setup.rows, setup.top_k))
        if grads:
            judge_grads(setup, grads, seen["ids"], seen["labels"], seen["safe"],
                        upstream_weights(out, setup.top_k, seed))

    driver = ", triton" if triton else ""
    return Case(f"valid ({setup.kind}, gradients: {mode}{driver})", run, Agrees(judge), call.args)


def _out_of_range_labels(draw: Draw, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    bad = draw.pick([vocab, vocab + 1, -1, -101, -99, 2**40, -(2**62)])
    labels = labels.contiguous().clone()
    labels.view(-1)[draw.integer(0, labels.numel() - 1)] = bad
    return labels


def _requiring_grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().to(torch.float32 if not tensor.is_floating_point() else tensor.dtype) \
        .requires_grad_()


def public_mutations(draw: Draw, setup: Setup, kwargs: dict) -> list[Mutation]:
    hidden, weight, vocab = setup.hidden, setup.weight, setup.vocab
    lead = tuple(hidden.shape[:-1])
    mutations = float_tensor_mutations(draw, "hidden", hidden)
    mutations += float_tensor_mutations(draw, "weight", weight)
    mutations += [
        Mutation("no dims", "hidden", torch.tensor(1.0, dtype=hidden.dtype), ("hidden",)),
        Mutation("H off by one", "hidden", with_dim_resized(draw, hidden, -1), ("hidden", "weight")),
        Mutation("H off by one", "weight", with_dim_resized(draw, weight, 1), ("hidden", "weight")),
        Mutation("1-D", "weight", weight[0], ("weight",)),
        Mutation("3-D", "weight", weight.unsqueeze(0), ("weight",)),
        Mutation("no rows (V = 0)", "weight", weight[:0], ("weight",)),
    ]
    # The verifier's side.
    target_hidden = setup.target_hidden
    if target_hidden is not None:
        mutations += [m for m in float_tensor_mutations(draw, "target_hidden", target_hidden)
                      if m.label != "None for a tensor"]
        mutations += [
            Mutation("a shape off by one", "target_hidden", with_dim_resized(draw, target_hidden, -1),
                     ("target_hidden",)),
            Mutation("requiring grad", "target_hidden", _requiring_grad(target_hidden), ("target_hidden",)),
        ]
        if any(name in SOFT for name in setup.losses):
            mutations.append(Mutation("None with a soft loss", "target_hidden", None, ("target_hidden", "losses")))
        other_weight = weight if setup.target_weight is None else setup.target_weight
        mutations += [m for m in float_tensor_mutations(draw, "target_weight", other_weight)
                      if m.label != "None for a tensor"]
        mutations += [
            Mutation("V off by one", "target_weight", with_dim_resized(draw, other_weight, 0), ("target_weight",)),
            Mutation("requiring grad", "target_weight", _requiring_grad(other_weight), ("target_weight",)),
        ]
    else:
        mutations += [
            Mutation("without target_hidden", "target_weight", weight.detach().clone(), ("target_weight",)),
            Mutation("the wrong shape", "target_hidden", with_dim_resized(draw, hidden, -1), ("target_hidden",)),
        ]
        mutations.append(Mutation("requiring grad", "target_hidden", _requiring_grad(hidden), ("target_hidden",)))
    # Labels.
    labels = setup.labels if setup.labels is not None else draw.ids(lead, vocab)
    wrong_id = draw.pick([torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool, torch.float64])
    mutations += [
        Mutation(f"dtype {str(wrong_id).removeprefix('torch.')}", "labels", labels.clamp(0, 100).to(wrong_id),
                 ("labels",)),
        Mutation("on the meta device", "labels", labels.to("meta"), ("labels",)),
        Mutation("a list for a tensor", "labels", labels.tolist(), ("labels",)),
        Mutation("an extra dim", "labels", with_extra_dim(draw, labels), ("labels",)),
    ]
    if labels.dim():
        mutations.append(Mutation("a dim off by one", "labels", with_dim_resized(draw, labels, 0), ("labels",)))
    if labels.numel():
        mutations.append(Mutation("an id out of range", "labels", _out_of_range_labels(draw, labels, vocab),
                                  ("labels",)))
    if "ce" in setup.losses and target_hidden is None:
        mutations.append(Mutation("None with ce and no target", "labels", None, ("labels", "target_hidden")))
    # The losses.
    some = list(setup.losses) or ["kl_div" if target_hidden is not None else "ce"]
    mutations += [
        Mutation("an unknown name", "losses", (*setup.losses, draw.pick(["kl", "KL_DIV", "mse", "", "cross_entropy"])),
                 ("losses",)),
        Mutation("a name twice", "losses", (*some, draw.pick(some)), ("losses",)),
        Mutation("a string, not a sequence", "losses", draw.pick(list(LOSSES)), ("losses",)),
        Mutation("not a sequence", "losses", draw.pick([3, None, 1.5]), ("losses",)),
        Mutation("a non-string name", "losses", (*setup.losses, draw.pick([0, None, b"ce"])), ("losses",)),
    ]
    if target_hidden is None:
        mutations.append(Mutation("a soft loss without target_hidden", "losses",
                                  (*setup.losses, draw.pick(list(SOFT))), ("losses", "target_hidden")))
        if setup.labels is None:
            mutations.append(Mutation("ce with neither labels nor target_hidden", "losses", ("ce",),
                                      ("losses", "labels", "target_hidden")))
    # The scalars.
    mutations += [m for m in size_mutations(draw, "top_k", too_large=vocab + 1) if m.label != "0"]
    mutations += [
        Mutation("top_k = V + 1", "top_k", vocab + 1, ("top_k",)),
        Mutation("0", "logit_scale", draw.pick([0, 0.0, -0.0]), ("logit_scale",)),
        Mutation("NaN", "logit_scale", float("nan"), ("logit_scale",)),
        Mutation("inf", "logit_scale", draw.pick([math.inf, -math.inf]), ("logit_scale",)),
        Mutation("a string", "logit_scale", "1.0", ("logit_scale",)),
        Mutation("None", "logit_scale", None, ("logit_scale",)),
        Mutation("bool True", "logit_scale", True, ("logit_scale",)),
        Mutation("0", "softcap", draw.pick([0, 0.0, -0.0]), ("softcap",)),
        Mutation("negative", "softcap", draw.pick([-1.0, -30, -1e-30]), ("softcap",)),
        Mutation("NaN", "softcap", float("nan"), ("softcap",)),
        Mutation("inf", "softcap", math.inf, ("softcap",)),
        Mutation("a string", "softcap", "30", ("softcap",)),
        Mutation("bool True", "softcap", True, ("softcap",)),
        Mutation("a dtype it cannot take", "logits_dtype", draw.pick(NOT_HEAD_DTYPES), ("logits_dtype",)),
        Mutation("a string for a dtype", "logits_dtype", "float32", ("logits_dtype",)),
        Mutation("<= 0", "tile_mb", draw.pick([0, 0.0, -1.0, -1e-9]), ("tile_mb",)),
        Mutation("NaN", "tile_mb", float("nan"), ("tile_mb",)),
    ]
    return mutations


# --- dflash2::draft_head and dflash2::draft_head_backward ----------------------------------------------


def _op_args(setup: Setup, planes: bool, tile_rows: int) -> dict:
    return dict(hidden=setup.hidden, weight=setup.weight, target_hidden=setup.target_hidden,
                target_weight=setup.target_weight, labels=setup.labels, loss_mask=_mask(setup.losses),
                top_k=setup.top_k, logit_scale=setup.logit_scale, softcap=setup.softcap or 0.0,
                logits_dtype=setup.logits_dtype, hidden_grad_planes=planes, tile_rows=tile_rows)


def _draw_tile_rows(draw: Draw, rows: int) -> int:
    return int(draw.pick([1, 2, 3, max(1, rows), rows + 1, draw.integer(1, max(1, rows)), 2**62]))


OP_OUTPUTS = ("losses", "topk_ids", "topk_logits", "label_ids", "label_logit", "draft_lse", "target_lse",
              "draft_argmax", "target_argmax", "at_topk", "overlap", "topk_z", "label_z", "hidden_grads", "row_stats")
ROW_STATS = 5


def _judge_op_outputs(setup: Setup, result, planes: bool) -> dict:
    """dflash2::draft_head's 15 outputs: shapes and dtypes, the public fields as the public
    function's, the target-side ones 0 without a target, the raw z at the ids and the label,
    the per-loss dL/dh planes against float64 when asked for, the row statistics' lse."""
    assert isinstance(result, (tuple, list)) and len(result) == len(OP_OUTPUTS), f"expected 15 outputs: {result!r}"
    out = dict(zip(OP_OUTPUTS, result))
    rows, k, width, cd = setup.rows, setup.top_k, setup.width, setup.compute
    count = len(setup.losses)
    f32, i64 = torch.float32, torch.int64
    shapes = dict(losses=((count, rows), f32), topk_ids=((rows, k), i64), topk_logits=((rows, k), setup.logits_dtype),
                  label_ids=((rows,), i64), label_logit=((rows,), setup.logits_dtype), draft_lse=((rows,), f32),
                  target_lse=((rows,), f32), draft_argmax=((rows,), i64), target_argmax=((rows,), i64),
                  at_topk=((rows, k), f32), overlap=((rows,), f32), topk_z=((rows, k), cd), label_z=((rows,), cd),
                  hidden_grads=((rows, count, width) if planes and count else (0,), cd),
                  row_stats=((rows, ROW_STATS), torch.float64))
    for name, (shape, dtype) in shapes.items():
        value = out[name]
        assert isinstance(value, torch.Tensor) and tuple(value.shape) == shape and value.dtype == dtype, \
            f"{name}: {getattr(value, 'dtype', value)} {tuple(getattr(value, 'shape', ()))}, expected {dtype} {shape}"
    has_target = setup.target_hidden is not None
    has_label = has_target or setup.labels is not None
    if not has_target:
        for name in ("target_lse", "target_argmax", "at_topk", "overlap"):
            assert_equal(f"{name} (0 without a target)", out[name], torch.zeros_like(out[name]))
    if not has_label:
        assert_equal("label_ids (-1 without labels or a target)", out["label_ids"], torch.full((rows,), -1))
    names = _names_of(_mask(setup.losses))  # the op's [L, ...] order
    flat = Flat({name: out["losses"][i] for i, name in enumerate(names)}, out["topk_ids"], out["topk_logits"],
                out["label_ids"] if has_label else None, out["label_logit"] if has_label else None,
                out["draft_lse"], out["target_lse"] if has_target else None, out["draft_argmax"],
                out["target_argmax"] if has_target else None, out["at_topk"] if has_target else None,
                out["overlap"] if has_target else None)
    seen = judge_forward(setup, flat)
    ids = seen["ids"]
    z_in = _compute_logits(setup.hidden, setup.weight, setup)
    truth = exact_head(setup, seen["labels"], hidden_grad=planes and count > 0)
    z64 = truth["z"].detach()
    assert_contract("topk_z", out["topk_z"], z_in.gather(-1, ids), z64.gather(-1, ids))
    column = torch.zeros(rows, dtype=i64) if seen["safe"] is None else seen["safe"]
    assert_contract("label_z", out["label_z"], z_in.gather(-1, column[:, None])[:, 0],
                    z64.gather(-1, column[:, None])[:, 0])
    if planes and count and setup.kind != "nan":  # NaN rows: 0 * NaN upstream of an ignored row's 0 in float64
        leaf = setup.hidden.detach().requires_grad_()
        ref = reference.draft_head(leaf, setup.weight.detach(), target_hidden=setup.target_hidden,
                                   target_weight=setup.target_weight, labels=seen["labels"], losses=names,
                                   top_k=0, logit_scale=setup.logit_scale, softcap=setup.softcap,
                                   logits_dtype=setup.logits_dtype)
        for i, name in enumerate(names):
            (in_dtype,) = torch.autograd.grad(ref.losses[name].sum(), leaf, retain_graph=True)
            (exact_grad,) = torch.autograd.grad(truth["losses"][name].sum(), truth["hidden"], retain_graph=True)
            assert_contract(f"hidden_grads[{name!r}]", out["hidden_grads"][:, i], in_dtype.to(cd), exact_grad)
    # The row statistics' normalisers: the lse the fp32 outputs round.
    assert_equal("row_stats' lse(z)", out["row_stats"][:, 0].float(), out["draft_lse"])
    if has_target:
        assert_equal("row_stats' lse(t)", out["row_stats"][:, 1].float(), out["target_lse"])
    return seen


def draft_head_op_case(draw: Draw) -> Case:
    """dflash2::draft_head(hidden [N, H], weight, target_hidden, target_weight, labels, loss_mask,
    top_k, logit_scale, softcap, logits_dtype, hidden_grad_planes, tile_rows) -> 14 tensors."""
    setup = draw_setup(draw, flat=True)
    planes = draw.chance(0.5)
    args = _op_args(setup, planes, _draw_tile_rows(draw, setup.rows))
    call = Call(torch.ops.dflash2.draft_head, args)
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, op_mutations(draw, setup, args))
    triton = draw_triton(draw, setup)

    def run():
        with poisoned_empty(), on_driver(triton):
            return call()

    driver = ", triton" if triton else ""
    return Case(f"valid ({setup.kind}, planes={planes}{driver})", run,
                Agrees(lambda result: _judge_op_outputs(setup, result, planes)), call.args)


def _scalar_mutations(draw: Draw, setup: Setup, args: dict) -> list[Mutation]:
    """The custom ops' int / float / dtype arguments, as the dispatcher hands them over."""
    vocab = setup.vocab
    mutations = [m for m in size_mutations(draw, "top_k", too_large=vocab + 1) if m.label != "0"]
    mutations += [Mutation(m.label, "tile_rows", m.value, m.names, m.binding)
                  for m in size_mutations(draw, "tile_rows")]
    mutations += [
        Mutation("negative", "loss_mask", draw.pick([-1, -32]), ("loss_mask",)),
        Mutation("above 31", "loss_mask", draw.pick([32, 33, 64, 2**40]), ("loss_mask",)),
        Mutation("a string for an int", "loss_mask", "1", ("loss_mask",)),
        Mutation("0", "logit_scale", 0.0, ("logit_scale",)),
        Mutation("NaN", "logit_scale", float("nan"), ("logit_scale",)),
        Mutation("inf", "logit_scale", draw.pick([math.inf, -math.inf]), ("logit_scale",)),
        Mutation("a string for a float", "logit_scale", "1.0", ("logit_scale",)),
        Mutation("negative", "softcap", draw.pick([-1.0, -1e-30]), ("softcap",)),
        Mutation("NaN", "softcap", float("nan"), ("softcap",)),
        Mutation("inf", "softcap", math.inf, ("softcap",)),
        Mutation("None for a float", "softcap", None, ("softcap",)),
        Mutation("a dtype it cannot take", "logits_dtype", draw.pick(NOT_HEAD_DTYPES), ("logits_dtype",)),
        Mutation("a string for a dtype", "logits_dtype", "float32", ("logits_dtype",)),
        Mutation("None for a dtype", "logits_dtype", None, ("logits_dtype",)),
    ]
    if setup.target_hidden is None:
        mutations.append(Mutation("a soft loss without target_hidden", "loss_mask",
                                  args["loss_mask"] | _mask([draw.pick(list(SOFT))]),
                                  ("loss_mask", "target_hidden")))
        if setup.labels is None:
            mutations.append(Mutation("ce with neither labels nor target_hidden", "loss_mask", _mask(["ce"]),
                                      ("loss_mask", "labels", "target_hidden")))
    return mutations


def _tensor_mutations(draw: Draw, setup: Setup) -> list[Mutation]:
    """The forward's tensors: dtypes, devices, shapes (the names the schema gives them)."""
    hidden, weight = setup.hidden, setup.weight
    mutations = float_tensor_mutations(draw, "hidden", hidden) + float_tensor_mutations(draw, "weight", weight)
    mutations += [
        Mutation("1-D", "hidden", hidden[0] if hidden.shape[0] else hidden.reshape(-1), ("hidden",)),
        Mutation("3-D", "hidden", hidden.unsqueeze(0), ("hidden",)),
        Mutation("H off by one", "hidden", with_dim_resized(draw, hidden, 1), ("hidden", "weight")),
        Mutation("1-D", "weight", weight[0], ("weight",)),
        Mutation("no rows (V = 0)", "weight", weight[:0], ("weight",)),
    ]
    if setup.target_hidden is not None:
        mutations += [m for m in float_tensor_mutations(draw, "target_hidden", setup.target_hidden)
                      if m.label != "None for a tensor"]
        mutations.append(Mutation("rows off by one", "target_hidden", with_dim_resized(draw, setup.target_hidden, 0),
                                  ("target_hidden",)))
        other = weight if setup.target_weight is None else setup.target_weight
        mutations += [m for m in float_tensor_mutations(draw, "target_weight", other) if m.label != "None for a tensor"]
        mutations.append(Mutation("V off by one", "target_weight", with_dim_resized(draw, other, 0),
                                  ("target_weight",)))
    else:
        mutations.append(Mutation("without target_hidden", "target_weight", weight.detach().clone(),
                                  ("target_weight",)))
    labels = setup.labels if setup.labels is not None else draw.ids(hidden.shape[:1], setup.vocab)
    mutations += [
        Mutation("dtype int32", "labels", labels.clamp(0, 100).to(draw.pick([torch.int32, torch.float32])),
                 ("labels",)),
        Mutation("rows off by one", "labels", with_dim_resized(draw, labels, 0), ("labels",)),
        Mutation("on the meta device", "labels", labels.to("meta"), ("labels",)),
        Mutation("a list for a tensor", "labels", labels.tolist(), ("labels",)),
    ]
    if labels.numel():
        mutations.append(Mutation("an id out of range", "labels", _out_of_range_labels(draw, labels, setup.vocab),
                                  ("labels",)))
    return mutations


def op_mutations(draw: Draw, setup: Setup, args: dict) -> list[Mutation]:
    mutations = at_op_boundary(_tensor_mutations(draw, setup) + _scalar_mutations(draw, setup, args))
    return mutations + [_bool_refused("hidden_grad_planes")]


def _bool_refused(argument: str) -> Mutation:
    """A str for a bool: torch's dispatcher refuses it before the op runs (binding)."""
    return Mutation("a string for a bool", argument, "yes", (argument,), True)


BACKWARD_INPUTS = ("topk_ids", "topk_z", "label_ids", "label_z", "hidden_grads", "row_stats")


def draft_head_backward_op_case(draw: Draw) -> Case:
    """dflash2::draft_head_backward(grad_losses [L, N], grad_topk [N, K], grad_label [N],
    hidden, weight, target_hidden, target_weight, labels, topk_ids, topk_z, label_ids,
    label_z, hidden_grads, row_stats, loss_mask, top_k, logit_scale, softcap, logits_dtype,
    need_hidden, need_weight, tile_rows) -> (grad_hidden, grad_weight), judged as the
    gradients of sum_l g_l . loss_l + g_topk . topk_logits + g_label . label_logit; forward
    and backward on the same driver (the row statistics are the GPU driver's)."""
    setup = draw_setup(draw, flat=True, special=False)
    planes = draw.chance(0.6)
    forward_args = _op_args(setup, planes, _draw_tile_rows(draw, setup.rows))
    triton = draw_triton(draw, setup)
    with on_driver(triton):
        forward = dict(zip(OP_OUTPUTS, torch.ops.dflash2.draft_head(**forward_args)))
    rows, k, count = setup.rows, setup.top_k, len(setup.losses)
    grad_dtype = draw.pick([torch.float32, torch.float32, torch.float64, torch.bfloat16])
    grads = {"grad_losses": draw.layout(draw.randn((count, rows), grad_dtype)),
             "grad_topk": draw.layout(draw.randn((rows, k), grad_dtype)),
             "grad_label": draw.layout(draw.randn((rows,), grad_dtype))}
    need_hidden, need_weight = draw.pick([(True, False)] * 5 + [(True, True)] * 4 + [(False, True)] * 3
                                         + [(False, False)])
    args = {**grads, **{n: forward_args[n] for n in ("hidden", "weight", "target_hidden", "target_weight", "labels")},
            **{n: forward[n] for n in BACKWARD_INPUTS},
            **{n: forward_args[n] for n in ("loss_mask", "top_k", "logit_scale", "softcap", "logits_dtype")},
            "need_hidden": need_hidden, "need_weight": need_weight,
            "tile_rows": _draw_tile_rows(draw, rows)}
    call = Call(torch.ops.dflash2.draft_head_backward, args)
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, backward_mutations(draw, setup, args, forward))

    def run():
        with poisoned_empty(), on_driver(triton):
            return call()

    def judge(result) -> None:
        assert isinstance(result, (tuple, list)) and len(result) == 2, f"expected 2 gradients, got {result!r}"
        for name, needed, leaf, got in (("grad_hidden", need_hidden, setup.hidden, result[0]),
                                        ("grad_weight", need_weight, setup.weight, result[1])):
            shape = tuple(leaf.shape) if needed else (0,)
            assert tuple(got.shape) == shape and got.dtype == leaf.dtype, \
                f"{name}: {got.dtype} {tuple(got.shape)}, expected {leaf.dtype} {shape}"
        label_ids = forward["label_ids"]
        has_label = setup.labels is not None or setup.target_hidden is not None
        labels = _label_used(setup, label_ids if has_label else None)
        safe = torch.where(label_ids == IGNORE, 0, label_ids) if has_label else None
        names = _names_of(forward_args["loss_mask"])
        weights = ({name: grads["grad_losses"][i].double() for i, name in enumerate(names)},
                   grads["grad_topk"].double(), grads["grad_label"].double())
        wanted = {name: got for name, needed, got in (("hidden", need_hidden, result[0]),
                                                       ("weight", need_weight, result[1])) if needed}
        judge_grads(setup, wanted, forward["topk_ids"], labels, safe, weights)

    driver = ", triton" if triton else ""
    return Case(f"valid (planes={planes}, need_hidden={need_hidden}, need_weight={need_weight}{driver})", run,
                Agrees(judge), call.args)


def backward_mutations(draw: Draw, setup: Setup, args: dict, forward: dict) -> list[Mutation]:
    rows, k = setup.rows, setup.top_k
    mutations = _tensor_mutations(draw, setup) + _scalar_mutations(draw, setup, args)
    for name in ("grad_losses", "grad_topk", "grad_label"):
        tensor = args[name]
        # None is an upstream gradient nothing produced (autograd's, for an unused output): valid.
        mutations += [m for m in float_tensor_mutations(draw, name, tensor) if m.label != "None for a tensor"]
        mutations.append(Mutation("a dim off by one", name, with_dim_resized(draw, tensor, tensor.dim() - 1),
                                  (name,)))
        mutations.append(Mutation("an extra dim", name, with_extra_dim(draw, tensor), (name,)))
    ids_dtype = draw.pick([torch.int32, torch.float32, torch.int16])
    mutations += [
        Mutation("not int64", "topk_ids", args["topk_ids"].to(ids_dtype), ("topk_ids",)),
        Mutation("K off by one", "topk_ids", with_dim_resized(draw, args["topk_ids"], 1), ("topk_ids",)),
        Mutation("not int64", "label_ids", args["label_ids"].to(ids_dtype), ("label_ids",)),
        Mutation("rows off by one", "label_ids", with_dim_resized(draw, args["label_ids"], 0), ("label_ids",)),
        Mutation("not the compute dtype", "topk_z", args["topk_z"].to(draw.pick([torch.float16, torch.bfloat16])),
                 ("topk_z",)),
        Mutation("rows off by one", "label_z", with_dim_resized(draw, args["label_z"], 0), ("label_z",)),
        Mutation("not the compute dtype", "label_z", args["label_z"].to(torch.float16), ("label_z",)),
        Mutation("None for a tensor", "topk_ids", None, ("topk_ids",)),
    ]
    count = len(setup.losses)
    if count and rows:
        planes = torch.zeros((rows, count, setup.width + 1), dtype=setup.compute)
        mutations.append(Mutation("planes of the wrong width", "hidden_grads", planes, ("hidden_grads",)))
    mutations += [
        Mutation("not float64", "row_stats", args["row_stats"].float(), ("row_stats",)),
        Mutation("rows off by one", "row_stats", with_dim_resized(draw, args["row_stats"], 0), ("row_stats",)),
        Mutation("None for a tensor", "row_stats", None, ("row_stats",)),
    ]
    if rows and k:
        bad = args["topk_ids"].clone()
        bad[draw.integer(0, rows - 1), draw.integer(0, k - 1)] = draw.pick([setup.vocab, -1, 2**40])
        mutations.append(Mutation("an id out of range", "topk_ids", bad, ("topk_ids",)))
    return at_op_boundary(mutations) + [_bool_refused("need_hidden"), _bool_refused("need_weight")]


# --- the C++ row ops --------------------------------------------------------------------------------


@dataclass
class RowsSetup:
    logits: torch.Tensor  # raw s [R, V], float32 or float64
    target_logits: torch.Tensor | None
    labels: torch.Tensor | None
    losses: tuple[str, ...]
    top_k: int
    logit_scale: float
    softcap: float | None
    logits_dtype: torch.dtype
    kind: str


def _fresh(tensor):
    """A copy in the same memory layout (a row-strided slice stays row-strided)."""
    if tensor is None:
        return None
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    return copy.copy_(tensor)


def draw_rows(draw: Draw) -> RowsSetup:
    """Raw logits of a few rows: random (spread like a trained head's), ties (a handful of
    values: sure ties at any scale), or masked (-inf over some entries, never a whole row)."""
    rows = draw.size(0, MAX_ROWS, edges=(1, 2))
    vocab = draw.size(1, MAX_VOCAB, edges=VOCAB_EDGES)
    dtype = draw.pick([torch.float32, torch.float32, torch.float64])
    kind = draw.pick(["random", "random", "ties", "masked"])
    if kind == "ties":
        logits = torch.randint(-3, 4, (rows, vocab), generator=draw.torch).to(dtype) * 0.75
    else:
        logits = draw.randn((rows, vocab), dtype, draw.pick([1.0, 2.0, 4.0]))
    has_target = draw.chance(0.7)
    target = None
    if has_target:
        target = (logits.double() + draw.randn((rows, vocab), torch.float64, draw.pick([0.3, 1.0, 3.0]))).to(dtype)
    if kind == "masked" and vocab > 1:
        mask = torch.rand(rows, vocab, generator=draw.torch) < 0.3
        mask[:, draw.integer(0, vocab - 1)] = False
        logits = logits.masked_fill(mask, -math.inf)
        if target is not None:
            target = target.masked_fill(mask, -math.inf)  # q = 0 where p = 0: the losses stay finite
    has_labels = draw.chance(0.5)
    labels = draw.layout(draw_labels(draw, (rows,), vocab)) if has_labels else None
    layout = lambda t: draw.layout(t, unit_last_stride=True, expand=False)  # noqa: E731
    scale = float(draw.pick(SCALES))
    if kind == "masked":  # a negative scale would make -inf +inf: a row of NaN, no masking
        scale = abs(scale)
    return RowsSetup(layout(logits), None if target is None else layout(target), labels,
                     draw_losses(draw, has_target, has_labels), draw_top_k(draw, vocab), scale,
                     draw.pick(SOFTCAPS) if draw.chance(0.35) else None, draw.dtype(HEAD_FLOATS), kind)


def _rows_truth(setup: RowsSetup, label, *, grad: bool = False, losses: bool = True) -> dict:
    """The float64 formulas and the dense reference (the logits' dtype) on the raw logits:
    z, t, the losses (0 on ignored rows) and the leaves they differentiate to."""
    out = {}
    for name, cast in (("in_dtype", lambda x: x), ("exact", lambda x: x.double())):
        s = cast(setup.logits.detach())
        z = transform(s, setup.logit_scale, setup.softcap)
        t = None if setup.target_logits is None else \
            transform(cast(setup.target_logits.detach()), setup.logit_scale, setup.softcap)
        # The gradients from logits where -inf (masked, logit_scale > 0) is -1e30: the same
        # losses but ce at a masked label (exp gives 0 either way), and autograd's gradient
        # there is the limit's, 0, not 0 * (-inf - -inf) = NaN.
        leaf = torch.where(s == -math.inf, -1e30, s).requires_grad_(grad)
        finite_t = None if t is None else transform(
            torch.where(cast(setup.target_logits.detach()) == -math.inf, -1e30, cast(setup.target_logits.detach())),
            setup.logit_scale, setup.softcap)
        ignored = None if label is None else label == IGNORE
        safe = None if label is None else torch.where(ignored, 0, label)

        def row_losses(z, t):
            values = reference.draft_head_row_losses(z, t, safe, setup.losses) if losses else {}
            if ignored is not None:
                values = {n: torch.where(ignored, torch.zeros_like(v), v) for n, v in values.items()}
            return values

        out[name] = dict(s=leaf, z=z, t=t, losses=row_losses(z, t),
                         differentiable=row_losses(transform(leaf, setup.logit_scale, setup.softcap), finite_t))
    return out


def _rows_label(setup: RowsSetup, target_argmax) -> torch.Tensor | None:
    if setup.labels is not None:
        return setup.labels.contiguous()
    return target_argmax if setup.target_logits is not None else None


def _rows_bound(setup: RowsSetup, in_dtype, exact64) -> float:
    """0 where the transform is exact (a power-of-two scale, no softcap: z = scale * s in any
    float dtype), so that every tie is a sure one; else error_bound's."""
    if setup.softcap is None and math.frexp(abs(setup.logit_scale))[0] == 0.5:
        return 0.0
    return error_bound(in_dtype, exact64)


ROWS_OUTPUTS = ("losses", "stats", "argmax", "topk_ids", "topk_values", "target_at_topk", "label_values")


def _judge_rows(setup: RowsSetup, result, planes_given: bool) -> None:
    out, z_after, t_after, planes = result
    assert isinstance(out, (tuple, list)) and len(out) == 7, f"expected 7 outputs, got {out!r}"
    out = dict(zip(ROWS_OUTPUTS, out))
    rows, vocab = setup.logits.shape
    k, count, dtype = setup.top_k, len(setup.losses), setup.logits.dtype
    shapes = dict(losses=(count, rows), stats=(rows, 3), argmax=(rows, 2), topk_ids=(rows, k),
                  topk_values=(rows, k), target_at_topk=(rows, k), label_values=(rows,))
    for name, shape in shapes.items():
        want = torch.int64 if name in ("argmax", "topk_ids") else dtype
        assert tuple(out[name].shape) == shape and out[name].dtype == want, \
            f"{name}: {out[name].dtype} {tuple(out[name].shape)}, expected {want} {shape}"
    has_target = setup.target_logits is not None
    truth = _rows_truth(setup, None, losses=False)
    z_in, z64 = truth["in_dtype"]["z"].detach(), truth["exact"]["z"].detach()
    bound = _rows_bound(setup, z_in, z64)
    ids = out["topk_ids"]
    assert_a_top_k("topk_ids", ids, z64, bound, setup.logits_dtype)
    assert_a_top_k("draft argmax", out["argmax"][:, :1], z64, bound, setup.logits_dtype)
    if k:
        assert_equal("draft argmax (topk_ids[:, 0])", out["argmax"][:, 0], ids[:, 0])
    assert_contract("logits (transformed in place)", z_after, z_in, z64)
    if has_target:
        t_in, t64 = truth["in_dtype"]["t"], truth["exact"]["t"]
        assert_a_top_k("target argmax", out["argmax"][:, 1:], t64, _rows_bound(setup, t_in, t64), setup.logits_dtype)
        assert_contract("target_logits (transformed in place)", t_after, t_in, t64)
    else:
        for name, value in (("target_lse", out["stats"][:, 1]), ("overlap", out["stats"][:, 2]),
                            ("target argmax", out["argmax"][:, 1]), ("target_at_topk", out["target_at_topk"])):
            assert_equal(f"{name} (0 without a target)", value, torch.zeros_like(value))
    label = _rows_label(setup, out["argmax"][:, 1])
    truth = _rows_truth(setup, label, grad=planes_given)
    names = _names_of(_mask(setup.losses))
    for i, name in enumerate(names):
        assert_contract(f"losses[{name!r}]", out["losses"][i], truth["in_dtype"]["losses"][name],
                        truth["exact"]["losses"][name].detach())
    assert_contract("draft_lse", out["stats"][:, 0], torch.logsumexp(z_in, -1), torch.logsumexp(z64, -1))
    assert_contract("topk_values", out["topk_values"], z_in.gather(-1, ids), z64.gather(-1, ids))
    column = torch.zeros(rows, dtype=torch.int64) if label is None else torch.where(label == IGNORE, 0, label)
    assert_contract("label_values", out["label_values"], z_in.gather(-1, column[:, None])[:, 0],
                    z64.gather(-1, column[:, None])[:, 0])
    if has_target:
        t_in, t64 = truth["in_dtype"]["t"].detach(), truth["exact"]["t"]
        assert_contract("target_lse", out["stats"][:, 1], torch.logsumexp(t_in, -1), torch.logsumexp(t64, -1))
        overlap = lambda z, t: torch.minimum(torch.softmax(t, -1), torch.softmax(z, -1)).sum(-1)  # noqa: E731
        assert_contract("overlap", out["stats"][:, 2], overlap(z_in, t_in), overlap(z64, t64))
        assert_contract("target_at_topk", out["target_at_topk"], t_in.gather(-1, ids), t64.gather(-1, ids))
    if planes_given:
        for i, name in enumerate(names):
            grads = {}
            for side in ("in_dtype", "exact"):
                (grads[side],) = torch.autograd.grad(truth[side]["differentiable"][name].sum(), truth[side]["s"],
                                                     retain_graph=True, allow_unused=True, materialize_grads=True)
            assert_contract(f"loss_grads[{name!r}] (dL/ds)", planes[i], grads["in_dtype"], grads["exact"])


def _guarded(op, written):
    """The op, checked to raise before it writes: a bad call that fails must leave the
    tensors the op writes in place (``written``: their positions in the call) as they were."""

    def call(*args):
        before = {i: args[i].clone() for i in written
                  if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].device.type == "cpu"}
        try:
            return op(*args)
        except Exception as error:
            for i, saved in before.items():
                now = args[i]
                same = (now == saved) | (now.isnan() & saved.isnan()) if saved.is_floating_point() else now == saved
                if not bool(same.all()):
                    raise AssertionError(f"{type(error).__name__} raised after argument {i} was written "
                                         f"({error})") from error
            raise

    call.__name__ = getattr(op, "__name__", "op")
    return call


def _rows_tensor_mutations(draw: Draw, setup: RowsSetup, *, planes=None) -> list[Mutation]:
    logits, target, labels = setup.logits, setup.target_logits, setup.labels
    rows, vocab = logits.shape
    others = target is not None or labels is not None or planes is not None
    mutations = [m for m in float_tensor_mutations(draw, "logits", logits, accepted=(torch.float32, torch.float64))
                 if others or m.label != "on the meta device"]  # alone on meta: a shape computation
    mutations += [
        Mutation("1-D", "logits", logits.reshape(-1), ("logits",)),
        Mutation("3-D", "logits", logits.unsqueeze(0), ("logits",)),
        Mutation("an empty vocabulary", "logits", logits[:, :0], ("logits",)),
    ]
    if vocab > 1:
        wide = torch.zeros(rows, 2 * vocab, dtype=logits.dtype)
        wide[:, ::2] = logits
        mutations.append(Mutation("non-unit last stride", "logits", wide[:, ::2], ("logits",)))
    if target is not None:
        mutations += [m for m in float_tensor_mutations(draw, "target_logits", target,
                                                        accepted=(logits.dtype,)) if m.label != "None for a tensor"]
        mutations += [
            Mutation("rows off by one", "target_logits", with_dim_resized(draw, target, 0), ("target_logits",)),
            Mutation("V off by one", "target_logits", with_dim_resized(draw, target, 1), ("target_logits",)),
        ]
    if labels is not None:
        mutations += [
            Mutation("dtype int32", "labels", labels.to(draw.pick([torch.int32, torch.float32, torch.int16])),
                     ("labels",)),
            Mutation("rows off by one", "labels", with_dim_resized(draw, labels, 0), ("labels",)),
            Mutation("2-D", "labels", labels.unsqueeze(0), ("labels",)),
            Mutation("on the meta device", "labels", labels.to("meta"), ("labels",)),
            Mutation("a list for a tensor", "labels", labels.tolist(), ("labels",)),
        ]
        if labels.numel():
            mutations.append(Mutation("an id out of range", "labels", _out_of_range_labels(draw, labels, vocab),
                                      ("labels",)))
    return mutations


def _rows_scalar_mutations(draw: Draw, setup: RowsSetup, *, top_k: bool) -> list[Mutation]:
    mask = _mask(setup.losses)
    mutations = [
        Mutation("negative", "loss_mask", draw.pick([-1, -32]), ("loss_mask",)),
        Mutation("above 31", "loss_mask", draw.pick([32, 33, 2**40]), ("loss_mask",)),
        Mutation("float", "loss_mask", 1.0, ("loss_mask",)),
        Mutation("0", "logit_scale", 0.0, ("logit_scale",)),
        Mutation("NaN", "logit_scale", float("nan"), ("logit_scale",)),
        Mutation("inf", "logit_scale", draw.pick([math.inf, -math.inf]), ("logit_scale",)),
        Mutation("a string for a float", "logit_scale", "1", ("logit_scale",)),
        Mutation("negative", "softcap", draw.pick([-1.0, -1e-30]), ("softcap",)),
        Mutation("NaN", "softcap", float("nan"), ("softcap",)),
        Mutation("inf", "softcap", math.inf, ("softcap",)),
        Mutation("a dtype it cannot take", "logits_dtype", draw.pick(NOT_HEAD_DTYPES), ("logits_dtype",)),
        Mutation("None for a dtype", "logits_dtype", None, ("logits_dtype",)),
    ]
    if setup.target_logits is None:
        mutations.append(Mutation("a soft loss without target_logits", "loss_mask",
                                  mask | _mask([draw.pick(list(SOFT))]), ("loss_mask", "target_logits")))
        if setup.labels is None:
            mutations.append(Mutation("ce with neither labels nor target_logits", "loss_mask", _mask(["ce"]),
                                      ("loss_mask", "labels", "target_logits")))
    if top_k:
        mutations += [m for m in size_mutations(draw, "top_k", too_large=setup.logits.shape[1] + 1) if m.label != "0"]
    return mutations


def _loss_planes(draw: Draw, setup: RowsSetup) -> torch.Tensor:
    rows, vocab = setup.logits.shape
    planes = torch.full((len(setup.losses), rows, vocab + draw.pick([0, 0, 3])), 7.0, dtype=setup.logits.dtype)
    return planes[..., :vocab]


def draft_head_rows_cpu_case(draw: Draw) -> Case:
    """dflash2::draft_head_rows_cpu(logits [R, V] (raw in, transformed out), target_logits,
    labels, loss_mask, top_k, logit_scale, softcap, logits_dtype, loss_grads [L, R, V]?)."""
    setup = draw_rows(draw)
    planes = _loss_planes(draw, setup) if setup.losses and draw.chance(0.5) else None
    args = dict(logits=setup.logits, target_logits=setup.target_logits, labels=setup.labels,
                loss_mask=_mask(setup.losses), top_k=setup.top_k, logit_scale=setup.logit_scale,
                softcap=setup.softcap or 0.0, logits_dtype=setup.logits_dtype, loss_grads=planes)
    op = torch.ops.dflash2.draft_head_rows_cpu
    if draw.chance(BAD_FRACTION):
        mutations = _rows_tensor_mutations(draw, setup, planes=planes)
        mutations += _rows_scalar_mutations(draw, setup, top_k=True)
        if setup.target_logits is not None:
            mutations.append(Mutation("logits itself", "target_logits", setup.logits, ("target_logits",)))
        if planes is not None:
            mutations += [
                Mutation("a plane too few", "loss_grads", planes[1:], ("loss_grads",)),
                Mutation("V off by one", "loss_grads", with_dim_resized(draw, planes, 2), ("loss_grads",)),
                Mutation("the other float dtype", "loss_grads",
                         planes.to(torch.float64 if planes.dtype == torch.float32 else torch.float32),
                         ("loss_grads",)),
            ]
        elif setup.losses:
            mutations.append(Mutation("2-D", "loss_grads", torch.zeros(setup.logits.shape, dtype=setup.logits.dtype),
                                      ("loss_grads",)))
        broken = at_op_boundary(mutations)
        if setup.target_logits is None and setup.labels is None and planes is None:
            # logits is the op's only tensor: with None the dispatcher finds no kernel to call.
            broken = [Mutation(m.label, m.argument, m.value, m.names, True) if m.value is None and
                      m.argument == "logits" else m for m in broken]
        return bad_case(draw, Call(_guarded(op, (0, 1, 8)), args), broken)

    def run():
        logits, target, grads = _fresh(setup.logits), _fresh(setup.target_logits), _fresh(planes)
        out = op(logits, target, setup.labels, args["loss_mask"], setup.top_k, setup.logit_scale,
                 args["softcap"], setup.logits_dtype, grads)
        return out, logits, target, grads

    return Case(f"valid ({setup.kind}, planes={planes is not None})", run,
                Agrees(lambda result: _judge_rows(setup, result, planes is not None)), args)


def draft_head_rows_backward_cpu_case(draw: Draw) -> Case:
    """dflash2::draft_head_rows_backward_cpu(logits [R, V] (raw in, sum_l g_l dL_l/ds out),
    target_logits (transformed in place), labels, loss_mask, logit_scale, softcap,
    logits_dtype, grad_losses [L, R])."""
    setup = draw_rows(draw)
    rows = setup.logits.shape[0]
    grad_losses = draw.layout(draw.randn((len(setup.losses), rows), setup.logits.dtype))
    args = dict(logits=setup.logits, target_logits=setup.target_logits, labels=setup.labels,
                loss_mask=_mask(setup.losses), logit_scale=setup.logit_scale, softcap=setup.softcap or 0.0,
                logits_dtype=setup.logits_dtype, grad_losses=grad_losses)
    op = torch.ops.dflash2.draft_head_rows_backward_cpu
    if draw.chance(BAD_FRACTION):
        mutations = _rows_tensor_mutations(draw, setup, planes=grad_losses)
        mutations += _rows_scalar_mutations(draw, setup, top_k=False)
        mutations += [m for m in float_tensor_mutations(draw, "grad_losses", grad_losses,
                                                        accepted=(setup.logits.dtype,))]
        mutations += [
            Mutation("a loss too many", "grad_losses", with_dim_resized(draw, grad_losses, 0), ("grad_losses",)),
            Mutation("rows off by one", "grad_losses", with_dim_resized(draw, grad_losses, 1), ("grad_losses",)),
            Mutation("3-D", "grad_losses", grad_losses.unsqueeze(0), ("grad_losses",)),
        ]
        return bad_case(draw, Call(_guarded(op, (0, 1)), args), at_op_boundary(mutations))

    def run():
        logits, target = _fresh(setup.logits), _fresh(setup.target_logits)
        label = None
        if setup.labels is None and setup.target_logits is not None:
            # The target argmax the kernel takes for the label: the forward row op's (one row kernel).
            forward = torch.ops.dflash2.draft_head_rows_cpu(_fresh(setup.logits), _fresh(setup.target_logits), None,
                                                            0, 0, setup.logit_scale, args["softcap"],
                                                            setup.logits_dtype, None)
            label = forward[2][:, 1]
        returned = op(logits, target, setup.labels, args["loss_mask"], setup.logit_scale, args["softcap"],
                      setup.logits_dtype, grad_losses)
        return returned, logits, target, label

    def judge(result) -> None:
        returned, grad_s, t_after, target_argmax = result
        assert returned is None, f"expected None, got {returned!r}"
        truth = _rows_truth(setup, None, losses=False)
        if setup.target_logits is not None:
            t_in, t64 = truth["in_dtype"]["t"], truth["exact"]["t"]
            assert_contract("target_logits (transformed in place)", t_after, t_in, t64)
            if target_argmax is not None:
                assert_a_top_k("target argmax", target_argmax[:, None], t64, _rows_bound(setup, t_in, t64),
                               setup.logits_dtype)
        truth = _rows_truth(setup, _rows_label(setup, target_argmax), grad=True)
        names = _names_of(_mask(setup.losses))
        grads = {}
        for side in ("in_dtype", "exact"):
            losses, s = truth[side]["differentiable"], truth[side]["s"]
            terms = [(grad_losses[i].to(losses[name].dtype) * losses[name]).sum() for i, name in enumerate(names)]
            grads[side] = torch.autograd.grad(sum(terms), s, allow_unused=True, materialize_grads=True)[0] \
                if terms else torch.zeros_like(s)
        assert_contract("logits (sum_l grad_losses[l] dL_l/ds)", grad_s, grads["in_dtype"], grads["exact"])

    return Case(f"valid ({setup.kind})", run, Agrees(judge), args)


# --- the vocab-parallel shard ops -------------------------------------------------------------------


def _stats_setup(draw: Draw) -> RowsSetup:
    """A rank's raw logits (draw_rows), without labels or losses: the statistics pass takes neither."""
    setup = draw_rows(draw)
    setup.labels, setup.losses = None, ()
    return setup


def _judge_shard_stats(setup: RowsSetup, result) -> None:
    out, z_after, t_after = result
    assert isinstance(out, (tuple, list)) and len(out) == 4, f"expected 4 outputs, got {out!r}"
    stats, ids, values, target_argmax = out
    rows, vocab = setup.logits.shape
    k, dtype = setup.top_k, setup.logits.dtype
    for name, tensor, shape, want in (("stats", stats, (rows, 3), torch.float64), ("topk_ids", ids, (rows, k), torch.int64),
                                      ("topk_values", values, (rows, k), torch.float64),
                                      ("target_argmax", target_argmax, (rows,), torch.int64)):
        assert tuple(tensor.shape) == shape and tensor.dtype == want, \
            f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected {want} {shape}"
    truth = _rows_truth(setup, None, losses=False)
    z_in, z64 = truth["in_dtype"]["z"].detach(), truth["exact"]["z"].detach()
    assert_a_top_k("topk_ids", ids, z64, _rows_bound(setup, z_in, z64), setup.logits_dtype)
    assert_contract("logits (transformed in place)", z_after, z_in, z64)
    assert_contract("topk_values", values, z_in.gather(-1, ids).double(), z64.gather(-1, ids), compute_dtype=dtype)
    assert_contract("stats[:, 0] (the shard's lse of z)", stats[:, 0], torch.logsumexp(z_in, -1).double(),
                    torch.logsumexp(z64, -1), compute_dtype=dtype)
    if setup.target_logits is None:
        assert_equal("stats[:, 1:] (0 without a target)", stats[:, 1:], torch.zeros_like(stats[:, 1:]))
        assert_equal("target_argmax (0 without a target)", target_argmax, torch.zeros_like(target_argmax))
        return
    t_in, t64 = truth["in_dtype"]["t"].detach(), truth["exact"]["t"]
    assert_contract("target_logits (transformed in place)", t_after, t_in, t64)
    assert_a_top_k("target_argmax", target_argmax[:, None], t64, _rows_bound(setup, t_in, t64), setup.logits_dtype)
    assert_contract("stats[:, 1] (the shard's lse of t)", stats[:, 1], torch.logsumexp(t_in, -1).double(),
                    torch.logsumexp(t64, -1), compute_dtype=dtype)
    at = target_argmax[:, None]
    assert_contract("stats[:, 2] (t at the target argmax)", stats[:, 2], t_in.gather(-1, at)[:, 0].double(),
                    t64.gather(-1, at)[:, 0], compute_dtype=dtype)


def _stats_mutations(draw: Draw, setup: RowsSetup) -> list[Mutation]:
    taken = ("logits", "target_logits", "top_k", "logit_scale", "softcap", "logits_dtype")
    mutations = _rows_tensor_mutations(draw, setup) + _rows_scalar_mutations(draw, setup, top_k=True)
    mutations = [m for m in mutations if m.argument in taken and "loss_mask" not in m.names]
    if setup.target_logits is not None:
        mutations.append(Mutation("logits itself", "target_logits", setup.logits, ("target_logits",)))
    return at_op_boundary(mutations)


def draft_head_shard_stats_cpu_case(draw: Draw) -> Case:
    """dflash2::draft_head_shard_stats_cpu(logits [R, V] (raw in, transformed out),
    target_logits, top_k, logit_scale, softcap, logits_dtype) -> (stats [R, 3] float64,
    topk_ids [R, k], topk_values [R, k] float64, target_argmax [R])."""
    setup = _stats_setup(draw)
    args = dict(logits=setup.logits, target_logits=setup.target_logits, top_k=setup.top_k,
                logit_scale=setup.logit_scale, softcap=setup.softcap or 0.0, logits_dtype=setup.logits_dtype)
    op = torch.ops.dflash2.draft_head_shard_stats_cpu
    if draw.chance(BAD_FRACTION):
        broken = _stats_mutations(draw, setup)
        if setup.target_logits is None:  # logits alone: with None the dispatcher finds no kernel to call
            broken = [Mutation(m.label, m.argument, m.value, m.names, True) if m.value is None and
                      m.argument == "logits" else m for m in broken]
        return bad_case(draw, Call(_guarded(op, (0, 1)), args), broken)

    def run():
        logits, target = _fresh(setup.logits), _fresh(setup.target_logits)
        return op(logits, target, setup.top_k, setup.logit_scale, args["softcap"], setup.logits_dtype), logits, target

    return Case(f"valid ({setup.kind})", run, Agrees(lambda result: _judge_shard_stats(setup, result)), args)


@dataclass
class ShardSetup:
    rows: RowsSetup  # this shard's raw logits (its columns first in the whole row)
    other: torch.Tensor  # [R, W] raw logits of the other shards
    other_target: torch.Tensor | None
    labels: torch.Tensor  # [R] global ids in [0, V + W), -100 ignored
    local: torch.Tensor  # [R] as the op takes them: the id here, -1 elsewhere, -100 kept


def draw_shard(draw: Draw) -> ShardSetup:
    """A shard of a row (draw_rows) and the rest of the row (up to 9 entries) beside it."""
    setup = draw_rows(draw)
    rows, vocab = setup.logits.shape
    dtype = setup.logits.dtype
    width = draw.size(0, 9, edges=(0, 1))
    other = draw.randn((rows, width), dtype, draw.pick([1.0, 3.0]))
    other_target = None
    if setup.target_logits is not None:
        other_target = (other.double() + draw.randn((rows, width), torch.float64, 1.0)).to(dtype)
    labels = draw_labels(draw, (rows,), vocab + width)
    local = torch.where((labels >= vocab), torch.full_like(labels, -1), labels)
    setup.labels = draw.layout(local)
    setup.losses = draw_losses(draw, setup.target_logits is not None, True)
    return ShardSetup(setup, other, other_target, labels, local)


_SHARE_COLUMNS = ("kl_div", "rkl", "jsd", "overlap", "jsd_q", "tv_q")


def _shard_truth(shard: ShardSetup, grad: bool) -> dict:
    """The whole row's normalisers and row sums in float64 (row_stats), and per side
    (in_dtype: the dense reference in the logits' dtype; exact: float64) this shard's shares
    of the sums and the whole row's losses differentiable w.r.t. this shard's raw logits."""
    setup = shard.rows
    vocab = setup.logits.shape[1]
    safe = torch.where(shard.labels == IGNORE, 0, shard.labels)
    ignored = shard.labels == IGNORE
    out = {}
    for name, cast in (("in_dtype", lambda x: x), ("exact", lambda x: x.double())):
        s = cast(setup.logits.detach())
        leaf = torch.where(s == -math.inf, -1e30, s).requires_grad_(grad)
        z = transform(torch.cat([leaf, cast(shard.other)], 1), setup.logit_scale, setup.softcap)
        z_masked = transform(torch.cat([s, cast(shard.other)], 1), setup.logit_scale, setup.softcap)
        t = finite_t = None
        if setup.target_logits is not None:
            raw_t = torch.cat([cast(setup.target_logits.detach()), cast(shard.other_target)], 1)
            t = transform(raw_t, setup.logit_scale, setup.softcap)
            # As _rows_truth: -inf (masked) as -1e30 where gradients are taken, their limit.
            finite_t = transform(torch.where(raw_t == -math.inf, -1e30, raw_t), setup.logit_scale, setup.softcap)
        losses = reference.draft_head_row_losses(z, finite_t, safe, setup.losses)
        losses = {n: torch.where(ignored, torch.zeros_like(v), v) for n, v in losses.items()}
        shares = {n: torch.zeros(z.shape[0], dtype=z.dtype) for n in _SHARE_COLUMNS}
        if t is not None:
            log_q, log_p = torch.log_softmax(z_masked, -1), torch.log_softmax(t, -1)
            q, p = log_q.exp(), log_p.exp()
            log_m = torch.logaddexp(log_q, log_p) - math.log(2.0)
            zero = lambda w, x: torch.where(w == 0, torch.zeros_like(x), w * x)  # noqa: E731
            terms = {"kl_div": zero(p, log_p - log_q), "rkl": zero(q, log_q - log_p),
                     "jsd": 0.5 * zero(p, log_p - log_m) + zero(q, 0.5 * (log_q - log_m)),
                     "overlap": torch.minimum(p, q), "jsd_q": zero(q, 0.5 * (log_q - log_m)),
                     "tv_q": zero(q, torch.where(q < p, -1.0, torch.where(q == p, -0.5, 0.0)).to(q.dtype))}
            shares = {n: term[:, :vocab].sum(-1) for n, term in terms.items()}
            for n in ("kl_div", "rkl", "jsd", "jsd_q", "tv_q"):  # an ignored row's sums: its overlap alone
                shares[n] = torch.where(ignored, torch.zeros_like(shares[n]), shares[n])
            if name == "exact":
                whole = {n: term.sum(-1) for n, term in terms.items()}
                row_stats = [z_masked.max(-1).values, torch.logsumexp(z_masked, -1), t.max(-1).values,
                             torch.logsumexp(t, -1), whole["rkl"], whole["jsd_q"], whole["tv_q"]]
        elif name == "exact":
            zeros = torch.zeros(z.shape[0], dtype=torch.float64)
            row_stats = [z_masked.max(-1).values, torch.logsumexp(z_masked, -1), zeros, zeros, zeros, zeros, zeros]
        out[name] = dict(s=leaf, z=z_masked[:, :vocab].detach(), losses=losses, shares=shares)
    out["row_stats"] = torch.stack([v.detach() for v in row_stats], 1)
    return out


def draft_head_shard_rows_cpu_case(draw: Draw) -> Case:
    """dflash2::draft_head_shard_rows_cpu(logits [R, V] (z, or raw s with transform),
    target_logits, labels [R] (local: -1 elsewhere), loss_mask, logit_scale, softcap,
    row_stats [R, 7] float64 (the whole row's), transform, shares, loss_grads [L, R, V]?,
    grad_losses [L, R]?) -> shares [R, 6] float64 (or [0, 6])."""
    shard = draw_shard(draw)
    setup = shard.rows
    rows, vocab = setup.logits.shape
    dtype = setup.logits.dtype
    mask = _mask(setup.losses)
    needs_sums = bool(mask & _mask(("rkl", "jsd", "tv")))
    mode = draw.pick(["shares", "planes", "backward", "shares+planes"])
    if mode == "shares+planes" and needs_sums:
        mode = "planes"
    shares, transform_first = "shares" in mode, mode == "backward" or draw.chance(0.3)
    planes = _loss_planes(draw, setup) if "planes" in mode else None
    grad_losses = draw.layout(draw.randn((len(setup.losses), rows), dtype)) if mode == "backward" else None
    truth = _shard_truth(shard, grad=planes is not None or grad_losses is not None)
    row_stats = truth["row_stats"]
    z_given = setup.logits if transform_first else truth["in_dtype"]["z"].to(dtype)
    t_given = setup.target_logits
    if t_given is not None and not transform_first:
        t_given = transform(setup.target_logits.detach(), setup.logit_scale, setup.softcap)
    args = dict(logits=z_given, target_logits=t_given, labels=setup.labels, loss_mask=mask,
                logit_scale=setup.logit_scale, softcap=setup.softcap or 0.0, row_stats=row_stats,
                transform=transform_first, shares=shares, loss_grads=planes, grad_losses=grad_losses)
    op = torch.ops.dflash2.draft_head_shard_rows_cpu
    if draw.chance(BAD_FRACTION):
        taken = tuple(args)
        mutations = [m for m in _rows_tensor_mutations(draw, setup, planes=planes)
                     + _rows_scalar_mutations(draw, setup, top_k=False) if m.argument in taken]
        mutations = [m for m in mutations if not (m.argument == "labels" and m.label == "an id out of range")]
        if rows:
            bad = setup.labels.contiguous().clone()
            bad[draw.integer(0, rows - 1)] = draw.pick([vocab, vocab + 1, -2, -101, -99, 2**40])
            mutations.append(Mutation("an id out of range", "labels", bad, ("labels",)))
        mutations += [m for m in float_tensor_mutations(draw, "row_stats", row_stats, accepted=(torch.float64,))]
        mutations += [
            Mutation("a column too few", "row_stats", row_stats[:, :6], ("row_stats",)),
            Mutation("rows off by one", "row_stats", with_dim_resized(draw, row_stats, 0), ("row_stats",)),
            Mutation("None for labels", "labels", None, ("labels",)),
        ]
        if planes is not None:
            mutations.append(Mutation("both gradient forms", "grad_losses",
                                      torch.zeros((len(setup.losses), rows), dtype=dtype),
                                      ("grad_losses", "loss_grads")))
            mutations.append(Mutation("a plane too few", "loss_grads", planes[1:], ("loss_grads",)))
            if needs_sums:
                mutations.append(Mutation("shares with planes needing the merged sums", "shares", True,
                                          ("shares", "loss_grads")))
        if grad_losses is not None:
            mutations.append(Mutation("rows off by one", "grad_losses", with_dim_resized(draw, grad_losses, 1),
                                      ("grad_losses",)))
        return bad_case(draw, Call(_guarded(op, (0, 1, 9)), args), at_op_boundary(mutations))

    def run():
        logits, target, grads = _fresh(z_given), _fresh(t_given), _fresh(planes)
        out = op(logits, target, setup.labels, mask, setup.logit_scale, args["softcap"], row_stats, transform_first,
                 shares, grads, grad_losses)
        return out, logits, grads

    def judge(result) -> None:
        out, logits_after, grads = result
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and \
            tuple(out.shape) == ((rows if shares else 0), 6), f"shares: {out!r}"
        # The sums the op computes: the requested losses' (and those their gradients subtract),
        # the overlap; the others are 0.
        computed = {"overlap", *setup.losses, *(["jsd_q"] if "jsd" in setup.losses else []),
                    *(["tv_q"] if "tv" in setup.losses else [])}
        for column, name in enumerate(_SHARE_COLUMNS):
            if not shares:
                continue
            if setup.target_logits is None or name not in computed:
                assert_equal(f"shares[:, {column}] ({name}, not computed)", out[:, column],
                             torch.zeros_like(out[:, column]))
            else:
                assert_contract(f"shares[:, {column}] ({name})", out[:, column],
                                truth["in_dtype"]["shares"][name].detach().double(),
                                truth["exact"]["shares"][name].detach(), compute_dtype=dtype)
        names = _names_of(mask)
        wanted = {}
        for side in ("in_dtype", "exact"):
            losses, s = truth[side]["losses"], truth[side]["s"]
            if planes is not None:
                wanted[side] = [torch.autograd.grad(losses[n].sum(), s, retain_graph=True, allow_unused=True,
                                                    materialize_grads=True)[0] for n in names]
            elif grad_losses is not None:
                terms = [(grad_losses[i].to(losses[n].dtype) * losses[n]).sum() for i, n in enumerate(names)]
                wanted[side] = torch.autograd.grad(sum(terms), s, allow_unused=True, materialize_grads=True)[0] \
                    if terms else torch.zeros_like(s)
        if planes is not None:
            for i, name in enumerate(names):
                assert_contract(f"loss_grads[{name!r}] (dL/ds)", grads[i], wanted["in_dtype"][i],
                                wanted["exact"][i])
        elif grad_losses is not None:
            assert_contract("logits (sum_l grad_losses[l] dL_l/ds)", logits_after, wanted["in_dtype"],
                            wanted["exact"])
        elif transform_first:
            assert_contract("logits (transformed in place)", logits_after, truth["in_dtype"]["z"],
                            truth["exact"]["z"])

    return Case(f"valid ({setup.kind}, {mode}, transform={transform_first})", run, Agrees(judge), args)
