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


@pytest.mark.slow
def test_a_checkout_behaves_as_itself(tmp_path, monkeypatch):
    """Both sides run the same command alike; their scratch folder (the two runs' stores) is
    removed, as nothing failed."""
    scratch = own_tempdir(tmp_path, monkeypatch)
    status = bench.main(
        ["--before", str(REPO), "--after", str(REPO), "--only", "o0", "--out", str(tmp_path)]
    )
    assert not list(scratch.glob("behaviour-*"))
    report = json.loads((tmp_path / "behaviour_cpu.json").read_text())
    assert status == 0 and report["runs"]["o0"]["differences"] == []
    assert report["runs"]["o0"]["params"] > 50 and report["runs"]["o0"]["metric_points"] > 10
    assert "| o0: `model=tiny" in (tmp_path / "behaviour_cpu.md").read_text()
