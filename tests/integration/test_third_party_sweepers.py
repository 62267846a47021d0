"""Third-party Hydra sweepers and launchers as the runner's clients, each with the real plugin
installed by `[dev]`: Optuna's sweeper (a failed trial reaches it as a failed job, counted against
its `max_failure_rate`, where a NaN objective crashed its study) and submitit's local launcher
(which starts every job at once: the sweep says so)."""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from runner.tracking.tags import PARENT_RUN
from tests.helpers.runs import FAST, run_in_process

# Optuna's random sampler with seed 0 draws lr -1 (refused by the plan), then 0.05, from
# choice(0.05,-1). (Not its grid sampler: when the grid's last trial fails, the plugin's own
# `study.tell` raises "Study.stop is supposed to be invoked inside an objective function".)
OPTUNA = [
    "hydra/sweeper=optuna",
    "hydra/sweeper/sampler=random",
    "hydra.sweeper.sampler.seed=0",
    "hydra.sweeper.n_trials=2",
    "hydra.sweeper.direction=maximize",
    "optimizer.lr=choice(0.05,-1)",
]
BUDGET = [*FAST, "data.num_train=64", "trainer.max_epochs=1", "trainer.progress_bar=false"]


def sweep_runs(uri: str):
    """(the one parent run, its children in job order): the jobs share a run name here."""
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    (parent,) = [r for r in runs if PARENT_RUN not in r.data.tags]
    children = [r for r in runs if r is not parent]
    assert all(c.data.tags[PARENT_RUN] == parent.info.run_id for c in children)
    return parent, sorted(children, key=lambda r: int(r.data.tags["sweep.job_num"]))


@pytest.fixture
def optuna():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install '.[dev]'")


def test_an_optuna_study_runs_every_trial_when_failures_are_allowed(optuna, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    status = run_in_process(
        "-m",
        *OPTUNA,
        "hydra.sweeper.max_failure_rate=1.0",
        *BUDGET,
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert status == 1  # as a sweep with a failed job exits
    parent, runs = sweep_runs(uri)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]  # both trials ran
    assert runs[0].data.tags["error"].startswith("ConfigError: optimizer.lr: got -1.0")
    assert runs[1].data.params["optimizer.lr"] == "0.05"
    assert math.isfinite(runs[1].data.metrics["best_val_acc"])
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["jobs"] == 2 and parent.data.metrics["failed_jobs"] == 1


def test_an_optuna_study_stopped_by_a_failed_trial_names_it_on_the_parent(optuna, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    status = run_in_process(
        "-m",
        *OPTUNA,
        *BUDGET,
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert status == 1
    parent, children = sweep_runs(uri)
    assert parent.info.status == "FAILED"
    error = parent.data.tags["error"]
    assert error.startswith(
        "the sweep stopped early (exit status 1); failed: tiny-O0 trial 0 (#0): "
        "ConfigError: optimizer.lr: got -1.0"
    ), error
    assert parent.data.tags["sweep.failed_jobs"].startswith("tiny-O0 trial 0 (#0): ConfigError")
    # the plugin launches its trials in batches (hydra.sweeper.n_jobs, 2) and stops after the
    # batch that failed (max_failure_rate 0.0, its default): both of this batch's jobs are there
    assert [(c.info.status, c.data.tags["sweep.job_num"]) for c in children] == [
        ("FAILED", "0"),
        ("FINISHED", "1"),
    ]


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.parametrize(
    "task,given,wanted",
    [
        ([], [], "minimize would have Optuna search for the lowest best_val_acc, a classifier's"),
        (
            ["model=gpt_tiny", "data=synthetic_text"],
            ["hydra.sweeper.direction=maximize"],
            "maximize would have Optuna search for the highest best_val_loss, a language model's",
        ),
    ],
)
def test_an_optuna_direction_against_the_objective_is_refused(
    optuna, tmp_path, capfd, task, given, wanted
):
    """Optuna minimises by default, and a classifier's objective is its accuracy: a study left at
    the default searched for the worst settings without a word. Refused before anything starts
    (exit 2, the key, the fix), as is maximising a language model's loss; the right direction
    passes (a dry run: the check runs there too)."""
    args = ["-m", *OPTUNA[:4], "optimizer.lr=choice(0.05,0.02)", *(task or BUDGET)]
    status = run_in_process(*args, *given, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    out = "".join(capfd.readouterr())
    assert status == 2, out[-3000:]
    assert f"hydra.sweeper.direction: {wanted}" in out, out[-3000:]
    assert "Traceback" not in out and sorted(p.name for p in tmp_path.iterdir()) == []
    right = "maximize" if not task else "minimize"
    assert f"add hydra.sweeper.direction={right}" in out
    status = run_in_process(*args, f"hydra.sweeper.direction={right}", "dry_run=true")
    out = "".join(capfd.readouterr())
    assert status == 0, out[-3000:]
    assert "Dry run of a sweep by OptunaSweeper (2 trials)" in out


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_dry_run_of_an_optuna_sweep_shows_its_base_config_and_makes_no_study(
    optuna, tmp_path, capfd
):
    """Each dry-run job returned no objective, so Optuna failed every trial and the command
    ended in "ValueError: No trials are completed yet." (exit 1; a study in
    `hydra.sweeper.storage` kept the failed trials). The dry run shows the config each job
    starts from, checked, and what Optuna draws, and no study exists: exit 0. A bad value in
    that config is refused as a single dry run refuses it (exit 2)."""
    study = tmp_path / "optuna.db"
    args = [
        "-m",
        *OPTUNA[:5],
        "optimizer.lr=tag(log, interval(1e-4, 1e-1))",
        *BUDGET,
        "dry_run=true",
        f"hydra.sweeper.storage=sqlite:///{study}",
        "hydra.sweeper.study_name=lr",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    status = run_in_process(*args)
    out = "".join(capfd.readouterr())
    assert status == 0, out[-3000:]
    assert out.count("  opt_level: O") == 1 and "Traceback" not in out
    assert (
        "Dry run of a sweep by OptunaSweeper (2 trials), whose jobs are drawn as it runs: above "
        "is the config each job starts from; the sweeper draws each job's "
        "optimizer.lr=tag(log, interval(1e-4, 1e-1)). Nothing was run and no study was made."
    ) in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no study, no sweep folder
    assert run_in_process(*args, "optimizer.momentum=-3") == 2
    assert "optimizer.momentum: got -3.0" in "".join(capfd.readouterr())


def test_submitit_local_warns_that_its_jobs_run_at_once(tmp_path, capfd):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[dev]'")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    status = run_in_process(
        "-m",
        "hydra/launcher=submitit_local",
        *BUDGET,
        "trainer.seed=1,2",
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert status == 0
    out = "".join(capfd.readouterr())
    assert "submitit's local launcher starts the sweep's jobs at once" in out, out[-3000:]
    parent, children = sweep_runs(uri)
    assert parent.data.tags["sweep.launcher"] == "LocalLauncher"
    assert [c.data.params["trainer.seed"] for c in children] == ["1", "2"]
    assert all(c.info.status == "FINISHED" for c in children)
