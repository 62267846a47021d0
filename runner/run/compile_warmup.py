"""With `trainer.compile`: the compile warm-up before the first epoch's clock starts, and the layer
audit of one eager step (hooks inside the compiled graph would recompile it); both leave the run
exactly as if nothing had happened (README.md beside this file). Each takes the trainer whose model
it steps on its first training batch, and puts back the gradients, the model's buffers and every
random generator."""

from __future__ import annotations

from typing import Any

import torch

from runner.measure.audit import AuditInstrument
from runner.run import rng


def batch_sizes(trainer: Any) -> list[int]:
    """The batch sizes `trainer`'s training loop meets on this rank: the full one, and a
    smaller last batch where the data does not divide evenly."""
    loader = trainer.train_loader
    size = loader.batch_size or 1
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and hasattr(sampler, "__len__"):  # (this rank's share, whole)
        count = len(sampler) + int(getattr(sampler, "skip", 0))
    else:
        count = len(loader.dataset)
    sizes = [min(size, count)]
    last = count % size
    full_batches = count // size
    if last and full_batches < trainer.train_batches:  # the partial batch is reached
        sizes.append(last)
    return sizes


@torch.no_grad()
def _snapshot(module: torch.nn.Module) -> tuple[list[torch.Tensor], dict]:
    return [b.detach().clone() for b in module.buffers()], rng.rng_state()


@torch.no_grad()
def _restore(module: torch.nn.Module, snapshot: tuple[list[torch.Tensor], dict]) -> None:
    buffers, state = snapshot
    for b, saved in zip(module.buffers(), buffers):
        b.copy_(saved)
    rng.restore_rng(state)


def compile_warmup(trainer: Any) -> float:
    """Compile `trainer`'s training forward and backward before the clock of the first epoch
    starts: one forward and backward per batch shape the loop will meet, on the first training
    batch, after which the gradients, the model's buffers (BatchNorm statistics) and every
    random generator are put back as they were. Returns the seconds it took (`compile_time_s`);
    the validation forward compiles at the first validation (outside `epoch_time_s`)."""
    engine = trainer.engine
    snapshot = _snapshot(trainer.module)
    try:
        trainer.model.train()
        x, y = trainer.to_device(*next(iter(trainer.train_loader)))
        trainer.clock.start()  # (the batch is fetched: only compiling is timed)
        for size in batch_sizes(trainer):
            with engine.autocast():
                loss = trainer.task.loss(trainer.criterion, trainer.model(x[:size]), y[:size])
            engine.backward(loss)
            engine.zero_grad(trainer.optimizer)
        seconds = trainer.clock.stop()
    finally:
        _restore(trainer.module, snapshot)
    return seconds


def audit_eager(trainer: Any) -> None:
    """The layer audit of one eager forward and backward of `trainer`'s first batch, put back as
    after the warm-up. The dtypes are the compiled step's: torch.compile keeps each op's dtype."""
    instrument = trainer.instruments.find(AuditInstrument)
    if instrument is None:
        return
    engine, module = trainer.engine, trainer.module
    audit = instrument.audit()
    snapshot = _snapshot(module)
    try:
        trainer.model.train()
        x, y = trainer.to_device(*next(iter(trainer.train_loader)))
        call = getattr(module, "_call_impl", module)  # eager, compiled or not
        with audit:
            with engine.autocast():
                loss = trainer.task.loss(trainer.criterion, call(x), y)
            engine.backward(loss)
            audit.observe_grads()
        engine.zero_grad(trainer.optimizer)
    finally:
        _restore(module, snapshot)
    instrument.record(audit, trainer.global_step + 1)
