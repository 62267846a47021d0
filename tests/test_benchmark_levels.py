"""Smoke test of benchmarks/levels.py: a tiny model and budget on CPU, real runner cells, the
result files (Markdown, CSV, JSON, PNG) with the expected structure; two partial runs merged into
one table, and a table re-rendered from JSON files (no timing assertions)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.benchmark_helpers import load_benchmark

TINY = ["--device", "cpu", "--models", "tiny", "--image-size", "16", "--batch-size", "8",
        "--steps", "1", "--warmup", "0"]


def test_levels_benchmark_smoke_and_merge(tmp_path: Path, capsys):
    bench = load_benchmark("levels")
    out = tmp_path / "results" / "levels.md"
    assert bench.main([*TINY, "--levels", "o0,o2_bf16", "--out", str(out)]) == 0
    # a second command adds cells to the same table
    assert bench.main([*TINY, "--levels", "o3_bf16,torch_amp", "--out", str(out),
                       "--merge"]) == 0

    table = out.read_text()
    assert "| tiny | O0 | `o0` | float32 | 16 | 8 |" in table
    assert "| tiny | O2 | `o2_bf16` | bfloat16 (fp32 BatchNorm, fp32 master weights) |" in table
    assert "| tiny | O3 | `o3_bf16` |" in table
    assert "| tiny | - | `torch_amp` | float32 weights, autocast bfloat16 |" in table
    assert "NO TARGETS on CPU" in table and "Run 2 (tiny)" in table
    assert "Verdict:" in capsys.readouterr().out

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["device"] == "cpu" and len(report["runs"]) == 2
    cells = report["cells"]
    assert [c["level"] for c in cells] == ["o0", "o2_bf16", "o3_bf16", "torch_amp"]
    assert [c["run"] for c in cells] == [0, 0, 1, 1]
    for c in cells:
        assert c["status"] == "ok" and c["memory_kind"].startswith("cpu_")
        assert c["samples_per_s"] > 0 and c["step_ms"] > 0 and c["peak_mem_mb"] >= 0
    assert cells[0]["speedup_vs_o0"] == pytest.approx(1.0)
    for run in report["runs"]:
        assert len(run["load_start"]) == 3 and run["command"].startswith("python benchmarks/")

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["level"] for r in rows] == ["o0", "o2_bf16", "o3_bf16", "torch_amp"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # re-rendered from JSON alone (how GPU parts fetched separately are combined)
    again = tmp_path / "again" / "levels.md"
    assert bench.main(["--from-json", str(out.with_suffix(".json")), "--out", str(again)]) == 0
    assert json.loads(again.with_suffix(".json").read_text())["cells"] == cells
    assert again.with_suffix(".png").is_file()


def test_levels_benchmark_rejects_bad_arguments(tmp_path: Path, capsys):
    bench = load_benchmark("levels")
    for argv, message in [(["--levels", "o9"], "unknown level"),
                          (["--models", "resnet99"], "unknown model"),
                          (["--steps", "0"], "--steps must be at least 1"),
                          (["--from-json", str(tmp_path / "none.json")], "no such file")]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(["--device", "cpu", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
