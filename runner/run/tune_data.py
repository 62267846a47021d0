"""`trainer.tune`'s data candidates: the DataLoader's worker processes (`trainer.num_workers`)
and, on CUDA, pinned host memory (`trainer.pin_memory`).

Where a sample costs something to make (files read: CIFAR, an ImageFolder, token files, the
user's own dataset; the runner's `synthetic` images, each drawn and upsampled; not
`synthetic_text`, whose items are slices of tokens in memory: workers have nothing to overlap), the
training loader is built as the run builds it (`runner.components.loaders.build_loaders`: the
same sampler, batch size, pinned memory on CUDA, persistent workers) for a few worker counts,
and a few batches are fetched from each. A row per count: the steady ms per batch (the batches
after those the loader asks for at its start), and the start-up seconds (the workers' start,
paid once per loader: the workers persist across epochs).

The choice, against the steady step time of the model settings chosen: without workers the
loop fetches each batch itself (the step pays step + batch); with workers it waits only where
a batch comes slower than a step (max(step, batch)), plus the start-up of the training and the
validation loaders spread over the run's steps. The fewest workers within MARGIN of the
cheapest win (the loop no longer waits; more workers only hold memory and cores).

Pinned memory (on by default on CUDA) is tried off at the chosen count, each batch copied to the
GPU as the trainer copies it (non-blocking) and waited for: it is turned off only where that is
PIN_MARGIN faster. A CPU run never pins: nothing to measure.

The sampler's order is drawn from (seed, epoch) alone, so the batches come in the same order
whatever the worker count; random augmentations draw from each worker's own seed (torch's
seeding: base seed + worker id), so their draws, as in any PyTorch run, follow the count. The
fetches here draw the base seed from torch's generator, which the caller puts back
(runner.run.tune): the run's loaders draw as the run given its count by hand would.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner.measure.probes import synchronize
from runner.run.plan import RunPlan
from runner.run.tune_measure import BUDGET_NOTE, MARGIN, Row

log = logging.getLogger(__name__)

WORKERS, PIN = "trainer.num_workers", "trainer.pin_memory"
KEYS = (WORKERS, PIN)  # the tunable keys this module decides
# the data sources held in memory whose items are slices (a batch costs its collation alone):
# nothing for workers to overlap (data=synthetic draws and upsamples each image: a candidate)
IN_MEMORY = ("synthetic_text",)
COUNTS = (0, 2, 4, 8)  # worker counts tried (with the config's and the CPUs' own, at most 8)
TIMED_ROUNDS = 2  # batches timed per count: this many per worker (at least 3 without workers)
LOADERS = 2  # loaders whose workers start once per run: training and validation
# unpinned replaces the default (pinned, on CUDA) only when this much faster: a few batches'
# copies are noisy, and pinning is what a careful engineer sets for a GPU
PIN_MARGIN = 0.10


def cpus() -> int:
    """The CPUs this process may run on (its affinity, where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def facts(free: Sequence[str]) -> dict[str, Any]:
    """What the data rows depend on beyond the run's config (runner.run.tune_cache.key)."""
    return {"cpus": cpus()} if any(k in free for k in KEYS) else {}


def not_read(plan: RunPlan) -> Optional[str]:
    """Why the loader's workers are no candidate for this run's data (None: they are)."""
    name = OmegaConf.select(plan.cfg, "data.name", default=None)
    if OmegaConf.select(plan.cfg, "data._target_", default=None) is None and name in IN_MEMORY:
        return (
            f"kept: data={name} is sliced from tokens in memory: a batch costs its collation "
            "alone (workers gain nothing)"
        )
    return None


def counts(current: int, cpu_count: int) -> list[int]:
    """The worker counts to try: none, 2, 4, 8 and all the CPUs, at most 8 and at most the
    CPUs, and the config's own count."""
    top = min(8, cpu_count)
    return sorted({c for c in (*COUNTS, top) if c <= top} | {int(current)})


def is_data_row(row: Mapping[str, Any] | Row) -> bool:
    settings = row.settings if isinstance(row, Row) else row.get("settings", {})
    return bool(settings) and all(k in KEYS for k in settings)


def split(rows: Sequence[Row]) -> tuple[list[Row], list[Row]]:
    """(the model's rows, the loader's rows) of a tuning's rows, as measured or cached."""
    return [r for r in rows if not is_data_row(r)], [r for r in rows if is_data_row(r)]


def measure(
    plan: RunPlan,
    device: torch.device,
    free: Sequence[str],
    budget: tuple[float, float],
    step_ms: Optional[float],
    steps: Optional[int],
) -> list[Row]:
    """A row per worker count (where the workers are a candidate), then, on CUDA where pinned
    memory is free to tune, one without it at the count chosen; while tuning is within its
    budget (`budget`: its seconds and the time.perf_counter it started at). `step_ms`: the
    chosen model settings' steady step."""
    workers = WORKERS in free and not not_read(plan)
    pin = PIN in free and device.type == "cuda"
    if not (workers or pin):
        return []
    from runner.components.data import build_datasets

    keys = [key for key, tried in ((WORKERS, workers), (PIN, pin)) if tried]
    log.info("trainer.tune: timing the data loader for %s", ", ".join(keys))
    bundle = build_datasets(plan.cfg.data, plan.specs.get("data"))

    def timed(settings: dict[str, Any]) -> Row:
        spent = time.perf_counter() - budget[1]
        if spent > budget[0]:
            return Row(settings, note=f"skipped: tuning took {spent:.0f} s, nothing {BUDGET_NOTE}")
        return _fetch(plan, bundle, settings, device)

    count = int(plan.cfg.trainer.num_workers)
    rows = [timed({WORKERS: c}) for c in counts(count, cpus())] if workers else []
    best = choose(rows, step_ms, steps)
    count = int(best.settings[WORKERS]) if best is not None else count
    if pin:
        rows += [] if workers else [timed({WORKERS: count})]
        rows.append(timed({WORKERS: count, PIN: False}))
    return rows


def _fetch(plan: RunPlan, bundle: Any, settings: Mapping[str, Any], device: torch.device) -> Row:
    """Fetch batches from a training loader with `settings` and copy them to `device`: first
    the batches it asks its workers for at the start (while they start, the ready ones pile up),
    then TIMED_ROUNDS more per worker, timed: the pace of workers that are never idle."""
    from runner.components.loaders import build_loaders, shutdown_workers

    cfg = plan.cfg.trainer
    count, pin = int(settings[WORKERS]), settings.get(PIN, cfg.pin_memory)
    train, val = build_loaders(bundle, cfg.batch_size, count, device.type, cfg.seed, pin_memory=pin)
    skip = max(count * (train.prefetch_factor or 0), 1)
    try:
        if len(train) < skip + 2:
            return Row(dict(settings), note="not measured: the epoch has too few batches")
        timed = min(max(TIMED_ROUNDS * count, 3), len(train) - skip)
        start = time.perf_counter()
        batches = iter(train)
        _copy(next(batches), device)
        first = time.perf_counter() - start
        for _ in range(skip - 1):
            _copy(next(batches), device)
        ready = time.perf_counter()
        for _ in range(timed):
            _copy(next(batches), device)
        per_batch = (time.perf_counter() - ready) / timed
        # a worker's first batch took `count` batch intervals of the loader's pace: the rest of
        # the wait for it was the workers' start
        startup = max(first - count * per_batch, 0.0) if count else 0.0
        return Row(dict(settings), per_batch * 1e3, startup)
    finally:
        shutdown_workers(train, val)


def _copy(batch: Any, device: torch.device) -> None:
    """A batch to `device` as the trainer copies it (non-blocking), and waited for."""
    if device.type != "cpu":
        for part in batch if isinstance(batch, (tuple, list)) else (batch,):
            if isinstance(part, torch.Tensor):
                part.to(device, non_blocking=True)
    synchronize(device)


def cost_ms(row: Row, step_ms: float, steps: Optional[int]) -> float:
    """A worker count's time per training step: the step, and the batch where the loop waits
    for it, with the workers' start-up spread over the run's `steps` (unknown: not charged)."""
    if row.steady_ms is None or row.note:
        return math.inf
    count = int(row.settings[WORKERS])
    per_step = step_ms + row.steady_ms if count == 0 else max(step_ms, row.steady_ms)
    charge = LOADERS * row.compile_s * 1e3 / steps if steps and count else 0.0
    return per_step + charge


def choose(rows: Sequence[Row], step_ms: Optional[float], steps: Optional[int]) -> Optional[Row]:
    """The fewest workers within MARGIN of the cheapest count (None: none was measured)."""
    if step_ms is None:
        return None
    costs = [(cost_ms(r, step_ms, steps), int(r.settings[WORKERS]), r) for r in rows]
    best = min((c for c, _, _ in costs), default=math.inf)
    if not math.isfinite(best):
        return None
    return min((n, r) for c, n, r in costs if c <= best * (1 + MARGIN))[1]


def decide(
    tuning: Any,
    plan: RunPlan,
    rows: Sequence[Row],
    free: Sequence[str],
    step_ms: Optional[float],
    steps: Optional[int],
) -> None:
    """Set the data keys' values and reasons on `tuning` (runner.run.tune_decision.Tuning) from the
    loader's `rows`, against the chosen model settings' steady `step_ms`."""
    tuning.loader = list(rows)
    counted = [r for r in rows if PIN not in r.settings]
    if WORKERS in free:
        why = not_read(plan)
        best = choose(counted, step_ms, steps) if not why else None
        if why:
            reason = why
        elif best is None:
            reason = "kept: " + (counted[0].note if counted else "not measured")
        else:
            count = int(best.settings[WORKERS])
            changed = count != int(plan.cfg.trainer.num_workers)
            reason = ("tuned: " if changed else "kept: ") + _why(best, step_ms)
            tuning.settings[WORKERS] = count
        tuning.reasons[WORKERS] = reason
    if PIN in free:
        tuning.reasons[PIN] = _pin(tuning, rows, counted)


def _pin(tuning: Any, rows: Sequence[Row], counted: Sequence[Row]) -> str:
    """Why pinned memory has its value (set on `tuning` where it changes: off only where a batch,
    copied to the GPU, comes PIN_MARGIN faster without it at the chosen worker count; else the
    config's null, which pins on CUDA)."""
    unpinned = [r for r in rows if r.settings.get(PIN) is False]
    if not unpinned:
        return "kept: not measured"
    off = unpinned[0]
    pinned = [r for r in counted if r.settings[WORKERS] == off.settings[WORKERS]]
    if off.note or not pinned or pinned[0].steady_ms is None:
        return "kept: " + (off.note or "pinned was not measured")
    on = pinned[0].steady_ms
    pace = f"{off.steady_ms:.1f} ms a batch unpinned, {on:.1f} pinned (copied to the GPU)"
    if off.steady_ms < on * (1 - PIN_MARGIN):
        tuning.settings[PIN] = False
        return f"tuned: {pace}"
    return f"kept: pinned measured as fast or faster: {pace}"


def _why(best: Row, step_ms: float) -> str:
    pace = f"{best.steady_ms:.1f} ms a batch against a {step_ms:.1f} ms step"
    if not best.settings[WORKERS]:
        return f"no workers: {pace}"
    if best.steady_ms <= step_ms:
        return f"the fewest workers that keep up: {pace}"
    return f"the fastest measured, the loop still waits for its data: {pace}"


def table(rows: Sequence[Row], settings: Mapping[str, Any]) -> list[str]:
    """tune.md's loader section: each loader's ms per batch, start-up s and the chosen."""
    if not rows:
        return []
    count, pinned = settings.get(WORKERS), settings.get(PIN) is not False
    lines = ["| loader | ms/batch | start-up s | chosen |", "|---|---|---|---|"]
    for row in rows:
        name = ", ".join(f"{k}={str(v).lower()}" for k, v in row.settings.items())
        ms = f"{row.steady_ms:.1f}" if row.steady_ms is not None else "-"
        chosen = (count is None or row.settings[WORKERS] == count) and (
            PIN in row.settings
        ) != pinned
        mark = "yes" if chosen and not row.note else row.note
        lines.append(f"| {name} | {ms} | {row.compile_s:.2f} | {mark} |")
    return [*lines, ""]
