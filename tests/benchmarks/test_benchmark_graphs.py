"""benchmarks/graphs.py on a CPU, where planning refuses `trainer.cuda_graphs`: real runs of its
check mode time the eager sides (the runner's step, the hand-written loop, Lightning), measure
their busy share with runner.measure.busy's instrument, say what planning refused, and write the
files after each group; the verdict judged on given rows (no timing assertions); bad arguments
refused before any work."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import graphs as bench

REPO = Path(__file__).resolve().parents[2]


def test_on_a_cpu_the_eager_sides_are_timed_and_the_refusals_said(tmp_path: Path, monkeypatch):
    out = tmp_path / "results" / "graphs.md"
    argv = ["--device", "cpu", "--model", "tiny", "--shapes", "16x4,8x4", "--levels", "o2,o0"]
    argv += ["--steps", "1", "--rounds", "1", "--warmup", "1", "--busy-steps", "2"]
    # a piece stopped at its limit keeps the groups that ran: the table is written after each
    written = []
    run_group = bench.run_group

    def after_the_last_write(*args):
        written.append(out.read_text() if out.exists() else None)
        return run_group(*args)

    monkeypatch.setattr(bench, "run_group", after_the_last_write)
    assert bench.main([*argv, "--out", str(out)]) == 0
    assert len(written) == 4 and written[0] is None
    assert "| 16 | 4 | o2 | runner, eager | false |" in written[1]
    assert "| o0 |" not in written[1].split("## Verdict")[0]

    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["results"]
    sides = [(r["image_size"], r["level"], r["side"]) for r in rows]
    assert sides == [
        (16, "o2", "eager"),
        (16, "o2", "optimizer"),  # (the first shape's first level only)
        (16, "o2", "step"),
        (16, "o2", "hand"),
        (16, "o2", "lightning"),  # (each shape's first level)
        (16, "o0", "eager"),
        (16, "o0", "step"),
        (16, "o0", "hand"),
        (8, "o2", "eager"),
        (8, "o2", "step"),
        (8, "o2", "hand"),
        (8, "o2", "lightning"),
        (8, "o0", "eager"),
        (8, "o0", "step"),
        (8, "o0", "hand"),
    ]
    for r in rows:
        if r["side"] in ("optimizer", "step"):  # a CUDA graph needs a CUDA device
            assert r["status"] == "refused" and "needs a CUDA device" in r["refused"], r
            assert f"trainer.cuda_graphs: {r['mode']}, but" in r["refused"]
            continue
        assert r["status"] == "ok" and r["ms"] > 0 and math.isfinite(r["loss"]), r
        assert 0 < r["busy"] <= 1, r  # (the CPU operators' share of the steps)
        assert r["samples_per_s"] == pytest.approx(4 / (r["ms"] / 1e3))
    lightning = {r["image_size"]: r for r in rows if r["side"] == "lightning"}
    assert {r["mode"] for r in lightning.values()} == {"bf16-mixed"}  # (fp16: GPU only)
    for r in rows:
        if r["status"] != "ok" or r["side"] == "lightning":
            continue
        same = [x for x in rows if x["image_size"] == r["image_size"] and x["status"] == "ok"]
        ref = next(x for x in same if x["level"] == r["level"] and x["side"] == "eager")
        o0 = next(x for x in same if x["level"] == "o0" and x["side"] == r["side"])
        assert r["vs_eager"] == pytest.approx(ref["ms"] / r["ms"])
        assert r["vs_o0"] == pytest.approx(o0["ms"] / r["ms"])
        assert r["vs_lightning"] == pytest.approx(lightning[r["image_size"]]["ms"] / r["ms"])
    # the same work: at O0 (fp32) the runner and the hand loop, from the same weights, batch and
    # number of steps, end on the same loss
    for px in (16, 8):
        runner, hand = (
            next(r for r in rows if (r["image_size"], r["level"], r["side"]) == (px, "o0", s))
            for s in ("eager", "hand")
        )
        assert runner["loss"] == pytest.approx(hand["loss"], rel=1e-4)
        assert hand["mode"] == "fp32"
    assert {r["mode"] for r in rows if r["side"] == "hand" and r["level"] == "o2"} == {
        "16-bit, fp32 masters"
    }

    table = out.read_text()
    assert table.count("refused in planning (below)") == 5
    assert "Refused in planning: trainer.cuda_graphs: step, but the run is on cpu" in table
    assert "Refused in planning: trainer.cuda_graphs: optimizer, but" in table
    assert "Verdict: **NO TARGET** on a CPU: planning refuses the graphs" in table
    assert "Load average" in table and "Command: `python -m benchmarks.graphs" in table
    assert report["targets"] == []
    assert "trainer.cuda_graphs=step" in report["overrides"]["16x4/o2/step"]
    assert "scheduler=none" in report["overrides"]["8x4/o0/false"]
    with out.with_suffix(".csv").open() as f:
        assert [(r["side"], r["status"]) for r in csv.DictReader(f)][:3] == [
            ("eager", "ok"),
            ("optimizer", "refused"),
            ("step", "refused"),
        ]


def test_densenet161_at_its_least_size_steps_eagerly_on_a_cpu(tmp_path: Path):
    """The benchmark's own model and level config (32 px: DenseNet-161's five halvings)."""
    out = tmp_path / "dn.md"
    argv = ["--device", "cpu", "--shapes", "32x2", "--levels", "o0", "--sides", "eager,step,hand"]
    argv += ["--steps", "1", "--rounds", "1", "--warmup", "0", "--busy-steps", "1"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["side"], r["status"]) for r in rows] == [
        ("eager", "ok"),
        ("step", "refused"),
        ("hand", "ok"),
    ]
    assert rows[0]["model"] == "densenet161" and rows[0]["loss"] == pytest.approx(
        rows[2]["loss"], rel=1e-4
    )


def _row(px, batch, level, side, ms, busy=0.5):
    return {
        "image_size": px,
        "batch_size": batch,
        "level": level,
        "side": side,
        "status": "ok",
        "ms": ms,
        "busy": busy,
    }


def _report(rows, device="cuda", model="densenet161"):
    report = {"device": device, "model": model, "results": rows}
    report["targets"] = bench.judged(report)
    return report


def test_the_verdict_judges_each_target_on_the_rows():
    met = [
        _row(32, 128, "o2", "eager", 100.0),
        _row(32, 128, "o2", "step", 20.0, busy=0.95),
        _row(32, 128, "o2", "lightning", 105.0),
        _row(32, 128, "o0", "step", 30.0),
        _row(224, 64, "o2", "step", 60.0),
        _row(224, 64, "o0", "step", 82.0),
    ]
    judged = bench.judged(_report(met))
    values = [round(c["value"], 3) for c in judged]
    assert values == [5.0, 1.5, 0.95, 5.25, round(82 / 60, 3)]
    assert all(c["met"] for c in judged)
    assert bench.verdict(_report(met))[0] == "Verdict: **MET**: 5 of 5 targets met."

    slow = [dict(r) for r in met]
    slow[1].update(ms=60.0, busy=0.7)  # O2 captured: 1.67x its eager, 0.5x O0 captured
    slow = slow[:4]  # (224 px not run)
    lines = bench.verdict(_report(slow))
    assert lines[0].startswith("Verdict: **MISSED**: 0 of 5 targets met, 4 missed, 1 not")
    assert "O2 captured / its own eager step 1.67x (target >= 2x): **MISSED**" in lines[2]
    assert "device busy, O2 captured 0.70 (target >= 0.9): **MISSED**" in lines[4]
    assert lines[6] == (
        "- 224 px, batch 64: O2 captured / O0 captured - (target >= 1.3x): **NOT MEASURED**"
    )
    refused = [r if r["side"] != "step" else {**r, "status": "refused"} for r in met]
    assert bench.verdict(_report(refused))[0].startswith("Verdict: **INCOMPLETE**: 0 of 5")
    assert "NO TARGET" in bench.verdict(_report(met, model="resnet18"))[0]


def test_the_defaults_and_bad_arguments(capsys):
    args = bench.parse_args(["--device", "cpu"])
    assert (args.model, args.shapes, args.levels) == ("densenet161", [(32, 2)], ["o2", "o0"])
    assert args.sides == list(bench.SIDES) and (args.steps, args.rounds) == (1, 1)
    for argv, message in [
        (["--shapes", "32"], "--shapes: '32' is not <px>x<batch>"),
        (["--shapes", "32x0"], "--shapes: '32x0' is not <px>x<batch>"),
        (["--levels", "o9"], "unknown level(s) o9"),
        (["--sides", "eager,deepspeed"], "--sides: unknown ['deepspeed']"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--busy-steps", "0"], "--busy-steps must be at least 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--model", "resnet9000"], "--model resnet9000:"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(["--device", "cpu", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_a_bad_argument_exits_2_with_one_line_before_any_work(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.graphs", "--device", "cpu", "--shapes", "32x"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("error: --shapes: '32x' is not <px>x<batch> (e.g. 32x128), both at least 1")
    )
    assert done.stdout == ""
