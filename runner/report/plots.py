"""The comparison's figures (PNG, by matplotlib, imported when drawn): grouped bars of steady
throughput, peak memory and quality per level and model, stacked bars of memory by kind,
validation curves."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from pathlib import Path

from runner import metrics as m
from runner.measure import spread
from runner.report.analysis import (
    MEMORY_METRICS,
    Row,
    SeedGroup,
    all_lm,
    seed_groups,
    seeds_vary,
    timed_targets,
)
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


def _label_bars(ax, bars, texts: Sequence[str], above: Sequence[float] = ()) -> None:
    """Each bar's value written above it (and above its whisker: `above`, the whiskers' lengths
    over the bars)."""
    above = list(above) or [0.0] * len(texts)
    for bar, text, up in zip(bars, texts, above):
        if text:
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height() + bar.get_y() + up),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )


def _groups(rows: Sequence[Row]) -> list[tuple[str, str, SeedGroup]]:
    """(model, label, configuration): one a configuration where seeds vary, else one a run."""
    if seeds_vary(rows):
        return [(g.model, g.label + f" (n={len(g.rows)})", g) for g in seed_groups(rows)]
    return [
        (r.model, label, SeedGroup(label, r.model, [r])) for r, label in zip(rows, bar_labels(rows))
    ]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _speed(group: SeedGroup, lm: bool) -> tuple[float, float, float, str]:
    """(rate, down, up, label): the configuration's mean rate, the whiskers to its steps' p10
    and p90 (the seeds' means), and its label: the rate and its speed-up."""
    rates = [r.throughput for r in group.rows if r.throughput is not None]
    if not rates:
        return math.nan, 0.0, 0.0, ""
    rate = _mean(rates)
    low, high = zip(*(r.spread for r in group.rows))
    down = up = 0.0
    if all(v is not None for v in (*low, *high)):
        down, up = max(rate - _mean(low), 0.0), max(_mean(high) - rate, 0.0)
    # its speed-up as the headline gives it: its mean rate over its baselines' (their seeds')
    bases = list({id(r.base): r.base for r in group.rows if r.base is not None}.values())
    base_rates = [b.throughput for b in bases if b.throughput is not None]
    if base_rates and len(base_rates) == len(bases) and all(r.steady for r in group.rows):
        text = spread.number(rate) + f"\n{rate / _mean(base_rates):.2f}x"
    else:  # (runs made before the steady figure: their train times' ratios)
        ratios = [r.speedup for r in group.rows if r.speedup is not None]
        text = spread.number(rate) + (f"\n{_mean(ratios):.2f}x" if ratios else "")
    return rate, down, up, text


def plot_bars(rows: Sequence[Row], path: Path) -> None:
    """Three panels per model, one bar (or point) a configuration: the steady throughput with
    whiskers to its steps' p10 and p90, labelled with its speed-up; the peak memory; the best
    validation as points with the seeds' std, on an axis zoomed to the values, each model's O0
    drawn as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    groups = _groups(rows)
    series = list(dict.fromkeys(label for _, label, _ in groups))
    lm = all_lm(rows)
    metric, title, scale, spec = (
        (m.BEST_VAL_LOSS, "best val loss (nats/token)", 1.0, ".3f")
        if lm
        else (m.BEST_VAL_ACC, "best val accuracy (%)", 100.0, ".2f")
    )
    unit = "tokens" if lm else "samples"
    fig, (speed, memory, quality) = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(series))
    shown: list[float] = []  # the quality values drawn, with their whiskers (the zoom)
    for i, name in enumerate(series):
        at = {mdl: j + (i - (len(series) - 1) / 2) * width for j, mdl in enumerate(models)}
        chosen = [(mdl, g) for mdl, lbl, g in groups if lbl == name]
        color = f"C{i}"
        cells = [_speed(g, lm) for _, g in chosen]
        bars = speed.bar(
            [at[mdl] for mdl, _ in chosen],
            [c[0] for c in cells],
            width,
            label=name,
            color=color,
            yerr=[[c[1] for c in cells], [c[2] for c in cells]],
            capsize=3,
            ecolor="dimgray",
        )
        _label_bars(speed, bars, [c[3] for c in cells], [c[2] for c in cells])
        peaks = [g.stats(operator.methodcaller("get", m.PEAK_MEM_MB)) for _, g in chosen]
        bars = memory.bar(
            [at[mdl] for mdl, _ in chosen],
            [math.nan if p is None else p[0] for p in peaks],
            width,
            color=color,
        )
        _label_bars(memory, bars, ["" if p is None else f"{p[0]:.3g}" for p in peaks])
        for mdl, g in chosen:
            stats = g.stats(operator.methodcaller("get", metric))
            if stats is None:
                continue
            value, std = stats[0] * scale, stats[1] * scale
            quality.errorbar(at[mdl], value, yerr=std or None, fmt="o", color=color, capsize=4)
            quality.annotate(
                format(value, spec),
                (at[mdl], value + std),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=8,
            )
            shown += [value - std, value + std]
    _baselines(quality, rows, models, metric, scale)
    if shown:  # the axis zoomed to the values (a bar from 0 made 70.65 and 70.35 look alike)
        low, high = min(shown), max(shown)
        pad = max(0.25 * (high - low), 0.002 * scale if not lm else 0.01, 1e-9)
        quality.set_ylim(low - pad, high + 2 * pad)
    speed.set_title(f"steady throughput ({unit}/s; whiskers: the steps' p10-p90)")
    memory.set_title("peak memory (MB)")
    quality.set_title(title + (" (seeds' std)" if seeds_vary(rows) else ""))
    for ax in (speed, memory, quality):
        ax.set_xticks(range(len(models)), models)
        ax.set_xlim(-0.5, len(models) - 0.5)
        ax.grid(axis="y", alpha=0.3)
    for ax in (speed, memory):
        ax.margins(y=0.15)
    speed.legend(title="level", fontsize="small")
    _save(fig, path)


def _baselines(ax, rows: Sequence[Row], models: Sequence[str], metric: str, scale: float) -> None:
    """Each model's O0 run's value (the mean of its seeds) as a dashed line across its group."""
    for j, model in enumerate(models):
        base = [
            r.get(metric) for r in rows if r.model == model and r.level == "O0" and r.get(metric)
        ]
        if base:
            value = _mean(base) * scale
            ax.hlines(value, j - 0.45, j + 0.45, colors="gray", linestyles="--", linewidth=1)
            ax.annotate(
                "O0", (j - 0.45, value), xytext=(2, 2), textcoords="offset points", fontsize=7
            )


def plot_memory(rows: Sequence[Row], path: Path) -> None:
    """Memory by kind: a panel per kind of tensor (weights, fp32 masters, gradients, optimizer
    state, activations), one labelled bar per run on the panel's own scale, so that a kind of
    0.1 MB reads as well beside activations of 30 MB as they do (stacked, it was a sliver)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        (r, label)
        for r, label in zip(rows, bar_labels(rows))
        if any(r.get(m) is not None for m in MEMORY_METRICS)
    ]
    kinds = list(MEMORY_METRICS.items())
    fig, axes = plt.subplots(
        1, len(kinds), figsize=(max(12.0, (0.5 * len(shown) + 1) * len(kinds)), 4.2)
    )
    names = [f"{r.model}\n{label}" for r, label in shown]
    for i, (ax, (metric, kind)) in enumerate(zip(axes, kinds)):
        values = [r.get(metric) for r, _ in shown]
        bars = ax.bar(range(len(shown)), [v or 0.0 for v in values], 0.6, color=f"C{i}")
        _label_bars(ax, bars, ["-" if v is None else f"{v:.3g}" for v in values])
        ax.set_xticks(range(len(shown)), names, fontsize=8, rotation=30 if len(shown) > 3 else 0)
        ax.set_title(kind)
        ax.set_ylim(0, 1.2 * max([v or 0.0 for v in values], default=0.0) or 1.0)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("MB")
    if not shown:
        _legend_or_note(axes[0], False, "no run logged memory by kind (mem_*_mb)")
    fig.suptitle("Memory by kind in one training step (from the tensors; each panel its own scale)")
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
    latest = 0.0  # the longest training time drawn
    for i, r in enumerate(shown):
        # a marker of its own (hollow every other run): runs that reached the same accuracy
        # in an epoch stay apart where their points coincide
        style = {"marker": "osD^v"[i % 5], "markerfacecolor": "none" if i % 2 else None}
        curve = r.quality  # (an epoch logged again: its last value)
        if not curve:
            continue
        epochs = sorted(curve)
        values = [scale * curve[e] for e in epochs]
        label = f"{r.run_name} ({r.status})" if r.status != "FINISHED" else r.run_name
        (line,) = by_epoch.plot(epochs, values, label=label, **style)
        drawn += 1
        elapsed = [r.training_time_to(e) for e in epochs]
        if None not in elapsed:
            by_time.plot(elapsed, values, color=line.get_color(), label=label, **style)
            latest = max(latest, *elapsed)
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
    epochs = sorted({e for r in shown for e in r.quality})
    if 0 < len(epochs) <= 12:  # every epoch a tick (one epoch was ticked 0.95 ... 1.05)
        by_epoch.set_xticks(epochs)
        by_epoch.set_xlim(epochs[0] - 0.5, epochs[-1] + 0.5)
    else:
        by_epoch.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training time (s, the epochs' epoch_time_s summed)")
    by_time.set_xlim(0, 1.05 * latest or None)  # (the last point inside the axes)
    for ax in (by_epoch, by_time):
        ax.set_ylabel(quality)
        ax.grid(alpha=0.3)
    by_epoch.set_title("Validation loss per epoch" if lm else "Validation accuracy per epoch")
    by_time.set_title("... against training time")
    missing = "no run logged val_loss" if lm else "no run logged val_acc"
    _legend_or_note(by_epoch, drawn > 0, missing)
    _legend_or_note(by_time, timed > 0, "no run logged epoch_time_s for its epochs")
    _save(fig, path)
