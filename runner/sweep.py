"""Hydra multirun -> one MLflow parent run, with every job of the sweep as its child run.

Hydra calls `MlflowSweepCallback` (registered under `hydra.callbacks` in conf/config.yaml) in the
launching process when a sweep starts and ends, and in the job's own process around each job; the
joblib launcher pickles the callback, parent run id included, into its worker processes.

- Sweep start: every job's config is checked (basic sweeper), then the store, the experiment and
  the parent run are created, all before the first job, so a bad value stops the sweep at once and
  parallel jobs never race to create the SQLite schema.
- Each job: a child run (tagged `mlflow.parentRunId`, which the MLflow UI nests by). The job finds
  its parent in the sweep's folder (`SweepParent`, written there while the parent is open), so
  it works the same for in-process jobs, joblib worker processes and SLURM jobs on other nodes.
  A failing job is recorded FAILED and, under Hydra's basic sweeper, returns NaN instead of
  raising, because Hydra 1.3's basic sweeper re-raises the first failure, stops the sweep and skips
  the end-of-sweep callback; under any other sweeper (Optuna) it raises, so the sweeper counts a
  failed trial (a NaN objective crashes Optuna's study).
- `resume=auto` on a sweep continues the sweep run before in the same folder (refused when its
  overrides differ): the same parent run, each job's earlier child kept (FINISHED), resumed from
  its checkpoint (KILLED, FAILED) or replaced (no checkpoint).
- Sweep end: the parent ends FINISHED with the number of failed children; the process exits 1 if
  any job failed. Ctrl-C or a crash of the sweep machinery ends the parent KILLED or FAILED
  (`LaunchScope`, held by the CLI).

Only light imports at module level, and nothing happens on import: Hydra instantiates this
callback for single runs too; the CLI registers the config resolver (`register_resolvers`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fcntl
import gc
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import ConfigError, RunnerError
from runner.tracking import tags as tag

log = logging.getLogger(__name__)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SUBMITIT_LOCAL_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
MAX_RUN_NAME = 200


@dataclass(frozen=True)
class SweepParent:
    """What a job needs to become a child run: where the parent lives and its id. Written into
    the sweep's folder while the parent run is open (`save`), read there by each job (`load`)."""

    tracking_uri: str
    experiment_name: str
    experiment_id: str
    run_id: str

    FILE = ".amp-runner-sweep.json"

    @classmethod
    def load(cls, sweep_dir: str | os.PathLike) -> SweepParent | None:
        """The open parent of the sweep in `sweep_dir`; None when there is none (a single run, a
        dry-run sweep, or a sweep that has ended)."""
        try:
            data = json.loads((Path(sweep_dir) / cls.FILE).read_text())
            return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls)})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, sweep_dir: str | os.PathLike) -> None:
        folder = Path(sweep_dir)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{self.FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(tmp, folder / self.FILE)  # a job never reads half a file

    @classmethod
    def forget(cls, sweep_dir: str | os.PathLike) -> None:
        (Path(sweep_dir) / cls.FILE).unlink(missing_ok=True)

    def children(self, tracker: Any, job_num: int | None = None) -> list[Any]:
        """The child runs of this parent in `tracker`'s store (those of job `job_num` only,
        when given), newest first."""
        where = f"tags.`{tag.PARENT_RUN}` = '{self.run_id}'"
        if job_num is not None:
            where += f" and tags.`{tag.JOB_NUM}` = '{job_num}'"
        return tracker.client.search_runs(
            [self.experiment_id], filter_string=where, order_by=["attributes.start_time DESC"]
        )


def job_parent() -> SweepParent | None:
    """The parent run of the Hydra job running in this process: the open parent of its sweep's
    folder; None outside a multirun (or for a dry-run sweep, which opens no parent)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return SweepParent.load(hydra_cfg.sweep.dir)


# ---- the jobs of a sweep -------------------------------------------------------------------------
def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's overrides, expanded as Hydra's basic sweeper will (`hydra.sweeper.params`, then
    the command line); None for another sweeper (Optuna, ...), whose jobs are known only later."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sweep_overrides(config: DictConfig) -> list[str]:
    """The overrides that make this a sweep (`precision=o0,o1`, `+experiment=...`), for naming."""
    arguments = list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [
        text
        for text, o in zip(arguments, parsed)
        if o.is_sweep_override() or o.get_key_element().lstrip("+~") == "experiment"
    ]


def preflight(config: DictConfig, config_name: str | None, tracking_uri: str) -> int | None:
    """Check every job's config before any job runs (ConfigError names the job and the key);
    returns the number of jobs, or None when the sweeper decides them as it goes."""
    from hydra import compose

    from runner.run.plan import make_plan

    jobs = sweep_jobs(config)
    if jobs is None:
        return None
    for number, overrides in enumerate(jobs):
        try:
            cfg = compose(config_name=config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:  # a typo'd key or option
            cause = f"\n{error.__cause__}" if error.__cause__ else ""
            raise RunnerError(
                f"sweep job #{number} ({' '.join(overrides)}): {error}{cause}"
            ) from error
        if _resuming(cfg):  # in a sweep, resume=auto is decided per job, at its start
            OmegaConf.set_struct(cfg, False)
            cfg.resume = None
        try:
            make_plan(cfg)
            same_store(cfg, tracking_uri, config.mlflow.experiment_name)
        except ConfigError as error:
            raise ConfigError(
                error.key,
                f"{error.problem} (in sweep job #{number}: {' '.join(overrides)})",
                error.allowed,
            ) from error
    return len(jobs)


def same_store(cfg: DictConfig, tracking_uri: str, experiment_name: str) -> None:
    """A child run must live beside its parent: the store and experiment cannot vary in a sweep."""
    from runner.tracking.store import resolve_tracking_uri

    if resolve_tracking_uri(cfg.mlflow.tracking_uri) != tracking_uri:
        raise ConfigError(
            "mlflow.tracking_uri",
            f"a sweep's jobs log to their parent run's store "
            f"{tracking_uri!r}, got {cfg.mlflow.tracking_uri!r}; it cannot be swept",
            "one value for the whole sweep",
        )
    if cfg.mlflow.experiment_name != experiment_name:
        raise ConfigError(
            "mlflow.experiment_name",
            f"a sweep's jobs log to their parent run's "
            f"experiment {experiment_name!r}, got {cfg.mlflow.experiment_name!r}; it "
            "cannot be swept",
            "one value for the whole sweep",
        )


def _resuming(config: DictConfig) -> bool:
    return str(OmegaConf.select(config, "resume") or "").strip().lower() == "auto"


def _sweep_tokens(overrides: Sequence[str]) -> set[str]:
    """The overrides that define a sweep (what `resume` is set to does not)."""
    return {o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith("resume")}


def earlier_sweep(tracker: Any, sweep_dir: Path, overrides: Sequence[str]) -> Any:
    """The parent run of the sweep run before in `sweep_dir` (the newest, if several), or None;
    a ConfigError when its overrides differ from `overrides` (naming what differs), since its
    finished jobs would not be this sweep's."""
    folder = str(Path(sweep_dir).resolve())
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`{tag.SWEEP_DIR}` = '{folder}'",
        order_by=["attributes.start_time DESC"],
    )
    if not runs:
        return None
    parent = runs[0]
    before = _sweep_tokens(parent.data.tags.get(tag.SWEEP_OVERRIDES, "").split())
    now = _sweep_tokens(overrides)
    if before != now:
        differs = [f"-{o}" for o in sorted(before - now)] + [f"+{o}" for o in sorted(now - before)]
        raise ConfigError(
            "resume",
            f"the sweep in {folder} (parent run {parent.info.run_id}) "
            f"was run with other overrides: {' '.join(differs)} (- then, + now); "
            "its finished jobs would not be this sweep's",
            f"the same overrides as then ({' '.join(sorted(before))}) with "
            "resume=auto, or another hydra.sweep.dir for a new sweep",
        )
    return parent


def _earlier_job(tracker: Any, parent: SweepParent, job_num: int) -> Any:
    """This job's child run from an earlier session of the same sweep, or None."""
    runs = parent.children(tracker, job_num)
    return runs[0] if runs else None


class SweepJobFailed(RuntimeError):
    """A sweep job failed (already recorded as a FAILED child run): what a sweeper other than
    Hydra's basic one receives as the job's error."""


def run_job(
    cfg: DictConfig,
    parent: SweepParent,
    *,
    overrides: Sequence[str],
    output_dir: str,
    job_num: int,
    sweeper: str = BASIC_SWEEPER,
) -> float:
    """One sweep job as a child run. A failure is logged and recorded as a FAILED child (also when
    it happened before the run existed). Under Hydra's basic sweeper it is then returned as NaN, so
    the sweep goes on (that sweeper stops at the first job that raises and skips the end-of-sweep
    callback). Under any other `sweeper` (Optuna's) it raises `SweepJobFailed`: the sweeper sees a
    failed job (Optuna tells the trial FAIL and counts it against
    `hydra.sweeper.max_failure_rate`), where a NaN objective would crash Optuna's study; a job
    that finishes without a finite objective raises there too."""
    from runner.run.app import run
    from runner.run.plan import default_run_name
    from runner.tracking.lifecycle import Tracker

    tags = {tag.PARENT_RUN: parent.run_id, tag.JOB_NUM: str(job_num)}
    raises = bool(sweeper) and sweeper != BASIC_SWEEPER
    try:
        same_store(cfg, parent.tracking_uri, parent.experiment_name)
        if _resuming(cfg):
            done, cfg = _resume_job(cfg, parent, job_num)
            if done is not None:
                return done
        best = run(cfg, overrides=overrides, output_dir=output_dir, extra_tags=tags)
    except Exception as error:  # noqa: BLE001  (recorded and counted; the sweep goes on)
        if isinstance(error, RunnerError):
            log.error("Sweep job #%d failed: %s", job_num, error)
        else:
            log.exception("Sweep job #%d failed", job_num)
        try:
            tracker = Tracker(parent.tracking_uri, parent.experiment_name)
            if not parent.children(tracker, job_num):
                tracker.record_failure(default_run_name(cfg), tags, error)
        except Exception:  # noqa: BLE001  (the store itself is failing: the log says so)
            log.exception("Could not record sweep job #%d's failure in MLflow", job_num)
        if raises:
            raise SweepJobFailed(
                f"sweep job #{job_num} failed: {type(error).__name__}: {error}"
            ) from error
        return math.nan
    if best is None or not math.isfinite(best):
        if raises:
            raise SweepJobFailed(
                f"sweep job #{job_num} finished without a finite objective "
                f"({best}): an optimising sweeper cannot use it"
            )
        return math.nan
    return best


def _resume_job(
    cfg: DictConfig, parent: SweepParent, job_num: int
) -> tuple[float | None, DictConfig]:
    """A job of a resumed sweep (`resume=auto`): (its objective, when its earlier run finished
    and is kept; else None, and the config to run it with). An earlier run that did not finish
    resumes from its checkpoint in the same MLflow run; one without a checkpoint is deleted and
    the job starts afresh (so the tree holds one child per job); a job that never ran starts
    afresh (not from another sweep's run of the same name)."""
    from runner.run import checkpoint
    from runner.tracking.lifecycle import Tracker

    tracker = Tracker(parent.tracking_uri, parent.experiment_name)
    earlier = _earlier_job(tracker, parent, job_num)
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.resume = None
    if earlier is None:
        return None, cfg
    if earlier.info.status == "FINISHED":
        metrics = earlier.data.metrics
        best = metrics.get("best_val_acc", metrics.get("best_val_loss"))
        log.info(
            "Sweep job #%d finished in an earlier session (run %s): kept, not run again",
            job_num,
            earlier.info.run_id,
        )
        return (math.nan if best is None else float(best)), cfg
    path = (
        checkpoint.run_folder(
            cfg.trainer.checkpoint_dir, cfg.mlflow.experiment_name, earlier.info.run_name
        )
        / earlier.info.run_id
        / checkpoint.FILENAME
    )
    if path.is_file():
        log.info(
            "Sweep job #%d resumes its run %s (%s) from %s",
            job_num,
            earlier.info.run_id,
            earlier.info.status,
            path,
        )
        cfg.resume = str(path)
    else:
        log.info(
            "Sweep job #%d: its run %s (%s) left no checkpoint: it starts again",
            job_num,
            earlier.info.run_id,
            earlier.info.status,
        )
        tracker.client.delete_run(earlier.info.run_id)
    return None, cfg


# ---- one GPU per job with the joblib launcher ----------------------------------------------------
def claim_gpu(lock_dir: Path, count: int) -> tuple[int, IO[str]] | None:
    """The first GPU index no other job of this sweep holds (an exclusive lock file per GPU in the
    sweep folder, released when the handle is closed); None when all are taken."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        handle = open(lock_dir / f".gpu{index}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return index, handle
    return None


def gpu_count() -> int:
    import torch  # here, not at import: single runs load this module too

    return torch.cuda.device_count()


def parallel_jobs() -> int:
    """`hydra/launcher=parallel`'s n_jobs: one job per GPU, one at a time without a GPU, so that
    no job's timings and peak memory are spoiled by a neighbour on the same device."""
    return max(1, gpu_count())


def register_resolvers() -> None:
    """The config resolvers the runner's config tree uses (`${runner.parallel_jobs:}` in
    conf/hydra/launcher/parallel.yaml); the CLI calls this before Hydra composes."""
    OmegaConf.register_new_resolver("runner.parallel_jobs", parallel_jobs, replace=True)


# ---- the callback --------------------------------------------------------------------------------
class MlflowSweepCallback(Callback):
    """Makes a Hydra multirun one MLflow parent run with a child run per job."""

    def __init__(self) -> None:
        self.parent: SweepParent | None = None
        self._parent_run: Any = None  # the launching process's open parent (a TrackedRun)
        self._sweep_dir: Path | None = None
        self._gpu: tuple[int, IO[str]] | None = None

    def __getstate__(self) -> dict:
        """What a launcher ships to its worker processes (joblib pickles the callback): the
        parent's address; the open run and a claimed GPU stay with the process that holds them."""
        return {**self.__dict__, "_parent_run": None, "_gpu": None}

    # launching process
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        SweepParent.forget(sweep_dir)  # an earlier sweep's leftover must not adopt these jobs
        if config.dry_run:
            return  # a dry run creates no run, in a sweep too
        import runner
        from runner.tracking.lifecycle import Tracker
        from runner.tracking.store import resolve_tracking_uri

        try:
            tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
            jobs = preflight(config, kwargs.get("config_name"), tracking_uri)
            tracker = Tracker.from_config(config.mlflow)
        except RunnerError as error:
            log.error("%s", error)
            raise SystemExit(2) from error
        tracker.reap()  # the experiment's RUNNING runs whose process is gone end KILLED
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
        self._warn_shared_device(config, launcher)
        earlier = None
        if _resuming(config):
            try:
                earlier = earlier_sweep(tracker, sweep_dir, list(config.hydra.overrides.task))
            except RunnerError as error:
                log.error("%s", error)
                raise SystemExit(2) from error
        name = config.mlflow.sweep_name or " ".join(["sweep", *sweep_overrides(config)])
        tags = {
            tag.SWEEP_DIR: str(sweep_dir.resolve()),
            tag.SWEEP_OVERRIDES: " ".join(config.hydra.overrides.task),
            tag.SWEEP_LAUNCHER: launcher.rsplit(".", 1)[-1],
            "runner_version": runner.__version__,
            tag.COMMAND: " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            **{str(k): str(v) for k, v in config.mlflow.tags.items()},
        }
        if earlier is not None:  # resume=auto: the same parent goes on, with its children
            self._parent_run = tracker.reopen_run(
                earlier.info.run_id, {tag.COMMAND: tags[tag.COMMAND]}
            )
            log.info(
                "Resuming the sweep of %s: its parent run %s (%s), finished jobs are kept",
                sweep_dir,
                earlier.info.run_name,
                earlier.info.run_id,
            )
        else:
            self._parent_run = tracker.create_run(name[:MAX_RUN_NAME], tags)
        self.parent = SweepParent(
            tracker.tracking_uri,
            config.mlflow.experiment_name,
            tracker.experiment_id,
            self._parent_run.run_id,
        )
        self.parent.save(sweep_dir)
        self._sweep_dir = sweep_dir
        scope = _SCOPE.get()
        if scope is not None:
            scope.adopt(self)
        count = "" if jobs is None else f" of {jobs} jobs"
        log.info(
            "Sweep%s: MLflow parent run %r (%s) in %s",
            count,
            name,
            self.parent.run_id,
            tracker.tracking_uri,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent is None or self._parent_run is None:
            return
        from mlflow.entities import RunStatus

        from runner.tracking.lifecycle import Tracker, end_state

        tracker = Tracker(self.parent.tracking_uri, self.parent.experiment_name)
        children = self.parent.children(tracker)
        failed = [c for c in children if c.info.status != "FINISHED"]
        parent, self._parent_run = self._parent_run, None
        SweepParent.forget(self._sweep_dir)
        parent.log_metrics({"jobs": len(children), "failed_jobs": len(failed)}, 0)
        parent.set_tag(
            tag.FAILED_JOBS,
            "; ".join(f"{c.info.run_name} ({end_state(c)})" for c in failed) or "none",
        )
        parent.end(RunStatus.to_string(RunStatus.FINISHED))
        failures = (
            f", {len(failed)} failed: "
            + ", ".join(f"{c.info.run_name} ({end_state(c)})" for c in failed)
            if failed
            else ", none failed"
        )
        log.info(
            "Sweep finished: %d jobs%s.\nCompare them:  python -m runner.report --tracking-uri %s "
            "--experiment %s --parent %s\n%s",
            len(children),
            failures,
            tracker.tracking_uri,
            self.parent.experiment_name,
            self.parent.run_id,
            tracker.hint(),
        )
        if failed:
            raise SystemExit(1)  # Hydra swallows a callback's exceptions, not SystemExit

    def end_early(self, status: str, reason: str) -> None:
        """End the parent run if the sweep stopped before `on_multirun_end` (see LaunchScope):
        its `error` tag is `reason` and, when jobs failed, which ones and why (a sweeper such as
        Optuna stops at a failed trial by its `max_failure_rate`)."""
        parent, self._parent_run = self._parent_run, None
        if parent is None:
            return
        if self._sweep_dir is not None:
            SweepParent.forget(self._sweep_dir)
        try:
            failed = self._failed_children()
            if failed:
                reason += "; failed: " + "; ".join(failed)
                parent.set_tag(tag.FAILED_JOBS, "; ".join(failed))
            parent.end(status, reason)
        except Exception:  # noqa: BLE001  (exiting anyway; say so)
            log.exception("Could not end the sweep's parent run %s", parent.run_id)

    def _failed_children(self) -> list[str]:
        """ "<run name> (#<job>): <its error>" for each child that did not finish."""
        from runner.tracking.lifecycle import Tracker

        if self.parent is None:
            return []
        tracker = Tracker(self.parent.tracking_uri, self.parent.experiment_name)
        children = self.parent.children(tracker)
        return [
            f"{c.info.run_name} (#{c.data.tags.get(tag.JOB_NUM, '?')}): "
            f"{c.data.tags.get(tag.ERROR, c.info.status)}"
            for c in sorted(children, key=lambda c: int(c.data.tags.get(tag.JOB_NUM, 0)))
            if c.info.status not in ("FINISHED", "RUNNING")
        ]

    # each job's process
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent is None:
            return  # a single run, or a dry-run sweep
        _end_fluent_runs()
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
        _end_fluent_runs()
        if self._gpu is not None:
            self._gpu[1].close()
            self._gpu = None
        if "torch" in sys.modules:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    @staticmethod
    def _warn_shared_device(config: DictConfig, launcher: str) -> None:
        """Parallel jobs on one device spoil each other's timings and memory figures."""
        if launcher == SUBMITIT_LOCAL_LAUNCHER:
            devices = max(1, gpu_count())
            log.warning(
                "submitit's local launcher starts the sweep's jobs at once, on this machine's %d "
                "device(s): jobs that share a device spoil each other's timings and peak memory. "
                "hydra/launcher=parallel runs one job per GPU (one at a time on a CPU); "
                "hydra/launcher=slurm spreads them over a cluster.",
                devices,
            )
            return
        if launcher != JOBLIB_LAUNCHER:
            return
        n_jobs = OmegaConf.select(config, "hydra.launcher.n_jobs")
        devices = max(1, gpu_count())
        if n_jobs is not None and (n_jobs < 0 or n_jobs > devices):
            log.warning(
                "hydra.launcher.n_jobs=%s runs more jobs at once than there are devices (%d): "
                "their timings and peak memory are not comparable. hydra/launcher=parallel runs "
                "one job per GPU (one at a time on a CPU).",
                n_jobs,
                devices,
            )


def _end_fluent_runs() -> None:
    """A job that left an MLflow fluent run active must not leak it into the next job."""
    if "mlflow" not in sys.modules:
        return
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


class LaunchScope:
    """The sweeps one CLI invocation launched: a sweep that stops early (Ctrl-C, a crash of the
    launcher) never reaches Hydra's end-of-sweep callback, so the CLI ends whatever parent run
    its sweeps left open (`close_open`). Each callback owns its parent; the scope only lists the
    callbacks, for the duration of the CLI call (`launch_scope`)."""

    def __init__(self) -> None:
        self._callbacks: list[MlflowSweepCallback] = []

    def adopt(self, callback: MlflowSweepCallback) -> None:
        self._callbacks.append(callback)

    def close_open(self, status: str, reason: str) -> None:
        """End every parent still open: KILLED or FAILED, with the reason as its `error` tag."""
        for callback in self._callbacks:
            callback.end_early(status, reason)


_SCOPE: contextvars.ContextVar[LaunchScope | None] = contextvars.ContextVar(
    "amp_runner_launch_scope", default=None
)


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
