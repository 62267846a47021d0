"""One MLflow run in progress (`Run` of runner.tracking.base): params, tags, batched asynchronous
metrics, artifacts, its heartbeat, and the end with a final status.

Metrics go out from a background thread, so the training loop never waits on the store; every
pending metric is delivered before the run is ended. What the store does not take by the end goes
to a local offline store (runner.tracking.replay). The run's heartbeat (another background thread)
tells other processes it is alive (runner.tracking.liveness).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag

from runner import shell
from runner.errors import RunnerError, said
from runner.tracking import tags as tag
from runner.tracking.base import Run
from runner.tracking.liveness import heartbeat_tags, was_reaped
from runner.tracking.store import (
    MAX_PARAM_LENGTH,
    MAX_PARAMS_PER_BATCH,
    MAX_TAG_LENGTH,
    RetryingClient,
)

log = logging.getLogger(__name__)


class MlflowRun(Run):
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
        # the folders `log_text` wrote such artifacts into: removed once they are delivered
        self._scratch: list[Path] = []
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
            scratch = Path(tempfile.mkdtemp(prefix="amp-runner-artifact-"))
            self._scratch.append(scratch)
            kept = scratch / Path(artifact_file).name
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
                        said(error),
                    )
                self._outage = said(error)
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
            beat = heartbeat_tags()
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in beat.items()])
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
                self._drop_scratch()
                return
            except Exception as failure:  # noqa: BLE001  (retried, then written offline)
                self._outage = said(failure)
                if time.monotonic() + pause > deadline:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 5.0)
        self._write_offline(status, error)
        self._drop_scratch()  # (kept where neither store took them: _write_offline raised)

    def _drop_scratch(self) -> None:
        """Remove the folders of `log_text`'s kept artifacts: delivered, or in the offline
        store."""
        while self._scratch:
            shutil.rmtree(self._scratch.pop(), ignore_errors=True)

    def _write_offline(self, status: str, error: str | None) -> None:
        if self.offline_dir is None:
            raise RunnerError(
                f"the tracking store {self.tracking_uri} did not take the run's "
                f"last {self._pending()} metrics and final status ({self._outage})"
            )
        from runner.tracking.replay import write_offline

        try:
            where = write_offline(
                self.offline_dir, self, status, error, self._buffer, self._artifacts
            )
        except Exception as failure:  # noqa: BLE001  (a full disk refuses both stores)
            raise RunnerError(
                f"the tracking store {self.tracking_uri} did not take run {self.run_id}'s last "
                f"{self._pending()} metrics and final status {status} ({self._outage}), and "
                f"neither did the offline store in {self.offline_dir} "
                f"({said(failure)}). The run stays RUNNING "
                "there until the next run of its experiment, which ends it KILLED (its "
                "process gone)"
            ) from failure
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
            shell.word(str(where)),
        )
