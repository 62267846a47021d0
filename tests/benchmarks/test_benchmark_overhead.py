"""Smoke test of benchmarks/overhead.py: a tiny model and budget, real runner objects on both
sides, the three result files with the expected structure (no timing assertions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import common, startup
from benchmarks import overhead as bench
from runner.measure import step_trace
from tests.helpers.benchmarks import own_tempdir


def test_overhead_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "overhead.md"
    code = bench.main(
        [
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--image-size",
            "16",
            "--batch-size",
            "8",
            "--rounds",
            "2",
            "--block",
            "1",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0

    table = out.read_text()
    assert "| O0 | `o0` | plain fp32 loop |" in table
    assert "| O1 | `o1_bf16` | torch.autocast (no scaler: bf16) |" in table
    assert "| O2 | `o2_bf16` | 16-bit model + fp32 masters" in table
    assert "Verdict:" in table and "Command:" in table and "Load average" in table
    assert "informational" in table  # tiny is not the target's task
    assert "Verdict:" in capsys.readouterr().out

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["level"] for r in rows] == ["o0", "o1_bf16", "o2_bf16"]
    assert [r["target"] for r in rows] == ["<= 1.03", "<= 1.03", "< 1"]

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["task"] == {
        "model": "tiny",
        "image_size": 16,
        "batch_size": 8,
        "channels_last": False,
    }
    assert len(report["load_start"]) == 3 and len(report["load_end"]) == 3
    for row in report["results"]:
        assert row["runner_ms"]["samples"] == row["handwritten_ms"]["samples"] == 2
        assert row["ratio"] > 0
        # both sides start from the same weights and batch: the same first loss
        assert row["first_loss_runner"] == pytest.approx(row["first_loss_handwritten"], rel=1e-2)


@pytest.mark.parametrize(
    "level,model", [("o1_bf16", "tiny"), ("o2_bf16", "tiny"), ("o2_bf16", "gpt_tiny")]
)
def test_the_fp32_model_is_the_weights_the_runner_starts_from(level, model):
    """common.fp32_model builds the run's own O0 plan: the same initial weights as the runner's
    model, which O1 keeps in fp32 (equal) and O2 casts to bf16 (equal once cast)."""
    import torch

    cfg = common.compose([*common.one_batch_task(model, 16, 4, "cpu"), f"precision={level}"])
    start = common.fp32_model(cfg)
    runner = common.build_runner(cfg).model.state_dict()
    weights = {k: v for k, v in start.state_dict().items() if v.is_floating_point()}
    assert weights and {p.dtype for p in start.parameters()} == {torch.float32}
    for key, value in weights.items():
        assert torch.equal(value.to(runner[key].dtype), runner[key]), key


def test_overhead_benchmark_rejects_bad_arguments(capsys):
    for argv, message in [
        (["--levels", "o3_bf16"], "no hand-written counterpart"),
        (["--levels", "o9"], "unknown level"),
        (["--model", "resnet99"], "unknown model"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(["--device", "cpu", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow  # five short processes: the runner's and the hand-written loop's, twice each
def test_startup_benchmark_smoke(tmp_path: Path, capsys, monkeypatch):
    """`overhead.py --startup` times whole processes: both sides ran (one pair after a warm-up
    each), the runner's phases add up to its wall time, every file has its structure (no timing
    assertion), and its scratch folder (the runs' store and checkpoints) is gone."""
    out = tmp_path / "results" / "startup.md"
    scratch = own_tempdir(tmp_path, monkeypatch)
    code = bench.main(
        ["--startup", "--pairs", "1", "--cold", "0", "--import-repeats", "1", "--out", str(out)]
    )
    assert code == 0, capsys.readouterr()
    assert not list(scratch.glob("amp-runner-startup-*"))
    table = out.read_text()
    assert "| runner |" in table and "| hand-written loop |" in table
    assert "runner - hand" in table and "Target: runner - hand <= 1.5 s" in table
    assert (
        "## Where the runner's time goes" in table and "| mlflow (client, SQLite store) |" in table
    )
    assert "Command: `python -m benchmarks.startup --pairs 1" in table
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["side"], r["pair"]) for r in rows] == [("runner", "1"), ("hand", "1")]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["cold"] == [] and len(report["gaps_s"]) == 1
    phases = sum(report["phases_median_s"].values())
    assert phases == pytest.approx(report["runner_s"][0], abs=0.2)
    assert report["gaps_s"][0] == pytest.approx(report["runner_s"][0] - report["hand_s"][0])


def test_startup_phases_from_the_log_timestamps():
    """A run's log lines split its wall time into phases; a phase whose line is missing counts
    zero and the next one takes its time."""
    import datetime as dt

    start = dt.datetime(2026, 1, 1, 12, 0, 0).timestamp()
    log = "\n".join(
        [
            "[2026-01-01 12:00:04,000][runner.run.app][INFO] - Precision (Apex O0, resolved):",
            "[2026-01-01 12:00:06,500][runner.run.app][INFO] - Kernels: cpp "
            "(precision.kernels=auto)",
            "[2026-01-01 12:00:07,500][runner.run.app][INFO] - Finished tiny-O0: best val_acc 0.1",
        ]
    )
    phases = list(startup.phases(log, start, 8.0).values())
    assert phases == pytest.approx([4.0, 2.5, 0.0, 1.0, 0.5])


def test_overhead_instruments_smoke(tmp_path: Path):
    """--instruments: the trainer's instruments at a usual step (the step timer alone) keep
    nothing per step, read no device value and hold no hook (the timings themselves are not
    asserted)."""
    out = tmp_path / "instruments.md"
    argv = ["--instruments", "--device", "cpu", "--model", "tiny", "--image-size", "16"]
    argv += ["--batch-size", "8", "--levels", "o0", "--rounds", "2", "--calls", "1000"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    assert "at a usual step" in out.read_text() and "**cost**" in out.read_text()
    assert "(TimingInstrument)" in out.read_text()
    result = json.loads(out.with_suffix(".json").read_text())["result"]
    assert result["device_reads"] == 0 and result["hooks_during_an_idle_step"] == 0
    # at most FOLD_EVERY steps' marks pending (then folded into sums and a histogram), and the
    # epoch's trace of steady step times (at most CAPACITY float32s, for the speed-ups'
    # intervals): a bound, not a byte a step (10,000)
    assert result["bytes_kept_after_10000"] < 64 * 1024 + 2 * step_trace.CAPACITY * 4
    assert result["runner_step_ms"] > 0 and result["calls"] == 1000
