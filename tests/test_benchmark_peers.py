"""benchmarks/peers.py on a CPU: the runner's step beside Lightning's precision plugins and the
hand-written autocast loop, on a tiny model (no timing assertions: the numbers are machine
noise here). What it does assert: each peer trained the same model from the same weights on the
same batch with the same optimizer, so after the same number of steps the losses agree."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tests.benchmark_helpers import load_benchmark

pytest.importorskip("lightning")


def test_peers_benchmark_trains_the_same_thing_on_each_side(tmp_path: Path, capsys):
    bench = load_benchmark("peers")
    out = tmp_path / "results" / "peers.md"
    code = bench.main(["--device", "cpu", "--model", "tiny", "--image-size", "16",
                       "--batch-size", "8", "--steps", "2", "--warmup", "1", "--rounds", "2",
                       "--out", str(out)])
    assert code == 0
    table = out.read_text()
    for row in ("| lightning:bf16-mixed | o1_bf16 |", "| lightning:bf16-true | o3_bf16 |",
                "| hand:o1_bf16 | o1_bf16 |"):
        assert row in table
    assert "NO TARGET on CPU" in table and "Command:" in table and "Lightning 2." in table
    assert "Verdict:" in capsys.readouterr().out

    with out.with_suffix(".csv").open() as f:
        rows = {r["peer"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"lightning:bf16-mixed", "lightning:bf16-true", "hand:o1_bf16"}
    for peer, row in rows.items():
        assert row["status"] == "ok", row["error"]
        runner_loss, peer_loss = float(row["runner_loss"]), float(row["peer_loss"])
        assert math.isfinite(runner_loss) and math.isfinite(peer_loss)
        # autocast on both sides: the same ops in the same types, so the same loss up to the
        # order of float sums; a whole-bf16 model (bf16-true against o3_bf16) rounds the inputs
        # and the BatchNorm statistics a little differently
        tolerance = 0.02 if peer == "lightning:bf16-true" else 1e-3
        assert peer_loss == pytest.approx(runner_loss, rel=tolerance), peer
        assert float(row["ratio"]) > 0 and row["meets"] == ""  # no target on a CPU

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["model"] == "tiny" and report["rounds"] == 2 and report["steps"] == 2
    assert report["overrides"]["lightning:bf16-true"][-1] == "precision=o3_bf16"


def test_peers_benchmark_refuses_an_unknown_peer(capsys):
    bench = load_benchmark("peers")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--device", "cpu", "--peers", "lightning:fp8-true"])
    assert stop.value.code == 2
    assert "unknown peer 'lightning:fp8-true'" in capsys.readouterr().err
