"""The runner's logged steady throughput against levels.py's timed steps: does the figure a user
reads in MLflow compare levels as a careful hand measurement does?

For each level, the runner's command as a user types it (`python -m runner precision=<level>
model=<model> data=synthetic ...`, one epoch of `--steps` steps, tracking=none) in a process of
its own, its logged `samples_per_s` (steady: the steps after the warm-up) and
`epoch_samples_per_s` (the epoch's own, warm-up included) read back from its record; then
`levels.py` for the same model, batch and image size (the runner's own step, timed after untimed
warm-up steps, on one batch kept in memory). The verdict: the ratio of the last level's logged
`samples_per_s` to the first's is within 10% of levels.py's ratio for the same two levels.

    python -m benchmarks.steady --device cuda        # densenet161, 224 px, batch 64, O0 and O2
    python -m benchmarks.steady --device cpu --model tiny --image-size 16 --batch-size 16 \\
        --steps 12 --levels o0,o1_bf16               # the same check at a CPU's size

levels.py runs with the runner's defaults (channels-last off; on CUDA TF32 on, as torch allows
it for convolutions by default). Exit 0 whatever the verdict; 1 if a run failed; 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    REPO,
    add_device_option,
    add_out_option,
    check_at_least_one,
    check_presets,
    csv_list,
    fill_defaults,
    load_average,
    provenance,
    resolve_device,
    results_path,
    setup_lines,
    show,
    write_results,
)

TOLERANCE = 0.10  # the logged ratio within 10% of levels.py's
DEFAULTS = {
    "cuda": dict(
        model="densenet161", image_size=224, batch_size=64, steps=60, levels=["o0", "o2"], workers=8
    ),
    "cpu": dict(
        model="tiny", image_size=16, batch_size=16, steps=12, levels=["o0", "o1_bf16"], workers=0
    ),
}
FIELDS = [
    "level",
    "status",
    "samples_per_s",
    "epoch_samples_per_s",
    "warmup_time_s",
    "mfu",
    "levels_samples_per_s",
    "kernels",
    "error",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.steady",
        description="The runner's logged steady samples_per_s per level against levels.py's "
        "timed steps: the ratio between two levels, both ways; Markdown, CSV and JSON.",
    )
    add_device_option(p)
    p.add_argument("--model", default=None, help="model option (default densenet161; CPU tiny)")
    p.add_argument("--image-size", type=int, default=None, help="(default 224; CPU 16)")
    p.add_argument("--batch-size", type=int, default=None, help="(default 64; CPU 16)")
    p.add_argument("--steps", type=int, default=None, help="the runs' steps (default 60; CPU 12)")
    p.add_argument(
        "--levels",
        type=csv_list,
        default=None,
        help="two presets, the baseline first (default o0,o2; CPU o0,o1_bf16)",
    )
    p.add_argument("--workers", type=int, default=None, help="trainer.num_workers (8; CPU 0)")
    add_out_option(p, "steady")
    p.add_argument("--work", type=Path, default=None, help="the runs' folder (default: a temp)")
    args = p.parse_args(argv)
    args.device = resolve_device(p, args.device)
    fill_defaults(args, DEFAULTS[args.device])
    check_at_least_one(p, args, ("image_size", "batch_size", "steps"))
    if len(args.levels) != 2:
        p.error("--levels: two presets, the baseline first")
    check_presets(p, args.levels)
    args.out = args.out or results_path(f"steady_{args.device}.md", args.device)
    return args


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def runner_command(args: argparse.Namespace, level: str, folder: Path) -> list[str]:
    """The mission's command at `level`, as a user types it, recorded without a store."""
    return [
        sys.executable,
        "-m",
        "runner",
        f"precision={level}",
        f"model={args.model}",
        "data=synthetic",
        f"data.image_size={args.image_size}",
        f"trainer.device={args.device}",
        f"trainer.batch_size={args.batch_size}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={args.steps}",
        "trainer.limit_val_batches=5",
        f"trainer.num_workers={args.workers}",
        "trainer.progress_bar=false",
        "trainer.checkpoint_every_n_epochs=0",
        f"trainer.checkpoint_dir={folder / 'checkpoints'}",
        "tracking=none",
        f"hydra.run.dir={folder}",
    ]


def last(record: dict, metric: str) -> float | None:
    points = record["metrics"].get(metric)
    return points[-1][1] if points else None


def run_level(args: argparse.Namespace, level: str, work: Path) -> dict:
    folder = work / level
    started = time.perf_counter()
    done = subprocess.run(
        runner_command(args, level, folder),
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
    )
    row = {"level": level, "status": "ok", "error": None, "wall_s": time.perf_counter() - started}
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return {**row, "status": "failed", "error": " / ".join(tail)}
    record = json.loads((folder / "tracking.json").read_text())
    for metric in ("samples_per_s", "epoch_samples_per_s", "warmup_time_s", "mfu", "tflops"):
        row[metric] = last(record, metric)
    row["kernels"] = record["params"].get("precision.kernels")
    row["flops_per_sample"] = record["params"].get("model.flops_per_sample")
    if row["samples_per_s"] is None:
        row["status"], row["error"] = "failed", "no steady samples_per_s logged"
    return row


def run_levels_py(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """levels.py's samples/s per level for the same model, batch and image size."""
    out = work / "levels" / f"levels_{args.device}.md"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "levels.py"),
        "--device",
        args.device,
        "--models",
        args.model,
        "--levels",
        ",".join(args.levels),
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
        "--channels-last",
        "off",
        "--out",
        str(out),
    ]
    if args.device == "cuda":
        cmd.append("--tf32")  # torch's default for convolutions, as the runner's runs have it
    else:
        cmd += ["--steps", "5", "--warmup", "3"]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if done.returncode != 0 or not out.with_suffix(".json").is_file():
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise RuntimeError("levels.py failed: " + " / ".join(tail))
    cells = json.loads(out.with_suffix(".json").read_text())["cells"]
    return {c["level"]: c["samples_per_s"] for c in cells if c.get("status") == "ok"}


def _ratio(a: dict, b: dict, key: str) -> float | None:
    try:
        return b[key] / a[key]
    except (TypeError, ZeroDivisionError, KeyError):
        return None


def verdict(rows: list[dict], levels: Sequence[str]) -> dict:
    base, other = (next(r for r in rows if r["level"] == lv) for lv in levels)
    out = {"levels": list(levels), "tolerance": TOLERANCE}
    for name, key in (
        ("logged_ratio", "samples_per_s"),
        ("epoch_ratio", "epoch_samples_per_s"),
        ("levels_ratio", "levels_samples_per_s"),
    ):
        out[name] = _ratio(base, other, key)
    if out["logged_ratio"] is None or out["epoch_ratio"] is None:
        return {**out, "pass": False, "why": "a run has no figure"}
    if out["levels_ratio"] is None:
        why = (
            "levels.py has no figures (it failed, or has not finished); "
            f"{levels[1]} / {levels[0]}: logged steady {out['logged_ratio']:.2f}x, "
            f"the epoch's own {out['epoch_ratio']:.2f}x"
        )
        return {**out, "pass": False, "why": why}
    out["off_by"] = out["logged_ratio"] / out["levels_ratio"] - 1
    out["pass"] = abs(out["off_by"]) <= TOLERANCE
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(report: dict) -> str:
    v, (a, b) = report["verdict"], report["verdict"]["levels"]
    lines = [
        f"# Logged steady throughput against levels.py ({report['device']})",
        "",
        *setup_lines(report),
        "",
        f"{report['model']}, {report['image_size']} px, batch {report['batch_size']}, one epoch "
        f"of {report['steps']} steps, trainer.num_workers={report['workers']}.",
        "",
        "| level | runner: samples_per_s (steady) | runner: epoch_samples_per_s | warm-up (s) "
        "| mfu | levels.py samples/s | kernels |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['level']} | {_fmt(r.get('samples_per_s'), '.1f')} | "
            f"{_fmt(r.get('epoch_samples_per_s'), '.1f')} | {_fmt(r.get('warmup_time_s'), '.1f')}"
            f" | {_fmt(r.get('mfu'), '.1%')} | {_fmt(r.get('levels_samples_per_s'), '.1f')} | "
            f"{r.get('kernels') or '-'} |"
        )
    lines.append("")
    if "off_by" in v:
        lines += [
            f"{b} / {a}: logged steady **{v['logged_ratio']:.2f}x**, levels.py "
            f"**{v['levels_ratio']:.2f}x** ({v['off_by']:+.1%}; target within "
            f"{v['tolerance']:.0%}): **{'PASS' if v['pass'] else 'MISS'}**. The epoch's own "
            f"figures (warm-up included) give {v['epoch_ratio']:.2f}x.",
            "",
        ]
    else:
        lines += [f"No verdict: {v['why']}.", ""]
    failed = [r for r in report["rows"] if r["status"] != "ok"]
    lines += [f"- `{r['level']}`: {r['error']}" for r in failed]
    return "\n".join(lines) + ("\n" if failed else "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    load_start, started = load_average(), time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="steady-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"Steady throughput on {args.device}: {args.model} {args.image_size}px batch "
        f"{args.batch_size}, {args.steps} steps, levels {', '.join(args.levels)}",
        flush=True,
    )
    rows = []
    for level in args.levels:
        rows.append(run_level(args, level, work))
        print(f"  {level}: {rows[-1]}", flush=True)

    def report(measured: dict) -> dict:
        for row in rows:
            row["levels_samples_per_s"] = measured.get(row["level"])
        return {
            "benchmark": "steady",
            "device": args.device,
            "model": args.model,
            "image_size": args.image_size,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "workers": args.workers,
            "rows": rows,
            "verdict": verdict(rows, args.levels),
            **provenance("steady", argv, args.device, load_start, started),
        }

    # the runs' figures first, so that a piece stopped inside levels.py (a GPU lease's time
    # limit: DenseNet-161's cells take a minute each) keeps them; then again with levels.py's
    first = report({})
    write_results(args.out, render(first), rows, FIELDS, first)
    print(f"Wrote the runs' figures to {args.out}; now levels.py", flush=True)
    try:
        measured = run_levels_py(args, work)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        measured = {}
    final = report(measured)
    text = render(final)
    paths = write_results(args.out, text, rows, FIELDS, final)
    show(text, paths)
    return 0 if all(r["status"] == "ok" for r in rows) and measured else 1


if __name__ == "__main__":
    sys.exit(main())
