"""Which tracker records a run: `tracking.name` (conf/tracking/: mlflow, the default, or none)
opens MLflow's store (runner.tracking.mlflow_tracker) or the JSON records of `tracking=none`
(runner.tracking.json_file), each imported only when chosen."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runner.tracking.base import MLFLOW, NONE, Reader, Tracker


def kind(cfg: Any) -> str:
    """The tracker a run's config asks for (`tracking.name`; mlflow where the node is absent)."""
    node = getattr(cfg, "tracking", None)
    name = getattr(node, "name", None) if node is not None else None
    return str(name or MLFLOW)


def open_tracker(cfg: Any, folder: str | os.PathLike | None = None) -> Tracker:
    """The tracker a run's config asks for: MLflow's store and experiment of `cfg.mlflow`, or
    under `tracking=none` the records in `folder` (the run's output folder; default: here)."""
    return open_store(kind(cfg), cfg.mlflow, folder)


def open_store(name: str, mlflow_cfg: Any, folder: str | os.PathLike | None = None) -> Tracker:
    """The tracker `name` (`tracking.name`) over the `mlflow` config node's experiment."""
    if name == NONE:
        from runner.tracking.json_file import JsonTracker

        return JsonTracker(
            Path(folder) if folder is not None else Path.cwd(), mlflow_cfg.experiment_name
        )
    from runner.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker.from_config(mlflow_cfg)


def reopen_store(name: str, location: str, experiment_name: str) -> Tracker:
    """The tracker of a sweep's parent run again, from where it keeps runs (`Tracker.location`),
    in another process (a sweep's job)."""
    if name == NONE:
        from runner.tracking.json_file import JsonTracker

        return JsonTracker(Path(location), experiment_name)
    from runner.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(location, experiment_name)


def open_reader(location: str) -> Reader:
    """A reader of the MLflow store at `location` (a URI; a relative SQLite path is taken from
    here). Opening a SQLite file that does not exist creates an empty store: check first."""
    from runner.tracking.mlflow_reader import MlflowReader

    return MlflowReader.open(location)
