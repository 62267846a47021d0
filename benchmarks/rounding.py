"""The stall case: where pure bf16 (O3) stops learning and stochastic rounding does not.

Without fp32 master weights, every update `w - lr * g` is rounded back to bf16, whose 8-bit
significand spaces neighbouring values 2^-8 of a weight apart: an update smaller than half that
spacing rounds back to the old weight and is lost. With a small enough learning rate many updates
are that small, so `o3_bf16` (round to nearest) keeps only the few that survive rounding and falls
far behind (on the default task it ends 23 points below the reference),
while `o2_bf16` (the same bf16 model with fp32 master weights, which keep the small updates) and
`o3_bf16_sr` (no masters; each weight rounded up or down at random in proportion to its distance,
so small updates survive on average) train alike.

The task: the tiny CNN on synthetic 16-px images (10 classes, noise std 2), plain SGD with
momentum at lr 0.003 and no schedule, batch 128. Every (level, seed) is a real `runner.run.app.run`
logged to an MLflow store (by default a fresh SQLite store in a temporary folder); the per-epoch
`val_acc` and `train_loss` histories are read back from the store. Results: a Markdown table, a
CSV (one row per run and epoch), a JSON with everything, and a PNG figure (train loss and
validation accuracy per epoch, mean over the seeds with a min-max band).

    python -m benchmarks.rounding                          # 3 levels x 3 seeds, 10 epochs, CPU
    python -m benchmarks.rounding --seeds 0 --epochs 3
    python -m benchmarks.rounding --lr 0.03 --seeds 0      # a larger lr: no stall

Verdict: the stall is shown when `o3_bf16`'s mean best validation accuracy is at least
STALL_POINTS below `o2_bf16`'s while `o3_bf16_sr`'s is within SR_POINTS of it. Exit status: 0
when every run finished, whatever the verdict; 1 when a run crashed (a `DivergenceError` is an
outcome); 2 for bad arguments.
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
    add_threads_option,
    apply_threads,
    compose,
    resolve_device,
    results_path,
    save_figure,
    write_results,
)

EXPERIMENT = "rounding-stall"
REFERENCE, STALLS, ROUNDS = "o2_bf16", "o3_bf16", "o3_bf16_sr"
LEVELS = [REFERENCE, STALLS, ROUNDS]
DEFAULT_SEEDS = [0, 1, 2]
DEFAULT_EPOCHS = 10
DEFAULT_LR = 0.003
# The verdict's thresholds, on the mean over seeds of each run's best validation accuracy: the
# stall is shown when o3_bf16 ends at least STALL_POINTS below o2_bf16 and o3_bf16_sr within
# SR_POINTS of it.
STALL_POINTS = 10.0
SR_POINTS = 2.0
# The task (the lr and epochs come from the options; --extra overrides any of it). The training
# loss is logged once per epoch (log_every_n_steps is set to the epoch's step count), so each
# logged value is that epoch's mean.
TASK_OVERRIDES = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=4000",
    "data.num_val=1000",
    "data.image_size=16",
    "data.num_classes=10",
    "data.noise=2.0",
    "data.seed=0",
    "optimizer=sgd",
    "optimizer.momentum=0.9",
    "scheduler=none",
    "trainer.batch_size=128",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.checkpoint_every_n_epochs=0",  # no checkpoint files (only an interrupt writes one)
]
# the reference drawn wide and pale under the others: o3_bf16_sr follows it closely
STYLES = {
    REFERENCE: {"color": "tab:blue", "linewidth": 4.0, "alpha": 0.45, "marker": None},
    STALLS: {"color": "tab:red", "linewidth": 1.6, "marker": "o", "markersize": 3},
    ROUNDS: {"color": "tab:green", "linewidth": 1.6, "marker": "s", "markersize": 3},
}


@dataclass
class RunResult(harness.Run):
    OBJECTIVE = ("best_val_acc", "accuracy")

    best_val_acc: float | None = None
    final_val_acc: float | None = None
    final_train_loss: float | None = None
    val_acc: list[float | None] = field(default_factory=list)  # per epoch, from the store
    train_loss: list[float | None] = field(default_factory=list)  # per epoch (its mean)


@dataclass
class LevelSummary:
    level: str
    dtype: str
    best: dict[int, float | None] = field(default_factory=dict)  # per seed
    mean: float | None = None
    std: float | None = None
    vs_reference_points: float | None = None
    final_val_acc: float | None = None  # means over seeds
    final_train_loss: float | None = None
    # per epoch over the seeds: mean, min, max (None where a seed has no value)
    val_acc: dict[str, list[float | None]] = field(default_factory=dict)
    train_loss: dict[str, list[float | None]] = field(default_factory=dict)
    statuses: list[str] = field(default_factory=list)


# ---- arguments ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rounding",
        description="The stall case: o2_bf16 (fp32 masters), o3_bf16 (round to nearest) and "
        "o3_bf16_sr (stochastic rounding) at a learning rate small enough that bf16 loses most "
        "updates; real runs over several seeds; Markdown, CSV, JSON and a PNG figure.",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=DEFAULT_EPOCHS,
        help=f"trainer.max_epochs (default {DEFAULT_EPOCHS})",
    )
    parser.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help=f"optimizer.lr (default {DEFAULT_LR})"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default="cpu",
        help="default cpu (the committed results are a CPU run)",
    )
    harness.add_options(
        parser,
        EXPERIMENT,
        "rounding",
        levels_help=f"comma-separated presets (default {','.join(LEVELS)}; the verdict needs "
        "those three)",
        fixed="the dataset (data.seed)",
        beside=".csv, .json and .png",
    )
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(parser, args)

    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    args.seeds = harness.parse_seeds(parser, args.seeds, DEFAULT_SEEDS)
    args.device = resolve_device(parser, args.device)
    args.levels = harness.parse_levels(parser, args.levels or LEVELS, compiled=False)
    if args.out is None:
        args.out = results_path(f"rounding_{args.device}.md", args.device)
    return args


# ---- running ------------------------------------------------------------------------------------
def task_overrides(args: argparse.Namespace) -> list[str]:
    """The task's overrides: the fixed ones, the options', the training loss logged once per
    epoch, then --extra (so that a user's override wins)."""
    base = [
        *TASK_OVERRIDES,
        f"optimizer.lr={args.lr}",
        f"trainer.max_epochs={args.epochs}",
        f"trainer.device={args.device}",
    ]
    cfg = compose([*base, *args.extra])
    steps = math.ceil(int(cfg.data.num_train) / int(cfg.trainer.batch_size))
    return [*base, f"trainer.log_every_n_steps={steps}", *args.extra]


def per_epoch(history: list[tuple[int, float]], epochs: int) -> list[float | None]:
    """A per-epoch metric (step = epoch, 1-based) as a list over epochs 1..`epochs`."""
    values = dict(history)
    return [values.get(epoch) for epoch in range(1, epochs + 1)]


def epoch_means(
    history: list[tuple[int, float]], steps_per_epoch: int, epochs: int
) -> list[float | None]:
    """The training loss per epoch from its logged history (step = optimizer step; each value
    the mean loss since the previous one): the values logged within an epoch, weighted by the
    steps each covers. With one value per epoch (the default task) that value itself."""
    sums = [0.0] * epochs
    weights = [0] * epochs
    previous = 0
    for step, value in history:
        epoch = math.ceil(step / steps_per_epoch)
        start = max(previous, (epoch - 1) * steps_per_epoch)
        if 1 <= epoch <= epochs:
            sums[epoch - 1] += value * (step - start)
            weights[epoch - 1] += step - start
        previous = step
    return [s / w if w else None for s, w in zip(sums, weights)]


def run_one(args, level: str, seed: int, task: list[str]) -> RunResult:
    """One real run of `level` at `seed`, then its per-epoch validation accuracy and training
    loss read back from the store."""
    result = RunResult(level, seed)
    name = f"tiny-{level}-lr{args.lr:g}-seed{seed}"
    stored = harness.train(args, result, task, name, ["val_acc", "train_loss"])
    if stored.run_id is not None:
        cfg = compose(task)
        steps = math.ceil(int(cfg.data.num_train) / int(cfg.trainer.batch_size))
        result.val_acc = per_epoch(stored.histories.get("val_acc", []), args.epochs)
        result.train_loss = epoch_means(stored.histories.get("train_loss", []), steps, args.epochs)
        done = [v for v in result.val_acc if v is not None]
        result.final_val_acc = done[-1] if done else None
        losses = [v for v in result.train_loss if v is not None]
        result.final_train_loss = losses[-1] if losses else None
    return result


# ---- summary ------------------------------------------------------------------------------------
def _band(series: list[list[float | None]], epochs: int) -> dict[str, list[float | None]]:
    """Per epoch: mean, min and max over the seeds that have a finite value there."""
    band: dict[str, list[float | None]] = {"mean": [], "min": [], "max": []}
    for i in range(epochs):
        values = harness.finite(s[i] for s in series if i < len(s))
        band["mean"].append(harness.mean(values))
        band["min"].append(min(values) if values else None)
        band["max"].append(max(values) if values else None)
    return band


def summarise(
    results: list[RunResult], levels: list[str], seeds: list[int], epochs: int
) -> list[LevelSummary]:
    rows = []
    for level in levels:
        mine = [r for r in results if r.level == level]
        row = LevelSummary(
            level=level,
            dtype=mine[0].dtype if mine else "",
            best=harness.by_seed(mine, "best_val_acc"),
            statuses=[r.status for r in mine],
        )
        row.mean, row.std = harness.seed_stats(row.best, seeds)
        row.final_val_acc = harness.mean(r.final_val_acc for r in mine)
        row.final_train_loss = harness.mean(r.final_train_loss for r in mine)
        row.val_acc = _band([r.val_acc for r in mine], epochs)
        row.train_loss = _band([r.train_loss for r in mine], epochs)
        rows.append(row)
    reference = next((r for r in rows if r.level == REFERENCE), None)
    for row in rows:
        if reference is not None and reference.mean is not None and row.mean is not None:
            row.vs_reference_points = 100.0 * (row.mean - reference.mean)
    return rows


def verdict(rows: list[LevelSummary]) -> str:
    by = {r.level: r for r in rows}
    missing = [lvl for lvl in LEVELS if lvl not in by or by[lvl].mean is None]
    if missing:
        return (
            f"Verdict: NOT JUDGED: {', '.join(missing)} did not finish every seed (the "
            f"verdict compares {STALLS} and {ROUNDS} with {REFERENCE})."
        )
    stall, sr = by[STALLS].vs_reference_points, by[ROUNDS].vs_reference_points
    stalls, keeps = stall <= -STALL_POINTS, abs(sr) <= SR_POINTS
    head = "STALL SHOWN" if stalls and keeps else "STALL NOT SHOWN"
    return (
        f"Verdict: {head}: {STALLS} {stall:+.2f} points from {REFERENCE}'s "
        f"{100 * by[REFERENCE].mean:.2f}% ({'stalls' if stalls else 'does not stall'}: "
        f"the threshold is at least {STALL_POINTS:g} points below); {ROUNDS} {sr:+.2f} points "
        f"({'keeps up' if keeps else 'does not keep up'}: the threshold is within "
        f"{SR_POINTS:g} points)."
    )


# ---- reporting ----------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def render_markdown(report: dict, rows: list[LevelSummary], figure_name: str | None) -> str:
    seeds, epochs = report["seeds"], report["epochs"]
    chance = 100.0 / report["num_classes"] if report.get("num_classes") else None
    lines = [
        f"# The stall case: bf16 rounding at a small learning rate ({report['device']})",
        "",
        f"The tiny CNN trained for {epochs} epochs at lr {report['lr']:g} (SGD with momentum, no "
        "schedule) in three ways: `o2_bf16`, a bf16 model with fp32 master weights (the "
        "reference); `o3_bf16`, bf16 weights without masters, each update rounded to the "
        "nearest bf16 value; `o3_bf16_sr`, bf16 weights without masters, each update rounded up "
        "or down at random in proportion to its distance (stochastic rounding). bf16 spaces "
        "neighbouring values 2^-8 of a weight apart, so an update smaller than half of that is "
        "lost by round to nearest, and at a learning rate this small many updates are that "
        "small. Best validation accuracy (%) per seed "
        "(`trainer.seed`; the data, `data.seed`, is fixed), then the last epoch's validation "
        "accuracy and mean training loss, means over the seeds"
        + (f"; chance is {chance:.0f}%." if chance else "."),
        "",
        "| level | dtype | "
        + " | ".join(f"seed {s}" for s in seeds)
        + f" | mean ± std | Δ vs `{REFERENCE}` (points) | last val acc | last train loss |",
        "|---|---|" + "---:|" * len(seeds) + "---:|---:|---:|---:|",
    ]
    for r in rows:
        accs = harness.seed_cells(r.best, r.level, report, _pct)
        mean = "-" if r.mean is None else f"{100 * r.mean:.2f} ± {100 * (r.std or 0):.2f}"
        diff = (
            "reference"
            if r.level == REFERENCE
            else "-"
            if r.vs_reference_points is None
            else f"{r.vs_reference_points:+.2f}"
        )
        loss = "-" if r.final_train_loss is None else f"{r.final_train_loss:.3f}"
        lines.append(
            f"| `{r.level}` | {r.dtype or '?'} | "
            + " | ".join(accs)
            + f" | {mean} | {diff} | {_pct(r.final_val_acc)} | {loss} |"
        )
    lines += ["", verdict(rows), ""]
    lines += [
        "## Per epoch (mean over the seeds)",
        "",
        "| epoch | "
        + " | ".join(f"`{r.level}` val acc" for r in rows)
        + " | "
        + " | ".join(f"`{r.level}` train loss" for r in rows)
        + " |",
        "|---:|" + "---:|" * (2 * len(rows)),
    ]
    for i in range(epochs):
        lines.append(
            f"| {i + 1} | "
            + " | ".join(_pct(r.val_acc["mean"][i]) for r in rows)
            + " | "
            + " | ".join(
                "-" if r.train_loss["mean"][i] is None else f"{r.train_loss['mean'][i]:.3f}"
                for r in rows
            )
            + " |"
        )
    lines.append("")
    if figure_name:
        lines += [
            f"![Training loss and validation accuracy per epoch]({figure_name})",
            "",
            "The figure: per epoch, the mean over the seeds (line) and the lowest and "
            "highest seed (band); the training loss is each epoch's mean.",
            "",
        ]
    lines += [
        "## Setup",
        "",
        *harness.setup_lines(report),
        f"- Verdict thresholds: `{STALLS}` at least {STALL_POINTS:g} points below `{REFERENCE}`,"
        f" `{ROUNDS}` within {SR_POINTS:g} points of it (means of the best validation accuracy "
        "over the seeds)",
        "- Task (Hydra overrides, then `precision=<level> trainer.seed=<seed>`): "
        + " ".join(f"`{o}`" for o in report["overrides"]),
        "",
    ]
    lines += harness.unfinished_lines(report["_results"])
    return "\n".join(lines)


def figure(report: dict, rows: list[LevelSummary], path: Path) -> Path | None:
    """Two panels over the epochs, one line per level: the training loss (each epoch's mean) and
    the validation accuracy, each the mean over the seeds with a min-max band. None (and a note)
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure", file=sys.stderr)
        return None
    epochs = list(range(1, report["epochs"] + 1))
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.4))
    for row in rows:
        style = STYLES.get(row.level, {"linewidth": 1.6, "marker": "^", "markersize": 3})
        label = {
            REFERENCE: f"{REFERENCE} (fp32 master weights)",
            STALLS: f"{STALLS} (round to nearest, no masters)",
            ROUNDS: f"{ROUNDS} (stochastic rounding, no masters)",
        }.get(row.level, row.level)
        for ax, band, scale in ((loss_ax, row.train_loss, 1.0), (acc_ax, row.val_acc, 100.0)):
            points = [
                (e, m, lo, hi)
                for e, m, lo, hi in zip(epochs, band["mean"], band["min"], band["max"])
                if m is not None
            ]
            if not points:
                continue
            xs = [p[0] for p in points]
            (line,) = ax.plot(xs, [scale * p[1] for p in points], label=label, **style)
            ax.fill_between(
                xs,
                [scale * p[2] for p in points],
                [scale * p[3] for p in points],
                color=line.get_color(),
                alpha=0.15,
                linewidth=0,
            )
    if report.get("num_classes"):
        acc_ax.axhline(
            100.0 / report["num_classes"], color="grey", linestyle=":", linewidth=1, label="chance"
        )
    loss_ax.set_title("training loss (epoch mean)")
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("cross-entropy")
    acc_ax.set_title("validation accuracy")
    acc_ax.set_xlabel("epoch")
    acc_ax.set_ylabel("%")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.set_xticks(epochs)
    acc_ax.legend(fontsize=8, loc="best")
    where = report["machine"].get("gpu") or report["machine"]["cpu"]
    seeds = len(report["seeds"])
    head = verdict(rows).removeprefix("Verdict: ").split(":")[0].lower()
    fig.suptitle(
        f"bf16 weights at lr {report['lr']:g}: fp32 masters, round to nearest, "
        f"stochastic rounding ({head})\ntiny CNN, synthetic 16-px data, SGD momentum "
        f"0.9; mean of {seeds} seed{'s' if seeds > 1 else ''}, band: lowest to highest "
        f"seed; {where}",
        fontsize=10,
    )
    return save_figure(fig, path)


CSV_FIELDS = ["level", "seed", "epoch", "status", "val_acc", "train_loss", "best_val_acc", "run_id"]


def csv_rows(results: list[RunResult]) -> list[dict]:
    """One row per run and epoch (a run without a history: one row with its status)."""
    rows = []
    for r in results:
        epochs = max(len(r.val_acc), len(r.train_loss))
        for i in range(epochs):
            rows.append(
                {
                    "level": r.level,
                    "seed": r.seed,
                    "epoch": i + 1,
                    "status": r.status,
                    "val_acc": r.val_acc[i] if i < len(r.val_acc) else None,
                    "train_loss": r.train_loss[i] if i < len(r.train_loss) else None,
                    "best_val_acc": r.best_val_acc,
                    "run_id": r.run_id,
                }
            )
        if not epochs:
            rows.append(
                {
                    "level": r.level,
                    "seed": r.seed,
                    "epoch": None,
                    "status": r.status,
                    "best_val_acc": r.best_val_acc,
                    "run_id": r.run_id,
                }
            )
    return rows


def write_outputs(
    out: Path, report: dict, rows: list[LevelSummary], with_figure: bool = True
) -> list[Path]:
    png = out.with_suffix(".png")
    drawn = figure(report, rows, png) if with_figure else None
    payload = {k: v for k, v in report.items() if not k.startswith("_")}
    payload["summary"] = [asdict(r) for r in rows]
    payload["verdict"] = verdict(rows)
    payload["thresholds"] = {"stall_points": STALL_POINTS, "sr_points": SR_POINTS}
    paths = write_results(
        out,
        render_markdown(report, rows, png.name if drawn else None),
        csv_rows(report["_results"]),
        CSV_FIELDS,
        payload,
    )
    return paths + ([drawn] if drawn else [])


# ---- entry point --------------------------------------------------------------------------------
def said(result: RunResult) -> str:
    """The line printed after a run."""
    loss = result.final_train_loss
    return (
        f"{result.status}: best val acc {_pct(result.best_val_acc)}%, last train loss "
        f"{'-' if loss is None else f'{loss:.3f}'}, {result.wall_s:.0f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    harness.open_store(args, "rounding-stall-")
    overrides = task_overrides(args)
    composed = compose(overrides)
    print(
        f"Rounding stall: {len(args.levels)} levels x {len(args.seeds)} seeds on {args.device}, "
        f"{args.epochs} epochs at lr {args.lr:g}; MLflow store {args.tracking_uri}",
        flush=True,
    )
    report = {
        "benchmark": EXPERIMENT,
        "device": args.device,
        "levels": args.levels,
        "seeds": args.seeds,
        "epochs": args.epochs,
        "lr": args.lr,
        "num_classes": int(composed.data.get("num_classes", 0) or 0),
        "overrides": overrides,
        **harness.report_fields("rounding", argv, args),
    }

    def rows() -> list[LevelSummary]:
        return summarise(report["_results"], args.levels, args.seeds, args.epochs)

    results = harness.run_all(
        args,
        report,
        lambda level, seed: run_one(args, level, seed, overrides),
        said,
        lambda: write_outputs(args.out, report, rows(), with_figure=False),
        seed_major=True,  # a command stopped early leaves every level compared
    )
    paths = write_outputs(args.out, report, rows())
    return harness.finish(render_markdown(report, rows(), None), paths, results)


if __name__ == "__main__":
    sys.exit(main())
