"""What watches a training step: one `Instruments` object the step enters once, made of small
instruments behind one protocol (`Instrument`). At a step only the every-step instruments (the
step timer) are due at, entering it costs a few calls and their marks: no allocation, no hook,
no device read (README.md beside this file)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, TypeVar

MetricsSink = Callable[[Mapping[str, float], int], None]  # (metrics, step), e.g. log_metrics
ArtifactSink = Callable[[Path, str], None]  # (local file, artifact folder), e.g. log_file


def output_folder(folder: Optional[Path], prefix: str) -> Path:
    """`folder`, made if missing; None: a new temporary folder, its name starting `prefix`,
    removed when this process exits (a run always names its folders: a temporary one serves a
    Trainer built without them, whose files would otherwise pile up under /tmp)."""
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix=prefix))
        _remove_at_exit(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _remove_at_exit(folder: Path) -> None:
    """Remove `folder` when the process that made it exits (not a forked child of it)."""
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)


class Instrument:
    """One thing that watches steps. A step it is `due` at runs, in this order:

        start(step)                  before the forward: install hooks
        after_backward(step)         the gradients exist: observe, remove hooks, record
        after_step(step, stepped)    after the optimizer step (`stepped`: not skipped)
        close()                      always, last (on an error too): no hook left behind

    then, outside the step, `counted(step, samples, items)` (what it trained on: samples, and
    the task's items: samples or tokens). Around an epoch's training steps: `start_epoch(epoch)`
    before its first batch is fetched and `steps_done()` after its last step (before
    validation); at its end `epoch_metrics()` (what goes out with the epoch's metrics), then
    `end_epoch()` (files to the artifact sink). Every method does nothing unless overridden. An
    instrument with `every_step` is due at every step (its `due` is never asked). A step may
    be replayed from a CUDA graph (`trainer.cuda_graphs=step`) only where every instrument due
    at it is an every-step one (which takes no hook) or `replayable` (it hooks nothing of the
    step's Python); the others' steps run eagerly."""

    every_step = False
    replayable = False

    def due(self, step: int) -> bool:
        """Whether (1-based) training step `step` is watched (asked once per step, first)."""
        return False

    def start(self, step: int) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def after_step(self, step: int, stepped: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def counted(self, step: int, samples: int, items: int) -> None:
        pass

    def start_epoch(self, epoch: int) -> None:
        pass

    def steps_done(self) -> None:
        pass

    def epoch_metrics(self) -> dict[str, float]:
        return {}

    def end_epoch(self) -> None:
        pass


class Watch:
    """The instruments due at one step, entered as a context around it: `after_backward()`
    and `after_step(stepped)` are the points a step exposes."""

    def __init__(self, step: int, instruments: Sequence[Instrument]):
        self.step = step
        self.instruments = instruments

    def __enter__(self) -> Watch:
        started: list[Instrument] = []
        try:
            for instrument in self.instruments:
                started.append(instrument)
                instrument.start(self.step)
        except BaseException:
            for instrument in reversed(started):
                instrument.close()
            raise
        return self

    def after_backward(self) -> None:
        for instrument in reversed(self.instruments):  # the last hooks in, the first out
            instrument.after_backward(self.step)

    def after_step(self, stepped: bool) -> None:
        for instrument in self.instruments:
            instrument.after_step(self.step, stepped)

    def __exit__(self, *exc: Any) -> None:
        for instrument in reversed(self.instruments):
            instrument.close()


class _Idle(Watch):
    """A step nothing watches: every point is a no-op (one shared object)."""

    def __init__(self) -> None:
        super().__init__(0, ())

    def __enter__(self) -> Watch:
        return self

    def after_backward(self) -> None:
        pass

    def after_step(self, stepped: bool) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


IDLE = _Idle()
T = TypeVar("T", bound=Instrument)


class Instruments:
    """The instruments of a trainer, in the order they start (None entries are left out)."""

    def __init__(self, *instruments: Optional[Instrument]):
        self.all = tuple(i for i in instruments if i is not None)
        self._sometimes = tuple(i for i in self.all if not i.every_step)
        always = tuple(i for i in self.all if i.every_step)
        # the watch of a step only the every-step instruments are due at: one shared object
        self._usual: Watch = Watch(0, always) if always else IDLE
        self._counting = tuple(i for i in self.all if type(i).counted is not Instrument.counted)

    def step(self, step: int) -> Watch:
        """The watch of training step `step`: the instruments due at it (the every-step ones
        among them), or one shared watch when only the every-step ones are (`IDLE` when there
        are none)."""
        due: Optional[list[Instrument]] = None  # (no list is made for a usual step)
        for instrument in self._sometimes:
            if instrument.due(step):
                due = [instrument] if due is None else [*due, instrument]
        if due is None:
            if self._usual is not IDLE:
                self._usual.step = step
            return self._usual
        return Watch(step, [i for i in self.all if i.every_step or i in due])

    def counted(self, step: int, samples: int, items: int) -> None:
        for instrument in self._counting:
            instrument.counted(step, samples, items)

    def find(self, kind: type[T]) -> Optional[T]:
        """The instrument of class `kind` (None: there is none)."""
        return next((i for i in self.all if isinstance(i, kind)), None)

    def start_epoch(self, epoch: int) -> None:
        for instrument in self.all:
            instrument.start_epoch(epoch)

    def steps_done(self) -> None:
        for instrument in self.all:
            instrument.steps_done()

    def epoch_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for instrument in self.all:
            out.update(instrument.epoch_metrics())
        return out

    def end_epoch(self) -> None:
        for instrument in self.all:
            instrument.end_epoch()
