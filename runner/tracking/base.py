"""The tracking seam: what the runner records about a run, and reads back, whatever keeps it.

- `Tracker`: a store and one experiment in it. It starts runs (`start_run`: ended FINISHED,
  FAILED or KILLED whatever happens), creates or reopens them (a sweep's parent), ends the runs
  whose process is gone (`reap`), and says where to look (`hint`).
- `Run`: one run in progress. Params, tags, metrics at a step, artifacts (a text or a file),
  inputs (datasets), system metrics; `deliver` before a checkpoint, `end` with a status.
- `Reader`: runs read back (of an experiment, by their tags), their params, metrics, metric
  histories; `RunRecord` is one run as read.

Two implementations: MLflow (`tracking=mlflow`, the default: runner.tracking.mlflow_tracker and
mlflow_run, over runner.tracking.store) and `tracking=none` (runner.tracking.json_file: the console
and a JSON file in the run's folder, no store at all). `open_tracker` picks one by the config's
`tracking.name` (runner.tracking.trackers). Nothing outside runner/tracking/ imports mlflow, and
this module never does at import: a run under `tracking=none` loads no MLflow.
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.tracking import tags as tag
from runner.tracking.liveness import was_reaped

log = logging.getLogger(__name__)

# a run's status (MLflow's names, which every tracker uses)
RUNNING, FINISHED, FAILED, KILLED = "RUNNING", "FINISHED", "FAILED", "KILLED"
MLFLOW, NONE = "mlflow", "none"  # the trackers, as `tracking.name` says them


class RunNotFound(LookupError):
    """No run of that id in the store: the message is the store's own."""


class StoreUnreadable(RuntimeError):
    """The store does not answer (a server that is away) or cannot be read: the message says
    where, and the store's own reason."""


@dataclass(frozen=True)
class RunRecord:
    """One run as a `Reader` reads it back: `metrics` holds each metric's latest value (the
    whole history: `Reader.history`); times are milliseconds since the epoch."""

    run_id: str
    run_name: str
    experiment_id: str
    status: str
    start_time: int | None = None
    end_time: int | None = None
    params: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


def end_state(run: RunRecord) -> str:
    """A run's status for a summary line; a run a reaper ended says why (its `error` tag)."""
    if was_reaped(run.tags):
        return f"{run.status}: {run.tags[tag.ERROR]}"
    return run.status


class Run(ABC):
    """One run in progress (rank 0's; the other ranks log into a `NullRun`)."""

    run_id: str | None
    resumes: int = 0  # the sessions before this one (its `resume.count` tag; 0: a new run)

    @abstractmethod
    def log_params(self, params: Mapping[str, str]) -> None: ...

    @abstractmethod
    def set_tag(self, key: str, value: Any) -> None: ...

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Returns at once: the training loop never waits on the store."""

    @abstractmethod
    def log_text(self, text: str, artifact_file: str) -> None:
        """An artifact from a string, at `artifact_file` (e.g. `layers/layer_plan.txt`)."""

    @abstractmethod
    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file as an artifact, under the folder `artifact_path` (None: at the top)."""

    def log_datasets(self, datasets: Sequence[Mapping[str, Any]]) -> None:  # noqa: B027  (optional)
        """The run's inputs: each a mapping of `name`, `digest`, `source_type`, `source`,
        `profile` (JSON text) and `context` ("training", "evaluation")."""

    def sample_system(self, interval_s: float, resumed: bool = False) -> bool:
        """Log system metrics every `interval_s` seconds until `end`; False when not sampled."""
        return False

    def deliver(self, timeout: float = 10.0) -> bool:
        """Before a checkpoint: the metrics logged so far, kept (True when they are)."""
        return True

    @abstractmethod
    def end(self, status: str, error: str | None = None) -> None:
        """The final status (FINISHED, FAILED, KILLED) and, unless FINISHED, why (the `error`
        tag), once everything logged is delivered."""


class NullRun(Run):
    """What ranks other than 0 log into: nothing (rank 0 logs the reduced metrics)."""

    run_id = None

    def log_params(self, params: Mapping[str, str]) -> None:
        pass

    def set_tag(self, key: str, value: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        pass

    def end(self, status: str, error: str | None = None) -> None:
        pass


@contextmanager
def null_run() -> Iterator[NullRun]:
    yield NullRun()


class Reader(ABC):
    """Runs read back from a store at `location` (an MLflow URI, a folder)."""

    location: str

    @abstractmethod
    def experiment_id(self, name: str) -> str | None:
        """The id of the experiment `name`; None when the store has none of that name."""

    @abstractmethod
    def experiment_names(self) -> list[str]:
        """The names of the store's experiments (for a name that matched none)."""

    @abstractmethod
    def run(self, run_id: str) -> RunRecord:
        """The run `run_id`; RunNotFound when the store has none."""

    @abstractmethod
    def runs(
        self,
        experiment_ids: Sequence[str],
        *,
        tags: Mapping[str, str] | None = None,
        having: Sequence[str] = (),
        newest_first: bool = False,
    ) -> list[RunRecord]:
        """The runs of the experiments whose tags hold `tags` (name -> value) and some value of
        every tag in `having`."""

    @abstractmethod
    def history(self, run_id: str, metric: str) -> list[tuple[int, float]]:
        """Every (step, value) the run logged of `metric`, by step."""

    @abstractmethod
    def log_artifacts(self, run_id: str, folder: str | os.PathLike, artifact_path: str) -> None:
        """The files of `folder` as artifacts of a finished run, under `artifact_path`."""

    def artifact_texts(self, run_id: str, folder: str) -> dict[str, str]:
        """The text of each file in the run's artifact folder `folder` (not below it), by file
        name; {} where it has none or the store does not give them (a reader of a store without
        artifacts)."""
        return {}

    @abstractmethod
    def delete_run(self, run_id: str) -> None: ...

    @abstractmethod
    def hint(self, experiment_id: str) -> str:
        """Where a person sees the experiment's runs (a command, a link, a folder)."""


class Tracker(ABC):
    """A store and one experiment in it, checked once when opened (before any training).

    `label` names the tracker in messages ("MLflow"), `location` is where it keeps runs (an MLflow
    URI, a folder); `reader` reads its runs back."""

    label: str
    location: str
    experiment_name: str
    experiment_id: str
    reader: Reader

    @abstractmethod
    def create_run(
        self, run_name: str, tags: Mapping[str, str], folder: str | os.PathLike | None = None
    ) -> Run:
        """A new RUNNING run; the caller must `end` it (`start_run` does). `folder`: the run's
        own folder (Hydra's output folder), where the tracker may keep files of its own."""

    @abstractmethod
    def reopen_run(
        self,
        run_id: str,
        tags: Mapping[str, str],
        folder: str | os.PathLike | None = None,
        run_name: str = "",
    ) -> Run:
        """A run of this experiment set RUNNING again (a resumed run goes on logging into it);
        `tags` are added, and `resume.count` counts the sessions. `run_name`: the run's name,
        for a tracker that no longer holds the run's record."""

    def reap(self, own_log: tuple[Path, int] | None = None) -> list[str]:
        """End as KILLED the RUNNING runs of this experiment whose process is gone; their ids.
        `own_log`: this process's job log and the byte its lines begin at."""
        return []

    def folder_taken(self, folder: str | os.PathLike, run_id: str | None) -> str | None:
        """Why a run (`run_id`: the run it resumes; None: a new one) cannot be recorded with
        `folder` as its own, else None. A store keeps any number of runs; `tracking=none` keeps
        one run's record a folder (runner.tracking.json_file)."""
        return None

    @abstractmethod
    def hint(self) -> str:
        """Where a person sees this experiment's runs."""

    def runs(
        self,
        *,
        tags: Mapping[str, str] | None = None,
        having: Sequence[str] = (),
        newest_first: bool = False,
    ) -> list[RunRecord]:
        """This experiment's runs (see `Reader.runs`)."""
        return self.reader.runs(
            [self.experiment_id], tags=tags, having=having, newest_first=newest_first
        )

    def record_failure(
        self,
        run_name: str,
        tags: Mapping[str, str],
        error: BaseException,
        folder: str | os.PathLike | None = None,
    ) -> str:
        """A FAILED run holding only the error: for a sweep job that failed before its run
        existed, so that the sweep's tree still shows every job. `folder`: the job's own."""
        run = self.create_run(run_name, tags, folder)
        run.end(FAILED, f"{type(error).__name__}: {error}")
        return str(run.run_id)

    @contextmanager
    def start_run(
        self,
        run_name: str,
        params: Mapping[str, str],
        tags: Mapping[str, str],
        resume_run_id: str | None = None,
        folder: str | os.PathLike | None = None,
    ) -> Iterator[Run]:
        """Create the run (or reopen `resume_run_id`); end it FINISHED, FAILED (error tag) or
        KILLED whatever happens. A run that did not finish says where to see what it logged (a
        finished one: the caller)."""
        if resume_run_id is not None:
            run = self.reopen_run(resume_run_id, tags, folder, run_name)
        else:
            run = self.create_run(run_name, tags, folder)
        try:
            if resume_run_id is None:
                run.log_params(params)
            yield run
        except KeyboardInterrupt as interrupt:
            self._end_unfinished(
                run, run_name, KILLED, str(interrupt) or "interrupted by the user (Ctrl-C)"
            )
            raise
        except BaseException as error:
            self._end_unfinished(run, run_name, FAILED, f"{type(error).__name__}: {error}")
            raise
        else:
            run.end(FINISHED)

    def _end_unfinished(self, run: Run, run_name: str, status: str, error: str) -> None:
        """End a run that did not finish, its own error on its way up: a store that cannot
        take the end (a full disk refusing the store and the offline one) is told in a line,
        and the run's error stays the one reported."""
        try:
            run.end(status, error)
        except Exception as refused:  # noqa: BLE001  (the run's own error goes on)
            log.error(
                "Run %r (%s) could not be marked %s: %s", run_name, run.run_id, status, refused
            )
            return
        log.warning("Run %r (%s) marked %s.\n%s", run_name, run.run_id, status, self.hint())


def end_fluent_runs() -> None:
    """A sweep job that left an MLflow fluent run active (`mlflow.start_run` in user code) must
    not leak it into the next job."""
    if "mlflow" not in sys.modules:
        return
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()
