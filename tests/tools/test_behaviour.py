"""Smoke test of tools/behaviour.py: one command run by the same checkout on both sides (no
difference may be found), and the comparison itself on hand-made stores (a changed metric value,
param or artifact is found; time and process tags are not)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmarks import own_tempdir
from tests.helpers.runs import REPO
from tools import behaviour as bench


def record(**changes):
    base = {
        "status": "FINISHED",
        "params": {"optimizer.lr": "0.1", "trainer.checkpoint_dir": "/a"},
        "tags": {"opt_level": "O0", "runner.pid": "1", "runner.heartbeat": "t0"},
        "metrics": {"val_loss": [(1, 2.0), (2, 1.5)], "epoch_time_s": [(1, 3.0), (2, 2.9)]},
        "artifacts": ["config.yaml", "precision.txt"],
    }
    for key, value in changes.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    return base


def test_the_comparison_finds_what_changed_and_ignores_time():
    same = record(
        params={"trainer.checkpoint_dir": "/b"},
        tags={"runner.pid": "2", "runner.heartbeat": "t1"},
        metrics={"epoch_time_s": [(1, 9.0), (2, 9.1)]},
    )
    assert bench.compare(record(), same) == []
    changed = bench.compare(
        record(),
        record(
            params={"optimizer.lr": "0.2"},
            metrics={"val_loss": [(1, 2.0), (2, 1.4)]},
            artifacts=["config.yaml"],
        ),
    )
    assert [d.split(":")[0] for d in changed] == [
        "param optimizer.lr",
        "metric val_loss",
        "artifacts only before",
    ]
    assert bench.compare(record(), record(metrics={"epoch_time_s": [(1, 3.0)]})) == [
        "metric epoch_time_s: steps [1, 2] vs [1]"
    ]


def test_each_sides_folder_and_run_id_are_masked_and_nothing_else():
    """A resumed run's checkpoint path names its side's folder and its own run id: both differ
    between any two runs, the rest of the path may not."""
    before = record(run_id="aaa", tags={"resumed_from": "/w/before/r/aaa/last.pt"})
    after = record(run_id="bbb", tags={"resumed_from": "/w/after/r/bbb/last.pt"})
    assert bench.compare(before, after) == []
    moved = record(run_id="bbb", tags={"resumed_from": "/w/after/r/bbb/best.pt"})
    assert [d.split(":")[0] for d in bench.compare(before, moved)] == ["tag resumed_from"]


def test_the_commands_cover_the_levels_an_lm_a_plan_a_tuned_and_a_resumed_run():
    said = {
        name: " ".join(" ".join(s) for s in sessions) for name, sessions in bench.COMMANDS.items()
    }
    for level in ("o0", "o1_bf16", "o2_bf16", "o3_bf16"):
        assert f"precision={level}" in said[level]
    assert all("diagnose_every_n_steps" in said[lv] for lv in ("o1_bf16", "o2_bf16", "o3_bf16"))
    assert "model=gpt_tiny" in said["language_model"] and "+precision.layers" in said["layer_plan"]
    assert "trainer.tune=on" in said["tuned"] and "tuned" in bench.PRIMED
    first, then = bench.COMMANDS["resumed"]
    assert "trainer.max_epochs=1" in first and {"trainer.max_epochs=2", "resume=auto"} <= set(then)


@pytest.mark.slow
def test_a_checkout_behaves_as_itself(tmp_path, monkeypatch):
    """Both sides run the same command alike, a resumed one's two sessions into one run; their
    scratch folder (the runs' stores) is removed, as nothing failed."""
    scratch = own_tempdir(tmp_path, monkeypatch)
    status = bench.main(
        ["--before", str(REPO), "--after", str(REPO), "--only", "resumed", "--out", str(tmp_path)]
    )
    assert not list(scratch.glob("behaviour-*"))
    report = json.loads((tmp_path / "behaviour_cpu.json").read_text())
    resumed = report["runs"]["resumed"]
    assert status == 0 and resumed["differences"] == []
    assert resumed["params"] > 50 and resumed["metric_points"] > 10
    said = (tmp_path / "behaviour_cpu.md").read_text()
    assert "| resumed: `model=tiny" in said
    assert f"{report['machine']['cores']} cores" in said and report["date"][:10] in said
