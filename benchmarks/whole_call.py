"""The whole-call GPU model: what one call of each public op costs on an H200, counted on
the CPU by running the op's real Python code on fake CUDA tensors (benchmarks/fake_cuda.py).
A model, not a measurement.

    python benchmarks/whole_call.py [--only TEXT] [--save FILE.jsonl] [--doc docs/MODELS.md]

Each scenario builds fake inputs at a published shape (SPEC section 5: Qwen3.8-27B, H 5120,
V 248,320, r 256, k 16; speculators' 4,096 rows a step) and calls the public API; the
forward and the backward (``torch.autograd.backward`` of the outputs with a random
upstream gradient) are counted separately. Per direction: device launches by kind
(ours Triton / ours CUDA C++ / aten), host syncs, the GB that aten ops other than GEMMs
move over [rows, V] planes, GEMM TFLOP, peak MiB allocated, the H200 device-time estimate
and the host-time floor. The draft head's rows carry the TFLOP of the dense head they
replace (the ``dense ...`` scenarios: logits [N, V] materialised, speculators' eager
losses or F.cross_entropy, torch.topk).

For tests: :data:`SCENARIOS` by name, :func:`count_scenario` (a :class:`Counted`);
:data:`HEAD_SCENARIOS` names the draft head's, whose budgets live in
tests/test_head_whole_call.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fake_cuda import HOST_LAUNCH_S, HOST_SYNC_S, CallCount, CallCounter, FakeCuda  # noqa: E402

DOC_MARKER = "<!-- table: whole_call -->"
HEAD_DOC_MARKER = "<!-- table: whole_call_head -->"
DOC_END = "<!-- end table -->"

# SPEC section 5: Qwen3.8-27B-DFlash2 at speculators' training step (512 anchors x block 8).
ROWS, HIDDEN, VOCAB, RANK, TOP_K = 4096, 5120, 248_320, 256, 16
CONV_ROWS, CONV_HIDDEN = 16_384, 4096  # NeMo's [2, 4096, 4096] GLM-sized conv input, flattened
SERVING_ROWS = 256  # 32 requests x block 8
LARGE_ROWS = 16_384
BF16 = torch.bfloat16


@dataclass
class Counted:
    """One scenario's counts: the forward, and the backward where the call has one."""

    forward: CallCount
    backward: CallCount | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    op: str  # conv, selector, head, dense head
    form: str
    shape: str
    run: Callable[[], Counted]
    dense: str | None = None  # the dense scenario a head scenario replaces


def _randn(*shape, dtype=BF16, grad=False) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)


def _ids(*shape) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, device="cuda")


def _count(forward: Callable, upstream: Callable | None = None, plane=None) -> Counted:
    """Count ``forward()`` (-> its outputs), then ``torch.autograd.backward`` of the
    tensors and gradients ``upstream(outputs)`` returns (outside the forward's count)."""
    with CallCounter(plane=plane) as fwd:
        outputs = forward()
    if upstream is None:
        return Counted(fwd)
    tensors, grads = upstream(outputs)
    with CallCounter(plane=plane) as bwd:
        torch.autograd.backward(tensors, grads)
    return Counted(fwd, bwd)


def _plane(vocab: int = VOCAB, hidden: int = HIDDEN):
    """[R, V] planes: a dim of V beside any dim but H (the lm_head [V, H], its transpose
    and its gradient are no plane; a chunk of exactly H rows would be missed)."""
    return lambda t: t.dim() >= 2 and vocab in t.shape[-2:] and hidden not in t.shape[-2:] and t.numel() > vocab


# --- the conv -----------------------------------------------------------------------------------


def conv_call(rows: int, hidden: int, *, training: bool) -> Counted:
    """dk.grouped_dynamic_conv at block 8, group 16, K 2 on bf16 x [rows, hidden], speculators'
    fp32 base [K, H] and the delta as one side of a [rows, 2, K, G] bf16 projection (row stride
    2KG). The delta is made a leaf so that the backward counted is the op's: the projection's
    select_backward (a zero fill and a copy) is upstream's."""
    import dflash2_kernels as dk

    groups = hidden // 16
    x = _randn(rows, hidden, grad=training)
    projection = _randn(rows, 2, 2, groups)
    delta = projection[:, 0].requires_grad_(training)
    base = _randn(2, hidden, dtype=torch.float32, grad=training)
    if not training:
        with torch.no_grad():
            return _count(lambda: dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16))
    return _count(lambda: dk.grouped_dynamic_conv(x, delta, base, block_size=8, group_size=16),
                  lambda y: (y, torch.randn_like(y)))


# --- the selector ---------------------------------------------------------------------------------


def _selector():
    import dflash2_kernels as dk

    # Built in bf16 on the fake device: Module.to would swap fake parameters, which the fake
    # mode's weak references forbid.
    default = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        with torch.device("cuda"):
            return dk.CandidateSelector(VOCAB, HIDDEN, RANK, TOP_K)
    finally:
        torch.set_default_dtype(default)


def selector_score_candidates() -> Counted:
    """speculators' call: CandidateSelector.score_candidates(unary_logits [N, V], hidden [N, H],
    predecessor_ids [N], candidate_ids [N, k]) -> [N, k], the logits requiring grad."""
    selector = _selector()
    logits, hidden = _randn(ROWS, VOCAB, grad=True), _randn(ROWS, HIDDEN, grad=True)
    pred, cand = _ids(ROWS), _ids(ROWS, TOP_K)
    return _count(lambda: selector.score_candidates(logits, hidden, pred, cand),
                  lambda s: (s, torch.randn_like(s)))


def selector_pair_scores() -> Counted:
    """NeMo's call: CandidateSelector.pair_scores(hidden [N, H], unary [N, k] gathered,
    candidate_ids, predecessor_ids) -> [N, k]."""
    selector = _selector()
    hidden, unary = _randn(ROWS, HIDDEN, grad=True), _randn(ROWS, TOP_K, grad=True)
    pred, cand = _ids(ROWS), _ids(ROWS, TOP_K)
    return _count(lambda: selector.pair_scores(hidden, unary, cand, pred), lambda s: (s, torch.randn_like(s)))


# --- the draft head and the dense head it replaces -------------------------------------------------


HEAD_FORMS = {  # form -> (losses, inputs: "labels" or "target", W requires grad)
    "ce": (("ce",), "labels", False),
    "kl_div": (("kl_div",), "target", False),
    "kl_div+tv": (("kl_div", "tv"), "target", False),
    "ce, trainable lm_head": (("ce",), "labels", True),
}
LARGE_FORMS = ("ce", "kl_div")  # the trainers' defaults (NeMo: ce; speculators: kl_div, tv a metric)


def _head_inputs(form: str, rows: int = ROWS):
    losses, given, trainable = HEAD_FORMS[form]
    hidden = _randn(rows, HIDDEN, grad=True)
    weight = _randn(VOCAB, HIDDEN, grad=trainable)
    target = _randn(rows, HIDDEN) if given == "target" else None
    labels = _ids(rows) if given == "labels" else None
    return losses, hidden, weight, target, labels


def _head_upstream(out):
    """The sum of the losses, and a random gradient on topk_logits (the selector's unary term)."""
    loss = sum(out.losses.values()).sum()
    return [loss, out.topk_logits], [None, torch.randn_like(out.topk_logits)]


def head_call(form: str, rows: int = ROWS) -> Counted:
    """dk.draft_head(hidden [N, H] bf16 requiring grad, W [V, H] bf16, top_k 16, ...): the
    forward keeps its dh planes; the backward runs from the losses and topk_logits."""
    import dflash2_kernels as dk

    losses, hidden, weight, target, labels = _head_inputs(form, rows)
    return _count(lambda: dk.draft_head(hidden, weight, target_hidden=target, labels=labels, losses=losses,
                                        top_k=TOP_K),
                  _head_upstream, plane=_plane())


def head_serving() -> Counted:
    """The serving form: losses=(), no target, under no_grad, 256 rows: candidates, draft_lse, argmax."""
    import dflash2_kernels as dk

    hidden, weight = _randn(SERVING_ROWS, HIDDEN), _randn(VOCAB, HIDDEN)
    with torch.no_grad():
        return _count(lambda: dk.draft_head(hidden, weight, losses=(), top_k=TOP_K), plane=_plane())


def _eager_losses():
    """speculators' losses/eager.py (kl_div_loss, tv_loss), loaded alone: importing the
    speculators package pulls in its trainer's dependencies."""
    spec = importlib.util.find_spec("speculators")
    if spec is None or spec.origin is None:
        raise SystemExit("the dense head's losses are speculators' own: pip install speculators==0.9.0 "
                         "(SPEC section 6 lists how)")
    path = Path(spec.origin).parent / "losses" / "eager.py"
    module_spec = importlib.util.spec_from_file_location("_speculators_eager_losses", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


class DenseHead:
    """The head both trainers run today: logits [N, V] materialised in bf16, the losses
    on them (F.cross_entropy, or speculators' eager kl_div_loss / tv_loss against the
    verifier's logits, computed without grad), and torch.topk of the logits."""

    def __init__(self, losses):
        self.losses = losses
        self.eager = _eager_losses() if any(name != "ce" for name in losses) else None

    def forward(self, hidden, weight, target, labels):
        logits = F.linear(hidden, weight)
        values = {}
        if target is not None:
            with torch.no_grad():
                target_logits = F.linear(target, weight)
        for name in self.losses:
            if name == "ce":
                values[name] = F.cross_entropy(logits, labels, reduction="none")
            else:
                values[name] = getattr(self.eager, f"{name}_loss")(logits, target_logits)
        return values, torch.topk(logits, TOP_K).values


def dense_call(form: str, rows: int = ROWS) -> Counted:
    """The dense head at ``form``'s losses and inputs (HEAD_FORMS), forward and backward."""
    losses, hidden, weight, target, labels = _head_inputs(form, rows)
    dense = DenseHead(losses)

    def upstream(out):
        values, topk = out
        return [sum(values.values()).sum(), topk], [None, torch.randn_like(topk)]

    return _count(lambda: dense.forward(hidden, weight, target, labels), upstream, plane=_plane())


def dense_serving() -> Counted:
    """Logits [256, V] and torch.topk, under no_grad."""
    hidden, weight = _randn(SERVING_ROWS, HIDDEN), _randn(VOCAB, HIDDEN)
    with torch.no_grad():
        return _count(lambda: torch.topk(F.linear(hidden, weight), TOP_K), plane=_plane())


# --- the scenarios -----------------------------------------------------------------------------------


def _scenarios() -> list[Scenario]:
    training = f"N {ROWS}, H {HIDDEN}, V {VOCAB:,}, bf16"
    scenarios = [
        Scenario("conv training", "conv", "speculators (fp32 base, strided delta)",
                 f"{CONV_ROWS} x {CONV_HIDDEN} bf16, gs 16, K 2, L 8",
                 lambda: conv_call(CONV_ROWS, CONV_HIDDEN, training=True)),
        Scenario("conv serving", "conv", "no grad", f"{SERVING_ROWS} x {HIDDEN} bf16, gs 16, K 2, L 8",
                 lambda: conv_call(SERVING_ROWS, HIDDEN, training=False)),
        Scenario("selector score_candidates", "selector", "speculators (unary [N, V])",
                 f"N {ROWS}, V {VOCAB:,}, r {RANK}, k {TOP_K}, H {HIDDEN}, bf16", selector_score_candidates),
        Scenario("selector pair_scores", "selector", "NeMo (unary [N, k])",
                 f"N {ROWS}, V {VOCAB:,}, r {RANK}, k {TOP_K}, H {HIDDEN}, bf16", selector_pair_scores),
    ]
    for form in HEAD_FORMS:
        scenarios.append(Scenario(f"head {form}", "head", form, training, lambda f=form: head_call(f),
                                  dense=f"dense {form}"))
    # The trainers' defaults at the GPU targets' second size (NeMo's 2 x 8,192 rows a step).
    large = f"N {LARGE_ROWS}, H {HIDDEN}, V {VOCAB:,}, bf16"
    for form in LARGE_FORMS:
        scenarios.append(Scenario(f"head {form}, N {LARGE_ROWS}", "head", form, large,
                                  lambda f=form: head_call(f, LARGE_ROWS), dense=f"dense {form}, N {LARGE_ROWS}"))
    scenarios.append(Scenario("head serving", "head", "serving (losses=(), no grad)",
                              f"N {SERVING_ROWS}, H {HIDDEN}, V {VOCAB:,}, bf16", head_serving,
                              dense="dense serving"))
    for form in HEAD_FORMS:
        scenarios.append(Scenario(f"dense {form}", "dense head", form, training, lambda f=form: dense_call(f)))
    for form in LARGE_FORMS:
        scenarios.append(Scenario(f"dense {form}, N {LARGE_ROWS}", "dense head", form, large,
                                  lambda f=form: dense_call(f, LARGE_ROWS)))
    scenarios.append(Scenario("dense serving", "dense head", "serving (logits + torch.topk)",
                              f"N {SERVING_ROWS}, H {HIDDEN}, V {VOCAB:,}, bf16", dense_serving))
    return scenarios


SCENARIOS = {scenario.name: scenario for scenario in _scenarios()}
HEAD_SCENARIOS = [name for name, scenario in SCENARIOS.items() if scenario.op == "head"]


def count_scenario(name: str) -> Counted:
    """Run one scenario (SCENARIOS[name]) on fake CUDA tensors: its forward and backward counts."""
    with FakeCuda():
        return SCENARIOS[name].run()


def records(scenario: Scenario, counted: Counted, env: dict, dense: Counted | None = None) -> list[dict]:
    """One JSON object per direction of the scenario."""
    out = []
    for direction, count in (("forward", counted.forward), ("backward", counted.backward)):
        if count is None:
            continue
        summary = count.summary()
        dense_count = None if dense is None else getattr(dense, direction)
        out.append(dict(
            bench="whole_call", scenario=scenario.name, op=scenario.op, form=scenario.form, direction=direction,
            shape=scenario.shape, launches=summary["launches"], syncs=summary["syncs"],
            sync_sites=summary["sync_sites"], data_dependent=summary["data_dependent"],
            plane_gb=summary["plane_bytes"] / 1e9, plane_ops=summary["plane_ops"], gb=summary["bytes"] / 1e9,
            gemm_tflop=summary["gemm_flops"] / 1e12,
            dense_gemm_tflop=None if dense_count is None else dense_count.gemm_flops / 1e12,
            peak_mib=summary["peak_bytes"] / 2**20, h200_device_ms=summary["device_s"] * 1e3,
            host_floor_ms=summary["host_floor_s"] * 1e3, bound=summary["bound"], unmodelled=summary["unmodelled"],
            model=f"fake CUDA H200; device = sum over launches of max(bytes / 4.3 TB/s, FLOPs / peak, 3 us); "
                  f"host floor = launches x {HOST_LAUNCH_S * 1e6:.0f} us + syncs x {HOST_SYNC_S * 1e6:.0f} us",
            **env))
    return out


# --- output ---------------------------------------------------------------------------------------


def _launches(r: dict) -> str:
    k = r["launches"]
    return f"{k['triton']}/{k['cuda']}/{k['aten']}"


def _tflop(value) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 1 else f"{value:.2f}" if value else "0"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.1f}"


def _device_ms(r: dict) -> str:
    """Device ms, starred where a kernel has no bytes model (every argument read once)."""
    return _ms(r["h200_device_ms"]) + ("*" if r["unmodelled"] else "")


def _gemm_cell(r: dict) -> str:
    dense = r["dense_gemm_tflop"]
    return _tflop(r["gemm_tflop"]) + ("" if dense is None else f" ({_tflop(dense)})")


_COLUMNS = (  # markdown column -> one direction's cell
    ("launches T/C/aten", _launches),
    ("syncs", lambda r: str(r["syncs"])),
    ("plane GB", lambda r: f"{r['plane_gb']:.1f}"),
    ("GEMM TFLOP (dense)", _gemm_cell),
    ("peak MiB", lambda r: f"{r['peak_mib']:,.0f}"),
    ("H200 device ms", _device_ms),
    ("host floor ms", lambda r: _ms(r["host_floor_ms"])),
)


def markdown(rows: list[dict]) -> str:
    """One row per scenario; each cell "forward · backward" where there is a backward."""
    by_scenario: dict = {}
    for r in rows:
        by_scenario.setdefault(r["scenario"], []).append(r)
    first = rows[0]
    lines = [f"**A model, not a measurement**: counted on {first.get('device', '?')} at commit "
             f"`{first.get('commit', '?')}`, {first.get('date', '?')[:10]}, torch {first.get('torch', '?')}.", "",
             "| call | " + " | ".join(name for name, _ in _COLUMNS) + " |", "|---" * (len(_COLUMNS) + 1) + "|"]
    for name, directions in by_scenario.items():
        cells = [" · ".join(cell(r) for r in directions) for _, cell in _COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(rows: list[dict]) -> None:
    print(f"{'call':34} {'dir':4} {'T/C/aten':>12} {'syncs':>5} {'plane GB':>8} {'TFLOP':>6} {'dense':>6} "
          f"{'peak MiB':>9} {'dev ms':>8} {'host ms':>8}")
    for r in rows:
        direction = "fwd" if r["direction"] == "forward" else "bwd"
        print(f"{r['scenario']:34} {direction:4} {_launches(r):>12} {r['syncs']:5} {r['plane_gb']:8.1f} "
              f"{_tflop(r['gemm_tflop']):>6} {_tflop(r['dense_gemm_tflop']):>6} {r['peak_mib']:9,.0f} "
              f"{_device_ms(r):>8} {_ms(r['host_floor_ms']):>8}")
    for r in rows:
        if r["sync_sites"]:
            sites = "; ".join(dict.fromkeys(r["sync_sites"]))
            print(f"# syncs in {r['scenario']} {r['direction']}: {sites}")
        if r["unmodelled"]:
            print(f"# unmodelled kernels in {r['scenario']} {r['direction']} (every tensor argument read once): "
                  f"{', '.join(r['unmodelled'])}")


def head_markdown(rows: list[dict]) -> str:
    """The fused head against the dense head it replaces, forward + backward summed: the
    model's H200 ms, the GEMM floor (the dense head's GEMM FLOPs at the bf16 GEMM rate the
    model uses), floor / ours (the GPU target: >= 0.8), peak MiB."""
    from traffic_minimum import MATMUL_FLOPS_PER_S

    by_scenario: dict = {}
    for r in rows:
        by_scenario.setdefault(r["scenario"], []).append(r)
    lines = ["| call | ours ms | dense ms | GEMM floor ms | floor / ours | floor / dense | peak MiB ours / dense |",
             "|---|---|---|---|---|---|---|"]
    for name in HEAD_SCENARIOS:
        dense_name = SCENARIOS[name].dense
        if name not in by_scenario or dense_name not in by_scenario or "serving" in name:
            continue
        ours, dense = by_scenario[name], by_scenario[dense_name]
        ours_ms = sum(r["h200_device_ms"] for r in ours)
        dense_ms = sum(r["h200_device_ms"] for r in dense)
        floor_ms = sum(r["gemm_tflop"] for r in dense) * 1e12 / MATMUL_FLOPS_PER_S[BF16] * 1e3
        ours_peak, dense_peak = (max(r["peak_mib"] for r in side) for side in (ours, dense))
        lines.append(f"| {name} | {_ms(ours_ms)} | {_ms(dense_ms)} | {_ms(floor_ms)} | {floor_ms / ours_ms:.2f} | "
                     f"{floor_ms / dense_ms:.2f} | {ours_peak:,.0f} / {dense_peak:,.0f} |")
    return "\n".join(lines)


def write_doc(path: Path, table: str, marker: str = DOC_MARKER) -> None:
    """Replace the block between ``marker`` and DOC_END in ``path`` with ``table``."""
    text = path.read_text()
    if marker not in text:
        raise SystemExit(f"{path}: no line {marker!r} to put the table after")
    head, rest = text.split(marker, 1)
    if DOC_END not in rest:
        raise SystemExit(f"{path}: no line {DOC_END!r} after {marker!r}")
    path.write_text(f"{head}{marker}\n{table}\n{DOC_END}{rest.split(DOC_END, 1)[1]}")


def write_tables(path: Path, rows: list[dict]) -> None:
    """Both tables into ``path``: every call, and the head against the dense head."""
    write_doc(path, markdown(rows))
    write_doc(path, head_markdown(rows), HEAD_DOC_MARKER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="only the scenarios whose name contains this text")
    parser.add_argument("--save", help="write the records here (replacing it), e.g. docs/results/whole_call.jsonl")
    parser.add_argument("--doc", help=f"write the table into this markdown file, after {DOC_MARKER}")
    args = parser.parse_args()

    rows = model_rows(args.only)
    if args.save:
        Path(args.save).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.doc:
        write_tables(Path(args.doc), rows)


def model_rows(only: str | None = None) -> list[dict]:
    """Count every scenario (those whose name contains ``only``) and the dense ones they
    compare with; print the table; return the records (benchmarks/traffic.py takes them too)."""
    from common import environment

    env = environment(torch.device("cpu"))
    chosen = [s for s in SCENARIOS.values() if not only or only in s.name]
    counted = {}
    for scenario in chosen + [SCENARIOS[s.dense] for s in chosen if s.dense and s.dense not in
                              {c.name for c in chosen}]:
        counted[scenario.name] = count_scenario(scenario.name)
    rows = [r for s in chosen for r in records(s, counted[s.name], env, counted.get(s.dense))]
    print(f"# whole-call model (fake CUDA, H200) | torch {env['torch']} | commit {env['commit']}")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
