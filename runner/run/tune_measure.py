"""`trainer.tune`'s measurements: a candidate's steady step time and first-step loss; the choice.

Each candidate (a set of settings on top of the run's config) is built from the plan as the run
would be (`runner.run.build`: the same seed, so the same initial weights), without loader workers,
and trained for a few steps on its first batch by a `Trainer` that reports nowhere: the first step
gives the loss (and, compiled, the compile time), the fastest of the steps after the warm ones the
steady step time. Nothing here touches the run's own parts; the caller keeps the random generators.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from omegaconf import OmegaConf, read_write

from runner.measure.probes import synchronize
from runner.run.distributed import Comm
from runner.run.plan import RunPlan

log = logging.getLogger(__name__)

WARM_STEPS = 2  # steps left out of the steady time (the first one compiles, where compiled)
TIMED_STEPS = 5
# a candidate replaces the fastest so far only when this much faster (noise is not a gain)
MARGIN = 0.03
# the first-step loss a candidate may differ by, relative, per the narrowest compute format
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2, "fp8": 5e-2}


@dataclasses.dataclass
class Row:
    """One candidate as measured: its settings (config keys), steady ms per step (None: not
    measured), compile seconds, first-step loss, and why it was refused or skipped ("" if not)."""

    settings: dict[str, Any]
    steady_ms: Optional[float] = None
    compile_s: float = 0.0
    loss: Optional[float] = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Row:
        return cls(
            dict(data["settings"]),
            data.get("steady_ms"),
            float(data.get("compile_s", 0.0)),
            data.get("loss"),
            str(data.get("note", "")),
        )


def tolerance(compute_dtypes: Sequence[Any]) -> float:
    """The relative first-step loss difference allowed at a level computing in `compute_dtypes`
    (none: fp32, tight; 16-bit and fp8 formats: loose, as their rounding moves with the order of
    the sums)."""
    names = [str(d).replace("torch.", "") for d in compute_dtypes]
    if any("float8" in n or "fp8" in n for n in names):
        return TOLERANCE["fp8"]
    return max([TOLERANCE.get(n, TOLERANCE["float16"]) for n in names] or [TOLERANCE["float32"]])


def with_settings(cfg, settings: Mapping[str, Any]):
    """A copy of the config `cfg` with `settings` (config keys) set."""
    out = copy.deepcopy(cfg)
    with read_write(out):
        for k, v in settings.items():
            OmegaConf.update(out, k, v, merge=False)
    return out


def measure(plan: RunPlan, settings: Mapping[str, Any], device: torch.device) -> Row:
    """Build the run with `settings` and time its steps on its first batch."""
    from runner.run.build import build
    from runner.run.trainer import RunContext, Trainer, trainer_config

    cfg = with_settings(plan.cfg, {**settings, "trainer.num_workers": 0})
    candidate = dataclasses.replace(plan, cfg=cfg, resume=None)
    quiet = logging.getLogger("runner")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the candidates' builds say what the run's will say
    try:
        parts = build(candidate, device, Comm(), wait_for_kernels=False)
    finally:
        quiet.setLevel(level)
    try:
        trainer = Trainer(
            trainer_config(cfg.trainer),
            parts,
            RunContext(on_metrics=lambda metrics, step: None),
            device=device,
        )
        x, y = trainer._to_device(*next(iter(parts.train_loader)))
        trainer.model.train()
        times, first = [], math.nan
        for index in range(WARM_STEPS + TIMED_STEPS):
            synchronize(device)
            start = time.perf_counter()
            loss = trainer.train_step(x, y)
            synchronize(device)
            times.append(time.perf_counter() - start)
            if index == 0:
                first = float(loss)
        # the fastest timed step: what the candidate does on its own (a machine shared with
        # other work only ever adds time to a step, and noise is no property of the settings)
        steady = min(times[WARM_STEPS:])
        compile_s = max(times[0] - steady, 0.0) if cfg.trainer.compile else 0.0
        return Row(dict(settings), steady * 1e3, compile_s, first)
    finally:
        parts.close()


def effective_ms(row: Row, steps: Optional[int]) -> float:
    """A row's cost per step over a run of `steps` steps: its steady time, with its compile
    time shared out over the steps (unknown length: the compile time is not charged)."""
    if row.steady_ms is None or row.note:
        return math.inf
    charge = row.compile_s * 1e3 / steps if steps else 0.0
    return row.steady_ms + charge


def choose(rows: Sequence[Row], steps: Optional[int]) -> Row:
    """The fastest row over a run of `steps` (the first, the untuned settings, unless another
    is MARGIN faster), among those measured and not refused."""
    best = rows[0]
    for row in rows[1:]:
        if effective_ms(row, steps) < effective_ms(best, steps) * (1 - MARGIN):
            best = row
    return best


def refuse_if_loss_differs(row: Row, reference: Optional[float], tol: float) -> None:
    """Mark `row` refused where its first-step loss is beyond `tol` (relative) of `reference`."""
    if row.loss is None or reference is None or row.note:
        return
    delta = abs(row.loss - reference) / max(abs(reference), 1e-12)
    if not math.isfinite(row.loss) or delta > tol:
        row.note = f"refused: first-step loss {row.loss:.6g} vs {reference:.6g} (tolerance {tol:g})"
