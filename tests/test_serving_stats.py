"""Statistical tests of the serving path's sampling (SPEC sections 2 and 3).

Lossless verification: with drafts d_t drawn from the proposal q_t, the tokens that
``dk.rejection_sample`` emits (d_t while accepted, then the bonus) must follow the
verifier's distribution p_t at every position, whatever q is. Each test runs many
independent trials of one (p, q) block in the batch dimension and compares the emitted
tokens' frequencies with p_t by a chi-square goodness-of-fit test: position t is judged
on the rows whose first t drafts were accepted (in these blocks the target rows do not
depend on the prefix, so the verifier's distribution after that prefix is p_t; the
position-D token is the bonus of the fully accepted rows).

The sampled walk: ``dk.walk``'s path at position 0 must follow softmax(E[0, anchor]/T),
and at position 1, given the position-0 choice j, softmax(E[1, j]/T); its draft_probs
must be those distributions.

Every chi-square check in one test shares a family-wise significance of 1e-3 (Bonferroni),
with fixed seeds, so a correct sampler passes reliably; the power tests show that the
same checks reject samplers that are wrong in the ways such code goes wrong. The
p-value is the exact chi-square tail for integer df (no scipy needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import dflash2_kernels as dk
from dflash2_kernels import reference
from dflash2_kernels._extension import has_kernel

from .contract import assert_same_within_floor, assert_within_contract

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64

FAMILY_ALPHA = 1e-3  # per test, split over its checks
MIN_EXPECTED = 5.0  # chi-square bins with fewer expected counts are pooled
TRIALS = 40_000


def backend_paths(op_name: str) -> list:
    """(backend, device) pairs: the PyTorch reference, the C++ CPU kernel when it is
    registered, and CUDA (the CUDA kernel, or the reference on CUDA tensors without it)."""
    return [
        pytest.param("reference", "cpu", id="reference"),
        pytest.param("auto", "cpu", id="cpu-kernel", marks=pytest.mark.skipif(
            not has_kernel(op_name, "cpu"), reason=f"no CPU kernel registered for dflash2::{op_name}")),
        pytest.param("auto", "cuda", id="cuda", marks=pytest.mark.gpu),
    ]


# --- chi-square ------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with integer df >= 1, exactly:
    Q(x; 1) = erfc(sqrt(x/2)), Q(x; 2) = exp(-x/2), Q(x; k+2) = Q(x; k) + (x/2)^(k/2) e^(-x/2) / Gamma(k/2 + 1)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    k = 2 if df % 2 == 0 else 1
    q = math.exp(-x / 2) if k == 2 else math.erfc(math.sqrt(x / 2))
    while k < df:
        q += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1))
        k += 2
    return min(q, 1.0)


@dataclass
class ChiSquare:
    statistic: float
    df: int
    n: int
    p_value: float
    detail: str

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> ChiSquare:
    """Goodness of fit of observed counts [n] to probabilities [n] (normalised here).

    A count in a zero-probability category makes the statistic infinite. Categories
    with fewer than MIN_EXPECTED expected counts are pooled into one bin (with the
    smallest of the others if the pool is still too small).
    """
    counts = counts.detach().to("cpu", F64)
    probs = probs.detach().to("cpu", F64).clamp_min(0)
    probs = probs / probs.sum()
    n = int(counts.sum().item())
    if n == 0:
        raise AssertionError("no observations to test")
    impossible = (probs == 0) & (counts > 0)
    if impossible.any():
        where = impossible.nonzero().flatten().tolist()
        return ChiSquare(math.inf, 0, n, 0.0, f"{int(counts[impossible].sum())} draws in zero-probability bins {where}")
    expected = probs * n
    order = [i for i in expected.argsort(descending=True).tolist() if probs[i] > 0]
    bins = [[i] for i in order if expected[i] >= MIN_EXPECTED]
    pool = [i for i in order if expected[i] < MIN_EXPECTED]
    if pool:
        if sum(expected[i] for i in pool) >= MIN_EXPECTED or not bins:
            bins.append(pool)
        else:
            bins[-1] += pool
    observed = torch.stack([counts[b].sum() for b in bins])
    wanted = torch.stack([expected[b].sum() for b in bins])
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    df = len(bins) - 1
    if df < 1:
        raise AssertionError(f"a chi-square test needs two bins; expected counts {expected.tolist()}")
    detail = f"observed {observed.long().tolist()} vs expected {[round(w, 1) for w in wanted.tolist()]}"
    return ChiSquare(statistic, df, n, chi2_sf(statistic, df), detail)


def assert_fits(label: str, result: ChiSquare, alpha: float) -> None:
    assert not result.rejects(alpha), (
        f"{label}: chi-square {result.statistic:.2f} on {result.df} df over {result.n} draws, "
        f"p = {result.p_value:.2e} < {alpha:.1e}; {result.detail}")


# Upper 1e-3 points of chi-square (standard tables).
CRITICAL_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 20: 45.315, 30: 59.703}


@pytest.mark.parametrize("df,critical", sorted(CRITICAL_1E3.items()))
def test_chi2_tail_matches_the_tables(df, critical):
    assert chi2_sf(critical, df) == pytest.approx(1e-3, rel=2e-3)
    assert chi2_sf(critical * 0.9, df) > 1e-3 > chi2_sf(critical * 1.1, df)


def test_chi_square_flags_draws_where_the_distribution_has_no_mass():
    result = chi_square(torch.tensor([500, 499, 1]), torch.tensor([0.5, 0.5, 0.0]))
    assert result.rejects(1e-300) and "zero-probability" in result.detail
    assert not chi_square(torch.tensor([500, 500, 0]), torch.tensor([0.5, 0.5, 0.0])).rejects(0.5)


# --- rejection sampling ----------------------------------------------------------------

BASE = torch.tensor([
    [0.30, 0.20, 0.15, 0.10, 0.08, 0.07, 0.06, 0.04],
    [0.05, 0.10, 0.35, 0.05, 0.15, 0.10, 0.12, 0.08],
    [0.10, 0.05, 0.05, 0.25, 0.05, 0.30, 0.10, 0.10],
    [0.12, 0.18, 0.08, 0.14, 0.22, 0.06, 0.11, 0.09],
], dtype=F64)  # verifier rows over V = 8; row t is p_t


def _ranked(p: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    """The tokens of p at the given ranks (0 = p's mode)."""
    return p.argsort(descending=True, stable=True)[ranks]


def _block(draft: int, candidates: Callable, proposal: Callable, target: Callable = lambda p: p):
    """(p [D+1, V], cand [D, k], q [D, k]) from per-row rules over BASE."""
    p = torch.stack([target(BASE[t % len(BASE)]) for t in range(draft + 1)])
    cand = torch.stack([candidates(p[t]) for t in range(draft)])
    q = torch.stack([proposal(p[t], cand[t]) for t in range(draft)])
    return p, cand, q / q.sum(-1, keepdim=True)


def _close(p, cand):
    return p[cand] * torch.tensor([1.1, 0.9, 1.1, 0.9, 1.1], dtype=F64)


def _far(p, cand):
    return torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08], dtype=F64)


def _uniform(p, cand):
    return torch.ones(len(cand), dtype=F64)


def _one_hot(p, cand):
    return torch.eye(len(cand), dtype=F64)[0]


def _support_of_four(p):
    """80% of the mass on p's top 4 tokens, none elsewhere: an unnormalised target."""
    kept = torch.zeros_like(p)
    top = _ranked(p, [0, 1, 2, 3])
    kept[top] = p[top]
    return 0.8 * kept / kept.sum()


def _covering(p, cand):
    """q >= p on every token: 90% on p's support in p's proportions, 10% on a token p
    lacks. max(p - q, 0) is then empty at every rejection: the bonus must come from p."""
    q = torch.zeros(len(cand), dtype=F64)
    support = p[cand] > 0
    q[support] = 0.9 * p[cand][support] / p[cand][support].sum()
    q[~support] = 0.1 / int((~support).sum())
    return q


def _on_candidates(p):
    """p supported exactly on its top 4 tokens (so q = p there accepts every draft)."""
    kept = torch.zeros_like(p)
    top = _ranked(p, [0, 1, 2, 3])
    kept[top] = p[top]
    return kept / kept.sum()


@dataclass(frozen=True)
class RejectionCase:
    id: str
    build: Callable  # () -> (p [D+1, V], cand [D, k], q [D, k]) in float64
    target_dtype: torch.dtype = F32
    positions: tuple[int, ...] | None = None  # the positions enough rows reach; None: 0..D
    # (count, share): at least this share of the rows must accept exactly count drafts
    accepted_share: tuple[int, float] | None = None

    @property
    def draft(self) -> int:
        return self.build()[1].shape[0]


REJECTION_CASES = [
    RejectionCase("q-close-to-p", lambda: _block(2, lambda p: _ranked(p, [0, 1, 2, 3, 4]), _close)),
    RejectionCase("q-close-to-p-bf16-target", lambda: _block(2, lambda p: _ranked(p, [0, 1, 2, 3, 4]), _close), BF16),
    RejectionCase("q-far-from-p", lambda: _block(2, lambda p: _ranked(p, [7, 6, 5, 4, 3]), _far)),
    RejectionCase("q-misses-p-mode", lambda: _block(2, lambda p: _ranked(p, [1, 2, 3, 4]), _uniform)),
    # With p and q both normalised, q >= p everywhere forces q == p (no rejections), so
    # an empty residual at a rejection needs a target with mass below 1 (say a truncated
    # top-p distribution): there the fallback to p alone makes the emitted tokens follow
    # normalise(p) (accepted p(x), plus (1 - sum p) * p(x) / sum p from the fallback).
    RejectionCase("q-covers-p-empty-residual",
                  lambda: _block(2, lambda p: _ranked(p, [0, 1, 2, 3, 4]), _covering, _support_of_four)),
    RejectionCase("point-mass-q-greedy-draft", lambda: _block(2, lambda p: _ranked(p, [1, 0, 2, 3]), _one_hot)),
    # The greedy draft is a token p lacks: always rejected, the bonus from p minus nothing.
    RejectionCase("point-mass-q-on-zero-p",
                  lambda: _block(2, lambda p: _ranked(p, [5, 0, 1, 2]), _one_hot, _on_candidates),
                  positions=(0,), accepted_share=(0, 1.0)),
    # q == p (the same fp32 values) on the candidates at t < D: u * q < p accepts every
    # draft (a kernel that multiplies in fp32 may round u * q up to p once in 2^24), so
    # the rows reach the bonus, drawn from p_D (BASE's last row, full support).
    RejectionCase("all-accepted-bonus-from-p_D",
                  lambda: _all_accepted_block(3), accepted_share=(3, 0.999)),
]


def _all_accepted_block(draft: int):
    p, cand, _ = _block(draft, lambda p: _ranked(p, [0, 1, 2, 3]), lambda p, c: p[c], _on_candidates)
    p[draft] = BASE[draft % len(BASE)]
    return p, cand, p[:draft].gather(1, cand)  # not renormalised: bit-equal to p


def _draw_drafts(cand: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> torch.Tensor:
    """Drafts [trials, D]: position t drawn from q_t over cand_t, independently per row."""
    g = torch.Generator().manual_seed(seed)
    picks = [torch.multinomial(q[t].float().expand(trials, -1), 1, replacement=True, generator=g).squeeze(1)
             for t in range(cand.shape[0])]
    return torch.stack([cand[t][picks[t]] for t in range(cand.shape[0])], 1)


def run_block(case: RejectionCase, device: str, *, seed: int = 0, claimed_q: torch.Tensor | None = None,
              bonus_ignores_residual: bool = False, emit_drafts: bool = False):
    """Run TRIALS copies of the block; returns (p [D+1, V] as the verifier holds it,
    drafts [N, D], accepted [N], bonus [N]). The keyword arguments break the sampler on
    purpose (for the power tests): ``claimed_q`` is passed as draft_probs instead of the
    q the drafts came from; ``bonus_ignores_residual`` redraws every bonus after a
    rejection from p; ``emit_drafts`` accepts every draft."""
    p, cand, q = case.build()
    draft, vocab = cand.shape[0], p.shape[1]
    drafts = _draw_drafts(cand, q, TRIALS, seed)
    target = p.to(case.target_dtype)
    target_probs = target.expand(TRIALS, -1, -1).contiguous().to(device)
    draft_probs = (q if claimed_q is None else claimed_q).float().expand(TRIALS, -1, -1).contiguous().to(device)
    candidate_ids = cand.expand(TRIALS, -1, -1).contiguous().to(device)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    accepted, bonus = dk.rejection_sample(drafts.to(device), target_probs, draft_probs, candidate_ids, generator=g)
    accepted, bonus = accepted.cpu(), bonus.cpu()
    if emit_drafts:
        accepted = torch.full_like(accepted, draft)
        g2 = torch.Generator().manual_seed(seed + 2)
        bonus = torch.multinomial(target[draft].float(), TRIALS, replacement=True, generator=g2)
    if bonus_ignores_residual:
        g2 = torch.Generator().manual_seed(seed + 2)
        redraw = torch.multinomial(target.float()[accepted], 1, generator=g2).squeeze(1)
        bonus = torch.where(accepted < draft, redraw, bonus)
    assert accepted.dtype == bonus.dtype == torch.long and accepted.shape == bonus.shape == (TRIALS,)
    assert int(accepted.min()) >= 0 and int(accepted.max()) <= draft
    assert int(bonus.min()) >= 0 and int(bonus.max()) < vocab, "a bonus token outside [0, V)"
    return target.to(F64), drafts, accepted, bonus


def emitted_at(position: int, drafts, accepted, bonus) -> torch.Tensor:
    """The token emitted at ``position`` by each row whose first ``position`` drafts were accepted."""
    reached = accepted >= position
    if position < drafts.shape[1]:
        token = torch.where(accepted > position, drafts[:, position], bonus)
    else:
        token = bonus
    return token[reached]


def emission_checks(p, drafts, accepted, bonus, positions=None) -> list[tuple[str, ChiSquare]]:
    vocab = p.shape[1]
    checks = []
    for t in range(drafts.shape[1] + 1) if positions is None else positions:
        tokens = emitted_at(t, drafts, accepted, bonus)
        assert tokens.numel() >= 1000, f"position {t}: only {tokens.numel()} rows reach it; enlarge TRIALS"
        checks.append((f"position {t}", chi_square(torch.bincount(tokens, minlength=vocab), p[t])))
    return checks


@pytest.mark.parametrize("backend,device", backend_paths("rejection_sample"))
@pytest.mark.parametrize("case", REJECTION_CASES, ids=lambda c: c.id)
def test_emitted_tokens_follow_the_verifier(case, backend, device, monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", backend)
    p, drafts, accepted, bonus = run_block(case, device)
    checks = emission_checks(p, drafts, accepted, bonus, case.positions)
    for label, result in checks:
        assert_fits(f"{case.id} {label}", result, FAMILY_ALPHA / len(checks))
    if case.accepted_share is not None:
        count, share = case.accepted_share
        histogram = torch.bincount(accepted, minlength=case.draft + 1).tolist()
        assert histogram[count] >= share * TRIALS, (
            f"{share:.1%} of the rows must accept {count} drafts; rows per accepted count {histogram}")


def _uniform_claim(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, 1.0 / q.shape[-1])


def _ten_percent_off(q: torch.Tensor) -> torch.Tensor:
    claim = q * torch.tensor([1.1, 0.9] + [1.0] * (q.shape[-1] - 2), dtype=F64)
    return claim / claim.sum(-1, keepdim=True)


CASE = {case.id: case for case in REJECTION_CASES}
BROKEN_SAMPLERS = [
    pytest.param(CASE["q-far-from-p"], {"bonus_ignores_residual": True}, id="bonus-from-p-not-residual"),
    pytest.param(CASE["q-misses-p-mode"], {"bonus_ignores_residual": True},
                 id="bonus-from-p-not-residual-q-misses-mode"),
    pytest.param(CASE["q-far-from-p"], {"claim": _uniform_claim}, id="draft-probs-not-the-drafts-q"),
    pytest.param(CASE["q-close-to-p"], {"claim": _ten_percent_off}, id="draft-probs-10pct-off"),
    pytest.param(CASE["q-far-from-p"], {"emit_drafts": True}, id="accept-every-draft"),
]


@pytest.mark.parametrize("case,breakage", BROKEN_SAMPLERS)
def test_chi_square_rejects_a_broken_sampler(case, breakage, monkeypatch):
    """The checks above have power: each broken sampler fails them at position 0."""
    monkeypatch.setenv("DFLASH2_BACKEND", "reference")
    if "claim" in breakage:
        breakage = {"claimed_q": breakage["claim"](case.build()[2])}
    p, drafts, accepted, bonus = run_block(case, "cpu", **breakage)
    label, result = emission_checks(p, drafts, accepted, bonus)[0]
    alpha = FAMILY_ALPHA / (drafts.shape[1] + 1)
    assert result.rejects(alpha), (
        f"{case.id} {label}: a broken sampler passed (chi-square {result.statistic:.1f}, "
        f"{result.df} df, p = {result.p_value:.2e}); {result.detail}")


# --- the sampled walk ------------------------------------------------------------------


@dataclass(frozen=True)
class WalkCase:
    temperature: float
    dtype: torch.dtype = F32
    vocab: int = 12
    rank: int = 4
    top_k: int = 4
    draft: int = 2
    anchor: int = 5

    @property
    def id(self) -> str:
        return f"T{self.temperature}-{str(self.dtype).removeprefix('torch.')}"


WALK_CASES = [WalkCase(1.0), WalkCase(0.5), WalkCase(2.0), WalkCase(1.0, BF16)]


def walk_inputs(case: WalkCase, device: str, seed: int = 0):
    """One sequence: (projected [1, D, r], logits [1, D, V], anchor_ids [1], A, B)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(case.dtype).to(device)

    return (randn(1, case.draft, case.rank), randn(1, case.draft, case.vocab, scale=1.5),
            torch.tensor([case.anchor], device=device), randn(case.vocab, case.rank, scale=0.8),
            randn(case.vocab, case.rank, scale=0.8))


def exact_edges(projected, logits, anchor_ids, predecessor, successor, candidate_ids):
    """SPEC section 2's formula in float64 for sequence 0: E [D, k, k]."""
    projected, logits, predecessor, successor = (x.double().cpu() for x in (projected, logits, predecessor, successor))
    cand = candidate_ids[0].cpu()
    draft, top_k = cand.shape
    unary = logits[0].gather(-1, cand)
    prev = torch.cat([anchor_ids.cpu().long().expand(1, top_k), cand[:-1]])
    return unary.unsqueeze(1) + torch.einsum("tir,tr,tjr->tij", predecessor[prev], projected[0], successor[cand])


def sampled_walk(case: WalkCase, device: str, seed: int = 0):
    """(walk outputs over TRIALS copies of the sequence, the edges [D, k, k] of it)."""
    inputs = walk_inputs(case, device, seed)
    edges, candidate_ids = dk.edge_scores(*inputs, case.top_k)
    expected, expected_ids = reference.serving_edge_scores(*(x.cpu() for x in inputs), case.top_k)
    assert torch.equal(candidate_ids.cpu(), expected_ids)
    assert_within_contract(f"{case} edges", edges[0].cpu(), expected[0], exact_edges(*inputs, candidate_ids))
    projected, logits, anchor_ids, predecessor, successor = inputs
    repeat = (lambda x: x.expand(TRIALS, *x.shape[1:]).contiguous())
    g = torch.Generator(device=device).manual_seed(seed + 1)
    path, walk_candidates, draft_probs = dk.walk(repeat(projected), repeat(logits), repeat(anchor_ids), predecessor,
                                                 successor, case.top_k, case.temperature, generator=g)
    assert draft_probs is not None and draft_probs.dtype == F32
    assert draft_probs.shape == (TRIALS, case.draft, case.top_k)
    assert torch.equal(walk_candidates, candidate_ids.expand(TRIALS, -1, -1)), \
        "walk and edge_scores disagree on the candidates"
    return path.cpu(), candidate_ids[0].cpu(), draft_probs.cpu(), edges[0].cpu()


def candidate_index(tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Position of each token among the candidates [k]; asserts every token is one."""
    match = tokens.unsqueeze(-1) == candidates
    assert bool(match.any(-1).all()), "the walk chose a token outside the position's candidates"
    return match.int().argmax(-1)


def walk_checks(case, path, candidates, edges, *, row_for=lambda j: j, temperature=None):
    """Chi-square checks of path[:, 0] and of path[:, 1] given each well-populated j_0.
    ``row_for`` and ``temperature`` pick the expected distributions (overridden by the
    power test to model broken walks)."""
    temperature = case.temperature if temperature is None else temperature
    q = lambda row: torch.softmax(row.float() / temperature, -1).double()  # noqa: E731
    j0 = candidate_index(path[:, 0], candidates[0])
    j1 = candidate_index(path[:, 1], candidates[1])
    checks = [("position 0", chi_square(torch.bincount(j0, minlength=case.top_k), q(edges[0, 0])))]
    for j in range(case.top_k):
        rows = j0 == j
        if int(rows.sum()) >= 1000:
            checks.append((f"position 1 after j0={j}",
                           chi_square(torch.bincount(j1[rows], minlength=case.top_k), q(edges[1, row_for(j)]))))
    assert len(checks) >= 3, "too few well-populated predecessors: the instance is too peaked"
    return checks


@pytest.mark.parametrize("backend,device", backend_paths("select_path"))
@pytest.mark.parametrize("case", WALK_CASES, ids=lambda c: c.id)
def test_sampled_walk_follows_its_draft_probs(case, backend, device, monkeypatch):
    monkeypatch.setenv("DFLASH2_BACKEND", backend)
    path, candidates, draft_probs, edges = sampled_walk(case, device)
    softmax = lambda row: torch.softmax(row.float() / case.temperature, -1)  # noqa: E731

    # draft_probs are the distributions the walk drew from: position 0 from the anchor's
    # row of E, position 1 from the row of the candidate chosen at position 0.
    j0 = candidate_index(path[:, 0], candidates[0])
    assert_same_within_floor("q at position 0", draft_probs[:, 0], softmax(edges[0, 0]).expand(TRIALS, -1))
    assert_same_within_floor("q at position 1", draft_probs[:, 1], softmax(edges[1])[j0])

    checks = walk_checks(case, path, candidates, edges)
    for label, result in checks:
        assert_fits(f"walk {case.id} {label}", result, FAMILY_ALPHA / len(checks))


BROKEN_WALKS = [
    pytest.param(dict(row_for=lambda j: 0), id="position-1-ignores-the-predecessor"),
    pytest.param(dict(temperature=1.0), id="temperature-ignored"),
    pytest.param(dict(temperature=0.55), id="temperature-10pct-off"),
]


@pytest.mark.parametrize("broken", BROKEN_WALKS)
def test_chi_square_rejects_a_broken_walk(broken, monkeypatch):
    """The walk's checks have power: the real walk's draws fail against the distributions
    a walk with the predecessor or the temperature bug would have drawn from."""
    monkeypatch.setenv("DFLASH2_BACKEND", "reference")
    case = WALK_CASES[1]  # T = 0.5
    path, candidates, _, edges = sampled_walk(case, "cpu")
    checks = walk_checks(case, path, candidates, edges, **broken)
    alpha = FAMILY_ALPHA / len(checks)
    assert any(result.rejects(alpha) for _, result in checks), (
        "a broken walk passed: " + "; ".join(f"{label} p = {r.p_value:.2e}" for label, r in checks))
