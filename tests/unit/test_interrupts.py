"""Signals, as the process gets them (os.kill on itself): a run's stop request keeps the first
signal, a run takes over one that its sweep worker held between jobs, and a sweep's process
passes its stop on to the worker processes that hold their signals (runner.sweep.stop)."""

from __future__ import annotations

import math
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from runner.run.interrupts import RunInterrupted, StopRequest, holding, terminate_interrupts
from runner.sweep import stop
from runner.sweep.jobs import run_job
from runner.sweep.parent import SweepParent
from runner.sweep.stop import FORWARD_AFTER_S


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # (Python runs the handler between bytecodes of the main thread)


def test_the_first_signal_stands_and_a_second_ctrl_c_stops_at_once():
    """A SIGTERM after a Ctrl-C is what a sweep's process passes on to a job that had the
    terminal's Ctrl-C already: it must neither replace the first signal (the exit status) nor
    count as the second Ctrl-C."""
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as request:
        assert holding() is request
        _signal_self(signal.SIGINT)
        assert request.signum == signal.SIGINT
        _signal_self(signal.SIGTERM)
        assert request.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before and holding() is None


def test_a_sigterm_outside_a_run_interrupts_unless_it_was_ignored():
    """Outside a run's loop a SIGTERM raises as Ctrl-C does (exit 143 at the entry point) where it
    would end the process unsaid; a run's stop request takes it over while it trains; an ignored
    SIGTERM (submitit's job controllers) stays ignored."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with terminate_interrupts():
            with pytest.raises(RunInterrupted) as raised:
                _signal_self(signal.SIGTERM)
            assert raised.value.exit_code == 143 and str(raised.value) == "interrupted by SIGTERM"
            with StopRequest() as request:
                _signal_self(signal.SIGTERM)
                assert request.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with terminate_interrupts():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_in_a_submitit_job_its_time_limit_signal_stops_the_run_too(monkeypatch):
    """submitit's time-limit and preemption signal (SIGUSR2) is held like SIGTERM in its jobs,
    its own handler kept for the requeue; elsewhere it is left alone."""
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))  # (submitit's, here)
    try:
        with StopRequest():
            _signal_self(signal.SIGUSR2)
        assert seen == [signal.SIGUSR2]  # not a submitit job: the handler before stands
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        with StopRequest() as run:
            _signal_self(signal.SIGUSR2)
            assert run.signum == signal.SIGUSR2 and seen == [signal.SIGUSR2]
            _signal_self(signal.SIGTERM)  # (the first signal stands)
            assert run.signum == signal.SIGUSR2
            handler = run.previous_handler(signal.SIGUSR2)
        assert callable(handler) and signal.getsignal(signal.SIGUSR2) is handler
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_run_takes_over_a_signal_held_before_it_started():
    with StopRequest() as worker:
        _signal_self(signal.SIGTERM)
        with StopRequest() as run:
            assert run.signum == signal.SIGTERM and worker.signum is None
        assert holding() is worker
        with StopRequest() as next_run:  # the signal stopped one run, not every later one
            assert next_run.signum is None


def _wait_for_sigterm(ready) -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(15))
    ready.set()
    time.sleep(60)
    os._exit(0)


def test_the_sweep_passes_its_stop_on_to_registered_workers_only(tmp_path):
    """Only the worker processes that hold their signals get the SIGTERM: a worker that has not
    run a job yet would die of it and break joblib's pool."""
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event(), ctx.Event()]
    workers = [ctx.Process(target=_wait_for_sigterm, args=(e,), daemon=True) for e in events]
    for worker, ready in zip(workers, events):
        worker.start()
        assert ready.wait(30)
    registered, other = workers
    folder = tmp_path / stop.WORKERS
    folder.mkdir()
    (folder / str(registered.pid)).touch()
    try:
        assert stop.SweepStop(tmp_path, lambda s: None).forward() == [registered.pid]
        registered.join(30)
        assert registered.exitcode == 15 and other.is_alive()
    finally:
        other.kill()
        other.join(30)
    stop.forget_workers(tmp_path)
    assert not folder.exists()


def _worker_of(sweep_pid: int, sweep_dir, job: bool, stopped) -> None:
    """A forked sweep worker: with `job`, one whose job runs until a signal stops it; then idle,
    as a joblib worker waits for its next job."""
    stop.hold_in_worker(sweep_dir, sweep_pid)
    if job:
        with StopRequest() as run:
            while not run.requested:
                time.sleep(0.01)
            stopped.set()
    stop.job_ended()
    time.sleep(60)
    os._exit(1)


@pytest.mark.parametrize("job", [False, True], ids=["idle", "running a job"])
def test_a_worker_whose_sweep_is_gone_stops_its_job_and_exits(tmp_path, job):
    """The sweep's process killed outright: its worker's job stops as on a SIGTERM, and the
    worker exits; an idle one exits at once (they trained on and idled as orphans)."""
    ctx = multiprocessing.get_context("fork")
    sweep = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    sweep.start()
    stopped = ctx.Event()
    worker = ctx.Process(target=_worker_of, args=(sweep.pid, tmp_path, job, stopped), daemon=True)
    worker.start()
    try:
        time.sleep(1)  # (the worker's job runs)
        assert worker.is_alive() and not stopped.is_set()
        sweep.kill()
        worker.join(30)
        assert worker.exitcode == 0 and stopped.is_set() == job
    finally:
        for process in (sweep, worker):
            process.kill()
            process.join(30)


def test_a_job_in_the_sweeps_own_process_leaves_the_sweep_stopped(tmp_path):
    """(joblib runs the jobs in the sweep's process when it has one worker): a job that takes
    over the sweep's signal stops, and the sweep stays stopped."""
    with stop.SweepStop(tmp_path, lambda s: None) as sweep:
        sweep.signum = signal.SIGINT  # as its handler sets it
        with StopRequest() as run:
            assert run.signum == signal.SIGINT
        assert sweep.signum == signal.SIGINT


def test_the_sweeps_first_signal_marks_it_stopped_and_the_second_stops_at_once(tmp_path):
    marked = []
    with stop.SweepStop(tmp_path, marked.append) as sweep:
        _signal_self(signal.SIGINT)
        assert marked == [signal.SIGINT] and sweep.signum == signal.SIGINT
        assert sweep._timer is not None and sweep._timer.daemon
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGINT)
    sweep._timer.join(FORWARD_AFTER_S / 2)  # cancelled with the sweep's end: done at once
    assert not sweep._timer.is_alive()


@pytest.mark.parametrize(
    ("n_jobs", "jobs", "cap"),
    [(4, 2, 2), (2, 2, None), (1, 3, None), (-1, 1000, None), (None, 2, None), (4, None, None)],
)
def test_a_sweep_starts_no_more_workers_than_jobs(n_jobs, jobs, cap):
    assert stop.cap_workers(n_jobs, jobs) == cap


def test_submitits_job_controllers_start_deaf_to_ctrl_c():
    """submitit's local launcher runs its `setup` commands and then its job's controller in one
    shell: the controller starts with SIGINT and SIGTERM ignored (Python keeps an inherited
    SIG_IGN), after the user's own setup, which still runs."""
    setup = stop.submitit_setup(["export AMP_PROBE=1"])
    assert stop.submitit_setup(setup) == setup  # (once, for a config that has it already)
    probe = (
        "import os, signal as s; "
        "print(s.getsignal(s.SIGINT), s.getsignal(s.SIGTERM), os.environ['AMP_PROBE'])"
    )
    command = " && ".join([*setup, shlex.join([sys.executable, "-c", probe])])
    done = subprocess.run(command, shell=True, capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(signal.SIG_IGN), str(signal.SIG_IGN), "1"]


def test_a_job_of_a_stopped_sweep_does_not_start(tmp_path, caplog):
    parent = SweepParent("mlflow", "sqlite:///nowhere/x.db", "e", "1", "abc", stopped="SIGINT")
    parent.save(tmp_path)
    assert SweepParent.load(tmp_path).stopped == "SIGINT"
    value = run_job(OmegaConf.create({}), parent, overrides=[], output_dir=str(tmp_path), job_num=3)
    assert math.isnan(value)
    assert "Sweep job #3 not started: the sweep was stopped (SIGINT)" in caplog.text
    assert not (tmp_path / "nowhere").exists()
