"""Tune every Triton kernel at the published shapes and record what each member measured.

    python benchmarks/tune.py --out tuning.jsonl                    # on a GPU (gpu_check.sh)
    python benchmarks/tune.py --records tuning.jsonl --write-shipped --doc docs/BENCHMARKS.md
    python benchmarks/tune.py --interpret --out /tmp/tuning.jsonl   # the flow on the CPU

On a GPU it runs, with ``DFLASH2_AUTOTUNE=retune`` (the shipped table and the disk cache
skipped) and a fresh cache directory (``--cache``: one that later runs then read), the calls whose kernels have configuration spaces
(dflash2_kernels/tuning/spaces.py): the conv forward and backward at bench_conv.py's five
GPU shapes, and the draft head at N 4096, V 248,320, H 5120 bf16 (speculators' kl_div
with tv as a metric; NeMo's ce with labels; ce with a trainable lm_head: the recompute's
sparse add), forward and backward. The tuner times each member of each space at its
first launch (device time of CUDA-graph replays); every timing is one JSONL record: GPU,
space and digest, shape class, each member's ms, the default's and the winner's.

From records (``--records``, no GPU): ``--write-shipped`` puts the winners into
dflash2_kernels/tuning/shipped.json under the GPU's name (the first choice on that GPU),
``--doc`` writes the table between ``<!-- table: tuning -->`` and its end marker.

``--interpret`` runs the same flow on the CPU (Triton's interpreter, tiny shapes, wall
time of each launch standing in for device time, GPU name "interpreter"): what the GPU
script's dry run calls, so the script cannot rot between GPU runs. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "dflash2_kernels" / "tuning" / "shipped.json"
TABLE_START, TABLE_END = "<!-- table: tuning -->", "<!-- end table -->"


def _setup(interpret: bool, cache: str) -> None:
    os.environ["DFLASH2_AUTOTUNE"] = "retune"
    os.environ["DFLASH2_CACHE_DIR"] = cache
    if interpret:  # before triton is imported: its jit decorator reads it
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["DFLASH2_BACKEND"] = "triton"


def _stand_in_gpu(tuner) -> None:
    """The interpreter's launches counted as a GPU's, timed by the wall clock."""
    def wall_ms(launch, device_of):
        start = time.perf_counter()
        launch.run(device_of)
        return (time.perf_counter() - start) * 1e3

    tuner.on_gpu = lambda device_of: True
    tuner.can_time = lambda device_of: True
    tuner._timer = wall_ms
    tuner._device_name = lambda index: "interpreter"


def _conv_calls(device, interpret: bool):
    import torch

    import dflash2_kernels as dk
    from bench_conv import GPU_SHAPES, Shape, make_inputs

    shapes = [Shape(64, 256, GPU_SHAPES[0].dtypes)] if interpret else GPU_SHAPES
    for shape in shapes:
        x, delta, base, dy = make_inputs(shape, device)
        leaves = [t.requires_grad_(True) for t in (x, delta, base)]
        out = dk.grouped_dynamic_conv(x, delta, base, block_size=shape.block_size, group_size=shape.group_size)
        torch.autograd.grad(out, leaves, dy)
        yield f"conv {shape.name}"


def _head_calls(device, interpret: bool):
    import torch

    import dflash2_kernels as dk

    rows, vocab, width = (8, 1500, 16) if interpret else (4096, 248_320, 5120)
    dtype = torch.float32 if interpret else torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    hidden, target = randn(rows, width), randn(rows, width)
    weight = randn(vocab, width, scale=width ** -0.5)
    labels = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    for name, kwargs, weight_grad in (
            ("kl_div+tv", dict(target_hidden=target, losses=("kl_div", "tv")), False),
            ("ce labels", dict(labels=labels, losses=("ce",)), False),
            ("ce labels, trainable lm_head", dict(labels=labels, losses=("ce",)), True)):
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(weight_grad)
        out = dk.draft_head(h, w, top_k=16, **kwargs)
        loss = out.losses[kwargs["losses"][0]].sum() + out.topk_logits.sum()  # tv: a metric, no gradient
        torch.autograd.grad(loss, [h] + ([w] if weight_grad else []))
        del out, loss
        yield f"head {name} N{rows} V{vocab} H{width}"


def run(out: Path, interpret: bool, cache: Path | None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="dflash2-tune-") as scratch:
        _setup(interpret, str(cache or scratch))
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import torch
        import triton

        from dflash2_kernels.tuning import SPACES
        from dflash2_kernels.tuning.tuner import TUNER

        if interpret:
            _stand_in_gpu(TUNER)
            device = torch.device("cpu")
        elif torch.cuda.is_available():
            device = torch.device("cuda")
        else:
            sys.exit("tune.py: no GPU (use --interpret for the flow on the CPU)")
        commit = os.environ.get("DFLASH2_COMMIT") or _git_commit()
        records = []
        for calls in (_conv_calls, _head_calls):
            for call in calls(device, interpret):
                for trial in TUNER.trials[len(records):]:
                    records.append(dict(trial, call=call, digest=SPACES[trial["space"]].digest,
                                        default_ms=trial["times_ms"][trial["default"]],
                                        winner_ms=trial["times_ms"][trial["winner"]],
                                        triton=triton.__version__, torch=torch.__version__, commit=commit,
                                        date=time.strftime("%Y-%m-%d"), interpreted=interpret))
                print(f"{call}: {len(records)} spaces timed so far", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(table(records))
    return records


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(records: list[dict]) -> str:
    """Per timed space and shape class: the default's and the winner's device time."""
    lines = ["| GPU | kernel space | shape class | call | default | ms | winner | ms | gain |",
             "|---|---|---|---|---|---:|---|---:|---:|"]
    for r in records:
        gain = r["default_ms"] / r["winner_ms"] if r["winner_ms"] else float("nan")
        lines.append(f"| {r['gpu']} | {r['space']} | `{r['key']}` | {r['call']} | {r['default']} | "
                     f"{r['default_ms']:.4f} | {r['winner']} | {r['winner_ms']:.4f} | {gain:.2f}x |")
    if records:
        first = records[0]
        lines.append(f"\n{len(records)} timings; commit {first['commit']}, {first['date']}, Triton {first['triton']}, "
                     f"torch {first['torch']} (`python benchmarks/tune.py --out tuning.jsonl`; device time of "
                     f"CUDA-graph replays, {'interpreter: wall time, meaningless' if first['interpreted'] else 'GPU'}).")
    return "\n".join(lines)


def write_shipped(records: list[dict], path: Path) -> int:
    """Merges the records' winners into the shipped table; returns how many it wrote. Only
    records of the spaces as they are now count (digest), interpreter records never."""
    sys.path.insert(0, str(REPO))
    from dflash2_kernels.tuning import SPACES

    shipped = json.loads(path.read_text()) if path.exists() else {}
    written = 0
    for r in records:
        space = SPACES.get(r["space"])
        if r.get("interpreted") or space is None or space.digest != r["digest"] or not space.named(r["winner"]):
            continue
        entry = shipped.setdefault(r["gpu"], {}).get(r["space"])
        if not entry or entry["digest"] != space.digest:
            entry = shipped[r["gpu"]][r["space"]] = {"digest": space.digest, "winners": {}}
        entry["winners"][r["key"]] = r["winner"]
        written += 1
    path.write_text(json.dumps(shipped, indent=1, sort_keys=True) + "\n")
    return written


def write_doc(records: list[dict], doc: Path) -> None:
    text = doc.read_text()
    block = f"{TABLE_START}\n{table(records)}\n{TABLE_END}"
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc} has no {TABLE_START} ... {TABLE_END} block")
    doc.write_text(pattern.sub(lambda _: block, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSONL records of a tuning run")
    parser.add_argument("--interpret", action="store_true", help="the flow on the CPU, tiny shapes")
    parser.add_argument("--records", type=Path, help="records of an earlier run instead of running")
    parser.add_argument("--cache", type=Path, help="the tuning cache directory to fill (DFLASH2_CACHE_DIR for "
                                                   "later runs to use the winners; default: a scratch one)")
    parser.add_argument("--write-shipped", nargs="?", const=SHIPPED, type=Path, metavar="PATH",
                        help=f"merge the winners into the shipped table (default {SHIPPED.relative_to(REPO)})")
    parser.add_argument("--doc", type=Path, help="markdown file with a tuning table block to rewrite")
    args = parser.parse_args()
    if args.records:
        records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
        print(table(records))
    elif args.out:
        records = run(args.out, args.interpret, args.cache)
    else:
        parser.error("give --out (run) or --records")
    if args.write_shipped:
        print(f"{write_shipped(records, args.write_shipped)} winners written to {args.write_shipped}")
    if args.doc:
        write_doc(records, args.doc)


if __name__ == "__main__":
    main()
