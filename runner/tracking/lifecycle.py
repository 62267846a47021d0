"""MLflow run lifecycle for one training run: params, tags, batched async metrics, final status.

Metrics go out from a background thread, so the training loop never waits on the store; every
pending metric is delivered before the run is ended. A run always ends in a final state: FINISHED,
FAILED (the error as the `error` tag) or KILLED (Ctrl-C, SIGTERM).

A process that is killed outright (SIGKILL, the OOM killer, a lost node) cannot end its run, so
every run carries liveness tags (its host and process, and a heartbeat refreshed by another
background thread: runner.tracking.liveness), and every run or sweep that starts ends the RUNNING
runs of its experiment whose process is gone as KILLED (`Tracker.reap`).

The store itself (its lock, the retries on "database is locked", the offline fallback's folder) is
`runner.tracking.store`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, Run, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from runner.errors import ConfigError, RunnerError
from runner.tracking import liveness
from runner.tracking import tags as tag
from runner.tracking.liveness import LIVENESS_TAGS, ProcessIdentity, now_iso, parse_iso, was_reaped
from runner.tracking.store import (
    HEARTBEAT_S,
    MAX_PARAM_LENGTH,
    MAX_PARAMS_PER_BATCH,
    MAX_TAG_LENGTH,
    STALE_AFTER_S,
    STORE_LOCK_TIMEOUT_S,
    RetryingClient,
    artifact_location,
    prepare_sqlite_file,
    resolve_tracking_uri,
    sqlite_path,
    startup_error,
    store_lock,
    ui_hint,
)

log = logging.getLogger(__name__)


def end_state(run: Run) -> str:
    """A run's status for a summary line; a run a reaper ended says why (its `error` tag)."""
    if was_reaped(run.data.tags):
        return f"{run.info.status}: {run.data.tags[tag.ERROR]}"
    return run.info.status


class TrackedRun:
    """One MLflow run in progress. Metrics go into a buffer that a background thread sends in
    batches, so the training loop never waits on the store: a store that does not answer (a
    tracking server that went away) keeps them buffered and retried with a growing pause, and
    they arrive once it is back. At the end, whatever still cannot be delivered (metrics, the
    final status, the log file) is written to a local MLflow store in `offline_dir`, and one
    command (`python -m runner.replay <folder>`) replays it into the server later.

    With `heartbeat_s`, a third thread sets the `runner.heartbeat` tag every `heartbeat_s` seconds
    until `end` (a long compile, validation or checkpoint never looks like a dead process; a store
    that does not answer just misses beats). Should another process have ended the run as vanished
    meanwhile (it could not see the heartbeat for longer than its `mlflow.stale_after_s`: a store
    out of reach, a suspended process), the next beat, or `end`, undoes that."""

    BATCH = 1000  # MLflow's limit of metrics per log_batch call
    MAX_PAUSE_S = 30.0
    END_TIMEOUT_S = float(os.environ.get("AMP_RUNNER_MLFLOW_END_TIMEOUT", "30"))

    def __init__(
        self,
        client: RetryingClient,
        run_id: str,
        experiment_id: str,
        tracking_uri: str = "",
        experiment_name: str = "",
        offline_dir: str | os.PathLike | None = None,
        heartbeat_s: float | None = None,
    ):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.offline_dir = Path(offline_dir) if offline_dir is not None else None
        self._buffer: list[Metric] = []
        self._artifacts: list[tuple[str, str | None]] = []  # not delivered: for the offline store
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # one sender at a time: the thread, flush, end
        self._wake = threading.Event()
        self._closing = False
        self._outage: str | None = None  # the error while the store does not answer
        self._sender = threading.Thread(
            target=self._send_loop, daemon=True, name=f"mlflow-sender-{run_id[:8]}"
        )
        self._sender.start()
        self._system: Any = None  # a SystemSampler, once sample_system is called
        self.heartbeat_s = heartbeat_s
        self._stop_beating = threading.Event()
        self._heart: threading.Thread | None = None
        if heartbeat_s is not None:
            self._heart = threading.Thread(
                target=self._beat_loop, daemon=True, name=f"mlflow-heartbeat-{run_id[:8]}"
            )
            self._heart.start()

    def sample_system(self, interval_s: float, resumed: bool = False) -> bool:
        """Log system metrics (`system/...`, MLflow's monitors) every `interval_s` seconds until
        `end`, through this run's buffer (runner.tracking.system); a resumed run goes on after
        the steps its earlier processes logged. False when they cannot run."""
        from runner.tracking.system import PREFIX, SystemSampler

        self._system = SystemSampler(self.log_metrics, interval_s)
        if resumed:
            try:
                steps = [
                    m.step
                    for m in self.client.get_run(self.run_id).data._metric_objs
                    if m.key.startswith(PREFIX)
                ]
                self._system.samples = max(steps) + 1 if steps else 0
            except Exception:  # noqa: BLE001  (a store away: the steps start at 0)
                pass
        return self._system.start()

    def log_datasets(self, datasets: Sequence[Mapping[str, Any]]) -> None:
        """MLflow's dataset inputs (`mlflow.log_input`: the run page's "Datasets used"): each a
        mapping of `name`, `digest`, `source_type`, `source`, `profile` (JSON text) and
        `context` ("training", "evaluation"). Metadata: a store that does not take them is
        warned about, the run goes on."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [
            DatasetInput(
                Dataset(
                    name=d["name"],
                    digest=d["digest"],
                    source_type=d["source_type"],
                    source=d["source"],
                    profile=d.get("profile"),
                ),
                tags=[InputTag("mlflow.data.context", d["context"])],
            )
            for d in datasets
        ]
        try:
            self.client.log_inputs(self.run_id, datasets=inputs)
        except Exception as error:  # noqa: BLE001  (metadata; the run's metrics matter more)
            log.warning(
                "The datasets were not logged to run %s: %s: %s",
                self.run_id,
                type(error).__name__,
                error,
            )

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
            self._keep(
                kept, str(Path(artifact_file).parent) if "/" in artifact_file else None, error
            )

    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not Path(path).is_file():
            return
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as error:  # noqa: BLE001  (kept for the offline store)
            self._keep(Path(path), artifact_path, error)

    def _keep(self, path: Path, artifact_path: str | None, error: BaseException) -> None:
        log.warning(
            "Could not upload %s to the tracking store (%s); it goes to the offline "
            "store if the store is still unreachable at the end",
            path.name,
            error,
        )
        self._artifacts.append((str(path), artifact_path))

    # ---- the sender ---------------------------------------------------------------------------
    def _send_some(self) -> bool:
        """Send up to BATCH buffered metrics; False when the store did not take them. One call
        at a time (the sender thread and a `flush` never send the same batch twice)."""
        with self._sending:
            with self._lock:
                batch = self._buffer[: self.BATCH]
            if not batch:
                return True
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as error:  # noqa: BLE001  (buffered and retried; see _send_loop)
                if self._outage is None:
                    log.warning(
                        "The tracking store %s does not take metrics (%s): buffering "
                        "them and retrying; training goes on",
                        self.tracking_uri,
                        error,
                    )
                self._outage = f"{type(error).__name__}: {error}"
                return False
            with self._lock:
                del self._buffer[: len(batch)]
        if self._outage is not None:
            log.warning(
                "The tracking store %s answers again: sending the buffered metrics",
                self.tracking_uri,
            )
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

    # ---- the heartbeat --------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._stop_beating.wait(self.heartbeat_s):
            self._beat()

    def _beat(self) -> None:
        """Set the heartbeat tag, and undo a reaper's verdict on this live run. Errors are not
        reported: the metric sender already says when the store is away."""
        try:
            self.client.set_tag(self.run_id, tag.HEARTBEAT, now_iso())
            self._undo_reap()
        except Exception as error:  # noqa: BLE001  (a missed beat; the next one may go)
            log.debug("Heartbeat of run %s not delivered: %s", self.run_id, error)

    def _undo_reap(self) -> None:
        run = self.client.get_run(self.run_id)
        if run.info.status != RunStatus.to_string(RunStatus.KILLED) or not was_reaped(
            run.data.tags
        ):
            return
        self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self.client.delete_tag(self.run_id, tag.ERROR)
        log.warning(
            "Run %s had been ended by another process (%s), which could not see its "
            "heartbeat for a while (the store out of reach, this process suspended, or "
            "that host's clock ahead): it is RUNNING again",
            self.run_id,
            run.data.tags[tag.ERROR],
        )

    def _stop_heart(self) -> None:
        """Stop the heartbeat thread, with a last beat (which undoes a reaper's verdict) unless
        the store is known to be away (the end has its own deadline for that)."""
        if self._heart is None:
            return
        self._stop_beating.set()
        self._heart.join(timeout=30)
        self._heart = None
        if self._outage is None:
            self._beat()

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

    def deliver(self, timeout: float = 10.0) -> bool:
        """Before a checkpoint: the metrics logged so far, in the store (a process killed right
        after the checkpoint loses none of what it covers, and its resume does not log them
        again). A store that does not answer within `timeout` keeps them buffered (they go out
        later, or to the offline store at the end); training goes on."""
        if self._outage is not None:
            return False  # the sender is already retrying; do not stall the checkpoint
        return self.flush(timeout=timeout)

    def end(self, status: str, error: str | None = None) -> None:
        """Deliver the rest and the final status; what the store does not take within
        END_TIMEOUT_S goes to the offline store (see `runner.tracking.replay`)."""
        if self._system is not None:
            self._system.stop()
            self._system = None
        self._stop_heart()
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
                    self.set_tag(tag.ERROR, error)
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
            raise RunnerError(
                f"the tracking store {self.tracking_uri} did not take the run's "
                f"last {self._pending()} metrics and final status ({self._outage})"
            )
        from runner.tracking.replay import write_offline

        where = write_offline(self.offline_dir, self, status, error, self._buffer, self._artifacts)
        log.error(
            "The tracking store %s is unreachable (%s): run %s's last %d metrics and its "
            "final status %s are saved in %s. When the store is back, replay them with:\n"
            "  python -m runner.replay %s",
            self.tracking_uri,
            self._outage,
            self.run_id,
            len(self._buffer),
            status,
            where,
            where,
        )


class Tracker:
    """The tracking store and experiment; checked once at start, before any training.

    `heartbeat_s`: how often its runs refresh their heartbeat; `stale_after_s`: how old the
    heartbeat of a run on another host must be for `reap` to end it; `lock_timeout_s`: how long
    opening a SQLite store waits for another process that holds its lock (see `store_lock`)."""

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        lock_timeout_s: float = STORE_LOCK_TIMEOUT_S,
    ):
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment_name = experiment_name
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        if self.tracking_uri.startswith(("http://", "https://")):
            # MLflow's own retries would block a call for minutes while a server is away; the
            # runner buffers and retries metrics itself, and a server that does not answer at
            # the start is an error at once (user settings of these variables win)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            database = sqlite_path(self.tracking_uri)
            if database is not None:
                prepare_sqlite_file(database)
            # the first client of a URI in a process opens MLflow's store, which creates the
            # tables of a new database: under the lock, with the experiment's creation
            with store_lock(self.tracking_uri, lock_timeout_s):
                self.client = RetryingClient(self.tracking_uri)
                self.experiment_id = self._experiment(experiment_name)
        except RunnerError:
            raise
        except Exception as error:  # noqa: BLE001  (any store error at the start: the user's)
            raise startup_error(self.tracking_uri, error) from error

    @classmethod
    def from_config(cls, mlflow_cfg: Any) -> Tracker:
        """The tracker an `mlflow` config node describes (`cfg.mlflow`)."""
        return cls(
            mlflow_cfg.tracking_uri,
            mlflow_cfg.experiment_name,
            heartbeat_s=float(mlflow_cfg.heartbeat_s),
            stale_after_s=float(mlflow_cfg.stale_after_s),
        )

    def _experiment(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(
                    name,
                    artifact_location=artifact_location(self.tracking_uri),
                    tags=dict([tag.EXPERIMENT_KIND]),
                )
            except MlflowException as error:  # created meanwhile by a run on another machine
                if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                    raise
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        experiment_id = experiment.experiment_id
        if experiment.tags.get(tag.EXPERIMENT_KIND[0]) is None:
            self.client.set_experiment_tag(experiment_id, *tag.EXPERIMENT_KIND)
        return experiment_id

    def _liveness_tags(self) -> dict[str, str]:
        return {**ProcessIdentity.current().tags(), tag.HEARTBEAT: now_iso()}

    def create_run(
        self, run_name: str, tags: Mapping[str, str], offline_dir: str | os.PathLike | None = None
    ) -> TrackedRun:
        """A new RUNNING run, with this process's liveness tags and a heartbeat; the caller must
        `end` it (`start_run` does)."""
        tags = {**{k: str(v) for k, v in tags.items()}, **self._liveness_tags()}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        return TrackedRun(
            self.client,
            run.info.run_id,
            self.experiment_id,
            self.tracking_uri,
            self.experiment_name,
            offline_dir,
            self.heartbeat_s,
        )

    # ---- runs whose process is gone -------------------------------------------------------------
    def running_runs(self) -> list[Run]:
        """Every RUNNING run of this experiment that carries liveness tags."""
        runs: list[Run] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                max_results=1000,
                page_token=token,
                filter_string=f"attributes.status = 'RUNNING' and tags.`{tag.HEARTBEAT}` != ''",
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def vanished(
        self, run: Run, here: ProcessIdentity | None = None, now: float | None = None
    ) -> str | None:
        """Why a RUNNING run's process is known to be gone (the reason `reap` writes), or None:
        alive, finished, or not judged (see runner.tracking.liveness)."""
        if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
            return None
        return liveness.vanished(run.data.tags, self.stale_after_s, here, now)

    def end_vanished(self, run: Run, reason: str) -> bool:
        """End `run` KILLED with `reason` as its `error` tag, at its last heartbeat, provided it is
        still as it was judged (RUNNING, the same liveness tags): a run another process reaped or
        reopened meanwhile is left alone. On SQLite the check and the end are one step under the
        store's lock; elsewhere the window between them is a store round trip. True when this
        call ended it."""
        run_id = run.info.run_id
        with store_lock(self.tracking_uri):
            now = self.client.get_run(run_id)
            seen = {k: run.data.tags.get(k) for k in LIVENESS_TAGS}
            if (
                now.info.status != RunStatus.to_string(RunStatus.RUNNING)
                or {k: now.data.tags.get(k) for k in LIVENESS_TAGS} != seen
            ):
                return False
            beat = parse_iso(now.data.tags.get(tag.HEARTBEAT, ""))
            end_ms = max(run.info.start_time or 0, int(beat * 1000)) if beat else None
            self.client.log_batch(run_id, tags=[RunTag(tag.ERROR, reason[:MAX_TAG_LENGTH])])
            self.client.set_terminated(
                run_id, status=RunStatus.to_string(RunStatus.KILLED), end_time=end_ms
            )
        return True

    def reap(self, here: ProcessIdentity | None = None, now: float | None = None) -> list[str]:
        """End as KILLED every RUNNING run of this experiment whose process is gone (on this
        host: its pid is dead or another process; elsewhere: no heartbeat for `stale_after_s`),
        with the `error` tag "process vanished: no heartbeat since <time> (host <h>, pid <p>)";
        one warning line per run ended. Live runs and runs without liveness tags are never
        touched. Returns the ids of the runs ended here. A store that fails meanwhile is only
        reported: reaping is housekeeping, never a reason not to train."""
        here = here or ProcessIdentity.current()
        ended = []
        try:
            for run in self.running_runs():
                reason = self.vanished(run, here, now)
                if reason is not None and self.end_vanished(run, reason):
                    log.warning(
                        "Ended run %r (%s) as KILLED: %s",
                        run.info.run_name,
                        run.info.run_id,
                        reason,
                    )
                    ended.append(run.info.run_id)
        except Exception as error:  # noqa: BLE001  (see the docstring)
            log.warning(
                "Could not look for runs whose process vanished in %s: %s", self.tracking_uri, error
            )
        return ended

    def latest_run(self, run_name: str) -> Run | None:
        """The most recently started run named `run_name` in this experiment (any status), or
        None: for `resume=auto` to see what became of the run it would continue."""
        quote = "'" if "'" not in run_name else '"'
        if quote in run_name:  # MLflow's filter strings cannot escape quotes: filter here
            runs = [
                r
                for r in self.client.search_runs(
                    [self.experiment_id], order_by=["attributes.start_time DESC"], max_results=1000
                )
                if r.info.run_name == run_name
            ]
        else:
            runs = self.client.search_runs(
                [self.experiment_id],
                max_results=1,
                order_by=["attributes.start_time DESC"],
                filter_string=f"attributes.run_name = {quote}{run_name}{quote}",
            )
        return runs[0] if runs else None

    def record_failure(self, run_name: str, tags: Mapping[str, str], error: BaseException) -> str:
        """A FAILED run holding only the error: for a sweep job that failed before its run
        existed, so that the sweep's tree still shows every job."""
        tracked = self.create_run(run_name, tags)
        tracked.end(RunStatus.to_string(RunStatus.FAILED), f"{type(error).__name__}: {error}")
        return tracked.run_id

    def reopen_run(
        self, run_id: str, tags: Mapping[str, str], offline_dir: str | os.PathLike | None = None
    ) -> TrackedRun:
        """A run of this experiment set RUNNING again (a resumed run goes on logging into it),
        with this process's liveness tags."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            raise ConfigError(
                "resume",
                f"the checkpoint's MLflow run {run_id} is not in the "
                f"store {self.tracking_uri}: {error}",
                "the tracking_uri the checkpointed run used",
            ) from error
        if run.info.experiment_id != self.experiment_id:
            raise ConfigError(
                "resume",
                f"the checkpoint's MLflow run {run_id} belongs to "
                f"experiment {run.info.experiment_id}, not {self.experiment_id}",
                "the experiment_name the checkpointed run used",
            )
        # the new owner first, then the status, as one step against `end_vanished`
        with store_lock(self.tracking_uri):
            self.client.log_batch(
                run_id, tags=[RunTag(k, v) for k, v in self._liveness_tags().items()]
            )
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        if tag.ERROR in run.data.tags:  # why the last session ended: not true of a running run
            self.client.delete_tag(run_id, tag.ERROR)
        tracked = TrackedRun(
            self.client,
            run_id,
            self.experiment_id,
            self.tracking_uri,
            self.experiment_name,
            offline_dir,
            self.heartbeat_s,
        )
        count = int(run.data.tags.get(tag.RESUME_COUNT, "0")) + 1
        for key, value in {**tags, tag.RESUME_COUNT: str(count)}.items():
            tracked.set_tag(key, value)
        return tracked

    @contextmanager
    def start_run(
        self,
        run_name: str,
        params: Mapping[str, str],
        tags: Mapping[str, str],
        resume_run_id: str | None = None,
        offline_dir: str | os.PathLike | None = None,
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
            tracked.end(
                RunStatus.to_string(RunStatus.KILLED),
                str(interrupt) or "interrupted by the user (Ctrl-C)",
            )
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

    def deliver(self, timeout: float = 10.0) -> bool:
        return True


@contextmanager
def null_run() -> Iterator[_NullRun]:
    yield _NullRun()
