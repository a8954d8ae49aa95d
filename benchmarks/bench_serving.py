"""Benchmark the serving path per drafted block: ours vs PyTorch written the way upstream
(NeMo Automodel) does it.

    python benchmarks/bench_serving.py [--out results.jsonl] [--no-compile] [--quick]
                                       [--full] [--batch B ...]

    --full     on CPU, the GPU shapes (V = 248,320, B up to 128): slow
    --batch B  only these batch sizes (repeatable)

Four measurements, each per call for one drafted block of B sequences x D positions:

- walk (the selection: top-k of the logits, every adjacent pair's edge score, one path),
  greedy (T = 0) and sampled (T = 1): ``dk.walk`` against NeMo's steps in eager PyTorch
  (torch.topk, then per position: gate = A[pred] * P[:, t]; scores = U[:, t] +
  einsum(gate, B[cand[:, t]]); argmax, or softmax + multinomial; the chosen candidate
  is the next predecessor), and torch.compile of those steps (skipped with
  --no-compile). GB/s over the minimal bytes: the logits, P and the gathered codebook
  rows read once.
- top-k alone: ``dk.candidate_topk`` on logits [B*D, V] against torch.topk; GB/s over
  the logits read once (B*D*V*2 bytes) and its percent of the measured copy bandwidth.
- rejection sampling: ``dk.rejection_sample`` with fp32 target_probs [B, D+1, V]
  against NeMo's rule looped over the sequences (gather p and q at the drafts, rand,
  cumprod, ``.item()`` on the accepted count, residual scatter_add, clamp, normalise,
  multinomial). GB/s over one V-row of p read per sequence.
- greedy verify: ``dk.greedy_verify`` on bf16 target logits [B, D+1, V] against the
  per-sequence loop (argmax, compare, ``.item()``). GB/s over the logits read once.

On CUDA every op that captures is also timed replayed from a CUDA graph ("(graph)"
rows), which removes the launch overhead that dominates at small B. Shapes: on CUDA
B in {1, 8, 32, 128}, D = 7, V = 248,320, k = 16, r = 256, bf16 logits, codebooks and
P; on CPU V = 32,000 and B in {1, 8} unless --full. The "ours x" column is each row's
time over ours (plain timing) for the same case. After the table, the issue's H200
targets beside the measured numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash2_kernels as dk  # noqa: E402

from common import Row, print_table, start_run, time_cuda_graph, time_fn, write_records  # noqa: E402

DRAFT, TOP_K, RANK = 7, 16, 256
GPU_VOCAB, CPU_VOCAB = 248_320, 32_000
GPU_BATCHES, CPU_BATCHES = (1, 8, 32, 128), (1, 8)
TARGET_BATCH = 32


def _own_options() -> argparse.Namespace:
    """This benchmark's flags, taken out of sys.argv before start_run parses the shared ones."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--batch", type=int, action="append")
    own, rest = parser.parse_known_args()
    sys.argv = sys.argv[:1] + rest
    return own


@dataclass(frozen=True)
class Shape:
    batch: int
    vocab: int
    draft: int = DRAFT
    top_k: int = TOP_K
    rank: int = RANK

    @property
    def name(self) -> str:
        return f"B{self.batch} D{self.draft} V{self.vocab} k{self.top_k} r{self.rank}"


# --- upstream's steps in PyTorch ---------------------------------------------------------


def torch_walk(projected, logits, anchor_ids, predecessor_codebook, successor_codebook, top_k: int,
               temperature: float):
    """NeMo's walk: torch.topk, then a Python loop over the positions."""
    unary, candidates = torch.topk(logits, top_k, dim=-1)  # [B, D, k]
    predecessor = anchor_ids
    path, probs = [], []
    for t in range(logits.shape[1]):
        gate = predecessor_codebook[predecessor] * projected[:, t]  # [B, r]
        scores = unary[:, t] + torch.einsum("br,bkr->bk", gate, successor_codebook[candidates[:, t]])
        if temperature > 0:
            q = torch.softmax(scores.float() / temperature, dim=-1)
            choice = torch.multinomial(q, 1).squeeze(1)
            probs.append(q)
        else:
            choice = scores.argmax(dim=-1)
        predecessor = candidates[:, t].gather(1, choice.unsqueeze(1)).squeeze(1)
        path.append(predecessor)
    return torch.stack(path, 1), candidates, torch.stack(probs, 1) if probs else None


def torch_rejection_sample(draft_tokens, target_probs, draft_probs, candidate_ids):
    """NeMo's per-sequence rejection sampling, looped over the batch."""
    batch, draft = draft_tokens.shape
    accepted_all, bonus_all = [], []
    for b in range(batch):
        tokens, p_all, q_all, cand = draft_tokens[b], target_probs[b], draft_probs[b], candidate_ids[b]
        p = p_all[:draft].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        q = (q_all * (cand == tokens.unsqueeze(-1))).sum(-1)
        u = torch.rand(draft, device=tokens.device)
        accepted = int((u * q < p).long().cumprod(0).sum().item())
        if accepted < draft:
            residual = p_all[accepted].clone()
            residual.scatter_add_(0, cand[accepted], -q_all[accepted].to(residual.dtype))
            residual = residual.clamp_min(0)
            mass = residual.sum()
            distribution = torch.where(mass > 0, residual / mass, p_all[accepted])
        else:
            distribution = p_all[draft]
        bonus_all.append(torch.multinomial(distribution, 1))
        accepted_all.append(accepted)
    return torch.tensor(accepted_all, device=draft_tokens.device), torch.cat(bonus_all)


def torch_greedy_verify(draft_tokens, target_logits):
    """Greedy verification looped over the sequences, as upstream serves it."""
    draft = draft_tokens.shape[1]
    accepted_all, bonus_all = [], []
    for b in range(draft_tokens.shape[0]):
        target = target_logits[b].argmax(-1)  # [D+1]
        accepted = int((draft_tokens[b] == target[:draft]).long().cumprod(0).sum().item())
        accepted_all.append(accepted)
        bonus_all.append(target[accepted])
    return torch.tensor(accepted_all, device=draft_tokens.device), torch.stack(bonus_all)


# --- inputs ------------------------------------------------------------------------------


def make_block(shape: Shape, device: torch.device, codebooks):
    """One drafted block: the drafter's logits and P, anchors, and what verification needs
    (the walk's path and q, the verifier's probabilities with most mass on the drafter's
    top candidates so that a realistic share of drafts is accepted)."""
    g = torch.Generator(device=device).manual_seed(shape.batch)
    bf16 = torch.bfloat16
    logits = (torch.randn(shape.batch, shape.draft, shape.vocab, device=device, generator=g) * 3).to(bf16)
    projected = torch.randn(shape.batch, shape.draft, shape.rank, device=device, generator=g).to(bf16)
    anchors = torch.randint(0, shape.vocab, (shape.batch,), device=device, generator=g)
    path, candidates, draft_probs = dk.walk(projected, logits, anchors, *codebooks, shape.top_k, 1.0, generator=g)
    target_logits = torch.randn(shape.batch, shape.draft + 1, shape.vocab, device=device, generator=g).to(bf16)
    target_logits[:, :-1] = 2 * logits + 0.5 * target_logits[:, :-1]  # a sharper verifier that mostly agrees
    target_probs = torch.softmax(target_logits.float(), dim=-1)
    return dict(logits=logits, projected=projected, anchors=anchors, path=path, candidates=candidates,
                draft_probs=draft_probs, target_logits=target_logits, target_probs=target_probs)


def make_codebooks(vocab: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    return tuple((torch.randn(vocab, RANK, device=device, generator=g) * 0.02).to(torch.bfloat16) for _ in range(2))


# --- measuring ---------------------------------------------------------------------------


class Bench:
    def __init__(self, run):
        self.run, self.device, self.rows = run, run.device, []
        cpu = run.device.type == "cpu"
        self.plain = dict(warmup=2, reps=10, budget_s=2.0) if cpu else dict(warmup=3, reps=20, budget_s=3.0)
        self.notes: list[str] = []

    def measure(self, bench: str, case: str, impl: str, fn, nbytes: int, *, graph: bool = True, **extra):
        """Plain timing, plus CUDA-graph timing on CUDA where ``fn`` captures."""
        self.rows.append(Row(bench, case, impl, time_fn(fn, self.device, **self.plain), nbytes, self.run.copy_gbps,
                             dict(extra)))
        if graph and self.device.type == "cuda":
            try:
                timing = time_cuda_graph(fn, self.device)
            except Exception as error:  # an op that syncs or draws from an uncapturable generator
                try:
                    torch.cuda.synchronize(self.device)
                except RuntimeError:
                    pass
                self.notes.append(f"{bench} {case} {impl}: no CUDA graph ({type(error).__name__}: "
                                  f"{str(error).splitlines()[0][:100]})")
                return
            self.rows.append(Row(bench, case, f"{impl} (graph)", timing, nbytes, self.run.copy_gbps, dict(extra)))

    def best_ms(self, bench: str, case: str, impl: str) -> float | None:
        times = [r.timing.median_ms for r in self.rows
                 if r.bench == bench and r.case == case and r.impl in (impl, f"{impl} (graph)")]
        return min(times) if times else None

    def row(self, bench: str, case: str, impl: str) -> Row | None:
        return next((r for r in self.rows if r.bench == bench and r.case == case and r.impl == impl), None)


def walk_bytes(shape: Shape) -> int:
    per_position = shape.vocab * 2 + shape.rank * 2 + 2 * shape.top_k * shape.rank * 2  # logits, P, A and B rows
    return shape.batch * shape.draft * per_position


def bench_shape(bench: Bench, shape: Shape, codebooks, compiled_walk) -> None:
    block = make_block(shape, bench.device, codebooks)
    logits, projected, anchors = block["logits"], block["projected"], block["anchors"]
    args = (projected, logits, anchors, *codebooks, shape.top_k)

    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        case = f"{mode} {shape.name}"
        nbytes = walk_bytes(shape)
        bench.measure("walk", case, "ours", lambda t=temperature: dk.walk(*args, t), nbytes)
        bench.measure("walk", case, "torch loop", lambda t=temperature: torch_walk(*args, t), nbytes)
        if compiled_walk is not None:
            try:
                bench.measure("walk", case, "torch loop compiled", lambda t=temperature: compiled_walk(*args, t),
                              nbytes, graph=False)
            except Exception as error:
                bench.notes.append(f"walk {case}: torch.compile failed ({type(error).__name__})")

    flat = logits.view(-1, shape.vocab)
    case = f"topk {shape.name}"
    nbytes = flat.numel() * flat.element_size()
    bench.measure("topk", case, "ours", lambda: dk.candidate_topk(flat, shape.top_k), nbytes)
    bench.measure("topk", case, "torch.topk", lambda: torch.topk(flat, shape.top_k, dim=-1), nbytes)

    verify = (block["path"], block["target_probs"], block["draft_probs"], block["candidates"])
    accepted, _ = dk.rejection_sample(*verify)
    case = f"rejection {shape.name}"
    nbytes = shape.batch * shape.vocab * 4
    mean_accepted = float(accepted.float().mean())
    bench.notes.append(f"rejection {shape.name}: {mean_accepted:.2f} of {shape.draft} drafts accepted on average")
    bench.measure("rejection", case, "ours", lambda: dk.rejection_sample(*verify), nbytes,
                  mean_accepted=mean_accepted)
    bench.measure("rejection", case, "torch loop", lambda: torch_rejection_sample(*verify), nbytes, graph=False,
                  mean_accepted=mean_accepted)

    case = f"greedy verify {shape.name}"
    greedy = (block["path"], block["target_logits"])
    nbytes = block["target_logits"].numel() * 2
    bench.measure("greedy_verify", case, "ours", lambda: dk.greedy_verify(*greedy), nbytes)
    bench.measure("greedy_verify", case, "torch loop", lambda: torch_greedy_verify(*greedy), nbytes, graph=False)


def print_targets(bench: Bench, shapes: list[Shape]) -> None:
    """The issue's H200 targets beside what this run measured (B = 32 where it ran).

    Selection: the PyTorch loop as upstream runs it (eager) over our best time (plain or
    replayed from a CUDA graph); the loop replayed from a graph is shown beside it."""
    at = next((s for s in shapes if s.batch == TARGET_BATCH), shapes[-1])
    judged = bench.device.type == "cuda" and at.vocab == GPU_VOCAB and at.batch == TARGET_BATCH
    scope = "" if judged else f"; this run: {at.name} on {bench.device.type}, for reference only"
    print(f"\n# targets (H200, B = 32, V = 248,320){scope}")

    def verdict(ok: bool) -> str:
        return ("  MET" if ok else "  MISSED") if judged else ""

    def us(ms: float | None) -> str:
        return f"{ms * 1e3:10.1f} us" if ms is not None else f"{'-':>10}   "

    for mode in ("greedy", "sampled"):
        case = f"{mode} {at.name}"
        ours = bench.best_ms("walk", case, "ours")
        loop = bench.row("walk", case, "torch loop")
        loop_graph = bench.row("walk", case, "torch loop (graph)")
        if ours is None or loop is None:
            continue
        ratio = loop.timing.median_ms / ours
        line = (f"  selection {mode:7}: ours {us(ours)} vs torch loop {us(loop.timing.median_ms)} = {ratio:7.1f}x"
                f"   (target >= 10x){verdict(ratio >= 10)}")
        if loop_graph is not None:
            graph_ms = loop_graph.timing.median_ms
            line += f"; the loop in a CUDA graph: {us(graph_ms)} = {graph_ms / ours:.1f}x"
        print(line)
    topk = [r for r in bench.rows if r.bench == "topk" and r.case == f"topk {at.name}" and r.impl.startswith("ours")]
    if topk:
        best = max(topk, key=lambda r: r.gbps)
        pct = 100 * best.gbps / best.copy_gbps
        print(f"  top-k            : {best.gbps:10.1f} GB/s = {pct:5.1f}% of copy bandwidth"
              f"   (target >= 60%){verdict(pct >= 60)}")
    ours = bench.best_ms("rejection", f"rejection {at.name}", "ours")
    if ours is not None:
        print(f"  rejection        : {us(ours)}   (target <= 20 us){verdict(ours * 1e3 <= 20)}")


def main() -> None:
    own = _own_options()
    run = start_run(__doc__, quick_help="one batch size: B = 32 on CUDA, B = 8 on CPU")
    args, device = run.args, run.device
    full = device.type == "cuda" or own.full
    vocab = GPU_VOCAB if full else CPU_VOCAB
    batches = own.batch or (list(GPU_BATCHES) if full else list(CPU_BATCHES))
    if args.quick and not own.batch:
        batches = [TARGET_BATCH if full else CPU_BATCHES[-1]]
    shapes = [Shape(b, vocab) for b in batches]
    from dflash2_kernels._extension import has_kernel

    kernels = {op: has_kernel(op, device.type) for op in ("candidate_topk", "select_path", "rejection_sample")}
    print("# kernels registered for " + device.type + ": "
          + ", ".join(f"{op} {'yes' if ok else 'no (reference)'}" for op, ok in kernels.items()))

    compiled_walk = None if args.no_compile else torch.compile(torch_walk, dynamic=True)
    bench = Bench(run)
    codebooks = make_codebooks(vocab, device)
    with torch.inference_mode():
        for shape in shapes:
            bench_shape(bench, shape, codebooks, compiled_walk)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print_table(bench.rows)
    for note in bench.notes:
        print("# " + note)
    print_targets(bench, shapes)
    write_records(bench.rows, run.env, args.out)


if __name__ == "__main__":
    main()
