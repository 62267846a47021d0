"""`python -m runner ...`: the Hydra entry point. Heavy imports wait until the config is valid."""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import runner
import runner.config  # noqa: F401  (registers the schemas before Hydra composes)
from runner import shell
from runner.config import mistakes
from runner.config.finder import config_dir
from runner.errors import PeersLost, RunnerError, said
from runner.run import interrupts
from runner.sweep import callback, expansion, gpus, jobs, parent
from runner.tracking import job_log, record

log = logging.getLogger("runner")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep; returns the best validation accuracy (what an optimising
    sweeper such as Optuna maximises). A failing single run exits non-zero; a failing sweep job is
    recorded and, under Hydra's basic sweeper, returns NaN so that the sweep goes on; under any
    other sweeper it raises, so the sweeper sees a failed job (runner.sweep)."""
    job_log.own_loggers_on()  # (hydra/job_logging=disabled: errors are still told)
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

    from runner.run import distributed
    from runner.run.app import run
    from runner.tracking.record import typed_command

    unswept = expansion.unswept(hydra_cfg, cfg, typed_command([sys.argv[0], "-m", *sys.argv[1:]]))
    if unswept and os.environ.get("RANK", "0") == "0":  # (under torchrun: said once)
        log.warning("%s", unswept)
    try:
        return run(cfg, **job)
    except BrokenPipeError:  # stdout closed by its reader (`dry_run=true | head`): no more to say
        shell.reader_gone()
        sys.exit(1)
    except RunnerError as error:
        _refusal(error, distributed.rank_label())
        if not isinstance(error, PeersLost):  # (torchrun's summary: the rank that failed first)
            distributed.tell_torchrun(str(error))
        sys.exit(2)
    except Exception as error:
        if _verbose():  # HYDRA_FULL_ERROR=1: Hydra prints the whole traceback
            raise
        from runner.run import failure

        failure.keep(error)  # (once: a run that existed has kept it already)
        log.error("The run failed with an unexpected error.\n%s", failure.short_traceback(error))
        distributed.tell_torchrun(f"The run failed with an unexpected error: {said(error)}")
        sys.exit(1)


def _refusal(error: RunnerError, label: str = "") -> None:
    """A run's refusal or stop (`RunnerError`: bad input the planner found, a divergence, out of
    memory) in the one format of every refusal: a plain line on stderr, as a config that does
    not compose is told (no logging prefix; `label`: a rank's, under torchrun), and the same
    line in the job log's file (runner.log), as an error."""
    message = f"{label}{error}"
    try:
        print(message, file=sys.stderr)
    except OSError:  # (stderr is gone: the job log still has it)
        pass
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (error,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


# ---- a config that does not compose: one line, exit 2 -------------------------------------------
def _verbose() -> bool:
    """HYDRA_FULL_ERROR=1: Hydra's own report (its stack trace and config search path)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _in_task(error: BaseException) -> bool:
    """Whether `error` came out of the task function (a run's own error, reported as before)."""
    task = main.__wrapped__.__code__  # (hydra.main wraps it with functools.wraps)
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code is task:
            return True
        frame = frame.tb_next
    return False


# Hydra's --shell-completion (-sc) takes one subcommand, for a shell it has a plugin for
COMPLETION = (
    "give one of install=SHELL, uninstall=SHELL or query=SHELL, SHELL one of bash, fish or zsh "
    '(e.g. eval "$(python -m runner --shell-completion install=bash)")'
)


def _completion_misused(error: BaseException) -> bool:
    """Hydra's refusal of `--shell-completion` without one subcommand, or for a shell it has
    no plugin for: a ValueError and its traceback, exit 1."""
    said = str(error)
    return isinstance(error, ValueError) and (
        said.startswith("Expecting one subcommand from") or "No completion plugin for" in said
    )


def _mistake(error: BaseException) -> bool:
    return not _verbose() and mistakes.is_composition_error(error) and not _in_task(error)


# Hydra's functions that make and write the output folders (hydra.core.utils.run_job and
# _save_config; the basic sweeper's and launcher's mkdir of the sweep's folder)
_HYDRA_WRITERS = ("run_job", "_save_config", "sweep", "launch")


def _output_folder_failure(error: BaseException) -> str | None:
    """The path of an OSError raised in Hydra's own code outside the task function, making or
    writing the run's output folder where it cannot (a file in the way, no rights, a read-only
    launch folder, a full disk); None for any other error. A write the disk refuses names no
    file: the path is then the output folder of the job Hydra was writing (`run_job`'s)."""
    if not isinstance(error, OSError) or _verbose() or _in_task(error):
        return None
    innermost, writing = None, None  # the last of Hydra's frames the error passed through
    frame = error.__traceback__
    while frame is not None:
        code = frame.tb_frame.f_code
        if f"{os.sep}hydra{os.sep}" in code.co_filename:
            innermost = code.co_name
            if writing is None and "output_dir" in frame.tb_frame.f_locals:
                writing = str(frame.tb_frame.f_locals["output_dir"])  # (run_job's: the job's)
        frame = frame.tb_next
    if innermost not in _HYDRA_WRITERS:
        return None
    return os.fsdecode(error.filename) if error.filename is not None else writing


def _refuse_output(error: OSError, failed: str) -> NoReturn:
    from runner.run.output_folder import cannot_create

    mode = "sweep" if any(a in ("-m", "--multirun") for a in sys.argv[1:]) else "run"
    print(cannot_create(mode, failed, error.strerror or type(error).__name__), file=sys.stderr)
    raise SystemExit(2) from None


def _refuse(error: BaseException) -> NoReturn:
    """Print the one-line explanation of a composition error and exit 2."""
    overrides = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    print(mistakes.explain(error, overrides), file=sys.stderr)
    raise SystemExit(2) from None


@contextlib.contextmanager
def mistakes_reported() -> Iterator[None]:
    """While Hydra runs the command: a config that does not compose (an unknown option of a group,
    an unknown key, a value of the wrong type) exits 2 with one line from
    `runner.config.mistakes` instead of Hydra's report (exit 1). Hydra hands each step of a
    command to `hydra._internal.utils.run_and_report`, which prints any error and exits 1; the
    step is wrapped here so that a composition error raised outside the task function is
    explained and exits 2 first. The error is Hydra's own, from its one composition: no second
    composition, nothing added on the happy path. Errors of a run, and every error under
    HYDRA_FULL_ERROR=1, take Hydra's path as before. `--help` and `--info` compose outside that
    reporter: their composition errors are caught as they leave Hydra.

    An error that ends a sweep a signal had stopped (an optimising sweeper raising on the jobs
    the stop failed) is that interruption, not Hydra's report: KILLED, exit 130 or 143."""
    from hydra._internal import utils

    from runner.run.interrupts import RunInterrupted

    reporter: Callable[[Callable[[], Any]], Any] = utils.run_and_report

    def report(func: Callable[[], Any]) -> Any:
        def composing() -> Any:
            try:
                return func()
            except Exception as error:
                signum = callback.stopped_sweep()
                if signum is not None:
                    raise RunInterrupted(signum) from error
                if isinstance(error, BrokenPipeError):  # (`-sc install=bash | head`: as --help)
                    shell.reader_gone()
                    raise SystemExit(1) from None
                failed = _output_folder_failure(error)
                if failed is not None:
                    _refuse_output(error, failed)
                if _completion_misused(error):
                    said = str(error).split(", available")[0].splitlines()[0]  # (one line)
                    print(f"--shell-completion: {said}; {COMPLETION}", file=sys.stderr)
                    raise SystemExit(2) from None
                if not _mistake(error):
                    raise
                _refuse(error)

        return reporter(composing)

    utils.run_and_report = report
    try:
        yield
    except Exception as error:
        if not _mistake(error):
            raise
        _refuse(error)
    finally:
        utils.run_and_report = reporter


# ---- --help: the groups a user picks from, and the launchers and sweepers installed -------------
INTERNAL_GROUPS = ("hydra", "schema")  # Hydra's own (launchers, sweepers: apart), the schemas


def _group_options(group: str) -> list[str]:
    from hydra.core.global_hydra import GlobalHydra

    return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def help_groups() -> str:
    """`--help`'s groups (`${runner.help_groups:}` in conf/config.yaml): each top-level group's
    options over the whole search path (a `--config-dir`'s own groups and options too), without
    Hydra's groups, the schemas, or an experiment's inner groups."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    lines = []
    for group in sorted(loader.list_groups("")):
        options = _group_options(group) if group not in INTERNAL_GROUPS else []
        if options:
            add = "   (add one: +experiment=NAME)" if group == "experiment" else ""
            lines.append(f"  {group}: {', '.join(options)}{add}")
    return "\n".join(lines)


def _installed(group: str) -> list[str]:
    """The options of a Hydra plugin group (hydra/launcher, hydra/sweeper) that can be picked: an
    option of the runner's own that extends a plugin's (parallel: joblib) only where that plugin
    is installed (its options are there)."""
    options = _group_options(group)
    usable = []
    for option in options:
        path = config_dir() / group / f"{option}.yaml"
        defaults = (OmegaConf.load(path).get("defaults") or []) if path.is_file() else []
        if all(d in options for d in defaults if isinstance(d, str) and d != "_self_"):
            usable.append(option)
    return usable


def help_launchers() -> str:
    """`--help`'s launchers and sweepers (`${runner.help_launchers:}`): the installed ones."""
    launchers, sweepers = _installed("hydra/launcher"), _installed("hydra/sweeper")
    lines = [
        f"  hydra/launcher: {', '.join(launchers)}   (basic: one job after another, here)",
        f"  hydra/sweeper: {', '.join(sweepers)}   (basic: every combination of the values)",
    ]
    examples = {
        "parallel": "-m hydra/launcher=parallel precision=o0,o1,o2,o3   (one job per GPU at once)",
        "slurm": "-m hydra/launcher=slurm hydra.launcher.partition=gpu precision=o2   (SLURM jobs)",
        "optuna": "-m hydra/sweeper=optuna hydra.sweeper.n_trials=20 "
        "hydra.sweeper.direction=maximize 'optimizer.lr=tag(log, interval(1e-4, 1e-1))'",
    }
    missing = {"parallel": "joblib", "slurm": "slurm", "optuna": "optuna"}
    for name, example in examples.items():
        if name in launchers or name in sweepers:
            lines.append(f"  python -m runner {example}")
        else:
            lines.append(f'  ({name}: pip install "amp-runner[{missing[name]}]")')
    return "\n".join(lines)


# `torchrun --nproc_per_node=N -m runner -m ...`: each rank ran the whole sweep on its own, the
# ranks meeting in one sweep folder (the second refused as "in use by a sweep that is running")
SWEEP_UNDER_TORCHRUN = (
    "-m (a sweep) under torchrun (WORLD_SIZE={world}): every rank would run the whole sweep on "
    "its own; run the sweep without torchrun (-m hydra/launcher=parallel runs a job per GPU; "
    "hydra/launcher=slurm with hydra.launcher.gpus_per_node for a job over several), or torchrun "
    "one run at a time"
)


# `-m ... --cfg job` (or --info): Hydra refused it with a ValueError traceback
FLAGS_TOGETHER = (
    "to see each job of a sweep, -m ... dry_run=true (every job's config, checked); --cfg job "
    "shows one job's config, without -m"
)


def overrides_together(argv: list[str]) -> list[str]:
    """`argv` (without the program) with its overrides in one group, first: Hydra's parser
    (argparse) takes the overrides as one positional group and refuses any after a flag
    (`python -m runner model=tiny -m precision=o0,o1` or `+experiment=mine --config-dir conf
    dry_run=true`: "unrecognized arguments: ..."; hydra#3053). Hydra's own parser decides which
    tokens are overrides, so an option's value (`--config-dir conf`) stays with its option. A
    command it refuses for another reason (an unknown flag, a bad choice) is left as it is:
    Hydra reports it."""
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            parsed, rest = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return argv
    if not rest or any(token.startswith("-") for token in rest):
        return argv
    others = list(argv)
    for token in reversed(rest):  # (the later group: from the end)
        del others[len(others) - 1 - others[::-1].index(token)]
    for token in parsed.overrides:  # (the first group: from the start)
        others.remove(token)
    return [*parsed.overrides, *rest, *others]


def cli() -> None:
    """Console-script entry (`amp-runner ...`); Ctrl-C exits 130 and SIGTERM 143 after the run
    (and a sweep's parent run) is marked KILLED (and, from a first signal, checkpointed); a sweep
    that stops early leaves no RUNNING parent behind."""
    if "--version" in sys.argv[1:]:  # (Hydra's own would print Hydra's version)
        print(runner.version_line())
        return
    if "--info" in sys.argv[1:]:  # (Hydra logs it to stdout: a reader gone says nothing)
        logging.raiseExceptions = False
    world = os.environ.get("WORLD_SIZE", "1")
    if any(a in ("-m", "--multirun") for a in sys.argv[1:]) and world.isdigit() and int(world) > 1:
        from runner.run.distributed import tell_torchrun

        message = SWEEP_UNDER_TORCHRUN.format(world=world)
        tell_torchrun(message)  # (its failure summary: each rank's own words)
        if os.environ.get("RANK", "0") == "0":  # (every rank stops; one says why)
            print(message, file=sys.stderr)
        sys.exit(2)
    record.keep_typed(sys.argv)  # (the `command` tag: as typed)
    sys.argv[1:] = overrides_together(sys.argv[1:])
    job_log.tolerate_write_errors()  # (`... | head`: one line, not a traceback a line logged)
    gpus.register_resolvers()
    OmegaConf.register_new_resolver("runner.help_groups", help_groups, replace=True)
    OmegaConf.register_new_resolver("runner.help_launchers", help_launchers, replace=True)
    with callback.launch_scope() as launched:
        try:
            with mistakes_reported(), interrupts.terminate_interrupts():
                main()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM after its checkpoint
            signum = getattr(interrupt, "signum", signal.SIGINT)
            reason = str(interrupt) or "interrupted by the user (Ctrl-C)"
            if not launched.close_open("KILLED", reason, signum):  # (a sweep's says its own)
                print(
                    f"Interrupted: {interrupt}" if str(interrupt) else "Interrupted.",
                    file=sys.stderr,
                )
            sys.exit(getattr(interrupt, "exit_code", 130))
        except BrokenPipeError:  # stdout's reader has gone (`--help | head`): nothing left to say
            shell.reader_gone()
            sys.exit(1)
        except ValueError as error:  # Hydra's check of its flags, before anything: one line
            if not str(error).startswith("Only one of --run, --multirun"):
                raise
            print(f"{error}: {FLAGS_TOGETHER}", file=sys.stderr)
            sys.exit(2)
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
