"""Where each benchmark case's time goes: the per-kernel profile of every case, as records and tables.

    python benchmarks/profile_report.py --run --records PATH [--quick] [--doc docs/BENCHMARKS.md]
    python benchmarks/profile_report.py --records PATH [--doc docs/BENCHMARKS.md]

``--run`` runs every benchmark (bench_conv, bench_selector, bench_serving, bench_head,
bench_step) with ``--profile PATH --no-compile`` (common.py: each implementation of each
case profiled with torch.profiler over a few calls), each in its own process under a time
cap, appending to PATH (one JSONL for the whole run); scripts/gpu_check.sh runs the
benchmarks itself with ``--profile`` and this script for the tables only. Then, from
PATH, one table per op: per case and implementation the call time, the host's share, the
device time (how it was taken), the device time of our kernels / cuBLAS / other aten
kernels, launches per call, the time the device sat idle waiting for the host, the three
longest kernels, and beside it the whole-call model's prediction for that call
(docs/results/whole_call.jsonl: launches and H200 device ms, at the published shapes, which
the GPU cases use) so the model is checked the first time a GPU runs it. ``--doc`` writes
the tables into the file's ``<!-- table: profile -->`` block.

On the CPU the same code runs at the benchmarks' CPU shapes (``--quick``: their smallest,
at most 3 timed repetitions): "kernels" are then the torch ops a call runs, with their
self CPU times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot import rewrite  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_RECORDS = REPO / "docs" / "results" / "whole_call.jsonl"
BENCHES = ("conv", "selector", "serving", "head", "step")

# (bench, case pattern, impl) -> the whole-call model's scenario (conv training: the model takes
# speculators' fp32 base, one cast more than the bf16 case). Forward-only head cases run
# under no_grad while the model's head forward keeps dh for the backward: only fwd+bwd compares.
MODEL_SCENARIOS = [
    ("conv", r"^(fwd|fwd\+bwd) 16384x4096 bf16$", "ours", "conv training"),
    ("conv", r"^fwd 256x5120 bf16$", "ours", "conv serving"),
    ("selector", r"^op score_candidates (fwd|fwd\+bwd) N4096 V248320 .*bfloat16$", "ours", "selector score_candidates"),
    ("selector", r"^op pair_scores (fwd|fwd\+bwd) N4096 V248320 .*bfloat16$", "ours", "selector pair_scores"),
] + [
    ("head", rf"^{form} fwd\+bwd N{rows} V248320 H5120 bfloat16$", impl, f"{side} {loss}{suffix}")
    for form, loss in (("ce labels", "ce"), ("kl_div", "kl_div"))
    for rows, suffix in ((4096, ""), (16384, ", N 16384"))
    for impl, side in (("ours", "head"), ("reference", "dense"))
]


def run_benches(records: Path, benches: list[str], quick: bool, cap_s: float) -> list[str]:
    """Each benchmark in profile mode, in its own process; returns the ones that failed."""
    failed = []
    for bench in benches:
        command = [sys.executable, str(REPO / "benchmarks" / f"bench_{bench}.py"), "--no-compile",
                   "--profile", str(records)] + (["--quick", "--max-reps", "3"] if quick else [])
        start = time.perf_counter()
        print(f"# {' '.join(command[1:])}", flush=True)
        try:
            done = subprocess.run(command, cwd=REPO, timeout=cap_s, capture_output=True, text=True)
            ok = done.returncode == 0
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:] if not ok else []
        except subprocess.TimeoutExpired:
            ok, tail = False, [f"cut at its cap of {cap_s:.0f} s"]
        print(f"#   {bench}: {'done' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s", flush=True)
        for line in tail:
            print(f"#   | {line}")
        if not ok:
            failed.append(bench)
    return failed


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def model_for(record: dict, model: list[dict]) -> dict | None:
    """The whole-call model's launches and H200 device ms for this measured call, or None."""
    for bench, pattern, impl, scenario in MODEL_SCENARIOS:
        if record["bench"] == bench and record["impl"] == impl and re.search(pattern, record["case"]):
            directions = ("forward", "backward") if "fwd+bwd" in record["case"] else ("forward",)
            rows = [m for m in model if m["scenario"] == scenario and m["direction"] in directions]
            if len(rows) != len(directions):
                return None
            return {"scenario": scenario, "launches": sum(sum(m["launches"].values()) for m in rows),
                    "device_ms": sum(m["h200_device_ms"] for m in rows)}
    return None


def ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 else f"{value * 1e3:.1f} us"


def short(name: str, width: int = 40) -> str:
    """A kernel's name without its template arguments and signature, at most ``width`` chars."""
    name = re.sub(r"^void ", "", name)
    depth, kept = 0, []
    for ch in name:
        depth += ch in "<("
        if depth == 0:
            kept.append(ch)
        depth -= ch in ">)"
    text = "".join(kept) or name
    return text if len(text) <= width else text[: width - 1] + "…"


def tables(records: list[dict], model: list[dict]) -> str:
    """One markdown table per benchmark, newest run of each (bench, device)."""
    newest: dict = {}
    for r in records:
        key = (r["bench"], r["device"])
        if key not in newest or (r["date"], r["commit"]) > (newest[key][0]["date"], newest[key][0]["commit"]):
            newest[key] = [r]
        elif (r["date"], r["commit"]) == (newest[key][0]["date"], newest[key][0]["commit"]):
            newest[key].append(r)
    out = []
    for (bench, device), rows in newest.items():
        first = rows[0]
        cpu = first["profile"]["gpu_idle_ms"] is None
        out += [f"**{bench}** on {device}: commit `{first['commit']}`, {first['date']}, torch {first['torch']}, "
                f"triton {first.get('triton') or 'none'}."
                + (" On the CPU the \"kernels\" are torch ops (self CPU time)." if cpu else ""), ""]
        out += ["| case | impl | call ms | host ms | device ms | ours / cuBLAS / aten ms | launches | idle ms "
                "| longest kernels | model: launches, H200 ms |", "|" + "---|" * 10]
        for r in rows:
            p = r["profile"]
            groups = p["groups_ms"]
            split = " / ".join(ms(groups.get(g)) for g in (("ours", "blas", "aten") if cpu else ("ours", "cublas", "aten")))
            longest = "; ".join(f"{short(k['name'])} {ms(k['device_ms'])}" for k in p["kernels"][:3])
            how = {"graph": " (graph)", "profiler": " (prof.)"}.get(r.get("device_method"), "")
            m = model_for(r, model)
            modelled = f"{m['launches']}, {ms(m['device_ms'])}" if m else "—"
            out.append(f"| {r['case']} | {r['impl']} | {ms(r['call_ms'])} | {ms(r['host_ms'])} | "
                       f"{ms(r['device_ms'] if r['device_ms'] is not None else p['device_ms'])}{how} | {split} | "
                       f"{p['launches_per_call']:.0f} | {ms(p['gpu_idle_ms'])} | {longest} | {modelled} |")
        out.append("")
    return "\n".join(out).rstrip() if out else "No profile records."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", required=True, help="the profile JSONL (appended to by --run)")
    parser.add_argument("--run", action="store_true", help="run the benchmarks in profile mode first")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' --quick shapes")
    parser.add_argument("--benches", default=",".join(BENCHES), help=f"comma-separated, of {', '.join(BENCHES)}")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds each benchmark may run")
    parser.add_argument("--doc", help="write the tables into this markdown file's <!-- table: profile --> block")
    args = parser.parse_args()
    records = Path(args.records)
    benches = [b for b in args.benches.split(",") if b]
    unknown = sorted(set(benches) - set(BENCHES))
    if unknown:
        parser.error(f"--benches: unknown {', '.join(unknown)} (known: {', '.join(BENCHES)})")
    failed = run_benches(records, benches, args.quick, args.cap) if args.run else []
    text = tables(read_jsonl(records), read_jsonl(MODEL_RECORDS))
    print(text)
    if args.doc:
        missing = rewrite(Path(args.doc), {"profile": text})
        if missing:
            raise SystemExit(f"--doc: {args.doc} has no <!-- table: profile --> block")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
