"""Smoke test of benchmarks/logging_cost.py: a tiny budget, a real MLflow SQLite store, the
trainer's own epoch loop; the result files with the expected structure and every logging call in
the store (no timing assertions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import logging_cost as bench


def test_logging_cost_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "logging_cost.md"
    code = bench.main(
        [
            "--image-size",
            "8",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--rounds",
            "2",
            "--intervals",
            "1,2",
            "--extra",
            "model.width=4",
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
        ]
    )
    assert code == 0

    table = out.read_text()
    assert "| 1 | 4 |" in table and "| 2 | 2 |" in table  # calls per block
    assert "Verdict: NOT JUDGED" in table  # 2 is not the runner's default interval (50)
    assert "Load average" in table and "Command:" in table
    assert "Verdict:" in capsys.readouterr().out

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["default_interval"] == 50 and report["intervals"] == [1, 2]
    # warm-up (4 + 2 calls) and 2 rounds of (4 + 2): every call reached the SQLite store
    assert report["logged_calls"] == report["stored_train_loss_values"] == 18
    for row in report["results"]:
        assert row["step_ms_sink_off"] > 0 and row["step_ms_mlflow"] > 0
        assert row["in_call_ms_per_call"] > 0
    with out.with_suffix(".csv").open() as f:
        assert [r["log_every_n_steps"] for r in csv.DictReader(f)] == ["1", "2"]
    assert not (tmp_path / "mlruns").exists()


def test_logging_cost_defaults_and_bad_arguments(capsys):
    assert bench.parse_args([]).intervals == [1, 50]  # 50: the runner's default interval
    for argv, message in [
        (["--intervals", "0"], "--intervals must be at least 1"),
        (["--intervals", "x"], "must be integers"),
        (["--model", "resnet99"], "unknown model"),
        (["--steps", "0"], "--steps must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
