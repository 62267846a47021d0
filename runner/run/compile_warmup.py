"""With `trainer.compile`: the compile warm-up before the first epoch's clock starts, and the layer
audit of one eager step (hooks inside the compiled graph would recompile it); both leave the run
exactly as if nothing had happened (README.md beside this file)."""

from __future__ import annotations

from typing import Any

import torch

from runner.measure.audit import AuditInstrument
from runner.measure.instruments import Instruments
from runner.measure.probes import Stopwatch
from runner.run import rng


class CompileWarmup:
    """The compile half of `runner.run.trainer.Trainer`: steps its model on its first training
    batch (moved by its `to_device`) and puts back the gradients, the model's buffers and
    every random generator."""

    model: torch.nn.Module  # the model trained through (compiled, maybe DDP-wrapped)
    module: torch.nn.Module  # the model itself
    optimizer: torch.optim.Optimizer
    engine: Any
    task: Any
    criterion: Any
    train_loader: Any
    train_batches: int
    global_step: int
    clock: Stopwatch
    instruments: Instruments

    def _first_batch_shapes(self) -> list[int]:
        """The batch sizes this rank's training loop meets: the full one, and a smaller last
        batch where the data does not divide evenly."""
        size = self.train_loader.batch_size or 1
        sampler = getattr(self.train_loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "__len__"):  # (this rank's share, whole)
            count = len(sampler) + int(getattr(sampler, "skip", 0))
        else:
            count = len(self.train_loader.dataset)
        sizes = [min(size, count)]
        last = count % size
        full_batches = count // size
        if last and full_batches < self.train_batches:  # the partial batch is reached
            sizes.append(last)
        return sizes

    @torch.no_grad()
    def _snapshot(self) -> tuple[list[torch.Tensor], dict]:
        return [b.detach().clone() for b in self.module.buffers()], rng.rng_state()

    @torch.no_grad()
    def _restore_snapshot(self, snapshot: tuple[list[torch.Tensor], dict]) -> None:
        buffers, state = snapshot
        for b, saved in zip(self.module.buffers(), buffers):
            b.copy_(saved)
        rng.restore_rng(state)

    def compile_warmup(self) -> float:
        """Compile the training forward and backward before the clock of the first epoch
        starts: one forward and backward per batch shape the loop will meet, on the first
        training batch, after which the gradients, the model's buffers (BatchNorm statistics)
        and every random generator are put back as they were. Returns the seconds it took
        (`compile_time_s`); the validation forward compiles at the first validation (outside
        `epoch_time_s`)."""
        snapshot = self._snapshot()
        try:
            self.model.train()
            x, y = next(iter(self.train_loader))
            x, y = self.to_device(x, y)
            self.clock.start()  # (the batch is fetched: only compiling is timed)
            for size in self._first_batch_shapes():
                with self.engine.autocast():
                    loss = self.task.loss(self.criterion, self.model(x[:size]), y[:size])
                self.engine.backward(loss)
                self.engine.zero_grad(self.optimizer)
            seconds = self.clock.stop()
        finally:
            self._restore_snapshot(snapshot)
        return seconds

    def audit_eager(self) -> None:
        """The layer audit of one eager forward and backward of the first batch, put back as
        after the warm-up. The dtypes are the compiled step's: torch.compile keeps each op's
        dtype."""
        instrument = self.instruments.find(AuditInstrument)
        if instrument is None:
            return
        audit = instrument.audit()
        snapshot = self._snapshot()
        try:
            self.model.train()
            x, y = next(iter(self.train_loader))
            x, y = self.to_device(x, y)
            call = getattr(self.module, "_call_impl", self.module)  # eager, compiled or not
            with audit:
                with self.engine.autocast():
                    loss = self.task.loss(self.criterion, call(x), y)
                self.engine.backward(loss)
                audit.observe_grads()
            self.engine.zero_grad(self.optimizer)
        finally:
            self._restore_snapshot(snapshot)
        instrument.record(audit, self.global_step + 1)
