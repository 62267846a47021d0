"""Smoke test of benchmarks/cpu_bf16.py: one round of each operation and one block of the tiny
model's runner step per level; the three result files with the expected structure (no timing
assertions: which side of fp32 bf16 lands on is the machine's)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_bf16 as bench


def test_cpu_bf16_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "cpu_bf16.md"
    argv = ["--rounds", "1", "--steps", "1", "--step-rounds", "1", "--models", "tiny"]
    assert bench.main([*argv, "--out", str(out)]) == 0

    threads = sorted({1, torch.get_num_threads()})
    operations = [name for name, _, _ in bench.operations()]
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["section"], r["name"], int(r["threads"])) for r in rows] == [
        *(("operation", name, count) for count in threads for name in operations),
        *(("training step", f"tiny {level}", threads[-1]) for level in bench.STEP_LEVELS),
    ]
    for row in rows:
        fp32, bf16, ratio = (float(row[k]) for k in ("fp32_ms", "bf16_ms", "ratio"))
        assert fp32 > 0 and bf16 > 0 and abs(ratio - bf16 / fp32) < 1e-6 * ratio, row
    steps = {r["name"]: r for r in rows if r["section"] == "training step"}
    assert float(steps["tiny o0"]["ratio"]) == 1.0  # O0 against itself
    assert len({r["fp32_ms"] for r in steps.values()}) == 1  # every level against one O0

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["finding_fires"] == (report["runner_ratio"] >= report["slow_ratio"])
    assert set(report["flags"]) <= set(bench.FLAGS) and report["cpu_capability"]
    assert report["errors"] == [] and "benchmarks.cpu_bf16 --rounds 1" in report["command"]
    table = out.read_text()
    side = "SLOWER" if "SLOWER" in table else "FASTER"
    assert f"Verdict: bf16 computes {side} than fp32 on this CPU" in table
    assert "tiny o1_bf16" in table and "| training step | tiny o2_bf16 | 32 px, batch 32 |" in table
    fires = "fires" if report["finding_fires"] else "does not fire"
    assert f"so its finding (from 3x) {fires}." in table
    assert "## Setup" in table and "Verdict:" in capsys.readouterr().out


def test_cpu_bf16_benchmark_refuses_a_zero_count(tmp_path: Path, capsys):
    """Bad arguments are refused before anything is timed (an --out of the test's own, so that a
    refusal that broke could not overwrite the committed results)."""
    out = ["--out", str(tmp_path / "results" / "cpu_bf16.md")]
    with pytest.raises(SystemExit) as exit:
        bench.main(["--rounds", "0", *out])
    assert exit.value.code == 2
    assert "--rounds, --steps and --step-rounds must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        bench.main(["--models", "tiny,resnet5", *out])
    assert exit.value.code == 2
    assert "unknown model 'resnet5': " in capsys.readouterr().err
    assert not (tmp_path / "results").exists()  # nothing was timed or written
