"""Smoke test of benchmarks/accuracy.py: a tiny budget, real runs, the three result files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import accuracy as bench
from benchmarks import harness


@pytest.mark.slow  # two real runs and a fresh MLflow store: about 10-15 s on 2 cores
def test_accuracy_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "accuracy.md"
    code = bench.main(
        [
            "--levels",
            "o0,o2_bf16",
            "--seeds",
            "0",
            "--device",
            "cpu",
            "--epochs",
            "1",
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--extra",
            "data.num_train=64",
            "data.num_val=64",
            "trainer.batch_size=32",
        ]
    )
    assert code == 0

    table = out.read_text()
    assert "| O0 | `o0` | float32 |" in table
    assert "| O2 | `o2_bf16` | bfloat16 (fp32 BatchNorm, fp32 master weights) |" in table
    assert "Verdict:" in table and "Command:" in table
    assert "Verdict:" in capsys.readouterr().out  # the table is printed too

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["level"], r["seed"], r["status"]) for r in rows] == [
        ("o0", "0", "finished"),
        ("o2_bf16", "0", "finished"),
    ]
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


@pytest.mark.slow  # four real runs (torchao's import: a few seconds); the compiled rows' real
# compile is tested once, in test_benchmark_levels (a cold CPU compile takes 15-30 s)
def test_accuracy_benchmark_sr_and_fp8_rows(tmp_path: Path):
    out = tmp_path / "accuracy.md"
    code = bench.main(
        [
            "--levels",
            "o2_bf16,o3_bf16_sr,o1_fp8",
            "--seeds",
            "0",
            "--device",
            "cpu",
            "--epochs",
            "1",
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'm.db'}",
            "--extra",
            "data.num_train=64",
            "data.num_val=64",
            "trainer.batch_size=32",
        ]
    )
    assert code == 0

    table = out.read_text()
    assert "| O3 | `o3_bf16_sr` | bfloat16 (stochastic rounding) |" in table
    assert (
        "| O1 | `o1_fp8` | float32 weights, autocast bfloat16, fp8 Linear (tensorwise) |" in table
    )
    assert "vs `o2_bf16` within 0.3:" in table  # the SR row's own check
    assert "o3_bf16_sr against o2_bf16: " in table.split("Verdict:")[1].splitlines()[0]
    # the tiny CNN's 10-output head is not fp8-able: the table says so plainly
    assert "**`o1_fp8` converted no layer to fp8 on `tiny`**" in table
    assert "torch.compile" not in table  # no compiled row, no compile note

    with out.with_suffix(".csv").open() as f:
        rows = {r["level"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["o0", "o2_bf16", "o3_bf16_sr", "o1_fp8"]
    assert all(r["status"] == "finished" for r in rows.values())
    assert rows["o1_fp8"]["fp8_layers"] == "0" and rows["o0"]["fp8_layers"] == ""
    assert all(r["compile_time_s"] == "" for r in rows.values())
    for row in rows.values():  # the sum of the epochs' epoch_time_s, read back from the store
        assert 0 < float(row["epochs_time_s"]) <= float(row["train_time_s"])

    report = json.loads(out.with_suffix(".json").read_text())
    summary = {s["level"]: s for s in report["summary"]}
    assert summary["o1_fp8"]["checked"] and summary["o1_fp8"]["fp8_layers"] == [0]
    assert summary["o3_bf16_sr"]["sr_checked"] and not summary["o3_bf16_sr"]["checked"]
    assert summary["o3_bf16_sr"]["vs_reference_points"] == pytest.approx(
        100 * (summary["o3_bf16_sr"]["mean"] - summary["o2_bf16"]["mean"])
    )

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    names = {
        r.info.run_name
        for r in client.search_runs(
            [client.get_experiment_by_name("accuracy-parity").experiment_id]
        )
    }
    assert "tiny-o1_fp8-seed0" in names and "tiny-o3_bf16_sr-seed0" in names
    assert bench.run_name("tiny", "o2_bf16+compile", 1) == "tiny-o2_bf16-compiled-seed1"


def test_accuracy_level_specs_and_the_sr_check(capsys):
    args = bench.parse_args(["--levels", "o2_bf16+compile,o3_bf16_sr", "--device", "cpu"])
    assert args.levels == ["o0", "o2_bf16+compile", "o3_bf16_sr"]
    assert bench.parse_args(["--device", "cpu"]).levels == bench.CPU_LEVELS
    for bad, message in [
        ("o2_bf16+fast", "the suffixes are +compile"),
        ("o2_bf16+int3state", "the suffixes are +compile"),
        ("o9+compile", "unknown level 'o9'"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(["--levels", bad, "--device", "cpu"])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err

    def results(level, accs, opt_level):
        return [
            bench.RunResult(level, seed, opt_level=opt_level, best_val_acc=acc)
            for seed, acc in enumerate(accs)
        ]

    base = [*results("o0", [0.850, 0.860], "O0"), *results("o2_bf16", [0.850, 0.858], "O2")]
    levels = ["o0", "o2_bf16", "o3_bf16_sr"]
    rows = bench.summarise([*base, *results("o3_bf16_sr", [0.848, 0.856], "O3")], levels, [0, 1])
    sr = rows[2]
    assert sr.vs_reference_points == pytest.approx(-0.2) and sr.within_sr_target
    assert "o3_bf16_sr against o2_bf16: PASS, -0.20 point(s)" in bench.verdict(rows)
    rows = bench.summarise([*base, *results("o3_bf16_sr", [0.846, 0.854], "O3")], levels, [0, 1])
    assert rows[2].vs_reference_points == pytest.approx(-0.4) and not rows[2].within_sr_target
    assert "o3_bf16_sr against o2_bf16: MISS, -0.40 point(s)" in bench.verdict(rows)
    # without its reference the check is not judged (and the O0 check is unaffected)
    rows = bench.summarise(
        [*base[:2], *results("o3_bf16_sr", [0.85, 0.85], "O3")], ["o0", "o3_bf16_sr"], [0, 1]
    )
    assert "o3_bf16_sr against o2_bf16: NOT JUDGED (o2_bf16 was not run)" in bench.verdict(rows)


def test_accuracy_compiled_rows_are_checked_and_show_their_compile_times():
    runs = [
        bench.RunResult(
            "o0",
            s,
            opt_level="O0",
            dtype="float32",
            best_val_acc=0.85,
            train_time_s=10.0,
            epochs_time_s=8.0,
        )
        for s in (0, 1)
    ]
    runs += [
        bench.RunResult(
            "o0+compile",
            s,
            opt_level="O0",
            dtype="float32; torch.compile",
            compiled=True,
            best_val_acc=acc,
            train_time_s=t + 7.0,
            epochs_time_s=7.0,
            compile_time_s=t,
        )
        for s, acc, t in ((0, 0.83, 30.0), (1, 0.84, 4.0))
    ]
    rows = bench.summarise(runs, ["o0", "o0+compile"], [0, 1])
    assert rows[1].checked and rows[1].compiled and rows[1].compile_times_s == [30.0, 4.0]
    assert rows[1].diff_points == pytest.approx(-1.5) and not rows[1].within_target
    report = {
        "device": "cpu",
        "model": "tiny",
        "seeds": [0, 1],
        "epochs": 1,
        "num_val": 0,
        "compile_cache": "a new empty folder",
        "command": "c",
        "date": "d",
        "total_wall_s": 60.0,
        "tracking_uri": "u",
        "experiment": "e",
        "overrides": [],
        "runs": [],
        "_results": runs,
        "machine": {
            "cpu": "x",
            "cores": "2",
            "torch_threads": "2",
            "torch": "t",
            "python": "p",
            "platform": "l",
        },
    }
    table = bench.render_markdown(report, rows)
    assert (
        "| O0 | `o0+compile` | float32; torch.compile | 83.00 | 84.00 | 83.50 ± 0.71 | -1.50 "
        "| within 1: **no** | - | - | 30.0 / 4.0 | 7.0 | 24.0 |"
    ) in table
    assert "MISS: o0+compile -1.50 point(s) from O0" in table
    assert "torch.compile's on-disk cache was a new empty folder" in table


def test_accuracy_state_rows_parse_and_are_checked_against_their_own_level():
    args = bench.parse_args(["--suite", "state", "--device", "cpu"])
    assert args.levels == ["o0", *bench.STATE_LEVELS] and args.model == "vit_tiny"
    assert args.epochs == bench.STATE_EPOCHS and "optimizer=adamw" in bench.task_overrides(args)
    assert args.out.name == "accuracy_state_cpu.md"
    assert harness.state_reference("o2_bf16+int4state") == ("o2_bf16", "int4")
    assert harness.state_reference("o2_bf16+int8state+compile") == ("o2_bf16+compile", "int8")
    assert harness.state_reference("o3_bf16_sr_int8state") == ("o3_bf16_sr", "int8")
    assert harness.state_reference("o2_bf16") == (None, None)
    run = bench.RunResult("o2_bf16+int4state", 3)
    args.tracking_uri, args.experiment = "sqlite:///m.db", "e"
    assert harness.run_overrides([], run, args, "name", "key")[:3] == [
        "precision=o2_bf16",
        "precision.optimizer_state=int4",
        "trainer.seed=3",
    ]
    assert bench.run_name("vit_tiny", "o2_bf16+bf16state", 0) == "vit_tiny-o2_bf16-bf16state-seed0"

    def results(level, accs, opt_level, state_mb, state):
        return [
            bench.RunResult(
                level,
                seed,
                opt_level=opt_level,
                best_val_acc=acc,
                state_mb=state_mb,
                optimizer_state=state,
            )
            for seed, acc in enumerate(accs)
        ]

    runs = [
        *results("o0", [0.60, 0.62], "O0", 4.0, "float32"),
        *results("o2_bf16", [0.60, 0.62], "O2", 4.0, "float32"),
        *results("o2_bf16_int8state", [0.601, 0.621], "O2", 1.0, "int8"),
        *results("o2_bf16+int4state", [0.58, 0.60], "O2", 0.6, "int4"),
        *results("o2_bf16+bf16state", [0.596, 0.612], "O2", 2.0, "bfloat16"),
        # O3 keeps its state in the weights' bf16: the targets are of fp32 state all the same
        *results("o3_bf16_sr", [0.60, 0.62], "O3", 2.0, "bfloat16"),
        *results("o3_bf16_sr_int8state", [0.60, 0.62], "O3", 1.1, "int8"),
    ]
    levels = [
        "o0",
        "o2_bf16",
        "o2_bf16_int8state",
        "o2_bf16+int4state",
        "o2_bf16+bf16state",
        "o3_bf16_sr",
        "o3_bf16_sr_int8state",
    ]
    rows = {r.level: r for r in bench.summarise(runs, levels, [0, 1])}
    sr8 = rows["o3_bf16_sr_int8state"]
    assert sr8.state_memory_ratio == pytest.approx(1.1 / 4.0) and sr8.within_memory_target
    assert sr8.state_vs_reference == pytest.approx(0.55)
    assert bench._state_check(sr8) == (
        "vs `o3_bf16_sr` within 0.2: yes (+0.00); state 0.28x of "
        "fp32 (<= 0.3: yes), 0.55x of `o3_bf16_sr`'s bfloat16"
    )
    int8, int4, bf16 = (
        rows["o2_bf16_int8state"],
        rows["o2_bf16+int4state"],
        rows["o2_bf16+bf16state"],
    )
    assert not int8.checked and int8.state_reference == "o2_bf16"  # not against O0
    assert int8.vs_state_points == pytest.approx(0.1) and int8.within_state_target
    assert int8.state_memory_ratio == pytest.approx(0.25) and int8.within_memory_target
    assert int4.within_state_target is None  # int4 accuracy is reported
    assert int4.state_memory_ratio == pytest.approx(0.15) and int4.within_memory_target
    assert bf16.vs_state_points == pytest.approx(-0.6) and not bf16.within_state_target
    assert bf16.within_memory_target is None
    text = bench.verdict(list(rows.values()))
    assert "o2_bf16_int8state vs o2_bf16: PASS (+0.10 point, state 0.25x of fp32)" in text
    assert "o2_bf16+int4state vs o2_bf16: PASS (-2.00 point, state 0.15x of fp32)" in text
    assert "o2_bf16+bf16state vs o2_bf16: MISS (-0.60 point, state 0.50x of fp32)" in text
    assert (
        bench._state_check(int8)
        == "vs `o2_bf16` within 0.2: yes (+0.10); state 0.25x of fp32 (<= 0.3: yes)"
    )


@pytest.mark.slow  # four real runs of vit_tiny, torchao's update uncompiled (a cold compile of
# every parameter shape would take minutes on 2 cores)
def test_accuracy_benchmark_state_suite_smoke(tmp_path: Path, monkeypatch):
    import torchao.optim.adam as adam

    monkeypatch.setattr(adam.torch, "compile", lambda fn, **kwargs: fn)
    out = tmp_path / "accuracy_state.md"
    code = bench.main(
        [
            "--suite",
            "state",
            "--levels",
            "o2_bf16,o2_bf16_int8state,o2_bf16+bf16state",
            "--seeds",
            "0",
            "--device",
            "cpu",
            "--epochs",
            "1",
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'm.db'}",
            "--extra",
            "data.num_train=64",
            "data.num_val=64",
            "trainer.batch_size=32",
        ]
    )
    assert code == 0
    table = out.read_text()
    assert (
        "| O2 | `o2_bf16_int8state` | bfloat16 (fp32 BatchNorm, fp32 master weights), int8 "
        "optimizer state |"
    ) in table
    assert "vs `o2_bf16` within 0.2:" in table and "(<= 0.3: " in table
    assert "optimizer state against its level's own: o2_bf16_int8state vs o2_bf16:" in table
    with out.with_suffix(".csv").open() as f:
        rows = {r["level"]: r for r in csv.DictReader(f)}
    assert rows["o2_bf16_int8state"]["optimizer_state"] == "int8"
    assert rows["o2_bf16+bf16state"]["optimizer_state"] == "bfloat16"
    ratio = float(rows["o2_bf16_int8state"]["state_mb"]) / float(rows["o2_bf16"]["state_mb"])
    assert ratio <= 0.3, ratio
    assert float(rows["o2_bf16+bf16state"]["state_mb"]) / float(
        rows["o2_bf16"]["state_mb"]
    ) == pytest.approx(0.5, abs=0.01)
