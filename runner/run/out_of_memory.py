"""A run that does not fit its device's memory, said in one line instead of the allocator's
traceback: where it ran out (building, a training step, validation), at which sizes (the model,
the level, the batch), how much it asked for against what the device has, and what to change.

PyTorch raises `torch.OutOfMemoryError` on a GPU; on a CPU its allocator raises a RuntimeError
("DefaultCPUAllocator: can't allocate memory"), where the operating system refuses (a request
larger than the machine, a process limit). A CPU that promises memory it does not have leaves
the process to the kernel's OOM killer instead: nothing can be said then, and the next run ends
the run KILLED with its log (runner.tracking.job_log).

`guarded` runs a part of the run and turns its out-of-memory error into `OutOfMemory`, raised
once the failed step's frames are gone: the tensors they held are freed (and, on a GPU, handed
back to the device) before anything else runs, so that the next job of a sweep starts with the
device's memory free.

A DataLoader worker is a process of its own, with its own memory: the OOM killer may end it
alone, and torch then raises "DataLoader worker (pid N) is killed by signal: Killed", a
traceback that says nothing of memory. `guarded` turns that into `WorkerKilled` where the
machine's count of OOM kills (/proc/vmstat) grew during the call, and a worker's bus error
(the shared memory the workers hand their batches over, /dev/shm, run out: a container's
default is 64 MB) likewise; a SIGKILL or SIGTERM without an OOM kill counted is said to come
from outside the run. A worker that crashed any other way is left as it is (a bug).
"""

from __future__ import annotations

import gc
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Optional, TypeVar

import torch

from runner.errors import OutOfMemory, RunnerError, WorkerKilled, chain
from runner.tracking.liveness import oom_kills

T = TypeVar("T")
GIB = 1024**3

# where in the run an error was raised, by the functions its traceback passes through (the
# innermost that matches names it)
PHASES = {
    "train_step": "a training step",
    "evaluate": "validation",
    "compile_warmup": "torch.compile's warm-up",
    "_save": "writing a checkpoint",
    "build_model": "building the model",
    "build_optimizer": "building the optimizer",
    "build_datasets": "loading the data",
}
_CPU_REFUSED = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
# torch's CUDA message, up to what it says of the device (the rest: its allocator's detail)
_CUDA_HEAD = re.compile(r"^(.*? is free\.)", re.S)
_RESERVED = re.compile(r"([\d.]+) (GiB|MiB) is reserved by PyTorch but unallocated")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocator's refusal: torch's OutOfMemoryError (a GPU), or the CPU
    allocator's RuntimeError."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate" in str(error)


# what the run was doing around that phase, by the outermost function that matches
PURPOSES = {
    "tuned": "trainer.tune's measurements",
    "planned": "the layer plan's pre-flight",
}


def phase(traceback: Optional[TracebackType]) -> str:
    """Where the run was when `traceback` was raised (`PHASES`), and what for (`PURPOSES`);
    "the run" where nothing matches."""
    found, purpose = "the run", None
    while traceback is not None:
        name = traceback.tb_frame.f_code.co_name
        found = PHASES.get(name, found)
        purpose = purpose or PURPOSES.get(name)
        traceback = traceback.tb_next
    return found if purpose is None else f"{found} of {purpose}"


def _gib(count: float) -> str:
    return f"{count / GIB:.1f} GiB"


def _machine_bytes() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001  (a figure for the message only)
        return None


def _address_limit() -> Optional[int]:
    """The process's address-space limit (`ulimit -v`), None where there is none."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def what_happened(error: BaseException, device: torch.device) -> str:
    """The allocator's own account, short: how much was asked for, what the device has."""
    text = str(error)
    refused = _CPU_REFUSED.search(text)
    if refused is not None:
        asked = int(refused.group(1))
        total = _machine_bytes()
        has = [f"the machine has {_gib(total)}"] if total else []
        limit = _address_limit()
        if limit is not None:
            has.append(f"this process may address {_gib(limit)}: ulimit -v")
        return f"the CPU allocator could not get {_gib(asked)}" + (
            f" ({'; '.join(has)})" if has else ""
        )
    head = _CUDA_HEAD.match(text)
    said = head.group(1) if head is not None else text.splitlines()[0] if text else "no message"
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        said += f" The run's peak so far: {_gib(peak)} allocated."
        reserved = _RESERVED.search(text)
        if reserved is not None:
            amount = float(reserved.group(1)) * (GIB if reserved.group(2) == "GiB" else 1024**2)
            total = torch.cuda.get_device_properties(device).total_memory
            if amount > 0.05 * total:  # fragmentation torch's own advice is about
                said += (
                    f" {_gib(amount)} is reserved but unallocated (fragmented): "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may be enough."
                )
    return said


def advice(device: torch.device, opt_level: str) -> str:
    """What to change to fit."""
    steps = [
        "a smaller trainer.batch_size (activations grow with it; trainer.accumulate_grad_batches "
        "raised as much keeps the samples a step learns from)"
    ]
    if opt_level in ("O0", "O1"):
        level = "precision=o2_bf16" if device.type == "cpu" else "precision=o2 or o2_bf16"
        steps.append(
            f"a 16-bit level ({level}: weights, gradients and activations in half the bytes)"
        )
    steps.append("Adam's moments in 8 bits (precision.optimizer_state=int8)")
    if device.type == "cuda":
        steps.append("trainer.strategy=fsdp over several GPUs (the state sharded)")
    return "To fit: " + "; ".join(steps) + "."


def release(device: torch.device) -> None:
    """What a failed step held, freed: cycles collected, a GPU's cached blocks handed back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# torch's words for a DataLoader worker that died (its C++ SIGCHLD check, or its queue's)
_WORKER_DIED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) "
    r"(?:is killed by signal: ([^.]+)\.|exited unexpectedly)"
)
SHM = "/dev/shm"
# the signals only another process sends a worker, by torch's (strsignal's) name for them
OUTSIDE = {"Killed": "SIGKILL", "Terminated": "SIGTERM"}


def worker_killed(error: BaseException, oom_kills_since: Optional[int]) -> Optional[str]:
    """What a DataLoader worker's death (`error`, torch's RuntimeError) was, where memory ended
    it: the OOM killer (`oom_kills_since`: processes it ended on this machine during the call;
    None where the machine does not show its count) or a bus error (shared memory run out); or
    where another process did (SIGKILL or SIGTERM, no OOM kill counted). None for any other
    error or death (a crash of the worker's own: a segmentation fault, an abort)."""
    found = _WORKER_DIED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    pids, by = found.group(1).strip(), found.group(2)
    worker = f"A DataLoader worker (pid {pids})"
    if by == "Bus error":  # (what /dev/shm held at the crash is freed by now: its size)
        try:
            room = f" ({SHM} holds {shutil.disk_usage(SHM).total / 2**20:.0f} MB in all)"
        except OSError:
            room = ""
        return (
            f"{worker} crashed with a bus error, in a worker most often the shared memory the "
            f"workers hand their batches over in running out{room}. Give it more room (a "
            "container: docker run --shm-size=8g), or fewer workers (trainer.num_workers; 0 "
            "loads in this process); where it is large, a file the dataset maps into memory "
            "may have shrunk while it was read"
        )
    if (by is None or by == "Killed") and (oom_kills_since or 0) > 0:
        how = "was killed (SIGKILL)" if by else "exited unexpectedly"
        return (
            f"{worker} {how}: the kernel's OOM killer ended {oom_kills_since} process(es) on "
            "this machine during the run, most likely this worker, out of memory. Each of the "
            "trainer.num_workers workers is a process with memory of its own (what the dataset "
            "holds, its batches in flight): fewer workers, a smaller trainer.batch_size, or a "
            "machine with more memory"
        )
    if by in OUTSIDE:  # (no bug of the run's: its traceback would say nothing)
        if oom_kills_since is None:  # (no /proc/vmstat to read)
            who = (
                f"{worker} was killed ({OUTSIDE[by]}): by the kernel's OOM killer, out of "
                "memory, or by another process (a kill, a job scheduler); this machine does not "
                "show its count of OOM kills"
            )
        else:
            who = (
                f"{worker} was killed ({OUTSIDE[by]}) from outside the run: the kernel's OOM "
                "killer ended no process on this machine meanwhile, so another process sent it "
                "(a kill, a job scheduler, a container's memory limit the machine's count does "
                "not show)"
            )
        return (
            f"{who}. Were it memory: fewer workers (trainer.num_workers), a smaller "
            "trainer.batch_size. resume=auto continues the run from its last checkpoint"
        )
    return None


WORKER_GRACE_S = 3.0  # how long a broken connection to a worker waits for its death to show


def _signal_described(error: BaseException) -> Optional[BaseException]:
    """torch's "exited unexpectedly" (`error`: its check of the workers after a failed receive,
    which reaps the dead one, so that the signal is lost to its SIGCHLD check) made whole: the
    signal that ended the worker, read from the worker's process object in the frames the error
    came through; None where it is not there."""
    found = _WORKER_DIED.search(str(error))
    if found is None or found.group(2) is not None:
        return None
    pids = {int(pid) for pid in found.group(1).split(",")}
    frame = error.__traceback__
    while frame is not None:
        workers = getattr(frame.tb_frame.f_locals.get("self"), "_workers", None)
        for worker in workers if isinstance(workers, list) else ():
            code = getattr(worker, "exitcode", None)
            if getattr(worker, "pid", None) in pids and isinstance(code, int) and code < 0:
                name = signal.strsignal(-code) or f"signal {-code}"
                return RuntimeError(
                    f"DataLoader worker (pid {worker.pid}) is killed by signal: {name}."
                )
        frame = frame.tb_next
    return None


@contextmanager
def _sigchld_held() -> Iterator[None]:
    """torch's SIGCHLD handler (which raises a worker's death wherever the main process is) held
    off while a failure is looked at, `_worker_death` making its check instead: the death is then
    told once, as the failure's cause, not raised in the middle of its report. (The main thread
    only sets handlers: elsewhere the handler stays.)"""
    try:
        before = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (not SIG_IGN: that reaps)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL if before is None else before)


def _worker_death(error: BaseException, grace_s: float = WORKER_GRACE_S) -> BaseException:
    """`error`, or where a DataLoader worker died, torch's error for that death with its signal.
    torch tells a death three ways, by chance of timing: its SIGCHLD handler's check ("is killed
    by signal: Bus error"), raised wherever the main process is, perhaps inside the receive
    whose failure is then chained on; its check after a failed receive ("exited unexpectedly",
    no signal: `_signal_described`); or nothing yet, the receive broken as soon as the dying
    worker's sockets closed, before the kernel shows it dead (not yet a zombie): for such an
    error the check is made again for up to `grace_s` seconds. torch tells a death once (its
    check forgets the worker): told here, its handler does not raise it again later, in this
    one's report."""
    for link in chain(error):
        found = _WORKER_DIED.search(str(link)) if isinstance(link, RuntimeError) else None
        if found is not None and found.group(2) is not None:
            return link
    for link in chain(error):
        told = _signal_described(link)
        if told is not None:
            return told
    if _WORKER_DIED.search(str(error)):
        return error
    from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails

    broken = any(isinstance(link, (ConnectionError, EOFError)) for link in chain(error))
    deadline = time.monotonic() + (grace_s if broken else 0.0)
    while True:
        try:  # (torch's SIGCHLD handler may make the same check, and raise, in the sleep)
            _error_if_any_worker_fails()
            if time.monotonic() >= deadline:
                return error
            time.sleep(0.02)
        except RuntimeError as died:
            return died


def _described(
    error: BaseException,
    device: torch.device,
    opt_level: str,
    sizes: Callable[[], str],
    kills: Optional[int],
) -> Optional[tuple[str, type[RunnerError]]]:
    """What `guarded` raises for `error` (`kills`: the OOM-kill count before the call), or None
    where it is neither out of memory nor a worker ended by memory."""
    if is_out_of_memory(error):
        happened = what_happened(error, device).rstrip(".")
        return (
            f"Out of memory on {device} in {phase(error.__traceback__)} ({sizes()}): "
            f"{happened}. {advice(device, opt_level)}",
            OutOfMemory,
        )
    with _sigchld_held():
        now = oom_kills()
        since = now - kills if now is not None and kills is not None else None
        killed = worker_killed(_worker_death(error), since)
        # (no phase: torch's SIGCHLD handler raises wherever the main process then is)
        return None if killed is None else (f"{killed} ({sizes()}).", WorkerKilled)


def guarded(
    call: Callable[[], T], device: torch.device, opt_level: str, sizes: Callable[[], str]
) -> T:
    """`call()`, whose out-of-memory error becomes `OutOfMemory`: "Out of memory on <device> in
    <phase> (<sizes()>): <what happened>. To fit: ...", and a DataLoader worker ended by memory
    `WorkerKilled` (`worker_killed`). Raised after the failed call's frames are released (see
    the module's docstring); any other error passes unchanged."""
    kills = oom_kills()
    try:
        return call()
    except Exception as error:
        try:
            told = _described(error, device, opt_level, sizes, kills)
        except RuntimeError as late:  # torch's SIGCHLD handler, before `_described` held it off
            if _WORKER_DIED.search(str(late)) is None:
                raise
            told = _described(late, device, opt_level, sizes, kills)
        if told is None:
            raise
    # (here the error, its traceback and the frames holding the step's tensors are gone)
    release(device)
    message, kind = told
    raise kind(message)
