"""Fuzz cases for the serving path (SPEC sections 2 and 3): candidate_topk, edge_scores,
walk, the module's edge_scores/walk, rejection_sample, greedy_verify, and the raw ops
``candidate_topk``, ``select_path`` and ``rejection_sample``.

Judged against ``dk.reference``: top-k values equal torch.topk's exactly (ids may order
ties either way, so they are checked by what they index); edges within the SPEC section
4 contract over the kernel's own candidates; greedy paths exactly the reference walk over
the kernel's edges; sampled paths draw by draw from the same uniforms; verification
exactly the reference's accepted counts and bonus tokens.

The public functions take every k in [1, V] and float64 (k > 32 and float64 run the
reference), so their valid cases draw those too; the raw ops keep the kernels' limits
(k <= 32; float16, bfloat16, float32), and their cases still draw beyond them as bad.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import dflash2_kernels as dk
from dflash2_kernels import reference

from ..host_blas import pinned_outputs
from ..serving_cases import assert_sampled_walk_follows_its_edges, distinct_top_logits, walk_over_edges
from .case import Agrees, Call, Case
from .draw import FLOATS, Draw
from .draw import SERVING_FLOATS as KERNEL_FLOATS
from .judges import assert_contract, assert_equal, float64
from .mutations import (
    Mutation,
    at_op_boundary,
    bad_case,
    dtype_argument_mutations,
    float_tensor_mutations,
    id_tensor_mutations,
    size_mutations,
    temperature_mutations,
    with_dim_dropped,
    with_dim_resized,
)

BAD_FRACTION = 0.5
MAX_TOP_K = 32  # the raw ops' limit (one warp lane per candidate); the public functions take any k <= V
WIDE_TOP_K = 96  # the largest k > 32 a drafted block draws ([B, D, k, k] edges stay small)
CODEBOOKS = ("predecessor_codebook", "successor_codebook")
TEMPERATURES = (0.05, 0.3, 1.0, 2.5)


def generator_mutations() -> list[Mutation]:
    return [Mutation("not a generator", "generator", 123, ("generator",)),
            Mutation("a device, not a generator", "generator", torch.device("cpu"), ("generator",))]


def floats(raw: bool) -> tuple:
    """The float dtypes an argument takes: the kernels' for a raw op, float64 too for the public functions."""
    return KERNEL_FLOATS if raw else FLOATS


def draw_top_k(draw: Draw, vocab: int, *, raw: bool, wide_limit: int | None = None) -> int:
    """k in [1, V]: for a raw op at most 32; for the public functions past 32 a third of
    the time (33, 48, 64, up to wide_limit, or k = V when V is that small)."""
    if raw or vocab <= MAX_TOP_K or not draw.chance(1 / 3):
        return draw.integer(1, min(vocab, MAX_TOP_K))
    limit = min(vocab, wide_limit or vocab)
    return min(limit, draw.pick([MAX_TOP_K + 1, 48, 64, draw.integer(MAX_TOP_K + 1, limit), limit]))


def draw_logits(draw: Draw, lead: tuple, vocab: int, top_k: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """distinct: the top 2k values distinct in any dtype (a unique top-k and walk); ties:
    a handful of values; masked: -inf over a third; special: -inf, +inf and NaN sprinkled."""
    if kind == "distinct":
        return distinct_top_logits(lead, vocab, top_k, dtype, draw.torch)
    if kind == "ties":
        return torch.randint(-2, 3, (*lead, vocab), generator=draw.torch).to(dtype)
    logits = draw.randn((*lead, vocab), dtype)
    if kind == "random":
        return logits
    if kind == "masked":
        return draw.sprinkle(logits, (float("-inf"),), 0.3)
    return draw.sprinkle(logits, (float("-inf"), float("inf"), float("nan")), draw.pick([0.01, 0.2]))


# --- top-k -------------------------------------------------------------------------------


def topk_judge(logits: torch.Tensor, top_k: int):
    def judge(result) -> None:
        assert isinstance(result, (tuple, list)) and len(result) == 2, f"expected (values, ids), got {result!r}"
        values, ids = result
        assert_equal("values (torch.topk's)", values, torch.topk(logits, top_k, dim=-1).values)
        assert ids.dtype == torch.int64 and ids.shape == values.shape, f"ids: {ids.dtype} {tuple(ids.shape)}"
        assert ((ids >= 0) & (ids < logits.shape[-1])).all(), "an id outside [0, V)"
        assert_equal("logits at the ids", logits.gather(-1, ids), values)
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "a row repeats an id"

    return judge


def _topk_mutations(draw: Draw, logits: torch.Tensor, top_k: int, *, raw: bool) -> list[Mutation]:
    vocab = logits.shape[-1]
    # logits is the only tensor: on 'meta' it is a shape computation, not a device mix-up.
    mutations = [m for m in float_tensor_mutations(draw, "logits", logits, accepted=floats(raw))
                 if m.label != "on the meta device"]
    mutations += size_mutations(draw, "top_k", too_large=(min(vocab, MAX_TOP_K) if raw else vocab) + 1)
    # With no vocabulary no top_k is in range: a message about either is right.
    mutations.append(Mutation("an empty vocabulary", "logits", logits[..., :0], ("logits", "top_k")))
    return mutations


def candidate_topk_case(draw: Draw) -> Case:
    """dk.candidate_topk(logits [..., V], top_k) -> (values, ids) [..., k]."""
    vocab = draw.size(1, 5000, edges=(2, 32, 33, 1024, 1025))
    top_k = draw_top_k(draw, vocab, raw=False)
    kind = draw.pick(["random", "ties", "masked", "special"])
    logits = draw.layout(draw_logits(draw, draw.lead_dims(3, 24), vocab, top_k, draw.dtype(FLOATS), kind))
    call = Call(dk.candidate_topk, dict(logits=logits, top_k=top_k))
    if draw.chance(BAD_FRACTION):
        mutations = _topk_mutations(draw, logits, top_k, raw=False)
        mutations.append(Mutation("no dims", "logits", logits.reshape(-1)[0] if logits.numel() else
                                  torch.tensor(0.0, dtype=logits.dtype), ("logits",)))
        return bad_case(draw, call, mutations)
    return Case(f"valid ({kind})", call, Agrees(topk_judge(logits, top_k)), call.args)


def candidate_topk_op_case(draw: Draw) -> Case:
    """dflash2::candidate_topk(logits [R, V], top_k) -> (values, ids) [R, k]."""
    vocab = draw.size(1, 5000, edges=(2, 32, 33, 1024, 1025))
    top_k = draw.integer(1, min(vocab, MAX_TOP_K))
    kind = draw.pick(["random", "ties", "masked", "special"])
    rows = draw.size(0, 24, edges=(1,))
    logits = draw.layout(draw_logits(draw, (rows,), vocab, top_k, draw.dtype(KERNEL_FLOATS), kind))
    call = Call(torch.ops.dflash2.candidate_topk, dict(logits=logits, top_k=top_k))
    if draw.chance(BAD_FRACTION):
        mutations = _topk_mutations(draw, logits, top_k, raw=True)
        mutations.append(Mutation("3-D", "logits", logits.unsqueeze(0), ("logits",)))
        mutations = at_op_boundary(mutations)
        # logits is the op's only tensor: with None the dispatcher finds no kernel to call.
        mutations = [Mutation(m.label, m.argument, m.value, m.names, True) if m.value is None else m
                     for m in mutations]
        return bad_case(draw, call, mutations)
    return Case(f"valid ({kind})", call, Agrees(topk_judge(logits, top_k)), call.args)


# --- one drafted block: edge scores and the walk -------------------------------------------


@dataclass(frozen=True)
class BlockShape:
    batch: int
    draft: int
    vocab: int
    rank: int
    top_k: int


def draw_block(draw: Draw, *, raw: bool = False, projected_dtypes=None,
               kinds=("distinct", "distinct", "ties", "masked", "special"),
               hidden_size: int | None = None) -> tuple[BlockShape, str, dict]:
    """(sizes, logits kind, {projected [B, D, r], logits [B, D, V], anchor_ids [B], codebooks [V, r]}).

    raw: within the raw op's limits (k <= 32, no float64); else k up to V (at most
    WIDE_TOP_K) and float64 among the dtypes. hidden_size: draw hidden [B, D, H]
    instead of projected (for the module).
    """
    vocab = draw.size(1, 2000, edges=(2, 33, 64))
    shape = BlockShape(draw.size(1, 4), draw.size(1, 8), vocab, 0 if draw.chance(0.04) else draw.size(1, 140,
                       edges=(128, 129)), draw_top_k(draw, vocab, raw=raw, wide_limit=WIDE_TOP_K))
    kind = draw.pick(list(kinds))
    codebook_dtype = draw.dtype(floats(raw))
    options = projected_dtypes(codebook_dtype) if projected_dtypes else floats(raw)
    projected_dtype = codebook_dtype if draw.chance(0.6) and codebook_dtype in options else draw.pick(list(options))
    logits = draw_logits(draw, (shape.batch, shape.draft), vocab, shape.top_k, draw.dtype(floats(raw)), kind)
    tensors = {
        "projected": draw.randn((shape.batch, shape.draft, hidden_size or shape.rank), projected_dtype),
        "logits": logits,
        "anchor_ids": draw.ids((shape.batch,), vocab),
        "predecessor_codebook": draw.randn((vocab, shape.rank), codebook_dtype, 0.5),
        "successor_codebook": draw.randn((vocab, shape.rank), codebook_dtype, 0.5),
    }
    return shape, kind, {name: draw.layout(t, expand=name != "logits") for name, t in tensors.items()}


@contextlib.contextmanager
def reference_candidates(candidate_ids: torch.Tensor):
    """Make the reference score the given candidates: its torch.topk orders ties its own
    way, and the kernel's edges are judged over the kernel's candidates."""
    original = reference.candidate_topk
    reference.candidate_topk = lambda logits, top_k: (logits.gather(-1, candidate_ids), candidate_ids)
    try:
        yield
    finally:
        reference.candidate_topk = original


def reference_edges(tensors: dict, top_k: int, candidate_ids: torch.Tensor, score_dtype=None):
    """(edges in the input dtypes rounded to the score dtype, edges in float64) over given candidates."""
    order = ("projected", "logits", "anchor_ids", *CODEBOOKS)
    args = [tensors[n] for n in order]
    with reference_candidates(candidate_ids):
        in_dtype, _ = reference.serving_edge_scores(*args, top_k)
        exact, _ = reference.serving_edge_scores(*map(float64, args), top_k)
    if score_dtype is None:
        score_dtype = reference.serving_score_dtype(tensors["logits"], tensors["projected"],
                                                    tensors["predecessor_codebook"])
    return in_dtype.to(score_dtype), exact


def assert_valid_candidates(candidate_ids, logits: torch.Tensor, top_k: int, kind: str) -> None:
    """The candidates are a top-k of each position's logits; with distinct top logits,
    exactly the reference's."""
    assert_equal("candidates' logits (torch.topk's values)", logits.gather(-1, candidate_ids),
                 torch.topk(logits, top_k, dim=-1).values)
    assert (candidate_ids.sort(-1).values.diff(dim=-1) > 0).all(), "a position repeats a candidate"
    if kind == "distinct":
        assert_equal("candidate_ids (the reference's)", candidate_ids, reference.candidate_topk(logits, top_k)[1])


def assert_edges(edges, candidate_ids, tensors: dict, shape: BlockShape, kind: str, score_dtype=None) -> None:
    assert_valid_candidates(candidate_ids, tensors["logits"], shape.top_k, kind)
    in_dtype, exact = reference_edges(tensors, shape.top_k, candidate_ids, score_dtype)
    assert_contract("edges", edges, in_dtype, exact)


def _block_mutations(draw: Draw, shape: BlockShape, tensors: dict, *, raw: bool = False) -> list[Mutation]:
    """Bad arguments of one drafted block (the public names are the schema's)."""
    mutations = []
    for name in ("projected", "logits", *CODEBOOKS):
        accepted = floats(raw)
        if raw and name == "projected":
            accepted = {tensors["predecessor_codebook"].dtype, torch.float32}
        mutations += float_tensor_mutations(draw, name, tensors[name], accepted=accepted,
                                            partners=CODEBOOKS if name in CODEBOOKS else ())
    mutations += id_tensor_mutations(draw, "anchor_ids", tensors["anchor_ids"], shape.vocab,
                                     accepted=(torch.int64,) if raw else None)
    mutations += size_mutations(draw, "top_k", too_large=(min(shape.vocab, MAX_TOP_K) if raw else shape.vocab) + 1)
    logits, projected = tensors["logits"], tensors["projected"]
    mutations += [
        Mutation("2-D", "logits", logits[0], ("logits",)),
        Mutation("vocabulary off by one", "logits", with_dim_resized(draw, logits, 2),
                 ("logits", "predecessor_codebook")),
        Mutation("an empty batch", "logits", logits[:0], ("logits", "projected", "anchor_ids")),
        Mutation("rank off by one", "projected", with_dim_resized(draw, projected, 2), ("projected",)),
        Mutation("draft length off by one", "projected", with_dim_resized(draw, projected, 1), ("projected",)),
        Mutation("batch off by one", "anchor_ids", with_dim_resized(draw, tensors["anchor_ids"], 0),
                 ("anchor_ids",)),
        Mutation("rows off by one", "successor_codebook", with_dim_resized(draw, tensors["successor_codebook"], 0),
                 ("successor_codebook",)),
        Mutation("the other codebook's dtype differs", "successor_codebook",
                 tensors["successor_codebook"].to(draw.pick([d for d in floats(raw)
                                                             if d != tensors["predecessor_codebook"].dtype])),
                 CODEBOOKS),
    ]
    return mutations


def edge_scores_case(draw: Draw) -> Case:
    """dk.edge_scores(projected, logits, anchor_ids, codebooks, top_k) -> (edges [B, D, k, k], candidates)."""
    shape, kind, tensors = draw_block(draw)
    call = Call(dk.edge_scores, {**tensors, "top_k": shape.top_k})
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, _block_mutations(draw, shape, tensors))

    def judge(result) -> None:
        edges, candidate_ids = result
        assert_edges(edges, candidate_ids, tensors, shape, kind)

    return Case(f"valid ({kind} logits)", call, Agrees(judge), call.args)


def _seeded_uniforms(seed_or_generator, shape: tuple) -> torch.Tensor:
    """The uniforms a walk or verification drew: the same generator state, the same torch.rand."""
    if isinstance(seed_or_generator, torch.Generator):
        return torch.rand(shape, generator=seed_or_generator, dtype=torch.float32)
    torch.manual_seed(seed_or_generator)
    return torch.rand(shape, dtype=torch.float32)


def _random_source(draw: Draw):
    """(a generator's seed, or None to draw from the global generator seeded with seed) and the seed."""
    seed = draw.integer(0, 2**31)
    return (seed if draw.chance(0.7) else None), seed


def _make_generator(generator_seed):
    return None if generator_seed is None else torch.Generator().manual_seed(generator_seed)


def walk_case(draw: Draw) -> Case:
    """dk.walk(projected, logits, anchor_ids, codebooks, top_k, temperature, *, generator)."""
    sampled = draw.chance(0.5)
    kinds = ("distinct", "ties") if sampled else ("distinct", "distinct", "ties", "masked", "special")
    shape, kind, tensors = draw_block(draw, kinds=kinds)
    temperature = draw.pick(TEMPERATURES) if sampled else draw.pick([0.0, 0])
    generator_seed, seed = _random_source(draw)
    call = Call(dk.walk, {**tensors, "top_k": shape.top_k, "temperature": temperature,
                          "generator": _make_generator(generator_seed)}, keywords=("generator",))
    if draw.chance(BAD_FRACTION):
        mutations = _block_mutations(draw, shape, tensors) + temperature_mutations(draw) + generator_mutations()
        return bad_case(draw, call, mutations)

    def run():
        generator = _make_generator(generator_seed)
        if generator is None:
            torch.manual_seed(seed)
        walked = dk.walk(**tensors, top_k=shape.top_k, temperature=temperature, generator=generator)
        return walked, dk.edge_scores(**tensors, top_k=shape.top_k)

    def judge(result) -> None:
        (path, candidate_ids, draft_probs), (edges, edge_candidates) = result
        assert_equal("walk's candidates (edge_scores')", candidate_ids, edge_candidates)
        assert_edges(edges, candidate_ids, tensors, shape, kind)
        if not sampled:
            assert draft_probs is None, "a greedy walk returned draft_probs"
            assert_equal("greedy path (the reference walk over the edges)", path,
                         walk_over_edges(edges, candidate_ids))
            return
        source = _make_generator(generator_seed) if generator_seed is not None else seed
        uniforms = _seeded_uniforms(source, (shape.batch, shape.draft))
        assert draft_probs is not None and draft_probs.dtype == torch.float32, "draft_probs: float32 expected"
        assert_sampled_walk_follows_its_edges(path, candidate_ids, draft_probs, edges, uniforms, temperature)

    return Case(f"valid ({'sampled' if sampled else 'greedy'}, {kind} logits)", run, Agrees(judge), call.args)


def select_path_op_case(draw: Draw) -> Case:
    """dflash2::select_path(logits, projected, predecessor_codebook, successor_codebook,
    anchor_ids, uniforms, top_k, temperature, score_dtype) -> (path, candidates, q, edges)."""
    sampled = draw.chance(0.5)
    kinds = ("distinct", "ties") if sampled else ("distinct", "distinct", "ties", "masked", "special")
    shape, kind, tensors = draw_block(draw, raw=True, kinds=kinds, projected_dtypes=lambda c: (c, torch.float32))
    temperature = draw.pick(TEMPERATURES) if sampled else 0.0
    uniforms = (draw.layout(torch.rand((shape.batch, shape.draft), generator=draw.torch)) if sampled
                else torch.empty(0))
    score_dtype = (reference.serving_score_dtype(tensors["logits"], tensors["projected"],
                                                 tensors["predecessor_codebook"])
                   if draw.chance(0.7) else draw.dtype(KERNEL_FLOATS))
    call = Call(torch.ops.dflash2.select_path,
                dict(logits=tensors["logits"], projected=tensors["projected"],
                     predecessor_codebook=tensors["predecessor_codebook"],
                     successor_codebook=tensors["successor_codebook"], anchor_ids=tensors["anchor_ids"],
                     uniforms=uniforms, top_k=shape.top_k, temperature=temperature, score_dtype=score_dtype))
    if draw.chance(BAD_FRACTION):
        mutations = _block_mutations(draw, shape, tensors, raw=True)
        mutations += temperature_mutations(draw)
        mutations += dtype_argument_mutations(draw, "score_dtype", KERNEL_FLOATS)
        if sampled:
            mutations += float_tensor_mutations(draw, "uniforms", uniforms, accepted=(torch.float32,))
            mutations.append(Mutation("draft length off by one", "uniforms", with_dim_resized(draw, uniforms, 1),
                                      ("uniforms",)))
        return bad_case(draw, call, at_op_boundary(mutations))

    def judge(result) -> None:
        path, candidate_ids, draft_probs, edges = result
        assert_edges(edges, candidate_ids, tensors, shape, kind, score_dtype)
        if sampled:
            assert_sampled_walk_follows_its_edges(path, candidate_ids, draft_probs, edges, uniforms, temperature)
            return
        assert_equal("greedy path (the reference walk over the edges)", path, walk_over_edges(edges, candidate_ids))
        assert_equal("greedy draft_probs (one-hot of the choice)", draft_probs,
                     (candidate_ids == path.unsqueeze(-1)).float())

    return Case(f"valid ({'sampled' if sampled else 'greedy'}, {kind} logits)", call, Agrees(judge), call.args)


def selector_serving_case(draw: Draw) -> Case:
    """CandidateSelector.edge_scores(hidden, logits, anchor_ids) / .walk(hidden, logits,
    anchor_ids, temperature, *, generator) on drawn parameters, judged like the functional
    forms with P = hidden_projection(hidden)."""
    dtype = draw.pick([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float64])
    hidden_size = draw.size(1, 64)
    sampled = draw.chance(0.4)
    kinds = ("distinct", "ties") if sampled else ("distinct", "distinct", "ties", "masked", "special")
    shape, kind, tensors = draw_block(draw, kinds=kinds, projected_dtypes=lambda _: (dtype,),
                                      hidden_size=hidden_size)
    shape = BlockShape(shape.batch, shape.draft, shape.vocab, max(shape.rank, 1), shape.top_k)
    hidden = tensors.pop("projected")
    params = {
        "predecessor_codebook": draw.randn((shape.vocab, shape.rank), dtype, 0.5),
        "successor_codebook": draw.randn((shape.vocab, shape.rank), dtype, 0.5),
        "hidden_projection.weight": draw.randn((shape.rank, hidden_size), dtype, 0.3),
    }
    method = draw.pick(["edge_scores", "walk"])
    temperature = draw.pick(TEMPERATURES) if sampled else 0.0
    generator_seed = draw.integer(0, 2**31)
    sizes = dict(vocab_size=shape.vocab, hidden_size=hidden_size, rank=shape.rank, top_k=shape.top_k)
    arguments = dict(hidden=hidden, logits=tensors["logits"], anchor_ids=tensors["anchor_ids"])
    if method == "walk":
        arguments.update(temperature=temperature, generator=torch.Generator().manual_seed(generator_seed))

    def build(vocab_size, hidden_size, rank, top_k):
        module = dk.CandidateSelector(vocab_size, hidden_size, rank, top_k).to(dtype)
        module.load_state_dict(params)
        return module

    def call_method(vocab_size, hidden_size, rank, top_k, **arguments):
        with torch.no_grad():
            return getattr(build(vocab_size, hidden_size, rank, top_k), method)(**arguments)

    call = Call(call_method, {**sizes, **arguments}, keywords=tuple(arguments))
    if draw.chance(BAD_FRACTION):
        mutations = float_tensor_mutations(draw, "hidden", hidden)
        mutations += [Mutation("hidden width off by one", "hidden", with_dim_resized(draw, hidden, -1),
                               ("hidden", "hidden_size"))]
        mutations += id_tensor_mutations(draw, "anchor_ids", tensors["anchor_ids"], shape.vocab)
        mutations += [Mutation("vocabulary off by one", "logits", with_dim_resized(draw, tensors["logits"], 2),
                               ("logits", "predecessor_codebook", "vocab_size"))]
        if method == "walk":
            mutations += temperature_mutations(draw) + generator_mutations()
        return bad_case(draw, call, mutations)

    def run():
        with torch.no_grad():
            module = build(**sizes)
            fresh = dict(arguments)
            if method == "walk":
                fresh["generator"] = torch.Generator().manual_seed(generator_seed)
            # The walk's edges: the module's own, so its greedy path can be replayed over them;
            # its P = W h, one for both calls: the judge scores from it (the projection's
            # rounding is nn.Linear's, and a second call of it need not round alike).
            with pinned_outputs(module.hidden_projection) as projections:
                return (getattr(module, method)(**fresh),
                        module.edge_scores(hidden, tensors["logits"], tensors["anchor_ids"]),
                        projections[0])

    def judge(result) -> None:
        got, (edges, candidate_ids), projected = result
        functional = dict(projected=projected, logits=tensors["logits"], anchor_ids=tensors["anchor_ids"],
                          predecessor_codebook=params["predecessor_codebook"],
                          successor_codebook=params["successor_codebook"])
        assert_edges(edges, candidate_ids, functional, shape, kind)
        if method == "edge_scores":
            assert_equal("edge_scores' edges (a second call's)", got[0], edges)
            assert_equal("edge_scores' candidates (a second call's)", got[1], candidate_ids)
            return
        path, walk_candidates, draft_probs = got
        assert_equal("walk's candidates (edge_scores')", walk_candidates, candidate_ids)
        if not sampled:
            assert draft_probs is None, "a greedy walk returned draft_probs"
            assert_equal("greedy path (the reference walk over the edges)", path,
                         walk_over_edges(edges, candidate_ids))
            return
        uniforms = _seeded_uniforms(torch.Generator().manual_seed(generator_seed), (shape.batch, shape.draft))
        assert_sampled_walk_follows_its_edges(path, candidate_ids, draft_probs, edges, uniforms, temperature)

    return Case(f"valid {method} ({'sampled' if sampled else 'greedy'}, {kind} logits)", run, Agrees(judge),
                {**call.args, "dtype": dtype})


# --- verification ----------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyShape:
    batch: int
    draft: int
    vocab: int
    top_k: int


def draw_verification(draw: Draw, *, raw: bool) -> tuple[VerifyShape, str, dict]:
    """(sizes, proposal kind, {draft_tokens [B, D], target_probs [B, D+1, V], draft_probs
    [B, D, k], candidate_ids [B, D, k]}).

    random: q unrelated to p; close: candidates p's top k, q p renormalised on them;
    covering: p is q / 2 on the candidates and 0 elsewhere (unnormalised: empty residual);
    onehot: a greedy draft; stray: draft tokens outside the candidates (q(d) = 0).
    """
    vocab = draw.size(1, 5000, edges=(2, 4096, 4097))
    shape = VerifyShape(draw.size(1, 16), draw.size(1, 8), vocab, draw.integer(1, min(vocab, draw.pick([40, 100]))))
    b, d, v, k = shape.batch, shape.draft, shape.vocab, shape.top_k
    kind = draw.pick(["random", "close", "covering", "onehot", "stray"])
    sharpness = 8.0 if kind == "close" else 3.0
    target = torch.softmax(torch.randn(b, d + 1, v, generator=draw.torch, dtype=torch.float64) * sharpness, -1)
    candidates = torch.stack([torch.randperm(v, generator=draw.torch)[:k] for _ in range(b * d)]).view(b, d, k)
    if kind == "close":
        candidates = target[:, :d].topk(k, dim=-1).indices
    if kind == "onehot":
        proposal = torch.zeros(b, d, k, dtype=torch.float64)
        proposal[..., 0] = 1.0
    elif kind in ("close", "covering"):
        on_candidates = target[:, :d].gather(-1, candidates)
        proposal = on_candidates / on_candidates.sum(-1, keepdim=True).clamp_min(1e-300)
        if kind == "covering":
            target[:, :d] = 0
            target[:, :d].scatter_(-1, candidates, proposal / 2)
    else:
        proposal = torch.softmax(torch.randn(b, d, k, generator=draw.torch, dtype=torch.float64) * 2, -1)
    drawn = torch.multinomial(proposal.view(-1, k).float(), 1, generator=draw.torch).view(b, d, 1)
    tokens = candidates.gather(-1, drawn).squeeze(-1)
    if kind == "stray":
        tokens = draw.ids((b, d), v)
    id_dtype = torch.int64 if raw else draw.pick([torch.int64, torch.int64, torch.int32])
    tensors = {
        "draft_tokens": tokens.to(id_dtype),
        "target_probs": target.to(draw.dtype(floats(raw))),
        "draft_probs": proposal.to(torch.float32 if raw else draw.dtype(FLOATS)),
        "candidate_ids": candidates.to(id_dtype),
    }
    return shape, kind, {name: draw.layout(t) for name, t in tensors.items()}


def _verify_mutations(draw: Draw, shape: VerifyShape, tensors: dict, *, raw: bool) -> list[Mutation]:
    mutations = []
    ids = (torch.int64,) if raw else None
    mutations += id_tensor_mutations(draw, "draft_tokens", tensors["draft_tokens"], shape.vocab, accepted=ids)
    mutations += id_tensor_mutations(draw, "candidate_ids", tensors["candidate_ids"], shape.vocab, accepted=ids)
    mutations += float_tensor_mutations(draw, "target_probs", tensors["target_probs"], accepted=floats(raw))
    mutations += float_tensor_mutations(draw, "draft_probs", tensors["draft_probs"],
                                        accepted=(torch.float32,) if raw else FLOATS)
    target, proposal = tensors["target_probs"], tensors["draft_probs"]
    mutations += [
        Mutation("D positions, not D + 1", "target_probs", target[:, :-1], ("target_probs",)),
        Mutation("batch off by one", "target_probs", with_dim_resized(draw, target, 0), ("target_probs",)),
        Mutation("an empty vocabulary", "target_probs", target[..., :0], ("target_probs",)),
        Mutation("batch off by one", "draft_probs", with_dim_resized(draw, proposal, 0), ("draft_probs",)),
        Mutation("k off by one", "candidate_ids", with_dim_resized(draw, tensors["candidate_ids"], 2),
                 ("candidate_ids", "draft_probs")),
        Mutation("1-D", "draft_tokens", with_dim_dropped(draw, tensors["draft_tokens"], 0), ("draft_tokens",)),
        Mutation("no positions", "draft_tokens", tensors["draft_tokens"][:, :0], ("draft_tokens", "target_probs")),
        Mutation("no candidates", "draft_probs", proposal[..., :0], ("draft_probs", "candidate_ids")),
    ]
    return mutations


def rejection_sample_case(draw: Draw) -> Case:
    """dk.rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids, *, generator)."""
    shape, kind, tensors = draw_verification(draw, raw=False)
    generator_seed, seed = _random_source(draw)
    call = Call(dk.rejection_sample, {**tensors, "generator": _make_generator(generator_seed)},
                keywords=("generator",))
    if draw.chance(BAD_FRACTION):
        return bad_case(draw, call, _verify_mutations(draw, shape, tensors, raw=False) + generator_mutations())

    def run():
        generator = _make_generator(generator_seed)
        if generator is None:
            torch.manual_seed(seed)
        return dk.rejection_sample(**tensors, generator=generator)

    def judge(result) -> None:
        source = _make_generator(generator_seed) if generator_seed is not None else seed
        uniforms = _seeded_uniforms(source, (shape.batch, shape.draft + 1))
        _assert_verification(result, reference.rejection_sample(**tensors, uniforms=uniforms))

    return Case(f"valid ({kind} proposal)", run, Agrees(judge), call.args)


def _assert_verification(result, expected) -> None:
    assert isinstance(result, (tuple, list)) and len(result) == 2, f"expected (accepted, bonus), got {result!r}"
    assert_equal("accepted", result[0], expected[0])
    assert_equal("bonus", result[1], expected[1])


def rejection_sample_op_case(draw: Draw) -> Case:
    """dflash2::rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids, uniforms)."""
    shape, kind, tensors = draw_verification(draw, raw=True)
    uniforms = torch.rand((shape.batch, shape.draft + 1), generator=draw.torch)
    if draw.chance(0.05):  # the edges of [0, 1)
        uniforms = draw.sprinkle(uniforms, (0.0, 1.0 - 2**-24), 0.3)
    call = Call(torch.ops.dflash2.rejection_sample, {**tensors, "uniforms": uniforms})
    if draw.chance(BAD_FRACTION):
        mutations = _verify_mutations(draw, shape, tensors, raw=True)
        mutations += float_tensor_mutations(draw, "uniforms", uniforms, accepted=(torch.float32,))
        mutations.append(Mutation("D, not D + 1", "uniforms", uniforms[:, :-1], ("uniforms",)))
        return bad_case(draw, call, at_op_boundary(mutations))
    return Case(f"valid ({kind} proposal)", call,
                Agrees(lambda result: _assert_verification(result, reference.rejection_sample(**call.args))),
                call.args)


def greedy_verify_case(draw: Draw) -> Case:
    """dk.greedy_verify(draft_tokens [B, D], target_logits [B, D+1, V]) -> (accepted, bonus)."""
    batch, draft = draw.size(0, 16, edges=(1,)), draw.size(0, 8, edges=(1,))
    vocab = draw.size(1, 3000, edges=(2,))
    kind = draw.pick(["random", "ties", "special"])
    logits = draw_logits(draw, (batch, draft + 1), vocab, 1, draw.dtype(FLOATS), kind)
    argmax = logits.argmax(-1)
    tokens = torch.where(torch.rand(batch, draft, generator=draw.torch) < 0.8, argmax[:, :draft],
                         draw.ids((batch, draft), vocab))
    if draw.chance(0.1):  # ids outside [0, V) are never the argmax: defined, not an error
        tokens = draw.sprinkle(tokens, (vocab, -1), 0.2)
    tensors = {"draft_tokens": draw.layout(tokens.to(draw.pick([torch.int64, torch.int32]))),
               "target_logits": draw.layout(logits)}
    call = Call(dk.greedy_verify, tensors)
    if draw.chance(BAD_FRACTION):
        mutations = id_tensor_mutations(draw, "draft_tokens", tensors["draft_tokens"], vocab, check_range=False)
        mutations += float_tensor_mutations(draw, "target_logits", logits)
        mutations += [
            Mutation("D positions, not D + 1", "target_logits", logits[:, :-1], ("target_logits",)),
            Mutation("an empty vocabulary", "target_logits", logits[..., :0], ("target_logits",)),
            Mutation("1-D", "draft_tokens", with_dim_dropped(draw, tokens, 0), ("draft_tokens",)),
        ]
        return bad_case(draw, call, mutations)
    return Case(f"valid ({kind} logits)", call,
                Agrees(lambda result: _assert_verification(result, reference.greedy_verify(**tensors))), call.args)
