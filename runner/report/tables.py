"""The comparison as text: the Markdown page (the headline, every column a row per run, the seeds'
table, the notes, the figures) and the CSV file."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner import metrics as m
from runner.config.formats import SHORT_NAMES
from runner.measure import spread
from runner.metrics import LAYERS_IN, MFU, SAMPLES_PER_S, TOKENS_PER_S, WARMUP_TIME_S, spread_names
from runner.report import headline
from runner.report.analysis import (
    DEVICE_BUSY,
    LM_METRICS,
    MEMORY_METRICS,
    MEMORY_TOTAL,
    METRICS,
    TARGET_GAP,
    TIMING_METRICS,
    Row,
    SeedGroup,
    all_lm,
    seed_groups,
    seeds_vary,
    tuned_settings,
)
from runner.report.headline import reach_cell
from runner.report.notes import (
    TUNED_TITLE,
    clip,
    headline_notes,
    run_lists,
    table_notes,
)
from runner.tracking.varying import SEED_PARAMS, display_names, tuned_keys, varying_params

ARTIFACT_DIR = "report"
TABLE_MD, TABLE_CSV = "comparison.md", "comparison.csv"
MEMORY_PNG = "memory_by_kind.png"


def figure_files(rows: Sequence[Row]) -> tuple[str, str]:
    """The file names of the bars (throughput, memory, quality) and of the curves: of the loss
    where every run is a language model (what the figures draw then), else of the accuracy."""
    if all_lm(rows):
        return "time_memory_loss.png", "val_loss_curves.png"
    return "time_memory_accuracy.png", "val_acc_curves.png"


def _mean_std(stats: tuple[float, float, int] | None, spec: str, scale: float = 1.0) -> str:
    if stats is None:
        return "-"
    mean, std, _ = stats
    return f"{format(mean * scale, spec)} ± {format(std * scale, spec)}"


def _reach_stats(group: SeedGroup) -> str:
    """The seeds' speedup to O0's best, saying how many of them got there where some did not
    (a seed that never reached the target has no speedup to average)."""
    tried = [r.reach for r in group.rows if r.reach is not None]
    reached = sum(reach.epoch is not None for reach in tried)
    cell = _mean_std(group.stats(lambda r: r.reach_speedup), ".2f")
    return cell + (f" ({reached} of {len(tried)} reached)" if reached < len(tried) else "")


def render_seed_table(rows: Sequence[Row]) -> list[str]:
    """Markdown lines: one row per configuration, its seeds aggregated as mean ± std (sample
    standard deviation) with the number of seeds; empty when no seed varies."""
    if not seeds_vary(rows):
        return []
    lm = bool(rows) and all(r.is_lm for r in rows)
    quality, title, scale = (
        (m.BEST_VAL_LOSS, "best val loss", 1.0)
        if lm
        else (m.BEST_VAL_ACC, "best val acc (%)", 100.0)
    )
    lines = [
        "Across seeds (mean ± sample std over the runs of each configuration that differ only "
        "in " + ", ".join(f"`{k}`" for k in SEED_PARAMS if k in varying_params(rows)) + "):",
        "",
        f"| model | configuration | seeds | {title} | train time (s) | "
        "peak memory (MB) | speedup vs O0 | memory vs O0 | speedup to O0's best |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in seed_groups(rows):
        lines.append(
            "| "
            + " | ".join(
                [
                    g.model,
                    g.label,
                    str(len(g.rows)),
                    _mean_std(g.stats(lambda r: r.get(quality)), ".4f" if lm else ".2f", scale),
                    _mean_std(g.stats(lambda r: r.get(m.TRAIN_TIME_S)), ".1f"),
                    _mean_std(g.stats(lambda r: r.get(m.PEAK_MEM_MB)), ".0f"),
                    _mean_std(g.stats(lambda r: r.speedup), ".2f"),
                    _mean_std(g.stats(lambda r: r.memory_ratio), ".2f"),
                    _reach_stats(g),
                ]
            )
            + " |"
        )
    return lines + [""]


# the layer audit's count of layers per observed format (runner.measure.audit)
LAYER_FORMATS = tuple(SHORT_NAMES.values())  # fp32, bf16, fp16, fp8
LAYERS_TITLE = "layers " + "/".join(LAYER_FORMATS)
COLUMNS = [
    "run",
    "model",
    "level",
    "dtype",
    LAYERS_TITLE,
    "optimizer",
    "batch size",
    "status",
    "best val acc (%)",
    "train time (s)",
    "throughput (samples/s)",
    "mfu (%)",
    "warm-up (s)",
    "peak memory (MB)",
    "skipped steps",
    "weights (MB)",
    "masters (MB)",
    "grads (MB)",
    "optimizer state (MB)",
    "activations (MB)",
    "state total (MB)",
    "speedup vs O0",
    "memory vs O0",
    "time to O0's best (s)",
    "speedup to O0's best",
]


def layer_counts(row: Row) -> str:
    """How many layers computed in fp32 / bf16 / fp16 / fp8 at the run's first step (the layer
    audit's `layers_<format>` metrics), "-" for a run without them."""
    values = [row.get(f"{LAYERS_IN}{fmt}") for fmt in LAYER_FORMATS]
    if all(v is None for v in values):
        return "-"
    return "/".join(str(int(v or 0)) for v in values)


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _perplexity(loss: float | None) -> float | None:
    return None if loss is None else math.exp(min(loss, 700.0))


# the task columns, in their place among COLUMNS: (title, cell of a row)
_ACCURACY = ("best val acc (%)", lambda r: _fmt(r.get(m.BEST_VAL_ACC), ".2f", 100))
_LM_QUALITY = [
    ("best val loss (nats/token)", lambda r: _fmt(r.get(m.BEST_VAL_LOSS), ".4f")),
    ("perplexity", lambda r: _fmt(_perplexity(r.get(m.BEST_VAL_LOSS)), ".2f")),
]


def _rate(row: Row, metric: str) -> str:
    """A steady rate with its spread where the run logged one: "417 (213-781)"."""
    rate = row.get(metric)
    if rate is None:
        return "-"
    low, high = (row.get(name) for name in spread_names(metric))
    if low is None or high is None:
        return f"{rate:.0f}"
    return f"{spread.number(rate)} ({spread.number(low)}-{spread.number(high)})"


def _speedup(row: Row) -> str:
    """The speedup, with its 95% interval where both runs have traces: "4.36 [4.10, 4.60]"."""
    ratio = row.speedup_ratio
    if ratio is None:
        return _fmt(row.speedup, ".2f")
    return spread.ratio_text(ratio).replace("x", "", 1)


_SAMPLES = ("throughput (samples/s)", lambda r: _rate(r, SAMPLES_PER_S))
_TOKENS = ("throughput (tokens/s)", lambda r: _rate(r, TOKENS_PER_S))
_TIMING = [
    ("mfu (%)", lambda r: _fmt(r.get(MFU), ".1f", 100)),
    ("warm-up (s)", lambda r: _fmt(r.get(WARMUP_TIME_S), ".1f")),
]
_MEMORY_TITLES = COLUMNS[COLUMNS.index("weights (MB)") : COLUMNS.index("state total (MB)") + 1]


def _param_cell(key: str):
    """A column of a param's value (`-` where the run has none)."""
    return lambda r: r.params.get(key, "-")


def _metric_cell(key: str, spec: str):
    """A column of a metric's value, formatted."""
    return lambda r: _fmt(r.get(key), spec)


def columns(rows: Sequence[Row]) -> list[tuple[str, Any]]:
    """The table's columns: COLUMNS for classifiers; a language model's loss, perplexity and
    tokens per second in place of accuracy and samples per second (both where both kinds of run
    are compared)."""
    lm, cls = any(r.is_lm for r in rows), any(not r.is_lm for r in rows)
    quality = ([_ACCURACY] if cls or not rows else []) + (_LM_QUALITY if lm else [])
    speed = ([_SAMPLES] if cls or not rows else []) + ([_TOKENS] if lm else [])
    names = display_names(rows)
    varying = [(key, _param_cell(key)) for key in varying_params(rows)]
    if tuned_keys(rows):
        varying.append((TUNED_TITLE, lambda r: tuned_settings(r) or "-"))
    return [
        ("run", lambda r: names.get(r.run_id, r.run_name)),
        *varying,
        ("model", lambda r: r.model),
        ("level", lambda r: r.level),
        ("dtype", lambda r: r.dtype),
        (LAYERS_TITLE, layer_counts),
        ("optimizer", lambda r: r.optimizer),
        ("batch size", lambda r: r.batch),
        ("status", lambda r: r.status),
        *quality,
        ("train time (s)", lambda r: _fmt(r.get(m.TRAIN_TIME_S), ".1f")),
        *speed,
        *_TIMING,
        ("peak memory (MB)", lambda r: _fmt(r.get(m.PEAK_MEM_MB), ".0f")),
        ("skipped steps", lambda r: _fmt(r.get(m.SKIPPED_STEPS), ".0f")),
        *(
            (title, _metric_cell(key, ".2f"))
            for key, title in zip((*MEMORY_METRICS, MEMORY_TOTAL), _MEMORY_TITLES)
        ),
        ("speedup vs O0", _speedup),
        ("memory vs O0", lambda r: _fmt(r.memory_ratio, ".2f")),
        ("time to O0's best (s)", reach_cell),
        ("speedup to O0's best", lambda r: _fmt(r.reach_speedup, ".2f")),
        ("baseline (O0)", lambda r: r.baseline or "-"),
    ]


def table_cells(row: Row, rows: Sequence[Row] | None = None) -> list[str]:
    return [cell(row) for _, cell in columns(rows if rows is not None else [row])]


def render_markdown(
    rows: Sequence[Row], title: str, source: str, target_gap: float = TARGET_GAP
) -> str:
    """The comparison: the headline table (at most ten columns) and how to read it, then every
    column, the seeds' table, the notes and the runs to look at, and the figures; every prose
    line a bullet of at most MAX_LINE characters."""
    titles = [title for title, _ in columns(rows)]
    # left-aligned columns: run, what varies (and what trainer.tune changed), model ... status
    text = 8 + len(varying_params(rows)) + bool(tuned_keys(rows))
    quality = "loss" if all_lm(rows) else "accuracy"
    bars, curves = figure_files(rows)
    lines = [
        f"# {title}",
        "",
        source,
        "",
        *headline.render(rows),
        "",
        *(clip(f"- {note}") for note in headline_notes(rows)),
        "",
        "## Every column",
        "",
        "| " + " | ".join(titles) + " |",
        "|" + "---|" * text + "---:|" * (len(titles) - text - 1) + "---|",
        *("| " + " | ".join(table_cells(r, rows)) + " |" for r in rows),
        "",
        *render_seed_table(rows),
        "## Notes",
        "",
        *(clip(f"- {note}") for note in table_notes(rows, target_gap)),
        "",
        *run_lists(rows),
        "## Figures",
        "",
        f"![steady throughput, memory and {quality} per level]({bars})",
        "",
        f"![memory by kind per level]({MEMORY_PNG})",
        "",
        f"![validation {quality} per epoch]({curves})",
        "",
    ]
    return "\n".join(lines)


def _noise_cells(row: Row) -> tuple:
    """The CSV's speedup_low, speedup_high, speedup_within_noise and device_busy_pct."""
    ratio = row.speedup_ratio
    interval = (ratio.low, ratio.high, ratio.noise) if ratio else (None, None, None)
    return (*interval, row.get(DEVICE_BUSY))


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        lm = [k for k in LM_METRICS if k not in METRICS] if any(r.is_lm for r in rows) else []
        varying = varying_params(rows)
        tuned = ["tuned"] if tuned_keys(rows) else []
        # the steady rates' spread (p10, p90), the speedup's 95% interval: new columns go last
        rates = (SAMPLES_PER_S, TOKENS_PER_S) if any(r.is_lm for r in rows) else (SAMPLES_PER_S,)
        spreads = [name for rate in rates for name in spread_names(rate)]
        writer.writerow(
            [
                "run_id",
                "run_name",
                *varying,
                *tuned,
                "model",
                "level",
                "dtype",
                "layers",
                "optimizer",
                "batch_size",
                "accumulate_grad_batches",
                "status",
                *METRICS,
                *TIMING_METRICS,
                *MEMORY_METRICS,
                MEMORY_TOTAL,
                "speedup_vs_o0",
                "memory_vs_o0",
                "target",
                "epoch_to_target",
                "time_to_target_s",
                "speedup_to_target",
                "baseline_run",
                "reason",
                *lm,
                *spreads,
                "speedup_low",
                "speedup_high",
                "speedup_within_noise",
                "device_busy_pct",
            ]
        )
        for r in rows:
            writer.writerow(
                [
                    r.run_id,
                    r.run_name,
                    *(r.params.get(k) for k in varying),
                    *(tuned_settings(r) for _ in tuned),
                    r.model,
                    r.level,
                    r.dtype,
                    layer_counts(r),
                    r.optimizer,
                    r.batch_size,
                    r.accumulate,
                    r.status,
                    *(r.get(m) for m in METRICS),
                    *(r.get(m) for m in TIMING_METRICS),
                    *(r.get(m) for m in (*MEMORY_METRICS, MEMORY_TOTAL)),
                    r.speedup,
                    r.memory_ratio,
                    *(
                        (r.reach.target, r.reach.epoch, r.reach.seconds)
                        if r.reach
                        else (None, None, None)
                    ),
                    r.reach_speedup,
                    r.baseline,
                    r.reason,
                    *(r.get(k) for k in lm),
                    *(r.get(k) for k in spreads),
                    *_noise_cells(r),
                ]
            )
