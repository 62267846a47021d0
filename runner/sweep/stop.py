"""Ctrl-C on a sweep whose jobs run in processes of their own on this machine (the joblib
launcher: `hydra/launcher=joblib` or `parallel`; submitit's local launcher): each job that runs
stops after its step with a checkpoint, no job starts after it, and the sweep ends KILLED with
the exit status of the signal (130 for Ctrl-C).

A terminal's Ctrl-C reaches the whole process group: the sweep's own process and the jobs'
processes at once. Left to Python's defaults, the sweep's process raised KeyboardInterrupt while
joblib waited for the jobs, and joblib, on that or on the first job that came back interrupted,
ended every other worker at once, before its checkpoint (their runs stayed RUNNING); a worker
without a job died of the signal, which broke joblib's pool; under submitit a job that came back
interrupted left no result, and the sweep ended FAILED with submitit's traceback. So:

- the sweep's process holds the first signal while the jobs run (`SweepStop`): it marks the sweep
  stopped in its folder (`SweepParent.stopped`: a job that starts after that does not run), and a
  moment later passes a SIGTERM on to the jobs' processes that hold their signals, for a signal
  sent to the sweep's process alone (a container's stop); a second Ctrl-C stops at once;
- each job's process holds its signals between jobs (`hold_in_worker`), and a job there that a
  signal stopped returns (its run KILLED, with its checkpoint) instead of raising, so that the
  launcher waits for the other jobs;
- the end of the sweep ends the parent run KILLED and exits as a run would.

A joblib worker that has not yet run a job cannot hold its signals: the sweep starts no more
workers than it has jobs (`cap_workers`), so each gets one within seconds of the start.

submitit's local launcher runs each job under a controller process of submitit's, which a
Ctrl-C ended with a traceback; ending, it killed its job (SIGKILL, a second after a SIGINT),
often before the job's checkpoint, and the sweep took the job's missing result for its end and
exited while the job was still running. The launcher's `setup` commands (submitit's own
parameter) run in the shell that starts the controller: `SUBMITIT_SETUP` there leaves the
controller deaf to Ctrl-C (`submitit_setup`), so it waits for its job as it does for one that
finishes.

A sweep's process killed outright (SIGKILL, the OOM killer) passes nothing on: each job's
process watches it (`_watch_sweep`), stops its job and exits when it is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from runner.run.interrupts import StopRequest

log = logging.getLogger(__name__)

WORKERS = ".amp-runner-workers"  # in the sweep's folder: one empty file per holding worker's pid
FORWARD_AFTER_S = 1.0  # a Ctrl-C reaches the workers itself within this; a SIGTERM follows

_worker: Optional[StopRequest] = None  # this process's hold, when it is a sweep's worker
_job_idle = threading.Event()  # (in a worker: cleared from a job's start to its end)
_job_idle.set()
ORPHAN_STOP_LIMIT_S = 600.0  # a job of a sweep that is gone: its time to stop before its exit
_watching: Optional[threading.Thread] = None  # (in a worker: `_watch_sweep`)


class SweepStop(StopRequest):
    """The sweep's own process while its jobs run in worker processes: the first SIGINT/SIGTERM
    calls `on_stop(signum)` (which marks the sweep stopped), says what happens, and after
    `FORWARD_AFTER_S` sends a SIGTERM to each worker process registered in `sweep_dir` (the
    workers that had the signal already keep their first one)."""

    watches = False  # (its main thread waits on the jobs: the handler says it at once)

    def __init__(self, sweep_dir: Path, on_stop: Callable[[int], None]) -> None:
        super().__init__()
        self._workers = Path(sweep_dir) / WORKERS
        self._on_stop = on_stop
        self._timer: Optional[threading.Timer] = None

    def _first(self, signum: int) -> None:
        self._on_stop(signum)
        log.warning(
            "%s received: the sweep stops; each running job stops after its step with a "
            "checkpoint, and no further job starts (Ctrl-C again to stop at once)",
            signal.Signals(signum).name,
        )
        self._timer = threading.Timer(FORWARD_AFTER_S, self.forward)
        self._timer.daemon = True
        self._timer.start()

    def handed_over(self) -> None:
        """(A job in this process took the signal over: the sweep stays stopped.)"""

    def forward(self) -> list[int]:
        """SIGTERM to each live job process that holds its signals; returns their pids."""
        sent = []
        for entry in sorted(self._workers.glob("*")) if self._workers.is_dir() else []:
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(ProcessLookupError):  # (its job has ended)
                    os.kill(int(entry.name), signal.SIGTERM)
                    sent.append(int(entry.name))
        return sent

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().__exit__(*exc)


class _WorkerHold(StopRequest):
    watches = False  # (between jobs: a job's run watches its own)

    def _first(self, signum: int) -> None:  # the sweep's process says what happens
        log.debug("%s received between sweep jobs", signal.Signals(signum).name)


def hold_in_worker(sweep_dir: Path, sweep_pid: Optional[int] = None) -> None:
    """In a process that runs a sweep's jobs (a joblib worker, a submitit job), at each job's
    start: the signals are held between jobs (a run's own request takes over one that came
    first), and the process is registered in `sweep_dir` for the sweep's process to pass its
    stop on to. With `sweep_pid`, the sweep's process, a thread watches it (`_watch_sweep`)."""
    global _worker, _watching
    if threading.current_thread() is not threading.main_thread():
        return
    if _worker is None:
        _worker = _WorkerHold().__enter__()
    folder = Path(sweep_dir) / WORKERS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(os.getpid())).touch()
    _job_idle.clear()
    if sweep_pid is not None and _watching is None:
        _watching = threading.Thread(
            target=_watch_sweep, args=(sweep_pid,), name="amp-runner-sweep-watch", daemon=True
        )
        _watching.start()


def requeue(signum: int) -> None:
    """In a job of submitit's stopped by its time-limit or preemption signal, once the run has
    its checkpoint: submitit's own handling of that signal, held until now, which requeues the
    job (the same job again: it continues that run, runner.sweep.jobs) and exits the process.
    Where submitit will not requeue (too many time-outs), the job ends as stopped."""
    handler = _worker.previous_handler(signum) if _worker is not None else None
    if callable(handler):
        try:
            handler(signum, None)
        except Exception as error:  # noqa: BLE001  (submitit's "not requeued because ...")
            log.warning("%s: resume=auto continues the run from its checkpoint", error)


def job_ended() -> None:
    """(In a worker: its job has returned.)"""
    _job_idle.set()


def _watch_sweep(pid: int, poll_s: float = 2.0) -> None:
    """A worker's watch on its sweep's process. Killed outright (SIGKILL, the OOM killer), that
    one ends nothing else: its workers trained on as orphans (a run then RUNNING in the store
    that `resume=auto` would start a second time beside it), and idled after their job, holding
    their memory (a GPU's too), for hours. So when it is gone, the job that
    runs here stops as on a SIGTERM (after its step, with its checkpoint, KILLED), and the
    process exits once no job runs (or after `ORPHAN_STOP_LIMIT_S`: a job that raised past its
    end, say)."""
    _wait_for_exit(pid, poll_s)
    if not _job_idle.is_set():
        log.warning(
            "The sweep's process (%d) is gone: this job stops after its step with a checkpoint "
            "(resume=auto goes on from it)",
            pid,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        _job_idle.wait(ORPHAN_STOP_LIMIT_S)
    logging.shutdown()
    os._exit(0)


def _wait_for_exit(pid: int, poll_s: float) -> None:
    """Returns once process `pid` has exited (a pidfd where the system has one: no mistaking a
    later process that reuses the number)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # (no pidfd: poll the number)
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(poll_s)
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def in_worker() -> bool:
    """Whether this process runs a sweep's jobs apart from the sweep's own process (its jobs
    return when interrupted)."""
    return _worker is not None


def forget_workers(sweep_dir: Path) -> None:
    """The workers' registrations in the sweep's folder (at its start: an earlier sweep's)."""
    folder = Path(sweep_dir) / WORKERS
    if folder.is_dir():
        for entry in folder.iterdir():
            entry.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # (a worker that registers at this moment)
            folder.rmdir()


# (a signal ignored stays ignored across exec, and Python keeps it so: the controller inherits
# the shell's SIG_IGN for SIGINT and sets its own SIGTERM handler, which passes SIGTERM on to its
# job; the shell itself must not die of a SIGTERM either, or the launcher takes the job for
# ended. A job's process sets its own handlers from its first job on: `hold_in_worker`.)
SUBMITIT_SETUP = "trap '' INT TERM"


def submitit_setup(setup: Optional[list[str]]) -> list[str]:
    """submitit's local launcher's `setup` commands for a sweep that stops on Ctrl-C: `setup`
    (the user's, if any) after `SUBMITIT_SETUP`."""
    setup = list(setup or [])
    return setup if SUBMITIT_SETUP in setup else [SUBMITIT_SETUP, *setup]


def cap_workers(n_jobs: Optional[int], jobs: Optional[int]) -> Optional[int]:
    """The number of worker processes for `jobs` jobs when the launcher's `n_jobs` asks for
    more (joblib starts them all at once, and one without a job dies of a Ctrl-C); None when it
    does not, or the count is not known before the sweep (an optimising sweeper)."""
    if not jobs or n_jobs is None:
        return None
    from joblib import effective_n_jobs

    return jobs if effective_n_jobs(n_jobs) > jobs else None
