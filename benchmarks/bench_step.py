"""Benchmark whole steps, upstream against patched: a speculators training step and a NeMo
Automodel serving step, before and after ``dk.patch`` of the same model.

    python benchmarks/bench_step.py [--out results.jsonl] [--no-compile] [--quick]
                                    [--full] [--layers N]
                                    [--head [--budget-mib M] [--vocab V ...]
                                            [--trainers speculators nemo]]

    --full       on CPU, the real shapes below (fp32 there: tens of GB, slow)
    --layers N   draft layers (default 2)
    --no-compile on CUDA, run speculators' forward eagerly (speculators wraps it in
                 torch.compile whenever CUDA is available: both sides then run compiled)
    --quick      the training step only
    --head       the training step with the fused head instead (see "head" below)
    --budget-mib the memory budget of --head's anchor search (default 4096)
    --vocab      --head's vocabularies (default 151936 248320)
    --trainers   --head's training steps (default: speculators nemo)
    --drafter D  a real drafter's shape instead (qwen3-8b: a Qwen3-8B verifier's drafter
                 as speculators' DFlash 2 defaults build it, DRAFTERS below); with
                 --head, at its own vocabulary only
    --no-anchor-search  --head without the anchor search (a GPU run's time)

What runs (one model per step, switched between the two sides in place by
``dk.patch(model)`` / ``dk.unpatch(model)``, which keep the very Parameters and so the
optimizer; the sides' steps are timed in turns, then their memory measured):

- train: ``DFlash2DraftModel.forward`` (speculators 0.9.0's real training forward:
  anchors, the draft layers with their 4 convs each, the LM head, the verifier's
  targets, the selector's ``score_candidates``, KL unary loss + selector K-way
  cross-entropy), backward, AdamW step, zero_grad. One packed sequence of T verifier
  tokens with A anchors of L = 8 rows (A * L draft rows). Upstream: speculators'
  PyTorch conv and selector.
- serve greedy / serve sampled: one drafted block for each of B requests with NeMo's
  ``Qwen3DFlash2DraftModel``: embed ``[anchor, MASK x 7]``, the draft forward over C
  new context features + the block (no KV cache: both sides alike), the head -> draft
  logits [B, 7, V], ``candidate_selector.walk`` (T = 0 / T = 1), then verification
  against stand-in target distributions [B, 8, V] (the target's forward is not
  timed: it is the same with or without this package). Upstream greedy: the
  longest-prefix-equal-to-argmax rule of NeMo's ``spec_generate``, batched; upstream
  sampled: NeMo's ``dflash2_rejection_sample``, which takes one request, in a loop
  (``.item()`` per request, as spec_generate does). Ours: the patched walk, then
  ``dk.greedy_verify`` / ``dk.rejection_sample`` on the whole batch.

- head (``--head``): the training steps at the real vocabularies (V 151,936, Qwen3's, and
  248,320, Qwen3.8's), three ways: upstream, ``ours`` (``dk.patch(model)``: conv and
  selector) and ``ours+head`` (``dk.patch(model, fused_head=True)``: the losses,
  candidates and metrics from dk.draft_head, no [rows, V] tensor). speculators: the
  train step above. NeMo: ``DFlash2TrainerModule.forward`` (its block CE with decay
  gamma 4 + selector CE; the draft of the serving step below, a frozen bias-free target
  head and embeddings), backward, AdamW, one sequence of T tokens with A anchors
  (``num_anchors``; A * (L - 1) predicted rows, logits for A * L). Each row also gives
  the largest number of anchors (doubling from 16) whose step stays within the memory
  budget: the number of anchors a user can raise their run to.

Time: median (p20, p80) ms per step after 2 warm-up steps per side, the two sides'
steps taking turns so that a load change on a shared machine hits both alike (CUDA:
events, after an L2 flush; CPU: perf_counter).

Memory, "peak MiB": on CUDA ``torch.cuda.max_memory_allocated`` during one step minus
what was allocated before it (the step's own peak: activations, gradients, optimizer
temporaries, kernel scratch). On CPU, where torch's allocator keeps no statistics: the
process's peak resident set during one step minus the resident set just before it
(Linux VmHWM after resetting it), with glibc's mmap threshold fixed at 64 KiB and
``malloc_trim`` before the step, so that every tensor over 64 KiB is its own mapping
and the resident set follows live memory (repeat measurements agree to 0.1 MiB; with
glibc's defaults they scatter by tens of MiB). It counts every page the step touched,
kernel scratch and small heap allocations included, the same way for both sides.

Shapes. Default on CPU (fp32): H 256 (4 heads of 64, 2 KV heads, MLP 768), V 8192,
r 256, k 16, L 8, T 1024 tokens and A 64 anchors (512 rows), 3 verifier layers of
features; serving B 8, C 8. On CUDA or with --full (SPEC section 5; bf16 on CUDA):
H 5120 (a Qwen3-style layer: 32 heads of 128, 8 KV heads, MLP 17408: the drafters'
attention and MLP shapes are not in SPEC, and they cost both sides the same), V 248,320,
r 256, k 16, L 8, T 4096 and A 512 (4096 rows); serving B 32, C 8.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash2_kernels as dk  # noqa: E402
from dflash2_kernels.compat.compiled import uncompiled  # noqa: E402

from common import Row, Timing, settled_peak_bytes, start_run, time_side_by_side, write_records  # noqa: E402


@dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tokens: int  # T, verifier positions in the packed training sequence
    anchors: int  # A; draft rows = A * block
    requests: int  # B, serving
    layers: int = 2
    rank: int = 256
    top_k: int = 16
    block: int = 8
    taps: int = 2
    group: int = 16
    aux_layers: int = 3  # verifier layers whose hidden states feed the draft
    context: int = 8  # C, new context features per serving step
    autocast: bool = False  # fp32 weights, the step under bf16 autocast (speculators' trainer)

    @property
    def name(self) -> str:
        return f"H{self.hidden} V{self.vocab} L{self.block} r{self.rank} k{self.top_k} x{self.layers} layers"


CPU_SIZE = Size(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=8192, tokens=1024, anchors=64,
                requests=8)
FULL_SIZE = Size(hidden=5120, heads=32, kv_heads=8, head_dim=128, intermediate=17408, vocab=248_320, tokens=4096,
                 anchors=512, requests=32)
# Real drafters as speculators 0.9.0's DFlash 2 defaults build them (train/config/schema.py:
# 5 layers, block 8, max_anchors 512, total_seq_len 8192, fp32 master weights and bf16
# autocast; the draft's attention and MLP shapes from the verifier's config).
DRAFTERS = {
    "qwen3-8b": Size(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151_936,
                     tokens=8192, anchors=512, requests=32, layers=5, autocast=True),
}


def _own_options() -> argparse.Namespace:
    """This benchmark's flags, taken out of sys.argv before start_run parses the shared ones."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--budget-mib", type=float, default=4096.0)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151_936, 248_320])
    parser.add_argument("--trainers", nargs="+", choices=sorted(TRAINERS), default=["speculators", "nemo"])
    parser.add_argument("--drafter", choices=sorted(DRAFTERS))
    parser.add_argument("--no-anchor-search", action="store_true")
    own, rest = parser.parse_known_args()
    sys.argv = sys.argv[:1] + rest
    return own


def qwen3_config(size: Size, layers: int):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, head_dim=size.head_dim,
                         max_position_embeddings=2 * (size.tokens + size.anchors * size.block))
    # SDPA with a dense mask on both sides (speculators' default, flex attention,
    # compiles its block mask; NeMo's trainer chooses per backend).
    config._attn_implementation = "sdpa"
    return config


def steady_heap() -> None:
    """On CPU, fix glibc's mmap threshold at 64 KiB (mallopt; it also stops glibc from
    raising the threshold as large blocks are freed): every tensor over 64 KiB is then
    its own mapping, unmapped when freed, so the resident set follows live memory
    (repeat measurements agree to 0.1 MiB; with glibc's defaults they scatter by tens
    of MiB). It slows large allocations, so it is set after all the timing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


# --- training: speculators ---------------------------------------------------------------


def speculators_model(size: Size, device: torch.device, dtype: torch.dtype):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = DFlash2SpeculatorConfig(
        transformer_layer_config=qwen3_config(size, size.layers),
        draft_vocab_size=size.vocab,
        block_size=size.block,
        aux_hidden_state_layer_ids=list(range(size.aux_layers)),
        mask_token_id=size.vocab - 1,
        conv_kernel_size=size.taps,
        conv_group_size=size.group,
        selector_rank=size.rank,
        selector_top_k=size.top_k,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=size.block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlash2DraftModel(config)
    with torch.no_grad():
        # Verifier-owned (frozen) weights: NaN until load_verifier_weights; random here.
        for weight in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
            weight.normal_(std=size.hidden ** -0.5)
        # Off the identity start, so the dynamic taps and transitions do real work.
        for name, parameter in model.named_parameters():
            if name.endswith("base_kernel"):
                parameter.normal_(0.5, 0.2)
            elif name.endswith("kernel_projection.weight"):
                parameter.normal_(std=0.1 * size.hidden ** -0.5)
    return model.to(dtype).train()


def train_step_fn(model, size: Size, device: torch.device, dtype: torch.dtype, compiled: bool):
    from speculators.models.dflash2 import DFlash2DraftModel

    generator = torch.Generator().manual_seed(0)
    tokens = size.tokens
    loss_mask = torch.ones(1, tokens, dtype=torch.long)
    loss_mask[:, : size.block] = 0
    data_dtype = torch.bfloat16 if size.autocast else dtype  # speculators' hidden_states_dtype
    batch = dict(
        hidden_states=torch.randn(1, tokens, size.aux_layers * size.hidden, generator=generator).to(data_dtype),
        input_ids=torch.randint(0, size.vocab - 1, (1, tokens), generator=generator),
        loss_mask=loss_mask,
        verifier_last_hidden_states=torch.randn(1, tokens, size.hidden, generator=generator).to(data_dtype),
        document_ids=(torch.arange(tokens) >= tokens // 2).long().unsqueeze(0),
    )
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    kwargs, _ = DFlash2DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                     max_anchors=size.anchors)
    forward = model.forward
    if not compiled:
        # speculators decorated forward with torch.compile at import (when CUDA is up).
        forward = uncompiled(type(model).forward).__get__(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step():
        torch.manual_seed(0)  # the same anchors every step, on both sides
        # The fused head is an instance-level forward (dk.patch(model, fused_head=True)),
        # compiled where the class's is: eager too when the class's is run eager here.
        fused = vars(model).get("forward")
        if fused is not None and not compiled:
            fused = uncompiled(fused.__func__).__get__(model)
        with torch.autocast(device.type, torch.bfloat16, enabled=size.autocast):
            _, loss, _ = (fused or forward)(**batch, **kwargs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


# --- training: NeMo -----------------------------------------------------------------------


def nemo_trainer_model(size: Size, device: torch.device, dtype: torch.dtype):
    """NeMo's DFlash2TrainerModule around a draft of ``size``, with a frozen, bias-free
    target head and embeddings of the same vocabulary (as its recipe freezes the target)."""
    from nemo_automodel.components.speculative.dflash.dflash2_core import DFlash2TrainerModule

    draft = nemo_draft(size, device, dtype).train()
    torch.manual_seed(1)
    with torch.device(device):
        head = nn.Linear(size.hidden, size.vocab, bias=False)
        embed = nn.Embedding(size.vocab, size.hidden)
    with torch.no_grad():
        head.weight.normal_(std=size.hidden ** -0.5)
    return DFlash2TrainerModule(draft_model=draft, target_lm_head=head.to(dtype).requires_grad_(False),
                                target_embed_tokens=embed.to(dtype).requires_grad_(False),
                                mask_token_id=size.vocab - 1, block_size=size.block, attention_backend="sdpa",
                                num_anchors=size.anchors, loss_decay_gamma=4.0, selector_loss_weight=1.0)


def nemo_train_step_fn(trainer, size: Size, device: torch.device, dtype: torch.dtype, compiled: bool):
    """One NeMo training step with ``size.anchors`` anchors (``compiled``: unused, NeMo's
    trainer compiles nothing itself)."""
    trainer.num_anchors = size.anchors
    generator = torch.Generator().manual_seed(0)
    loss_mask = torch.ones(1, size.tokens)
    loss_mask[:, : size.block] = 0
    batch = dict(input_ids=torch.randint(0, size.vocab - 1, (1, size.tokens), generator=generator),
                 hidden_states=torch.randn(1, size.tokens, size.aux_layers * size.hidden, generator=generator).to(dtype),
                 loss_mask=loss_mask)
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    optimizer = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=1e-5)

    def step():
        torch.manual_seed(0)  # the same anchors every step, on every side
        loss = trainer(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


# --- serving: NeMo ------------------------------------------------------------------------


def nemo_draft(size: Size, device: torch.device, dtype: torch.dtype):
    from nemo_automodel.components.speculative.dflash import draft_qwen3_dflash2

    config = qwen3_config(size, size.layers)
    config.num_target_layers = size.aux_layers + 1
    config.block_size = size.block
    config.dflash_config = {"block_size": size.block, "mask_token_id": size.vocab - 1,
                            "target_layer_ids": list(range(size.aux_layers)), "conv_kernel_size": size.taps,
                            "conv_group_size": size.group, "selector_rank": size.rank, "selector_top_k": size.top_k}
    torch.manual_seed(0)
    with torch.device(device):
        draft = draft_qwen3_dflash2.Qwen3DFlash2DraftModel(config)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if name.endswith("successor_codebook"):
                parameter.normal_(std=0.02)  # NeMo starts it at zero: the walk would ignore it
    return draft.to(dtype).eval()


def serve_step_fns(draft, size: Size, device: torch.device, dtype: torch.dtype, ours: bool) -> dict:
    """{"serve greedy": fn, "serve sampled": fn} for one drafted block of B requests."""
    from nemo_automodel.components.speculative.dflash import draft_qwen3_dflash2

    # Captured now: patch_nemo (not used here) would replace the module-level name.
    upstream_rejection_sample = draft_qwen3_dflash2.dflash2_rejection_sample
    generator = torch.Generator().manual_seed(1)
    batch, block, draft_len = size.requests, size.block, size.block - 1
    torch.manual_seed(1)
    embed = nn.Embedding(size.vocab, size.hidden).to(device, dtype)
    head = nn.Linear(size.hidden, size.vocab, bias=False).to(device, dtype)
    anchors = torch.randint(0, size.vocab - 1, (batch,), generator=generator).to(device)
    block_ids = torch.full((batch, block), size.vocab - 1, dtype=torch.long, device=device)
    block_ids[:, 0] = anchors
    features = torch.randn(batch, size.context, size.aux_layers * size.hidden, generator=generator).to(device, dtype)
    position_ids = torch.arange(size.context + block, device=device).expand(batch, -1)
    target_logits = (4 * torch.randn(batch, block, size.vocab, generator=generator)).to(device, dtype)
    target_probs = torch.softmax(target_logits.float(), dim=-1)
    selector = draft.candidate_selector

    def drafted():
        hidden = draft(position_ids=position_ids, noise_embedding=embed(block_ids), target_hidden=features)[:, 1:]
        return hidden, draft.compute_logits(hidden, head)

    @torch.inference_mode()
    def greedy():
        hidden, logits = drafted()
        path, _, _ = selector.walk(hidden, logits, anchors, 0.0)
        if ours:
            return dk.greedy_verify(path, target_logits)
        posterior = target_logits.argmax(-1)
        accepted = (path == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)
        return accepted, posterior.gather(1, accepted[:, None])[:, 0]

    @torch.inference_mode()
    def sampled():
        hidden, logits = drafted()
        path, candidate_ids, draft_probs = selector.walk(hidden, logits, anchors, 1.0)
        if ours:
            return dk.rejection_sample(path, target_probs, draft_probs, candidate_ids)
        results = [upstream_rejection_sample(path[b:b + 1], target_probs[b:b + 1], draft_probs[b:b + 1],
                                             candidate_ids[b:b + 1]) for b in range(batch)]
        return [accepted for accepted, _ in results], torch.stack([bonus for _, bonus in results])

    return {"serve greedy": greedy, "serve sampled": sampled}


# --- measuring and reporting --------------------------------------------------------------


@dataclass
class Side:
    """One (case, implementation): how to run it, and a way back to it after another
    side patched or unpatched the shared model."""

    case: str
    impl: str
    fn: Callable[[], object]  # one whole step
    restore: Callable[[], object]  # put the shared model in this side's state
    timing: Timing | None = None
    peak: int | None = None


def time_interleaved(sides: list[Side], device: torch.device, reps: int, budget_s: float = 60.0) -> None:
    """Time the sides of one case in turns (upstream, ours, upstream, ...), so that a load
    change on a shared machine hits both alike. Before each timed step, untimed: the
    side's ``restore`` and one step of it (on CUDA the first step after a swap may
    compile). Two warm-up steps per side first."""
    def restored_and_warm(side: Side) -> Callable[[], None]:
        def prepare() -> None:
            side.restore()
            side.fn()
        return prepare

    timings = time_side_by_side({id(side): side.fn for side in sides}, device, warmup=2, warmup_s=0.0, reps=reps,
                                budget_s=budget_s, prepare={id(side): restored_and_warm(side) for side in sides})
    for side in sides:
        side.timing = timings[id(side)]
        print(f"#   {side.case:28} {side.impl:9} {side.timing.median_ms:10.2f} ms", flush=True)


IMPLS = ("upstream", "ours", "ours+head")


def print_step_table(rows: list[Row]) -> None:
    """Per case: upstream, then ours (and ours+head), time and peak memory; "x up" is
    upstream's median over the row's, "mem x" upstream's peak over the row's; "max A" the
    most anchors within the budget (--head)."""
    header = (f"{'case':28} {'impl':9} {'median ms':>10} {'p20 ms':>9} {'p80 ms':>9} {'x up':>7} "
              f"{'peak MiB':>9} {'mem x':>6} {'max A':>6}")
    print(header)
    print("-" * len(header))
    upstream = {r.case: r for r in rows if r.impl == "upstream"}
    cases = list(dict.fromkeys(r.case for r in rows))
    for r in sorted(rows, key=lambda r: (cases.index(r.case), IMPLS.index(r.impl))):
        base = upstream.get(r.case)
        speed = f"{base.timing.median_ms / r.timing.median_ms:7.2f}" if base and r is not base else " " * 7
        peak = r.extra.get("peak_extra_mib")
        base_peak = base.extra.get("peak_extra_mib") if base else None
        memory = f"{base_peak / peak:6.2f}" if r is not base and peak and base_peak else " " * 6
        peak_text = f"{peak:9.1f}" if peak is not None else f"{'-':>9}"
        anchors = r.extra.get("max_anchors_within_budget")
        anchors_text = (f"{'<16':>6}" if "max_anchors_within_budget" in r.extra else " " * 6) if anchors is None else (
            f"{anchors:>5d}+" if anchors == r.extra.get("anchor_search_limit") else f"{anchors:6d}")
        print(f"{r.case:28} {r.impl:9} {r.timing.median_ms:10.2f} {r.timing.p20_ms:9.2f} {r.timing.p80_ms:9.2f} "
              f"{speed} {peak_text} {memory} {anchors_text}")


# --- the fused head: the training step at the real vocabularies ----------------------------


def _head_states(model) -> dict[str, Callable[[], object]]:
    """impl -> what puts the shared model in that state."""
    return {
        "upstream": lambda: dk.unpatch(model),
        "ours": lambda: (dk.unpatch(model), dk.patch(model)),
        "ours+head": lambda: dk.patch(model, fused_head=True),
    }


# The anchor search's last count: 512 anchors are 4096 rows, a step of tens of seconds
# at V 248,320 on two CPU cores; a row that still fits there reads "512+".
ANCHOR_SEARCH_LIMIT = 512


# trainer -> (model builder, step builder): what --head times.
TRAINERS = {"speculators": (speculators_model, train_step_fn), "nemo": (nemo_trainer_model, nemo_train_step_fn)}


def max_anchors_within(model, step_fn, size: Size, device, dtype, compiled: bool, budget_bytes: float,
                       start: int = 16, stop: int = ANCHOR_SEARCH_LIMIT) -> int | None:
    """The largest anchor count, doubling from ``start`` up to ``stop``, whose step's peak
    memory stays within the budget (None: not even ``start``). Stops at the first that
    does not fit: memory grows with the anchors."""
    best = None
    anchors = start
    while anchors <= stop:
        step = step_fn(model, replace(size, anchors=anchors), device, dtype, compiled)
        peak = settled_peak_bytes(step, device)
        print(f"#     {anchors:5d} anchors: {peak / 2**20:9.1f} MiB", flush=True)
        if peak is None or peak > budget_bytes:
            break
        best = anchors
        anchors *= 2
    return best


def head_sides(size: Size, trainers: list[str], vocabs: list[int], device, dtype, compiled: bool, reps: int,
               budget_bytes: float | None, copy_gbps: float) -> list[Row]:
    """Each trainer's step at each vocabulary, upstream / ours / ours+head; the anchor
    search within ``budget_bytes`` unless it is None."""
    rows = []
    for trainer, vocab in ((trainer, vocab) for trainer in trainers for vocab in vocabs):
        build_model, step_fn = TRAINERS[trainer]
        vsize = replace(size, vocab=vocab)
        model = build_model(vsize, device, dtype)
        case = f"train {trainer} V{vocab} A{vsize.anchors}"
        states = _head_states(model)
        sides = []
        for impl, restore in states.items():
            restore()
            sides.append(Side(case, impl, step_fn(model, vsize, device, dtype, compiled), restore))
        time_interleaved(sides, device, reps, budget_s=600.0)
        if device.type == "cpu":
            steady_heap()
        for side in sides:
            side.restore()
            side.peak = settled_peak_bytes(side.fn, device)
            anchors = None if budget_bytes is None else max_anchors_within(model, step_fn, vsize, device, dtype,
                                                                           compiled, budget_bytes)
            extra = {"peak_extra_mib": None if side.peak is None else side.peak / 2**20, "size": asdict(vsize)}
            if budget_bytes is not None:
                extra.update(max_anchors_within_budget=anchors, budget_mib=budget_bytes / 2**20,
                             anchor_search_limit=ANCHOR_SEARCH_LIMIT)
            rows.append(Row("step_head", side.case, side.impl, side.timing, 0, copy_gbps, extra))
        del model, sides
    return rows


def main() -> None:
    own = _own_options()
    run = start_run(__doc__, quick_help="the training step only")
    args, device = run.args, run.device
    size = FULL_SIZE if device.type == "cuda" or own.full else CPU_SIZE
    if own.drafter:
        size = DRAFTERS[own.drafter]
    if own.layers:
        size = replace(size, layers=own.layers)
    dtype = torch.bfloat16 if device.type == "cuda" and not size.autocast else torch.float32
    compiled = device.type == "cuda" and not args.no_compile
    reps = 10 if device.type == "cuda" else 5
    print(f"# {size.name}, {str(dtype).removeprefix('torch.')}{' + bf16 autocast' if size.autocast else ''}; train: T {size.tokens}, {size.anchors} anchors "
          f"({size.anchors * size.block} rows){', speculators forward compiled' if compiled else ''}; "
          f"serve: B {size.requests}, C {size.context}")
    if own.head:
        vocabs = [size.vocab] if own.drafter else own.vocab
        search = "no anchor search" if own.no_anchor_search else f"anchor search within {own.budget_mib:.0f} MiB"
        print(f"# --head: {', '.join(own.trainers)} at V {vocabs}, {search}")
        rows = head_sides(size, own.trainers, vocabs, device, dtype, compiled, 3 if device.type == "cpu" else reps,
                          None if own.no_anchor_search else own.budget_mib * 2**20, run.copy_gbps)
        print_step_table(rows)
        write_records(rows, run.env, args.out)
        return
    sides: list[Side] = []

    # Timing first, every side; the memory afterwards (steady_heap slows allocations).
    model = speculators_model(size, device, dtype)
    case = f"train T{size.tokens} A{size.anchors}"
    upstream = Side(case, "upstream", train_step_fn(model, size, device, dtype, compiled), lambda: dk.unpatch(model))
    report = dk.patch(model)
    assert len(report.replaced) == 2 * size.layers + 1, str(report)  # a conv module per sublayer, a selector
    ours = Side(case, "ours", train_step_fn(model, size, device, dtype, compiled), lambda: dk.patch(model))
    time_interleaved([upstream, ours], device, reps)
    sides += [upstream, ours]

    if not args.quick:
        draft = nemo_draft(size, device, dtype)
        # The step functions capture the selector they walk with, so build each side's
        # while the draft is in that side's state.
        upstream_fns = serve_step_fns(draft, size, device, dtype, ours=False)
        report = dk.patch(draft)
        assert len(report.replaced) == 2 * size.layers + 1, str(report)
        ours_fns = serve_step_fns(draft, size, device, dtype, ours=True)
        for name in upstream_fns:
            pair = [Side(f"{name} B{size.requests}", "upstream", upstream_fns[name], lambda: dk.unpatch(draft)),
                    Side(f"{name} B{size.requests}", "ours", ours_fns[name], lambda: dk.patch(draft))]
            time_interleaved(pair, device, 5 * reps)
            sides += pair

    if device.type == "cpu":
        steady_heap()
    for side in sides:
        side.restore()
        side.peak = settled_peak_bytes(side.fn, device)

    rows = [Row("step", side.case, side.impl, side.timing, 0, run.copy_gbps,
                {"peak_extra_mib": None if side.peak is None else side.peak / 2**20, "size": asdict(size)})
            for side in sides]  # bytes 0: a whole step has no minimal-bytes roofline
    print_step_table(rows)
    write_records(rows, run.env, args.out)


if __name__ == "__main__":
    main()
