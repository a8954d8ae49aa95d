"""Benchmark the fused draft head (SPEC section 7): ours vs the dense head as upstream
computes it vs torch.compile of that, with the GEMM floor beside them, time and peak memory.

    python benchmarks/bench_head.py [--out results.jsonl] [--no-compile] [--quick] [--full]

    --full   on CPU, also V = 248,320 and H = 1024
    --only   the shapes to run of that list, NxVxH (e.g. --only 1024x131072x256)
    --quick  one tiny shape (N 128, V 8192, H 64), for a smoke test

Each case is the head over N rows, vocabulary V, hidden size H, top-k 16, in one of two
forms: ``kl_div+tv`` (speculators' soft losses against the verifier's ``target_hidden``,
the same frozen lm_head W on both sides) or ``ce labels`` (cross entropy against hard
labels, NeMo's form); forward (under no_grad) or forward+backward (dh of the summed
per-row losses plus a random upstream gradient on the top-k logits, as the selector uses
them; W frozen, as in both trainers). **ours**: ``dk.draft_head(hidden, W,
target_hidden=t_h, losses=("kl_div", "tv"), top_k=16)`` (``labels=..., losses=("ce",)``);
while the package has no ``draft_head`` its dense reference ``dk.reference.draft_head``
stands in and the records' ``note`` says so. **eager**: logits ``F.linear(hidden, W)``
and ``F.linear(t_h, W)`` materialised [N, V], speculators 0.9.0's ``kl_div_loss`` and
``tv_loss`` (``speculators.losses.eager``, [1, T, V] in, no masks) and ``torch.topk``;
``ce labels``: ``F.cross_entropy(logits, labels, reduction="none")`` as NeMo computes its
per-token NLL, and ``torch.topk`` (``dk.reference.draft_head`` for kl_div+tv if
speculators cannot be imported). **compile**: ``torch.compile`` of the eager function
(``dynamic=False``; --no-compile skips it). On CUDA also **speculators fused**,
speculators' default Triton losses (``speculators.losses.fused``) on the same
materialised logits. **floor**: the GEMMs every implementation must do, timed alone with
``torch.mm``: ``h W^T`` (and ``t_h W^T``), and for the backward ``dS W`` with dS [N, V],
into an [N, V] and an [N, H] tensor kept across calls (a fused head that does not keep
its [N, V] products recomputes them for the backward: two GEMMs more than this floor).
A case's implementations are timed in turns, one call each per repetition
(``common.time_side_by_side``); each record's ``extra.source`` names the code that ran.
The table: median / p20 / p80 ms, GB/s over the minimal bytes (inputs read once, results
and dh written once; no [N, V] term), how many times faster ours is, peak memory, ours as
a percent of the floor.

Peak memory, "peak MiB" (``extra.peak_extra_mib``): memory beyond the inputs during one
call (outputs, saved activations, gradients, scratch), measured after all the timing,
after one unmeasured call of the same function. CUDA: the caching allocator's
``max_memory_allocated`` after a reset, less what was allocated before
(``common.peak_extra_bytes``). CPU, where torch's allocator keeps no statistics: the
growth of the process's peak resident set during the call (``common.peak_extra_bytes``:
VmHWM after /proc/self/clear_refs, the C++ ops' result cache emptied first) with, as
bench_step.py does, glibc's mmap threshold fixed at 64 KiB and ``malloc_trim`` before
each call, so that every block of 64 KiB and up is its own mapping, unmapped when freed,
and pages the heap would reuse are counted as the allocations they are. Checked against
the allocator's own events (torch.profiler, profile_memory=True): 60.1 / 60.1 MiB and
32.4 / 32.1 MiB on two forward+backward cases at N 256, V 8192, H 128; with glibc's defaults
the eager kl_div+tv forward+backward at N 1024, V 32,000 read 1125 MiB, against 1188 MiB
so (1203 MiB for the first call in a fresh process, one-time set-up included). Rows
that do not fit are skipped, their reason in ``extra.skipped`` of the case's other rows:
an implementation's peak is estimated on the line through its peaks at two small N (the
eager function's for compile), x1.25, against MemAvailable (CPU) or the free device
memory (CUDA, where an out-of-memory error on the first call also skips it).

Shapes (k = 16). CPU, fp32, H 256: N in {1024, 4096} x V in {32,000, 151,936}, each form
and direction (kl_div+tv fwd, fwd+bwd, ce labels fwd+bwd); the issue's row N 1024,
V 131,072 (kl_div+tv fwd+bwd); and, for the plot of peak memory against N, kl_div+tv
fwd+bwd at V 151,936 for N 256 to 4096 (the memory plot's panel of that family).
CUDA, bf16: N in {4096, 16384}, V 248,320, H 5120, the trainers' defaults: ``kl_div``
(speculators: the kl_div loss, tv a metric: ours' overlap output, the dense heads' tv under
no_grad) and ``ce labels``, forward and forward+backward. There each record's timing also
carries the host's share and the device time (the sum of the call's kernels' times in a
torch.profiler profile: these calls are not captured in CUDA graphs), ``common.Timing``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash2_kernels as dk  # noqa: E402
from dflash2_kernels import reference  # noqa: E402

from common import (  # noqa: E402
    FLOOR_IMPL, Row, print_table, settled_peak_bytes, start_run, time_side_by_side, write_records,
)

TOP_K = 16
SOFT, CE, KL, SERVING = "kl_div+tv", "ce labels", "kl_div", "serving"
SOFT_LOSSES = ("kl_div", "tv")
FORM_LOSSES = {SOFT: SOFT_LOSSES, KL: ("kl_div",), CE: ("ce",), SERVING: ()}
FUSED_IMPL = "speculators fused"


@dataclass(frozen=True)
class Shape:
    rows: int
    vocab: int
    hidden: int
    dtype: torch.dtype
    cases: tuple = ((SOFT, False), (SOFT, True), (CE, True))  # (form, backward)

    def name(self, form: str, backward: bool) -> str:
        return (f"{form} {'fwd+bwd' if backward else 'fwd'} N{self.rows} V{self.vocab} H{self.hidden} "
                f"{str(self.dtype).removeprefix('torch.')}")


SERIES_ONLY = ((SOFT, True),)  # the row and the memory-vs-N series


def cpu_shapes(full: bool) -> list[Shape]:
    vocabs, hiddens = ((32_000, 151_936, 248_320), (256, 1024)) if full else ((32_000, 151_936), (256,))
    shapes = [Shape(n, v, h, torch.float32) for h in hiddens for v in vocabs for n in (1024, 4096)]
    shapes.append(Shape(1024, 131_072, 256, torch.float32, SERIES_ONLY))  # the target row
    shapes += [Shape(n, 151_936, 256, torch.float32, SERIES_ONLY) for n in (256, 512, 2048)]  # memory vs N
    return sorted(shapes, key=lambda s: (s.hidden, s.vocab, s.rows))


# The GPU targets (issue 37): the trainers' defaults, speculators' kl_div (tv a metric) and
# NeMo's ce with labels, forward and forward+backward.
GPU_CASES = ((KL, False), (KL, True), (CE, False), (CE, True))
GPU_SHAPES = [Shape(n, 248_320, 5120, torch.bfloat16, GPU_CASES) for n in (4096, 16384)]


def quick_shape(device: torch.device) -> Shape:
    return Shape(128, 8192, 64, torch.bfloat16 if device.type == "cuda" else torch.float32)


# --- the implementations -----------------------------------------------------------------------
# Each takes (hidden, weight, other) -- other: target_hidden (kl_div+tv) or labels (ce labels) --
# and returns (per-row losses, top-k logits, top-k ids).


def _draft_head():
    """(dk.draft_head, its name), or the dense reference standing in while the package has none."""
    if hasattr(dk, "draft_head"):
        return dk.draft_head, "dflash2_kernels.draft_head"
    return reference.draft_head, "dflash2_kernels.reference.draft_head (standing in: no dflash2_kernels.draft_head)"


def head_call(head, form: str, top_k: int = TOP_K, **extra):
    """fn(hidden, weight, other) calling ``head`` (dk.draft_head or the dense reference) in ``form``."""
    if form == CE:
        def fn(hidden, weight, labels):
            out = head(hidden, weight, labels=labels, losses=("ce",), top_k=top_k, **extra)
            return [out.losses["ce"]], out.topk_logits, out.topk_ids
    elif form == SERVING:
        def fn(hidden, weight, _):
            out = head(hidden, weight, losses=(), top_k=top_k, **extra)
            return [], out.topk_logits, out.topk_ids
    else:
        losses = FORM_LOSSES[form]

        def fn(hidden, weight, target_hidden):
            out = head(hidden, weight, target_hidden=target_hidden, losses=losses, top_k=top_k, **extra)
            return [out.losses[n] for n in losses], out.topk_logits, out.topk_ids
    return fn


def ours(form: str):
    head, name = _draft_head()
    return head_call(head, form), name


def _speculators_losses():
    try:
        from speculators.losses import eager
    except Exception:  # noqa: BLE001 -- any failure to import upstream means the fallback
        return None
    return eager


def dense_soft(hidden, weight, target_hidden):
    """speculators' head: both sides' logits materialised, its eager kl_div and tv, top-k."""
    from speculators.losses.eager import kl_div_loss, tv_loss

    logits = F.linear(hidden, weight)
    targets = F.linear(target_hidden, weight)
    kl = kl_div_loss(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)
    tv = tv_loss(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)
    values, ids = torch.topk(logits, TOP_K, dim=-1)
    return [kl, tv], values, ids


def dense_kl(hidden, weight, target_hidden):
    """speculators' default head: both sides' logits materialised, its eager kl_div (the loss)
    and tv (the accept-rate metric, no gradient), top-k."""
    from speculators.losses.eager import kl_div_loss, tv_loss

    logits = F.linear(hidden, weight)
    targets = F.linear(target_hidden, weight)
    kl = kl_div_loss(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)
    with torch.no_grad():
        tv_loss(logits.unsqueeze(0), targets.unsqueeze(0))
    values, ids = torch.topk(logits, TOP_K, dim=-1)
    return [kl], values, ids


def dense_ce(hidden, weight, labels):
    """Cross entropy against labels on materialised logits, as NeMo computes its per-token NLL
    (nemo_automodel's dllm_loss._compute_per_token_nll; speculators' ce_loss makes the same
    call with the target argmax for labels); top-k."""
    logits = F.linear(hidden, weight)
    ce = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
    values, ids = torch.topk(logits, TOP_K, dim=-1)
    return [ce], values, ids


def dense_reference(form: str):
    """The fallback when speculators cannot be imported: the package's dense reference."""
    return head_call(reference.draft_head, form)


def eager(form: str):
    """(the dense head as upstream computes it, what it is)."""
    if form == CE:
        return dense_ce, "F.linear logits [N, V]; F.cross_entropy(reduction='none') with labels, as NeMo; torch.topk"
    if _speculators_losses() is None:
        return dense_reference(form), "dflash2_kernels.reference.draft_head (speculators not importable)"
    if form == KL:
        return dense_kl, ("F.linear logits [N, V] both sides; speculators.losses.eager kl_div_loss, tv_loss as a "
                          "metric (no grad); torch.topk")
    return dense_soft, "F.linear logits [N, V] both sides; speculators.losses.eager kl_div_loss, tv_loss; torch.topk"


def speculators_fused(form: str, device: torch.device):
    """speculators' default (Triton) losses on the materialised logits: CUDA, kl_div+tv and
    kl_div (tv a metric)."""
    if device.type != "cuda" or form not in (SOFT, KL):
        return None
    try:
        from speculators.losses.fused import fused_kl_div_loss, fused_tv_loss
    except Exception:  # noqa: BLE001
        return None

    def fn(hidden, weight, target_hidden):
        logits = F.linear(hidden, weight)
        targets = F.linear(target_hidden, weight)
        kl = fused_kl_div_loss(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)
        if form == SOFT:
            losses = [kl, fused_tv_loss(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)]
        else:
            with torch.no_grad():
                fused_tv_loss(logits.unsqueeze(0), targets.unsqueeze(0))
            losses = [kl]
        values, ids = torch.topk(logits, TOP_K, dim=-1)
        return losses, values, ids
    metric = "" if form == SOFT else " (tv as a metric, no grad)"
    return fn, f"F.linear logits [N, V] both sides; speculators.losses.fused kl_div, tv{metric} (Triton); torch.topk"


# --- inputs, calls, floor ----------------------------------------------------------------------


class Inputs:
    """One shape's tensors: h, W, t_h, labels and the upstream gradients (seeded: the memory
    pass rebuilds the same ones)."""

    def __init__(self, shape: Shape, device: torch.device, top_k: int = TOP_K):
        torch.manual_seed(0)
        options = {"device": device, "dtype": shape.dtype}
        self.hidden = torch.randn(shape.rows, shape.hidden, **options)
        self.target_hidden = torch.randn(shape.rows, shape.hidden, **options)
        # scaled so that the logits have unit spread, as a trained head's roughly do
        self.weight = torch.randn(shape.vocab, shape.hidden, **options) / shape.hidden ** 0.5
        self.labels = torch.randint(0, shape.vocab, (shape.rows,), device=device)
        self.grad_topk = torch.randn(shape.rows, top_k, **options)

    def rows(self, n: int) -> Inputs:
        """The first n rows (the memory probes)."""
        part = object.__new__(Inputs)
        part.weight = self.weight
        for name in ("hidden", "target_hidden", "labels", "grad_topk"):
            setattr(part, name, getattr(self, name)[:n])
        return part

    def other(self, form: str) -> torch.Tensor:
        return self.target_hidden if form in (SOFT, KL) else self.labels


def make_call(fn, inputs: Inputs, form: str, backward: bool):
    """One call of ``fn``: the forward under no_grad, or (``backward``) the forward and dh
    from the summed losses plus the upstream gradient on the top-k logits."""
    other = inputs.other(form)
    if not backward:
        def forward():
            with torch.no_grad():
                return fn(inputs.hidden, inputs.weight, other)
        return forward
    hidden = inputs.hidden.detach().requires_grad_()
    grad_topk = inputs.grad_topk

    def forward_backward():
        losses, topk_logits, _ = fn(hidden, inputs.weight, other)
        return torch.autograd.grad([*losses, topk_logits], [hidden],
                                   [torch.ones_like(loss) for loss in losses] + [grad_topk.to(topk_logits.dtype)])
    return forward_backward


def floor(shape: Shape, form: str, backward: bool, inputs: Inputs, product: torch.Tensor):
    """The GEMMs alone: h W^T (and t_h W^T) into ``product`` [N, V], and for the backward
    dS W ([N, V] x [V, H], dS: ``product``) into an [N, H] tensor; both kept across calls."""
    weight_t = inputs.weight.t()
    grad_hidden = torch.empty(shape.rows, shape.hidden, device=product.device, dtype=shape.dtype)

    def gemms():
        torch.mm(inputs.hidden, weight_t, out=product)
        if form in (SOFT, KL):
            torch.mm(inputs.target_hidden, weight_t, out=product)
        if backward:
            torch.mm(product, inputs.weight, out=grad_hidden)
        return grad_hidden
    return gemms


def gemm_flops(shape: Shape, form: str, backward: bool) -> int:
    sides = 2 if form in (SOFT, KL) else 1
    return 2 * shape.rows * shape.vocab * shape.hidden * (sides + (1 if backward else 0))


def minimal_bytes(shape: Shape, form: str, backward: bool) -> int:
    """h, W and t_h (or the labels) read once; the per-row losses and the top-k logits and
    ids written once; for the backward the upstream gradients read and dh written."""
    size = torch.empty((), dtype=shape.dtype).element_size()
    n, h, v, k = shape.rows, shape.hidden, shape.vocab, TOP_K
    n_losses = len(FORM_LOSSES[form])
    total = n * h * size + v * h * size + (n * h * size if form in (SOFT, KL) else n * 8 if form == CE else 0)
    total += n_losses * n * 4 + n * k * (size + 8)
    if backward:
        total += n_losses * n * 4 + n * k * size + n * h * size
    return total


# --- memory ------------------------------------------------------------------------------------


def steady_heap() -> None:
    """On CPU, glibc's mmap threshold fixed at 64 KiB (bench_step.py's steady_heap): every
    allocation of 64 KiB and up is its own mapping, so the resident set follows live
    memory. It slows such allocations, so it is set after all the timing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def free_bytes(device: torch.device) -> int | None:
    """What a call may still use: the free device memory (CUDA) or MemAvailable (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


MARGIN = 1.25  # on the estimated peak
PROBE_ROWS = {"cpu": 512, "cuda": 1024}  # CPU: [512, V] fp32 blocks are mmapped, not heap


def does_not_fit(fn, shape: Shape, form: str, backward: bool, inputs: Inputs, device: torch.device) -> str | None:
    """Why ``fn`` would not fit at this shape, or None. Cheap where even 32 float32 [N, V]
    tensors would fit (the dense heads measured here peak at 7 to 15); else its peaks at two
    small N (PROBE_ROWS, fewer where that bound does not hold at twice as many, and twice
    as many; no probe at N up to twice that), extrapolated along the line through them,
    times MARGIN."""
    budget = free_bytes(device)
    if budget is None:
        return None
    if MARGIN * 32 * shape.rows * shape.vocab * 4 < budget:
        return None
    # probes small enough that the same bound holds at twice their rows
    first = min(PROBE_ROWS[device.type], int(budget / (2 * MARGIN * 32 * shape.vocab * 4)))
    if first < 16:
        return f"V {shape.vocab}: {budget / 2**30:.1f} GiB free, too little to estimate the peak from a few rows"
    if shape.rows <= 2 * first:
        return None  # too small to probe below it (a CUDA out-of-memory error is still caught)
    peaks = []
    for n in (first, 2 * first):
        peak = settled_peak_bytes(make_call(fn, inputs.rows(n), form, backward), device)
        if peak is None:
            return None
        peaks.append(max(peak, 0))
    estimate = MARGIN * (peaks[1] + (peaks[1] - peaks[0]) / first * (shape.rows - 2 * first))
    if estimate <= budget:
        return None
    return (f"estimated peak {estimate / 2**30:.1f} GiB (line through {peaks[0] / 2**20:.0f} MiB at N {first} and "
            f"{peaks[1] / 2**20:.0f} MiB at N {2 * first}, x{MARGIN}) > {budget / 2**30:.1f} GiB free")


OPTIONAL = ("compiled reference", FUSED_IMPL)  # skipped, not fatal, should their first call fail


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "alloc" in str(error).lower() and "memory" in str(error).lower())


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Case:
    shape: Shape
    form: str
    backward: bool
    skipped: dict  # impl -> why
    rows: list


def implementations(form: str, device: torch.device, compiled: dict) -> dict:
    """{impl: (fn, source)} for one form; ``compiled`` holds the torch.compile wrappers
    (one per form, kept across shapes so that the memory pass reuses their compilations)."""
    impls = {"ours": ours(form)}
    impls["reference"] = eager(form)
    if form in compiled:
        impls["compiled reference"] = (compiled[form], "torch.compile (dynamic=False) of: " + impls["reference"][1])
    fused = speculators_fused(form, device)
    if fused is not None:
        impls[FUSED_IMPL] = fused
    return impls


def time_case(case: Case, inputs: Inputs, product: torch.Tensor, impls: dict, device: torch.device,
              copy_gbps: float, quick: bool) -> None:
    shape, form, backward = case.shape, case.form, case.backward
    label = shape.name(form, backward)
    calls, first_call_s = {}, 0.0
    for impl, (fn, _) in impls.items():
        if impl == "compiled reference":  # estimated as the eager function it compiles
            reason = case.skipped.get("reference") and "as eager: " + case.skipped["reference"]
        else:
            reason = does_not_fit(fn, shape, form, backward, inputs, device)
        if reason is None:
            call = make_call(fn, inputs, form, backward)
            try:
                start = time.perf_counter()
                call()  # the first call: compiles, and shows an out-of-memory before the timing
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if impl != "compiled reference":
                    first_call_s = max(first_call_s, time.perf_counter() - start)
            except Exception as error:  # noqa: BLE001
                if _out_of_memory(error):
                    reason = f"out of memory on the first call: {str(error).splitlines()[0][:200]}"
                elif impl in OPTIONAL:
                    reason = f"failed on the first call: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                else:
                    raise
            else:
                calls[impl] = call
        if reason is not None:
            case.skipped[impl] = reason
            call = None  # what the failed call left is freed with its traceback, here
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"# {label}: {impl} skipped: {reason}", flush=True)
    calls[FLOOR_IMPL] = floor(shape, form, backward, inputs, product)
    slow = first_call_s > 0.5  # seconds a call: fewer repetitions (at least 3 within the budget)
    if quick:
        timings = time_side_by_side(calls, device, warmup=1, reps=5, budget_s=2, warmup_s=0.05)
    else:
        # A GPU is lent for minutes (scripts/gpu_check.sh): a few seconds a case there.
        budget_s = 8 if device.type == "cuda" else 60
        timings = time_side_by_side(calls, device, warmup=1 if slow else 3, reps=5 if slow else 20,
                                    budget_s=budget_s)
    sources = {impl: source for impl, (_, source) in impls.items()}
    gemms = ("h W^T, t_h W^T" if form in (SOFT, KL) else "h W^T") + (", dS W" if backward else "")
    sources[FLOOR_IMPL] = "torch.mm: " + gemms
    for impl, timing in timings.items():
        extra = {"peak_extra_mib": None, "source": sources[impl], "gemm_flops": gemm_flops(shape, form, backward),
                 "shape": {"rows": shape.rows, "vocab": shape.vocab, "hidden": shape.hidden,
                           "dtype": str(shape.dtype).removeprefix("torch."), "top_k": TOP_K,
                           "losses": list(FORM_LOSSES[form])}}
        if case.skipped:
            extra["skipped"] = dict(case.skipped)
        case.rows.append(Row("head", label, impl, timing, minimal_bytes(shape, form, backward), copy_gbps, extra))
        device_note = "" if timing.device_ms is None else f" (device {timing.device_ms:.2f} ms)"
        print(f"#   {label:48} {impl:20} {timing.median_ms:10.2f} ms{device_note}", flush=True)


def measure_memory(case: Case, inputs: Inputs, impls: dict, device: torch.device) -> None:
    for row in case.rows:
        if row.impl == FLOOR_IMPL:
            continue  # its tensors are allocated before the call
        call = make_call(impls[row.impl][0], inputs, case.form, case.backward)
        peak = settled_peak_bytes(call, device)
        row.extra["peak_extra_mib"] = None if peak is None else peak / 2**20


# --- top-k: its cost against K ------------------------------------------------------------------

TOPK_KS = (16, 64, 256, 1024)
# (N, V, H, dtype, form, extra K): the kl_div forward (fp32) and the serving form
# (fp16, H 16: the GEMM is cheap, the ranking is the cost), K up to V.
TOPK_SHAPES = ((1024, 32_000, 256, torch.float32, KL, ()), (1024, 32_000, 16, torch.float16, SERVING, (2048, 32_000)))


def dense_topk(form: str, top_k: int):
    """(the dense head of ``form`` with torch.topk at ``top_k``, what it is): the serving
    form's dense logits and torch.topk of them (the GEMM included, nothing else); kl_div's
    both sides' logits, speculators' eager kl_div_loss (the package's dense reference where
    speculators cannot be imported) and torch.topk."""
    if form == SERVING:
        def serving(hidden, weight, _):
            values, ids = torch.topk(F.linear(hidden, weight), top_k, dim=-1)
            return [], values, ids
        return serving, "F.linear logits [N, V]; torch.topk"
    if _speculators_losses() is None:
        return head_call(reference.draft_head, form, top_k), "dflash2_kernels.reference.draft_head"

    def kl(hidden, weight, target_hidden):
        from speculators.losses.eager import kl_div_loss

        logits = F.linear(hidden, weight)
        loss = kl_div_loss(logits.unsqueeze(0), F.linear(target_hidden, weight).unsqueeze(0)).squeeze(0)
        values, ids = torch.topk(logits, top_k, dim=-1)
        return [loss], values, ids
    return kl, "F.linear logits [N, V] both sides; speculators.losses.eager kl_div_loss; torch.topk"


def topk_rows(device: torch.device, copy_gbps: float, quick: bool) -> list[Row]:
    """Per K, dk.draft_head's forward against the dense logits + torch.topk: every K of a
    shape and both implementations timed in turns (one time_side_by_side), so that the
    ratios to K = 16 are measured under the same load."""
    rows = []
    shapes = TOPK_SHAPES if not quick else ((128, 4096, 32, torch.float32, KL, (4096,)),)
    for n, vocab, width, dtype, form, extra in shapes:
        shape = Shape(n, vocab, width, dtype)
        inputs = Inputs(shape, device)
        labels, calls, sources = {}, {}, {}
        for top_k in [k for k in TOPK_KS + extra if k <= vocab]:
            label = f"{form} fwd K{top_k} N{n} V{vocab} H{width} {str(dtype).removeprefix('torch.')}"
            dense, described = dense_topk(form, top_k)
            sources[label] = described
            for impl, fn in (("ours", head_call(dk.draft_head, form, top_k)), ("eager", dense)):
                calls[(label, impl)] = make_call(fn, inputs, form, False)
                labels[(label, impl)] = top_k
        timings = time_side_by_side(calls, device, warmup=1, reps=3 if quick else 5, budget_s=5 if quick else 600)
        for (label, impl), timing in timings.items():
            source = ("dflash2_kernels.draft_head, losses " + ("+".join(FORM_LOSSES[form]) or "none (serving)")
                      if impl == "ours" else sources[label])
            rows.append(Row("head_topk", label, impl, timing, minimal_bytes(shape, form, False), copy_gbps,
                            {"source": source, "top_k": labels[(label, impl)], "form": form}))
            print(f"#   {label:48} {impl:20} {timing.median_ms:10.2f} ms", flush=True)
        del inputs
    return rows


# --- vocab parallel: one rank's step against one process's and the dense gathered logits ---------

WORLD = 2
# (N, V, H, form): the row (kl_div + top-16 at V 65,536), then bench_step --head's
# (512 rows: 64 anchors x block 8, H 256) at its vocabularies, speculators' kl_div and
# NeMo's ce with labels.
VP_SHAPES = ((512, 65_536, 256, KL), (512, 151_936, 256, KL), (512, 151_936, 256, CE), (512, 248_320, 256, CE))


def dense_gathered(form: str, mesh):
    """What a tensor-parallel trainer has without the fused head (NeMo's own code path): the
    lm_head column-parallel, its logits a Shard(-1) DTensor made whole by ``full_tensor()``
    (an all_gather of [N, V]; NeMo's ``_to_full_tensor``), then the loss on the [N, V]
    logits (ce: F.cross_entropy(reduction='none'), NeMo's per-token NLL; kl_div:
    speculators' eager kl_div_loss with the target's logits gathered alike) and torch.topk."""
    from torch.distributed.tensor import DTensor, Shard

    def full(local):
        return DTensor.from_local(local, mesh, [Shard(1)], run_check=False).full_tensor()

    def fn(hidden, weight, other):
        logits = full(F.linear(hidden, weight))
        if form == CE:
            losses = [F.cross_entropy(logits, other, reduction="none", ignore_index=-100)]
        else:
            with torch.no_grad():
                targets = full(F.linear(other, weight))
            if _speculators_losses() is not None:
                from speculators.losses.eager import kl_div_loss

                losses = [kl_div_loss(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)]
            else:
                losses = [reference.draft_head_row_losses(logits, targets, None, ("kl_div",))["kl_div"]]
        values, ids = torch.topk(logits, TOP_K, dim=-1)
        return losses, values, ids
    return fn


def _rank_main(rank: int, port: int, shapes, reps: int, out_dir: str) -> None:
    """One of WORLD gloo ranks, one thread each: every shape's three steps (forward +
    backward) in turns, each call after a barrier, so that both ranks run the same thing at
    the same time (one process's step too: both cores busy, as in the rank's step)."""
    import json as json_module

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    group = dist.group.WORLD
    results = []
    for n, vocab, width, form in shapes:
        shape = Shape(n, vocab, width, torch.float32)
        inputs = Inputs(shape, torch.device("cpu"))
        local = inputs.weight.chunk(WORLD)[rank].contiguous()
        start = sum(part.shape[0] for part in inputs.weight.chunk(WORLD)[:rank])
        sharded = object.__new__(Inputs)
        sharded.__dict__.update(inputs.__dict__, weight=local)
        alone = object.__new__(Inputs)  # one process on the shard: labels within it (the same work)
        alone.__dict__.update(sharded.__dict__, labels=inputs.labels.remainder(local.shape[0]))
        del inputs
        calls = {
            "ours": make_call(head_call(dk.draft_head, form, vocab_start=start, group=group), sharded, form, True),
            "one process": make_call(head_call(dk.draft_head, form), alone, form, True),
            "dense gathered": make_call(dense_gathered(form, mesh), sharded, form, True),
        }
        samples = {name: [] for name in calls}
        for rep in range(reps + 1):  # the first round warms up
            for name, call in calls.items():
                dist.barrier()
                begin = time.perf_counter()
                call()
                if rep:
                    samples[name].append((time.perf_counter() - begin) * 1e3)
        results.append({"shape": [n, vocab, width, form], "samples": samples, "local": local.shape[0]})
        gc.collect()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json_module.dump(results, f)
    dist.destroy_process_group()


def vocab_parallel_rows(copy_gbps: float, quick: bool) -> list[Row]:
    """A rank's step of a WORLD-rank run, side by side with one process's fused step on the
    same shard and with the dense gathered logits; a row per rank-0 implementation, the
    slower rank's median in extra."""
    import json as json_module
    import socket
    import statistics
    import tempfile

    import torch.multiprocessing as mp

    from common import Timing

    shapes = ((128, 8192, 64, KL), (128, 8192, 64, CE)) if quick else VP_SHAPES
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(port, shapes, 2 if quick else 5, out_dir), nprocs=WORLD, join=True)
        per_rank = [json_module.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]
    rows = []
    sources = {"ours": "dflash2_kernels.draft_head(vocab_start=, group=): a rank's step, fused row kernels",
               "one process": "dflash2_kernels.draft_head on the same shard [V / 2, H] in one process",
               "dense gathered": "ColwiseParallel logits (Shard(-1) DTensor).full_tensor() [N, V], as NeMo; the "
                                 "loss on them (NeMo's F.cross_entropy / speculators' kl_div_loss); torch.topk"}
    for index, (n, vocab, width, form) in enumerate(shapes):
        label = f"{form} fwd+bwd N{n} V{vocab} H{width} float32 2 ranks"
        shape = Shape(n, vocab, width, torch.float32)
        for impl, source in sources.items():
            samples = per_rank[0][index]["samples"][impl]
            timing = Timing(statistics.median(samples), min(samples), max(samples))
            slowest = max(statistics.median(r[index]["samples"][impl]) for r in per_rank)
            rows.append(Row("head_vocab_parallel", label, impl, timing, minimal_bytes(shape, form, True), copy_gbps,
                            {"source": source, "ranks": WORLD, "threads_per_rank": 1,
                             "slowest_rank_median_ms": slowest, "local_vocab": per_rank[0][index]["local"],
                             "samples_ms": samples}))
            print(f"#   {label:48} {impl:20} {timing.median_ms:10.2f} ms (slowest rank {slowest:.2f})", flush=True)
    return rows


def _own_options() -> argparse.Namespace:
    """This benchmark's flags, taken out of sys.argv before start_run parses the shared ones."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--only", nargs="+", metavar="NxVxH", default=None,
                        help="run only these shapes of the device's list, e.g. 1024x131072x256")
    parser.add_argument("--topk", action="store_true", help="the top-k rows (K in 16 .. 1024 and up to V)")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help=f"the vocab-parallel rows ({WORLD} gloo ranks, CPU)")
    own, rest = parser.parse_known_args()
    sys.argv = sys.argv[:1] + rest
    return own


def main() -> None:
    own = _own_options()
    run = start_run(__doc__, quick_help="one tiny shape (N 128, V 8192, H 64), for a smoke test")
    args, device, copy_gbps = run.args, run.device, run.copy_gbps
    if args.quick:
        shapes = [quick_shape(device)]
    else:
        shapes = GPU_SHAPES if device.type == "cuda" else cpu_shapes(own.full)
        if own.only:
            shapes = [s for s in shapes if f"{s.rows}x{s.vocab}x{s.hidden}" in own.only]
            if not shapes:
                raise SystemExit(f"--only {' '.join(own.only)}: no such shape in this device's list")
    if own.topk or own.vocab_parallel:
        rows = topk_rows(device, copy_gbps, args.quick) if own.topk else []
        if own.vocab_parallel:
            load = os.getloadavg()
            run.env["load_before_vp"] = f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
            rows += vocab_parallel_rows(copy_gbps, args.quick)
        print_table(rows)
        write_records(rows, run.env, args.out)
        return
    compiled = {}
    if not args.no_compile:
        # One compiled function per form, compiled once for every shape and grad mode: allow
        # that many recompilations of the same code (dynamo's default limit is 8).
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        forms = {form for shape in shapes for form, _ in shape.cases}
        compiled = {form: torch.compile(eager(form)[0], dynamic=False) for form in forms}
    env = dict(run.env)
    notes = []
    if not hasattr(dk, "draft_head"):
        notes.append("ours is dflash2_kernels.reference.draft_head (dense), standing in for dk.draft_head, "
                     "which this commit does not have: these are not the fused head's figures.")
    if _speculators_losses() is None:
        notes.append("speculators could not be imported: eager kl_div+tv is dflash2_kernels.reference.draft_head.")
    if notes:
        env["note"] = " ".join(notes)
        print("# " + env["note"])

    # Timing first, every case; the memory afterwards (steady_heap slows allocations).
    cases: list[Case] = []
    for shape in shapes:
        inputs = Inputs(shape, device)
        product = torch.empty(shape.rows, shape.vocab, device=device, dtype=shape.dtype)  # the floor's [N, V]
        for form, backward in shape.cases:
            case = Case(shape, form, backward, {}, [])
            time_case(case, inputs, product, implementations(form, device, compiled), device, copy_gbps, args.quick)
            cases.append(case)
        del inputs, product

    if device.type == "cpu":
        steady_heap()
    for shape in shapes:
        inputs = Inputs(shape, device)
        for case in (c for c in cases if c.shape is shape):
            measure_memory(case, inputs, implementations(case.form, device, compiled), device)
        del inputs

    rows = [row for case in cases for row in case.rows]
    print_table(rows)
    write_records(rows, env, args.out)


if __name__ == "__main__":
    main()
