"""SIGINT and SIGTERM stop a run cleanly: the current step finishes, a checkpoint is written, the
MLflow run is marked KILLED and the process exits 128 + the signal's number (130 for Ctrl-C, 143
for SIGTERM, what schedulers such as SLURM send before they kill a job). A second Ctrl-C stops
at once (the run is still marked KILLED, but no checkpoint is written).

In a job of submitit's (`hydra/launcher=slurm`, `submitit_local`) its time-limit and preemption
signal (SIGUSR2, sent `signal_delay_s` before the job's time limit) stops the run the same way;
the job is then requeued and continues from the checkpoint (runner.sweep.jobs)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Optional

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


class StopRequest:
    """Records the first SIGINT/SIGTERM instead of dying, for the training loop to act on between
    steps (`requested`). Installed as a context manager, in the main thread only (elsewhere
    Python cannot take signals, and the defaults stay).

    The first signal stands: a second Ctrl-C stops at once, a SIGTERM after it changes nothing
    (a sweep passes its stop on to its jobs as a SIGTERM, which a job that had the terminal's
    Ctrl-C already must not take for a second one). Entered while another request holds the
    process's signals (a sweep's worker process between jobs, `runner.sweep.stop`), it takes
    over a signal that one got first: the run then stops after its first step."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: now
            return  # a SIGTERM after the first signal: the first one stands
        self.signum = signum
        self._first(signum)

    def _first(self, signum: int) -> None:
        """What the first signal does besides being recorded: says so."""
        log.warning(
            "%s received%s: stopping after this step with a checkpoint (Ctrl-C again to "
            "stop at once)",
            signal.Signals(signum).name,
            " (the job's time limit is near, or it is preempted)"
            if signum == preemption_signal()
            else "",
        )

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
                outer.handed_over()
            for sig in stop_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


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
