"""Start-up: the whole-process wall time of a tiny runner run against a hand-written loop doing
the same work (`benchmarks/hand_loop.py`), as a user types them, each in a fresh process.

    python -m benchmarks.overhead --startup          # the same as: python -m benchmarks.startup
    python -m benchmarks.startup --pairs 5 --cold 2

The task: `python -m runner model=tiny data=synthetic trainer.max_epochs=1
trainer.limit_train_batches=3 trainer.limit_val_batches=1 trainer.device=cpu` with the defaults
otherwise (batch 128, 2 DataLoader workers, the progress bar, an epoch checkpoint, MLflow in a
SQLite store), beside the hand-written loop with the same model, batch shape, workers, steps and a
checkpoint. Pairs alternate which side goes first; the figure is the median of each side and the
median of the per-pair differences (runner - hand). Before timing, one run of each side warms the
file cache, and the runner's run creates its MLflow store (a user's daily run logs into an
existing store) and the kernel cache is filled (`python -m runner.csrc build`).

Where the runner's time goes: each timed run's log timestamps split it into phases (start to the
first log line: interpreter, imports, config and plan; to "Kernels": tracking store, data, model,
engine; to "MLflow run": the run record; to "Finished": the training; to the process's exit), and
the import cost of each library the runner loads is timed alone (`python -c "import X"`, median of
3, less a bare interpreter's start).

The first run ever (`--cold`): the runner with an empty kernel cache (a new
AMP_RUNNER_KERNEL_CACHE), which starts the kernels' build in the background and trains on torch's
ops; its wall time against the warm runs' median (target: at most 10 s more). The background
builder is stopped after each cold run (its cache is thrown away).

Targets: runner - hand <= 1.5 s on a warm kernel cache; the first run <= 10 s over a
warm one. Exit 0 whatever the verdict; 1 if a run failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    REPO,
    load_average,
    provenance,
    results_path,
    setup_lines,
    show,
    write_results,
)

TARGET_GAP_S = 1.5
TARGET_COLD_S = 10.0
TRAIN_BATCHES, VAL_BATCHES = 3, 1
RUNNER_ARGS = [
    "model=tiny",
    "data=synthetic",
    "trainer.max_epochs=1",
    f"trainer.limit_train_batches={TRAIN_BATCHES}",
    f"trainer.limit_val_batches={VAL_BATCHES}",
    "trainer.device=cpu",
]
# what the runner imports that a hand-written loop does not, and torch (both), alone
IMPORTS = {
    "torch": "import torch",
    "torch.optim's first optimizer (torch._dynamo)": "import torch, torch._dynamo",
    "hydra + omegaconf": "import hydra, omegaconf",
    "mlflow (client, SQLite store)": (
        "import mlflow.tracking, mlflow.store.tracking.sqlalchemy_store"
    ),
}
PHASES = [
    ("start to the first log line (imports, config, plan)", "Precision ("),
    ("tracking store, data, model, engine", "Kernels:"),
    ("the MLflow run record", "MLflow run"),
    ("training (3 steps), validation, checkpoint", "Finished "),
    ("exit (workers, store, threads)", None),
]
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def timed(argv: Sequence[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, start as a Unix time, output) of one process; raises on failure."""
    start = time.time()
    began = time.perf_counter()
    proc = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - began
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{out[-3000:]}")
    return wall, start, out


def phases(out: str, start: float, wall: float) -> dict[str, float]:
    """Seconds per phase of one runner run, from its log lines' timestamps (local time, ms)."""
    stamps: dict[str, float] = {}
    for line in out.splitlines():
        match = _STAMP.match(line)
        if not match:
            continue
        moment = _dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for _, marker in PHASES:
            if marker is not None and marker in line and marker not in stamps:
                stamps[marker] = moment
    result, previous = {}, start
    for name, marker in PHASES:
        at = stamps.get(marker, previous) if marker is not None else start + wall
        result[name] = max(0.0, at - previous)
        previous = at
    return result


def import_costs(repeats: int) -> dict[str, float]:
    """Median seconds of `python -c "<import>"` less a bare `python -c pass`, per library."""

    def median_of(code: str) -> float:
        return statistics.median(
            timed([sys.executable, "-c", code], REPO, _env())[0] for _ in range(repeats)
        )

    bare = median_of("pass")
    return {label: median_of(code) - bare for label, code in IMPORTS.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--pairs", type=int, default=5, help="timed runner/hand pairs (default 5)")
    p.add_argument(
        "--cold",
        type=int,
        default=1,
        help="first runs ever, each on an empty kernel cache (default 1; 0: none)",
    )
    p.add_argument(
        "--import-repeats",
        type=int,
        default=3,
        help="times each library's import is timed alone (default 3; 0: not timed)",
    )
    p.add_argument("--out", type=Path, default=results_path("startup_cpu.md", "cpu"))
    args = p.parse_args(argv)
    if args.pairs < 1 or args.cold < 0 or args.import_repeats < 0:
        p.error("--pairs must be >= 1, --cold and --import-repeats >= 0")
    return args


def stop_builder(out: str) -> None:
    """End the background kernel build a cold run started (its pid is in the run's warning)."""
    match = re.search(r"a background process \(pid (\d+)", out)
    if match:
        try:
            os.killpg(int(match.group(1)), signal.SIGKILL)  # its own session: the compiler too
        except ProcessLookupError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    started, load_start = time.perf_counter(), load_average()
    build = subprocess.run(
        [sys.executable, "-m", "runner.csrc", "build", "--backend", "cpp"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        print(build.stdout + build.stderr, file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="amp-runner-startup-"))
    runner_cmd = [sys.executable, "-m", "runner", *RUNNER_ARGS]
    hand_cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "hand_loop.py"),
        "--train-batches",
        str(TRAIN_BATCHES),
        "--val-batches",
        str(VAL_BATCHES),
        "--out",
        str(work / "hand.pt"),
    ]
    sides = {"runner": runner_cmd, "hand": hand_cmd}
    try:
        for cmd in sides.values():  # warm-up: file cache, the MLflow store
            timed(cmd, work, _env())
        times: dict[str, list[float]] = {"runner": [], "hand": []}
        runner_phases: list[dict[str, float]] = []
        for index in range(args.pairs):
            order = ["runner", "hand"] if index % 2 == 0 else ["hand", "runner"]
            for side in order:
                wall, start, out = timed(sides[side], work, _env())
                times[side].append(wall)
                if side == "runner":
                    runner_phases.append(phases(out, start, wall))
            print(
                f"pair {index + 1}: runner {times['runner'][-1]:.2f} s, hand-written "
                f"{times['hand'][-1]:.2f} s",
                flush=True,
            )
        cold: list[dict] = []
        for index in range(args.cold):
            cache = work / f"empty-kernel-cache-{index}"
            wall, _, out = timed(runner_cmd, work, _env(AMP_RUNNER_KERNEL_CACHE=str(cache)))
            stop_builder(out)
            cold.append(
                {
                    "wall_s": wall,
                    "background_build": "a background process" in out,
                    "kernels_torch": "Kernels: torch" in out,
                }
            )
            print(f"first run {index + 1}: {wall:.2f} s", flush=True)
        imports = import_costs(args.import_repeats) if args.import_repeats else {}
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    finally:  # its store, checkpoints and the first runs' kernel caches
        shutil.rmtree(work, ignore_errors=True)
    runner_median = statistics.median(times["runner"])
    hand_median = statistics.median(times["hand"])
    gaps = [r - h for r, h in zip(times["runner"], times["hand"])]
    report = {
        "task": {
            "runner": " ".join(["python -m runner", *RUNNER_ARGS]),
            "hand": "python benchmarks/hand_loop.py --train-batches 3 --val-batches 1",
        },
        "pairs": args.pairs,
        "runner_s": times["runner"],
        "hand_s": times["hand"],
        "runner_median_s": runner_median,
        "hand_median_s": hand_median,
        "gap_median_s": statistics.median(gaps),
        "gaps_s": gaps,
        "gap_target_s": TARGET_GAP_S,
        "meets_gap": statistics.median(gaps) <= TARGET_GAP_S,
        "phases_median_s": {
            name: statistics.median(p[name] for p in runner_phases) for name, _ in PHASES
        },
        "imports_s": imports,
        "cold": cold,
        "cold_over_warm_s": [c["wall_s"] - runner_median for c in cold],
        "cold_target_s": TARGET_COLD_S,
        "meets_cold": all(c["wall_s"] - runner_median <= TARGET_COLD_S for c in cold),
        **provenance("startup", argv, "cpu", load_start, started),
    }
    rows = [
        {"side": side, "pair": i + 1, "wall_s": round(t, 3)}
        for side in ("runner", "hand")
        for i, t in enumerate(times[side])
    ]
    paths = write_results(args.out, render(report), rows, ["side", "pair", "wall_s"], report)
    show(render(report), paths)
    return 0


def render(report: dict) -> str:
    gap = report["gap_median_s"]
    lines = [
        "# Start-up (cpu)",
        "",
        "Whole-process wall time of a tiny run, the runner (`" + report["task"]["runner"] + "`, "
        "defaults otherwise: batch 128, 2 DataLoader workers, progress bar, epoch checkpoint, "
        "MLflow in an existing SQLite store, kernels in the cache) against a hand-written loop "
        "doing the same work (`" + report["task"]["hand"] + "`: the same model, batch shape, "
        f"workers and steps, and a checkpoint). {report['pairs']} pairs, the order alternating; "
        "medians.",
        "",
        "| side | median s | runs (s) |",
        "|---|---:|---|",
        f"| runner | {report['runner_median_s']:.2f} | "
        + ", ".join(f"{t:.2f}" for t in report["runner_s"])
        + " |",
        f"| hand-written loop | {report['hand_median_s']:.2f} | "
        + ", ".join(f"{t:.2f}" for t in report["hand_s"])
        + " |",
        f"| **runner - hand** (median of the pairs' differences) | **{gap:.2f}** | "
        + ", ".join(f"{t:.2f}" for t in report["gaps_s"])
        + " |",
        "",
        f"Target: runner - hand <= {report['gap_target_s']:g} s: "
        + (
            "**met**."
            if report["meets_gap"]
            else f"**missed** by {gap - report['gap_target_s']:.2f} s."
        ),
        "",
    ]
    if report["cold"]:
        over = ", ".join(f"{x:+.2f} s" for x in report["cold_over_warm_s"])
        walls = ", ".join(f"{c['wall_s']:.2f} s" for c in report["cold"])
        lines += [
            "## The first run ever",
            "",
            f"The runner on an empty kernel cache: {walls} ({over} against the warm median; "
            f"target <= {report['cold_target_s']:g} s: "
            + ("**met**" if report["meets_cold"] else "**missed**")
            + "). It starts the "
            "kernels' build in a background process at the lowest priority and steps with "
            "torch's ops this once"
            + (
                ""
                if all(c["background_build"] and c["kernels_torch"] for c in report["cold"])
                else " (NOT seen in every cold run: check the JSON)"
            )
            + ".",
            "",
        ]
    lines += [
        "## Where the runner's time goes",
        "",
        "Median seconds per phase of the timed runner runs (from its log timestamps):",
        "",
        "| phase | s |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {s:.2f} |" for name, s in report["phases_median_s"].items()]
    if report["imports_s"]:
        lines += [
            "",
            'Each import alone (`python -c "import ..."`, the median, less a bare '
            "interpreter's start); the hand-written loop pays torch's and the optimizer's "
            "(`torch.optim`'s first optimizer imports torch._dynamo), the runner pays all:",
            "",
            "| import | s |",
            "|---|---:|",
        ]
        lines += [f"| {name} | {s:.2f} |" for name, s in report["imports_s"].items()]
    lines += ["", "## Setup", "", *setup_lines(report), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
