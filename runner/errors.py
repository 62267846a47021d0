"""Errors a user can fix by changing the config; the CLI prints them without a traceback."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional


class RunnerError(Exception):
    """Base class: the message alone tells the user what to do."""


class ConfigError(RunnerError):
    """A config value is wrong: names the key, what was wrong, and what is allowed."""

    def __init__(self, key: str, problem: str, allowed: str | Iterable[str] | None = None):
        self.key = key
        self.problem = problem
        if allowed is not None and not isinstance(allowed, str):
            allowed = ", ".join(str(a) for a in allowed)
        self.allowed = allowed
        message = f"{key}: {problem}"
        if allowed:
            message += f" (allowed: {allowed})"
        super().__init__(message)

    def __reduce__(self):  # (pickled whole: an error crossing to another process)
        return type(self), (self.key, self.problem, self.allowed)


class DataError(RunnerError):
    """A dataset cannot be found or read; the message names the config key to change."""


class UnreadableFile(DataError):
    """A file of the dataset cannot be read as a sample (corrupted, truncated, not what it should
    be), met while training: the message names the file and what to do.

    Raised in a DataLoader worker, it reaches the training loop rebuilt by torch from its name and
    a message holding the worker's whole traceback; the message is cut back to this error's own
    (the traceback's last line), so the run still says one line."""

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class DivergenceError(RunnerError):
    """Training diverged: the loss stayed inf/NaN, or every step was skipped, for
    `trainer.max_bad_steps` consecutive steps; the message says which and at which step."""


class OutOfMemory(RunnerError):
    """The run does not fit its device's memory: the message says where it ran out, at which
    sizes, and what to change (runner.run.out_of_memory)."""


class CheckpointUnwritable(RunnerError):
    """A checkpoint could not be written (a full disk, its folder removed or made read-only while
    the run trained): the message names the file, the cause, the room left and what is kept."""


class WorkerKilled(RunnerError):
    """A DataLoader worker was ended by memory (the OOM killer, or shared memory run out) or by
    another process: the message says which and what to do (runner.run.out_of_memory)."""


class PeersLost(RunnerError):
    """A collective operation of a distributed run failed on this rank: most likely another rank
    ended or cannot be reached, and the run cannot go on without it. The message says the
    backend's error in a line and what is kept (runner.run.distributed.catch_lost_peers)."""


class LayerPlanError(RunnerError):
    """A layer ran in another format than its layer plan (or the level) says, with
    precision.strict=true: the message names each layer, what it ran in and what was planned."""


def chain(error: Optional[BaseException]) -> Iterator[BaseException]:
    """`error` and those it was raised from or during (`__cause__`, else `__context__`), latest
    first; each once, however they loop."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def said(error: BaseException) -> str:
    """An error in one line, as a store's is told: the database's own words where MLflow wraps
    SQLAlchemy's error (SQLite's "OperationalError: database or disk is full", not SQLAlchemy's
    note on autoflush, the statement, its parameters and a link), else the error's first
    line."""
    for link in chain(error):
        database = getattr(link, "orig", None)  # (sqlalchemy.exc.DBAPIError: the driver's error)
        if isinstance(database, BaseException):
            return f"{type(database).__name__}: {database}"
    lines = str(getattr(error, "message", None) or error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
