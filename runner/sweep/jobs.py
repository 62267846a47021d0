"""Each job of a sweep run as a child run of the sweep's parent (`run_job`): a failure recorded
and counted, a job of a resumed sweep kept or continued (`runner.sweep.resume`). What the jobs
are: `runner.sweep.expansion`; what is checked before the first: `runner.sweep.preflight`."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from omegaconf import DictConfig

from runner.errors import RunnerError
from runner.sweep.expansion import BASIC_SWEEPER, job_label
from runner.sweep.parent import SweepParent
from runner.sweep.preflight import same_store
from runner.sweep.resume import resume_job, resuming
from runner.tracking import tags as tag

log = logging.getLogger(__name__)


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
    that finishes without a finite objective raises there too.

    In a process apart from the sweep's (a joblib worker, a submitit job: runner.sweep.stop), a
    job that starts after the sweep was stopped does not run, and one that a signal stopped (its
    run KILLED, with its checkpoint) is a failed job (NaN, or `SweepJobFailed`) rather than an
    interruption (joblib would end the other jobs' processes at once, submitit would find no
    result); the sweep's process ends the sweep."""
    from runner.run.app import run
    from runner.run.interrupts import RunInterrupted, preemption_signal, submitit_job
    from runner.run.plan import default_run_name
    from runner.sweep import stop

    tags = {tag.PARENT_RUN: parent.run_id, tag.JOB_NUM: str(job_num)}
    raises = bool(sweeper) and sweeper != BASIC_SWEEPER
    apart = job_label(overrides, parent.varying.split(), job_num, sweeper)
    if parent.stopped:
        return _not_run(
            f"job #{job_num} not started: the sweep was stopped ({parent.stopped})", raises
        )
    try:
        same_store(cfg, parent.tracker, parent.location, parent.experiment_name)
        requeue = not resuming(cfg) and submitit_job()
        if resuming(cfg) or requeue:
            done, cfg = resume_job(cfg, parent, job_num, requeue=requeue)
            if done is not None:
                return done
        best = run(cfg, overrides=overrides, output_dir=output_dir, extra_tags=tags, apart=apart)
    except RunInterrupted as interrupted:
        if not stop.in_worker():
            raise  # the sweep's own process: the sweep stops here
        if interrupted.signum == preemption_signal():
            stop.requeue(interrupted.signum)  # (exits, when submitit requeues the job)
        return _not_run(f"job #{job_num} stopped: {interrupted}", raises)
    except Exception as error:  # noqa: BLE001  (recorded and counted; the sweep goes on)
        if isinstance(error, RunnerError):
            log.error("Sweep job #%d failed: %s", job_num, error)
        else:
            from runner.run import failure

            failure.keep(error)  # (once: a run that existed has kept it already)
            log.error(
                "Sweep job #%d failed with an unexpected error.\n%s",
                job_num,
                failure.short_traceback(error),
            )
        try:
            tracker = parent.open()
            if not parent.children(tracker, job_num):
                tracker.record_failure(default_run_name(cfg, apart=apart), tags, error, output_dir)
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


def _not_run(what: str, raises: bool) -> float:
    """A job that a signal kept from its end: said, then NaN or (`raises`) `SweepJobFailed`."""
    log.warning("Sweep %s", what)
    if raises:
        raise SweepJobFailed(f"sweep {what}")
    return math.nan
