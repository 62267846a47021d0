"""The comparison's analysis: one `Row` per run (what it computed in: `describe_dtype`), the params
that vary between the runs, each run's O0 baseline (speedup, memory ratio) and its seed group."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from runner import metrics as m
from runner.config.formats import stepped_dtype_name
from runner.config.schema import CLASSIFICATION, DEFAULT_EXPERIMENT, LANGUAGE_MODEL
from runner.measure import spread
from runner.measure.spread import Ratio
from runner.measure.step_trace import EpochTrace
from runner.metrics import (
    MEM_TOTAL_MB,
    MFU,
    SAMPLES_PER_S,
    TOKENS_PER_S,
    WARMUP_TIME_S,
    memory_metric,
    spread_names,
)
from runner.tracking.varying import (
    SEED_PARAMS,
    TUNE_PREFIX,
    baseline_keys,
    display_names,
    distance,
    varying_params,
)

EXPERIMENT = DEFAULT_EXPERIMENT  # the report reads this experiment unless told another
BASELINE_LEVEL = "O0"
# metric -> what the table calls it; a run lacking one is reported with "-" and a note.
METRICS = {
    m.BEST_VAL_ACC: "best val acc",
    m.TRAIN_TIME_S: "train time",
    SAMPLES_PER_S: "throughput",
    m.PEAK_MEM_MB: "peak memory",
    m.SKIPPED_STEPS: "skipped steps",
}
# a language model's (task language_model): its loss and its throughput in tokens
LM_METRICS = {
    m.BEST_VAL_LOSS: "best val loss",
    m.TRAIN_TIME_S: "train time",
    TOKENS_PER_S: "throughput",
    m.PEAK_MEM_MB: "peak memory",
    m.SKIPPED_STEPS: "skipped steps",
}
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
MEMORY_TOTAL = MEM_TOTAL_MB
# the step timer's (runner.measure.timing): reported where a run logged them, never listed as
# missing (runs made before them, a CPU run's mfu)
TIMING_METRICS = {MFU: "mfu", WARMUP_TIME_S: "warm-up"}
# how busy the (first) GPU was, in percent: the run's `device_busy_frac` (its profiled steps:
# runner.measure.busy) where it logged one, else MLflow's system metric, the mean over the run's
# samples (NVML's share of time a kernel ran)
DEVICE_BUSY = "device_busy_pct"
SYSTEM_GPU_BUSY = "system/gpu_0_utilization_percentage"
# how far from its O0 run's best a run's validation counts as reaching it (`--target-gap`):
# accuracy points below (0.01: one point), or a language model's nats per token above
TARGET_GAP = 0.01


def _plain(value: Any) -> Any:
    """A config value, or its spelling as an MLflow param ("None", "True", "False")."""
    if isinstance(value, str):
        return {"None": None, "null": None, "True": True, "False": False}.get(value, value)
    return value


def describe_dtype(precision: Mapping[str, Any], batchnorm_layers: Optional[int] = None) -> str:
    """What a level computes in, from its precision properties: a config node (`cfg.precision`) or
    a run's `precision.*` params without the prefix. `batchnorm_layers`: the model's count (the
    run's `model.batchnorm_layers`), where known: a model without BatchNorm keeps none in fp32."""
    get = lambda key: _plain(precision.get(key))  # noqa: E731
    cast = get("cast_model_type")
    fp8 = get("fp8_linear")
    extra = f", fp8 Linear ({fp8})" if fp8 else ""
    state = get("optimizer_state")
    stepped = stepped_dtype_name(cast, get("master_weights"))
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
        for on, label in (
            (get("keep_batchnorm_fp32") and batchnorm_layers != 0, "fp32 BatchNorm"),
            (get("master_weights"), "fp32 master weights"),
            (get("stochastic_rounding"), "stochastic rounding"),
        )
        if on
    ]
    return str(cast) + (f" ({', '.join(extras)})" if extras else "") + extra


@dataclass(frozen=True)
class Reach:
    """A run's way to a validation target: the first epoch that reached it and its training
    time to the end of that epoch (None: not reached, or no time logged)."""

    target: float
    epoch: int | None
    seconds: float | None


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
    # the run's `task.name` param (runs before the task group: a classifier)
    task: str = CLASSIFICATION
    val_loss: list[tuple[int, float]] = field(
        default_factory=list
    )  # (epoch, loss): language models
    # why it did not finish: the `error` tag (a failure, an interrupt, or "process vanished: ..."
    # for a run whose process was killed outright, ended KILLED by a later run); for a run still
    # RUNNING, its last heartbeat
    reason: str | None = None
    # the precision findings it started with, as its tag lists them ("warning precision.x; info
    # model"; "" for runs made before the tag)
    findings: str = ""
    params: dict[str, str] = field(default_factory=dict)  # every param the run logged
    # the batches a step summed (`trainer.accumulate_grad_batches`; 1 for runs made before it)
    accumulate: int = 1
    # whether its throughput is the steady figure (a run made before it logged the epoch's own
    # figure under that name: its throughput is then the mean over the epochs after the first)
    steady: bool = False
    epoch_times: list[tuple[int, float]] = field(default_factory=list)  # (epoch, training s)
    # reaching its O0 run's quality (add_baseline_ratios): where a baseline has a validation
    reach: Reach | None = None
    reach_speedup: float | None = None  # the baseline's time to the target / this run's
    # its steady steps' times, an epoch each (runner.measure.step_trace; runs made before: none)
    traces: list[EpochTrace] = field(default_factory=list, repr=False, compare=False)
    base: Optional[Row] = field(default=None, repr=False, compare=False)  # its baseline's row
    speedup_ratio: Optional[Ratio] = None  # the speedup with its interval, where both have traces

    def get(self, metric: str) -> float | None:
        value = self.metrics.get(metric)
        return None if value is None or math.isnan(value) else value

    @property
    def is_lm(self) -> bool:
        return self.task == LANGUAGE_MODEL

    @property
    def batch(self) -> str:
        """The batch size as the table shows it: "64", or "64 x 4" where a step summed 4."""
        if self.batch_size is None:
            return "-"
        return (
            f"{self.batch_size} x {self.accumulate}"
            if self.accumulate > 1
            else str(self.batch_size)
        )

    @property
    def throughput(self) -> float | None:
        """The run's throughput: tokens/s for a language model, else samples/s."""
        return self.get(TOKENS_PER_S if self.is_lm else SAMPLES_PER_S)

    @property
    def spread(self) -> tuple[float | None, float | None]:
        """Its throughput's spread: the rates of its slow and fast steps (p10, p90)."""
        p10, p90 = spread_names(TOKENS_PER_S if self.is_lm else SAMPLES_PER_S)
        return self.get(p10), self.get(p90)

    @property
    def missing(self) -> list[str]:
        return [m for m in (LM_METRICS if self.is_lm else METRICS) if self.get(m) is None]

    @property
    def quality(self) -> dict[int, float]:
        """Its validation by epoch: accuracy, or a language model's loss (an epoch a resumed
        session logged again: the last value)."""
        return dict(self.val_loss if self.is_lm else self.val_acc)

    def best_quality(self) -> float | None:
        """Its best validation: the highest accuracy, or a language model's lowest loss."""
        values = [v for v in self.quality.values() if not math.isnan(v)]
        if not values:
            return None
        return min(values) if self.is_lm else max(values)

    def reaching(self, target: float) -> Reach:
        """When its validation first reached `target` (an accuracy at or above it, a language
        model's loss at or below it), and the training time to the end of that epoch: its
        `epoch_time_s` summed over the epochs up to it (validation excluded, warm-up included).
        Not reached: epoch None; reached in an epoch without a time (a run made before the
        metric): seconds None."""
        for epoch, value in sorted(self.quality.items()):
            if value <= target if self.is_lm else value >= target:
                return Reach(target, epoch, self.training_time_to(epoch))
        return Reach(target, None, None)

    def training_time_to(self, epoch: int) -> float | None:
        """Its training time to the end of `epoch`: `epoch_time_s` summed over the epochs up to
        it; None where one of its validated epochs up to it has no time (a run made before the
        metric)."""
        times = dict(self.epoch_times)
        if any(e not in times for e in self.quality if e <= epoch) or epoch not in times:
            return None
        return sum(t for e, t in times.items() if e <= epoch)


def tuned_settings(row: Row) -> str:
    """What trainer.tune changed in this run ("channels_last=true, kernels=torch"), "" if
    nothing: the `tune.<key>` params whose reason is "tuned: ..."."""
    changed = []
    for key, text in sorted(row.params.items()):
        value, _, why = str(text).partition(" (")
        if key.startswith(TUNE_PREFIX) and why.startswith("tuned:"):
            changed.append(f"{key.rpartition('.')[2]}={value}")
    return ", ".join(changed)


def add_baseline_ratios(rows: Sequence[Row], target_gap: float = TARGET_GAP) -> None:
    """Speedup and memory ratio against the O0 run of the same group: the same model and the same
    values of every param that varies between the runs (lr, schedule, data, ...), seeds apart; of
    those, the nearest (`varying.distance`: the same seed, optimizer, samples a step, batch size and
    batches a step, in that order), so that an O2 run of batch 256 compares with the O0 of 64 x 4
    that fit. A run whose group has no O0 run gets no ratio (a different lr's O0 is not its
    baseline). The speedup is the ratio of the steady throughputs where both runs logged one (with
    its 95% interval from their traces of step times: runner.measure.spread), else (runs made
    before the steady figure) the baseline's train time over the run's. And the time
    to the baseline's quality: the training time each of the two took to come within
    `target_gap` of the baseline's best validation (Row.reaching), and their ratio."""
    group_keys = baseline_keys(rows)
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
        base = min(candidates, key=lambda b: distance(b.params, row.params))
        row.baseline, row.base = names[base.run_id], base
        rate, base_rate = row.throughput, base.throughput
        time, base_time = row.get(m.TRAIN_TIME_S), base.get(m.TRAIN_TIME_S)
        if row.steady and base.steady and rate and base_rate:
            row.speedup = rate / base_rate
            if base is not row:  # (its interval: runner.measure.spread)
                row.speedup_ratio = spread.speedup(
                    [row.traces], [base.traces], row.is_lm, value=row.speedup
                )
        elif time and base_time:
            row.speedup = base_time / time
        memory, base_memory = row.get(m.PEAK_MEM_MB), base.get(m.PEAK_MEM_MB)
        if memory is not None and base_memory:
            row.memory_ratio = memory / base_memory
        best = base.best_quality()
        if best is not None:
            target = best + target_gap if base.is_lm else best - target_gap
            row.reach, base_reach = row.reaching(target), base.reaching(target)
            if row.reach.seconds and base_reach.seconds:
                row.reach_speedup = base_reach.seconds / row.reach.seconds


def timed_targets(rows: Sequence[Row]) -> list[tuple[str, float]]:
    """(baseline's name, target) of each baseline whose best the runs were timed to."""
    return sorted({(r.baseline, r.reach.target) for r in rows if r.baseline and r.reach})


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


def all_lm(rows: Sequence[Row]) -> bool:
    """Whether every run is a language model's: the figures then draw its loss, not accuracy."""
    return bool(rows) and all(r.is_lm for r in rows)


def seeds_vary(rows: Sequence[Row]) -> bool:
    return any(k in SEED_PARAMS for k in varying_params(rows))


def seed_groups(rows: Sequence[Row]) -> list[SeedGroup]:
    """The runs grouped by model, level, dtype and every varying param but the seeds."""
    keys = baseline_keys(rows)
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
            r.accumulate,
            *(r.params.get(k) for k in keys),
        )
        groups.setdefault(key, SeedGroup(label, r.model, [])).rows.append(r)
    return list(groups.values())
