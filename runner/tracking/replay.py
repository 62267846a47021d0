"""`python -m runner.replay FOLDER` (the entry point, runner/replay.py): deliver what a run could
not log while its tracking server was away.

When the server does not answer at the end of a run, the run writes the metrics it still holds,
its final status, its error and its log file into a local MLflow store, `FOLDER/mlflow.db` (the
run's output folder's `mlflow-offline/`), as a run tagged with the server's URI and the server
run's id. Once the server is back, this command sends them there (into the same server run,
which then ends with its real status) and marks the local run as replayed, so a second replay
sends nothing twice. `--to URI` sends them to another server than the recorded one.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient

import runner
from runner import files
from runner.config.schema import DEFAULT_EXPERIMENT
from runner.errors import said
from runner.tracking import tags as tag
from runner.tracking.store import RetryingClient

DB = "mlflow.db"

log = logging.getLogger(__name__)


def local_uri(folder: Path) -> str:
    return f"sqlite:///{folder.resolve() / DB}"


def write_offline(
    folder: Path,
    tracked: Any,
    status: str,
    error: str | None,
    metrics: list[Metric],
    artifacts: list[tuple[str, str | None]],
) -> Path:
    """The undelivered part of `tracked` (a runner.tracking.mlflow_run.MlflowRun) as a run of a
    local store in `folder`; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(local_uri(folder))
    name = tracked.experiment_name or DEFAULT_EXPERIMENT
    experiment = client.get_experiment_by_name(name)
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment(
            name, artifact_location=(folder / "artifacts").resolve().as_uri()
        )
    )
    tags = {
        tag.REPLAY_TARGET_RUN: tracked.run_id,
        tag.REPLAY_TARGET_URI: tracked.tracking_uri,
        tag.REPLAY_STATUS: status,
    }
    if error:
        tags[tag.ERROR] = error
    run = client.create_run(experiment_id, run_name=f"replay of {tracked.run_id}", tags=tags)
    for i in range(0, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[i : i + 1000])
    for path, artifact_path in artifacts:
        client.log_artifact(run.info.run_id, path, artifact_path)
    client.set_terminated(run.info.run_id, status=RunStatus.to_string(RunStatus.FINISHED))
    return folder


def offline_runs(local: MlflowClient) -> list[Any]:
    """The runs of a local store saved for a server that was away (replayed or not)."""
    experiments = [e.experiment_id for e in local.search_experiments()]
    return local.search_runs(experiments, filter_string=f"tags.`{tag.REPLAY_TARGET_RUN}` != ''")


def replay(folder: Path, to: str | None = None) -> list[str]:
    """Send every not-yet-replayed run of the local store in `folder`; returns the server run ids
    it completed. Raises (nothing is marked replayed) when the server does not take them."""
    local = MlflowClient(local_uri(folder))
    done = []
    for run in offline_runs(local):
        tags = run.data.tags
        if tag.REPLAY_DONE in tags:
            continue
        target_uri = to or tags[tag.REPLAY_TARGET_URI]
        target_id = tags[tag.REPLAY_TARGET_RUN]
        server = RetryingClient(target_uri)  # (fails at once while the server is away)
        server.get_run(target_id)  # the run must exist there: raises with MLflow's message
        metrics = [
            m for key in run.data.metrics for m in local.get_metric_history(run.info.run_id, key)
        ]
        metrics = [Metric(m.key, m.value, m.timestamp, m.step) for m in metrics]
        for i in range(0, len(metrics), 1000):
            server.log_batch(target_id, metrics=metrics[i : i + 1000])
        with tempfile.TemporaryDirectory() as scratch:
            if local.list_artifacts(run.info.run_id):
                path = local.download_artifacts(run.info.run_id, "", scratch)
                server.log_artifacts(target_id, path)
        if tag.ERROR in tags:
            server.set_tag(target_id, tag.ERROR, tags[tag.ERROR])
        server.set_terminated(target_id, status=tags[tag.REPLAY_STATUS])
        local.set_tag(run.info.run_id, tag.REPLAY_DONE, target_uri)
        log.info(
            "Replayed %d metrics into run %s at %s (status %s)",
            len(metrics),
            target_id,
            target_uri,
            tags[tag.REPLAY_STATUS],
        )
        done.append(target_id)
    return done


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.replay", description=__doc__)
    parser.add_argument("--version", action="version", version=runner.version_line())
    parser.add_argument(
        "folder",
        type=files.user_path,
        help="the offline store's folder (mlflow-offline/ "
        "in the run's output folder; the run's log names it)",
    )
    parser.add_argument(
        "--to", default=None, help="the tracking server (default: the one the run was logging to)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the folder, or its database named outright (not any file: its folder may hold another store)
    folder = args.folder.parent if args.folder.name == DB and args.folder.is_file() else args.folder
    if not (folder / DB).is_file():
        print(f"No offline store in {folder} (expected {folder / DB})", file=sys.stderr)
        return 2
    try:
        saved = offline_runs(MlflowClient(local_uri(folder)))
    except Exception as error:  # noqa: BLE001  (not an MLflow store at all)
        print(
            f"No offline store in {folder}: {folder / DB} cannot be read ({said(error)})",
            file=sys.stderr,
        )
        return 2
    if not saved:  # (a run's own store, say ./mlflow.db: nothing in it is for a server)
        print(
            f"No offline run in {folder / DB}: it holds no run saved while a tracking server "
            "was away (a run that saved one names its mlflow-offline/ folder)",
            file=sys.stderr,
        )
        return 2
    try:
        done = replay(folder, args.to)
    except Exception as error:  # noqa: BLE001  (the server is still away, or refuses)
        print(
            f"Replay failed, nothing marked as replayed: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 1
    print(
        f"Replayed {len(done)} run(s)"
        + (f": {', '.join(done)}" if done else " (nothing left to replay)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
