"""`trainer.tune`'s data candidate: the DataLoader's worker processes (`trainer.num_workers`).

Where the run reads its data (files: CIFAR, an ImageFolder, token files, the user's own dataset;
not the runner's generated `synthetic` data, which workers have nothing to read for), the
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

The sampler's order is drawn from (seed, epoch) alone, so the batches come in the same order
whatever the worker count; random augmentations draw from each worker's own seed (torch's
seeding: base seed + worker id), so their draws, as in any PyTorch run, follow the count. The
fetches here draw the base seed from torch's generator, which the caller puts back
(runner.run.tune): the run's loaders draw as the run given its count by hand would.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner.run.plan import RunPlan
from runner.run.tune_measure import BUDGET_NOTE, MARGIN, Row

WORKERS = "trainer.num_workers"
KEYS = (WORKERS,)  # the tunable keys this module decides
# the data sources the runner generates in memory: nothing read, nothing for workers to overlap
GENERATED = ("synthetic", "synthetic_text")
COUNTS = (0, 2, 4, 8)  # worker counts tried (with the config's and the CPUs' own, at most 8)
TIMED_ROUNDS = 2  # batches timed per count: this many per worker (at least 3 without workers)
LOADERS = 2  # loaders whose workers start once per run: training and validation


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
    if OmegaConf.select(plan.cfg, "data._target_", default=None) is None and name in GENERATED:
        return f"kept: data={name} is generated in memory, not read (workers gain nothing)"
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
    plan: RunPlan, device: torch.device, free: Sequence[str], budget_s: float, started: float
) -> list[Row]:
    """A row per worker count (none where the workers are no candidate), while tuning, which
    `started` (time.perf_counter), is within `budget_s`."""
    if WORKERS not in free or not_read(plan):
        return []
    from runner.components.data import build_datasets

    bundle = build_datasets(plan.cfg.data, plan.specs.get("data"))
    rows = []
    for count in counts(plan.cfg.trainer.num_workers, cpus()):
        spent = time.perf_counter() - started
        if spent > budget_s:
            note = f"skipped: tuning took {spent:.0f} s, nothing {BUDGET_NOTE}"
            rows.append(Row({WORKERS: count}, note=note))
            continue
        rows.append(_fetch(plan, bundle, count, device))
    return rows


def _fetch(plan: RunPlan, bundle: Any, count: int, device: torch.device) -> Row:
    """Fetch batches from a training loader with `count` workers: first the batches it asks its
    workers for at the start (while they start, the ready ones pile up), then TIMED_ROUNDS more
    per worker, timed: the pace of workers that are never idle."""
    from runner.components.loaders import build_loaders, shutdown_workers

    cfg = plan.cfg.trainer
    train, val = build_loaders(bundle, cfg.batch_size, count, device.type, cfg.seed)
    skip = max(count * (train.prefetch_factor or 0), 1)
    try:
        if len(train) < skip + 2:
            return Row({WORKERS: count}, note="not measured: the epoch has too few batches")
        timed = min(max(TIMED_ROUNDS * count, 3), len(train) - skip)
        start = time.perf_counter()
        batches = iter(train)
        next(batches)
        first = time.perf_counter() - start
        for _ in range(skip - 1):
            next(batches)
        ready = time.perf_counter()
        for _ in range(timed):
            next(batches)
        per_batch = (time.perf_counter() - ready) / timed
        # a worker's first batch took `count` batch intervals of the loader's pace: the rest of
        # the wait for it was the workers' start
        startup = max(first - count * per_batch, 0.0) if count else 0.0
        return Row({WORKERS: count}, per_batch * 1e3, startup)
    finally:
        shutdown_workers(train, val)


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
    """Set the data keys' values and reasons on `tuning` (runner.run.tune.Tuning) from the
    loader's `rows`, against the chosen model settings' steady `step_ms`."""
    tuning.loader = list(rows)
    if WORKERS not in free:
        return
    why = not_read(plan)
    best = choose(rows, step_ms, steps) if not why else None
    if why:
        reason = why
    elif best is None:
        reason = "kept: " + (rows[0].note if rows else "not measured")
    else:
        count = int(best.settings[WORKERS])
        changed = count != int(plan.cfg.trainer.num_workers)
        reason = ("tuned: " if changed else "kept: ") + _why(best, step_ms)
        tuning.settings[WORKERS] = count
    tuning.reasons[WORKERS] = reason


def _why(best: Row, step_ms: float) -> str:
    pace = f"{best.steady_ms:.1f} ms a batch against a {step_ms:.1f} ms step"
    if not best.settings[WORKERS]:
        return f"no workers: {pace}"
    if best.steady_ms <= step_ms:
        return f"the fewest workers that keep up: {pace}"
    return f"the fastest measured, the loop still waits for its data: {pace}"


def table(rows: Sequence[Row], settings: Mapping[str, Any]) -> list[str]:
    """tune.md's loader section: each worker count's ms per batch, start-up s and the chosen."""
    if not rows:
        return []
    chosen = settings.get(WORKERS)
    lines = [
        "| trainer.num_workers | ms/batch | start-up s | chosen |",
        "|---|---|---|---|",
    ]
    for row in rows:
        count = row.settings[WORKERS]
        ms = f"{row.steady_ms:.1f}" if row.steady_ms is not None else "-"
        mark = "yes" if count == chosen and not row.note else row.note
        lines.append(f"| {count} | {ms} | {row.compile_s:.2f} | {mark} |")
    return [*lines, ""]
