"""DTensor arguments to the public functions (and so to the ``dflash2::`` ops) on a 2-rank
gloo CPU mesh (``init_device_mesh('cpu', (2,))``): never silently wrong.

Each case runs once on plain tensors (one process's result) and once on DTensors in a
layout: ``replicate`` (everything Replicate), ``rows`` (row tensors Shard(0), parameters
Replicate), ``codebooks`` (the parameters Shard(0): vocab-parallel codebooks / lm_head,
conv ``base`` split over taps; the draft head runs a Shard(0) lm_head vocab-parallel),
``sequence`` (rows Shard(1)) and ``partial`` (rows as Partial sums). Where the op has a rule the DTensor results (after
``full_tensor()``), gradients included, must equal the plain ones, in the documented
placements (per-row results Shard(0), a gradient reduced over rows into a replicated
parameter Partial). Where it has none, it must raise ``DTensorPlacementError`` (a
ValueError) saying what to pass.

The two ranks (tests/distributed_support.py: gloo processes on a free port, with a
deadline) run every case in one go, each case computing its plain twin in the same
process, so the comparison sees one host BLAS; the tests below only read what the ranks
saved.
"""

from __future__ import annotations

import traceback

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import distributed as dist_rules
from dflash2_kernels._extension import EXTENSION_LOADED

from .contract import assert_same_within_floor, assert_within_contract
from .distributed_support import WORLD, load_rank_results, requires_gloo, run_ranks, save_rank_result

pytestmark = [
    requires_gloo,
    pytest.mark.skipif(not dist_rules.AVAILABLE, reason="DTensor"),
    pytest.mark.skipif(not EXTENSION_LOADED, reason="the C++ ops (the rules are for the compiled ops)"),
]

TIMEOUT_S = 180
SEED = 1234
# fp32 everywhere: the DTensor side sums a parameter's gradient per rank, then across
# ranks (Partial -> full_tensor), one process sums it at once: the two agree within SPEC
# section 4's floor (tests/contract.py's assert_same_within_floor).

# --- inputs ---------------------------------------------------------------------------------
#
# Each case is ``fn(place, rank) -> (outputs, grads)``: ``place(role, tensor, grad)`` gives the
# tensor as the layout wants it (role "rows" or "param"), a leaf requiring grad if asked;
# outputs is a dict of results, grads a dict of the leaves whose .grad is compared.

B, S, H, GS, K = 4, 8, 32, 16, 2   # conv: 4 sequences of 8 rows; 4 * 8 rows split 16 / 16
V, R_, TOPK = 40, 8, 4             # selector / serving / head sizes
D = 4                              # serving: drafted block length


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def case_conv(place, rank, block_size=8, batch=B):
    g = _gen(1)
    x = place("rows", torch.randn(batch, S, H, generator=g), True)
    # speculators' delta: one side of the kernel projection, a strided view.
    kernels = torch.randn(batch, S, 2, K, H // GS, generator=g)
    delta = place("rows", kernels[:, :, 0], True)
    base = place("param", torch.randn(K, H, generator=g), True)
    out = dk.grouped_dynamic_conv(x, delta, base, block_size=block_size, group_size=GS)
    dy = torch.randn(batch, S, H, generator=g)
    (out * _like(dy, out)).sum().backward()
    return {"out": out}, {"dx": x, "ddelta": delta, "dbase": base}


def case_conv_uneven(place, rank):
    return case_conv(place, rank, batch=3)  # rows 16 / 8: uneven, both shards start a block


def case_conv_mixed(place, rank):
    """x Shard(0) rows with a Replicate delta: the delta is sliced locally, the rows rule runs."""
    def mixed(role, tensor, grad):
        return place("param" if tensor.dim() == 4 else role, tensor, grad)
    return case_conv(mixed, rank)


def case_conv_unaligned(place, rank):
    return case_conv(place, rank, block_size=3)  # rank 1 would start at row 16, not a block start


def case_conv_cpu_ops(place, rank):
    """The conv's raw C++ ops ([N, H] rows) have the conv's rules too."""
    g = _gen(11)
    x = place("rows", torch.randn(B * S, H, generator=g), False)
    delta = place("rows", torch.randn(B * S, K, H // GS, generator=g), False)
    base = place("param", torch.randn(K, H, generator=g), False)
    out = torch.ops.dflash2.conv_forward_cpu(x, delta, base, S, torch.float32)
    dx, ddelta, dbase = torch.ops.dflash2.conv_backward_cpu(_like(torch.randn(B * S, H, generator=g), out), x,
                                                            delta, base, S)
    return {"out": out, "dx": dx, "ddelta": ddelta, "dbase": dbase}, {}


def _selector_inputs(place, g, *, unary_width, grad=True):
    unary = place("rows", torch.randn(B, S, unary_width, generator=g), grad)
    projected = place("rows", torch.randn(B, S, R_, generator=g), grad)
    a = place("param", torch.randn(V, R_, generator=g), grad)
    b = place("param", torch.randn(V, R_, generator=g), grad)
    pred = place("rows", torch.randint(0, V, (B, S), generator=g), False)
    cand = place("rows", torch.randint(0, V, (B, S, TOPK), generator=g), False)
    return unary, projected, a, b, pred, cand


def case_score_candidates(place, rank):
    g = _gen(2)
    unary, projected, a, b, pred, cand = _selector_inputs(place, g, unary_width=V)
    scores = dk.score_candidates(unary, projected, a, b, pred, cand)
    (scores * _like(torch.randn(B, S, TOPK, generator=g), scores)).sum().backward()
    return {"scores": scores}, {"dU": unary, "dP": projected, "dA": a, "dB": b}


def case_pair_and_transition_scores(place, rank):
    g = _gen(3)
    unary, projected, a, b, pred, cand = _selector_inputs(place, g, unary_width=TOPK)
    pair = dk.pair_scores(projected, unary, a, b, cand, pred)
    transition = dk.transition_scores(projected, a, b, pred, cand)
    weights = torch.randn(2, B, S, TOPK, generator=g)
    ((pair * _like(weights[0], pair)).sum() + (transition * _like(weights[1], transition)).sum()).backward()
    return {"pair": pair, "transition": transition}, {"dU": unary, "dP": projected, "dA": a, "dB": b}


def case_selector_op_dtypes(place, rank):
    """The raw op twice on the same DTensor layouts, two output dtypes: the sharding cache
    must not hand the second call the first one's output metadata."""
    g = _gen(4)
    unary, projected, a, b, pred, cand = _selector_inputs(place, g, unary_width=TOPK, grad=False)
    flat = [t.reshape(B * S, *t.shape[2:]) for t in (unary, projected)]
    ids = (pred.reshape(B * S), cand.reshape(B * S, TOPK))
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        out = torch.ops.dflash2.selector_scores(flat[0], flat[1], a, b, *ids, True, dtype)
        outputs[str(dtype)] = out
    return outputs, {}


def case_candidate_topk(place, rank):
    g = _gen(5)
    logits = place("rows", torch.randn(B * S, V, generator=g), False)
    values, ids = dk.candidate_topk(logits, TOPK)
    return {"values": values, "ids": ids}, {}


def _serving_inputs(place, g):
    projected = place("rows", torch.randn(B, D, R_, generator=g), False)
    logits = place("rows", torch.randn(B, D, V, generator=g), False)
    anchors = place("rows", torch.randint(0, V, (B,), generator=g), False)
    a = place("param", torch.randn(V, R_, generator=g), False)
    b = place("param", torch.randn(V, R_, generator=g), False)
    return projected, logits, anchors, a, b


def case_walk(place, rank):
    g = _gen(6)
    projected, logits, anchors, a, b = _serving_inputs(place, g)
    edges, cand = dk.edge_scores(projected, logits, anchors, a, b, TOPK)
    path, cand_greedy, none = dk.walk(projected, logits, anchors, a, b, TOPK)
    assert none is None
    # Each rank's generator differs: the draws must be rank 0's (one process seeded SEED).
    sampled, cand_sampled, probs = dk.walk(projected, logits, anchors, a, b, TOPK, 0.8,
                                           generator=_gen(SEED + rank))
    return {"edges": edges, "candidate_ids": cand, "greedy_path": path, "greedy_candidates": cand_greedy,
            "sampled_path": sampled, "sampled_candidates": cand_sampled, "draft_probs": probs}, {}


def case_edges_reference_path(place, rank):
    """k > 32 runs the PyTorch reference inside the public functions: it refuses DTensors."""
    projected, logits, anchors, a, b = _serving_inputs(place, _gen(7))
    return {"edges": dk.edge_scores(projected, logits, anchors, a, b, 33)[0]}, {}


def case_walk_reference_path(place, rank):
    projected, logits, anchors, a, b = _serving_inputs(place, _gen(7))
    return {"path": dk.walk(projected, logits, anchors, a, b, 33, 0.8, generator=_gen(SEED + rank))[0]}, {}


def case_verify_reference_path(place, rank):
    """float64 probabilities run the reference too."""
    g = _gen(8)
    target_probs = torch.softmax(torch.randn(B, D + 1, V, generator=g, dtype=torch.float64), -1)
    cand = torch.randint(0, V, (B, D, TOPK), generator=g)
    draft_probs = torch.full((B, D, TOPK), 1.0 / TOPK)
    args = [place("rows", t, False) for t in (cand[..., 0], target_probs, draft_probs, cand)]
    return {"accepted": dk.rejection_sample(*args)[0]}, {}


def case_verify(place, rank):
    g = _gen(8)
    target_probs = torch.softmax(torch.randn(B, D + 1, V, generator=g) * 3, -1)
    cand = torch.stack([torch.randperm(V, generator=g)[:TOPK] for _ in range(B * D)]).view(B, D, TOPK)
    draft_probs = torch.softmax(torch.randn(B, D, TOPK, generator=g), -1)
    # Draft the target's likeliest candidate, so that some positions are accepted.
    draft = cand.gather(-1, target_probs[:, :D].gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
    args = [place("rows", t, False) for t in (draft, target_probs, draft_probs, cand)]
    accepted, bonus = dk.rejection_sample(*args, generator=_gen(SEED + rank))
    greedy_accepted, greedy_bonus = dk.greedy_verify(args[0], args[1])
    return {"accepted": accepted, "bonus": bonus, "greedy_accepted": greedy_accepted,
            "greedy_bonus": greedy_bonus}, {}


def case_draft_head(place, rank, weight_grad=False):
    g = _gen(9)
    hidden = place("rows", torch.randn(B, S, H, generator=g), True)
    weight = place("param", torch.randn(V, H, generator=g), weight_grad)
    target = place("rows", torch.randn(B, S, H, generator=g), False)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :3] = -100
    labels = place("rows", labels, False)
    out = dk.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=("kl_div", "ce"), top_k=TOPK)
    w = torch.randn(3, B, S, generator=g)
    loss = ((out.losses["kl_div"] * _like(w[0], out.losses["kl_div"])).sum()
            + (out.losses["ce"] * _like(w[1], out.losses["ce"])).sum()
            + (out.topk_logits.sum(-1) * _like(w[2], out.label_logit)).sum() + out.label_logit.sum())
    loss.backward()
    outputs = {f"loss_{name}": value for name, value in out.losses.items()}
    outputs.update({name: getattr(out, name) for name in ("topk_ids", "topk_logits", "label_ids", "label_logit",
                                                         "label_in_topk", "draft_lse", "target_lse", "overlap")})
    grads = {"dhidden": hidden}
    if weight_grad:
        grads["dweight"] = weight
    return outputs, grads


def case_draft_head_weight_grad(place, rank):
    return case_draft_head(place, rank, weight_grad=True)


def case_head_rows_kernel(place, rank):
    """The head's in-place row-chunk kernel is internal: DTensors get DTensor's NotImplementedError."""
    logits = place("rows", torch.randn(B * S, V, generator=_gen(10)), False)
    return {"out": torch.ops.dflash2.draft_head_rows_cpu(logits, None, None, 0, TOPK, 1.0, 0.0, torch.float32,
                                                         None)[0]}, {}


# name -> (case, {layout: None (must match one process) or an error substring}).
RULE = "rows"  # the layouts with a rule: compared to one process's results
CASES = {
    "conv": (case_conv, {"replicate": None, "rows": None, "codebooks": "base_kernel"}),
    "conv_uneven": (case_conv_uneven, {"rows": None}),
    "conv_mixed": (case_conv_mixed, {"rows": None}),
    "conv_partial": (case_conv, {"partial": "Replicate() or Shard(0)"}),
    "conv_cpu_ops": (case_conv_cpu_ops, {"replicate": None, "rows": None}),
    "conv_unaligned": (case_conv_unaligned, {"replicate": None, "rows": "draft-block boundaries"}),
    "score_candidates": (case_score_candidates, {"replicate": None, "rows": None,
                                                 "codebooks": "predecessor_codebook"}),
    "pair_and_transition_scores": (case_pair_and_transition_scores, {"replicate": None, "rows": None,
                                                                     "codebooks": "predecessor_codebook"}),
    "selector_op_dtypes": (case_selector_op_dtypes, {"rows": None}),
    "candidate_topk": (case_candidate_topk, {"replicate": None, "rows": None}),
    "walk": (case_walk, {"replicate": None, "rows": None, "codebooks": "predecessor_codebook"}),
    "edges_reference_path": (case_edges_reference_path, {"rows": "runs the PyTorch reference"}),
    "walk_reference_path": (case_walk_reference_path, {"replicate": "runs the PyTorch reference"}),
    "verify": (case_verify, {"replicate": None, "rows": None}),
    "verify_reference_path": (case_verify_reference_path, {"rows": "runs the PyTorch reference"}),
    # A Shard(0) lm_head (replicated rows) runs vocab-parallel (head/vocab_parallel.py): one process's results.
    "draft_head": (case_draft_head, {"replicate": None, "rows": None, "codebooks": None}),
    "draft_head_weight_grad": (case_draft_head_weight_grad, {"rows": None, "codebooks": None}),
    "head_rows_kernel": (case_head_rows_kernel, {"rows": "does not have a sharding strategy"}),
}
# Row tensors sharded on dim 1 (sequence parallel) are not rows: a clear error too.
CASES["conv_sequence_sharded"] = (case_conv, {"sequence": "Replicate() or Shard(0)"})


def _like(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """values as a DTensor in like's layout (a Partial one taken as Replicate) when like is one."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    if not isinstance(like, DTensor):
        return values
    placements = [Replicate() if isinstance(p, Partial) else p for p in like.placements]
    return distribute_tensor(values, like.device_mesh, placements)


# --- the ranks ------------------------------------------------------------------------------


def _placer(mesh, layout: str):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    if layout == "partial":  # row tensors as Partial sums (half on each rank), parameters Replicate
        def place(role, tensor, grad):
            if role == "param":
                return distribute_tensor(tensor.detach().clone(), mesh, [Replicate()]).requires_grad_(grad)
            return DTensor.from_local(tensor.detach() / 2, mesh, [Partial()]).requires_grad_(grad)

        return place
    placement = {
        "replicate": {"rows": Replicate(), "param": Replicate()},
        "rows": {"rows": Shard(0), "param": Replicate()},
        "codebooks": {"rows": Replicate(), "param": Shard(0)},
        "sequence": {"rows": Shard(1), "param": Replicate()},
    }[layout]

    def place(role, tensor, grad):
        return distribute_tensor(tensor.detach().clone(), mesh, [placement[role]]).requires_grad_(grad)

    return place


def _plain(role, tensor, grad):
    return tensor.detach().clone().requires_grad_(grad)


def _plain_float64(role, tensor, grad):
    tensor = tensor.detach()
    return (tensor.double() if tensor.is_floating_point() else tensor.clone()).requires_grad_(grad)


# Layouts that run another algorithm than one process: the vocab-parallel head merges
# per-row statistics across the ranks. Their results are judged by SPEC section 4 against
# the float64 evaluation, one process's being the reference; the others must agree with
# one process within the floor (the same kernels on other rows).
OTHER_ALGORITHM = {("draft_head", "codebooks"), ("draft_head_weight_grad", "codebooks")}


def _collect(outputs: dict, grads: dict) -> tuple[dict, dict]:
    """(full tensors, placements as strings) of the outputs and the leaves' gradients."""
    from torch.distributed.tensor import DTensor

    values, placements = {}, {}
    items = list(outputs.items()) + [(name, leaf.grad) for name, leaf in grads.items()]
    for name, value in items:
        if isinstance(value, DTensor):
            placements[name] = str(tuple(value.placements))
            value = value.full_tensor()
        values[name] = None if value is None else value.detach().clone()
    return values, placements


def _run_cases(rank: int, mesh) -> dict:
    results = {}
    for name, (case, layouts) in CASES.items():
        want = None
        for layout, expected_error in layouts.items():
            record = {"error": None, "error_type": None, "values": None, "placements": None}
            try:
                if want is None and expected_error is None:
                    want = _collect(*case(_plain, 0))[0]
                record["values"], record["placements"] = _collect(*case(_placer(mesh, layout), rank))
            except Exception as error:  # noqa: BLE001 - recorded for the parent to judge
                record["error_type"] = [cls.__name__ for cls in type(error).__mro__]
                record["error"] = f"{error}\n{traceback.format_exc()}"
            record["want"] = want
            if (name, layout) in OTHER_ALGORITHM:
                record["exact"] = _collect(*case(_plain_float64, 0))[0]
            results[(name, layout)] = record
    return results


def _worker(rank: int, out_dir: str) -> None:
    """One rank (its gloo group joined by distributed_support.run_ranks): every case."""
    from torch.distributed.device_mesh import init_device_mesh

    save_rank_result(out_dir, rank, _run_cases(rank, init_device_mesh("cpu", (WORLD,))))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dtensor")
    run_ranks(_worker, out_dir, timeout_s=TIMEOUT_S)
    return load_rank_results(out_dir)


# --- the checks -----------------------------------------------------------------------------

MATCHED = [(name, layout) for name, (_, layouts) in CASES.items() for layout, error in layouts.items()
           if error is None]
REFUSED = [(name, layout) for name, (_, layouts) in CASES.items() for layout, error in layouts.items()
           if error is not None]


def _assert_same(got: dict, want: dict, where, exact: dict | None = None) -> None:
    assert got.keys() == want.keys(), where
    for key, expected in want.items():
        value = got[key]
        if expected is None:
            assert value is None, (where, key)
            continue
        assert value is not None, (where, key, "no value (a gradient that never arrived?)")
        assert value.dtype == expected.dtype and value.shape == expected.shape, (where, key, value.dtype,
                                                                                  value.shape, expected.shape)
        if expected.is_floating_point() and exact is not None:
            assert_within_contract(f"{where} {key}", value, expected, exact[key])
        elif expected.is_floating_point():
            assert_same_within_floor(f"{where} {key}", value, expected)
        else:
            assert torch.equal(value, expected), (where, key)


@pytest.mark.parametrize("name,layout", MATCHED, ids=[f"{n}-{layout}" for n, layout in MATCHED])
def test_dtensor_results_equal_one_process(ranks, name, layout):
    for rank, results in enumerate(ranks):
        record = results[(name, layout)]
        assert record["error"] is None, f"rank {rank}: {record['error']}"
        _assert_same(record["values"], record["want"], (name, layout, rank), record.get("exact"))


@pytest.mark.parametrize("name,layout", REFUSED, ids=[f"{n}-{layout}" for n, layout in REFUSED])
def test_unsupported_layouts_raise_a_clear_error(ranks, name, layout):
    expected = CASES[name][1][layout]
    for rank, results in enumerate(ranks):
        record = results[(name, layout)]
        assert record["error"] is not None, f"rank {rank}: {name} on {layout} DTensors ran without an error"
        message = record["error"].split("\nTraceback")[0]
        assert expected in message, message
        if "sharding strategy" in expected:  # DTensor's own error for an op without a rule
            assert "NotImplementedError" in record["error_type"], record["error_type"]
            continue
        # Ours: a ValueError (also a NotImplementedError, so DTensor does not wrap it)
        # that says what to pass.
        assert "ValueError" in record["error_type"] and "DTensorPlacementError" in record["error_type"], \
            record["error_type"]
        assert "full_tensor()" in message and "instead" in message, message


ROW_RESULTS = {  # case -> {result: placement on the rows layout}
    "conv": {"out": "(Shard(dim=0),)", "dx": "(Shard(dim=0),)", "ddelta": "(Shard(dim=0),)",
             "dbase": "(Partial(sum),)"},
    "score_candidates": {"scores": "(Shard(dim=0),)", "dU": "(Shard(dim=0),)", "dP": "(Shard(dim=0),)",
                         "dA": "(Partial(sum),)", "dB": "(Partial(sum),)"},
    "candidate_topk": {"values": "(Shard(dim=0),)", "ids": "(Shard(dim=0),)"},
    "walk": {"edges": "(Shard(dim=0),)", "sampled_path": "(Shard(dim=0),)", "draft_probs": "(Shard(dim=0),)"},
    "verify": {"accepted": "(Shard(dim=0),)", "bonus": "(Shard(dim=0),)"},
    "draft_head": {"loss_kl_div": "(Shard(dim=0),)", "topk_ids": "(Shard(dim=0),)",
                   "dhidden": "(Shard(dim=0),)"},
    "draft_head_weight_grad": {"dweight": "(Partial(sum),)", "dhidden": "(Shard(dim=0),)"},
    "conv_uneven": {"out": "(Shard(dim=0),)", "dbase": "(Partial(sum),)"},
    "conv_mixed": {"out": "(Shard(dim=0),)", "dx": "(Shard(dim=0),)", "dbase": "(Partial(sum),)"},
}


@pytest.mark.parametrize("name", sorted(ROW_RESULTS))
def test_rows_stay_sharded_and_parameter_grads_are_partial(ranks, name):
    """Shard(0) rows run on the local rows (no gather): per-row results Shard(0), the
    gradient of a replicated parameter Partial (its sum over ranks is one process's)."""
    placements = ranks[0][(name, "rows")]["placements"]
    for key, want in ROW_RESULTS[name].items():
        assert placements[key] == want, (key, placements[key])


def test_selector_outputs_keep_each_calls_dtype(ranks):
    values = ranks[0][("selector_op_dtypes", "rows")]["values"]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert values[str(dtype)].dtype == dtype


def test_every_op_has_a_sharding_rule_or_a_documented_reason():
    distributed = dist_rules
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("dflash2::")}
    assert ops <= set(distributed.RULES) | set(distributed.NO_RULE), ops - set(distributed.RULES) - set(
        distributed.NO_RULE)
