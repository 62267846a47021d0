"""`python -m runner ...`: the Hydra entry point. Heavy imports wait until the config is valid."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import runner.config  # noqa: F401  (registers the schemas before Hydra composes)
from runner.config.finder import config_dir
from runner.errors import RunnerError
from runner.sweep import callback, gpus, jobs, parent

log = logging.getLogger("runner")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep; returns the best validation accuracy (what an optimising
    sweeper such as Optuna maximises). A failing single run exits non-zero; a failing sweep job is
    recorded and, under Hydra's basic sweeper, returns NaN so that the sweep goes on; under any
    other sweeper it raises, so the sweeper sees a failed job (runner.sweep)."""
    hydra_cfg = HydraConfig.get()
    job = {"overrides": list(hydra_cfg.overrides.task), "output_dir": hydra_cfg.runtime.output_dir}
    sweep_parent = parent.job_parent()
    if sweep_parent is not None:
        return jobs.run_job(
            cfg,
            sweep_parent,
            job_num=int(hydra_cfg.job.num),
            sweeper=str(OmegaConf.select(hydra_cfg, "sweeper._target_") or ""),
            **job,
        )

    from runner.run.app import run

    try:
        return run(cfg, **job)
    except RunnerError as error:
        log.error("%s", error)
        sys.exit(2)


def cli() -> None:
    """Console-script entry (`amp-runner ...`); Ctrl-C exits 130 and SIGTERM 143 after the run
    (and a sweep's parent run) is marked KILLED (and, from a first signal, checkpointed); a sweep
    that stops early leaves no RUNNING parent behind."""
    gpus.register_resolvers()
    with callback.launch_scope() as launched:
        try:
            main()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM after its checkpoint
            launched.close_open("KILLED", str(interrupt) or "interrupted by the user (Ctrl-C)")
            print(
                f"Interrupted: {interrupt}" if str(interrupt) else "Interrupted.", file=sys.stderr
            )
            sys.exit(getattr(interrupt, "exit_code", 130))
        except SystemExit as stop:
            if stop.code not in (0, None):
                launched.close_open("FAILED", f"the sweep stopped early (exit status {stop.code})")
            raise


def process_main() -> None:
    """`python -m runner` and the `amp-runner` script: `cli`, then the process ends as soon as its
    work is done. Python's own exit, after the exit handlers, tears down every module and object
    one by one (torch's, MLflow's, SQLAlchemy's, pandas'): 2.1-2.5 s measured after a tiny run's
    last line, for nothing a run needs. So once `cli` has returned or exited, the threading
    module shuts down as at exit (its exit callbacks, then the join of the threads that are not
    daemons), the exit handlers run (logging's flush, multiprocessing's clean-up
    of child processes, MLflow's), stdout and stderr are flushed, and the process exits with the
    same status at once (`os._exit`). An exception other than SystemExit takes Python's normal
    path (its traceback). AMP_RUNNER_FULL_EXIT=1 keeps Python's full exit (leak checkers)."""
    if os.environ.get("AMP_RUNNER_FULL_EXIT") == "1":
        cli()
        return
    try:
        cli()
        status: object = 0
    except SystemExit as stop:
        status = stop.code
    # as Python's own exit does first: the threading module's exit callbacks (they tell a
    # process pool's manager thread, joblib's or concurrent.futures', to stop), then the join
    # of every thread that is not a daemon
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # (not CPython)
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    if status is None:
        status = 0
    elif not isinstance(status, int):  # sys.exit("message"): printed, status 1, as Python does
        print(status, file=sys.stderr)
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
                pass
        os._exit(status & 0xFF if status >= 0 else 1)


if __name__ == "__main__":
    process_main()
