"""`python -m runner.report`: the precision levels of a sweep side by side, from MLflow.

Reads the runs back from any MLflow store (a SQLite file or a tracking server) and writes one
comparison table (Markdown and CSV, a row per run) and figures (PNG): grouped bars of training
time, peak memory and best validation accuracy per level and model, stacked bars of each run's
memory by kind (weights, fp32 masters, gradients, optimizer state, activations: `mem_*_mb`), and
the validation accuracy curve of every run. The params that differ between the runs (an lr, a
seed, a schedule swept beside the levels) get a column each, and each run is compared with the
O0 (fp32) run of its group (the same model and the same values of those params, seeds apart):
speedup = O0's train time / the run's, memory ratio = the run's peak memory / O0's; the table
names that baseline. The files are also logged as artifacts of
the sweep's parent run (under `report/`), so they show in the MLflow UI beside the runs. Runs that
did not finish are listed under the table with the reason: their `error` tag (a failure, an
interrupt, or "process vanished: ..." for a run whose process was killed outright and that a later
run ended KILLED: runner.tracking.liveness), or for a run still RUNNING its last heartbeat.

    python -m runner.report                                  # the newest sweep in ./mlflow.db
    python -m runner.report --parent <run id> --out report   # one sweep, by its parent run
    python -m runner.report --tracking-uri http://127.0.0.1:5000 --sweep
    multirun/2026-01-01/10-00-00
    python -m runner.report --diff <run id> <run id>         # the params that differ, printed

Exit status: 0 when the report was written, 1 when there is nothing to report (no such
store, experiment, sweep or runs: the message says which), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import operator
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.config.precision import stepped_dtype_name
from runner.measure.memory import TOTAL_METRIC
from runner.measure.memory import metric_name as memory_metric
from runner.tracking import metrics as m
from runner.tracking import tags as tag

EXPERIMENT = "amp-runner"
BASELINE_LEVEL = "O0"
ARTIFACT_DIR = "report"
TABLE_MD, TABLE_CSV = "comparison.md", "comparison.csv"
BARS_PNG, CURVES_PNG = "time_memory_accuracy.png", "val_acc_curves.png"
MEMORY_PNG = "memory_by_kind.png"
# metric -> what the table calls it; a run lacking one is reported with "-" and a note.
METRICS = {
    m.BEST_VAL_ACC: "best val acc",
    m.TRAIN_TIME_S: "train time",
    m.SAMPLES_PER_S: "throughput",
    m.PEAK_MEM_MB: "peak memory",
    m.SKIPPED_STEPS: "skipped steps",
}
# a language model's (task language_model): its loss and its throughput in tokens
LM_METRICS = {
    m.BEST_VAL_LOSS: "best val loss",
    m.TRAIN_TIME_S: "train time",
    m.TOKENS_PER_S: "throughput",
    m.PEAK_MEM_MB: "peak memory",
    m.SKIPPED_STEPS: "skipped steps",
}
LANGUAGE_MODEL = "language_model"  # the `task.name` param of a language model's run
# memory by kind (runner.measure.memory): reported where a run logged them, never listed as missing
# (runs
# made before they existed lack them)
MEMORY_METRICS = {
    memory_metric("weights"): "weights",
    memory_metric("master_weights"): "fp32 masters",
    memory_metric("grads"): "gradients",
    memory_metric("optimizer_state"): "optimizer state",
    memory_metric("activations"): "activations",
}
MEMORY_TOTAL = TOTAL_METRIC


class NothingToReport(Exception):
    """No experiment, sweep or run matched: the message says what was looked for, and where."""


def _plain(value: Any) -> Any:
    """A config value, or its spelling as an MLflow param ("None", "True", "False")."""
    if isinstance(value, str):
        return {"None": None, "null": None, "True": True, "False": False}.get(value, value)
    return value


def describe_dtype(precision: Mapping[str, Any]) -> str:
    """What a level computes in, from its precision properties: a config node (`cfg.precision`) or
    a run's `precision.*` params without the prefix."""
    get = lambda key: _plain(precision.get(key))  # noqa: E731
    cast = get("cast_model_type")
    fp8 = get("fp8_linear")
    extra = f", fp8 Linear ({fp8})" if fp8 else ""
    state = get("optimizer_state")
    stepped = stepped_dtype_name(
        {"cast_model_type": str(cast), "master_weights": str(get("master_weights"))}
    )
    if state and state != stepped:  # a state format other than the stepped weights' type
        extra += f", {state} optimizer state"
    plan = get("layer_plan")
    if plan == "auto":
        extra += ", layers planned by a pre-flight"
    elif plan or get("layers") not in (None, "{}", {}):
        extra += ", a layer plan"
    if get("opt_level") == BASELINE_LEVEL:
        return "float32" + extra
    if cast is None:
        return f"float32 weights, autocast {get('autocast_dtype')}" + extra
    extras = [
        label
        for key, label in (
            ("keep_batchnorm_fp32", "fp32 BatchNorm"),
            ("master_weights", "fp32 master weights"),
            ("stochastic_rounding", "stochastic rounding"),
        )
        if get(key)
    ]
    return str(cast) + (f" ({', '.join(extras)})" if extras else "") + extra


@dataclass
class Row:
    """One run's line of the comparison."""

    run_id: str
    run_name: str
    status: str
    model: str
    optimizer: str
    level: str
    dtype: str
    batch_size: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    val_acc: list[tuple[int, float]] = field(default_factory=list)  # (epoch, accuracy)
    speedup: float | None = None
    memory_ratio: float | None = None
    baseline: str | None = None
    peak_mem_kind: str = "?"
    task: str = (
        "classification"  # the run's `task.name` param (runs before the task group: a classifier)
    )
    val_loss: list[tuple[int, float]] = field(
        default_factory=list
    )  # (epoch, loss): language models
    # why it did not finish: the `error` tag (a failure, an interrupt, or "process vanished: ..."
    # for a run whose process was killed outright, ended KILLED by a later run); for a run still
    # RUNNING, its last heartbeat
    reason: str | None = None
    params: dict[str, str] = field(default_factory=dict)  # every param the run logged

    def get(self, metric: str) -> float | None:
        value = self.metrics.get(metric)
        return None if value is None or math.isnan(value) else value

    @property
    def is_lm(self) -> bool:
        return self.task == LANGUAGE_MODEL

    @property
    def missing(self) -> list[str]:
        return [m for m in (LM_METRICS if self.is_lm else METRICS) if self.get(m) is None]


# ---- reading runs --------------------------------------------------------------------------------
def select_runs(client, experiment_name: str, parent_id: str | None, sweep: str | None):
    """(parent run or None, its runs): the children of `parent_id`, of the newest sweep whose
    parent is named `sweep` or whose folder ends with it, or of the newest sweep; in an experiment
    without sweeps, every run of the experiment."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        raise NothingToReport(
            f"no experiment {experiment_name!r} in {client.tracking_uri}; "
            "set --experiment (the runs' mlflow.experiment_name)"
        )
    ids = [experiment.experiment_id]
    parent = None
    if parent_id:
        try:
            parent = client.get_run(parent_id)
        except MlflowException as error:
            raise NothingToReport(
                f"no run {parent_id!r} in {client.tracking_uri}: {error.message}"
            ) from None
    else:
        sweeps = client.search_runs(
            ids,
            filter_string=f"tags.`{tag.SWEEP_DIR}` != ''",
            order_by=["attributes.start_time DESC"],
        )
        if sweep:
            sweeps = [
                r
                for r in sweeps
                if r.info.run_name == sweep
                or r.data.tags[tag.SWEEP_DIR].rstrip("/").endswith(sweep.rstrip("/"))
            ]
            if not sweeps:
                raise NothingToReport(
                    f"no sweep named {sweep!r} or in a folder ending with it in "
                    f"experiment {experiment_name!r} of {client.tracking_uri}"
                )
        parent = sweeps[0] if sweeps else None
    if parent is None:
        runs = [r for r in client.search_runs(ids) if tag.PARENT_RUN not in r.data.tags]
    else:
        runs = client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{tag.PARENT_RUN}` = '{parent.info.run_id}'",
        )
    if not runs:
        where = (
            f"sweep {parent.info.run_name!r} ({parent.info.run_id})"
            if parent
            else f"experiment {experiment_name!r}"
        )
        raise NothingToReport(
            f"no runs in {where} of {client.tracking_uri}: run a sweep first, "
            "e.g. python -m runner -m precision=o0,o1,o2,o3"
        )
    return parent, sorted(runs, key=lambda r: r.info.start_time)


def _history(client, run_id: str, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, metric))


def to_row(client, run) -> Row:
    params = run.data.params
    precision = {
        k.removeprefix("precision."): v for k, v in params.items() if k.startswith("precision.")
    }
    batch = params.get("trainer.batch_size")
    row = Row(
        run_id=run.info.run_id,
        run_name=run.info.run_name,
        status=run.info.status,
        # a zoo model's arch or a _target_ model's class (the `model` tag), else the option name
        model=run.data.tags.get(tag.MODEL) or params.get("model.name", "?"),
        optimizer=params.get("optimizer.name", "?"),
        level=params.get("precision.opt_level", "?"),
        dtype=describe_dtype(precision) if precision else "?",
        batch_size=int(batch) if batch and batch.isdigit() else None,
        metrics={
            k: v
            for k, v in run.data.metrics.items()
            if k in METRICS
            or k in LM_METRICS
            or k in MEMORY_METRICS
            or k == MEMORY_TOTAL
            or k.startswith(m.LAYERS_IN)
        },
        val_acc=_history(client, run.info.run_id, m.VAL_ACC),
        peak_mem_kind=run.data.tags.get(tag.PEAK_MEM_KIND, "?"),
        task=params.get("task.name", "classification"),
        reason=end_reason(run.info.status, run.data.tags),
        params=dict(params),
    )
    if row.is_lm:
        row.val_loss = _history(client, run.info.run_id, m.VAL_LOSS)
    # Throughput: the mean over the epochs after the first (which includes warm-up) when there are.
    for metric in (m.SAMPLES_PER_S, m.TOKENS_PER_S):
        throughput = [v for _, v in _history(client, run.info.run_id, metric)]
        if len(throughput) > 1:
            row.metrics[metric] = sum(throughput[1:]) / len(throughput[1:])
    return row


def end_reason(status: str, tags: Mapping[str, str]) -> str | None:
    """Why a run is not FINISHED, from its tags: its `error`, or for a RUNNING run when and where
    it last showed life (a run whose process vanished stays RUNNING until the next run or sweep
    of its experiment starts and ends it KILLED)."""
    if status == "FINISHED":
        return None
    if status == "RUNNING":
        if tag.HEARTBEAT not in tags:
            return "running (no heartbeat recorded)"
        return (
            f"running: last heartbeat {tags[tag.HEARTBEAT]} (host {tags.get(tag.HOST, '?')},"
            f" pid {tags.get(tag.PID, '?')})"
        )
    return tags.get(tag.ERROR)


# Params the table shows in columns of their own (model, level and dtype, optimizer, batch size)
# or that follow from others (a model's parameter count, the global batch, the dataset's sizes):
# never listed as what varies between runs.
SHOWN_PARAMS = ("model.name", "model.arch", "optimizer.name", "trainer.batch_size", "task.name")
SHOWN_PREFIXES = ("precision.",)
DERIVED_PARAMS = (
    "model.num_parameters",
    "trainer.global_batch_size",
    "data.train_size",
    "data.val_size",
    "mlflow.run_name",
)
SEED_PARAMS = ("trainer.seed", "data.seed")


def varying_params(rows: Sequence[Row]) -> list[str]:
    """The params whose values differ between the runs (only those: "what differs"), apart from
    those the table shows anyway; runs that logged no params (a job that failed before its run
    began) do not count."""
    logged = [r for r in rows if r.params]
    keys = sorted({k for r in logged for k in r.params})
    return [
        k
        for k in keys
        if k not in SHOWN_PARAMS
        and k not in DERIVED_PARAMS
        and not k.startswith(SHOWN_PREFIXES)
        and len({r.params.get(k) for r in logged}) > 1
    ]


def display_names(rows: Sequence[Row]) -> dict[str, str]:
    """run id -> the run's name, with the start of its id where several runs share the name."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.run_name] = counts.get(r.run_name, 0) + 1
    return {
        r.run_id: r.run_name if counts[r.run_name] == 1 else f"{r.run_name} ({r.run_id[:8]})"
        for r in rows
    }


def add_baseline_ratios(rows: Sequence[Row]) -> None:
    """Speedup and memory ratio against the O0 run of the same group: the same model and the same
    values of every param that varies between the runs (lr, schedule, data, ...), seeds apart;
    of those, one with the same seed, optimizer and batch size when there is one. A run whose
    group has no O0 run gets no ratio (a different lr's O0 is not its baseline)."""
    varying = varying_params(rows)
    group_keys = [k for k in varying if k not in SEED_PARAMS]
    names = display_names(rows)

    def group(r: Row) -> tuple:
        return (r.model, *(r.params.get(k) for k in group_keys))

    for row in rows:
        candidates = [
            b
            for b in rows
            if group(b) == group(row)
            and b.level == BASELINE_LEVEL
            and b.get(m.TRAIN_TIME_S) is not None
        ]
        if not candidates:
            continue
        base = min(
            candidates,
            key=lambda b: (
                any(b.params.get(k) != row.params.get(k) for k in SEED_PARAMS),
                b.optimizer != row.optimizer,
                b.batch_size != row.batch_size,
            ),
        )
        row.baseline = names[base.run_id]
        time, base_time = row.get(m.TRAIN_TIME_S), base.get(m.TRAIN_TIME_S)
        if time and base_time:
            row.speedup = base_time / time
        memory, base_memory = row.get(m.PEAK_MEM_MB), base.get(m.PEAK_MEM_MB)
        if memory is not None and base_memory:
            row.memory_ratio = memory / base_memory


@dataclass
class SeedGroup:
    """The runs of one configuration that differ only in their seeds."""

    label: str  # the level and what differs, seeds apart ("O2 lr=0.1")
    model: str
    rows: list[Row]

    def stats(self, value) -> tuple[float, float, int] | None:
        """(mean, sample std, count) of `value(row)` over the runs that have it."""
        values = [v for v in (value(r) for r in self.rows) if v is not None]
        if not values:
            return None
        mean = sum(values) / len(values)
        std = (
            math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            if len(values) > 1
            else 0.0
        )
        return mean, std, len(values)


def seeds_vary(rows: Sequence[Row]) -> bool:
    return any(k in SEED_PARAMS for k in varying_params(rows))


def seed_groups(rows: Sequence[Row]) -> list[SeedGroup]:
    """The runs grouped by model, level, dtype and every varying param but the seeds."""
    keys = [k for k in varying_params(rows) if k not in SEED_PARAMS]
    groups: dict[tuple, SeedGroup] = {}
    for r in rows:
        label = (
            r.level
            + (" bf16" if "bfloat16" in r.dtype else "")
            + "".join(f" {k.rsplit('.', 1)[-1]}={r.params.get(k, '-')}" for k in keys)
        )
        key = (
            r.model,
            r.level,
            r.dtype,
            r.optimizer,
            r.batch_size,
            *(r.params.get(k) for k in keys),
        )
        groups.setdefault(key, SeedGroup(label, r.model, [])).rows.append(r)
    return list(groups.values())


def _mean_std(stats: tuple[float, float, int] | None, spec: str, scale: float = 1.0) -> str:
    if stats is None:
        return "-"
    mean, std, _ = stats
    return f"{format(mean * scale, spec)} ± {format(std * scale, spec)}"


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
        "peak memory (MB) | speedup vs O0 | memory vs O0 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
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
                ]
            )
            + " |"
        )
    return lines + [""]


# ---- writing -------------------------------------------------------------------------------------
# the layer audit's count of layers per observed format (runner.measure.audit)
LAYER_FORMATS = ("fp32", "bf16", "fp16", "fp8")
LAYERS_TITLE = "layers fp32/bf16/fp16/fp8"
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
]


def layer_counts(row: Row) -> str:
    """How many layers computed in fp32 / bf16 / fp16 / fp8 at the run's first step (the layer
    audit's `layers_<format>` metrics), "-" for a run without them."""
    values = [row.get(f"{m.LAYERS_IN}{fmt}") for fmt in LAYER_FORMATS]
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
_SAMPLES = ("throughput (samples/s)", lambda r: _fmt(r.get(m.SAMPLES_PER_S), ".0f"))
_TOKENS = ("throughput (tokens/s)", lambda r: _fmt(r.get(m.TOKENS_PER_S), ".0f"))


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
    return [
        ("run", lambda r: names.get(r.run_id, r.run_name)),
        *varying,
        ("model", lambda r: r.model),
        ("level", lambda r: r.level),
        ("dtype", lambda r: r.dtype),
        (LAYERS_TITLE, layer_counts),
        ("optimizer", lambda r: r.optimizer),
        ("batch size", lambda r: "-" if r.batch_size is None else str(r.batch_size)),
        ("status", lambda r: r.status),
        *quality,
        ("train time (s)", lambda r: _fmt(r.get(m.TRAIN_TIME_S), ".1f")),
        *speed,
        ("peak memory (MB)", lambda r: _fmt(r.get(m.PEAK_MEM_MB), ".0f")),
        ("skipped steps", lambda r: _fmt(r.get(m.SKIPPED_STEPS), ".0f")),
        *(
            (title, _metric_cell(key, ".2f"))
            for key, title in zip((*MEMORY_METRICS, MEMORY_TOTAL), COLUMNS[13:19])
        ),
        ("speedup vs O0", lambda r: _fmt(r.speedup, ".2f")),
        ("memory vs O0", lambda r: _fmt(r.memory_ratio, ".2f")),
        ("baseline (O0)", lambda r: r.baseline or "-"),
    ]


def table_cells(row: Row, rows: Sequence[Row] | None = None) -> list[str]:
    return [cell(row) for _, cell in columns(rows if rows is not None else [row])]


def render_markdown(rows: Sequence[Row], title: str, source: str) -> str:
    titles = [title for title, _ in columns(rows)]
    text = 8 + len(varying_params(rows))  # left-aligned columns: run, what varies, model ... status
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
        "Speedup: the baseline's train time / the run's (above 1 is faster); memory: the "
        "run's peak memory / the baseline's (below 1 is less). The baseline is the O0 run "
        "of the same model"
        + (
            " with the same " + ", ".join(f"`{k}`" for k in varying if k not in SEED_PARAMS)
            if any(k not in SEED_PARAMS for k in varying)
            else ""
        )
        + " (the same seed where there is one), named in the last column. The columns "
        "between run and model are the params that differ between these runs. Throughput is "
        "the mean over the epochs "
        "after the first. Train time covers all epochs, validation included. Peak memory: "
        + ", ".join(sorted({r.peak_mem_kind for r in rows}))
        + " (the runs' `peak_mem_kind`:"
        " CUDA's max allocated memory, or on a CPU the training state counted from the "
        "tensors). Weights, masters, grads, optimizer state and activations: the memory of "
        "each kind of tensor in one training step, counted from the tensors themselves "
        "(activations: the bytes saved for backward); state total is their sum. Layers "
        "fp32/bf16/fp16/fp8: how many layers (modules with weights of their own) computed "
        "in each format at the first step, as the layer audit saw them "
        "(`layers/layers_ran.csv` of each run).",
        "",
    ]
    lines += render_seed_table(rows)
    missing = [r for r in rows if r.missing]
    if missing:
        lines += ["Runs lacking metrics (shown as -):", ""]
        lines += [f"- {r.run_name} ({r.status}): no {', '.join(r.missing)}" for r in missing]
        lines.append("")
    unfinished = [r for r in rows if r.status != "FINISHED"]
    if unfinished:
        lines += ["Runs that did not finish:", ""]
        lines += [
            f"- {r.run_name} ({r.status}): {r.reason or 'no reason recorded'}" for r in unfinished
        ]
        lines.append("")
    if not any(r.baseline for r in rows):
        lines += ["No finished O0 run to compare with: speedup and memory ratio are empty.", ""]
    quality = "loss" if rows and all(r.is_lm for r in rows) else "accuracy"
    if any(r.is_lm for r in rows):
        lines += [
            "Language models: best val loss is the mean token cross-entropy on the "
            "validation tokens (nats per token), perplexity its exponential; throughput in "
            "training tokens per second.",
            "",
        ]
    lines += [
        f"![time, memory and {quality} per level]({BARS_PNG})",
        "",
        f"![memory by kind per level]({MEMORY_PNG})",
        "",
        f"![validation {quality} per epoch]({CURVES_PNG})",
        "",
    ]
    return "\n".join(lines)


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        lm = [k for k in LM_METRICS if k not in METRICS] if any(r.is_lm for r in rows) else []
        varying = varying_params(rows)
        writer.writerow(
            [
                "run_id",
                "run_name",
                *varying,
                "model",
                "level",
                "dtype",
                "layers",
                "optimizer",
                "batch_size",
                "status",
                *METRICS,
                *MEMORY_METRICS,
                MEMORY_TOTAL,
                "speedup_vs_o0",
                "memory_vs_o0",
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
                    r.model,
                    r.level,
                    r.dtype,
                    layer_counts(r),
                    r.optimizer,
                    r.batch_size,
                    r.status,
                    *(r.get(m) for m in METRICS),
                    *(r.get(m) for m in (*MEMORY_METRICS, MEMORY_TOTAL)),
                    r.speedup,
                    r.memory_ratio,
                    r.baseline,
                    r.reason,
                    *(r.get(k) for k in lm),
                ]
            )


def bar_labels(rows: Sequence[Row]) -> list[str]:
    """Each run's label within its model: the level, plus whatever else varies (dtype, batch size,
    optimizer, the params that differ, as `lr=0.05`), so that two runs never share a bar; where
    two runs still look alike, the start of their run ids."""
    varies = {key: len({getattr(r, key) for r in rows}) > 1 for key in ("optimizer", "batch_size")}
    varying = varying_params(rows)
    labels = []
    for r in rows:
        label = r.level + (" bf16" if "bfloat16" in r.dtype else "")
        if varies["optimizer"]:
            label += f" {r.optimizer}"
        if varies["batch_size"]:
            label += f" b{r.batch_size}"
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
    quality = (
        (m.BEST_VAL_LOSS, "best val loss (nats/token)", 1.0)
        if rows and all(r.is_lm for r in rows)
        else (m.BEST_VAL_ACC, "best val accuracy (%)", 100.0)
    )
    panels = [
        (m.TRAIN_TIME_S, "train time (s)", 1.0),
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
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = bool(rows) and all(r.is_lm for r in rows)  # language models: the loss per epoch
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        curve, scale = (r.val_loss, 1.0) if lm else (r.val_acc, 100.0)
        if curve:
            epochs, values = zip(*curve)
            ax.plot(
                epochs,
                [scale * v for v in values],
                marker="o",
                label=f"{r.run_name} ({r.status})" if r.status != "FINISHED" else r.run_name,
            )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation loss (nats/token)" if lm else "validation accuracy (%)")
    ax.set_title("Validation loss per run" if lm else "Validation accuracy per run")
    ax.grid(alpha=0.3)
    _legend_or_note(ax, bool(ax.lines), "no run logged val_loss" if lm else "no run logged val_acc")
    _save(fig, path)


# ---- entry point ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runner.report",
        description="Compare the runs of a sweep (precision levels, models, batch sizes) from "
        "MLflow: a Markdown and CSV table and PNG figures, also logged on the sweep's parent run.",
    )
    parser.add_argument(
        "--tracking-uri",
        default="sqlite:///mlflow.db",
        help="MLflow store or server (default: sqlite:///mlflow.db, the runner's "
        "default, relative to this directory)",
    )
    parser.add_argument(
        "--experiment", default=EXPERIMENT, help=f"MLflow experiment name (default: {EXPERIMENT})"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--parent",
        metavar="RUN_ID",
        help="the sweep's parent run id (printed at the end of the sweep)",
    )
    which.add_argument(
        "--sweep",
        metavar="NAME_OR_DIR",
        help="the sweep's parent run name, or its folder (multirun/<date>/<time>)",
    )
    which.add_argument(
        "--diff",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="print the params that differ between two runs (by run id) and "
        "their status and objective; writes nothing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("report"),
        help="folder for the table and figures (default: ./report)",
    )
    return parser.parse_args(argv)


def diff_runs(client, run_a: str, run_b: str) -> str:
    """The params whose values differ between two runs (a param one of them lacks shows `-`),
    then each run's status and objective, as a Markdown table."""
    from mlflow.exceptions import MlflowException

    runs = []
    for run_id in (run_a, run_b):
        try:
            runs.append(client.get_run(run_id))
        except MlflowException as error:
            raise NothingToReport(
                f"no run {run_id!r} in {client.tracking_uri}: {error.message}"
            ) from None
    a, b = (r.data.params for r in runs)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    head = [
        f"| param | {runs[0].info.run_name} ({run_a[:8]}) | "
        f"{runs[1].info.run_name} ({run_b[:8]}) |",
        "|---|---|---|",
    ]
    body = [f"| {k} | {a.get(k, '-')} | {b.get(k, '-')} |" for k in keys]
    tail = [f"| status | {runs[0].info.status} | {runs[1].info.status} |"]
    for metric in (m.BEST_VAL_ACC, m.BEST_VAL_LOSS):
        values = [r.data.metrics.get(metric) for r in runs]
        if any(v is not None for v in values):
            tail.append(
                f"| {metric} | "
                + " | ".join("-" if v is None else f"{v:.4g}" for v in values)
                + " |"
            )
    summary = (
        f"{len(keys)} params differ"
        if keys
        else "No param differs: the two runs were configured alike"
    )
    return "\n".join([summary + ":", "", *head, *body, *tail])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from runner.tracking.store import RetryingClient, resolve_tracking_uri, ui_hint

    uri = resolve_tracking_uri(args.tracking_uri)
    try:
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
            raise NothingToReport(
                f"no MLflow store at {uri} (opening it would create an empty "
                "one); set --tracking-uri to the runs' mlflow.tracking_uri"
            )
        client = RetryingClient(uri)
        if args.diff:
            print(diff_runs(client, *args.diff))
            return 0
        parent, runs = select_runs(client, args.experiment, args.parent, args.sweep)
    except NothingToReport as reason:
        print(f"Nothing to report: {reason}", file=sys.stderr)
        return 1
    rows = [to_row(client, run) for run in runs]
    add_baseline_ratios(rows)

    title = (
        f"Precision comparison: {parent.info.run_name}"
        if parent
        else f"Precision comparison: experiment {args.experiment}"
    )
    source = (
        f"{len(rows)} runs from `{uri}`, experiment `{args.experiment}`"
        + (f", parent run `{parent.info.run_id}`" if parent else "")
        + f"; written {_dt.datetime.now().isoformat(timespec='seconds')}."
    )
    markdown = render_markdown(rows, title, source)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / TABLE_MD).write_text(markdown)
    write_csv(rows, args.out / TABLE_CSV)
    plot_bars(rows, args.out / BARS_PNG)
    plot_curves(rows, args.out / CURVES_PNG)
    plot_memory(rows, args.out / MEMORY_PNG)

    print(markdown)
    written = (TABLE_MD, TABLE_CSV, BARS_PNG, MEMORY_PNG, CURVES_PNG)
    print(f"Wrote {', '.join(str(args.out / n) for n in written)}")
    if parent is not None:
        client.log_artifacts(parent.info.run_id, str(args.out), ARTIFACT_DIR)
        print(
            f"Logged them on the sweep's parent run {parent.info.run_id} "
            f"(artifacts/{ARTIFACT_DIR}). " + ui_hint(uri, parent.info.experiment_id)
        )
    else:
        print("No sweep parent run: the files were not logged to MLflow.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
