"""Smoke test of benchmarks/graphs.py on a CPU, where planning refuses `trainer.cuda_graphs`: a
tiny run times the eager step and writes the files with the refusal; the verdict's checks
judged on given numbers (no timing assertions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import graphs as bench


def test_graphs_benchmark_on_a_cpu_times_the_eager_step_and_says_the_refusal(
    tmp_path: Path, monkeypatch
):
    out = tmp_path / "results" / "graphs.md"
    argv = ["--device", "cpu", "--cases", "host_rn18_o2,gpu_rn50_o2_bf16", "--image-size", "8"]
    argv += ["--batch-size", "2", "--steps", "1", "--rounds", "1", "--reps", "1"]
    # a piece stopped at its limit keeps the cases that ran: the table is written after each
    written = []
    run_case = bench.run_case

    def after_the_last_write(args, name):
        written.append(out.read_text() if out.exists() else None)
        return run_case(args, name)

    monkeypatch.setattr(bench, "run_case", after_the_last_write)
    assert bench.main([*argv, "--out", str(out)]) == 0
    assert written[0] is None and "| host_rn18_o2 |" in written[1]
    assert "gpu_rn50_o2_bf16" not in written[1].split("## Setup")[0]
    table = out.read_text()
    assert "| gpu_rn50_o2_bf16 | resnet50 | 8 | 2 | o2_bf16 |" in table
    assert "refused (below)" in table and "a CUDA graph needs a CUDA device" in table
    assert "`gpu_rn50_o2_bf16`: not judged, planning refused the graphs here" in table
    assert "Load average" in table and "Command:" in table
    report = json.loads(out.with_suffix(".json").read_text())
    assert [c["case"] for c in report["results"]] == ["host_rn18_o2", "gpu_rn50_o2_bf16"]
    for cell in report["results"]:
        assert cell["status"] == "ok" and cell["eager_ms"] > 0 and cell["checks"] == []
        assert "graphed_ms" not in cell
    assert "trainer.cuda_graphs=true" in report["overrides"]["gpu_rn50_o2_bf16"]
    with out.with_suffix(".csv").open() as f:
        assert [r["case"] for r in csv.DictReader(f)] == ["host_rn18_o2", "gpu_rn50_o2_bf16"]


def _cell(bound: str, eager: float, graphed: float, **device: float) -> dict:
    cell = {"case": f"{bound}_case", "bound": bound, "status": "ok", "refused": None}
    cell.update(eager_ms=eager, graphed_ms=graphed, ratio=graphed / eager, **device)
    return {**cell, "replays_every_step": True}


def test_the_verdict_holds_each_case_to_its_expectation():
    assert bench.judge(_cell("host", 10.0, 8.0)) == [
        ("the replayed step faster than the eager one", True)
    ]
    assert not bench.judge(_cell("host", 10.0, 10.5))[0][1]
    split = {"eager_step": 1.0, "replay": 1.0, "copy": 0.05, "flat_copy_ms": 0.03}
    assert all(ok for _, ok in bench.judge(_cell("gpu", 27.0, 27.5, **split)))
    slow = bench.judge(_cell("gpu", 27.0, 28.0, **{**split, "copy": 1.7}))
    assert [ok for _, ok in slow] == [False, False, True]  # 3.7% slower, the copy 57x its bytes'
    lines = bench.verdict_lines({"results": [_cell("gpu", 27.0, 28.0, **split)]})
    assert "the step at most 2% slower: NOT met" in lines[0] and "**not met**" in lines[0]


def test_graphs_bad_arguments(capsys):
    args = bench.parse_args(["--device", "cpu"])
    assert args.cases == list(bench.CASES) and (args.image_size, args.batch_size) == (16, 2)
    for argv, message in [
        (["--cases", "host_vgg"], "unknown case"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--reps", "0"], "--reps must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(["--device", "cpu", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
