"""MLflow run lifecycle for one training run: params, tags, batched async metrics, final status.

Metrics go out with `log_batch(..., synchronous=False)`, so the training loop never waits on the
store; every pending operation is awaited before the run is ended. A run always ends in a final
state: FINISHED, FAILED (the error as the `error` tag) or KILLED (Ctrl-C).

A SQLite store has one writer at a time. MLflow waits for the lock a while, but parallel sweep jobs
can still meet "database is locked"; every store call made here is retried on that error (an
asynchronous metric batch that failed on it is sent again), so concurrent writers lose nothing.
"""
from __future__ import annotations

import functools
import logging
import os
import random
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from runner.errors import RunnerError

log = logging.getLogger(__name__)

# MLflow 3.x opens GenAI experiments on an overview page; this shows the training-runs view.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 5000
PARENT_RUN_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by
LOCKED_RETRIES = 8

T = TypeVar("T")


def is_database_locked(error: BaseException) -> bool:
    """SQLite's "database is locked", as MLflow reports it (directly or from its logging thread)."""
    return "database is locked" in str(error)


def retry_when_locked(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a store operation, retrying with a jittered backoff while another writer holds the
    SQLite lock. A failed write was rolled back, so retrying it cannot duplicate anything."""
    delay = 0.05
    for attempt in range(1, LOCKED_RETRIES + 1):
        try:
            return call(*args, **kwargs)
        except MlflowException as error:
            if attempt == LOCKED_RETRIES or not is_database_locked(error):
                raise
            log.warning("MLflow store busy (database is locked), retry %d/%d in %.2f s",
                        attempt, LOCKED_RETRIES - 1, delay)
            time.sleep(delay * (1 + random.random()))
            delay = min(2 * delay, 2.0)
    raise AssertionError("unreachable")


class RetryingClient:
    """An MlflowClient whose every call goes through `retry_when_locked`."""

    def __init__(self, tracking_uri: str):
        self._client = MlflowClient(tracking_uri)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        return functools.partial(retry_when_locked, attribute)


def resolve_tracking_uri(uri: str, base_dir: str | os.PathLike | None = None) -> str:
    """Make a relative SQLite URI absolute against the launch directory (Hydra does not chdir,
    but the printed `mlflow ui` command must work from anywhere)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = Path(base_dir or os.getcwd()) / uri[len(prefix):]
        return prefix + str(path.resolve())
    return uri


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} for MLflow params."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


def git_commit(directory: str | os.PathLike) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def ui_hint(tracking_uri: str, experiment_id: str) -> str:
    """The exact command and link that show this experiment's runs in the MLflow UI."""
    page = f"#/experiments/{experiment_id}/runs"
    if tracking_uri.startswith(("http://", "https://")):
        return f"Open {tracking_uri.rstrip('/')}/{page}"
    return (
        f"See the runs with:  mlflow ui --backend-store-uri {tracking_uri}\n"
        f"then open http://127.0.0.1:5000/{page}"
    )


class TrackedRun:
    """One MLflow run in progress; metrics are sent asynchronously in batches."""

    def __init__(self, client: RetryingClient, run_id: str, experiment_id: str):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self._pending: list[tuple[Any, list[Metric]]] = []

    def log_params(self, params: Mapping[str, str]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(params.items())]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

    def set_tag(self, key: str, value: Any) -> None:
        self.client.set_tag(self.run_id, key, str(value)[:MAX_TAG_LENGTH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        operation = self.client.log_batch(self.run_id, metrics=batch, synchronous=False)
        if operation is not None:
            self._pending.append((operation, batch))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if Path(path).is_file():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        """Wait until every asynchronously logged metric has reached the store; a batch that met
        a locked SQLite store is sent again, synchronously (and retried)."""
        pending, self._pending = self._pending, []
        for operation, batch in pending:
            try:
                operation.wait()
            except MlflowException as error:
                if not is_database_locked(error):
                    raise
                self.client.log_batch(self.run_id, metrics=batch)

    def end(self, status: str, error: str | None = None) -> None:
        try:
            self.flush()
        finally:
            if error:
                self.set_tag("error", error)
            self.client.set_terminated(self.run_id, status=status)


class Tracker:
    """The tracking store and experiment; checked once at start, before any training."""

    def __init__(self, tracking_uri: str, experiment_name: str):
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.client = RetryingClient(self.tracking_uri)
        try:
            self.experiment_id = self._experiment(experiment_name)
        except (MlflowException, OSError) as error:
            raise RunnerError(
                f"mlflow.tracking_uri: cannot use the tracking store {self.tracking_uri!r}: "
                f"{error}. Start the server, fix the URI, or use the default sqlite:///mlflow.db."
            ) from error

    def _experiment(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = self.client.create_experiment(name, tags=dict([EXPERIMENT_KIND]))
        else:
            experiment_id = experiment.experiment_id
            if experiment.tags.get(EXPERIMENT_KIND[0]) is None:
                self.client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
        return experiment_id

    def create_run(self, run_name: str, tags: Mapping[str, str]) -> TrackedRun:
        """A new RUNNING run; the caller must `end` it (`start_run` does)."""
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()}
        )
        return TrackedRun(self.client, run.info.run_id, self.experiment_id)

    def record_failure(self, run_name: str, tags: Mapping[str, str], error: BaseException) -> str:
        """A FAILED run holding only the error: for a sweep job that failed before its run
        existed, so that the sweep's tree still shows every job."""
        tracked = self.create_run(run_name, tags)
        tracked.end(RunStatus.to_string(RunStatus.FAILED), f"{type(error).__name__}: {error}")
        return tracked.run_id

    @contextmanager
    def start_run(
        self, run_name: str, params: Mapping[str, str], tags: Mapping[str, str]
    ) -> Iterator[TrackedRun]:
        """Create the run; end it FINISHED, FAILED (error tag) or KILLED whatever happens. A run
        that did not finish says where to see what it logged (a finished one: the caller)."""
        tracked = self.create_run(run_name, tags)
        try:
            tracked.log_params(params)
            yield tracked
        except KeyboardInterrupt:
            tracked.end(RunStatus.to_string(RunStatus.KILLED), "interrupted by the user (Ctrl-C)")
            log.warning("Run %r (%s) marked KILLED.\n%s", run_name, tracked.run_id, self.hint())
            raise
        except BaseException as error:
            tracked.end(RunStatus.to_string(RunStatus.FAILED), f"{type(error).__name__}: {error}")
            log.warning("Run %r (%s) marked FAILED.\n%s", run_name, tracked.run_id, self.hint())
            raise
        else:
            tracked.end(RunStatus.to_string(RunStatus.FINISHED))

    def hint(self) -> str:
        return ui_hint(self.tracking_uri, self.experiment_id)
