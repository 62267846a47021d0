"""The MLflow store: where it is, opening it safely, and calls that survive its lock.

A SQLite store has one writer at a time. MLflow waits for the lock a while, but parallel sweep jobs
can still meet "database is locked"; every store call made here is retried on that error (an
asynchronous metric batch that failed on it is sent again), so concurrent writers lose nothing.
MLflow creates a new SQLite store's tables without any guard against a second process doing the
same, so the store is opened (created, if new) under a file lock beside the database
(`<database>.lock`): any number of runs may start at once against a store that does not exist yet.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from runner import shell
from runner.errors import RunnerError, said
from runner.files import LockBusy, file_lock

log = logging.getLogger(__name__)

MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 5000
LOCKED_RETRIES = 8
HEARTBEAT_S = 60.0  # mlflow.heartbeat_s's default
STALE_AFTER_S = 600.0  # mlflow.stale_after_s's default
STORE_LOCK_TIMEOUT_S = 120.0  # how long a start waits for another process creating the store
SQLITE = "sqlite:///"
FILE = "file:"  # a folder store (MLflow 3 refuses a new one unless told)
SQLITE_HEADER = b"SQLite format 3\x00"

T = TypeVar("T")


def is_database_locked(error: BaseException) -> bool:
    """SQLite's "database is locked", as MLflow reports it (directly or from its logging thread)."""
    return "database is locked" in str(error)


def retry_when_locked(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a store operation, retrying with a jittered backoff while another writer holds the
    SQLite lock. A failed write was rolled back, so retrying it cannot duplicate anything."""
    delay = 0.05
    for attempt in range(1, LOCKED_RETRIES + 1):
        try:
            return call(*args, **kwargs)
        except MlflowException as error:
            if attempt == LOCKED_RETRIES or not is_database_locked(error):
                raise
            log.warning(
                "MLflow store busy (database is locked), retry %d/%d in %.2f s",
                attempt,
                LOCKED_RETRIES - 1,
                delay,
            )
            time.sleep(delay * (1 + random.random()))
            delay = min(2 * delay, 2.0)
    raise AssertionError("unreachable")


def fail_fast_over_http(tracking_uri: str) -> None:
    """MLflow's own retries would block a call to a server that is away for minutes (7 retries,
    backing off to 2 minutes): the runner buffers and retries metrics itself, a server that does
    not answer at a run's start is an error at once, and the report and the replay say that it is
    away. So no HTTP retries and a 10 s timeout for this process, where the user set neither."""
    if tracking_uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class _ToldByTheCaller(logging.Filter):
    """MLflow logs every SQLAlchemy OperationalError of its SQL store at ERROR with the whole
    traceback (the statement and its parameters: a thousand metrics), then raises it. The
    runner tells each one itself, once and in a line (a busy store's retry, a store that does
    not take metrics, one it cannot end a run in): a full disk or a crowded sweep printed a
    screen of MLflow's traceback for every batch the store refused."""

    PREFIX = "SQLAlchemy database error"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIX)


_STORE_LOG = "mlflow.store.db.utils"  # (the module that logs them)


def quiet_store_errors() -> None:
    """Leave the store errors the runner tells itself to the runner (`_ToldByTheCaller`)."""
    logger = logging.getLogger(_STORE_LOG)
    if not any(isinstance(f, _ToldByTheCaller) for f in logger.filters):
        logger.addFilter(_ToldByTheCaller())


class RetryingClient:
    """An MlflowClient whose every call goes through `retry_when_locked`."""

    def __init__(self, tracking_uri: str):
        fail_fast_over_http(tracking_uri)
        quiet_store_errors()
        self._client = MlflowClient(tracking_uri)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute
        return functools.partial(retry_when_locked, attribute)


def resolve_tracking_uri(uri: str, base_dir: str | os.PathLike | None = None) -> str:
    """Make a relative SQLite URI absolute against the launch directory (Hydra does not chdir,
    but the printed `mlflow ui` command must work from anywhere); a leading `~` is the home, as
    in the runner's other paths (SQLAlchemy would make a folder named `~`). A relative file store
    (`file:./mlruns`, where MLflow still takes one) is made absolute as well."""
    prefix = SQLITE
    if uri.startswith(prefix + "~"):
        uri = prefix + os.path.expanduser(uri[len(prefix) :])
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = Path(base_dir or os.getcwd()) / uri[len(prefix) :]
        return prefix + str(path.resolve())
    if uri.startswith(FILE) and not uri.startswith(FILE + "/"):
        path = Path(base_dir or os.getcwd()) / os.path.expanduser(uri[len(FILE) :])
        return path.resolve().as_uri()
    return uri


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (resolved); None for any other store."""
    if not tracking_uri.startswith(SQLITE):
        return None
    return Path(tracking_uri[len(SQLITE) :].split("?", 1)[0])


@contextmanager
def store_lock(tracking_uri: str, timeout_s: float = STORE_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive, across processes, for a SQLite store: an advisory lock on `<database>.lock`
    beside the database (in an existing folder: see `prepare_sqlite_file`); nothing for other
    stores, whose server serialises its own schema work. Waits up to `timeout_s`, then raises
    RunnerError."""
    path = sqlite_path(tracking_uri)
    if path is None:
        yield
        return
    lock = path.with_name(path.name + ".lock")
    try:
        held = file_lock(lock, timeout_s=timeout_s)
    except LockBusy:
        raise RunnerError(
            f"mlflow.tracking_uri: the tracking store {tracking_uri!r} stayed locked "
            f"by another process for {timeout_s:.0f} s ({lock} is held: a process "
            "creating the store, or one that hangs). Find it with `fuser "
            f"{lock}`, or use another store."
        ) from None
    with held:
        yield


def prepare_sqlite_file(path: Path) -> None:
    """Create the database's folder (as MLflow would); raise OSError for a database path MLflow
    cannot use, at once (MLflow itself retries for about 100 s before it gives up on a file that
    is not a database or cannot be opened)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(
            f"cannot create the folder {path.parent} ({error.strerror}: {error.filename})"
        ) from error
    if path.exists() and not path.is_file():
        raise IsADirectoryError(f"{path} is not a file")
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                raise OSError(f"{path} is not an SQLite database")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(f"{path if path.exists() else path.parent} is not writable")


def startup_error(tracking_uri: str, error: BaseException) -> RunnerError:
    """What a store that cannot be used at the start is: the URI, the cause and a fix."""
    cause = said(error)
    path = sqlite_path(tracking_uri)
    if path is None and "MLFLOW_ALLOW_FILE_STORE" in cause:  # (a file store: MLflow says how)
        fix = "Use a database store (the default sqlite:///mlflow.db), or opt out as it says."
    elif path is None:
        fix = "Start the server, fix the URI, or use the default sqlite:///mlflow.db."
    elif is_database_locked(error):
        fix = (
            "Another process keeps the database locked: try again, or for many runs at once "
            "log to an MLflow server (mlflow server --backend-store-uri "
            f"{shell.word(tracking_uri)}, then mlflow.tracking_uri=http://host:5000)."
        )
    elif "out-of-date database schema" in cause:
        fix = "Upgrade the store as said above (a backup first), or use another store."
    else:
        fix = (
            f"Make sure the folder {path.parent} exists (or can be created), is writable and "
            "has room, and that the file is an MLflow database, or set mlflow.tracking_uri to "
            "another store."
        )
    return RunnerError(
        f"mlflow.tracking_uri: cannot use the tracking store {tracking_uri!r}: "
        f"{cause.strip().rstrip('.')}. {fix}"
    )


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: `mlartifacts/` beside a SQLite database (not
    MLflow's default, `./mlruns` in whatever folder a run was launched from); for a server or any
    other store, the store's own default (None)."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix):
        return (Path(tracking_uri[len(prefix) :]).parent / "mlartifacts").resolve().as_uri()
    return None


def ui_hint(tracking_uri: str, experiment_id: str) -> str:
    """The exact command and link that show this experiment's runs in the MLflow UI."""
    page = f"#/experiments/{experiment_id}/runs"
    if tracking_uri.startswith(("http://", "https://")):
        return f"Open {tracking_uri.rstrip('/')}/{page}"
    return (
        f"See the runs with:  mlflow ui --backend-store-uri {shell.word(tracking_uri)}\n"
        f"then open http://127.0.0.1:5000/{page}"
    )
