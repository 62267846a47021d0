"""Smoke test of benchmarks/diagnostics_cost.py: a tiny budget on the tiny model; the result files
with the expected structure, and no hook while diagnostics are off (no timing assertions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import diagnostics_cost as bench
from tests.helpers.benchmarks import own_tempdir


def test_diagnostics_cost_benchmark_smoke(tmp_path: Path, capsys, monkeypatch):
    out = tmp_path / "results" / "diagnostics_cost.md"
    scratch = own_tempdir(tmp_path, monkeypatch)
    code = bench.main(
        [
            "--models",
            "tiny",
            "--levels",
            "o0,o2_bf16",
            "--image-size",
            "8",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--intervals",
            "1,10",
            "--extra",
            "model.width=4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert not list(scratch.glob("diagnostics-cost-*"))  # removed
    table = out.read_text()
    assert "| tiny | o0 (fp16) |" in table and "| tiny | o2_bf16 (bf16) |" in table
    assert "Load average" in table and "Command:" in table
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["intervals"] == [1, 10]
    for cell in report["results"]:
        assert cell["status"] == "ok" and cell["hooks_when_off"] == 0
        assert cell["hooks_when_diagnosed"] == cell["layers"] == 7  # 3 conv, 3 BN, 1 linear
        assert cell["step_ms_off"] > 0 and cell["values_observed_per_step"] > 0
        assert cell["amortised_fraction_every_10"] == pytest.approx(
            cell["amortised_fraction_every_1"] / 10
        )
    with out.with_suffix(".csv").open() as f:
        assert [r["level"] for r in csv.DictReader(f)] == ["o0", "o2_bf16"]
    assert "Wrote" in capsys.readouterr().out


def test_diagnostics_cost_bad_arguments(capsys):
    assert bench.parse_args([]).levels == ["o0", "o2_bf16"]
    for argv, message in [
        (["--intervals", "0"], "--intervals must be at least 1"),
        (["--models", "resnet99"], "unknown model"),
        (["--steps", "0"], "--steps must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
