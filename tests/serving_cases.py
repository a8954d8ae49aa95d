"""Case tables and input factories for the serving tests (top-k, edges, walk, verification).

The shapes cross the CUDA kernels' edges: vocabularies below one 1,024-element top-k
slice, across several slices, and with ragged ends; rank across the 128-column
codebook tile; k from 1 to the 32-lane limit; and the 4,096-element slices of the
rejection sampler. The WIDE_* cases are what the kernels do not take (k > 32 up to
k = V, float64 anywhere): the serving functions run the PyTorch reference there.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2_kernels import reference

from .contract import contract_floor

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SHORT = {F32: "f32", BF16: "bf16", F16: "f16", F64: "f64"}
# The largest k of the fused serving kernels (one warp lane per candidate).
KERNEL_TOP_K = 32


@dataclass(frozen=True)
class BlockCase:
    batch: int
    draft: int
    vocab: int
    rank: int
    top_k: int
    logits_dtype: torch.dtype = torch.float32
    codebook_dtype: torch.dtype = torch.float32
    projected_dtype: torch.dtype | None = None  # None: the codebook dtype

    @property
    def id(self) -> str:
        projected = SHORT[self.projected_dtype] if self.projected_dtype else "="
        return (f"B{self.batch}D{self.draft}V{self.vocab}r{self.rank}k{self.top_k}-"
                f"{SHORT[self.logits_dtype]}/{SHORT[self.codebook_dtype]}/{projected}")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return self.logits_dtype, self.codebook_dtype, self.projected_dtype or self.codebook_dtype

    @property
    def on_kernels(self) -> bool:
        """Whether the compiled kernels take this block (else the reference runs it)."""
        return self.top_k <= KERNEL_TOP_K and F64 not in self.dtypes


BLOCK_CASES = [
    BlockCase(1, 1, 1, 1, 1),
    BlockCase(2, 3, 37, 7, 5),
    BlockCase(3, 4, 1000, 128, 16),
    BlockCase(2, 7, 2053, 129, 16, torch.bfloat16, torch.bfloat16),
    BlockCase(2, 5, 3001, 256, 32, torch.float16, torch.float16),
    BlockCase(3, 2, 70_001, 64, 16, torch.bfloat16, torch.bfloat16, torch.float32),
    BlockCase(1, 8, 5000, 33, 7, torch.float32, torch.bfloat16, torch.float32),
    BlockCase(4, 3, 600, 256, 32, torch.bfloat16, torch.float32),
]

# Beyond the kernels: k above the 32 lanes (up to k = V) and float64, alone and mixed
# with float32.
WIDE_BLOCK_CASES = [
    BlockCase(2, 3, 300, 16, 33),
    BlockCase(2, 4, 2053, 129, 48, BF16, BF16),
    BlockCase(3, 5, 1000, 64, 64, F16, F16, F32),
    BlockCase(2, 3, 40, 8, 40),  # k = V
    BlockCase(2, 4, 500, 32, 16, F64, F64),  # float64 at a k the kernels take
    BlockCase(2, 3, 300, 24, 64, F64, F64),
    BlockCase(2, 3, 300, 24, 8, F32, F64),  # float32 logits, float64 codebooks
    BlockCase(2, 3, 300, 24, 8, F64, F32),  # float64 logits, float32 codebooks
    BlockCase(2, 3, 300, 24, 33, F32, F32, F64),  # float64 projected
    BlockCase(2, 3, 37, 7, 37, F64, F32, F32),  # k = V, float64 logits
]


def distinct_top_logits(shape: tuple[int, ...], vocab: int, top_k: int, dtype: torch.dtype,
                        generator: torch.Generator) -> torch.Tensor:
    """Logits whose 2k largest values per row are distinct in any 16-bit dtype.

    The rest is N(0, 1); the top 2k sit at 8 + i/4 (i < 2k) at random positions, so the
    candidates, their order and hence the walk are unique for every implementation.
    """
    rows = int(torch.tensor(shape).prod())
    logits = torch.randn(rows, vocab, generator=generator)
    lifted = min(2 * top_k, vocab)
    for row in range(rows):
        positions = torch.randperm(vocab, generator=generator)[:lifted]
        logits[row, positions] = 8.0 + torch.arange(lifted, dtype=torch.float32) / 4
    return logits.view(*shape, vocab).to(dtype)


def block_inputs(case: BlockCase, device: str, *, seed: int = 0, scale: float = 0.5):
    """(projected [B, D, r], logits [B, D, V], anchor_ids [B], A [V, r], B [V, r])."""
    g = torch.Generator().manual_seed(seed)
    # Cases with a float64 input draw in float64, so those values are not float32's.
    source = F64 if F64 in case.dtypes else F32
    logits = distinct_top_logits((case.batch, case.draft), case.vocab, case.top_k, case.logits_dtype, g)
    projected = torch.randn(case.batch, case.draft, case.rank, generator=g, dtype=source)
    predecessor = torch.randn(case.vocab, case.rank, generator=g, dtype=source) * scale
    successor = torch.randn(case.vocab, case.rank, generator=g, dtype=source) * scale
    anchors = torch.randint(0, case.vocab, (case.batch,), generator=g)
    projected = projected.to(case.projected_dtype or case.codebook_dtype)
    return (projected.to(device), logits.to(device), anchors.to(device),
            predecessor.to(case.codebook_dtype).to(device), successor.to(case.codebook_dtype).to(device))


def as_float64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.double() if t.is_floating_point() else t for t in tensors]


def walk_over_edges(edges: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """The greedy walk over given edge scores [B, D, k, k]: path [B, D] (torch.argmax's ties)."""
    batch, draft = candidate_ids.shape[:2]
    rows = torch.arange(batch, device=edges.device)
    choice = torch.zeros(batch, dtype=torch.long, device=edges.device)
    path = []
    for t in range(draft):
        choice = edges[rows, t, choice].argmax(-1)
        path.append(candidate_ids[rows, t, choice])
    return torch.stack(path, 1)


@dataclass(frozen=True)
class VerifyCase:
    batch: int
    draft: int
    vocab: int
    top_k: int
    target_dtype: torch.dtype = torch.float32
    proposal: str = "random"  # random | close | covering | onehot
    proposal_dtype: torch.dtype = torch.float32

    @property
    def id(self) -> str:
        proposal_dtype = "" if self.proposal_dtype == F32 else f"-q{SHORT[self.proposal_dtype]}"
        return (f"B{self.batch}D{self.draft}V{self.vocab}k{self.top_k}-{str(self.target_dtype)[6:]}-{self.proposal}"
                f"{proposal_dtype}")


VERIFY_CASES = [
    VerifyCase(64, 1, 10, 1),
    VerifyCase(64, 3, 10, 4, proposal="close"),
    VerifyCase(64, 4, 37, 5, torch.bfloat16),
    VerifyCase(48, 7, 4097, 16, proposal="close"),
    VerifyCase(32, 7, 9000, 16, proposal="covering"),
    VerifyCase(32, 5, 300, 40),
    VerifyCase(32, 7, 20_000, 16, proposal="onehot"),
]

# float64 probabilities (target, proposal or both), which the kernels do not take.
WIDE_VERIFY_CASES = [
    VerifyCase(64, 3, 10, 4, F64, "close"),
    VerifyCase(64, 4, 37, 5, F64),
    VerifyCase(48, 7, 4097, 16, F64, "close"),
    VerifyCase(32, 7, 9000, 16, F64, "covering"),
    VerifyCase(32, 5, 300, 40, F64, proposal_dtype=F64),
    VerifyCase(32, 4, 300, 64, F32, "close", proposal_dtype=F64),
    VerifyCase(32, 7, 2000, 16, F64, "onehot"),
]


def verify_inputs(case: VerifyCase, device: str, *, seed: int = 0):
    """(draft_tokens, target_probs, draft_probs, candidate_ids, uniforms) for one case.

    random: p and q unrelated; close: a sharp p, candidates its top k and q p
    renormalised on them (most tokens accepted); covering: p is q / 2 on the candidates and 0 elsewhere (an
    unnormalised row), so half the tokens are rejected with an empty residual and the
    bonus falls back to p; onehot: a greedy draft (q a point mass).
    """
    g = torch.Generator().manual_seed(seed)
    b, d, v, k = case.batch, case.draft, case.vocab, case.top_k
    sharpness = 8.0 if case.proposal == "close" else 3.0
    # Cases with float64 probabilities draw them in float64, so they are not float32's.
    source = F64 if F64 in (case.target_dtype, case.proposal_dtype) else F32
    target = torch.softmax(torch.randn(b, d + 1, v, generator=g, dtype=source) * sharpness, -1)
    candidates = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(b * d)]).view(b, d, k)
    if case.proposal == "close":  # the walk's candidates: the top of the distribution
        candidates = target[:, :d].topk(k, dim=-1).indices
    if case.proposal == "random":
        proposal = torch.softmax(torch.randn(b, d, k, generator=g, dtype=source) * 2, -1)
    elif case.proposal == "onehot":
        proposal = torch.zeros(b, d, k, dtype=source)
        proposal[..., 0] = 1.0
    else:
        on_candidates = target[:, :d].gather(-1, candidates)
        proposal = on_candidates / on_candidates.sum(-1, keepdim=True)
        if case.proposal == "covering":
            target[:, :d] = 0
            target[:, :d].scatter_(-1, candidates, proposal / 2)
    drawn = torch.multinomial(proposal.view(-1, k), 1, generator=g).view(b, d, 1)
    tokens = candidates.gather(-1, drawn).squeeze(-1)
    uniforms = torch.rand(b, d + 1, generator=g)
    tensors = (tokens, target.to(case.target_dtype), proposal.to(case.proposal_dtype), candidates, uniforms)
    return tuple(t.to(device) for t in tensors)


def topk_logits(rows: int, vocab: int, dtype: torch.dtype, kind: str, seed: int = 0) -> torch.Tensor:
    """random: N(0, 1); ties: a handful of distinct values, so every top-k is full of ties;
    special: -inf every 7th column, a NaN in the first row, +inf in the last."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(-2, 3, (rows, vocab), generator=g).to(dtype)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    if kind == "special":
        logits[:, ::7] = float("-inf")
        logits[0, vocab // 2] = float("nan")
        logits[-1, 0] = float("inf")
    return logits


def select_path(ops, projected, logits, anchors, a, b, top_k, temperature, uniforms):
    """ops.select_path (torch.ops.dflash2 or dflash2_emulated) with the caller's uniforms,
    the score dtype and P's dtype chosen as the public API does:
    (path, candidate_ids, draft_probs, edges)."""
    score_dtype = reference.serving_score_dtype(logits, projected, a)
    if projected.dtype != a.dtype:
        projected = projected.float()
    return ops.select_path(logits, projected, a, b, anchors, uniforms, top_k, temperature, score_dtype)


def assert_proposal_is_the_softmax(where: str, q: torch.Tensor, edge_row: torch.Tensor, temperature: float) -> None:
    """q [k] float32 is softmax(edge_row.float() / T), judged against that softmax in
    float64. The contract's z = scores.float() / T is fp32 arithmetic: rounding the
    scores, then dividing (or multiplying by a rounded 1 / T, as torch's CUDA division
    by a scalar does) leaves each z_j within 2 eps32 |z_j|, and z_j - max z within
    eps32 |z_j - max z| more. Softmax carries exponent errors d into q_i (d_i - sum_j q_j d_j),
    that is q_i ((1 - q_i) d_i - sum_{j != i} q_j d_j). Next to SPEC section 4's floor of q,
    each q_i may be off by eps32 q_i ((1 - 2 q_i) a_i + sum_j q_j a_j) with
    a_j = 2|z_j| + |z_j - max z|: the error an exact fp32 softmax of these scores can
    have, not a tolerance of ours. Without it a score of 50 at T = 0.3 makes a one-ulp
    change of z a 20-ulp change of q, and which host rounds which way decides the test."""
    z = (edge_row.float() / temperature).double()
    exact = torch.softmax(z, -1)
    finite = torch.isfinite(z)
    argument = torch.where(finite, 2 * z.abs() + (z.max() - z), torch.zeros_like(z))
    eps32 = torch.finfo(torch.float32).eps
    conditioning = eps32 * exact * ((1 - 2 * exact) * argument + (exact * argument).sum())
    error = (q.double() - exact).abs()
    bound = contract_floor(torch.float32, exact.max().item()) + conditioning
    worst = (error - bound).argmax().item()
    assert (error <= bound).all(), (
        f"{where} q: q[{worst}] = {q[worst].item():.9g}, softmax {exact[worst].item():.9g}: off by "
        f"{error[worst].item():.3e} > {bound[worst].item():.3e} (SPEC floor + fp32 conditioning of the scores)")


def assert_sampled_walk_follows_its_edges(path, candidates, draft_probs, edges, uniforms, temperature) -> None:
    """Each step's q is softmax(edge row / T) of the row the path came from, and each
    draw is q's inverse-CDF draw at its uniform (up to fp32 rounding of the sums)."""
    path, candidates, draft_probs, edges, uniforms = (t.cpu() for t in (path, candidates, draft_probs, edges,
                                                                        uniforms))
    batch, draft = path.shape
    for b in range(batch):
        row = 0
        for t in range(draft):
            where = f"b={b} t={t}"
            q = draft_probs[b, t]
            assert_proposal_is_the_softmax(where, q, edges[b, t, row], temperature)
            chosen = (candidates[b, t] == path[b, t]).nonzero()
            assert chosen.numel() == 1, f"{where}: the path left the candidates"
            row = chosen.item()
            running = q.double().cumsum(0)
            target = uniforms[b, t].item() * running[-1].item()
            assert q[row] > 0, f"{where}: drew an index without mass"
            assert running[row].item() > target - 1e-5, f"{where}: drew below the uniform"
            assert row == 0 or running[row - 1].item() <= target + 1e-5, f"{where}: skipped the uniform's index"
