"""benchmarks/peers.py on a CPU: the runner's step beside Lightning's precision plugins and the
hand-written autocast loop, on a tiny model (no timing assertions: the numbers are machine
noise here). What it does assert: each peer trained the same model from the same weights on the
same batch with the same optimizer, so after the same number of steps the losses agree."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

from benchmarks import peers as bench

# skipped without Lightning, found without importing it: its import takes 4 s, which every test
# process would pay at collection (the benchmark imports it where a peer needs it)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="no Lightning (pip install '.[dev]')"
)


def test_peers_benchmark_trains_the_same_thing_on_each_side(tmp_path: Path, capsys):
    out = tmp_path / "results" / "peers.md"
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
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    table = out.read_text()
    for row in (
        "| lightning:bf16-mixed | o1_bf16 |",
        "| lightning:bf16-true | o3_bf16 |",
        "| hand:o1_bf16 | o1_bf16 |",
    ):
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
    with pytest.raises(SystemExit) as stop:
        bench.main(["--device", "cpu", "--peers", "lightning:fp8-true"])
    assert stop.value.code == 2
    assert "unknown peer 'lightning:fp8-true'" in capsys.readouterr().err


def test_the_torchtitan_float8_peer_trains_the_same_fp8_layers(tmp_path: Path):
    """torchtitan's float8 recipe (rowwise, every Linear of sizes in multiples of 16, bf16
    autocast) beside the runner's o1_fp8 with the rowwise recipe, both emulated on a CPU: the
    runner side must convert the same layers (peers.py refuses the comparison otherwise) and, the
    same GEMMs in the same fp8 numerics, reach the same loss; --titan-filter keeps a layer out of
    fp8 on both sides (the runner's by a layer plan); --titan-compile runs the GPU's code path
    (the peer's blocks compiled fullgraph, the runner's model compiled) to the same loss."""
    pytest.importorskip("torchao")
    for name, extra in (
        ("all", []),
        ("filtered", ["--titan-filter", "head"]),
        ("compiled", ["--titan-compile"]),
    ):
        out = tmp_path / name / "peers.md"
        code = bench.main(
            [
                "--device",
                "cpu",
                "--model",
                "gpt_tiny",
                "--image-size",
                "32",
                "--batch-size",
                "4",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--rounds",
                "1",
                "--peers",
                "titan:float8",
                *extra,
                "--out",
                str(out),
            ]
        )
        assert code == 0, name
        report = json.loads(out.with_suffix(".json").read_text())
        row = report["rows"][0]
        assert row["status"] == "ok", row["error"]
        assert (
            row["level"]
            == {
                "all": "o1_fp8 rowwise",
                "filtered": "o1_fp8 rowwise, head bf16",
                "compiled": "o1_fp8 rowwise+compile",
            }[name]
        )
        assert math.isfinite(row["runner_loss"])
        assert row["peer_loss"] == pytest.approx(row["runner_loss"], rel=1e-3), name
        overrides = report["overrides"]["titan:float8"]
        assert "precision=o1_fp8" in overrides and "precision.fp8_linear=rowwise" in overrides
        assert ("+precision.layers.head=bfloat16" in overrides) == (name == "filtered")
        # emulated fp8 is compiled on neither side unless asked (the GPU's path: both compiled)
        assert ("trainer.compile=true" in overrides) == (name == "compiled")
        assert "32 tokens a sequence" in out.read_text()
    import torch._inductor.config as inductor

    assert inductor.emulate_precision_casts is False  # the blocks' option, not the process's


def test_the_torchtitan_peer_needs_a_language_model(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--device", "cpu", "--model", "tiny", "--peers", "titan:float8"])
    assert stop.value.code == 2
    assert "titan:float8 trains a language model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        bench.main(["--device", "cpu", "--model", "tiny", "--titan-filter", "head"])
    assert stop.value.code == 2
    assert (
        "--titan-filter and --titan-compile are for the titan:float8 peer"
        in capsys.readouterr().err
    )


def test_the_tuned_rows_name_what_the_runner_picked(tmp_path: Path):
    """--tuned: the runner at its defaults with trainer.tune=on, within the tuning budget
    given, the peer at its own; both still train the same thing (a layout or kernel choice
    leaves the loss as it is). A budget without --tuned is refused."""
    out = tmp_path / "peers_tuned.md"
    small = ["--image-size", "16", "--batch-size", "8", "--steps", "1", "--rounds", "1"]
    args = ["--device", "cpu", "--model", "tiny", "--tuned", "--peers", "hand:o1_bf16", *small]
    budget = ["--tune-budget-s", "60"]
    assert bench.main([*args, *budget, "--warmup", "1", "--out", str(out)]) == 0
    table = out.read_text()
    assert "trainer.tune picked" in table and "with trainer.tune=on" in table
    assert "within trainer.tune_budget_s=60 " in table
    with pytest.raises(SystemExit) as stop:
        bench.parse_args([a for a in args if a != "--tuned"] + budget)
    assert stop.value.code == 2
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["status"] == "ok" and row["picked"] and row["tune_s"] > 0
    assert row["peer_loss"] == pytest.approx(row["runner_loss"], rel=1e-3)
