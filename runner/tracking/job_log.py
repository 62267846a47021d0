"""A run's job log (Hydra's `<output dir>/runner.log`): the part one launch wrote, the name it is
attached under, and what lets the next run attach the log of a run whose process died.

A run attaches its own log as it ends (runner.run.failure.attach_log). A process killed outright
(SIGKILL, the OOM killer) cannot: its lines stay on disk, and the run the reaper ends KILLED would
hold none. So every run records, as tags, which file its session writes and where its lines begin
(`tags`); the reaper on the same host attaches that part (`of_vanished`). The file must still be
the one the run wrote (its first line, timed to the millisecond, where the tags say): a folder
cleaned and run in again holds another run's log. And it must be a job log at all: the tags come
from the store, which other people may write, and a path there is not trusted to name a file for
the reaper to upload.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from runner.tracking import tags as tag
from runner.tracking.liveness import ProcessIdentity

TAGS = (tag.LOG_FILE, tag.LOG_FROM, tag.LOG_HEAD)
HEAD_BYTES = 4096  # the most of a session's first line that `head` reads


def find(output_dir: Optional[os.PathLike]) -> Optional[Path]:
    """The log file the root logger writes in `output_dir` (Hydra's job log, named after
    `hydra.job.name`: runner.log by default); None where it writes none there (logging
    turned off, a run started from Python)."""
    if output_dir is None:
        return None
    folder = Path(output_dir).resolve()
    files = [
        Path(h.baseFilename)
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler)
    ]
    return next((f for f in files if f.resolve().parent == folder), None)


def own_loggers_on() -> None:
    """Hydra's `disabled` logging presets (`hydra/job_logging`, `hydra/hydra_logging`) set the
    root level to ERROR and disable every logger that exists as they are applied
    (`disable_existing_loggers`): the runner's among them, so a refused run or sweep exited 2
    without a word (the refusal is logged). Its loggers are enabled again; the levels stay the
    user's (those presets show errors only, on stderr)."""
    for name, logger in logging.root.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and (name == "runner" or name.startswith("runner.")):
            logger.disabled = False


def tolerate_write_errors() -> None:
    """A log stream that stops taking lines is told once on stderr, not by Python's "---
    Logging error ---" and a traceback for every line logged from then on, and the run goes on:
    a log file on a disk that filled (its lines still reach the console; the file takes them
    again once it can), or the console itself closed (`python -m runner ... | head`: a broken
    pipe; the lines are in the job log). An error that is not the stream's (a log call with
    wrong arguments) is reported as Python reports it. For every stream handler of the process:
    Hydra makes its handlers anew for a sweep, for each of its jobs and after each, so they are
    borne by their class (`logging.StreamHandler`, a file's handler's too); told once a stream
    (a sweep and its jobs write to the one console through handlers of their own). Where
    `logging.raiseExceptions` is off, nothing is told, as Python's own handler does."""
    if getattr(logging.StreamHandler.handleError, _BORNE, False):
        return
    report = logging.StreamHandler.handleError

    def handle_error(handler: logging.StreamHandler, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            report(handler, record)
            return
        if not logging.raiseExceptions or _reported_before(handler):
            return
        reason = error.strerror or str(error)
        if isinstance(handler, logging.FileHandler):
            said = (
                f"Cannot write the log file {handler.baseFilename} ({reason}): the lines it "
                "misses are on the console only"
            )
        else:
            stream = getattr(handler.stream, "name", "the console")
            said = f"Cannot write the log to {stream} ({reason}): the run goes on; its lines "
            said += "are in its job log" if _has_file() else "are not kept"
        try:
            sys.stderr.write(said + "\n")
        except OSError:  # (stderr is the stream that is gone)
            pass

    setattr(handle_error, _BORNE, True)
    logging.StreamHandler.handleError = handle_error  # type: ignore[method-assign]


_BORNE = "_runner_write_errors_borne"
_reported: weakref.WeakSet[Any] = weakref.WeakSet()  # the streams whose write error was told


def _reported_before(handler: logging.StreamHandler) -> bool:
    """Whether a write error of `handler`'s stream was told (and, from now on, that it was)."""
    try:
        if handler.stream in _reported:
            return True
        _reported.add(handler.stream)
    except TypeError:  # (a stream that takes no weak reference: told once by this handler)
        if getattr(handler, _BORNE, False):
            return True
        setattr(handler, _BORNE, True)
    return False


def _has_file() -> bool:
    return any(isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers)


def name(run_log: Path, resumes: int) -> str:
    """The artifact name of a session's log: `runner.log` for a new run, `runner.resume-<N>.log`
    for its N-th resumed session (beside the ones before it)."""
    if not resumes:
        return run_log.name
    return f"{run_log.stem}.resume-{resumes}{run_log.suffix}"


def part(run_log: Path, since: int = 0, until: Optional[int] = None) -> str:
    """The text of `run_log` from byte `since` up to byte `until` (None: its end)."""
    with run_log.open("rb") as file:
        file.seek(since)
        data = file.read() if until is None else file.read(max(until - since, 0))
    return data.decode("utf-8", errors="replace")


def size(run_log: Optional[Path]) -> int:
    """The size of the log file at `run_log` in bytes: where a launch's lines will begin; 0 where
    there is none."""
    try:
        return run_log.stat().st_size if run_log is not None else 0
    except OSError:
        return 0


def head(run_log: Optional[Path], since: int) -> Optional[str]:
    """A digest of the first line of `run_log` from byte `since` (a session's first line: its
    time to the millisecond), by which a reaper knows the file is still the one the session
    wrote; None before that line is there."""
    if run_log is None:
        return None
    try:
        with run_log.open("rb") as file:
            file.seek(since)
            line = file.readline(HEAD_BYTES)
    except OSError:
        return None
    return hashlib.sha256(line).hexdigest()[:16] if line.endswith(b"\n") else None


def tags(run_log: Optional[Path], since: int, first_line: Optional[str]) -> dict[str, str]:
    """The tags that tell a reaper where a session's lines are: the log's absolute path, the
    byte they begin at and the digest of their first line (`head`). None without a log (logging
    off, a run started from Python) or before its first line."""
    if run_log is None or first_line is None:
        return {}
    return {
        tag.LOG_FILE: str(run_log.resolve()),
        tag.LOG_FROM: str(since),
        tag.LOG_HEAD: first_line,
    }


def is_job_log(path: Path) -> bool:
    """Whether `path` can be a run's job log: an absolute path to a regular `.log` file, not a
    link, in a Hydra output folder (beside its `.hydra/`). A store's tags are not trusted to
    name a file for the reaper to upload (a secret whose first line is known, a link to one)."""
    return (
        path.is_absolute()
        and path.suffix == ".log"
        and not path.is_symlink()
        and path.is_file()
        and (path.parent / ".hydra").is_dir()
    )


def of_vanished(
    run_tags: Mapping[str, str],
    here: ProcessIdentity,
    own: Optional[tuple[Path, int]] = None,
) -> Optional[tuple[str, str]]:
    """(artifact name, text) of the log a run whose process vanished wrote, or None where it
    cannot be told for sure: no log tags, another host (its path names a file there: the tag says
    where), a file gone or replaced (its first line is not where and what the tags say), or one
    that is not a job log (`is_job_log`).
    `own`: the reaper's own job log and where its lines begin; the part ends there when the run
    wrote into the same file (a folder named outright and run in again)."""
    owner = ProcessIdentity.from_tags(run_tags)
    path, since, first_line = (run_tags.get(k, "") for k in TAGS)
    if owner is None or owner.host != here.host or not path or not since.isdigit():
        return None
    run_log, since_byte = Path(path), int(since)
    if not is_job_log(run_log) or head(run_log, since_byte) != first_line:
        return None
    until = None
    if own is not None:
        own_log, own_from = own
        try:
            if os.path.samefile(own_log, run_log) and own_from >= since_byte:
                until = own_from
        except OSError:
            pass
    count = run_tags.get(tag.RESUME_COUNT, "0")
    resumes = int(count) if count.isdigit() else 0
    return name(run_log, resumes), part(run_log, since_byte, until)
