"""benchmarks/steady.py at a CPU's size: the runner's command per level as a user types it, its
logged steady samples_per_s read back beside levels.py's for the same model and batch, and the
verdict's ratios (the timings themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import steady as bench


def test_steady_smoke(tmp_path: Path, monkeypatch):
    out = tmp_path / "steady.md"
    argv = ["--device", "cpu", "--model", "tiny", "--image-size", "8", "--batch-size", "8"]
    argv += ["--steps", "6", "--levels", "o0,o1_bf16", "--work", str(tmp_path / "work")]
    # what a piece stopped inside levels.py keeps: the runs' figures, written before it starts
    seen = {}
    run_levels_py = bench.run_levels_py

    def kept_then_run(args, work):
        seen["text"] = out.read_text()
        seen["rows"] = json.loads(out.with_suffix(".json").read_text())["rows"]
        return run_levels_py(args, work)

    monkeypatch.setattr(bench, "run_levels_py", kept_then_run)
    assert bench.main([*argv, "--out", str(out)]) == 0
    assert [r["level"] for r in seen["rows"]] == ["o0", "o1_bf16"]
    assert all(r["samples_per_s"] > 0 and r["levels_samples_per_s"] is None for r in seen["rows"])
    assert "No verdict: levels.py has no figures" in seen["text"]
    assert "o1_bf16 / o0: logged steady" in seen["text"]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {r["level"]: r for r in report["rows"]}
    for row in rows.values():
        assert row["status"] == "ok" and row["samples_per_s"] > 0 and row["warmup_time_s"] > 0
        assert row["epoch_samples_per_s"] > 0 and row["levels_samples_per_s"] > 0
        assert row["kernels"] and int(row["flops_per_sample"]) > 0
    verdict = report["verdict"]
    assert verdict["logged_ratio"] == pytest.approx(
        rows["o1_bf16"]["samples_per_s"] / rows["o0"]["samples_per_s"]
    )
    assert verdict["levels_ratio"] > 0 and isinstance(verdict["pass"], bool)
    text = out.read_text()
    assert "o1_bf16 / o0: logged steady" in text and "levels.py" in text


def test_steady_wants_two_levels(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--device", "cpu", "--levels", "o0"])
    assert stop.value.code == 2 and "two presets" in capsys.readouterr().err
    # a size or count of 0 is refused, not taken for "the default"
    for option in ("--image-size", "--batch-size", "--steps"):
        with pytest.raises(SystemExit) as stop:
            bench.parse_args(["--device", "cpu", option, "0"])
        assert stop.value.code == 2 and f"{option} must be at least 1" in capsys.readouterr().err
