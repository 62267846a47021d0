"""An unexpected error of a run (a bug, a user's model that raises): its full traceback kept where
it can be read later, the console told its last frames and where the full one is.

The runner's own errors (`RunnerError`: a bad config, a divergence) say in one line what to change
and keep no traceback. Any other exception is kept by `keep`: its full traceback goes to the log
files (the run's `runner.log`, Hydra's file handler; not the console) and, once the tracked run
exists, into the run as the artifact `traceback.txt` (MLflow's FAILED run, or the record of a
`tracking=none` run). `told` is what the console shows instead: the error, its last frames and
where the full traceback is. `record_errors` wraps a tracked run's body: an unexpected error is kept
before the run's log is attached, so that the attached `runner.log` holds the traceback too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from runner.errors import RunnerError
from runner.tracking import job_log

log = logging.getLogger(__name__)

ARTIFACT = "traceback.txt"  # the artifact of a FAILED run that holds its full traceback
LAST_FRAMES = 3  # the frames the console shows
_KEPT = "_runner_traceback_kept"  # set on an error once kept: where its traceback is


def full_traceback(error: BaseException, outer: Sequence[traceback.FrameSummary] = ()) -> str:
    """The traceback as Python prints it (chained exceptions included), below the `outer` frames
    (those the error has not unwound through yet, where it is caught on its way)."""
    report = traceback.TracebackException(type(error), error, error.__traceback__)
    inner = [f for f in report.stack if (f.filename, f.name) != (__file__, record_errors.__name__)]
    report.stack = traceback.StackSummary.from_list([*outer, *inner])
    return "".join(report.format())


def _frames_above(frame: Optional[FrameType]) -> list[traceback.FrameSummary]:
    """The frames above `frame` (contextlib's own skipped), outermost first."""
    while frame is not None and frame.f_code.co_filename == contextlib.__file__:
        frame = frame.f_back
    return list(traceback.extract_stack(frame.f_back)) if frame is not None else []


def keep(
    error: BaseException, tracked: Any = None, outer: Sequence[traceback.FrameSummary] = ()
) -> None:
    """Write `error`'s full traceback (below the `outer` frames) to the log files only (the
    console gets `told`) and, given the tracked run (`runner.tracking.base.Run`), as its artifact
    `traceback.txt`. Once per error: an error kept inside the run is not written again by the
    CLI."""
    if getattr(error, _KEPT, None) is not None:
        return
    text = full_traceback(error, outer)
    record = logging.LogRecord(
        log.name,
        logging.ERROR,
        __file__,
        0,
        "The run failed with an unexpected error; its full traceback:\n%s",
        (text.rstrip(),),
        None,
    )
    places = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            before = _size(handler.baseFilename)
            handler.handle(record)  # (flushed; a disk that is full keeps nothing: not named)
            if _size(handler.baseFilename) > before:
                places.append(str(handler.baseFilename))
    run_id = getattr(tracked, "run_id", None)
    if run_id is not None:
        try:
            tracked.log_text(text, ARTIFACT)
            places.append(f"the artifact {ARTIFACT} of the FAILED run {run_id}")
        except Exception as failure:  # noqa: BLE001  (the store failing too: the log keeps it)
            log.debug("The traceback could not be logged to run %s: %s", run_id, failure)
    setattr(error, _KEPT, places)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


_LIBRARIES = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")}
)


def _installed(filename: str) -> bool:
    """Whether a frame's file is Python's or an installed package's (not the user's own code)."""
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(_LIBRARIES)


def short_traceback(error: BaseException) -> str:
    """What the console shows of an unexpected error: its last frames (from the last one in the
    user's own code, that is outside Python's library and the installed packages, and at least
    `LAST_FRAMES`), the error and where the full traceback is (`keep`'s places)."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [i for i, f in enumerate(frames) if not _installed(f.filename)]
    start = min(own[-1], len(frames) - LAST_FRAMES) if own else len(frames) - LAST_FRAMES
    shown = frames[max(start, 0) :]
    of = f"the last {len(shown)} of {len(frames)} frames" if len(frames) > len(shown) else "frames"
    lines = [f"Traceback ({of}, most recent call last):"]
    lines += [line.rstrip("\n") for line in traceback.format_list(shown)]
    lines.append(f"{type(error).__name__}: {error}")
    places: Optional[list[str]] = getattr(error, _KEPT, None)
    if places:
        lines.append("The full traceback: " + " and ".join(places))
    else:
        lines.append("The full traceback: set HYDRA_FULL_ERROR=1 to print it")
    return "\n".join(lines)


@contextmanager
def record_errors(tracked: Any, run_log: Optional[os.PathLike], since: int = 0) -> Iterator[None]:
    """Around a tracked run's body: an unexpected error's traceback is kept (`keep`: the log
    files, the run's artifact), then, whatever happened, `run_log` (the job's `runner.log`;
    None: none), this launch's part of it from byte `since` on, is attached to the run under
    `logs/` (`attach_log`)."""
    try:
        yield
    except Exception as error:
        if not isinstance(error, RunnerError):
            # the error's traceback starts here (thrown into this generator): the frames above
            # the `with` come first (this generator's own is left out)
            keep(error, tracked, _frames_above(sys._getframe().f_back))
        raise
    finally:
        if run_log is not None:
            attach_log(tracked, Path(run_log), since)


def attach_log(tracked: Any, run_log: Path, since: int = 0) -> None:
    """The lines of this launch in `run_log` attached to the run under `logs/`: from byte
    `since` on (runs before it in the same folder, one the user names and runs in again, wrote
    theirs first; all of it where `since` is past the file's end: a file replaced meanwhile).
    A new run's as `runner.log`, a resumed run's as `runner.resume-<N>.log`, beside the ones
    of the sessions before it (it replaced them, and a resume in another folder lost them)."""
    if not run_log.is_file():
        return
    name = job_log.name(run_log, tracked.resumes)
    if run_log.stat().st_size < since:
        since = 0
    if since <= 0 and name == run_log.name:
        tracked.log_file(run_log, "logs")
        return
    tracked.log_text(job_log.part(run_log, since), f"logs/{name}")


def stopped_at_once(
    tracked: Any, run_log: Optional[os.PathLike], since: int, error: BaseException
) -> None:
    """A run stopped at once (a second signal while its loop is inside one long operation: the
    process ends now, without unwinding): its log attached as `record_errors` would, and its record
    ended KILLED with `error`'s words."""
    from runner.tracking.base import KILLED

    try:
        if run_log is not None:
            attach_log(tracked, Path(run_log), since)
    finally:
        tracked.end(KILLED, str(error))
