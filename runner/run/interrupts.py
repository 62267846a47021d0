"""SIGINT and SIGTERM stop a run cleanly: the current step finishes, a checkpoint is written, the
MLflow run is marked KILLED and the process exits 128 + the signal's number (130 for Ctrl-C, 143
for SIGTERM, what schedulers such as SLURM send before they kill a job). A SIGINT after the first
signal (Ctrl-C again) stops at once: the run is marked KILLED as stopped at once, and no checkpoint
of the step in progress is written.

Python runs a signal's handler only between two of its bytecodes: a step inside one long
operation (a 200-s convolution in emulated fp16 on a CPU) held the line "SIGTERM received" until
the step ended, and a second Ctrl-C could not stop it. So a run's request hears each signal as it
arrives, on a thread of its own (`_Watcher`, through Python's wakeup fd, which the C-level handler
writes at once): it says so then, and a second signal that the loop has not taken within
`AT_ONCE_GRACE_S` ends the run's record KILLED and the process (`StopRequest.at_once`).

In a job of submitit's (`hydra/launcher=slurm`, `submitit_local`) its time-limit and preemption
signal (SIGUSR2, sent `signal_delay_s` before the job's time limit) stops the run the same way;
the job is then requeued and continues from the checkpoint (runner.sweep.jobs)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Optional

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# a second signal the training loop has not taken within this (its main thread inside one long
# operation): the watcher ends the run's record and the process itself
AT_ONCE_GRACE_S = 2.0


def submitit_job() -> bool:
    """Whether this process runs a job of submitit's (its executor sets SUBMITIT_EXECUTOR)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def preemption_signal() -> Optional[int]:
    """In a job of submitit's, the signal it stands for a time limit or a preemption with
    (SIGUSR2, unless SUBMITIT_PREEMPT_SIGNAL names another); None elsewhere."""
    if not submitit_job():
        return None
    found = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    return None if found in SIGNALS else found


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a run after its step with a checkpoint."""
    preempt = preemption_signal()
    return SIGNALS if preempt is None else (*SIGNALS, preempt)


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal after writing its checkpoint; `exit_code` is 128 + signal."""

    def __init__(self, signum: int, checkpoint: Optional[str] = None):
        self.signum = signum
        self.checkpoint = checkpoint
        self.exit_code = 128 + signum
        where = f"; checkpoint {checkpoint} (resume=auto continues)" if checkpoint else ""
        super().__init__(f"interrupted by {signal.Signals(signum).name}{where}")

    def __reduce__(self):  # (pickled whole: a sweep job's, sent back by joblib's workers)
        return type(self), (self.signum, self.checkpoint)


class StoppedAtOnce(KeyboardInterrupt):
    """A second signal stopped the run at once, without a checkpoint of the step in progress;
    `exit_code` is 128 + signal."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped at once by a second {_named(signum)}, without a checkpoint of the step in "
            "progress (the last checkpoint, if any, is kept)"
        )

    def __reduce__(self):
        return type(self), (self.signum,)


def _named(signum: int) -> str:
    """A signal as a user knows it: "Ctrl-C (SIGINT)", "SIGTERM"."""
    name = signal.Signals(signum).name
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else name


def stops_at_once(first: int, then: int) -> bool:
    """Whether signal `then`, after the first signal `first`, stops the run at once: a SIGINT
    (Ctrl-C again). A SIGTERM after the first signal does not: a sweep passes its stop on to
    its jobs as a SIGTERM, which a job that had the signal already (the terminal's Ctrl-C, a
    scheduler's SIGTERM to the whole process group) must not take for a second one."""
    return then == signal.SIGINT


class StopRequest:
    """Records the first SIGINT/SIGTERM instead of dying, for the training loop to act on between
    steps (`requested`). Installed as a context manager, in the main thread only (elsewhere
    Python cannot take signals, and the defaults stay).

    The first signal stands: a second Ctrl-C stops at once, a SIGTERM after it changes nothing
    (a sweep passes its stop on to its jobs as a SIGTERM, which a job that had the terminal's
    Ctrl-C already must not take for a second one). Entered while another request holds the
    process's signals (a sweep's worker process between jobs, `runner.sweep.stop`), it takes
    over a signal that one got first: the run then stops after its first step."""

    watches = True  # (a run's request: a thread hears each signal as it arrives)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}
        # what a second signal does where the loop cannot take it: the run's record ended
        # KILLED (set by the run once its record exists; None: the loop's own error ends it)
        self.at_once: Optional[Callable[[int], None]] = None
        # (the first signal is said once, by whoever hears it first)
        self._saying = threading.Lock()
        self._said = False
        self._taken = threading.Event()  # the loop took the second signal
        self._watcher: Optional[_Watcher] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            if stops_at_once(self.signum, signum):
                self._taken.set()
                raise StoppedAtOnce(signum)  # the second signal: now
            return  # a SIGTERM after a Ctrl-C: the first one stands
        self.signum = signum
        self._say(signum)

    def _say(self, signum: int) -> None:
        """`_first`, once: by the watcher as the signal arrives, or by the handler."""
        with self._saying:
            if self._said:
                return
            self._said = True
        self._first(signum)

    def _first(self, signum: int) -> None:
        """What the first signal does besides being recorded: says so."""
        again = (
            "Ctrl-C again stops at once"
            if signum == signal.SIGINT
            else f"a SIGINT stops at once: Ctrl-C, or kill -INT {os.getpid()}"
        )
        log.warning(
            "%s received%s: stopping after the step in progress, with a checkpoint (%s)",
            _named(signum),
            " (the job's time limit is near, or it is preempted)"
            if signum == preemption_signal()
            else "",
            again,
        )

    def _second(self, signum: int) -> None:
        """A second signal the watcher heard: said now; where the loop has not taken it within
        AT_ONCE_GRACE_S (its main thread inside one long operation), the run's record is ended
        KILLED (`at_once`) and the process exits 128 + the signal."""
        log.warning(
            "%s again: stopping at once, without a checkpoint of the step in progress",
            _named(signum),
        )
        if self._taken.wait(AT_ONCE_GRACE_S) or self.at_once is None:
            return
        try:
            self.at_once(signum)
        finally:
            os._exit(128 + signum)

    def previous_handler(self, signum: int) -> object:
        """The handler of `signum` before this request took it (None when it did not)."""
        return self._previous.get(signum)

    def handed_over(self) -> None:
        """A run entered inside this request took its signal over: it stops that run only."""
        self.signum = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            outer = holding()
            if outer is not None and outer.signum is not None:  # it came before this run
                self.signum = outer.signum
                self._said = True  # (said when it came)
                outer.handed_over()
            for sig in stop_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.watches:
                self._watcher = _Watcher(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@functools.cache
def _forks_hear_nothing() -> None:
    """A process forked from this one (a DataLoader's worker) gives the wakeup fd up at once: it
    shares the watcher's socket, and a signal sent to the whole process group (a terminal's
    Ctrl-C) would write one more byte into it from each worker, which the watcher would take
    for a second Ctrl-C."""
    os.register_at_fork(after_in_child=_no_wakeup_fd)


def _no_wakeup_fd() -> None:
    with contextlib.suppress(ValueError):  # (forked from another thread: nothing was set there)
        signal.set_wakeup_fd(-1)


class _Watcher:
    """Hears the stop signals as they arrive, on a thread of its own: Python's C-level handler
    writes each signal's number to the wakeup fd at once (`signal.set_wakeup_fd`), whatever the
    main thread is doing; the thread says the first (`StopRequest._say`) and acts on a second
    that stops at once (`StopRequest._second`)."""

    def __init__(self, request: StopRequest) -> None:
        self.request = request
        _forks_hear_nothing()
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._hear, name="amp-runner-signals", daemon=True)
        self._thread.start()

    def _hear(self) -> None:
        first = self.request.signum  # (a signal taken over from an outer request counts)
        stops = set(stop_signals())
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:  # (closed: the run ended)
                return
            for signum in data:
                if signum not in stops:
                    continue
                if first is None:
                    first = signum
                    self.request._say(signum)
                elif stops_at_once(first, signum):
                    self.request._second(signum)

    def close(self) -> None:
        """The wakeup fd given back, the thread ended."""
        with contextlib.suppress(ValueError):  # (not the main thread: nothing was set)
            signal.set_wakeup_fd(self._previous)
        with contextlib.suppress(OSError):
            self._write.shutdown(socket.SHUT_RDWR)
        self._write.close()
        self._thread.join(timeout=5)
        self._read.close()


@contextlib.contextmanager
def terminate_interrupts() -> Iterator[None]:
    """Outside a run's training loop (composing, planning, the pre-flight, `trainer.tune`'s
    measurements, building the kernels) a SIGTERM stops the process as Ctrl-C does there: it
    raises `RunInterrupted`, which the entry point reports in one line and turns into exit 143,
    where Python's default would end the process without a word. Nothing is lost: no MLflow run
    or checkpoint exists yet (a run's own `StopRequest` takes the signal over while it trains).
    A SIGTERM ignored by whoever started the process (submitit's job controllers) stays ignored.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def interrupt(signum: int, frame: Optional[FrameType]) -> None:
        raise RunInterrupted(signum)

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def holding() -> Optional[StopRequest]:
    """The stop request that holds this process's signals now, if any."""
    handler = signal.getsignal(signal.SIGINT)
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, StopRequest) else None
