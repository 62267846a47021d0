"""What a run trains with: the parts `runner.run.build` makes from a plan and the trainer takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from runner.components.loaders import shutdown_workers
from runner.measure.probes import MemoryProbe
from runner.precision import AmpEngine, Finding
from runner.tasks import Classification, Task


@dataclass
class Parts:
    """What a run trains with, built from its plan (benchmarks reuse it)."""

    bundle: Any
    train_loader: Any
    val_loader: Any
    model: torch.nn.Module  # the model itself (prepared by the engine; not DDP-wrapped)
    optimizer: torch.optim.Optimizer
    engine: AmpEngine
    scheduler: Any
    memory: MemoryProbe  # reset before the model was built
    findings: list[Finding] = field(default_factory=list)  # about the built model (info only)
    criterion: torch.nn.Module = field(default_factory=torch.nn.CrossEntropyLoss)  # the loss
    task: Task = field(default_factory=Classification)  # what a batch is, the loss and metrics
    # the model's training FLOPs per sample, counted once in planning (None: not countable)
    flops_per_sample: Optional[float] = None

    def close(self) -> None:
        """End the loaders' worker processes (a run's last step; safe to repeat)."""
        shutdown_workers(self.train_loader, self.val_loader)
