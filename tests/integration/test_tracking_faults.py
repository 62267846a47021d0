"""A tracking server that is not there, goes away, comes back or stays away: a real `mlflow server`
on localhost (tests/helpers/server.py's MlflowServer), stopped and started for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import RunnerError
from runner.run import app
from runner.tracking import replay
from runner.tracking.mlflow_run import MlflowRun
from runner.tracking.mlflow_tracker import MlflowTracker
from tests.helpers.held_data import HELD, HELD_RUN, hold_in_step
from tests.helpers.runs import FAST, REPO, compose_config, read_until, start_cli
from tests.helpers.server import free_port


def without_mlflow_http_settings(**extra: str) -> dict[str, str]:
    """This process's environment less MLflow's HTTP retry settings, which a tracker made in this
    pytest process sets: a child process must set them itself (with MLflow's default retries, a
    call to a server that is away blocks for minutes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST_")}
    return {**env, **extra}


def test_the_report_says_at_once_that_a_server_is_away(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "runner.report", "--tracking-uri", uri, "--out", str(tmp_path)],
        env=without_mlflow_http_settings(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - started < 60, "MLflow's own retries"
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"Cannot read the runs from {uri}: ")
    assert "Start the server, or set --tracking-uri" in result.stderr


def test_an_unreachable_server_at_start_stops_the_run_before_any_training(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = compose_config(
        *FAST, f"mlflow.tracking_uri={uri}", f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}"
    )
    started = time.monotonic()
    with pytest.raises(RunnerError) as e:
        app.run(cfg)
    assert time.monotonic() - started < 60  # no minutes of MLflow's own retries
    assert str(e.value).startswith("mlflow.tracking_uri: cannot use the tracking store")
    assert uri in str(e.value) and "Start the server" in str(e.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing was trained


@pytest.mark.new_store
def test_a_file_store_refused_by_mlflow_is_told_how_to_go_on(tmp_path, monkeypatch):
    """MLflow 3 refuses a new file store (`file:./mlruns`) with its own way out
    (MLFLOW_ALLOW_FILE_STORE); the runner's fix said "Start the server" (a server's)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = compose_config(*FAST, "mlflow.tracking_uri=file:./mlruns")
    with pytest.raises(RunnerError) as e:
        app.run(cfg)
    said = str(e.value)
    if "MLFLOW_ALLOW_FILE_STORE" not in said:
        pytest.skip(f"this MLflow takes a file store: {said}")
    # (the store named by its absolute URI: the launch folder's mlruns/)
    assert said.startswith("mlflow.tracking_uri: cannot use the tracking store 'file:///")
    assert f"{Path.cwd().resolve().as_uri()}/mlruns'" in said
    assert said.endswith(
        ". Use a database store (the default sqlite:///mlflow.db), or opt out as it says."
    )
    assert ".." not in said and "Start the server" not in said


@pytest.mark.slow
def test_metrics_logged_while_the_server_is_away_arrive_when_it_is_back(mlflow_server):
    server = mlflow_server.start()
    tracker = MlflowTracker(server.url, "amp-runner")
    tracked = tracker.create_run("outage", {})
    for step in range(1, 4):
        tracked.log_metrics({"train_loss": float(step)}, step)
    assert tracked.flush(timeout=30)
    server.stop()
    for step in range(4, 7):  # the server is gone: logging must not wait for it
        started = time.monotonic()
        tracked.log_metrics({"train_loss": float(step)}, step)
        # MLflow's own retries to a closed port take seconds; 0.5 s leaves room for a loaded
        # machine (the suite runs a test process a core) and still fails on any retry
        assert time.monotonic() - started < 0.5
    tracked.log_text("layer plan", "layers/layer_plan.txt")  # kept in a scratch folder
    (scratch,) = tracked._scratch
    assert (scratch / "layer_plan.txt").read_text() == "layer plan"
    time.sleep(2)  # the sender tries, fails and keeps the metrics
    server.start()
    tracked.end("FINISHED")
    client = MlflowClient(server.url)
    history = client.get_metric_history(tracked.run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]
    assert client.get_run(tracked.run_id).info.status == "FINISHED"
    # the kept text arrived at the end, and its scratch folder went with it
    assert [a.path for a in client.list_artifacts(tracked.run_id, "layers")] == [
        "layers/layer_plan.txt"
    ]
    assert not scratch.exists()


def _held_run(tmp_path: Path, server_url: str, **env: str):
    """`python -m runner` against the server, held in epoch 1's sixth step by its dataset
    (tests.helpers.held_data) until the file it returns is made: the test takes the server away
    at a known point, then lets the run train on (20 steps an epoch, 2 epochs, each logged)."""
    work = tmp_path / "work"
    work.mkdir()
    release = tmp_path / "release"
    args = [
        *HELD_RUN,
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        f"mlflow.tracking_uri={server_url}",
    ]
    proc = start_cli(*args, cwd=work, env={**hold_in_step(6, release), **env})
    seen = read_until(proc, HELD)  # the run exists on the server, and trains
    assert "MLflow run" in "".join(seen), "".join(seen)
    return proc, seen, release


@pytest.mark.slow
def test_a_run_whose_server_goes_away_and_comes_back_finishes_with_every_metric(
    mlflow_server, tmp_path
):
    """`python -m runner` against a real server that is stopped while the run trains and started
    again: training never waits, and the server ends up with the whole run, FINISHED, with no
    offline store (END_TIMEOUT 120 s: the run ends before the server is back, and waits)."""
    server = mlflow_server.start()
    proc, seen, release = _held_run(tmp_path, server.url, AMP_RUNNER_MLFLOW_END_TIMEOUT="120")
    server.stop()
    release.touch()  # training goes on meanwhile
    time.sleep(3)
    server.start()
    rest, _ = proc.communicate(timeout=600)
    output = "".join(seen) + rest
    assert proc.returncode == 0, output
    assert "runner.replay" not in output, output  # everything was delivered
    client = MlflowClient(server.url)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
    assert steps == list(range(1, 41))  # 20 steps per epoch, none lost, none twice
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    assert "logs/runner.log" in logs


@pytest.mark.slow
def test_a_run_that_ends_while_the_server_is_away_is_saved_offline_and_replayed(
    mlflow_server, tmp_path
):
    server = mlflow_server.start()
    proc, seen, release = _held_run(tmp_path, server.url, AMP_RUNNER_MLFLOW_END_TIMEOUT="3")
    server.stop()  # (even the run's start-up artifacts may not have reached it)
    release.touch()
    rest, _ = proc.communicate(timeout=600)
    output = "".join(seen) + rest
    assert proc.returncode == 0, output  # the training itself finished
    match = re.search(r"python -m runner\.replay (\S+)", output)
    assert match and "is unreachable" in output, output
    folder = Path(match.group(1))
    assert (folder / replay.DB).is_file()

    # still away: the replay says so and marks nothing as done
    def replay_cli() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "runner.replay", str(folder)],
            env=without_mlflow_http_settings(PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=120,
        )

    still_away = replay_cli()
    assert still_away.returncode == 1 and "nothing marked as replayed" in still_away.stderr

    server.start()
    client = MlflowClient(server.url)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "RUNNING"  # what the server knew before it went away
    done = replay_cli()
    assert done.returncode == 0, done.stdout + done.stderr
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
    assert steps == list(range(1, 41))  # 20 per epoch, none lost, none twice
    assert "best_val_acc" in run.data.metrics
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    assert "logs/runner.log" in logs  # the log file went offline too, and came back
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "overrides.yaml", "precision.txt"} <= top  # sent or replayed
    again = replay_cli()
    assert again.returncode == 0 and "nothing left to replay" in again.stdout


def test_offline_replay_into_a_store(tmp_path):
    """The replay mechanics on two SQLite stores: undelivered metrics, status and error of a run
    reach the target run; replaying twice sends nothing twice."""
    target = MlflowTracker(f"sqlite:///{tmp_path / 'target.db'}", "amp-runner")
    tracked = target.create_run("r", {})
    tracked.log_metrics({"val_acc": 0.5}, 1)
    assert tracked.flush(timeout=10)
    pending = MlflowRun.__new__(MlflowRun)  # what a run that lost its store hands over
    pending.run_id, pending.tracking_uri = tracked.run_id, target.tracking_uri
    pending.experiment_name = "amp-runner"
    from mlflow.entities import Metric

    folder = replay.write_offline(
        tmp_path / "offline",
        pending,
        "FAILED",
        "DivergenceError: x",
        [Metric("val_acc", 0.25, 0, 2)],
        [],
    )
    assert replay.replay(folder) == [tracked.run_id]
    run = target.client.get_run(tracked.run_id)
    assert run.info.status == "FAILED" and run.data.tags["error"] == "DivergenceError: x"
    history = target.client.get_metric_history(tracked.run_id, "val_acc")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    assert replay.replay(folder) == []
    tracked.end("FAILED")  # (stops its sender thread)


def test_replay_of_a_store_with_no_offline_run_says_so(tmp_path, capsys):
    """`python -m runner.replay .` beside a run's own ./mlflow.db said "Replayed 0 run(s)
    (nothing left to replay)", as if an offline store were done; a file that is no database
    ended in SQLAlchemy's error. Both are refused, naming what the folder holds, exit 2."""
    own, junk = tmp_path / "own", tmp_path / "junk"
    tracker = MlflowTracker(f"sqlite:///{own / replay.DB}", "amp-runner")
    with tracker.start_run("tiny-O0", {}, {}):
        pass
    junk.mkdir()
    (junk / replay.DB).write_text("not a database")
    assert replay.main([str(own)]) == 2
    told = capsys.readouterr().err
    assert f"No offline run in {own / replay.DB}: it holds no run saved while a tracking " in told
    assert replay.main([str(junk)]) == 2
    told = capsys.readouterr().err
    assert f"No offline store in {junk}: {junk / replay.DB} cannot be read (" in told
    assert "[SQL:" not in told and "Traceback" not in told


def test_replay_is_given_the_offline_store_or_its_database(tmp_path, capsys):
    """`python -m runner.replay PATH`: PATH is the offline store's folder or its database. Any
    other file stood for its folder: a file beside the user's own ./mlflow.db replayed that
    store as if it were an offline one; a missing folder was told as its parent."""
    (tmp_path / replay.DB).write_text("")  # (the user's own store, say)
    other = tmp_path / "notes.txt"
    other.write_text("")
    for path in (other, tmp_path / "gone"):
        assert replay.main([str(path)]) == 2
        told = capsys.readouterr().err
        assert f"No offline store in {path} (expected {path / replay.DB})" in told
