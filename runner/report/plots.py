"""The comparison's figures (PNG, by matplotlib, imported when drawn): grouped bars of steady
throughput, peak memory and quality per level and model, stacked bars of memory by kind,
validation curves."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from pathlib import Path

from runner.measure.timing import SAMPLES_PER_S, TOKENS_PER_S
from runner.report.analysis import (
    MEMORY_METRICS,
    Row,
    SeedGroup,
    all_lm,
    seed_groups,
    seeds_vary,
    timed_targets,
)
from runner.tracking import metrics as m
from runner.tracking.varying import varying_params


def bar_labels(rows: Sequence[Row]) -> list[str]:
    """Each run's label within its model: the level, plus whatever else varies (dtype, batch size,
    optimizer, the params that differ, as `lr=0.05`), so that two runs never share a bar; where
    two runs still look alike, the start of their run ids."""
    keys = ("optimizer", "batch_size", "accumulate")
    varies = {key: len({getattr(r, key) for r in rows}) > 1 for key in keys}
    varying = varying_params(rows)
    labels = []
    for r in rows:
        label = r.level + (" bf16" if "bfloat16" in r.dtype else "")
        if varies["optimizer"]:
            label += f" {r.optimizer}"
        if varies["batch_size"] or varies["accumulate"]:
            label += f" b{r.batch_size}" + (f"x{r.accumulate}" if r.accumulate > 1 else "")
        for key in varying:
            label += f" {key.rsplit('.', 1)[-1]}={r.params.get(key, '-')}"
        labels.append(label)
    seen: dict[tuple[str, str], int] = {}
    for r, label in zip(rows, labels):
        seen[(r.model, label)] = seen.get((r.model, label), 0) + 1
    return [
        f"{label} ({r.run_id[:8]})" if seen[(r.model, label)] > 1 else label
        for r, label in zip(rows, labels)
    ]


def _legend_or_note(ax, shown: bool, note: str) -> None:
    """The legend where the axes show something; otherwise `note`, in their middle."""
    if shown:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: Path) -> None:
    """A figure laid out, written to `path` at 100 dpi and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bars(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    if seeds_vary(rows):  # one bar per configuration: the seeds' mean, their std as error bar
        groups = [(g.model, g.label + f" (n={len(g.rows)})", g) for g in seed_groups(rows)]
    else:
        groups = [
            (r.model, label, SeedGroup(label, r.model, [r]))
            for r, label in zip(rows, bar_labels(rows))
        ]
    series = list(dict.fromkeys(label for _, label, _ in groups))
    lm = all_lm(rows)
    quality = (
        (m.BEST_VAL_LOSS, "best val loss (nats/token)", 1.0)
        if lm
        else (m.BEST_VAL_ACC, "best val accuracy (%)", 100.0)
    )
    panels = [  # speed: the steady throughput (runner.measure.timing), higher is faster
        (TOKENS_PER_S, "steady throughput (tokens/s)", 1.0)
        if lm
        else (SAMPLES_PER_S, "steady throughput (samples/s)", 1.0),
        (m.PEAK_MEM_MB, "peak memory (MB)", 1.0),
        quality,
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(series))
    for ax, (metric, title, scale) in zip(axes, panels):
        for i, name in enumerate(series):
            values, errors = [], []
            for model in models:
                match = [g for mdl, lbl, g in groups if mdl == model and lbl == name]
                stats = match[0].stats(operator.methodcaller("get", metric)) if match else None
                values.append(math.nan if stats is None else stats[0] * scale)
                errors.append(0.0 if stats is None else stats[1] * scale)
            positions = [m + (i - (len(series) - 1) / 2) * width for m in range(len(models))]
            ax.bar(
                positions,
                values,
                width,
                label=name,
                yerr=errors if any(errors) else None,
                capsize=3,
            )
        ax.set_xticks(range(len(models)), models)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(title="level", fontsize="small")
    _save(fig, path)


def plot_memory(rows: Sequence[Row], path: Path) -> None:
    """One stacked bar per run (labelled by model and level): the MB of each kind of tensor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        (r, label)
        for r, label in zip(rows, bar_labels(rows))
        if any(r.get(m) is not None for m in MEMORY_METRICS)
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(shown) + 3), 5))
    bottoms = [0.0] * len(shown)
    positions = range(len(shown))
    for metric, name in MEMORY_METRICS.items():
        values = [r.get(metric) or 0.0 for r, _ in shown]
        ax.bar(positions, values, 0.6, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(list(positions), [f"{r.model}\n{label}" for r, label in shown])
    ax.set_ylabel("MB")
    ax.set_title("Memory by kind in one training step (from the tensors)")
    ax.grid(axis="y", alpha=0.3)
    _legend_or_note(ax, bool(shown), "no run logged memory by kind (mem_*_mb)")
    _save(fig, path)


def plot_curves(rows: Sequence[Row], path: Path) -> None:
    """Each run's validation (accuracy, or every run a language model's: loss) per epoch, and the
    same against its training time so far (the epochs' `epoch_time_s` summed: where a level's
    faster steps get it to an accuracy sooner), with each O0 baseline's target (the time to O0's
    best columns) as a dashed line."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = all_lm(rows)  # language models: the loss per epoch
    scale = 1.0 if lm else 100.0
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(14, 5))
    drawn = timed = 0  # the runs drawn per epoch, and against their training time
    shown = [r for r in rows if r.is_lm == lm]  # (a language model's loss is no accuracy)
    for r in shown:
        curve = r.quality  # (an epoch logged again: its last value)
        if not curve:
            continue
        epochs = sorted(curve)
        values = [scale * curve[e] for e in epochs]
        label = f"{r.run_name} ({r.status})" if r.status != "FINISHED" else r.run_name
        (line,) = by_epoch.plot(epochs, values, marker="o", label=label)
        drawn += 1
        elapsed = [r.training_time_to(e) for e in epochs]
        if None not in elapsed:
            by_time.plot(elapsed, values, marker="o", color=line.get_color(), label=label)
            timed += 1
    for name, target in timed_targets(shown):
        for ax in (by_epoch, by_time):
            ax.axhline(scale * target, linestyle="--", color="gray", linewidth=1)
        by_time.annotate(
            f"target ({name})",
            (0, scale * target),
            xycoords=("axes fraction", "data"),
            xytext=(4, 3),
            textcoords="offset points",
            fontsize=8,
            color="gray",
        )
    quality = "validation loss (nats/token)" if lm else "validation accuracy (%)"
    by_epoch.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training time (s, the epochs' epoch_time_s summed)")
    by_time.set_xlim(left=0)
    for ax in (by_epoch, by_time):
        ax.set_ylabel(quality)
        ax.grid(alpha=0.3)
    by_epoch.set_title("Validation loss per epoch" if lm else "Validation accuracy per epoch")
    by_time.set_title("... against training time")
    missing = "no run logged val_loss" if lm else "no run logged val_acc"
    _legend_or_note(by_epoch, drawn > 0, missing)
    _legend_or_note(by_time, timed > 0, "no run logged epoch_time_s for its epochs")
    _save(fig, path)
