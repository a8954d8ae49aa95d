"""Fuzz cases for the candidate selector's scores (SPEC section 2): score_candidates,
pair_scores, transition_scores, the CandidateSelector module's training methods, and
the raw ops ``selector_scores`` and ``selector_scores_backward``.

Valid results (and every gradient) are judged against ``dk.reference`` in the input
dtype and in float64. k = 0 candidates and rank 0 codebooks are valid: the reference
gives an empty result, and U gathered plus an empty sum, respectively.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from ..host_blas import pinned_outputs
from .case import Agrees, Call, Case
from .draw import FLOATS, Draw
from .judges import assert_all_contract, assert_contract, assert_equal, compute_dtype, float64, with_grads
from .mutations import (
    Mutation,
    at_op_boundary,
    bad_case,
    dtype_argument_mutations,
    float_tensor_mutations,
    id_tensor_mutations,
    size_mutations,
    with_dim_dropped,
    with_dim_resized,
    with_extra_dim,
)

BAD_FRACTION = 0.5
SPECIAL_LOGITS = (float("-inf"), float("inf"), float("nan"))
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


@dataclass(frozen=True)
class SelectorShape:
    lead: tuple[int, ...]
    vocab: int
    rank: int
    top_k: int
    unary_dtype: torch.dtype
    projected_dtype: torch.dtype
    codebook_dtype: torch.dtype


def draw_shape(draw: Draw, *, lead=None, projected_dtypes=None) -> SelectorShape:
    """Vocabularies from 1, ranks and k from 0 (rare), repeated ids (k > V), mixed dtypes.

    projected_dtypes(codebook_dtype) -> the dtypes P may take (default: any float).
    """
    if lead is None:
        lead = draw.lead_dims(3, 48)
    vocab = draw.size(1, 300, edges=(2, 7))
    rank = 0 if draw.chance(0.04) else draw.size(1, 300, edges=(16, 256))
    top_k = 0 if draw.chance(0.04) else draw.size(1, 40, edges=(16, 32, 33))
    codebook_dtype = draw.dtype(FLOATS)
    options = projected_dtypes(codebook_dtype) if projected_dtypes else FLOATS
    projected_dtype = codebook_dtype if draw.chance(0.6) and codebook_dtype in options else draw.pick(options)
    return SelectorShape(tuple(lead), vocab, rank, top_k, draw.dtype(FLOATS), projected_dtype, codebook_dtype)


def draw_tensors(draw: Draw, shape: SelectorShape, *, unit_last_stride=False, gathered=False,
                 id_dtypes=(torch.int64,)) -> dict:
    """unary [..., V] (or [..., k] gathered), projected [..., r], codebooks [V, r], ids."""
    width = shape.top_k if gathered else shape.vocab
    unary = draw.randn((*shape.lead, width), shape.unary_dtype)
    if draw.chance(0.15):  # masked logits (-inf), overflowed ones, NaN
        unary = draw.sprinkle(unary, SPECIAL_LOGITS, draw.pick([0.02, 0.3]))
    projected = draw.randn((*shape.lead, shape.rank), shape.projected_dtype)
    codebooks = [draw.randn((shape.vocab, shape.rank), shape.codebook_dtype, 0.5) for _ in range(2)]
    if draw.chance(0.05):  # NaN propagates through any order of operations
        which = draw.integer(0, 2)
        if which < 2:
            codebooks[which] = draw.sprinkle(codebooks[which], (float("nan"),), 0.02)
        else:
            projected = draw.sprinkle(projected, (float("nan"),), 0.02)
    id_dtype = draw.pick([d for d in id_dtypes if shape.vocab <= torch.iinfo(d).max + 1])
    layout = lambda t: draw.layout(t, unit_last_stride=unit_last_stride)  # noqa: E731
    return {
        "unary": layout(unary),
        "projected": layout(projected),
        "predecessor_codebook": layout(codebooks[0]),
        "successor_codebook": layout(codebooks[1]),
        "predecessor_ids": layout(draw.ids(shape.lead, shape.vocab).to(id_dtype)),
        "candidate_ids": layout(draw.ids((*shape.lead, shape.top_k), shape.vocab).to(id_dtype)),
    }


def _grad_mode(draw: Draw) -> str:
    """Which inputs need gradients: all, all but the unary scores (dU not formed), or none."""
    return draw.pick(["all", "all", "no unary", "none"])


def _leaves(tensors: dict, float_names, mode: str) -> tuple[dict, dict]:
    leaves = {n: tensors[n] for n in float_names if mode == "all" or (mode == "no unary" and "unary" not in n)}
    others = {n: tensors[n] for n in tensors if n not in leaves}
    return leaves, others


def _promoted_pair_scores(projected, unary, predecessor_codebook, successor_codebook, candidate_ids,
                          predecessor_ids):
    """NeMo's pair_scores with P and the codebooks promoted to one dtype first: its einsum
    refuses mixed dtypes (reference.selector_pair_scores raises there)."""
    common = torch.promote_types(projected.dtype, predecessor_codebook.dtype)
    return reference.selector_pair_scores(projected.to(common), unary, predecessor_codebook.to(common),
                                          successor_codebook.to(common), candidate_ids, predecessor_ids)


# --- the functional forms ------------------------------------------------------------------

# name -> (public function, reference, its unary argument's name or None, gathered unary?)
FUNCTIONS = {
    "score_candidates": (dk.score_candidates, reference.selector_score_candidates, "unary_logits", False),
    "pair_scores": (dk.pair_scores, _promoted_pair_scores, "unary", True),
    "transition_scores": (dk.transition_scores, reference.selector_transition_scores, None, False),
}
PARAMETERS = {
    "score_candidates": ("unary_logits", "projected", *CODEBOOKS, "predecessor_ids", "candidate_ids"),
    "pair_scores": ("projected", "unary", *CODEBOOKS, "candidate_ids", "predecessor_ids"),
    "transition_scores": ("projected", *CODEBOOKS, "predecessor_ids", "candidate_ids"),
}


def score_candidates_case(draw: Draw) -> Case:
    return functional_case(draw, "score_candidates")


def pair_scores_case(draw: Draw) -> Case:
    return functional_case(draw, "pair_scores")


def transition_scores_case(draw: Draw) -> Case:
    return functional_case(draw, "transition_scores")


def functional_case(draw: Draw, name: str) -> Case:
    fn, ref, unary_name, gathered = FUNCTIONS[name]
    shape = draw_shape(draw)
    drawn = draw_tensors(draw, shape, gathered=gathered,
                         id_dtypes=(torch.int64, torch.int64, torch.int32, torch.int16, torch.uint8))
    if unary_name:
        drawn[unary_name] = drawn.pop("unary")
    tensors = {parameter: drawn[parameter] for parameter in PARAMETERS[name]}
    call = Call(fn, dict(tensors))
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, functional_mutations(draw, shape, tensors, unary_name, gathered))
    floats = [n for n, t in tensors.items() if t.is_floating_point()]
    mode = _grad_mode(draw)
    leaves, others = _leaves(tensors, floats, mode)
    out_dtype = _out_dtype(name, tensors)
    grad = draw.randn((*shape.lead, shape.top_k), out_dtype)

    def run():
        return with_grads(fn, leaves, others, grad)

    def judge(result) -> None:
        in_dtype = with_grads(ref, leaves, others, grad)
        exact = with_grads(ref, {n: float64(t) for n, t in leaves.items()},
                           {n: float64(t) for n, t in others.items()}, grad.double())
        assert_all_contract(result, in_dtype, exact)

    return Case(f"valid (gradients: {mode})", run, Agrees(judge), {**tensors, "grad": grad})


def _out_dtype(name: str, tensors: dict) -> torch.dtype:
    codebook = tensors["predecessor_codebook"].dtype
    if name == "score_candidates":
        return tensors["unary_logits"].dtype
    if name == "transition_scores":
        return codebook
    return torch.promote_types(tensors["unary"].dtype, torch.promote_types(codebook, tensors["projected"].dtype))


def functional_mutations(draw: Draw, shape: SelectorShape, tensors: dict, unary_name, gathered) -> list[Mutation]:
    mutations = []
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            mutations += float_tensor_mutations(draw, name, tensor)
        else:
            mutations += id_tensor_mutations(draw, name, tensor, shape.vocab)
    other_float = draw.pick([d for d in FLOATS if d != shape.codebook_dtype])
    mutations += [
        Mutation("rank off by one", "projected", with_dim_resized(draw, tensors["projected"], -1), ("projected",)),
        Mutation("1-D", "predecessor_codebook", tensors["predecessor_codebook"][0], ("predecessor_codebook",)),
        Mutation("rows off by one", "successor_codebook", with_dim_resized(draw, tensors["successor_codebook"], 0),
                 ("successor_codebook",)),
        Mutation("rank off by one", "predecessor_codebook",
                 with_dim_resized(draw, tensors["predecessor_codebook"], 1), CODEBOOKS),
        Mutation("the other codebook's dtype differs", "successor_codebook",
                 tensors["successor_codebook"].to(other_float), CODEBOOKS),
        Mutation("an extra dim", "predecessor_ids", with_extra_dim(draw, tensors["predecessor_ids"]),
                 ("predecessor_ids", "projected")),
        Mutation("a dim dropped", "candidate_ids",
                 with_dim_dropped(draw, tensors["candidate_ids"], tensors["candidate_ids"].dim() - 1),
                 ("candidate_ids",)),
    ]
    if unary_name:
        width = "k" if gathered else "vocabulary"
        mutations += [
            Mutation(f"{width} off by one", unary_name, with_dim_resized(draw, tensors[unary_name], -1),
                     (unary_name,)),
            Mutation("an extra dim", unary_name, with_extra_dim(draw, tensors[unary_name]), (unary_name,)),
        ]
    return mutations


# --- the module ------------------------------------------------------------------------

METHODS = ("context", "transition_scores", "score_candidates", "select", "pair_scores", "forward")


def module_case(draw: Draw) -> Case:
    """A CandidateSelector with drawn parameters; one training method on drawn inputs."""
    dtype = draw.pick([torch.float32, torch.float32, torch.bfloat16, torch.float64])
    shape = draw_shape(draw, lead=draw.lead_dims(3, 32), projected_dtypes=lambda _: (dtype,))
    vocab, rank = shape.vocab, max(shape.rank, 1)
    top_k = draw.integer(1, vocab)
    hidden_size = draw.size(1, 96)
    sizes = dict(vocab_size=vocab, hidden_size=hidden_size, rank=rank, top_k=top_k)
    params = {
        "predecessor_codebook": draw.randn((vocab, rank), dtype, 0.5),
        "successor_codebook": draw.randn((vocab, rank), dtype, 0.5),
        "hidden_projection.weight": draw.randn((rank, hidden_size), dtype, 0.3),
    }
    hidden = draw.layout(draw.randn((*shape.lead, hidden_size), dtype))
    unary = draw.layout(draw.randn((*shape.lead, vocab), shape.unary_dtype))
    predecessor_ids = draw.layout(draw.ids(shape.lead, vocab))
    k = draw.size(0, 24, edges=(1,))
    candidate_ids = draw.layout(draw.ids((*shape.lead, k), vocab))
    method = draw.pick(METHODS)
    select_top_k = draw.pick([None, None, draw.integer(1, vocab), 0])  # 0 selects nothing: an empty result
    arguments = _method_arguments(method, hidden, unary, predecessor_ids, candidate_ids, select_top_k)

    def build(vocab_size, hidden_size, rank, top_k):
        module = dk.CandidateSelector(vocab_size, hidden_size, rank, top_k).to(dtype)
        module.load_state_dict(params)
        return module

    def call_method(vocab_size, hidden_size, rank, top_k, **arguments):
        return _call_method(build(vocab_size, hidden_size, rank, top_k), method, arguments)

    call = Call(call_method, {**sizes, **arguments}, keywords=tuple(arguments))
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, module_mutations(draw, method, sizes, arguments))

    def run():
        # The module's own P = W h too: the judge scores from it, so that the projection's
        # rounding (nn.Linear's business, not the kernels') is not held against the result.
        module = build(**sizes)
        with pinned_outputs(module.hidden_projection) as projections:
            result = _call_method(module, method, arguments)
        assert len(projections) == 1, f"{method} projected {len(projections)} inputs, not one"
        return result, projections[0].detach()

    judge = _module_judge(method, arguments, params, top_k if select_top_k is None else select_top_k)
    return Case(f"valid {method}", run, Agrees(judge), {**call.args, "dtype": dtype})


def _call_method(module, method: str, arguments: dict):
    if "select_top_k" in arguments:  # select's own top_k, keyed apart from the constructor's
        arguments = {**arguments, "top_k": arguments["select_top_k"]}
        del arguments["select_top_k"]
    return getattr(module, method)(**arguments)


def _method_arguments(method, hidden, unary, predecessor_ids, candidate_ids, select_top_k) -> dict:
    if method == "context":
        return dict(hidden_states=hidden, predecessor_ids=predecessor_ids)
    if method == "transition_scores":
        return dict(hidden_states=hidden, predecessor_ids=predecessor_ids, candidate_ids=candidate_ids)
    if method in ("score_candidates", "forward"):
        return dict(unary_logits=unary, hidden_states=hidden, predecessor_ids=predecessor_ids,
                    candidate_ids=candidate_ids)
    if method == "select":  # its top_k is not the constructor's: keyed apart, passed as top_k
        return dict(unary_logits=unary, hidden_states=hidden, predecessor_ids=predecessor_ids,
                    select_top_k=select_top_k)
    gathered = unary.gather(-1, candidate_ids)
    return dict(hidden=hidden, unary=gathered, candidate_ids=candidate_ids, predecessor_ids=predecessor_ids)


def _module_judge(method, arguments, params, select_top_k):
    """The method's result against the reference given the module's P, in the input
    dtypes and in float64 (as the functional forms are judged)."""
    a, b = params["predecessor_codebook"], params["successor_codebook"]

    def expected(projected, as_float64: bool):
        cast = float64 if as_float64 else (lambda t: t)
        p, pa, pb = cast(projected), cast(a), cast(b)
        if method == "context":
            return reference.selector_context(pa, p, arguments["predecessor_ids"])
        if method == "transition_scores":
            return reference.selector_transition_scores(p, pa, pb, arguments["predecessor_ids"],
                                                        arguments["candidate_ids"])
        if method == "pair_scores":
            return _promoted_pair_scores(p, cast(arguments["unary"]), pa, pb, arguments["candidate_ids"],
                                         arguments["predecessor_ids"])
        unary = cast(arguments["unary_logits"])
        candidates = arguments.get("candidate_ids")
        if method == "select":
            candidates = arguments["unary_logits"].topk(select_top_k, dim=-1).indices
        return reference.selector_score_candidates(unary, p, pa, pb, arguments["predecessor_ids"], candidates)

    def judge(outcome) -> None:
        result, projected = outcome
        if method == "select":
            ids, scores = result
            assert_equal("select's candidate ids (torch.topk's)", ids,
                         arguments["unary_logits"].topk(select_top_k, dim=-1).indices)
            result = scores
        with torch.no_grad():
            in_dtype, exact = expected(projected, False), expected(projected, True)
        assert_contract(method, result.detach(), in_dtype, exact, compute_dtype=compute_dtype(
            arguments.get("unary_logits", arguments.get("unary")), projected, a))

    return judge


def module_mutations(draw: Draw, method: str, sizes: dict, arguments: dict) -> list[Mutation]:
    mutations = []
    for name in sizes:
        mutations += size_mutations(draw, name, too_large=sizes["vocab_size"] + 1 if name == "top_k" else None)
    hidden_name = "hidden" if method == "pair_scores" else "hidden_states"
    hidden = arguments[hidden_name]
    mutations += float_tensor_mutations(draw, hidden_name, hidden)
    mutations.append(Mutation("hidden width off by one", hidden_name, with_dim_resized(draw, hidden, -1),
                              (hidden_name, "hidden_size")))
    for name in ("predecessor_ids", "candidate_ids"):
        if name in arguments:
            mutations += id_tensor_mutations(draw, name, arguments[name], sizes["vocab_size"])
    if method == "select":  # 0 selects nothing and None means the module's: both valid
        mutations += [Mutation(m.label, "select_top_k", m.value, ("top_k",))
                      for m in size_mutations(draw, "top_k", too_large=sizes["vocab_size"] + 1)
                      if m.label not in ("0", "None for an int")]
    return mutations


# --- the raw ops ---------------------------------------------------------------------------


def _raw_shape(draw: Draw) -> SelectorShape:
    shape = draw_shape(draw, lead=(draw.size(0, 64, edges=(1,)),),
                       projected_dtypes=lambda codebook: (codebook, torch.float32))
    return shape


def _raw_operand_mutations(draw: Draw, shape: SelectorShape, tensors: dict) -> list[Mutation]:
    """Bad operands of selector_scores / selector_scores_backward (schema names)."""
    mutations = []
    accepted_projected = {shape.codebook_dtype, torch.float32}
    for name in ("projected", *CODEBOOKS):
        accepted = accepted_projected if name == "projected" else FLOATS
        mutations += float_tensor_mutations(draw, name, tensors[name], accepted=accepted,
                                            partners=CODEBOOKS if name != "projected" else ())
    for name in ("predecessor_ids", "candidate_ids"):
        mutations += id_tensor_mutations(draw, name, tensors[name], shape.vocab, accepted=(torch.int64,))
    mutations += [
        Mutation("1-D", "projected", tensors["projected"].reshape(-1), ("projected",)),
        Mutation("rows off by one", "predecessor_ids", with_dim_resized(draw, tensors["predecessor_ids"], 0),
                 ("predecessor_ids",)),
        Mutation("rows off by one", "candidate_ids", with_dim_resized(draw, tensors["candidate_ids"], 0),
                 ("candidate_ids",)),
        Mutation("no rows", "predecessor_codebook", tensors["predecessor_codebook"][:0],
                 ("predecessor_codebook", "successor_codebook")),
        Mutation("rank off by one", "successor_codebook", with_dim_resized(draw, tensors["successor_codebook"], 1),
                 ("successor_codebook",)),
    ]
    for name in ("projected", *CODEBOOKS):
        if tensors[name].shape[-1] > 1:
            mutations.append(Mutation("non-unit last stride", name, _last_strided(tensors[name]), (name,)))
    return mutations


def _last_strided(tensor: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    wide[..., ::2] = tensor
    return wide[..., ::2]


def _speculators_scores(unary, projected, a, b, predecessor_ids, candidate_ids, unary_gathered):
    """The reference of the raw op: U (gathered here unless it came gathered) + T cast to U's dtype."""
    transition = reference.selector_transition_scores(projected, a, b, predecessor_ids, candidate_ids)
    gathered = unary if unary_gathered else unary.gather(-1, candidate_ids)
    return gathered + transition.to(gathered.dtype)


def selector_scores_op_case(draw: Draw) -> Case:
    """dflash2::selector_scores(unary, projected, predecessor_codebook, successor_codebook,
    predecessor_ids, candidate_ids, unary_gathered, out_dtype) -> [N, k]."""
    shape = _raw_shape(draw)
    unary_gathered = draw.chance(0.5)
    tensors = draw_tensors(draw, shape, unit_last_stride=True, gathered=unary_gathered)
    out_dtype = shape.unary_dtype if draw.chance(0.6) else draw.dtype(FLOATS)
    call = Call(torch.ops.dflash2.selector_scores, {**tensors, "unary_gathered": unary_gathered,
                                                    "out_dtype": out_dtype})
    if draw.chance(BAD_FRACTION):
        mutations = _raw_operand_mutations(draw, shape, tensors)
        mutations += float_tensor_mutations(draw, "unary", tensors["unary"])
        mutations += dtype_argument_mutations(draw, "out_dtype", FLOATS)
        mutations += [
            Mutation("width off by one", "unary", with_dim_resized(draw, tensors["unary"], -1), ("unary",)),
            Mutation("the other unary layout", "unary_gathered", not unary_gathered, ("unary", "unary_gathered"))
            if shape.top_k != shape.vocab else
            Mutation("rows off by one", "unary", with_dim_resized(draw, tensors["unary"], 0), ("unary",)),
        ]
        if tensors["unary"].shape[-1] > 1:
            mutations.append(Mutation("non-unit last stride", "unary", _last_strided(tensors["unary"]), ("unary",)))
        return bad_case(draw, call, at_op_boundary(mutations))

    def judge(result) -> None:
        operands = [tensors[n] for n in ("unary", "projected", *CODEBOOKS, "predecessor_ids", "candidate_ids")]
        in_dtype = _speculators_scores(*operands, unary_gathered).to(out_dtype)
        exact = _speculators_scores(*map(float64, operands), unary_gathered)
        assert_contract("scores", result, in_dtype, exact, compute_dtype=compute_dtype(*operands[:4]))

    return Case(f"valid (unary_gathered={unary_gathered})", call, Agrees(judge), call.args)


def selector_scores_backward_op_case(draw: Draw) -> Case:
    """dflash2::selector_scores_backward(grad_scores, projected, predecessor_codebook,
    successor_codebook, predecessor_ids, candidate_ids, unary_gathered, unary_width,
    unary_dtype) -> (dU [N, unary_width] unary_dtype, dP, dA, dB)."""
    shape = _raw_shape(draw)
    unary_gathered = draw.chance(0.5)
    tensors = draw_tensors(draw, shape, unit_last_stride=True, gathered=unary_gathered)
    unary = tensors.pop("unary")
    width = unary.shape[-1]
    grad = draw.layout(draw.randn((*shape.lead, shape.top_k), draw.dtype(FLOATS)), unit_last_stride=True)
    call = Call(torch.ops.dflash2.selector_scores_backward,
                {"grad_scores": grad, **tensors, "unary_gathered": unary_gathered, "unary_width": width,
                 "unary_dtype": shape.unary_dtype})
    if draw.chance(BAD_FRACTION):
        mutations = _raw_operand_mutations(draw, shape, tensors)
        mutations += float_tensor_mutations(draw, "grad_scores", grad)
        mutations += dtype_argument_mutations(draw, "unary_dtype", FLOATS)
        mutations += size_mutations(draw, "unary_width", too_large=width + 1)
        mutations += [
            Mutation("k off by one", "grad_scores", with_dim_resized(draw, grad, -1), ("grad_scores",)),
            Mutation("rows off by one", "grad_scores", with_dim_resized(draw, grad, 0), ("grad_scores",)),
        ]
        if width > 1:
            mutations.append(Mutation("one less than its width", "unary_width", width - 1, ("unary_width",)))
        return bad_case(draw, call, at_op_boundary(mutations))

    leaves = {"unary": unary, **{n: tensors[n] for n in ("projected", *CODEBOOKS)}}
    ids = {n: tensors[n] for n in ("predecessor_ids", "candidate_ids")}

    def scores(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids, candidate_ids):
        return _speculators_scores(unary, projected, predecessor_codebook, successor_codebook, predecessor_ids,
                                   candidate_ids, unary_gathered)

    def judge(result) -> None:
        assert isinstance(result, (tuple, list)) and len(result) == 4, f"expected 4 gradients, got {result!r}"
        in_dtype = with_grads(scores, leaves, ids, grad)
        exact = with_grads(scores, {n: float64(t) for n, t in leaves.items()}, ids, grad.double())
        got = dict(zip(("dunary", "dprojected", "dpredecessor_codebook", "dsuccessor_codebook"), result))
        exact.pop("out")
        assert_all_contract(got, in_dtype, exact)

    return Case(f"valid (unary_gathered={unary_gathered})", call, Agrees(judge), call.args)
