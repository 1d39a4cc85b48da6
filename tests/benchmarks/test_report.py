"""The benchmark tables (docs/benchmarks.md) are generated from benchmarks/results/*.json, never
typed; the README points to them and quotes no figure."""

from __future__ import annotations

import json
import re
from pathlib import Path

from _bench import load_benchmark

report = load_benchmark("report")
ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_tables_are_what_report_renders_from_the_committed_json():
    text = report.TABLES_FILE.read_text()
    expected = report.replace_section(text, report.render(report.load_results()))
    assert text == expected, "run `python -m benchmarks.report` (or `make bench`)"


def test_benchmark_prose_outside_the_tables_holds_no_measured_number():
    text = report.TABLES_FILE.read_text()
    prose = text[: text.index(report.BEGIN)] + text[text.index(report.END) :]
    readme = (ROOT / "README.md").read_text()
    prose += readme[readme.index("## Benchmarks") : readme.index("## Development")]
    prose = re.sub(r"`[^`]*`", "", prose)  # file names, keys and commands may hold digits
    assert not re.search(r"\d", prose), "a measured figure belongs in the JSON and its table"


def test_new_result_shapes_render_spreads_cpu_ratios_and_targets(tmp_path):
    results = report.load_results()
    spread = {"min": 1.5, "median": 1.9, "max": 2.0, "repeats": 5, "values": []}
    cpu = {"min": 1.6, "median": 1.95, "max": 2.1, "repeats": 5, "values": []}
    results["readers"] = {
        **results["readers"],
        "reader_speedup_vs_baseline": 1.9,
        "reader_speedup_vs_baseline_spread": {"median": 1.9, "wall": spread, "cpu": cpu},
        "targets": {"reader_speedup_vs_baseline": 2.0},
    }
    text = report.render(results)
    row = next(line for line in text.splitlines() if "`reader_speedup_vs_baseline`" in line)
    assert "1.90x — 1.50x–2.00x over 5 repeats" in row
    assert "CPU-time ratio 1.95x (1.60x–2.10x over 5 repeats)" in row
    assert "not met" in row and ">= 2 " in row
    del results["trainer"]
    assert "**Trainer**" not in report.render(results)  # a missing results file: no table


def test_report_check_and_rewrite(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    src = ROOT / "benchmarks" / "results" / "trainer.json"
    (folder / "trainer.json").write_text(src.read_text())
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n")
    argv = ["--results", str(folder), "--readme", str(readme)]
    assert report.main([*argv, "--check"]) == 1
    assert report.main(argv) == 0
    assert report.main([*argv, "--check"]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "**Trainer**" in text
    assert "old" not in text
    data = json.loads(src.read_text())
    assert f"{data['dedup_speedup']:.2f}x" in text


def test_gpu_sweep_row_shows_each_batch_size_and_vanishes_without_a_sweep():
    results = report.load_results()
    gpu = dict(results["kernels_gpu"])
    point = {f"{name}_share_of_peak": 0.25 for name in report._GPU_KERNELS}
    sweep = [
        {**point, "rows": rows, "torch_copy_share_of_peak": 0.5, "jagged_index_select_ms": 1.25}
        for rows in (4096, 131072)
    ]
    results["kernels_gpu"] = {**gpu, "gpu_sweep": sweep}
    rows = [line for line in report.render(results).splitlines() if line.startswith("| `gpu_")]
    assert len(rows) == 1
    row = rows[0]
    assert "4,096 rows: 25.0% / 25.0% / 25.0% / 50.0% (1.25 ms select)" in row
    assert "131,072 rows:" in row
    results["kernels_gpu"] = {k: v for k, v in gpu.items() if k != "gpu_sweep"}
    assert not [line for line in report.render(results).splitlines() if line.startswith("| `gpu_")]
