"""benchmarks/plot.py on a small record set written by the benchmarks' own
``common.Row.record`` / ``write_records``: the PNGs it draws, the markdown tables and the
README headline it writes, the newest run it keeps, and its error without matplotlib.
The PNG test needs matplotlib (``pip install .[bench]``) and skips without it; the rest
run without it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PLOT = REPO / "benchmarks" / "plot.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


common = _module("_bench_common_for_test_plot", REPO / "benchmarks" / "common.py")
plot = _module("_bench_plot_for_test_plot", PLOT)

DEVICE = "x86_64 (2 threads)"
SLUG = "x86-64-2-threads"


def _env(date: str, commit: str) -> dict:
    env = common.environment(torch.device("cpu"))  # the real fields, then fixed values
    env.update(date=date, device=DEVICE, commit=commit)
    return env


def _row(bench, case, impl, median_ms, peak_mib=None):
    timing = common.Timing(median_ms, 0.9 * median_ms, 1.1 * median_ms)
    extra = {} if peak_mib is None else {"peak_extra_mib": peak_mib}
    return common.Row(bench, case, impl, timing, 1 << 20, 10.0, extra)


def _write_records(path: Path) -> None:
    old = _env("2026-12-01 09:00:00 UTC", "0ld0ld0ld0ld")
    common.write_records([_row("conv", "fwd 256x4096 fp32", "ours", 9.0)], old, str(path))
    new = _env("2026-12-02 10:00:00 UTC", "abcdefabcdef")
    rows = []
    for rows_n, scale in ((256, 1.0), (4096, 16.0)):
        case = f"fwd {rows_n}x4096 fp32"
        rows += [_row("conv", case, "ours", 0.5 * scale), _row("conv", case, "reference", 3.0 * scale),
                 _row("conv", case, "compiled reference", 1.0 * scale), _row("conv", case, "floor", 0.25 * scale)]
    for n, scale in ((1024, 1.0), (4096, 4.0)):
        case = f"fwd+bwd N{n} V151936 H4096 bfloat16"
        rows += [_row("head", case, "ours", 2.0 * scale, 100.0 * scale),
                 _row("head", case, "reference", 5.0 * scale, 400.0 * scale)]
    common.write_records(rows, new, str(path))


def _docs(tmp_path: Path) -> tuple[Path, Path]:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Results\n\n<!-- table: conv -->\nold conv table\n<!-- end table -->\n\nprose\n\n"
                   "<!-- table: selector -->\nselector table kept\n<!-- end table -->\n\n"
                   "<!-- table: other -->\n<!-- end table -->\n")
    readme = tmp_path / "README.md"
    readme.write_text("# pkg\n\n<!-- table: headline -->\n<!-- end table -->\n")
    return doc, readme


def _run(args, hide_matplotlib=False):
    hide = "sys.modules['matplotlib'] = None; " if hide_matplotlib else ""
    code = (f"import runpy, sys; {hide}sys.argv = {[str(PLOT)] + [str(a) for a in args]!r}; "
            f"runpy.run_path({str(PLOT)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _table_line(doc_text: str, label: str) -> str:
    lines = [line for line in doc_text.splitlines() if line.startswith(f"| {label} |")]
    assert len(lines) == 1, (label, doc_text)
    return lines[0]


def test_tables_from_newest_run(tmp_path):
    records = tmp_path / "records.jsonl"
    _write_records(records)
    doc, readme = _docs(tmp_path)
    saved = tmp_path / "saved.jsonl"
    result = _run([records, "--no-plots", "--out", tmp_path / "plots", "--doc", doc, "--readme", readme,
                   "--save", saved], hide_matplotlib=True)
    assert result.returncode == 0, result.stderr

    text = doc.read_text()
    # ours, eager (ours x), compile (ours x), floor, ours % of floor, peak memory
    assert _table_line(text, "fwd 256x4096 fp32") == \
        "| fwd 256x4096 fp32 | 0.500 | 3.00 (6.00x) | 1.00 (2.00x) | 0.250 | 200% | not measured |"
    assert _table_line(text, "fwd 4096x4096 fp32") == \
        "| fwd 4096x4096 fp32 | 8.00 | 48.0 (6.00x) | 16.0 (2.00x) | 4.00 | 200% | not measured |"
    assert "9.00" not in text and "0ld0ld0ld0ld" not in text  # the older run is dropped
    assert "commit `abcdefabcdef`, 2026-12-02 10:00:00 UTC" in text
    assert "`.venv/bin/python benchmarks/bench_conv.py --out bench_results/conv.jsonl`" in text
    # head has no block of its own: it lands in the "other" block, with its peak memory
    assert _table_line(text, "fwd+bwd N4096 V151936 H4096 bfloat16") == \
        "| fwd+bwd N4096 V151936 H4096 bfloat16 | 8.00 | 20.0 (2.50x) | — | — | — | 400.0 / 1600.0 / — |"
    assert "selector table kept" in text and "old conv table" not in text and "prose" in text
    assert "](" not in text  # no plots drawn, so none linked

    headline = readme.read_text()
    assert "| conv | 2 | 6.00x – 6.00x | 2.00x – 2.00x |" in headline
    assert "| head | 2 | 2.50x – 2.50x | not measured |" in headline

    kept = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(kept) == 12 and {r["commit"] for r in kept} == {"abcdefabcdef"}


def test_size_axis_and_families():
    records = [{"case": f"fwd {n}x4096 fp32", "impl": impl} for n in (256, 4096) for impl in ("ours", "floor")]
    axis, families = plot.families(records)
    assert axis == "rows N"
    assert list(families) == ["fwd Nx4096 fp32"]
    assert sorted(families["fwd Nx4096 fp32"]["ours"]) == [256, 4096]
    records = [{"case": f"op pair_scores fwd N4096 V32000 r{r} float32", "impl": "ours"} for r in (64, 256)]
    axis, families = plot.families(records)  # N does not vary: the rank is the size
    assert axis == "rank r" and list(families) == ["op pair_scores fwd N4096 V32000 r float32"]
    axis, families = plot.families([{"case": "train T1024 A64", "impl": "ours"}])
    assert axis is None  # one size: bars, one per case


def test_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    records = tmp_path / "records.jsonl"
    _write_records(records)
    doc, readme = _docs(tmp_path)
    out = tmp_path / "plots"
    result = _run([records, "--out", out, "--doc", doc, "--readme", readme])
    assert result.returncode == 0, result.stderr
    names = sorted(path.name for path in out.iterdir())
    assert names == sorted([f"conv-{SLUG}-time.png", f"head-{SLUG}-time.png", f"head-{SLUG}-memory.png",
                            f"summary-{SLUG}.png"])
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width > 100 and height > 100, name
    text = doc.read_text()
    assert f"![conv time on {DEVICE}](plots/conv-{SLUG}-time.png)" in text
    assert f"![head peak memory on {DEVICE}](plots/head-{SLUG}-memory.png)" in text
    assert f"conv-{SLUG}-memory.png" not in text  # the conv's records carry no peak memory
    assert f"![ours' speed-up on {DEVICE}](plots/summary-{SLUG}.png)" in readme.read_text()


def test_without_matplotlib_says_how_to_get_it(tmp_path):
    records = tmp_path / "records.jsonl"
    _write_records(records)
    doc, readme = _docs(tmp_path)
    before = doc.read_text()
    result = _run([records, "--out", tmp_path / "plots", "--doc", doc, "--readme", readme], hide_matplotlib=True)
    assert result.returncode != 0
    assert "pip install .[bench]" in result.stderr
    assert doc.read_text() == before  # nothing rewritten when the plots fail
