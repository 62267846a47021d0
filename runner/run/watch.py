"""What watches a trainer's steps: the instruments of runner.measure (entered once a step), given
what the trainer knows. The step timer (every step: runner.run.step_timing), memory by kind (until
a step that stepped was measured), the range probe of `trainer.diagnose_every_n_steps` (on the
steps it diagnoses), with a layer plan the layer audit (the first step unless compiled, and the
diagnosed ones) and, on a CUDA device, the device's busy share (a few steps after the warm-up,
once: `device_busy_frac`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from runner import metrics as m
from runner.errors import LayerPlanError
from runner.measure import busy
from runner.measure.audit import AuditInstrument, never
from runner.measure.diagnostics import run_formats
from runner.measure.instruments import Instruments
from runner.measure.memory import MB, MemoryInstrument
from runner.measure.run_diagnostics import RangeInstrument, RunDiagnostics
from runner.run import cuda_graphs, fsdp
from runner.run.context import nowhere
from runner.run.step_timing import timing_instrument

log = logging.getLogger("runner.run.trainer")  # (the trainer's lines: they say what it measured)


def _allgather_mb(module: Any) -> dict[str, float]:
    """A sharded run's memory beside the shards: what one unit's all-gather holds."""
    return {m.MEM_ALLGATHER_MB: fsdp.allgather_bytes(module) / MB}


def diagnostics(trainer: Any) -> Optional[RunDiagnostics]:
    """The range diagnostics of `trainer.diagnose_every_n_steps` (None when 0: no probe), whose
    files go where the trainer's context says."""
    every = trainer.cfg.diagnose_every_n_steps
    if every <= 0:
        return None
    formats = run_formats(trainer.engine.properties.compute_dtypes)
    context = trainer.context
    return RunDiagnostics(every, formats, context.artifact_dir, context.on_artifact)


def instruments(trainer: Any, ranges: Optional[RunDiagnostics], audit: bool) -> Instruments:
    """The instruments that watch `trainer`'s steps, in the order they start: the step timer,
    memory by kind, the range probe on the steps `ranges` diagnoses (None: none), and with
    `audit` and a layer plan the layer audit."""
    context, module = trainer.context, trainer.module
    timing = timing_instrument(
        trainer.cfg,
        trainer.device,
        task=trainer.task,
        engine=trainer.engine,
        model=module,
        loader=trainer.train_loader,
        comm=trainer.comm,
        flops_per_sample=trainer.flops_per_sample,
        logger=log,
        on_artifact=context.on_artifact,  # (the steady step times: speed-up intervals)
        artifact_dir=context.artifact_dir,
        captures=_captures(trainer),
    )
    extra = (
        (lambda: {m.MEM_ALLGATHER_MB: fsdp.allgather_bytes(module) / MB})
        if trainer.sharded
        else None
    )
    memory = MemoryInstrument(module, trainer.optimizer, trainer.engine, trainer.memory, extra)
    probe = None
    if ranges is not None:
        probe = RangeInstrument(ranges, module, trainer.engine, context.on_metrics)
    layers = None
    if audit and trainer.layer_plan is not None:
        layers = AuditInstrument(
            trainer.layer_plan,
            module,
            context.on_metrics,
            error=LayerPlanError,
            first=not trainer.cfg.compile,  # (a compiled run audits an eager step: audit_eager)
            also=probe.due if probe is not None else never,
            # files only where they go somewhere (a tuning trial or a pre-flight: nowhere)
            writes=trainer.comm.is_main
            and (context.layers_dir is not None or context.on_artifact is not None),
            folder=context.layers_dir,
            on_artifact=context.on_artifact,
            logger=log,
        )
    return Instruments(timing, memory, probe, layers, busy_instrument(trainer))


def _captures(trainer: Any) -> Optional[Callable[[], int]]:
    """With `trainer.cuda_graphs=step`: how many times the whole step was captured so far (the
    trainer's graph, read at each step: it is made after the instruments)."""
    if cuda_graphs.mode(trainer.cfg.cuda_graphs) != cuda_graphs.STEP:
        return None
    return lambda: trainer.whole_step.captures if trainer.whole_step is not None else 0


def busy_instrument(trainer: Any) -> Optional[busy.BusyInstrument]:
    """On a CUDA device, where the run's metrics go somewhere (not a tuning trial's), on its
    main process: the device's busy share of a few steps after the session's warm-up (and the
    whole step's capture, `trainer.cuda_graphs=step`), logged once as `device_busy_frac`."""
    context, cfg = trainer.context, trainer.cfg
    if trainer.device.type != "cuda" or context.on_metrics is nowhere or not trainer.comm.is_main:
        return None
    on = [busy.GRAPHS] if cuda_graphs.mode(cfg.cuda_graphs) == cuda_graphs.STEP else []
    on += [busy.COMPILE] if cfg.compile else []
    first = max(cfg.warmup_steps, cuda_graphs.WARMUP_STEPS + 1) + 2

    def report(frac: float, step: int) -> None:
        context.on_metrics({m.DEVICE_BUSY_FRAC: frac}, step)

    return busy.BusyInstrument(trainer.device, first, report, on=on, logger=log)


def busy_frac(trainer: Any) -> Optional[float]:
    """The device's busy share `trainer` measured (None: not measured, or not yet)."""
    found = trainer.instruments.find(busy.BusyInstrument)
    return None if found is None else found.frac
