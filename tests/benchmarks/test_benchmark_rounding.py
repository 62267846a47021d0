"""Smoke test of benchmarks/rounding.py (the stall case): a tiny budget, real runs into a real
MLflow store, the four result files with the expected structure (no accuracy or timing
assertions: the budget is far too small to show the stall)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from benchmarks import rounding as bench

LEVELS = ["o2_bf16", "o3_bf16", "o3_bf16_sr"]


@pytest.mark.slow  # three real runs of two epochs and a fresh MLflow store: about 10-15 s
def test_rounding_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "rounding.md"
    code = bench.main(
        [
            "--seeds",
            "0",
            "--epochs",
            "2",
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            # 3 steps per epoch (the last batch partial), the loss logged every 2: two values in the
            # first epoch's window, the epoch mean weighted by the steps each covers
            "--extra",
            "data.num_train=80",
            "data.num_val=32",
            "trainer.batch_size=32",
            "trainer.log_every_n_steps=2",
        ]
    )
    assert code == 0

    table = out.read_text()
    assert "| `o2_bf16` | bfloat16 (fp32 BatchNorm, fp32 master weights) |" in table
    assert "| `o3_bf16` | bfloat16 |" in table
    assert "| `o3_bf16_sr` | bfloat16 (stochastic rounding) |" in table
    assert "Verdict: STALL" in table and "Command:" in table
    assert "![Training loss and validation accuracy per epoch](rounding.png)" in table
    assert "| 2 | " in table  # the per-epoch table reaches the last epoch
    assert "Verdict:" in capsys.readouterr().out
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["level"], r["epoch"]) for r in rows] == [
        (level, epoch) for level in LEVELS for epoch in ("1", "2")
    ]
    for row in rows:
        assert row["status"] == "finished" and row["run_id"]
        assert 0.0 <= float(row["val_acc"]) <= 1.0
        assert math.isfinite(float(row["train_loss"])) and float(row["train_loss"]) > 0

    report = json.loads(out.with_suffix(".json").read_text())
    assert [s["level"] for s in report["summary"]] == LEVELS
    assert report["thresholds"] == {
        "stall_points": bench.STALL_POINTS,
        "sr_points": bench.SR_POINTS,
    }
    assert "trainer.log_every_n_steps=2" in report["overrides"]
    for summary, run in zip(report["summary"], report["runs"]):
        assert len(summary["val_acc"]["mean"]) == len(summary["train_loss"]["mean"]) == 2
        # the best accuracy the run returned is the best of the history read back from the store
        assert run["best_val_acc"] == pytest.approx(max(run["val_acc"]))
    assert report["summary"][0]["vs_reference_points"] == 0.0
    assert not (tmp_path / "mlruns").exists()


def test_epoch_means_weights_each_logged_value_by_the_steps_it_covers():
    # 3 steps per epoch, logged at steps 2 and 3 (epoch 1: 2 steps then 1), 5 and 6 (epoch 2:
    # 2 then 1), and nothing in epoch 3
    history = [(2, 1.0), (3, 4.0), (5, 2.0), (6, 5.0)]
    assert bench.epoch_means(history, 3, 3) == [pytest.approx(2.0), pytest.approx(3.0), None]
    assert bench.epoch_means([(3, 0.5), (6, 0.25)], 3, 2) == [0.5, 0.25]  # once per epoch
    assert bench.per_epoch([(1, 0.1), (3, 0.3)], 3) == [0.1, None, 0.3]


def test_rounding_benchmark_rejects_bad_arguments(capsys):
    for argv, message in [
        (["--levels", "o9"], "unknown level"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--seeds", "a"], "--seeds must be integers"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
