"""The bottom floor for writing files safely: atomic replace-writes and file locks, used by every
writer of the runner (checkpoints, the token cache, the kernels' build folders, tracking records,
a sweep's parent file, plan files, the SQLite store's lock, a sweep job's GPU).

**Atomic replace-writes.** `atomic_write(path)` (a file handle) and `atomic_path(path)` (a path,
for a writer that opens the file itself: torch.save, a tokeniser) write beside `path`, to
`.<name>.<pid>.<thread>.tmp` in the same folder (so the rename never crosses a filesystem); on a
clean exit the file is flushed to disk and moved over `path` with `os.replace`, and the folder's
entry flushed too, so a reader sees the old file or the new one, never half of one, even after a
crash or a power loss. On an error the temporary file is removed and `path` is left as it was.
A process killed while writing leaves its temporary file: `remove_stale_temporaries` removes those
of processes that no longer exist.

**File locks.** `file_lock(path)` takes an exclusive lock on a lock file, waiting for it (for a
with-block, or until released); `try_lock(path)` takes it only if it is free. Both are advisory
`flock` locks on the open file: the kernel releases them when the holder exits however it exits,
so a lock file left behind by a dead process never blocks anyone. The lock file is opened
read-only (created world-readable where missing), so people sharing a folder can all take it.

POSIX only (fcntl), as the runner is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Optional, Union

PathLike = Union[str, os.PathLike]

_TEMPORARY = re.compile(r"^\..+\.(\d+)(?:\.\d+)?\.tmp$")  # .<name>.<pid>[.<thread>].tmp
POLL_S = 0.05  # how often a lock with a deadline is tried again


# ---- atomic replace-writes ------------------------------------------------------------------
def temporary_path(path: PathLike) -> Path:
    """Where `path` is written before it replaces the old one: beside it, named by this process
    and thread (two writers never share a temporary file)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


@contextlib.contextmanager
def atomic_path(path: PathLike, durable: bool = True) -> Iterator[Path]:
    """A temporary path beside `path` for the with-block to write by any means; on a clean exit
    it replaces `path` (flushed to disk first where `durable`); on an error it is removed."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        yield tmp
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)  # nothing left where it was replaced


@contextlib.contextmanager
def atomic_write(
    path: PathLike, mode: str = "w", durable: bool = True, **open_args
) -> Iterator[IO]:
    """A file opened in `mode` ("w", "wb", "w+b", ...) beside `path`, which replaces `path` when
    the with-block ends without an error (see `atomic_path`)."""
    with atomic_path(path, durable=False) as tmp:
        with open(tmp, mode, **open_args) as handle:
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
    if durable:
        fsync_folder(Path(path).parent)


def write_atomic(path: PathLike, data: Union[str, bytes], durable: bool = True) -> None:
    """`data` (text or bytes) as the whole of `path`, replaced atomically."""
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)


def fsync_file(path: PathLike) -> None:
    """Flush a file's written data to disk, whoever wrote it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: PathLike) -> None:
    """Flush the folder's entry list, so a renamed file survives a power loss (where the OS and
    filesystem allow it; some refuse to fsync a folder, or to open one)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def user_path(text: str) -> Path:
    """A path a user typed on a command line (argparse's `type`), its leading `~` the home's:
    the shell leaves `--out=~/reports` as it is, and a folder named `~` would be made here."""
    return Path(os.path.expanduser(text))


def folder_problem(folder: PathLike) -> Optional[str]:
    """Why `folder` cannot be made and written (None: it can): a file (or a dangling link) in
    the way, or no right to write where it would be made. Checked before a run's work, for a
    folder first written late (checkpoints at an epoch's end); nothing is created."""
    path = os.path.abspath(folder)
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a folder" + (
            " (a file is in the way)" if existing != path else ""
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable" + (f" (to make {path} in)" if existing != path else "")
    return None


def free_space(path: PathLike) -> Optional[int]:
    """The bytes free on the disk that holds (or would hold) `path`: its nearest folder that
    exists; None where that cannot be read. For messages about a write the disk refused."""
    where = os.path.abspath(path)
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def remove_stale_temporaries(folder: PathLike) -> None:
    """Remove the temporary files (`.<name>.<pid>[.<thread>].tmp`) of processes that no longer
    exist (killed while writing); another live process's, or this one's, stay."""
    for entry in Path(folder).iterdir():
        match = _TEMPORARY.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or process_exists(pid):
            continue
        entry.unlink(missing_ok=True)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence and permission check only, nothing is sent
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or not a real pid
        return True
    return True


# ---- file locks -------------------------------------------------------------------------------
class LockBusy(TimeoutError):
    """Another process held the lock past the deadline."""

    def __init__(self, path: PathLike, timeout_s: float):
        self.path, self.timeout_s = Path(path), timeout_s
        super().__init__(f"{path} stayed locked by another process for {timeout_s:g} s")

    def __reduce__(self):  # (pickled whole: an error crossing to another process)
        return type(self), (self.path, self.timeout_s)


class HeldLock:
    """An exclusive lock held on a lock file, until `release()` (or `close()`, or the end of a
    with-block, or the end of this process)."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    close = release

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open_lock_file(path: PathLike) -> int:
    # read-only and created world-readable: flock needs no write access
    return os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)


def try_lock(path: PathLike) -> Optional[HeldLock]:
    """The lock on `path` if no other process holds it, else None (never waits)."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return HeldLock(Path(path), fd)


def file_lock(
    path: PathLike,
    timeout_s: Optional[float] = None,
    on_wait: Optional[Callable[[], None]] = None,
) -> HeldLock:
    """The exclusive lock on `path` (created where missing), held until released: use it as
    `with file_lock(path): ...`. Where another process holds it, `on_wait()` is called once (to
    say what this one waits for), then it waits: as long as it takes (`timeout_s` None), or up to
    `timeout_s` seconds, then raises LockBusy."""
    fd = _open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            _wait(fd, path, timeout_s)
    except BaseException:
        os.close(fd)
        raise
    return HeldLock(Path(path), fd)


def _wait(fd: int, path: PathLike, timeout_s: Optional[float]) -> None:
    if timeout_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        if time.monotonic() > deadline:
            raise LockBusy(path, timeout_s)
        time.sleep(POLL_S)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            continue
