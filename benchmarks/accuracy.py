"""Accuracy parity benchmark: do the mixed-precision levels reach O0's validation accuracy?

With fixed seeds, a fixed model and epoch budget, and synthetic data made hard enough that O0 ends
well short of 100% (about 85-90%), every checked level (O1, O2, their bfloat16 and fp8 presets,
and the compiled rows) should reach O0's mean best validation accuracy within 1 point, over 3
seeds. O3 (pure 16-bit) is run and reported whatever it does, never checked against O0; O3 in bf16
with stochastic rounding (`o3_bf16_sr`) has a check of its own: its mean within 0.3 point of
`o2_bf16`'s (the same bf16 model with fp32 master weights, which stochastic rounding replaces).

A level is a precision preset, or `<preset>+compile` for the same preset with
`trainer.compile=true` (its row shows the compile time). On the default task's tiny CNN, whose
only Linear layer has 10 outputs (not a multiple of 16), `o1_fp8` converts no layer to fp8: the
table shows each fp8 row's `precision.fp8_layers` so that this is seen.

Every (level, seed) is a real `runner.run.app.run` on the config tree composed with Hydra's compose
API, logged to an MLflow store (by default a fresh SQLite store in a temporary folder, never the
user's ./mlflow.db). The seeds vary `trainer.seed` (weight init and shuffling order); the dataset
(`data.seed`) stays fixed, so every run is validated on the very same images and the levels are
compared on equal terms.

    python -m benchmarks.accuracy                   # CPU: o0, bf16 presets, o1_fp8, 2 compiled
    python -m benchmarks.accuracy --device cuda     # GPU: o0-o3, bf16, fp8, 3 compiled
    python -m benchmarks.accuracy --levels o0,o2_bf16,o2_bf16+compile --seeds 0 --epochs 2
    python -m benchmarks.accuracy --suite state     # optimizer state: vit_tiny, AdamW

Optimizer-state rows (`--suite state`, or any level written `<preset>+<format>state`, e.g.
`o2_bf16+int4state`, and the presets with int8 state): each is checked against the same level with
its own state (`o2_bf16_int8state` against `o2_bf16`): bf16 and int8 state within 0.2 point, the
measured optimizer-state memory (`mem_optimizer_state_mb`) at most 0.3x (int8) and 0.2x (int4) of
fp32 state (the reference's measured state scaled to 4 bytes an element: `o3_bf16_sr` keeps its
state in bf16, half of that); int4 and fp8 accuracy is reported. The suite runs on `vit_tiny` (most
of a
transformer's elements are in tensors torchao quantises; the tiny CNN's are mostly under 4096
elements and keep fp32 state) with AdamW (torchao's low-bit optimizers are Adam and AdamW).

Writes a Markdown table (also printed), a CSV with one row per run and a JSON with everything,
after every run (a run stopped at a time limit keeps what it finished).
Exit status: 0 when every run finished, whatever the verdict (a benchmark, not a test); 1 when a
run crashed (an exception other than the runner's divergence stop, which is an outcome); 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import harness
from benchmarks.common import (
    add_device_option,
    compose,
    fresh_compile_cache,
    model_label,
    model_overrides,
    resolve_device,
    results_path,
    write_results,
)
from benchmarks.harness import STATE_CHECKED, STATE_MEMORY_TARGETS

EXPERIMENT = "accuracy-parity"
TARGET_POINTS = 1.0  # a checked level's mean must be within this many points of O0's mean
BASELINE = "o0"
# stochastic rounding's own check: o3_bf16_sr (bf16 weights, no masters) against o2_bf16 (the same
# bf16 model with fp32 master weights)
SR_LEVEL, SR_REFERENCE, SR_TARGET_POINTS = "o3_bf16_sr", "o2_bf16", 0.3
CPU_LEVELS = [
    "o0",
    "o1_bf16",
    "o2_bf16",
    "o3_bf16",
    "o3_bf16_sr",
    "o1_fp8",
    "o0+compile",
    "o2_bf16+compile",
]
CUDA_LEVELS = [
    "o0",
    "o1",
    "o2",
    "o3",
    "o1_bf16",
    "o2_bf16",
    "o3_bf16",
    "o3_bf16_sr",
    "o1_fp8",
    "o2_fp8",
    "o0+compile",
    "o2_bf16+compile",
    "o1_fp8+compile",
]
# Optimizer-state rows (`<preset>+<format>state`, and the presets with int8 state): each is checked
# against the same level with its own state (`o2_bf16+int8state` and `o2_bf16_int8state` against
# `o2_bf16`): bf16 and int8 state within 0.2 point, and the state's memory (the runs'
# mem_optimizer_state_mb) within common.STATE_MEMORY_TARGETS of fp32 state
# (common.fp32_state_ratio); int4 and fp8 are reported.
STATE_TARGET_POINTS = 0.2
# `--suite state`: the optimizer-state rows on a transformer (most of its elements in tensors that
# torchao quantises: the tiny CNN's are mostly under 4096 elements) with AdamW (torchao's low-bit
# optimizers are Adam and AdamW)
STATE_LEVELS = [
    "o2_bf16",
    "o2_bf16+bf16state",
    "o2_bf16_int8state",
    "o2_bf16+int4state",
    "o2_bf16+fp8state",
    "o3_bf16_sr",
    "o3_bf16_sr_int8state",
]
STATE_MODEL = "vit_tiny"
STATE_TASK = [
    "model.patch_size=4",
    "optimizer=adamw",
    "optimizer.lr=1e-3",
    "optimizer.weight_decay=0.05",
    "trainer.batch_size=256",
]
STATE_EPOCHS = 4
DEFAULT_SEEDS = [0, 1, 2]
DEFAULT_EPOCHS = 10
# The fixed task. Synthetic 16-px images whose white noise (std 4, against a class pattern of unit
# std) caps a small CNN at roughly 85-90%; 16000 train / 4000 val images; the tiny CNN (width 16),
# SGD (lr 0.1, momentum 0.9) with a cosine schedule. `--extra` overrides any of it.
TASK_OVERRIDES = [
    "data=synthetic",
    "data.num_train=16000",
    "data.num_val=4000",
    "data.image_size=16",
    "data.num_classes=10",
    "data.noise=4.0",
    "data.seed=0",
    "optimizer=sgd",
    "optimizer.lr=0.1",
    "scheduler=cosine",
    "trainer.batch_size=128",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=50",
    "trainer.checkpoint_every_n_epochs=0",  # no checkpoint files (only an interrupt writes one)
]


@dataclass
class RunResult(harness.Run):
    OBJECTIVE = ("best_val_acc", "accuracy")

    compiled: bool = False
    best_val_acc: float | None = None
    train_time_s: float | None = None  # the run's train_time_s: training, validation, compiling
    epochs_time_s: float | None = None  # the sum of its epoch_time_s: training only
    compile_time_s: float | None = None  # compiled runs: compiling the training step
    fp8_layers: int | None = None  # fp8 runs: the precision.fp8_layers param
    skipped_steps: float | None = None
    optimizer_state: str | None = None  # the precision.optimizer_state param (the state's format)
    state_mb: float | None = None  # mem_optimizer_state_mb: the state's stored bytes, in MiB


@dataclass
class LevelSummary:
    level: str
    opt_level: str
    dtype: str
    checked: bool  # against O0, within TARGET_POINTS
    compiled: bool = False
    fp8: str | None = None
    accs: dict[int, float | None] = field(default_factory=dict)
    mean: float | None = None
    std: float | None = None
    diff_points: float | None = None
    within_target: bool | None = None
    sr_checked: bool = False  # o3_bf16_sr: against o2_bf16, within SR_TARGET_POINTS
    vs_reference_points: float | None = None
    within_sr_target: bool | None = None
    skipped_steps: float | None = None
    mean_train_time_s: float | None = None
    mean_epochs_time_s: float | None = None
    compile_times_s: list[float] = field(default_factory=list)  # per seed, in seed order
    fp8_layers: list[int] = field(default_factory=list)  # per seed (the same model: one value)
    statuses: list[str] = field(default_factory=list)
    # optimizer-state rows: the level they are checked against, their format, the difference in
    # points, the state's memory against the reference's (means over seeds), and the verdicts
    state_reference: str | None = None
    state_format: str | None = None
    state_mb: float | None = None
    vs_state_points: float | None = None
    within_state_target: bool | None = None
    state_memory_ratio: float | None = None  # the state's MiB over fp32 state's (the targets')
    state_type: str | None = None  # its runs' precision.optimizer_state
    state_vs_reference: float | None = None  # the state's MiB over its reference level's
    reference_state_type: str | None = None
    within_memory_target: bool | None = None


# ---- arguments ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy",
        description="Accuracy parity of the precision levels against O0 (fp32): real training "
        "runs over several seeds; writes a Markdown table, a CSV and a JSON.",
    )
    add_device_option(parser)
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"trainer.max_epochs (default {DEFAULT_EPOCHS}; {STATE_EPOCHS} with --suite state)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model config option, or <zoo>:<arch> for model=<zoo> "
        "model.arch=<arch> (default tiny; vit_tiny with --suite state)",
    )
    parser.add_argument(
        "--suite",
        choices=["levels", "state"],
        default="levels",
        help="levels (default): the precision levels against O0 on the tiny "
        "CNN with SGD; state: the optimizer-state rows ("
        f"{','.join(STATE_LEVELS)}) on {STATE_MODEL} with AdamW, "
        f"{STATE_EPOCHS} epochs unless --epochs says otherwise",
    )
    harness.add_options(
        parser,
        EXPERIMENT,
        "accuracy",
        levels_help="comma-separated precision presets, each optionally with +compile "
        "(trainer.compile=true) (default: on CPU "
        f"{','.join(CPU_LEVELS)}; on CUDA {','.join(CUDA_LEVELS)}); o0, the "
        "baseline, is added when missing",
        fixed="the dataset (data.seed)",
        extra_help="more Hydra overrides, applied "
        "after the benchmark's own, e.g. --extra data.num_train=64 data.num_val=64",
    )
    args = parser.parse_args(argv)

    state_suite = args.suite == "state"
    if args.epochs is None:
        args.epochs = STATE_EPOCHS if state_suite else DEFAULT_EPOCHS
    if args.model is None:
        args.model = STATE_MODEL if state_suite else "tiny"
    args.suite_task = STATE_TASK if state_suite else []
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    args.seeds = harness.parse_seeds(parser, args.seeds, DEFAULT_SEEDS)
    args.device = resolve_device(parser, args.device)
    levels = args.levels or (
        STATE_LEVELS if state_suite else CUDA_LEVELS if args.device == "cuda" else CPU_LEVELS
    )
    args.levels = harness.parse_levels(parser, levels, BASELINE)
    if args.out is None:
        suite = "_state" if state_suite else ""
        args.out = results_path(f"accuracy{suite}_{args.device}.md", args.device)
    return args


# ---- running ------------------------------------------------------------------------------------
def task_overrides(args: argparse.Namespace) -> list[str]:
    return [
        *model_overrides(args.model),
        *TASK_OVERRIDES,
        *getattr(args, "suite_task", []),
        f"trainer.max_epochs={args.epochs}",
        f"trainer.device={args.device}",
        *args.extra,
    ]


def run_name(model: str, level: str, seed: int) -> str:
    """`<model>-<preset>[-<format>state][-compiled]-seed<seed>` (the runner's own suffix for a
    compiled run)."""
    return f"{model}-{level.replace('+compile', '-compiled').replace('+', '-')}-seed{seed}"


def run_one(args, level: str, seed: int) -> RunResult:
    """One real run of `level` at `seed`, then its times, fp8 layers and optimizer state read
    back from the store."""
    result = RunResult(level, seed, compiled=level.endswith("+compile"))
    name = run_name(model_label(args.model), level, seed)
    stored = harness.train(args, result, task_overrides(args), name, ["epoch_time_s"])
    result.train_time_s = stored.metrics.get("train_time_s")
    result.skipped_steps = stored.metrics.get("skipped_steps")
    result.compile_time_s = stored.metrics.get("compile_time_s")
    epochs = stored.histories.get("epoch_time_s")
    result.epochs_time_s = sum(v for _, v in epochs) if epochs else None
    if "precision.fp8_layers" in stored.params:
        result.fp8_layers = int(stored.params["precision.fp8_layers"])
    result.optimizer_state = stored.params.get("precision.optimizer_state")
    result.state_mb = stored.metrics.get("mem_optimizer_state_mb")
    return result


# ---- summary ------------------------------------------------------------------------------------
def summarise(results: list[RunResult], levels: list[str], seeds: list[int]) -> list[LevelSummary]:
    rows: list[LevelSummary] = []
    for level in levels:
        mine = [r for r in results if r.level == level]
        first = mine[0] if mine else RunResult(level, 0)
        reference, fmt = harness.state_reference(level)
        summary = LevelSummary(
            level=level,
            opt_level=first.opt_level,
            dtype=first.dtype,
            # (a state row is checked against its own level's fp32-state row instead)
            checked=level != BASELINE and first.opt_level != "O3" and reference is None,
            state_reference=reference,
            state_format=fmt,
            compiled=first.compiled,
            fp8=first.fp8,
            sr_checked=level == SR_LEVEL,
            accs=harness.by_seed(mine, "best_val_acc"),
            compile_times_s=[
                r.compile_time_s
                for r in sorted(mine, key=lambda r: r.seed)
                if r.compile_time_s is not None
            ],
            fp8_layers=[r.fp8_layers for r in mine if r.fp8_layers is not None],
            statuses=[r.status for r in mine],
        )
        summary.mean, summary.std = harness.seed_stats(summary.accs, seeds)
        skipped = harness.finite(r.skipped_steps for r in mine)
        summary.skipped_steps = sum(skipped) if skipped else None
        summary.mean_train_time_s = harness.mean(r.train_time_s for r in mine)
        summary.mean_epochs_time_s = harness.mean(r.epochs_time_s for r in mine)
        summary.state_mb = harness.mean(r.state_mb for r in mine)
        summary.state_type = next((r.optimizer_state for r in mine if r.optimizer_state), None)
        rows.append(summary)
    base = next((r for r in rows if r.level == BASELINE), None)
    reference = next((r for r in rows if r.level == SR_REFERENCE), None)
    by_level = {r.level: r for r in rows}
    for row in rows:
        if base is not None and base.mean is not None and row.mean is not None:
            row.diff_points = 100.0 * (row.mean - base.mean)
        ref = by_level.get(row.state_reference) if row.state_reference else None
        if ref is not None:
            if ref.mean is not None and row.mean is not None:
                row.vs_state_points = 100.0 * (row.mean - ref.mean)
            harness.compare_state(row, ref)
            if row.state_format in STATE_CHECKED:
                row.within_state_target = (
                    row.vs_state_points is not None
                    and abs(row.vs_state_points) <= STATE_TARGET_POINTS
                )
        if row.checked:
            row.within_target = (
                row.diff_points is not None and abs(row.diff_points) <= TARGET_POINTS
            )
        if row.sr_checked and reference is not None:
            if reference.mean is not None and row.mean is not None:
                row.vs_reference_points = 100.0 * (row.mean - reference.mean)
            row.within_sr_target = (
                row.vs_reference_points is not None
                and abs(row.vs_reference_points) <= SR_TARGET_POINTS
            )
    return rows


def verdict(rows: list[LevelSummary]) -> str:
    base = next((r for r in rows if r.level == BASELINE), None)
    if base is None or base.mean is None:
        return "Verdict: NO BASELINE: O0 did not finish every seed, nothing can be compared."
    checked = [r for r in rows if r.checked]
    missed = [r for r in checked if not r.within_target]
    o3 = [r for r in rows if r.opt_level == "O3"]
    sr = next((r for r in rows if r.sr_checked), None)

    def fmt(r: LevelSummary) -> str:
        if r.diff_points is None:
            return f"{r.level} (no result: {', '.join(sorted(set(r.statuses)))})"
        return f"{r.level} {r.diff_points:+.2f}"

    parts = []
    if not checked:
        parts.append("no checked level was run")
    elif missed:
        parts.append(
            f"MISS: {', '.join(fmt(r) for r in missed)} point(s) from O0 "
            f"(target: within {TARGET_POINTS:g}); within: "
            f"{', '.join(fmt(r) for r in checked if r.within_target) or 'none'}"
        )
    else:
        parts.append(
            f"PASS: every checked level is within {TARGET_POINTS:g} point of O0's "
            f"{100 * base.mean:.2f}% ({', '.join(fmt(r) for r in checked)} points)"
        )
    if sr is not None:
        if not any(r.level == SR_REFERENCE for r in rows):
            parts.append(
                f"{SR_LEVEL} against {SR_REFERENCE}: NOT JUDGED ({SR_REFERENCE} was not run)"
            )
        elif sr.vs_reference_points is None:
            parts.append(f"{SR_LEVEL} against {SR_REFERENCE}: NOT JUDGED (a run did not finish)")
        else:
            parts.append(
                f"{SR_LEVEL} against {SR_REFERENCE}: "
                f"{'PASS' if sr.within_sr_target else 'MISS'}, "
                f"{sr.vs_reference_points:+.2f} point(s) "
                f"(target: within {SR_TARGET_POINTS:g})"
            )
    states = [r for r in rows if r.state_reference]
    if states:
        parts.append(
            "optimizer state against its level's own: "
            + ", ".join(_state_verdict(r, rows) for r in states)
        )
    if o3:
        parts.append(
            f"O3 against O0 (reported, not checked): {', '.join(fmt(r) for r in o3)} points"
        )
    return "Verdict: " + "; ".join(parts) + "."


def _state_verdict(r: LevelSummary, rows: list[LevelSummary]) -> str:
    """`o2_bf16_int8state vs o2_bf16: PASS (+0.05 point, state 0.26x)`."""
    if not any(x.level == r.state_reference for x in rows):
        return f"{r.level} vs {r.state_reference}: NOT JUDGED ({r.state_reference} was not run)"
    if r.vs_state_points is None:
        return f"{r.level} vs {r.state_reference}: NOT JUDGED (a run did not finish)"
    checks = [c for c in (r.within_state_target, r.within_memory_target) if c is not None]
    word = "reported" if not checks else "PASS" if all(checks) else "MISS"
    ratio = "" if r.state_memory_ratio is None else f", state {r.state_memory_ratio:.2f}x of fp32"
    return f"{r.level} vs {r.state_reference}: {word} ({r.vs_state_points:+.2f} point{ratio})"


def _state_check(r: LevelSummary) -> str:
    """The check column of an optimizer-state row."""
    if r.vs_state_points is None:
        text = f"vs `{r.state_reference}`: not judged"
    elif r.within_state_target is None:
        text = f"vs `{r.state_reference}`: reported ({r.vs_state_points:+.2f})"
    else:
        text = (
            f"vs `{r.state_reference}` within {STATE_TARGET_POINTS:g}: "
            f"{'yes' if r.within_state_target else '**no**'} ({r.vs_state_points:+.2f})"
        )
    if r.state_memory_ratio is not None:
        text += f"; state {r.state_memory_ratio:.2f}x of fp32"
        if r.within_memory_target is not None:
            target = STATE_MEMORY_TARGETS[r.state_format]
            text += f" (<= {target:g}: {'yes' if r.within_memory_target else '**no**'})"
        if r.reference_state_type not in (None, "float32"):
            text += (
                f", {r.state_vs_reference:.2f}x of `{r.state_reference}`'s {r.reference_state_type}"
            )
    return text


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def notes(report: dict, rows: list[LevelSummary]) -> list[str]:
    """What the table's fp8 and compile columns mean, and what a reader could misread: an fp8
    row whose model has no layer fp8 can convert."""
    lines = []
    if any(r.fp8 for r in rows):
        text = (
            "fp8 layers: the runs' `precision.fp8_layers` param, the number of Linear "
            "layers that ran their GEMMs in fp8 (torchao converts only Linear layers whose "
            "sizes are multiples of 16; each run's `fp8_layers.txt` artifact lists every "
            "layer and why it stayed). On a CPU fp8 is emulated: its numerics, not its "
            "speed."
        )
        empty = [r.level for r in rows if r.fp8 and r.fp8_layers and not any(r.fp8_layers)]
        if empty:
            names = ", ".join(f"`{lvl}`" for lvl in empty)
            why = (
                " The tiny CNN's only Linear layer has 10 outputs, not a multiple of 16."
                if report.get("model") == "tiny"
                else ""
            )
            text += (
                f" **{names} converted no layer to fp8 on `{report.get('model')}`**:{why} "
                "Such a row is its bf16 level (O1's bf16 autocast, or O2's bf16 model with "
                "fp32 masters) with fp8 switched on and nothing to apply it to; it says "
                "nothing about fp8's accuracy."
            )
        lines += [text, ""]
    if any(r.compiled for r in rows):
        lines += [
            "compile (s): each compiled run's `compile_time_s` (compiling the training step "
            "before the first epoch), per seed in seed order. torch.compile's on-disk cache was "
            f"{report.get('compile_cache', 'not recorded')}, so a level's first seed compiles "
            "cold and its later seeds find its graphs in that cache; the process's first "
            "compiled run also pays torch.compile's one-time start-up. epochs (s): the mean over "
            "seeds "
            "of the summed `epoch_time_s` (training only: no compiling, no validation); "
            "train_time_s (s): the mean of the runs' `train_time_s` (training, validation and "
            "compiling).",
            "",
        ]
    return lines


def render_markdown(report: dict, rows: list[LevelSummary]) -> str:
    seeds = report["seeds"]
    n_val = report["num_val"]
    base = next((r for r in rows if r.level == BASELINE), None)
    lines = [
        f"# Accuracy parity ({report['device']})",
        "",
        f"Best validation accuracy (%) over {report['epochs']} epochs, per seed "
        f"(`trainer.seed`; the dataset, `data.seed`, is fixed), for each precision level against "
        f"O0 (fp32). A checked level (O1, O2, their bf16 and fp8 presets, compiled rows) passes "
        f"when its mean is within {TARGET_POINTS:g} point of O0's mean; O3 is reported, not "
        f"checked against O0, except that `{SR_LEVEL}` (bf16 weights without fp32 masters, "
        f"stochastic rounding) passes when its mean is within {SR_TARGET_POINTS:g} point of "
        f"`{SR_REFERENCE}`'s (the same bf16 model with fp32 master weights). `<preset>+compile` "
        "is the preset with `trainer.compile=true`."
        + (
            f" An optimizer-state row (`<preset>+<format>state`: `precision.optimizer_state`, "
            "or a preset with int8 state) is checked against the same level with its own state: "
            f"bf16 and int8 state within {STATE_TARGET_POINTS:g} point, the state's memory "
            "(`mem_optimizer_state_mb`) at most "
            + ", ".join(f"{v:g}x for {k}" for k, v in STATE_MEMORY_TARGETS.items())
            + " of fp32 state (the reference's state scaled to 4 bytes an element); int4 and fp8 "
            "accuracy is reported."
            if any(r.state_reference for r in rows)
            else ""
        ),
        "",
        "| level | preset | dtype | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean ± std | Δ vs O0 (points) | check | skipped steps | fp8 layers | compile (s) "
        "| epochs (s) | train_time_s (s) |",
        "|---|---|---|" + "---:|" * len(seeds) + "---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        accs = harness.seed_cells(r.accs, r.level, report, _pct)
        mean = "-" if r.mean is None else f"{100 * r.mean:.2f} ± {100 * (r.std or 0):.2f}"
        diff = "-" if r.diff_points is None else f"{r.diff_points:+.2f}"
        if r.level == BASELINE:
            within = "baseline"
        elif r.state_reference:
            within = _state_check(r)
        elif r.sr_checked:
            within = f"vs `{SR_REFERENCE}` within {SR_TARGET_POINTS:g}: " + (
                "not judged"
                if r.vs_reference_points is None
                else f"{'yes' if r.within_sr_target else '**no**'} ({r.vs_reference_points:+.2f})"
            )
        elif not r.checked:  # O3: reported whatever it is
            within = "not checked" + (
                ""
                if r.diff_points is None
                else f" ({'yes' if abs(r.diff_points) <= TARGET_POINTS else 'no'})"
            )
        else:
            within = f"within {TARGET_POINTS:g}: " + ("yes" if r.within_target else "**no**")
        skipped = "-" if r.skipped_steps is None else f"{r.skipped_steps:g}"
        fp8 = (
            "-"
            if not r.fp8
            else (
                "?" if not r.fp8_layers else " / ".join(str(n) for n in dict.fromkeys(r.fp8_layers))
            )
        )
        compiled = (
            "-" if not r.compiled else (" / ".join(f"{t:.1f}" for t in r.compile_times_s) or "?")
        )
        epochs = "-" if r.mean_epochs_time_s is None else f"{r.mean_epochs_time_s:.1f}"
        ttime = "-" if r.mean_train_time_s is None else f"{r.mean_train_time_s:.1f}"
        lines.append(
            f"| {r.opt_level or '?'} | `{r.level}` | {r.dtype or '?'} | "
            + " | ".join(accs)
            + f" | {mean} | {diff} | {within} | {skipped} | {fp8} | "
            f"{compiled} | {epochs} | {ttime} |"
        )
    lines += ["", verdict(rows), ""]
    lines += notes(report, rows)
    if base is not None and base.mean is not None and n_val:
        p = base.mean
        se = 100 * math.sqrt(p * (1 - p) / n_val)
        lines += [
            f"Statistics: {n_val} validation images, so one run's accuracy near O0's "
            f"{100 * p:.1f}% has a binomial standard error of {se:.2f} points "
            f"(mean of {len(seeds)} seeds: {se / math.sqrt(len(seeds)):.2f} points if the errors "
            "were independent). All runs see the same validation images, so that sampling error "
            "is shared and largely cancels in the differences; the seed-to-seed std in the table "
            "(initialisation and shuffling) is what the 1-point target is measured against. "
            "Best-of-epochs accuracy is biased upwards a little, equally for every level.",
            "",
        ]
    lines += [
        "## Setup",
        "",
        *harness.setup_lines(report),
        "- Task (Hydra overrides, then `precision=<preset> trainer.seed=<seed>`, and "
        "`trainer.compile=true` for a `+compile` level): "
        + " ".join(f"`{o}`" for o in report["overrides"]),
        "",
    ]
    lines += harness.unfinished_lines(report["_results"])
    return "\n".join(lines)


def write_outputs(out: Path, report: dict, rows: list[LevelSummary]) -> list[Path]:
    fields = [
        "level",
        "opt_level",
        "dtype",
        "seed",
        "status",
        "best_val_acc",
        "train_time_s",
        "epochs_time_s",
        "compile_time_s",
        "fp8_layers",
        "skipped_steps",
        "optimizer_state",
        "state_mb",
        "wall_s",
        "run_id",
        "error",
    ]
    payload = {k: v for k, v in report.items() if not k.startswith("_")}
    payload["summary"] = [asdict(r) for r in rows]
    payload["verdict"] = verdict(rows)
    return write_results(
        out, render_markdown(report, rows), [asdict(r) for r in report["_results"]], fields, payload
    )


# ---- entry point --------------------------------------------------------------------------------
def said(result: RunResult) -> str:
    """The line printed after a run."""
    acc = "-" if result.best_val_acc is None else f"{100 * result.best_val_acc:.2f}%"
    took = result.compile_time_s
    compiled = "" if took is None else f", compiled in {took:.1f} s"
    return (
        f"{result.status}: best val acc {acc}, skipped {result.skipped_steps}"
        f"{compiled}, {result.wall_s:.0f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    harness.open_store(args, "accuracy-parity-")
    compile_cache = (
        fresh_compile_cache() if any(lvl.endswith("+compile") for lvl in args.levels) else None
    )
    print(
        f"Accuracy parity: {len(args.levels)} levels x {len(args.seeds)} seeds on "
        f"{args.device}, {args.epochs} epochs; MLflow store {args.tracking_uri}",
        flush=True,
    )
    composed = compose(task_overrides(args))
    report = {
        "benchmark": EXPERIMENT,
        "device": args.device,
        "model": args.model,
        "levels": args.levels,
        "seeds": args.seeds,
        "epochs": args.epochs,
        "num_val": int(composed.data.get("num_val", 0) or 0),
        "target_points": TARGET_POINTS,
        "sr_check": {
            "level": SR_LEVEL,
            "reference": SR_REFERENCE,
            "target_points": SR_TARGET_POINTS,
        },
        "compile_cache": compile_cache,
        "overrides": task_overrides(args),
        **harness.report_fields("accuracy", argv, args),
    }

    def save() -> list[Path]:
        rows = summarise(report["_results"], args.levels, args.seeds)
        return write_outputs(args.out, report, rows)

    results = harness.run_all(args, report, lambda lv, s: run_one(args, lv, s), said, save)
    rows = summarise(results, args.levels, args.seeds)
    return harness.finish(render_markdown(report, rows), save(), results)


if __name__ == "__main__":
    sys.exit(main())
