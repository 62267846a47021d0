"""The Hydra callback that makes a multirun one parent run with a child run per job
(`MlflowSweepCallback`), and the CLI's scope that ends a parent left open by a sweep that stopped
early (`LaunchScope`). See runner.sweep for the whole story."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runner import shell
from runner.errors import ConfigError, RunnerError, said
from runner.files import HeldLock, try_lock
from runner.sweep import launchers, stop
from runner.sweep.expansion import BASIC_SWEEPER, sweep_overrides, varying_keys
from runner.sweep.gpus import claim_gpu, gpu_count
from runner.sweep.parent import SweepParent
from runner.sweep.preflight import (
    check_direction,
    check_launcher,
    dry_run_drawn,
    preflight,
    resolved,
)
from runner.sweep.resume import earlier_sweep, overrides_tag, resuming
from runner.sweep.speed import speed_summary
from runner.tracking import job_log
from runner.tracking import tags as tag
from runner.tracking.base import end_fluent_runs
from runner.tracking.record import typed_command

log = logging.getLogger(__name__)

MAX_RUN_NAME = 200
FOLDER_LOCK = ".amp-runner-sweep.lock"  # in the sweep's folder, held while the sweep runs
SUMMARY_TXT = "sweep_summary.txt"  # the closing lines, an artifact of the parent run


class MlflowSweepCallback(Callback):
    """Makes a Hydra multirun one MLflow parent run with a child run per job."""

    def __init__(self) -> None:
        self.parent: SweepParent | None = None
        self._parent_run: Any = None  # the launching process's open parent (a tracking Run)
        self._sweep_dir: Path | None = None
        self._gpu: tuple[int, HeldLock] | None = None
        self._jobs: int | None = None  # the sweep's job count, when known before it starts
        self._stop: stop.SweepStop | None = None  # the sweep's process (joblib, submitit_local)
        self._launching_pid: int | None = None  # that process's id, under those
        self._folder: HeldLock | None = None  # the sweep's folder, its own while it runs

    def __getstate__(self) -> dict:
        """What a launcher ships to its worker processes (joblib pickles the callback): the
        parent's address; the open run, a claimed GPU and the signal handling stay with the
        process that holds them."""
        return {**self.__dict__, "_parent_run": None, "_gpu": None, "_stop": None, "_folder": None}

    # launching process
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.run.output_folder import cannot_create, check_output_folder

        job_log.own_loggers_on()  # (hydra/hydra_logging=disabled: a refusal is still told)
        try:
            check_output_folder(config, "sweep")
            check_launcher(config)  # (a dry run too: the launcher still starts its jobs)
            check_direction(config)  # (Optuna's: the default minimises a classifier's accuracy)
            tag.user_tags(config.mlflow.tags)  # (a list, a name of the runner's: refused)
        except RunnerError as error:
            log.error("%s", error)
            raise SystemExit(2) from error
        if config.dry_run:  # a dry run creates no run, in a sweep too
            if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
                try:
                    dry_run_drawn(config)  # (exits: Optuna's jobs are drawn as they run)
                except RunnerError as error:
                    log.error("%s", error)
                    raise SystemExit(2) from error
            return
        from runner.run.output_folder import claim_sweep
        from runner.tracking.base import MLFLOW
        from runner.tracking.trackers import kind

        try:  # (under tracking=none there is no store, and MLflow is not even imported)
            tracking_uri = resolved(config.mlflow.tracking_uri) if kind(config) == MLFLOW else ""
            jobs = preflight(config, kwargs.get("config_name"), tracking_uri)
        except RunnerError as error:
            log.error("%s", error)
            raise SystemExit(2) from error
        try:
            claim_sweep(config)  # (one named by the time: this sweep's own)
            sweep_dir = Path(config.hydra.sweep.dir)
            self._folder = _hold_folder(sweep_dir)
        except OSError as error:  # (what the check above cannot see: /proc, a full disk)
            problem = f"{error.strerror or error}: {error.filename}"
            log.error("%s", cannot_create("sweep", config.hydra.sweep.dir, problem))
            raise SystemExit(2) from error
        try:
            self._open_parent(config, sweep_dir, jobs)
        except BaseException:
            self._release_folder()  # (a sweep that does not start leaves its folder free)
            raise

    def _open_parent(self, config: DictConfig, sweep_dir: Path, jobs: int | None) -> None:
        """The sweep's parent run, opened (or reopened by `resume=auto`) in its store, and what
        the launcher's jobs are told of it."""
        from runner.tracking.trackers import kind

        tracker, earlier = _open_store(config, sweep_dir)
        launcher = launchers.fit_launcher(config, jobs)
        launchers.warn_shared_device(config, launcher)
        name = config.mlflow.sweep_name or " ".join(["sweep", *sweep_overrides(config)])
        self._parent_run = _start_parent_run(tracker, config, sweep_dir, launcher, name, earlier)
        self.parent = SweepParent(
            kind(config),
            tracker.location,
            config.mlflow.experiment_name,
            tracker.experiment_id,
            self._parent_run.run_id,
            " ".join(varying_keys(config)),
        )
        self.parent.save(sweep_dir)
        self._sweep_dir = sweep_dir
        self._jobs = jobs
        if launcher in launchers.LOCAL_PROCESS_LAUNCHERS:  # Ctrl-C: see runner.sweep.stop
            stop.forget_workers(sweep_dir)
            self._launching_pid = os.getpid()
            self._stop = stop.SweepStop(sweep_dir, self._mark_stopped).__enter__()
        scope = _SCOPE.get()
        if scope is not None:
            scope.adopt(self)
        count = "" if jobs is None else f" of {jobs} jobs"
        log.info(
            "Sweep%s: %s parent run %r (%s) in %s",
            count,
            tracker.label,
            name,
            self.parent.run_id,
            tracker.location,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._end()
        finally:
            self._release_folder()

    def _end(self) -> None:
        if self.parent is None or self._parent_run is None:
            return
        from runner.tracking.base import FINISHED, KILLED, MLFLOW, end_state

        tracker = self.parent.open()
        children = self.parent.children(tracker)
        signum = self._release_stop()
        failed = [c for c in children if c.status != FINISHED]
        parent, self._parent_run = self._parent_run, None
        SweepParent.forget(self._sweep_dir)
        status, reason = FINISHED, None
        if signum is not None:
            status, reason = KILLED, f"interrupted by {signal.Signals(signum).name}"
        ended = [f"{c.run_name} ({end_state(c)})" for c in failed]
        failures = f", {len(failed)} failed: " + ", ".join(ended) if failed else ", none failed"
        where = (  # an MLflow store, or (tracking=none) the records in the sweep's folder
            ["--tracking-uri", tracker.location]
            + ["--experiment", self.parent.experiment_name, "--parent", self.parent.run_id]
            if self.parent.tracker == MLFLOW
            else ["--sweep", tracker.location]
        )
        summary = (
            f"Sweep finished: {len(children)} job{'' if len(children) == 1 else 's'}{failures}.\n"
            + speed_summary(children, tracker.reader.history, _traces(tracker.reader))
            + "Compare them:  "
            + shell.join(["python", "-m", "runner.report", *where])
            + "\n"
        )
        try:
            parent.log_metrics({"jobs": len(children), "failed_jobs": len(failed)}, 0)
            parent.set_tag(tag.FAILED_JOBS, "; ".join(ended) or "none")
            parent.log_text(summary, SUMMARY_TXT)  # (kept where no console is: nohup, ssh gone)
            parent.end(status, reason)
            recorded = True
        except Exception as refused:  # noqa: BLE001  (a full disk: the sweep's end is still told)
            log.error(
                "The sweep's parent run %s could not be marked %s: %s%s",
                parent.run_id,
                status,
                said(refused),
                ""
                if isinstance(refused, RunnerError)  # (it says what becomes of the run)
                else ". It stays RUNNING until the next run in its experiment ends it KILLED",
            )
            recorded = False
        if signum is not None:
            self._end_stopped(signum, children)
        log.info("%s%s", summary, tracker.hint())
        if failed or not recorded:
            raise SystemExit(1)  # Hydra swallows a callback's exceptions, not SystemExit

    def _mark_stopped(self, signum: int) -> None:
        """The sweep's process had a signal: jobs that start from now on do not run."""
        if self.parent is not None and self._sweep_dir is not None:
            self.parent = dataclasses.replace(self.parent, stopped=signal.Signals(signum).name)
            self.parent.save(self._sweep_dir)

    def held_signal(self) -> int | None:
        """The signal the sweep's process holds while its jobs run, if it had one."""
        return self._stop.signum if self._stop is not None else None

    def _release_stop(self) -> int | None:
        """The signal handling of the sweep's process ends; returns the signal it held."""
        held, self._stop = self._stop, None
        if held is None:
            return None
        held.__exit__(None, None, None)
        if self._sweep_dir is not None:
            stop.forget_workers(self._sweep_dir)
        return held.signum

    def _release_folder(self) -> None:
        held, self._folder = self._folder, None
        if held is not None:
            held.release()

    def _end_stopped(self, signum: int, children: list[Any]) -> None:
        """The end of a sweep that a signal stopped (its parent run ended KILLED): the log says
        which jobs stopped and how to go on, and the sweep exits as a run would (130, 143)."""
        from runner.run.interrupts import RunInterrupted

        self._tell_stopped(signum, children)
        raise RunInterrupted(signum)

    def _tell_stopped(self, signum: int, children: list[Any]) -> None:
        """Which jobs a signal stopped, and the command that goes on."""
        from runner.tracking.base import FINISHED, KILLED

        name = signal.Signals(signum).name
        stopped = [c.run_name for c in children if c.status == KILLED]
        finished = sum(c.status == FINISHED for c in children)
        waiting = "" if self._jobs is None else f", {self._jobs - len(children)} not started"
        log.warning(
            "Sweep stopped by %s: %d job(s) stopped with a checkpoint (%s), %d finished%s. "
            "To go on: the same command with resume=auto %s",
            name,
            len(stopped),
            ", ".join(stopped) or "none",
            finished,
            waiting,
            shell.override("hydra.sweep.dir", str(self._sweep_dir)),
        )

    def end_early(self, status: str, reason: str, signum: int | None = None) -> bool:
        """End the parent run if the sweep stopped before `on_multirun_end` (see LaunchScope):
        its `error` tag is `reason` and, when jobs failed, which ones and why (a sweeper such as
        Optuna stops at a failed trial by its `max_failure_rate`). Stopped by a signal
        (`signum`: the default launcher's jobs run in the CLI's process, so its Ctrl-C ends the
        sweep here), the log says which jobs stopped and the command that goes on, as
        `_end_stopped` does for parallel jobs. Whether a parent was open."""
        self._release_stop()
        self._release_folder()
        parent, self._parent_run = self._parent_run, None
        if parent is None:
            return False
        if self._sweep_dir is not None:
            SweepParent.forget(self._sweep_dir)
        try:
            children = self.parent.children(self.parent.open()) if self.parent is not None else []
            failed = _failed(children)
            if failed:
                reason += "; failed: " + "; ".join(failed)
                parent.set_tag(tag.FAILED_JOBS, "; ".join(failed))
            parent.end(status, reason)
            if signum is not None:
                self._tell_stopped(signum, children)
        except Exception:  # noqa: BLE001  (exiting anyway; say so)
            log.exception("Could not end the sweep's parent run %s", parent.run_id)
        return True

    # each job's process
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent is None:
            return  # a single run, or a dry-run sweep
        if self._launching_pid not in (None, os.getpid()):  # a job's own process
            stop.hold_in_worker(Path(config.hydra.sweep.dir), self._launching_pid)
        end_fluent_runs()
        gc.collect()  # the previous in-process job's model and optimizer
        count = gpu_count()
        if count > 1:  # one job per GPU: take a free one for this job
            self._gpu = claim_gpu(Path(config.hydra.sweep.dir), count)
            if self._gpu is None:
                log.warning(
                    "More parallel jobs than GPUs: this job shares GPU 0, so its timings "
                    "and memory figures are not comparable; set hydra.launcher.n_jobs=%d",
                    count,
                )
            else:
                import torch

                torch.cuda.set_device(self._gpu[0])

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if self.parent is None:
            return
        stop.job_ended()
        end_fluent_runs()
        if self._gpu is not None:
            self._gpu[1].close()
            self._gpu = None
        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()


def _open_store(config: DictConfig, sweep_dir: Path) -> tuple[Any, Any]:
    """(the sweep's tracker, the parent run of the sweep `resume=auto` continues or None): the
    store opened and reaped, and the folder refused where another sweep's records hold it.
    A refusal is told and exits 2."""
    from runner.tracking.trackers import open_tracker

    SweepParent.forget(sweep_dir)  # an earlier sweep's leftover must not adopt these jobs
    try:
        tracker = open_tracker(config, sweep_dir)
    except RunnerError as error:
        log.error("%s", error)
        raise SystemExit(2) from error
    tracker.reap()  # the experiment's RUNNING runs whose process is gone end KILLED
    earlier = None
    try:
        if resuming(config):
            earlier = earlier_sweep(tracker, sweep_dir, list(config.hydra.overrides.task))
        taken = tracker.folder_taken(sweep_dir, None if earlier is None else earlier.run_id)
        if taken is not None:  # (tracking=none: an earlier sweep's records are there)
            raise ConfigError(
                "hydra.sweep.dir",
                taken,
                "a folder of its own for this sweep (Hydra's default, named by the time); "
                "to continue that sweep, its own command with resume=auto",
            )
    except RunnerError as error:
        log.error("%s", error)
        raise SystemExit(2) from error
    return tracker, earlier


def _start_parent_run(
    tracker: Any, config: DictConfig, sweep_dir: Path, launcher: str, name: str, earlier: Any
) -> Any:
    """The parent run, tagged with the sweep's folder, overrides, launcher and command: a new
    one named `name`, or `earlier` reopened (resume=auto: the same parent goes on, with its
    children)."""
    import runner

    tags = {
        tag.SWEEP_DIR: str(sweep_dir.resolve()),
        tag.SWEEP_OVERRIDES: overrides_tag(config.hydra.overrides.task),
        tag.SWEEP_LAUNCHER: launcher.rsplit(".", 1)[-1],
        tag.RUNNER_VERSION: runner.__version__,
        tag.COMMAND: typed_command(),
        **tag.user_tags(config.mlflow.tags),
    }
    if earlier is None:
        return tracker.create_run(name[:MAX_RUN_NAME], tags)
    parent_run = tracker.reopen_run(earlier.run_id, {tag.COMMAND: tags[tag.COMMAND]})
    log.info(
        "Resuming the sweep of %s: its parent run %s (%s), finished jobs are kept",
        sweep_dir,
        earlier.run_name,
        earlier.run_id,
    )
    return parent_run


def _traces(reader: Any) -> Any:
    """A run's traces of steady step times, read from `reader` (runner.measure.step_trace)."""
    from runner.measure import step_trace

    return lambda run_id: step_trace.read_all(
        reader.artifact_texts(run_id, step_trace.ARTIFACT_DIR)
    )


def _failed(children: list[Any]) -> list[str]:
    """ "<run name> (#<job>): <its error>" for each of a sweep's `children` that did not
    finish."""
    from runner.tracking.base import FINISHED, RUNNING

    return [
        f"{c.run_name} (#{c.tags.get(tag.JOB_NUM, '?')}): {c.tags.get(tag.ERROR, c.status)}"
        for c in sorted(children, key=lambda c: int(c.tags.get(tag.JOB_NUM, 0)))
        if c.status not in (FINISHED, RUNNING)
    ]


def _hold_folder(sweep_dir: Path) -> HeldLock:
    """The lock on the sweep's folder for as long as the sweep runs: a second sweep started there
    meanwhile (the same command twice, a `resume=auto` while the sweep still runs) stops before
    it starts, instead of sharing its parent run and running its jobs a second time."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    held = try_lock(sweep_dir / FOLDER_LOCK)
    if held is None:
        other = SweepParent.load(sweep_dir)
        log.error(
            "%s",
            ConfigError(
                "hydra.sweep.dir",
                f"{sweep_dir} is in use by a sweep that is running"
                + (f" (its parent run {other.run_id})" if other is not None else ""),
                "wait for it to end (or stop it), or give this sweep a folder of its own",
            ),
        )
        raise SystemExit(2)
    return held


class LaunchScope:
    """The sweeps one CLI invocation launched: a sweep that stops early (Ctrl-C, a crash of the
    launcher) never reaches Hydra's end-of-sweep callback, so the CLI ends whatever parent run
    its sweeps left open (`close_open`). Each callback owns its parent; the scope only lists the
    callbacks, for the duration of the CLI call (`launch_scope`)."""

    def __init__(self) -> None:
        self._callbacks: list[MlflowSweepCallback] = []

    def adopt(self, callback: MlflowSweepCallback) -> None:
        self._callbacks.append(callback)

    def stopped_by(self) -> int | None:
        """The signal that stopped one of the sweeps while its jobs ran, if any."""
        return next((s for c in self._callbacks if (s := c.held_signal()) is not None), None)

    def close_open(self, status: str, reason: str, signum: int | None = None) -> bool:
        """End every parent still open: KILLED or FAILED, with the reason as its `error` tag
        (`signum`: the signal that stopped it). Whether any was open."""
        return any([callback.end_early(status, reason, signum) for callback in self._callbacks])


_SCOPE: contextvars.ContextVar[LaunchScope | None] = contextvars.ContextVar(
    "amp_runner_launch_scope", default=None
)


def stopped_sweep() -> int | None:
    """The signal that stopped a sweep of the CLI's scope while its jobs ran (see LaunchScope)."""
    scope = _SCOPE.get()
    return scope.stopped_by() if scope is not None else None


@contextlib.contextmanager
def launch_scope() -> Iterator[LaunchScope]:
    """The CLI's scope for the sweeps it launches (see `LaunchScope`); outside it (a sweep
    started through Hydra's API by other code) a sweep that stops early leaves its parent
    RUNNING, for the next start's reaping to end."""
    scope = LaunchScope()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
