"""Writing files safely (runner.files): a replace-write is whole or absent, never half, and leaves
no temporary file; a lock is exclusive across processes, waits or gives up as asked, and a lock
file left by a dead process blocks no one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.files import (
    LockBusy,
    atomic_path,
    atomic_write,
    file_lock,
    remove_stale_temporaries,
    temporary_path,
    try_lock,
    write_atomic,
)

pytestmark = pytest.mark.new_store  # the tests list their folders: no store in them

HOLD = (
    "import fcntl, sys, time\n"
    "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('held', flush=True); time.sleep(float(sys.argv[2]))\n"
)


def _holder(path, seconds: float) -> subprocess.Popen:
    """Another process holding the lock on `path` for `seconds`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_replace_write_is_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    write_atomic(path, "old")
    write_atomic(path, "new")
    with atomic_write(path, "wb") as f:
        f.write(b"bytes")
    assert path.read_bytes() == b"bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "plan.yaml"
    write_atomic(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("half of the new")
            raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


def test_a_writer_that_opens_the_file_itself_gets_a_path_beside_the_target(tmp_path):
    path = tmp_path / "tokens.bin"
    with atomic_path(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tokens.bin.")
        tmp.write_bytes(b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


def test_a_dead_writers_temporary_is_removed_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".last.pt.{dead.pid}.tmp"
    stale_thread = tmp_path / f".tracking.json.{dead.pid}.1234.tmp"
    mine = temporary_path(tmp_path / "last.pt")
    other = tmp_path / "notes.tmp"
    for leftover in (stale, stale_thread, mine, other):
        leftover.write_bytes(b"partial")
    remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_a_lock_held_elsewhere_is_not_taken(tmp_path):
    path = tmp_path / ".lock"
    holder = _holder(path, 30)
    try:
        assert try_lock(path) is None
        waited = []
        start = time.monotonic()
        with pytest.raises(LockBusy):
            file_lock(path, timeout_s=0.3, on_wait=lambda: waited.append(True))
        assert waited == [True] and time.monotonic() - start >= 0.3
    finally:
        holder.kill()
        holder.wait()


def test_a_waiting_lock_is_taken_when_the_holder_ends_however_it_ends(tmp_path):
    path = tmp_path / ".lock"
    holder = _holder(path, 1.0)  # ends by itself
    with file_lock(path):  # waits for it
        assert holder.wait(timeout=10) == 0  # it has ended (its exit released the lock)
    killed = _holder(path, 60)
    killed.kill()  # a lock file left by a dead process
    killed.wait()
    assert os.path.exists(path)
    with file_lock(path, timeout_s=5):
        pass
    held = try_lock(path)
    assert held is not None
    with held:
        assert try_lock(path) is None  # flock: one holder per open file, in one process too
    again = try_lock(path)
    assert again is not None
    again.release()


def test_the_runners_errors_cross_processes_whole():
    """A sweep job's error goes back to the sweep through joblib's pickling: the errors whose
    constructor takes more than a message come back as they left (RunInterrupted's exit code,
    ConfigError's key), not as a TypeError in the parent."""
    import pickle

    from runner.errors import ConfigError
    from runner.run.interrupts import RunInterrupted

    for error in (
        RunInterrupted(15, "/ck/last.pt"),
        ConfigError("optimizer.lr", "got -1", "a number > 0"),
        LockBusy(Path("/tmp/x.lock"), 2.5),
    ):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert vars(back) == vars(error)
    assert pickle.loads(pickle.dumps(RunInterrupted(2))).exit_code == 130
