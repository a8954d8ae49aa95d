"""Plots and markdown tables from the JSON records the benchmarks write.

    python benchmarks/plot.py [RECORDS.jsonl ...] [--out docs/plots] [--doc docs/BENCHMARKS.md]
                              [--readme README.md] [--save docs/results/records.jsonl] [--no-plots]

RECORDS default to bench_results/*.jsonl. Records are grouped by op (their ``bench``
field) and machine (``device``); of each group only the newest run is kept (a run: the
records of one benchmark process, which share ``date`` and ``commit``; the benchmarks
append to --out, so a file may hold several). For each op and machine:

- PNGs in --out: ``OP-MACHINE-time.png``, median ms against size for ours, the eager
  reference, ``torch.compile`` of it and the floor, one panel per case family; and
  ``OP-MACHINE-memory.png`` where the records carry peak memory; ``summary-MACHINE.png``,
  ours' speed-up over eager and compile on every row of every op;
- a markdown table (rows: shape and dtype; columns: ours, eager, compile, floor, ours as
  % of the floor, peak memory), with the machine, versions, commit and the command that
  regenerates it, and its PNGs, written between ``<!-- table: OP -->`` and
  ``<!-- end table -->`` in --doc (ops with records but no block of their own go into
  ``<!-- table: other -->``), and a headline table with the summary PNGs between
  ``<!-- table: headline -->`` and ``<!-- end table -->`` in --readme. Blocks of ops
  absent from the records are left as they are: rerunning one benchmark rewrites its
  own tables only.

A record's optional ``note`` (the converted records of docs/results say where they came
from) is printed under its table's heading. --save writes the records behind the tables
to one file, so that the committed docs can be regenerated from it: ``make plots``
passes docs/results/records.jsonl and bench_results/*.jsonl, the newer run of each op
winning. Needs matplotlib (``pip install .[bench]``) unless --no-plots; never torch.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The command that regenerates each op's records; an op not listed here is taken to come
# from benchmarks/bench_OP.py (checked to exist, so that no table names a wrong command).
SCRIPTS = {
    "conv": "bench_conv.py --out bench_results/conv.jsonl",
    "selector": "bench_selector.py --out bench_results/selector.jsonl",
    "walk": "bench_serving.py --out bench_results/serving.jsonl",
    "topk": "bench_serving.py --out bench_results/serving.jsonl",
    "rejection": "bench_serving.py --out bench_results/serving.jsonl",
    "greedy_verify": "bench_serving.py --out bench_results/serving.jsonl",
    "step": "bench_step.py --out bench_results/step.jsonl",
    "step_head": "bench_step.py --head --out bench_results/step_head.jsonl",
    "head": "bench_head.py --out bench_results/head.jsonl",  # the fused draft head's benchmark (SPEC section 7)
    "head_topk": "bench_head.py --topk --vocab-parallel --out bench_results/head.jsonl",
    "head_vocab_parallel": "bench_head.py --topk --vocab-parallel --out bench_results/head.jsonl",
}
# Which table column each benchmark's implementation names fill.
COLUMNS = {
    "ours": "ours",
    "reference": "eager", "torch loop": "eager", "torch.topk": "eager", "upstream": "eager",
    "dense gathered": "eager",  # bench_head --vocab-parallel: a TP trainer's [N, V] logits gathered
    "compiled reference": "compile", "torch loop compiled": "compile",
    "floor": "floor",
}
ORDER = ("ours", "eager", "compile", "floor")
COLORS = {"ours": "tab:blue", "eager": "tab:red", "compile": "tab:orange", "floor": "tab:gray"}
GRAPH = " (graph)"  # bench_serving's CUDA-graph replays: rows of their own
# How a case names its size: the first pattern that matches every case of an op and takes
# more than one value there is the x axis; the case with that number replaced by the
# symbol names the series (conv "fwd 256x4096 fp32" -> "fwd Nx4096 fp32", x = 256).
SIZES = (("rows N", "N", r"(?<![\w.])N(\d+)\b"), ("rows N", "N", r"(?<![\w.])(\d+)x\d+\b"),
         ("batch B", "B", r"(?<![\w.])B(\d+)\b"), ("rank r", "r", r"(?<![\w.])r(\d+)\b"),
         ("tokens T", "T", r"(?<![\w.])T(\d+)\b"), ("top-k K", "K", r"(?<![\w.])K(\d+)\b"))


# --- records -------------------------------------------------------------------------------


def load(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise SystemExit(f"{path}:{number}: not a JSON record ({error})")
                    if record.get("bench") != "traffic":  # benchmarks/traffic.py's model: its own table
                        records.append(record)
    return records


def newest_runs(records: list[dict]) -> dict:
    """{(op, device): that op's records from its newest run on that device}, in the order
    the ops first appear. Dates compare as text (the benchmarks write ISO dates); of two
    runs with the same date the one that ends later in the input wins."""
    runs: dict = {}
    for index, record in enumerate(records):
        by_run = runs.setdefault((record["bench"], record["device"]), {})
        by_run.setdefault((record["date"], record["commit"]), []).append((index, record))
    newest = {}
    for key, by_run in runs.items():
        last = max(by_run, key=lambda run: (run[0], by_run[run][-1][0]))
        newest[key] = [record for _, record in by_run[last]]
    return newest


def command(op: str) -> str:
    script = SCRIPTS.get(op)
    if script is None:
        if not (REPO / "benchmarks" / f"bench_{op}.py").exists():
            raise SystemExit(f"records of op {op!r}: no benchmarks/bench_{op}.py; add it to SCRIPTS in {__file__}")
        script = f"bench_{op}.py --out bench_results/{op}.jsonl"
    return f".venv/bin/python benchmarks/{script}"


def split_impl(impl: str) -> tuple[str, bool]:
    """(column, replayed from a CUDA graph); an unknown implementation is a column of its own."""
    graph = impl.endswith(GRAPH)
    base = impl[: -len(GRAPH)] if graph else impl
    return COLUMNS.get(base, base), graph


def table_rows(records: list[dict]) -> tuple[list[str], dict]:
    """Row labels in first-seen order and {label: {column: record}}."""
    rows: dict = {}
    for record in records:
        column, graph = split_impl(record["impl"])
        rows.setdefault(record["case"] + (" (CUDA graph)" if graph else ""), {})[column] = record
    return list(rows), rows


def columns_of(rows: dict) -> list[str]:
    present = {column for row in rows.values() for column in row}
    return list(ORDER) + sorted(present - set(ORDER))


def median(record: dict | None) -> float | None:
    return None if record is None else record["timing"]["median_ms"]


def device_ms(record: dict | None) -> float | None:
    """The device time of a GPU record (benchmarks/common.py's Timing), else None."""
    return None if record is None else record["timing"].get("device_ms")


def peak(record: dict | None) -> float | None:
    return None if record is None else (record.get("extra") or {}).get("peak_extra_mib")


def slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


# --- markdown ------------------------------------------------------------------------------


def ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 1 \
        else f"{value:.3f}"


def times(value: float) -> str:
    return f"{value:.0f}x" if value >= 100 else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def provenance(records: list[dict]) -> str:
    first = records[0]
    parts = [f"commit `{first['commit']}`", first["date"], f"torch {first['torch']}",
             f"triton {first.get('triton') or 'none'}", f"Python {first['python']}"]
    if first.get("copy_gbps"):
        parts.append(f"copy bandwidth {first['copy_gbps']:.1f} GB/s (read + write)")
    return ", ".join(parts)


def op_table(op: str, device: str, records: list[dict], plots: Plots) -> str:
    labels, rows = table_rows(records)
    extra_columns = [c for c in columns_of(rows) if c not in ORDER]
    has_peak = any(peak(r) is not None for r in records)
    lines = [f"**{op}** on {device}: {provenance(records)}.", ""]
    if records[0].get("note"):
        lines += [records[0]["note"], ""]
    lines += [f"Regenerate: `{command(op)}`, then `make plots`."]
    with_device = any(device_ms(r) is not None for r in records)
    header = ["shape and dtype", "ours ms" + (" (device)" if with_device else ""), "eager ms (ours x)",
              "compile ms (ours x)", "floor ms", "ours % of floor"]
    header += [f"{c} ms (ours x)" for c in extra_columns] + ["peak MiB ours / eager / compile"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in labels:
        row = rows[label]
        ours = median(row.get("ours"))

        def against(column: str) -> str:
            other = median(row.get(column))
            if other is None:
                return "—"
            return ms(other) + (f" ({times(other / ours)})" if ours else "")

        floor = median(row.get("floor"))
        ours_cell = ms(ours) if ours is not None else "—"
        if device_ms(row.get("ours")) is not None:
            ours_cell += f" ({ms(device_ms(row['ours']))})"
        # % of floor from device times where both have one (the host's share is not the kernels')
        mine, base = device_ms(row.get("ours")), device_ms(row.get("floor"))
        if mine is None or base is None:
            mine, base = ours, floor
        cells = [label, ours_cell, against("eager"), against("compile"),
                 ms(floor) if floor is not None else "—",
                 f"{100 * mine / base:.0f}%" if mine is not None and base else "—"]
        cells += [against(c) for c in extra_columns]
        peaks = [peak(row.get(c)) for c in ("ours", "eager", "compile")]
        cells.append(" / ".join("—" if p is None else f"{p:.1f}" for p in peaks) if has_peak else "not measured")
        lines.append("| " + " | ".join(cells) + " |")
    if any("—" in line for line in lines[-len(labels):]):
        lines += ["", "— : not in this run."]
    pictures = [f"![{op} {what} on {device}]({link})" for what, name in
                (("time", f"{op}-{slug(device)}-time.png"), ("peak memory", f"{op}-{slug(device)}-memory.png"))
                if (link := plots.link(name))]
    if pictures:
        lines += [""] + pictures
    return "\n".join(lines)


def speedups(records: list[dict], column: str) -> list[float]:
    _, rows = table_rows(records)
    return [median(row[column]) / median(row["ours"]) for row in rows.values()
            if "ours" in row and column in row and median(row["ours"])]


def headline(runs: dict, plots: Plots) -> str:
    """One line per op and machine: how many rows, ours' speed-up range against eager and
    compile, where it was measured; and the summary plot of every machine."""
    lines = ["| op | rows | ours vs eager | ours vs `torch.compile` | measured on |", "|---|---|---|---|---|"]
    for (op, device), records in runs.items():
        cells = [op, str(len(table_rows(records)[0]))]
        for column in ("eager", "compile"):
            values = speedups(records, column)
            cells.append(f"{times(min(values))} – {times(max(values))}" if values else "not measured")
        first = records[0]
        cells.append(f"{device}, commit `{first['commit']}`, {first['date'].split()[0]}")
        lines.append("| " + " | ".join(cells) + " |")
    devices = dict.fromkeys(device for _, device in runs)
    links = [(d, plots.link(f"summary-{slug(d)}.png")) for d in devices]
    lines += [""] + [f"![ours' speed-up on {d}]({link})" for d, link in links if link]
    return "\n".join(lines)


# A block's body may not hold another block's start: a missing end marker is then no match.
BLOCK = re.compile(r"(<!-- table: (?P<name>[^>]*?) -->)(?P<body>(?:(?!<!-- table:).)*?)(<!-- end table -->)", re.S)


def rewrite(path: Path, blocks: dict[str, str]) -> list[str]:
    """Replace the body of each named block in ``path``; return the names it has no block for."""
    text = path.read_text()
    found = set()

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in blocks:
            return match.group(0)
        found.add(name)
        return match.group(1) + "\n" + blocks[name] + "\n" + match.group(4)

    new = BLOCK.sub(replace, text)
    if new != text:
        path.write_text(new)
    return [name for name in blocks if name not in found]


class Plots:
    """Links from one markdown file to the PNGs in ``directory`` that exist (a table never
    links a picture that is not there, e.g. after --no-plots on a fresh checkout)."""

    def __init__(self, directory: Path, markdown: Path):
        self.directory, self.markdown = directory, markdown

    def link(self, name: str) -> str | None:
        path = self.directory / name
        if not path.exists():
            return None
        return Path(os.path.relpath(path.resolve(), self.markdown.parent.resolve())).as_posix()


def doc_blocks(runs: dict, plots: Plots, doc: Path) -> dict[str, str]:
    per_op: dict = {}
    for (op, device), records in runs.items():
        per_op.setdefault(op, []).append(op_table(op, device, records, plots))
    named = set(BLOCK_NAMES.findall(doc.read_text())) if doc.exists() else set()
    blocks = {op: "\n\n".join(tables) for op, tables in per_op.items() if op in named}
    others = [table for op, tables in per_op.items() if op not in named for table in tables]
    blocks["other"] = "\n\n".join(others) if others else "No other op has records."
    return blocks


BLOCK_NAMES = re.compile(r"<!-- table: ([^>]*?) -->")


# --- plots ---------------------------------------------------------------------------------


def size_axis(cases: list[str]) -> tuple[str, str, str] | None:
    for label, symbol, pattern in SIZES:
        values = [re.search(pattern, case) for case in cases]
        if all(values) and len({v.group(1) for v in values}) > 1:
            return label, symbol, pattern
    return None


def families(records: list[dict]) -> tuple[str | None, dict]:
    """(x-axis label or None, {family: {column (+ graph): {size or case: record}}})."""
    axis = size_axis(list(dict.fromkeys(r["case"] for r in records)))
    out: dict = {}
    for record in records:
        column, graph = split_impl(record["impl"])
        if axis is None:
            family, x = "", record["case"]
        else:
            match = re.search(axis[2], record["case"])
            # "N4096" -> "N", "256x4096" -> "Nx4096": the symbol stands for the number.
            prefix = record["case"][match.start(0):match.start(1)]
            symbol = prefix if prefix == axis[1] else prefix + axis[1]
            family = record["case"][: match.start(0)] + symbol + record["case"][match.end(1):]
            x = int(match.group(1))
        out.setdefault(family, {}).setdefault(column + (GRAPH if graph else ""), {})[x] = record
    return (axis[0] if axis else None), out


def short_titles(names: list[str]) -> tuple[list[str], str]:
    """Each family name less the words every family shares, and those shared words."""
    words = [name.split() for name in names]
    shared = [w for w in words[0] if all(w in other for other in words)] if len(words) > 1 else []
    return [" ".join(w for w in ws if w not in shared) or "all" for ws in words], " ".join(shared)


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("benchmarks/plot.py needs matplotlib: pip install .[bench] "
                         "(or pip install matplotlib; --no-plots writes the tables alone)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(plt, op: str, device: str, records: list[dict], value, unit: str, log: bool, path: Path) -> None:
    axis, by_family = families(records)
    names = list(by_family)
    titles, shared = short_titles(names)
    if axis is None:  # no size varies: one bar group per case
        series = dict(sorted(by_family[""].items(), key=lambda s: _series_order(s[0])))
        if value is peak:
            series.pop("floor", None)  # its tensors are allocated before the measurement
        cases = list(dict.fromkeys(x for points in series.values() for x in points))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
        width = 0.8 / max(1, len(series))
        for i, (name, points) in enumerate(series.items()):
            ys = [value(points.get(c)) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], [y if y is not None else 0 for y in ys], width,
                   label=name, color=COLORS.get(name.removesuffix(GRAPH)))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, rotation=15, fontsize=8)
        ax.set_ylabel(unit)
        if log:
            ax.set_yscale("log")
            _plain_ticks(ax.yaxis)
        ax.legend(fontsize=8)
        fig.suptitle(f"{op} on {device}", fontsize=10)
    else:
        ncols = min(3 if len(names) in (5, 6, 9) else 4, len(names))
        nrows = -(-len(names) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.0 * nrows), squeeze=False)
        for ax, name, title in zip(axes.flat, names, titles):
            for series, points in sorted(by_family[name].items(), key=lambda s: _series_order(s[0])):
                if value is peak and series == "floor":  # its tensors are allocated before the measurement
                    continue
                xs = sorted(x for x in points if value(points[x]) is not None)
                if not xs:
                    continue
                base = series.removesuffix(GRAPH)
                ax.plot(xs, [value(points[x]) for x in xs], marker="o", label=series, color=COLORS.get(base),
                        linestyle="--" if base == "floor" or series.endswith(GRAPH) else "-")
            ax.set_xscale("log", base=2)
            sizes = sorted({x for points in by_family[name].values() for x in points})
            ax.set_xticks(sizes, [str(x) for x in sizes])
            ax.xaxis.set_minor_locator(_ticker().NullLocator())
            if log:
                ax.set_yscale("log")
                _plain_ticks(ax.yaxis)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(axis, fontsize=8)
            ax.set_ylabel(unit, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(names):]:
            ax.set_visible(False)
        fig.suptitle(f"{op} on {device}" + (f": {shared}" if shared else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def _ticker():
    import matplotlib.ticker

    return matplotlib.ticker


def _plain_ticks(axis) -> None:
    """Log-axis labels as plain numbers (40, not 4 x 10^1); 2 and 5 times a power of ten
    labelled too where the axis spans under two decades (else it may show no label)."""
    ticker = _ticker()

    def minor(x, pos):
        low, high = axis.get_view_interval()
        mantissa = round(x / 10 ** math.floor(math.log10(x)), 6)
        return f"{x:g}" if high < 100 * low and mantissa in (2, 5) else ""

    axis.set_major_formatter(ticker.FuncFormatter(lambda x, pos: f"{x:g}"))
    axis.set_minor_formatter(ticker.FuncFormatter(minor))


def _series_order(name: str) -> tuple:
    base = name.removesuffix(GRAPH)
    return (ORDER.index(base) if base in ORDER else len(ORDER), name)


def draw_summary(plt, runs: dict, device: str, path: Path) -> None:
    ops = [op for (op, d) in runs if d == device]
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(ops) + 1.5))
    for i, op in enumerate(ops):
        for offset, column, marker in ((-0.12, "eager", "o"), (0.12, "compile", "s")):
            values = speedups(runs[(op, device)], column)
            ax.scatter(values, [i + offset] * len(values), marker=marker, color=COLORS[column], alpha=0.7,
                       label=f"vs {column}" if i == 0 else None)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(ops)), ops)
    ax.invert_yaxis()
    ax.set_xlabel("ours' speed-up (each dot: one row of the op's table; > 1: ours faster)")
    ax.set_title(f"{device}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def make_plots(runs: dict, out: Path) -> list[Path]:
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (op, device), records in runs.items():
        path = out / f"{op}-{slug(device)}-time.png"
        draw(plt, op, device, records, median, "median ms per call", True, path)
        written.append(path)
        if any(peak(r) is not None for r in records):
            path = out / f"{op}-{slug(device)}-memory.png"
            draw(plt, op, device, records, peak, "peak MiB beyond the inputs", False, path)
            written.append(path)
    for device in dict.fromkeys(device for _, device in runs):
        path = out / f"summary-{slug(device)}.png"
        draw_summary(plt, runs, device, path)
        written.append(path)
    return written


# --- command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="*", help="JSONL files (default: bench_results/*.jsonl)")
    parser.add_argument("--out", default=str(REPO / "docs" / "plots"), help="directory for the PNGs")
    parser.add_argument("--doc", default=str(REPO / "docs" / "BENCHMARKS.md"), help="markdown file with table blocks")
    parser.add_argument("--readme", default=str(REPO / "README.md"), help="markdown file with the headline block")
    parser.add_argument("--save", help="write the records behind the tables here (one JSON record a line)")
    parser.add_argument("--no-plots", action="store_true", help="the tables only (no matplotlib needed)")
    args = parser.parse_args(argv)
    paths = args.records or sorted(glob.glob(str(REPO / "bench_results" / "*.jsonl")))
    if not paths:
        raise SystemExit("no records: run a benchmark with --out bench_results/NAME.jsonl first")
    runs = newest_runs(load(paths))
    doc, readme, out = Path(args.doc), Path(args.readme), Path(args.out)
    # The plots first: should they fail, the docs are left as they were.
    written = [] if args.no_plots else make_plots(runs, out)
    for path, blocks in ((doc, doc_blocks(runs, Plots(out, doc), doc)),
                         (readme, {"headline": headline(runs, Plots(out, readme))})):
        if not path.exists():
            print(f"# {path}: not found, not written")
            continue
        for name in rewrite(path, blocks):
            print(f"# {path}: no <!-- table: {name} --> block, not written")
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        with open(args.save, "w") as f:
            for records in runs.values():
                for record in records:
                    f.write(json.dumps(record) + "\n")
    for (op, device), records in runs.items():
        print(f"{op} on {device}: {len(records)} records, commit {records[0]['commit']}, {records[0]['date']}")
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
