"""The comparison as text: the Markdown table (with the notes under it and the seeds' table) and
the CSV file."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.config.formats import SHORT_NAMES
from runner.measure.audit import FORMAT_METRIC as LAYERS_IN
from runner.measure.timing import MFU, SAMPLES_PER_S, TOKENS_PER_S, WARMUP_TIME_S
from runner.report.analysis import (
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
    timed_targets,
    tuned_settings,
)
from runner.tracking import metrics as m
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


def reach_cell(row: Row) -> str:
    """The training time the run took to come within the target gap of its O0 run's best
    validation, and the epoch: "41.2 (epoch 3)"; "not reached"; "epoch 3" where it logged no
    epoch times; "-" without a baseline."""
    reach = row.reach
    if reach is None:
        return "-"
    if reach.epoch is None:
        return "not reached"
    if reach.seconds is None:
        return f"epoch {reach.epoch}"
    return f"{reach.seconds:.1f} (epoch {reach.epoch})"


def _perplexity(loss: float | None) -> float | None:
    return None if loss is None else math.exp(min(loss, 700.0))


# the task columns, in their place among COLUMNS: (title, cell of a row)
_ACCURACY = ("best val acc (%)", lambda r: _fmt(r.get(m.BEST_VAL_ACC), ".2f", 100))
_LM_QUALITY = [
    ("best val loss (nats/token)", lambda r: _fmt(r.get(m.BEST_VAL_LOSS), ".4f")),
    ("perplexity", lambda r: _fmt(_perplexity(r.get(m.BEST_VAL_LOSS)), ".2f")),
]
_SAMPLES = ("throughput (samples/s)", lambda r: _fmt(r.get(SAMPLES_PER_S), ".0f"))
_TOKENS = ("throughput (tokens/s)", lambda r: _fmt(r.get(TOKENS_PER_S), ".0f"))
_TIMING = [
    ("mfu (%)", lambda r: _fmt(r.get(MFU), ".1f", 100)),
    ("warm-up (s)", lambda r: _fmt(r.get(WARMUP_TIME_S), ".1f")),
]
_MEMORY_TITLES = COLUMNS[COLUMNS.index("weights (MB)") : COLUMNS.index("state total (MB)") + 1]


TUNED_TITLE = "tuned (trainer.tune)"


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
        ("speedup vs O0", lambda r: _fmt(r.speedup, ".2f")),
        ("memory vs O0", lambda r: _fmt(r.memory_ratio, ".2f")),
        ("time to O0's best (s)", reach_cell),
        ("speedup to O0's best", lambda r: _fmt(r.reach_speedup, ".2f")),
        ("baseline (O0)", lambda r: r.baseline or "-"),
    ]


def table_cells(row: Row, rows: Sequence[Row] | None = None) -> list[str]:
    return [cell(row) for _, cell in columns(rows if rows is not None else [row])]


def warnings_of(row: Row) -> list[str]:
    """The warnings and errors among the precision findings a run started with ("warning
    precision.autocast_dtype"), from its findings tag; info findings are left out."""
    entries = [e.strip() for e in row.findings.split(";")]
    return [e for e in entries if e.partition(" ")[0] in ("warning", "error")]


def no_steady_step(row: Row) -> str:
    """Why a run that trained lacks its steady throughput, where it is known: every step it
    took was warm-up (the first `trainer.warmup_steps` of a session, or a step that compiled),
    which the epoch's own figure counts and the steady figure leaves out; "" otherwise."""
    epoch = m.EPOCH_TOKENS_PER_S if row.is_lm else m.EPOCH_SAMPLES_PER_S
    if row.throughput is not None or row.get(epoch) is None:
        return ""
    warmup = row.params.get("trainer.warmup_steps", "?")
    return (
        f" (no steady step: every step was warm-up, the first trainer.warmup_steps={warmup} "
        f"of a session or a step that compiled; {epoch}, which counts them, is "
        f"{row.get(epoch):.0f}; train more steps for the steady figure)"
    )


def reach_note(rows: Sequence[Row], target_gap: float) -> str:
    """What the time to O0's best means, with each baseline's target ("" without baselines)."""
    targets = timed_targets(rows)
    if not targets:
        return ""
    return (
        " Time to O0's best: the training time (the epochs' `epoch_time_s` summed, validation "
        "excluded, warm-up included) to the end of the first epoch whose validation came within "
        "the target gap of the baseline's best (accuracy that many points below it, a language "
        f"model's loss that many nats above: `--target-gap` {target_gap:g}), "
        '"not reached" where no epoch did; its speedup: the baseline\'s own time to that '
        "target / the run's. A level that steps faster but needs more epochs to get there shows it "
        "here. Targets: " + ", ".join(f"{name} {target:.4g}" for name, target in targets) + "."
    )


def render_markdown(
    rows: Sequence[Row], title: str, source: str, target_gap: float = TARGET_GAP
) -> str:
    titles = [title for title, _ in columns(rows)]
    # left-aligned columns: run, what varies (and what trainer.tune changed), model ... status
    text = 8 + len(varying_params(rows)) + bool(tuned_keys(rows))
    lines = [
        f"# {title}",
        "",
        source,
        "",
        "| " + " | ".join(titles) + " |",
        "|" + "---|" * text + "---:|" * (len(titles) - text - 1) + "---|",
    ]
    lines += ["| " + " | ".join(table_cells(r, rows)) + " |" for r in rows]
    varying = varying_params(rows)
    lines += [
        "",
        "Speedup: the run's steady throughput / the baseline's (above 1 is faster; runs made "
        "before the steady figure: the baseline's train time / the run's); memory: the "
        "run's peak memory / the baseline's (below 1 is less). The baseline is the O0 run "
        "of the same model"
        + (
            " with the same " + ", ".join(f"`{k}`" for k in varying if k not in SEED_PARAMS)
            if any(k not in SEED_PARAMS for k in varying)
            else ""
        )
        + " (of those, one of the same seed, optimizer, samples a step and batch size where"
        " there is one), named in the last column. The columns "
        "between run and model are the params that differ between these runs"
        + (
            "; what trainer.tune chose for a run is part of its result, not a difference in "
            f"what is compared: `{TUNED_TITLE}` lists what it changed (`tune.md` and the "
            "`tune.*` params of each run say why)"
            if tuned_keys(rows)
            else ""
        )
        + ". Throughput is "
        "the steady figure (`samples_per_s`, a language model's `tokens_per_s`: the steps "
        "after each session's `trainer.warmup_steps` that compiled nothing), the mean over the "
        "epochs that logged one (runs made before it: the epoch's own figure, the mean over the "
        "epochs after the first). mfu: the achieved FLOP/s over the GPU's dense peak for the "
        "level's format, the mean over the epochs (a GPU in the peak table only). Warm-up: "
        "the time of the warm-up steps, summed over the run's sessions. Train time covers all "
        "epochs, validation and warm-up included. Peak memory: "
        + ", ".join(sorted({r.peak_mem_kind for r in rows}))
        + " (the runs' `peak_mem_kind`:"
        " CUDA's max allocated memory, or on a CPU the training state counted from the "
        "tensors). Weights, masters, grads, optimizer state and activations: the memory of "
        "each kind of tensor in one training step, counted from the tensors themselves "
        "(activations: the bytes saved for backward); state total is their sum. Layers "
        "fp32/bf16/fp16/fp8: how many layers (modules with weights of their own) computed "
        "in each format at the first step, as the layer audit saw them "
        "(`layers/layers_ran.csv` of each run)." + reach_note(rows, target_gap),
        "",
    ]
    lines += render_seed_table(rows)
    # each run as its row names it, with its id (to find it in the store)
    names = display_names(rows)
    missing = [r for r in rows if r.missing]
    if missing:
        lines += ["Runs lacking metrics (shown as -):", ""]
        lines += [
            f"- {names[r.run_id]} (run {r.run_id}, {r.status}): no {', '.join(r.missing)}"
            + no_steady_step(r)
            for r in missing
        ]
        lines.append("")
    warned = [(r, w) for r in rows if (w := warnings_of(r))]
    if warned:
        lines += [
            "Runs that started with precision warnings (each message, with its hint, is in the "
            "run's `precision.txt` artifact; they can explain a level's speed or accuracy):",
            "",
        ]
        lines += [f"- {names[r.run_id]} (run {r.run_id}): {'; '.join(w)}" for r, w in warned]
        lines.append("")
    unfinished = [r for r in rows if r.status != "FINISHED"]
    if unfinished:
        lines += ["Runs that did not finish:", ""]
        lines += [
            f"- {names[r.run_id]} (run {r.run_id}, {r.status}): {r.reason or 'no reason recorded'}"
            for r in unfinished
        ]
        lines.append("")
    if not any(r.baseline for r in rows):
        lines += ["No finished O0 run to compare with: speedup and memory ratio are empty.", ""]
    quality = "loss" if all_lm(rows) else "accuracy"
    bars, curves = figure_files(rows)
    if any(r.is_lm for r in rows):
        lines += [
            "Language models: best val loss is the mean token cross-entropy on the "
            "validation tokens (nats per token), perplexity its exponential; throughput in "
            "training tokens per second.",
            "",
        ]
    lines += [
        f"![steady throughput, memory and {quality} per level]({bars})",
        "",
        f"![memory by kind per level]({MEMORY_PNG})",
        "",
        f"![validation {quality} per epoch]({curves})",
        "",
    ]
    return "\n".join(lines)


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        lm = [k for k in LM_METRICS if k not in METRICS] if any(r.is_lm for r in rows) else []
        varying = varying_params(rows)
        tuned = ["tuned"] if tuned_keys(rows) else []
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
                ]
            )
