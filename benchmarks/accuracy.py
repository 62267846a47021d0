"""Accuracy parity benchmark: do the mixed-precision levels reach O0's validation accuracy?

With fixed seeds, a fixed model and epoch budget, and synthetic data made hard enough that O0 ends
well short of 100% (about 85-90%), every checked level (O1, O2 and their bfloat16 presets) should
reach O0's mean best validation accuracy within 1 point, over 3 seeds. O3 (pure 16-bit) is run and
reported whatever it does, never checked.

Every (level, seed) is a real `runner.app.run` on the config tree composed with Hydra's compose
API, logged to an MLflow store (by default a fresh SQLite store in a temporary folder, never the
user's ./mlflow.db). The seeds vary `trainer.seed` (weight init and shuffling order); the dataset
(`data.seed`) stays fixed, so every run is validated on the very same images and the levels are
compared on equal terms.

    python benchmarks/accuracy.py                       # CPU: o0 + o1_bf16, o2_bf16, o3_bf16
    python benchmarks/accuracy.py --device cuda         # GPU: o0, o1, o2, o3 + the bf16 presets
    python benchmarks/accuracy.py --levels o0,o2_bf16 --seeds 0 --epochs 2

Writes a Markdown table (also printed), a CSV with one row per run and a JSON with everything.
Exit status: 0 when every run finished, whatever the verdict (a benchmark, not a test); 1 when a
run crashed (an exception other than the runner's divergence stop, which is an outcome); 2 for
bad arguments.
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
from common import (REPO, command, compose, csv_list, machine, now,  # noqa: E402
                    prepare_store, write_results)

EXPERIMENT = "accuracy-parity"
TARGET_POINTS = 1.0  # a checked level's mean must be within this many points of O0's mean
BASELINE = "o0"
CPU_LEVELS = ["o0", "o1_bf16", "o2_bf16", "o3_bf16"]
CUDA_LEVELS = ["o0", "o1", "o2", "o3", "o1_bf16", "o2_bf16", "o3_bf16"]
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
]

log = logging.getLogger("benchmarks.accuracy")


@dataclass
class RunResult:
    level: str
    seed: int
    opt_level: str = ""
    dtype: str = ""
    status: str = "finished"  # finished | diverged | crashed
    best_val_acc: float | None = None
    train_time_s: float | None = None
    skipped_steps: float | None = None
    wall_s: float | None = None
    run_id: str | None = None
    error: str | None = None


@dataclass
class LevelSummary:
    level: str
    opt_level: str
    dtype: str
    checked: bool
    accs: dict[int, float | None] = field(default_factory=dict)
    mean: float | None = None
    std: float | None = None
    diff_points: float | None = None
    within_target: bool | None = None
    skipped_steps: float | None = None
    mean_train_time_s: float | None = None
    statuses: list[str] = field(default_factory=list)


# ---- arguments ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/accuracy.py",
        description="Accuracy parity of the precision levels against O0 (fp32): real training "
        "runs over several seeds; writes a Markdown table, a CSV and a JSON.",
    )
    parser.add_argument("--levels", type=csv_list, default=None,
                        help="comma-separated precision presets (default: on CPU "
                        f"{','.join(CPU_LEVELS)}; on CUDA {','.join(CUDA_LEVELS)}); o0, the "
                        "baseline, is added when missing")
    parser.add_argument("--seeds", type=csv_list, default=None,
                        help="comma-separated trainer.seed values (default 0,1,2); the dataset "
                        "(data.seed) stays fixed")
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                        help=f"trainer.max_epochs (default {DEFAULT_EPOCHS})")
    parser.add_argument("--model", default="tiny", help="model config option (default tiny)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the Markdown table; the .csv and .json go beside it (default "
                        "benchmarks/results/accuracy_<cpu|cuda>.md)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store (default: sqlite:///<a new temporary folder>/mlflow.db)")
    parser.add_argument("--experiment", default=EXPERIMENT,
                        help=f"MLflow experiment name (default {EXPERIMENT})")
    parser.add_argument("--extra", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="more Hydra overrides, applied after the benchmark's own, e.g. "
                        "--extra data.num_train=64 data.num_val=64")
    parser.add_argument("--verbose", "-v", action="store_true", help="show the runner's log")
    args = parser.parse_args(argv)

    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    try:
        args.seeds = [int(s) for s in (args.seeds or DEFAULT_SEEDS)]
    except ValueError:
        parser.error(f"--seeds must be integers, got {args.seeds}")
    if not args.seeds:
        parser.error("--seeds is empty")

    import torch

    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    from runner.app import preset_options

    known = preset_options()
    levels = args.levels or (CUDA_LEVELS if args.device == "cuda" else CPU_LEVELS)
    unknown = [lvl for lvl in levels if lvl not in known]
    if unknown:
        parser.error(f"unknown level(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if BASELINE not in levels:
        levels = [BASELINE, *levels]
    args.levels = list(dict.fromkeys(levels))  # unique, in order
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / f"accuracy_{args.device}.md"
    return args


# ---- running ------------------------------------------------------------------------------------
def task_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"model={args.model}",
        *TASK_OVERRIDES,
        f"trainer.max_epochs={args.epochs}",
        f"trainer.device={args.device}",
        *args.extra,
    ]


def read_run_metrics(tracking_uri: str, experiment: str, key: str) -> tuple[str | None, dict]:
    """The finished run tagged `benchmark_key=<key>` and its latest metric values."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None, {}
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.benchmark_key = '{key}'")
    if not runs:
        return None, {}
    return runs[0].info.run_id, dict(runs[0].data.metrics)


def run_one(args, level: str, seed: int, session: str) -> RunResult:
    from runner.app import run
    from runner.errors import DivergenceError
    from runner.report import describe_dtype

    key = f"{session}/{level}/s{seed}"
    overrides = [
        *task_overrides(args),
        f"precision={level}",
        f"trainer.seed={seed}",
        f"mlflow.tracking_uri={args.tracking_uri}",
        f"mlflow.experiment_name={args.experiment}",
        f"mlflow.run_name={args.model}-{level}-seed{seed}",
        f"+mlflow.tags.benchmark={EXPERIMENT}",
        f"+mlflow.tags.benchmark_key={key}",
        f"+mlflow.tags.benchmark_seed={seed}",
    ]
    result = RunResult(level=level, seed=seed)
    started = time.perf_counter()
    try:
        cfg = compose(overrides)
        result.opt_level = str(cfg.precision.opt_level)
        result.dtype = describe_dtype(cfg.precision)
        result.best_val_acc = run(cfg, overrides=overrides)
    except DivergenceError as error:  # an outcome (O3 may do this), not a crash
        result.status, result.error = "diverged", str(error)
    except Exception as error:  # noqa: BLE001  (reported, and the exit status says so)
        result.status, result.error = "crashed", f"{type(error).__name__}: {error}"
        log.debug("%s", traceback.format_exc())
        print(traceback.format_exc(), file=sys.stderr)
    result.wall_s = time.perf_counter() - started
    try:
        result.run_id, metrics = read_run_metrics(args.tracking_uri, args.experiment, key)
    except Exception as error:  # noqa: BLE001
        metrics = {}
        log.warning("could not read the run's metrics back: %s", error)
    result.train_time_s = metrics.get("train_time_s")
    result.skipped_steps = metrics.get("skipped_steps")
    if result.best_val_acc is None and result.status == "finished":
        result.status, result.error = "crashed", "the run returned no accuracy"
    return result


# ---- summary ------------------------------------------------------------------------------------
def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def summarise(results: list[RunResult], levels: list[str], seeds: list[int]) -> list[LevelSummary]:
    rows: list[LevelSummary] = []
    for level in levels:
        mine = [r for r in results if r.level == level]
        first = mine[0] if mine else RunResult(level, 0)
        summary = LevelSummary(
            level=level,
            opt_level=first.opt_level,
            dtype=first.dtype,
            checked=level != BASELINE and first.opt_level != "O3",
            accs={r.seed: r.best_val_acc if r.status == "finished" else None for r in mine},
            statuses=[r.status for r in mine],
        )
        accs = _finite(summary.accs.get(s) for s in seeds)
        if accs and len(accs) == len(seeds):
            summary.mean = statistics.fmean(accs)
            summary.std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        skipped = _finite(r.skipped_steps for r in mine)
        summary.skipped_steps = sum(skipped) if skipped else None
        times = _finite(r.train_time_s for r in mine)
        summary.mean_train_time_s = statistics.fmean(times) if times else None
        rows.append(summary)
    base = next((r for r in rows if r.level == BASELINE), None)
    for row in rows:
        if base is not None and base.mean is not None and row.mean is not None:
            row.diff_points = 100.0 * (row.mean - base.mean)
        if row.checked:
            row.within_target = row.diff_points is not None and abs(row.diff_points) <= TARGET_POINTS
    return rows


def verdict(rows: list[LevelSummary]) -> str:
    base = next((r for r in rows if r.level == BASELINE), None)
    if base is None or base.mean is None:
        return "Verdict: NO BASELINE: O0 did not finish every seed, nothing can be compared."
    checked = [r for r in rows if r.checked]
    missed = [r for r in checked if not r.within_target]
    o3 = [r for r in rows if r.opt_level == "O3"]

    def fmt(r: LevelSummary) -> str:
        if r.diff_points is None:
            return f"{r.level} (no result: {', '.join(sorted(set(r.statuses)))})"
        return f"{r.level} {r.diff_points:+.2f}"

    parts = []
    if not checked:
        parts.append("no checked level was run")
    elif missed:
        parts.append(f"MISS: {', '.join(fmt(r) for r in missed)} point(s) from O0 "
                     f"(target: within {TARGET_POINTS:g}); within: "
                     f"{', '.join(fmt(r) for r in checked if r.within_target) or 'none'}")
    else:
        parts.append(f"PASS: every checked level is within {TARGET_POINTS:g} point of O0's "
                     f"{100 * base.mean:.2f}% ({', '.join(fmt(r) for r in checked)} points)")
    if o3:
        parts.append(f"O3 (reported, not checked): {', '.join(fmt(r) for r in o3)} points")
    return "Verdict: " + "; ".join(parts) + "."


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def render_markdown(report: dict, rows: list[LevelSummary]) -> str:
    seeds = report["seeds"]
    n_val = report["num_val"]
    base = next((r for r in rows if r.level == BASELINE), None)
    lines = [
        f"# Accuracy parity ({report['device']})",
        "",
        f"Best validation accuracy (%) over {report['epochs']} epochs, per seed "
        f"(`trainer.seed`; the dataset, `data.seed`, is fixed), for each precision level against "
        f"O0 (fp32). A checked level (O1, O2, their bf16 presets) passes when its mean is within "
        f"{TARGET_POINTS:g} point of O0's mean; O3 is reported, not checked.",
        "",
        "| level | preset | dtype | " + " | ".join(f"seed {s}" for s in seeds)
        + " | mean ± std | Δ vs O0 (points) | within 1 point | skipped steps | mean train time (s) |",
        "|---|---|---|" + "---:|" * len(seeds) + "---:|---:|---|---:|---:|",
    ]
    for r in rows:
        accs = []
        for s in seeds:
            value = r.accs.get(s)
            if value is None:
                status = next((x.status for x in report["_results"] if x.level == r.level
                               and x.seed == s), "missing")
                accs.append(status)
            else:
                accs.append(_pct(value))
        mean = "-" if r.mean is None else f"{100 * r.mean:.2f} ± {100 * (r.std or 0):.2f}"
        diff = "-" if r.diff_points is None else f"{r.diff_points:+.2f}"
        if r.level == BASELINE:
            within = "baseline"
        elif not r.checked:  # O3: reported whatever it is
            within = "not checked" + ("" if r.diff_points is None else
                                      f" ({'yes' if abs(r.diff_points) <= TARGET_POINTS else 'no'})")
        else:
            within = "yes" if r.within_target else "**no**"
        skipped = "-" if r.skipped_steps is None else f"{r.skipped_steps:g}"
        ttime = "-" if r.mean_train_time_s is None else f"{r.mean_train_time_s:.1f}"
        lines.append(f"| {r.opt_level or '?'} | `{r.level}` | {r.dtype or '?'} | "
                     + " | ".join(accs) + f" | {mean} | {diff} | {within} | {skipped} | {ttime} |")
    lines += ["", verdict(rows), ""]
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
    m = report["machine"]
    lines += [
        "## Setup",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores (torch uses {m['torch_threads']} threads)"
        + (f", GPU {m['gpu']} (CUDA {m['cuda']})" if "gpu" in m else "")
        + f"; torch {m['torch']}, Python {m['python']}, {m['platform']}",
        f"- Date: {report['date']}",
        f"- Command: `{report['command']}`",
        f"- Total wall time: {report['total_wall_s'] / 60:.1f} min for {len(report['runs'])} runs",
        f"- MLflow: experiment `{report['experiment']}` in `{report['tracking_uri']}`",
        "- Task (Hydra overrides, then `precision=<level> trainer.seed=<seed>`): "
        + " ".join(f"`{o}`" for o in report["overrides"]),
        "",
    ]
    crashed = [r for r in report["_results"] if r.status != "finished"]
    if crashed:
        lines += ["## Runs that did not finish", ""]
        lines += [f"- `{r.level}` seed {r.seed}: {r.status}: {r.error}" for r in crashed]
        lines.append("")
    return "\n".join(lines)


def write_outputs(out: Path, report: dict, rows: list[LevelSummary]) -> list[Path]:
    fields = ["level", "opt_level", "dtype", "seed", "status", "best_val_acc", "train_time_s",
              "skipped_steps", "wall_s", "run_id", "error"]
    payload = {k: v for k, v in report.items() if not k.startswith("_")}
    payload["summary"] = [asdict(r) for r in rows]
    payload["verdict"] = verdict(rows)
    return write_results(out, render_markdown(report, rows),
                         [asdict(r) for r in report["_results"]], fields, payload)


# ---- entry point --------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.tracking_uri is None:
        folder = Path(tempfile.mkdtemp(prefix="accuracy-parity-"))
        args.tracking_uri = f"sqlite:///{folder / 'mlflow.db'}"
    from runner.tracking import resolve_tracking_uri

    args.tracking_uri = resolve_tracking_uri(args.tracking_uri)
    prepare_store(args.tracking_uri, args.experiment)

    session = uuid.uuid4().hex[:12]
    total = len(args.levels) * len(args.seeds)
    print(f"Accuracy parity: {len(args.levels)} levels x {len(args.seeds)} seeds on "
          f"{args.device}, {args.epochs} epochs; MLflow store {args.tracking_uri}", flush=True)
    started = time.perf_counter()
    results: list[RunResult] = []
    for level in args.levels:
        for seed in args.seeds:
            print(f"[{len(results) + 1}/{total}] {level} seed {seed} ...", end=" ", flush=True)
            result = run_one(args, level, seed, session)
            results.append(result)
            acc = "-" if result.best_val_acc is None else f"{100 * result.best_val_acc:.2f}%"
            print(f"{result.status}: best val acc {acc}, skipped {result.skipped_steps}, "
                  f"{result.wall_s:.0f} s", flush=True)
    total_wall = time.perf_counter() - started

    rows = summarise(results, args.levels, args.seeds)
    composed = compose(task_overrides(args))
    report = {
        "benchmark": EXPERIMENT,
        "device": args.device,
        "levels": args.levels,
        "seeds": args.seeds,
        "epochs": args.epochs,
        "num_val": int(composed.data.get("num_val", 0) or 0),
        "target_points": TARGET_POINTS,
        "overrides": task_overrides(args),
        "command": command("accuracy.py", argv),
        "date": now(),
        "total_wall_s": total_wall,
        "tracking_uri": args.tracking_uri,
        "experiment": args.experiment,
        "machine": machine(args.device),
        "runs": [asdict(r) for r in results],
        "_results": results,
    }
    paths = write_outputs(args.out, report, rows)
    print()
    print(render_markdown(report, rows))
    print("Wrote " + ", ".join(str(p) for p in paths))
    crashed = [r for r in results if r.status == "crashed"]
    if crashed:
        print(f"{len(crashed)} run(s) crashed: "
              + "; ".join(f"{r.level} seed {r.seed}: {r.error}" for r in crashed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
