"""Smoke test of benchmarks/accuracy.py: a tiny budget, real runs, the three result files."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.benchmark_helpers import load_benchmark


def _load_benchmark():
    return load_benchmark("accuracy")


@pytest.mark.slow  # two real runs and a fresh MLflow store: about 10-15 s on 2 cores
def test_accuracy_benchmark_smoke(tmp_path: Path, capsys):
    bench = _load_benchmark()
    out = tmp_path / "results" / "accuracy.md"
    code = bench.main([
        "--levels", "o0,o2_bf16",
        "--seeds", "0",
        "--device", "cpu",
        "--epochs", "1",
        "--out", str(out),
        "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--extra", "data.num_train=64", "data.num_val=64", "trainer.batch_size=32",
    ])
    assert code == 0

    table = out.read_text()
    assert "| O0 | `o0` | float32 |" in table
    assert "| O2 | `o2_bf16` | bfloat16 (fp32 BatchNorm, fp32 master weights) |" in table
    assert "Verdict:" in table and "Command:" in table
    assert "Verdict:" in capsys.readouterr().out  # the table is printed too

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["level"], r["seed"], r["status"]) for r in rows] == [
        ("o0", "0", "finished"), ("o2_bf16", "0", "finished")]
    for row in rows:
        assert 0.0 <= float(row["best_val_acc"]) <= 1.0
        assert float(row["skipped_steps"]) == 0.0
        assert row["run_id"]  # read back from the MLflow store

    report = json.loads(out.with_suffix(".json").read_text())
    assert [s["level"] for s in report["summary"]] == ["o0", "o2_bf16"]
    assert report["summary"][1]["checked"] is True
    assert report["num_val"] == 64 and report["seeds"] == [0]
    assert not (tmp_path / "mlruns").exists()  # artifacts stay beside the database


def test_accuracy_benchmark_adds_the_baseline_and_rejects_unknown_levels(capsys):
    bench = _load_benchmark()
    args = bench.parse_args(["--levels", "o3_bf16", "--device", "cpu"])
    assert args.levels == ["o0", "o3_bf16"]
    assert args.seeds == [0, 1, 2]
    try:
        bench.parse_args(["--levels", "o9", "--device", "cpu"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("an unknown level was accepted")
    assert "unknown level" in capsys.readouterr().err
