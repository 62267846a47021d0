"""Smoke test of benchmarks/layer_plan_cost.py: a tiny budget on the tiny CNN at both kinds of
level;
the result files with the expected structure and the plan's hooks (no timing assertions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import layer_plan_cost as bench


def test_layer_plan_cost_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "layer_plan_cost.md"
    code = bench.main(
        [
            "--models",
            "tiny",
            "--levels",
            "o1_bf16,o2_bf16",
            "--image-size",
            "8",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    table = out.read_text()
    assert "| tiny | o1_bf16 | 7 | 0 / 1 |" in table  # the head's forward wrapped
    assert "| tiny | o2_bf16 | 7 | 7 / 0 |" in table  # every layer casts its inputs
    assert "Load average" in table and "Command:" in table
    report = json.loads(out.with_suffix(".json").read_text())
    for cell in report["results"]:
        assert cell["status"] == "ok" and cell["deviates"]  # the head: fp32, not the level's
        assert cell["step_ms_level"] > 0 and cell["step_ms_plan"] > 0
        assert cell["step_ms_audited"] > 0
    with out.with_suffix(".csv").open() as f:
        assert [r["level"] for r in csv.DictReader(f)] == ["o1_bf16", "o2_bf16"]
    assert "Wrote" in capsys.readouterr().out


def test_layer_plan_cost_bad_arguments(capsys):
    assert bench.parse_args([]).levels == ["o1_bf16", "o2_bf16"]
    for argv, message in [
        (["--models", "densenet161"], "unknown model"),
        (["--steps", "0"], "--steps must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
