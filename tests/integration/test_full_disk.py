"""A disk that stops taking writes in the middle of a run (full, over quota): the run's files,
its record and its store each refuse, for real; and a console that is closed on the run (`|
head`). A write the kernel refuses here comes from
/dev/full (ENOSPC) or from a file size limit set on this process (`ulimit -f`: EFBIG, as
SQLite's and Python's writes see a full disk), lifted again at the end of each test.

Before: a full disk under the SQLite store printed MLflow's traceback (the statement and a
thousand metrics' parameters) for every batch it refused, Python's "--- Logging error ---" for
every line the job log missed, and ended in an "unexpected error" of the offline store's own
write (exit 1) in place of the run's error. Now each is a line, and the run's error is the one
told (runner.tracking)."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra.experimental.callback import Callback
from mlflow.tracking import MlflowClient

from runner.errors import RunnerError
from runner.tracking import job_log
from runner.tracking.json_file import FILE, JsonTracker
from runner.tracking.mlflow_run import MlflowRun
from runner.tracking.mlflow_tracker import MlflowTracker
from tests.helpers.runs import FAST, run_cli, run_in_process, start_cli


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """No file of this process grows past `limit` bytes while inside (a write past it fails
    with EFBIG; SIGXFSZ, which would kill the process, ignored meanwhile)."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)


def metrics(count: int) -> Iterator[tuple[dict[str, float], int]]:
    for step in range(1, count + 1):
        yield {"train_loss": 1.0 / step, "lr": 0.1}, step


# ---- the job log ---------------------------------------------------------------------------------
def test_a_log_file_the_disk_refuses_is_told_once_not_a_traceback_a_line(capfd):
    """Hydra's file handler on a full disk (/dev/full: every write ENOSPC). Python's default
    printed "--- Logging error ---" with a traceback and the record for every line logged."""
    root = logging.getLogger()
    handler = logging.FileHandler("/dev/full")
    root.addHandler(handler)
    try:
        job_log.tolerate_write_errors()
        job_log.tolerate_write_errors()  # (once: a second call changes nothing)
        said = logging.getLogger("runner.test_full_disk")
        for i in range(3):
            said.warning("line %d", i)
        told = capfd.readouterr().err
        assert told.count("Cannot write the log file /dev/full (No space left on device)") == 1
        assert "Logging error" not in told and "Traceback" not in told
        # an error that is not the file's (a log call's wrong arguments) is Python's report
        record = said.makeRecord(said.name, logging.WARNING, __file__, 0, "%d", ("x",), None)
        try:
            record.getMessage()
        except TypeError:
            handler.handleError(record)
        assert "--- Logging error ---" in capfd.readouterr().err
    finally:
        root.removeHandler(handler)
        with contextlib.suppress(OSError):  # (its last flush: as logging.shutdown does)
            handler.close()


def test_a_traceback_the_disk_refused_is_not_said_to_be_in_that_log(tmp_path, capfd):
    """An unexpected error's console lines end with where its full traceback is: they named a
    log file on a full disk, which kept none of it. Only a log that took it is named."""
    from runner.run import failure

    root = logging.getLogger()
    full, kept = logging.FileHandler("/dev/full"), logging.FileHandler(tmp_path / "runner.log")
    for handler in (full, kept):
        root.addHandler(handler)
    try:
        job_log.tolerate_write_errors()
        try:
            raise ValueError("a bug")
        except ValueError as error:
            failure.keep(error)
            said = failure.short_traceback(error)
        assert said.endswith(f"The full traceback: {tmp_path / 'runner.log'}"), said
        assert "ValueError: a bug" in (tmp_path / "runner.log").read_text()
        assert "Cannot write the log file /dev/full" in capfd.readouterr().err
    finally:
        for handler in (full, kept):
            root.removeHandler(handler)
            with contextlib.suppress(OSError):
                handler.close()


# ---- tracking=none: the run's record -------------------------------------------------------------
def test_a_record_the_disk_refuses_stays_in_memory_and_its_end_is_told(tmp_path, caplog):
    tracked = JsonTracker(tmp_path, "amp-runner").create_run("r", {}, tmp_path / "run")
    record = tmp_path / "run" / FILE
    caplog.set_level(logging.WARNING)
    with file_size_limit(record.stat().st_size):  # the record cannot grow
        for values, step in metrics(200):
            tracked.log_metrics(values, step)
        assert tracked.deliver() is False and tracked.deliver() is False
        tracked.log_text("x" * 100_000, "notes.txt")  # an artifact refused: told, not raised
        with pytest.raises(RunnerError) as ended:
            tracked.end("FAILED", "ValueError: the run's own")
    said = str(ended.value)
    assert said.startswith(f"tracking=none: cannot write the run's record {record} (File too")
    assert "without its final status FAILED and what the run logged since" in said
    assert caplog.text.count("Cannot write the run's record") == 1
    assert "Could not keep the artifact notes.txt" in caplog.text
    assert json.loads(record.read_text())["status"] == "RUNNING"  # as last written, whole
    # the disk takes it again: the next write has everything the run logged
    assert tracked.deliver() is True and "is written again" in caplog.text
    kept = json.loads(record.read_text())
    assert kept["status"] == "FAILED" and len(kept["metrics"]["train_loss"]) == 200


# ---- MLflow: the store and the offline store -----------------------------------------------------
@pytest.fixture
def quick_end(monkeypatch):
    monkeypatch.setattr(MlflowRun, "END_TIMEOUT_S", 1.0)


def test_a_store_and_an_offline_store_the_disk_refuses_end_in_one_error(
    tmp_path, quick_end, caplog
):
    """The SQLite store cannot grow: its writes fail (SQLite: "disk I/O error"), and the
    offline store, a new database, cannot be made either. The end names both, once each."""
    database = tmp_path / "mlflow.db"
    tracker = MlflowTracker(f"sqlite:///{database}", "amp-runner")
    tracked = tracker.create_run("r", {}, tmp_path / "run")
    caplog.set_level(logging.INFO)
    with file_size_limit(database.stat().st_size):
        for values, step in metrics(3000):
            tracked.log_metrics(values, step)
        assert tracked.flush(timeout=1) is False
        with pytest.raises(RunnerError) as ended:
            tracked.end("FINISHED")
    said = str(ended.value)
    assert said.startswith(f"the tracking store sqlite:///{database} did not take run ")
    assert "final status FINISHED (OperationalError: disk I/O error), and neither" in said
    assert f"the offline store in {tmp_path / 'run' / 'mlflow-offline'}" in said
    assert "until the next run of its experiment, which ends it KILLED" in said
    assert "\n" not in said
    # the store's refusal told once, in a line: not MLflow's traceback of every batch
    assert caplog.text.count("does not take metrics (OperationalError: disk I/O error)") == 1
    assert "SQLAlchemy database error" not in caplog.text and "Traceback" not in caplog.text
    assert tracker.client.get_run(tracked.run_id).info.status == "RUNNING"


def test_a_run_that_cannot_be_marked_failed_keeps_its_own_error(tmp_path, quick_end, caplog):
    """The run's error, not the store's refusal to take its end, is what goes on up (it was
    replaced by the offline store's OSError: an "unexpected error" in place of the run's)."""
    database = tmp_path / "mlflow.db"
    tracker = MlflowTracker(f"sqlite:///{database}", "amp-runner")
    full = contextlib.ExitStack()  # (the disk stays full until the run has been ended)
    with pytest.raises(ValueError, match="the run's own"), full:
        with tracker.start_run("r", {}, {}, folder=tmp_path / "run") as tracked:
            full.enter_context(file_size_limit(database.stat().st_size))
            for values, step in metrics(3000):
                tracked.log_metrics(values, step)
            raise ValueError("the run's own")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and said[0].startswith(f"Run 'r' ({tracked.run_id}) could not be marked")
    assert "FAILED: the tracking store" in said[0] and "neither did the offline store" in said[0]
    assert "marked FAILED.\n" not in caplog.text


# ---- a disk full before the run starts -----------------------------------------------------------
@pytest.mark.new_store
def test_a_new_store_on_a_full_disk_is_refused_in_one_line(tmp_path):
    """MLflow's message for it held the statement it failed on (a CREATE TABLE of 12 lines)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with file_size_limit(4096), pytest.raises(RunnerError) as refused:
        MlflowTracker(uri, "amp-runner")
    said = str(refused.value)
    assert said.startswith(f"mlflow.tracking_uri: cannot use the tracking store {uri!r}: ")
    assert "OperationalError: disk I/O error. Make sure the folder" in said, said
    assert "has room" in said and "\n" not in said


@pytest.mark.slow
@pytest.mark.new_store  # checks that nothing, no store, is created
def test_an_output_folder_on_a_full_disk_is_refused_naming_its_key(tmp_path):
    """Hydra's write of the job's config (`.hydra/config.yaml`) refused by the disk names no
    file: Hydra's report and traceback, exit 1. Now the output folder's key, exit 2."""
    result = run_cli(*FAST, cwd=tmp_path, file_limit=100, timeout=300)
    told = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in told, told[-3000:]
    assert "hydra.run.dir: the output folder outputs/" in told
    assert "cannot be made: File too large (allowed: a folder you can write" in told
    assert not (tmp_path / "mlflow.db").exists()


# ---- a sweep -------------------------------------------------------------------------------------
class DiskFullAtTheEnd(Callback):
    """A Hydra callback: the disk is full once the sweep's last job has ended (Hydra ends its
    callbacks in reverse order: this one, added after the runner's, before the runner's). The
    limit stays on until the test lifts it (`file_size_limit` of its own)."""

    def __init__(self, limit: int):
        self.limit = limit

    def on_multirun_end(self, config, **kwargs) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.RLIM_INFINITY))


def test_a_sweep_whose_parent_the_store_cannot_end_says_so_and_exits_1(tmp_path, capsys):
    """The parent's end refused by the store (a full disk) was a warning of Hydra's with MLflow's
    SQL in it, and the sweep exited 0 without its summary. Now: one line, the summary, exit 1."""
    target = f"{DiskFullAtTheEnd.__module__}.{DiskFullAtTheEnd.__qualname__}"
    with file_size_limit(resource.RLIM_INFINITY):  # (restores the limit the callback sets)
        status = run_in_process(
            "-m",
            *FAST,
            "trainer.max_epochs=1",
            "precision=o0,o1_bf16",
            f"+hydra.callbacks.disk_full._target_={target}",
            "+hydra.callbacks.disk_full.limit=512",  # (no page of the store can be written)
        )
    told = "".join(capsys.readouterr())
    assert status == 1, told[-3000:]
    assert "Sweep finished: 2 jobs, none failed." in told
    (line,) = [t for t in told.splitlines() if "The sweep's parent run" in t]
    assert "could not be marked FINISHED: " in line and "I/O error" in line, line
    assert "UserWarning" not in told and "[SQL:" not in told


# ---- the console closed ----------------------------------------------------------------------
def read_a_line_then_close(*args: str, cwd: Path, lines: int = 1) -> tuple[int, str]:
    """`python -m runner ARGS | head -1` (`lines`: 0, the reader gone before the first line):
    the pipe closed after that; the exit status and stderr."""
    proc = start_cli(*args, cwd=cwd, stderr_apart=True)
    for _ in range(lines):
        assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=300), err


@pytest.mark.slow
def test_a_run_whose_console_is_closed_goes_on_and_says_so_once(tmp_path):
    """`python -m runner ... | head`: Python's "--- Logging error ---" and a traceback for each
    of the run's later lines (14, 683 lines of stderr for a tiny run). Now one line; the run
    finishes, its lines in its job log."""
    status, err = read_a_line_then_close(*FAST, "tracking=none", cwd=tmp_path)
    assert status == 0, err[-3000:]
    assert err.count("Cannot write the log to <stdout> (Broken pipe): the run goes on; its") == 1
    assert "Logging error" not in err and "Traceback" not in err
    (log,) = tmp_path.glob("outputs/*/*/runner.log")
    assert "Finished tiny-O0" in log.read_text()


@pytest.mark.slow
def test_a_dry_run_read_in_part_ends_quietly(tmp_path):
    """`dry_run=true | head`: the print that met the closed pipe was an "unexpected error".
    (Its reader goes before its first line: the config fits in the pipe's buffer, and a close
    after a line could come after the whole of it.)"""
    status, err = read_a_line_then_close("model=tiny", "dry_run=true", cwd=tmp_path, lines=0)
    assert status == 1 and err == "", err[-3000:]


@pytest.mark.slow
def test_a_sweep_whose_console_is_closed_goes_on_and_says_so_once(tmp_path):
    """`python -m runner -m ... | head`: Hydra makes the sweep's log handlers anew before its
    jobs, for each job and after each, so the lines it logs itself ("Launching 2 jobs", each
    job's overrides, the sweep's summary) each printed "--- Logging error ---" and a traceback;
    each job said its own line. Now one line; both jobs finish."""
    args = ["-m", *FAST, "trainer.max_epochs=1", "precision=o0,o2_bf16"]
    status, err = read_a_line_then_close(*args, cwd=tmp_path)
    assert status == 0, err[-3000:]
    assert err.count("Cannot write the log to <stdout> (Broken pipe)") == 1, err[-3000:]
    assert "Logging error" not in err and "Traceback" not in err
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 3


@pytest.mark.parametrize(
    "option,status",
    [("--help", 1), ("--hydra-help", 1), ("--info", 0), ("--shell-completion install=bash", 1)],
)
def test_help_read_in_part_ends_quietly(option, status, tmp_path):
    """`python -m runner --help | head -1`: the print that met the closed pipe ended in a
    BrokenPipeError traceback (--info: a "--- Logging error ---" and a traceback a line). Its
    reader gone before the first line: a print ends the command (1, as `dry_run=true` does),
    Hydra's log lines of --info are let go."""
    result = run_cli(*option.split(), cwd=tmp_path, reader_gone=True)
    assert result.returncode == status and result.stderr == "", result.stderr[-3000:]
