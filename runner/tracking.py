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
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError, RunnerError

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


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: `mlartifacts/` beside a SQLite database (not
    MLflow's default, `./mlruns` in whatever folder a run was launched from); for a server or any
    other store, the store's own default (None)."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix):
        return (Path(tracking_uri[len(prefix):]).parent / "mlartifacts").resolve().as_uri()
    return None


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
    """One MLflow run in progress. Metrics go into a buffer that a background thread sends in
    batches, so the training loop never waits on the store: a store that does not answer (a
    tracking server that went away) keeps them buffered and retried with a growing pause, and
    they arrive once it is back. At the end, whatever still cannot be delivered (metrics, the
    final status, the log file) is written to a local MLflow store in `offline_dir`, and one
    command (`python -m runner.replay <folder>`) replays it into the server later."""

    BATCH = 1000  # MLflow's limit of metrics per log_batch call
    MAX_PAUSE_S = 30.0
    END_TIMEOUT_S = float(os.environ.get("AMP_RUNNER_MLFLOW_END_TIMEOUT", "30"))

    def __init__(self, client: RetryingClient, run_id: str, experiment_id: str,
                 tracking_uri: str = "", experiment_name: str = "",
                 offline_dir: str | os.PathLike | None = None):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.offline_dir = Path(offline_dir) if offline_dir is not None else None
        self._buffer: list[Metric] = []
        self._artifacts: list[tuple[str, str | None]] = []  # not delivered: for the offline store
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._outage: str | None = None  # the error while the store does not answer
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"mlflow-sender-{run_id[:8]}")
        self._sender.start()

    def log_params(self, params: Mapping[str, str]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(params.items())]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

    def set_tag(self, key: str, value: Any) -> None:
        self.client.set_tag(self.run_id, key, str(value)[:MAX_TAG_LENGTH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffered: returns at once, whatever the store is doing."""
        now = int(time.time() * 1000)
        with self._lock:
            self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        self._wake.set()

    def log_text(self, text: str, artifact_file: str) -> None:
        """An artifact from a string; kept for the offline store if the store does not take it."""
        try:
            self.client.log_text(self.run_id, text, artifact_file)
        except Exception as error:  # noqa: BLE001  (kept, like log_file)
            kept = Path(tempfile.mkdtemp(prefix="amp-runner-artifact-")) / Path(artifact_file).name
            kept.write_text(text)
            self._keep(kept, str(Path(artifact_file).parent) if "/" in artifact_file else None,
                       error)

    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not Path(path).is_file():
            return
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as error:  # noqa: BLE001  (kept for the offline store)
            self._keep(Path(path), artifact_path, error)

    def _keep(self, path: Path, artifact_path: str | None, error: BaseException) -> None:
        log.warning("Could not upload %s to the tracking store (%s); it goes to the offline "
                    "store if the store is still unreachable at the end", path.name, error)
        self._artifacts.append((str(path), artifact_path))

    # ---- the sender ---------------------------------------------------------------------------
    def _send_some(self) -> bool:
        """Send up to BATCH buffered metrics; False when the store did not take them."""
        with self._lock:
            batch = self._buffer[: self.BATCH]
        if not batch:
            return True
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as error:  # noqa: BLE001  (buffered and retried; see _send_loop)
            if self._outage is None:
                log.warning("The tracking store %s does not take metrics (%s): buffering them "
                            "and retrying; training goes on", self.tracking_uri, error)
            self._outage = f"{type(error).__name__}: {error}"
            return False
        with self._lock:
            del self._buffer[: len(batch)]
        if self._outage is not None:
            log.warning("The tracking store %s answers again: sending the buffered metrics",
                        self.tracking_uri)
            self._outage = None
        return True

    def _pending(self) -> int:
        with self._lock:
            return len(self._buffer)

    def _send_loop(self) -> None:
        pause = 0.0
        while not self._closing:
            self._wake.wait(timeout=pause or None)
            self._wake.clear()
            if self._closing:
                return  # `end` sends the rest itself
            while self._pending() and self._send_some():
                pass
            pause = 0.0 if not self._pending() else min(max(1.0, 2 * pause), self.MAX_PAUSE_S)

    def flush(self, timeout: float | None = None) -> bool:
        """Send every buffered metric now (retrying until `timeout`); True when all went."""
        deadline = time.monotonic() + (self.END_TIMEOUT_S if timeout is None else timeout)
        pause = 0.5
        while self._pending():
            if self._send_some():
                continue
            if time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 5.0)
        return True

    def end(self, status: str, error: str | None = None) -> None:
        """Deliver the rest and the final status; what the store does not take within
        END_TIMEOUT_S goes to the offline store (see `runner.replay`)."""
        self._closing = True
        self._wake.set()
        self._sender.join(timeout=60)
        deadline = time.monotonic() + self.END_TIMEOUT_S
        delivered = self.flush(timeout=self.END_TIMEOUT_S)
        pause = 0.5
        while delivered:
            try:
                while self._artifacts:  # kept while the store was away, and it is back
                    path, artifact_path = self._artifacts[0]
                    self.client.log_artifact(self.run_id, path, artifact_path)
                    self._artifacts.pop(0)
                if error:
                    self.set_tag("error", error)
                self.client.set_terminated(self.run_id, status=status)
                return
            except Exception as failure:  # noqa: BLE001  (retried, then written offline)
                self._outage = f"{type(failure).__name__}: {failure}"
                if time.monotonic() + pause > deadline:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 5.0)
        self._write_offline(status, error)

    def _write_offline(self, status: str, error: str | None) -> None:
        if self.offline_dir is None:
            raise RunnerError(f"the tracking store {self.tracking_uri} did not take the run's "
                              f"last {self._pending()} metrics and final status ({self._outage})")
        from runner.replay import write_offline

        where = write_offline(self.offline_dir, self, status, error, self._buffer,
                              self._artifacts)
        log.error("The tracking store %s is unreachable (%s): run %s's last %d metrics and its "
                  "final status %s are saved in %s. When the store is back, replay them with:\n"
                  "  python -m runner.replay %s", self.tracking_uri, self._outage, self.run_id,
                  len(self._buffer), status, where, where)


class Tracker:
    """The tracking store and experiment; checked once at start, before any training."""

    def __init__(self, tracking_uri: str, experiment_name: str):
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment_name = experiment_name
        if self.tracking_uri.startswith(("http://", "https://")):
            # MLflow's own retries would block a call for minutes while a server is away; the
            # runner buffers and retries metrics itself, and a server that does not answer at
            # the start is an error at once (user settings of these variables win)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
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
            experiment_id = self.client.create_experiment(
                name, artifact_location=artifact_location(self.tracking_uri),
                tags=dict([EXPERIMENT_KIND]))
        else:
            experiment_id = experiment.experiment_id
            if experiment.tags.get(EXPERIMENT_KIND[0]) is None:
                self.client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
        return experiment_id

    def create_run(self, run_name: str, tags: Mapping[str, str],
                   offline_dir: str | os.PathLike | None = None) -> TrackedRun:
        """A new RUNNING run; the caller must `end` it (`start_run` does)."""
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()}
        )
        return TrackedRun(self.client, run.info.run_id, self.experiment_id, self.tracking_uri,
                          self.experiment_name, offline_dir)

    def record_failure(self, run_name: str, tags: Mapping[str, str], error: BaseException) -> str:
        """A FAILED run holding only the error: for a sweep job that failed before its run
        existed, so that the sweep's tree still shows every job."""
        tracked = self.create_run(run_name, tags)
        tracked.end(RunStatus.to_string(RunStatus.FAILED), f"{type(error).__name__}: {error}")
        return tracked.run_id

    def reopen_run(self, run_id: str, tags: Mapping[str, str],
                   offline_dir: str | os.PathLike | None = None) -> TrackedRun:
        """A run of this experiment set RUNNING again (a resumed run goes on logging into it)."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            raise ConfigError("resume", f"the checkpoint's MLflow run {run_id} is not in the "
                              f"store {self.tracking_uri}: {error}",
                              "the tracking_uri the checkpointed run used") from error
        if run.info.experiment_id != self.experiment_id:
            raise ConfigError("resume", f"the checkpoint's MLflow run {run_id} belongs to "
                              f"experiment {run.info.experiment_id}, not {self.experiment_id}",
                              "the experiment_name the checkpointed run used")
        self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        tracked = TrackedRun(self.client, run_id, self.experiment_id, self.tracking_uri,
                             self.experiment_name, offline_dir)
        count = int(run.data.tags.get("resume.count", "0")) + 1
        for key, value in {**tags, "resume.count": str(count)}.items():
            tracked.set_tag(key, value)
        return tracked

    @contextmanager
    def start_run(
        self, run_name: str, params: Mapping[str, str], tags: Mapping[str, str],
        resume_run_id: str | None = None, offline_dir: str | os.PathLike | None = None,
    ) -> Iterator[TrackedRun]:
        """Create the run (or reopen `resume_run_id`); end it FINISHED, FAILED (error tag) or
        KILLED whatever happens. A run that did not finish says where to see what it logged (a
        finished one: the caller)."""
        if resume_run_id is not None:
            tracked = self.reopen_run(resume_run_id, tags, offline_dir)
        else:
            tracked = self.create_run(run_name, tags, offline_dir)
        try:
            if resume_run_id is None:
                tracked.log_params(params)
            yield tracked
        except KeyboardInterrupt as interrupt:
            tracked.end(RunStatus.to_string(RunStatus.KILLED),
                        str(interrupt) or "interrupted by the user (Ctrl-C)")
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


class _NullRun:
    """What ranks other than 0 log into: nothing (rank 0 logs the reduced metrics)."""

    run_id = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        pass


@contextmanager
def null_run() -> Iterator[_NullRun]:
    yield _NullRun()
