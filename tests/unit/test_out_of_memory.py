"""How an out-of-memory error is told apart and described (runner.run.out_of_memory); the runs
themselves: tests/integration/test_out_of_memory.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from runner.errors import OutOfMemory, WorkerKilled
from runner.run import out_of_memory

CPU = torch.device("cpu")


def test_only_an_allocators_refusal_is_out_of_memory():
    assert out_of_memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**62, dtype=torch.uint8)  # beyond any machine's address space
    assert out_of_memory.is_out_of_memory(refused.value)
    assert not out_of_memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be"))
    assert not out_of_memory.is_out_of_memory(MemoryError())  # Python's own, not torch's


def _raise_in(*names: str):
    """Raise torch's CPU refusal from nested functions called `names`, outermost first."""

    def call(depth: int) -> None:
        if depth == len(names):
            torch.empty(2**62, dtype=torch.uint8)
        code = compile(f"def {names[depth]}(go, d): go(d)", "<test>", "exec")
        scope: dict = {}
        exec(code, scope)
        scope[names[depth]](call, depth + 1)

    return lambda: call(0)


@pytest.mark.parametrize(
    "names, said",
    [
        (("fit", "train_step"), "a training step"),
        (("fit", "evaluate"), "validation"),
        (("prepared", "build_model"), "building the model"),
        (("tuned", "measure", "train_step"), "a training step of trainer.tune's measurements"),
        (("planned", "train_step"), "a training step of the layer plan's pre-flight"),
        (("somewhere",), "the run"),
    ],
)
def test_the_message_says_where_at_which_sizes_and_what_to_change(names, said):
    with pytest.raises(OutOfMemory) as error:
        out_of_memory.guarded(_raise_in(*names), CPU, "O1", lambda: "net at O1, batch 8")
    message = str(error.value)
    assert message.startswith(f"Out of memory on cpu in {said} (net at O1, batch 8): ")
    assert f"the CPU allocator could not get {2**62 / 1024**3:.1f} GiB" in message
    assert "precision=o2_bf16" in message and "fsdp" not in message  # (a CPU: one device)
    assert error.value.__context__ is None and error.value.__cause__ is None  # frames freed


def test_any_other_error_passes_unchanged():
    def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        out_of_memory.guarded(broken, CPU, "O0", lambda: "")
    assert out_of_memory.guarded(lambda: 7, CPU, "O0", lambda: "") == 7


KILLED = "DataLoader worker (pid 4242) is killed by signal: Killed. "
GONE = "DataLoader worker (pid(s) 4242, 4243) exited unexpectedly"


@pytest.mark.parametrize(
    "text, oom_kills, said",
    [
        (KILLED, 1, "A DataLoader worker (pid 4242) was killed (SIGKILL): the kernel's OOM killer"),
        (GONE, 2, "A DataLoader worker (pid 4242, 4243) exited unexpectedly: the kernel's OOM"),
        (
            "DataLoader worker (pid 7) is killed by signal: Bus error. ",
            0,
            "A DataLoader worker (pid 7) crashed with a bus error",
        ),
        (KILLED, 0, "A DataLoader worker (pid 4242) was killed (SIGKILL) from outside the run"),
        (
            "DataLoader worker (pid 7) is killed by signal: Terminated. ",
            0,
            "A DataLoader worker (pid 7) was killed (SIGTERM) from outside the run",
        ),
        (KILLED, None, "A DataLoader worker (pid 4242) was killed (SIGKILL): by the kernel's"),
        (GONE, 0, None),  # (no signal known, no OOM kill: nothing to say of it)
        (GONE, None, None),
        ("DataLoader worker (pid 7) is killed by signal: Segmentation fault. ", 3, None),  # a bug
        ("mat1 and mat2 shapes cannot be multiplied", 3, None),
    ],
)
def test_a_worker_ended_by_memory_is_told_apart(text, oom_kills, said):
    """torch's words for a worker that died, by what memory did to it: the OOM killer (its
    machine-wide count grew meanwhile) or shared memory run out (a bus error); a kill from
    outside without an OOM kill (it raised torch's error with a traceback, "an unexpected
    error"); a crash of the worker's own keeps torch's error and traceback."""
    found = out_of_memory.worker_killed(RuntimeError(text), oom_kills)
    if said is None:
        assert found is None
        return
    assert found.startswith(said)
    if "from outside" in said:
        assert "the kernel's OOM killer ended no process" in found
        assert "resume=auto continues the run" in found
    elif oom_kills is None:  # (no /proc/vmstat: either may have killed it)
        assert "or by another process" in found and "does not show its count" in found
        assert "resume=auto continues the run" in found
    elif oom_kills:
        assert f"ended {oom_kills} process(es) on this machine during the run" in found
        assert "fewer workers, a smaller trainer.batch_size" in found
    else:
        assert "--shm-size" in found and "trainer.num_workers" in found
    assert out_of_memory.worker_killed(ValueError(text), oom_kills) is None  # torch's own only


def _worker_dying_in(seconds: float):
    """A child process registered as a DataLoader worker (with torch's check of its workers) that
    dies of a bus error after `seconds`."""
    code = (
        "import os, signal, time; signal.signal(signal.SIGBUS, signal.SIG_DFL); "
        f"time.sleep({seconds}); os.kill(os.getpid(), signal.SIGBUS)"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_broken_connection_waits_for_the_dying_workers_death_to_show():
    """A worker that dies while its batch is received breaks the connection the batch came over
    before the kernel shows it dead: torch's check found no death then, and its SIGCHLD handler
    raised the death later, in the middle of the report of the ConnectionResetError (an
    unexpected error, exit 1). The check is now made again for a while, for that error only."""
    worker = _worker_dying_in(0.5)
    key = id(worker)
    torch._C._set_worker_pids(key, (worker.pid,))
    try:
        broken = ConnectionResetError(104, "Connection reset by peer")
        started = time.monotonic()
        died = out_of_memory._worker_death(broken)
        waited = time.monotonic() - started
        assert isinstance(died, RuntimeError), died
        assert f"DataLoader worker (pid {worker.pid}) is killed by signal: Bus error" in str(died)
        assert waited < out_of_memory.WORKER_GRACE_S
        # any other error is not waited for: no death shows yet (torch tells one once), it is kept
        worker_two = _worker_dying_in(30)
        torch._C._set_worker_pids(id(worker_two), (worker_two.pid,))
        try:
            other = ValueError("mat1 and mat2 shapes cannot be multiplied")
            started = time.monotonic()
            assert out_of_memory._worker_death(other, grace_s=30) is other
            assert time.monotonic() - started < 1.0
            # a broken connection with no death to come is given back after the grace
            assert out_of_memory._worker_death(broken, grace_s=0.2) is broken
        finally:
            torch._C._remove_worker_pids(id(worker_two))
            worker_two.kill()
            worker_two.wait()
    finally:
        torch._C._remove_worker_pids(key)
        worker.wait()


class _Iterator:
    """What torch's check of its workers after a failed receive has at hand: its workers."""

    def __init__(self, workers):
        self._workers = workers

    def _try_get_data(self):
        pids = ", ".join(str(worker.pid) for worker in self._workers)
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as error:
            raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from error


def test_a_worker_death_is_told_with_its_signal_however_torch_saw_it():
    """torch says "exited unexpectedly", without the signal, where its check after a failed
    receive found the worker dead (and reaped it: its SIGCHLD check then says nothing); the run
    ended as an unexpected error. The signal is read from the worker's process, where the check
    left it. Where the SIGCHLD handler raised inside the receive, its word is in the chain."""
    context = multiprocessing.get_context("fork")
    worker = context.Process(target=_bus_error)
    worker.start()
    worker.join()
    assert worker.exitcode == -signal.SIGBUS
    with pytest.raises(RuntimeError) as exited:
        _Iterator([worker])._try_get_data()
    told = out_of_memory._worker_death(exited.value)
    assert str(told).startswith(f"DataLoader worker (pid {worker.pid}) is killed by signal: Bus")
    assert out_of_memory.worker_killed(told, 0).startswith(
        f"A DataLoader worker (pid {worker.pid}) crashed with a bus error"
    )
    # the handler's word, raised inside the receive, under torch's "exited unexpectedly"
    handler = RuntimeError(f"DataLoader worker (pid {worker.pid}) is killed by signal: Bus error.")
    try:
        try:
            raise handler
        except RuntimeError as error:
            raise RuntimeError(
                f"DataLoader worker (pid(s) {worker.pid}) exited unexpectedly"
            ) from error
    except RuntimeError as outer:
        assert out_of_memory._worker_death(outer) is handler
    # a worker that exited with a status, not a signal: torch's words as they are
    ended = context.Process(target=sys.exit, args=(3,))
    ended.start()
    ended.join()
    with pytest.raises(RuntimeError) as exited:
        _Iterator([ended])._try_get_data()
    assert out_of_memory._worker_death(exited.value, grace_s=0) is exited.value


def _bus_error() -> None:
    signal.signal(signal.SIGBUS, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGBUS)


def test_a_death_raised_while_a_failure_is_looked_at_is_told(monkeypatch):
    """torch's SIGCHLD handler raises a worker's death wherever the main process is: also while
    `guarded` looks at the failure the death caused (a broken receive), before the handler is
    held off. That raise ended the run as an unexpected error; it is now the failure told."""
    from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails

    worker = _worker_dying_in(0)
    os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
    torch._C._set_worker_pids(id(worker), (worker.pid,))
    calls = []

    def kills_then_the_handler():
        calls.append(1)
        if len(calls) == 2:  # (in the look at the failure: what the handler does there)
            _error_if_any_worker_fails()
        return 0

    def broken_receive():
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(out_of_memory, "oom_kills", kills_then_the_handler)
    try:
        with pytest.raises(WorkerKilled) as told:
            out_of_memory.guarded(broken_receive, CPU, "O0", lambda: "tiny")
    finally:
        torch._C._remove_worker_pids(id(worker))
        worker.wait()
    assert str(told.value).startswith(
        f"A DataLoader worker (pid {worker.pid}) crashed with a bus error"
    )
    assert str(told.value).endswith("(tiny).")
