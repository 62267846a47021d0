"""What a trainer is given and gives back: `RunContext` (where its metrics, checkpoints and files
go, the process group, the stop request), the `Checkpoints` it writes to, and its `FitResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

from runner import metrics as m
from runner.measure.instruments import ArtifactSink, MetricsSink
from runner.run.distributed import Comm
from runner.run.interrupts import StopRequest


class Checkpoints(Protocol):
    """Where the trainer's checkpoint state goes (a run's: runner.run.checkpointer.Checkpointer):
    `writes`, whether this rank writes a file (a sharded run's ranks all gather the state even
    where they write none); `save(state)` writes it and says where."""

    writes: bool

    def save(self, state: dict) -> Optional[str]: ...


def nowhere(metrics, step) -> None:
    """The metrics sink of a trainer whose metrics go nowhere (a tuning trial, a pre-flight):
    what only a run's record would show (the device's busy share) is not measured for it."""


@dataclass
class RunContext:
    """Where the trainer's results go and what it answers to, in one object: the metrics sink
    (e.g. Run.log_metrics, runner.tracking.base), the process group, the checkpoints (None: none
    are written), the stop request (SIGINT/SIGTERM), and the sink for the files
    it writes (the diagnostics; e.g. Run.log_file), written under `artifact_dir` (None: a
    temporary folder, removed when the process exits; a run names its own)."""

    on_metrics: MetricsSink = field(default=nowhere)
    comm: Comm = field(default_factory=Comm)
    checkpointer: Optional[Checkpoints] = None
    stop: Optional[StopRequest] = None
    on_artifact: Optional[ArtifactSink] = None
    artifact_dir: Optional[Path] = None
    # the audit's files (layers_ran.csv); None: a temporary folder, removed when the process exits,
    # where `on_artifact` takes the files, else none are written
    layers_dir: Optional[Path] = None


@dataclass
class FitResult:
    best_val_acc: float  # a classifier's (nan for a language model)
    train_time_s: float
    epochs: list[dict[str, float]] = field(default_factory=list)
    best_val_loss: float = math.nan  # a language model's (nan for a classifier)
    objective: str = m.BEST_VAL_ACC  # the task's: what `best` is, and a sweep optimises

    @property
    def best(self) -> float:
        """The task's objective: best_val_acc (maximised) or best_val_loss (minimised)."""
        return self.best_val_loss if self.objective == m.BEST_VAL_LOSS else self.best_val_acc
