"""MLflow's side of `Tracker` (runner.tracking.base): the store and experiment, the runs it creates
or reopens (`MlflowRun`: runner.tracking.mlflow_run), and the reaping of runs whose process is gone.

A process that is killed outright (SIGKILL, the OOM killer, a lost node) cannot end its run, so
every run carries liveness tags (its host and process, and a heartbeat refreshed by a background
thread: runner.tracking.liveness), and every run or sweep that starts ends the RUNNING runs of its
experiment whose process is gone as KILLED (`MlflowTracker.reap`).

The store itself (its lock, the retries on "database is locked", the offline fallback's folder) is
`runner.tracking.store`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from runner.errors import ConfigError, RunnerError
from runner.tracking import job_log, liveness
from runner.tracking import tags as tag
from runner.tracking.base import KILLED, RUNNING, RunRecord, Tracker
from runner.tracking.liveness import LIVENESS_TAGS, ProcessIdentity, heartbeat_tags, parse_iso
from runner.tracking.mlflow_reader import MlflowReader, record
from runner.tracking.mlflow_run import MlflowRun
from runner.tracking.store import (
    HEARTBEAT_S,
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

OFFLINE = "mlflow-offline"  # the offline store's folder in a run's folder (runner.tracking.replay)


class MlflowTracker(Tracker):
    """The MLflow store and experiment; checked once at start, before any training.

    `heartbeat_s`: how often its runs refresh their heartbeat; `stale_after_s`: how old the
    heartbeat of a run on another host must be for `reap` to end it; `lock_timeout_s`: how long
    opening a SQLite store waits for another process that holds its lock (see `store_lock`)."""

    label = "MLflow"

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        lock_timeout_s: float = STORE_LOCK_TIMEOUT_S,
    ):
        self.tracking_uri = self.location = resolve_tracking_uri(tracking_uri)
        self.experiment_name = experiment_name
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
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
        self.reader = MlflowReader(self.client, self.tracking_uri)

    @classmethod
    def from_config(cls, mlflow_cfg: Any) -> MlflowTracker:
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
        return {**ProcessIdentity.current().tags(), **heartbeat_tags()}

    def _run(self, run_id: str, folder: str | os.PathLike | None) -> MlflowRun:
        """The run `run_id` in progress in this process; what the store cannot take by its end
        goes to an offline store in `folder` (none: an error then)."""
        return MlflowRun(
            self.client,
            run_id,
            self.experiment_id,
            self.tracking_uri,
            self.experiment_name,
            Path(folder) / OFFLINE if folder is not None else None,
            self.heartbeat_s,
        )

    def create_run(
        self, run_name: str, tags: Mapping[str, str], folder: str | os.PathLike | None = None
    ) -> MlflowRun:
        """A new RUNNING run, with this process's liveness tags and a heartbeat; the caller must
        `end` it (`start_run` does)."""
        tags = {**{k: str(v) for k, v in tags.items()}, **self._liveness_tags()}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        return self._run(run.info.run_id, folder)

    def reopen_run(
        self,
        run_id: str,
        tags: Mapping[str, str],
        folder: str | os.PathLike | None = None,
        run_name: str = "",
    ) -> MlflowRun:
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
        # the new owner first, then the status, as one step against `end_vanished` and against
        # another process resuming it at the same time
        with store_lock(self.tracking_uri):
            now = self.client.get_run(run_id)
            owner = (
                liveness.owner_alive(now.data.tags, self.stale_after_s)
                if now.info.status == RUNNING
                else None
            )
            if owner is not None:  # (two processes would log into one run, one checkpoint)
                raise ConfigError(
                    "resume",
                    f"the run {run_id} is still running ({owner}): another process trains it",
                    "wait for it to end, or stop it, then resume=auto (a run whose process died "
                    "is ended KILLED by the next run, and can be resumed then)",
                )
            self.client.log_batch(
                run_id, tags=[RunTag(k, v) for k, v in self._liveness_tags().items()]
            )
            self.client.update_run(run_id, status=RUNNING)
        # why the last session ended, and where its log was: not true of this session
        for stale in (tag.ERROR, *job_log.TAGS):
            if stale in run.data.tags and stale not in tags:
                self.client.delete_tag(run_id, stale)
        tracked = self._run(run_id, folder)
        count = int(run.data.tags.get(tag.RESUME_COUNT, "0")) + 1
        for key, value in {**tags, tag.RESUME_COUNT: str(count)}.items():
            tracked.set_tag(key, value)
        tracked.resumes = count
        return tracked

    def hint(self) -> str:
        return ui_hint(self.tracking_uri, self.experiment_id)

    # ---- runs whose process is gone -------------------------------------------------------------
    def running_runs(self) -> list[RunRecord]:
        """Every RUNNING run of this experiment that carries liveness tags."""
        runs: list[RunRecord] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                max_results=1000,
                page_token=token,
                filter_string=f"attributes.status = 'RUNNING' and tags.`{tag.HEARTBEAT}` != ''",
            )
            runs.extend(record(r) for r in page)
            token = page.token
            if not token:
                return runs

    def vanished(
        self, run: RunRecord, here: ProcessIdentity | None = None, now: float | None = None
    ) -> str | None:
        """Why a RUNNING run's process is known to be gone (the reason `reap` writes), or None:
        alive, finished, or not judged (see runner.tracking.liveness)."""
        if run.status != RUNNING:
            return None
        return liveness.vanished(run.tags, self.stale_after_s, here, now)

    def end_vanished(self, run: RunRecord, reason: str) -> bool:
        """End `run` KILLED with `reason` as its `error` tag, at its last heartbeat, provided it is
        still as it was judged (RUNNING, the same liveness tags): a run another process reaped or
        reopened meanwhile is left alone. On SQLite the check and the end are one step under the
        store's lock; elsewhere the window between them is a store round trip. True when this
        call ended it."""
        run_id = run.run_id
        with store_lock(self.tracking_uri):
            now = self.client.get_run(run_id)
            seen = {k: run.tags.get(k) for k in LIVENESS_TAGS}
            if (
                now.info.status != RUNNING
                or {k: now.data.tags.get(k) for k in LIVENESS_TAGS} != seen
            ):
                return False
            beat = parse_iso(now.data.tags.get(tag.HEARTBEAT, ""))
            end_ms = max(run.start_time or 0, int(beat * 1000)) if beat else None
            self.client.log_batch(run_id, tags=[RunTag(tag.ERROR, reason[:MAX_TAG_LENGTH])])
            self.client.set_terminated(run_id, status=KILLED, end_time=end_ms)
        return True

    def reap(
        self,
        here: ProcessIdentity | None = None,
        now: float | None = None,
        own_log: tuple[Path, int] | None = None,
    ) -> list[str]:
        """End as KILLED every RUNNING run of this experiment whose process is gone (on this
        host: its pid is dead or another process; elsewhere: no heartbeat for `stale_after_s`),
        with the `error` tag "process vanished: no heartbeat since <time> (host <h>, pid <p>)",
        and its session's job log attached where it is on this host (runner.tracking.job_log;
        `own_log`: this process's job log and where its lines begin, which ends a dead run's part
        in the same file); one warning line per run ended. Live runs and runs without liveness
        tags are never touched. Returns the ids of the runs ended here. A store that fails
        meanwhile is only reported: reaping is housekeeping, never a reason not to train."""
        here = here or ProcessIdentity.current()
        ended = []
        try:
            for run in self.running_runs():
                reason = self.vanished(run, here, now)
                if reason is not None and self.end_vanished(run, reason):
                    log.warning(
                        "Ended run %r (%s) as KILLED: %s%s",
                        run.run_name,
                        run.run_id,
                        reason,
                        self._attach_vanished_log(run, here, own_log),
                    )
                    ended.append(run.run_id)
        except Exception as error:  # noqa: BLE001  (see the docstring)
            log.warning(
                "Could not look for runs whose process vanished in %s: %s", self.tracking_uri, error
            )
        return ended

    def _attach_vanished_log(
        self, run: RunRecord, here: ProcessIdentity, own_log: tuple[Path, int] | None
    ) -> str:
        """The job log of a run whose process vanished attached to it (`job_log.of_vanished`);
        what to add to the line that says it was ended: where its log is."""
        path = run.tags.get(tag.LOG_FILE)
        if not path:
            return ""
        found = job_log.of_vanished(run.tags, here, own_log)
        if found is None:
            return f"; its log: {run.tags.get(tag.HOST, '?')}:{path}"
        name, text = found
        try:
            self.client.log_text(run.run_id, text, f"logs/{name}")
        except Exception as error:  # noqa: BLE001  (housekeeping: see reap)
            return f"; its log {path} could not be attached: {error}"
        return f"; its log attached (logs/{name})"

    def latest_run(self, run_name: str) -> RunRecord | None:
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
        return record(runs[0]) if runs else None
