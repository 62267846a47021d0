"""Same behaviour before and after a refactor: the same CLI commands run by two checkouts of the
runner, each into its own SQLite MLflow store, compared param by param, tag by tag and metric by
metric (deterministic metrics identical; timing and machine figures only present in both).

    python -m tools.behaviour --before /path/to/old/checkout --after . --out benchmarks/results/cpu

Each checkout runs as `python -m runner ...` with PYTHONPATH at that checkout, in a folder of its
own, so the two never share a store, a checkpoint folder or a cache. The commands: O0; the three
bf16 levels with range diagnostics; a language model; a layer plan; a run tuned by
`trainer.tune=on`; and a run resumed (`resume=auto` with `trainer.max_epochs` raised after its
first session ended). Tuning times its candidates, so two runs would choose by the machine's noise:
the tuned command runs once first with the `before` checkout (untimed, not compared) into a tuning
cache of its own, which both sides then read (a decision from the cache, the same on both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

# Seconds to a minute each on a 2-core CPU: tiny models, the defaults a user has (workers, progress
# bar, an epoch checkpoint).
COMMON = [
    "data.num_train=96",
    "data.num_val=32",
    "trainer.num_workers=2",
    "trainer.batch_size=16",
    "trainer.log_every_n_steps=2",
]
IMAGES = ["model=tiny", "data=synthetic", "data.image_size=16", *COMMON]
TEXT = [
    "model=gpt_tiny",
    "data=synthetic_text",
    "data.block_size=32",
    "trainer.num_workers=2",
    "trainer.batch_size=16",
    "trainer.log_every_n_steps=2",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
]
TWO = "trainer.max_epochs=2"
DIAGNOSED = "trainer.diagnose_every_n_steps=3"
# name -> the sessions of the command, each a `python -m runner` into the same folder and store
COMMANDS: dict[str, list[list[str]]] = {
    "o0": [[*IMAGES, TWO, "precision=o0"]],
    "o1_bf16": [[*IMAGES, TWO, "precision=o1_bf16", DIAGNOSED]],
    "o2_bf16": [[*IMAGES, TWO, "precision=o2_bf16", DIAGNOSED]],
    "o3_bf16": [[*IMAGES, TWO, "precision=o3_bf16", DIAGNOSED]],
    "language_model": [[*TEXT, TWO, "precision=o1_bf16"]],
    "layer_plan": [[*TEXT, TWO, "precision=o2_bf16", "+precision.layers.head=float32"]],
    "tuned": [[*IMAGES, TWO, "precision=o2_bf16", "trainer.tune=on", "trainer.tune_budget_s=20"]],
    "resumed": [
        [*IMAGES, "trainer.max_epochs=1", "precision=o2_bf16"],
        [*IMAGES, TWO, "precision=o2_bf16", "resume=auto"],
    ],
}
PRIMED = {"tuned"}  # run once first with the before checkout: both sides read its tuning cache

# Values that differ between any two runs (time, machine, folders, the code's own version).
TIMING_METRICS = (
    "epoch_time_s",
    "samples_per_s",
    "tokens_per_s",
    "train_time_s",
    "compile_time_s",
    "rss_growth_mb",
    "warmup_time_s",
    "step_time_ms_p50",
    "step_time_ms_p90",
    "data_wait_frac",
    "tflops",
    "mfu",
    "epoch_samples_per_s",
    "epoch_tokens_per_s",
    "tune_time_s",
    "device_busy_frac",
    "samples_per_s_p10",
    "samples_per_s_p90",
    "tokens_per_s_p10",
    "tokens_per_s_p90",
)
SUMMARY = "summary/"  # the headline copies of figures (timing ones among them): as their source
VARIABLE_TAGS = (
    "mlflow.",
    "git_commit",
    "runner_version",
    "host",
    "pid",
    "process_",
    "heartbeat",
    "started",
    "command",
    "liveness",
    "runner.log_",  # where the session's job log is (its path and first line: a time)
    "oom_kills",  # the machine's count of OOM-killed processes
)
VARIABLE_PARAMS = ("trainer.checkpoint_dir", "mlflow.tracking_uri")


def run(
    checkout: Path, name: str, sessions: list[list[str]], folder: Path, cache: Path
) -> tuple[int, float]:
    """The command's sessions run by `checkout`, one after another, in `folder` (the same store,
    checkpoint folder and run name), `cache` its tuning cache; the first failing session's exit
    status (0: all ran) and the seconds they took."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1", AMP_RUNNER_TUNE_CACHE=str(cache)
    )
    started = time.perf_counter()
    for index, args in enumerate(sessions):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "runner",
                *args,
                f"mlflow.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
                f"mlflow.run_name={name}",
                f"trainer.checkpoint_dir={folder / 'checkpoints'}",
            ],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        (folder / f"output{index}.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            return proc.returncode, time.perf_counter() - started
    return 0, time.perf_counter() - started


def read_store(db: Path) -> dict:
    """Params, tags, metric histories and artifact names of the store's only run, read with
    sqlite3 (the two checkouts may log through different code; the store is the contract)."""
    con = sqlite3.connect(db)
    (run_uuid, status, artifact_uri) = con.execute(
        "select run_uuid, status, artifact_uri from runs"
    ).fetchone()
    params = dict(con.execute("select key, value from params where run_uuid=?", (run_uuid,)))
    tags = dict(con.execute("select key, value from tags where run_uuid=?", (run_uuid,)))
    metrics: dict[str, list] = {}
    for key, step, value in con.execute(
        "select key, step, value from metrics where run_uuid=? order by key, step, timestamp",
        (run_uuid,),
    ):
        metrics.setdefault(key, []).append((step, value))
    con.close()
    root = Path(artifact_uri.removeprefix("file://"))
    if not root.is_absolute():
        root = db.parent / root
    artifacts = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return {
        "run_id": run_uuid,
        "status": status,
        "params": params,
        "tags": tags,
        "metrics": metrics,
        "artifacts": artifacts,
    }


def masked(value, run_id: str = ""):
    """A param's or tag's value with each side's own folder (`.../before/...`, `.../after/...`)
    and its run's id (in a resumed run's checkpoint path) written alike."""
    if not isinstance(value, str):
        return value
    value = value.replace("/before/", "/SIDE/").replace("/after/", "/SIDE/")
    return value.replace(run_id, "<run id>") if run_id else value


def compare(a: dict, b: dict) -> list[str]:
    """Every difference that is not time or machine noise."""
    out = []
    if a["status"] != b["status"]:
        out.append(f"status: {a['status']} vs {b['status']}")
    for what, skip in (("params", VARIABLE_PARAMS), ("tags", VARIABLE_TAGS)):
        keys = set(a[what]) | set(b[what])
        for key in sorted(keys):
            if any(word in key for word in skip):
                continue
            # (each side's folder masked: the stores, checkpoints and resumed paths differ)
            va, vb = (masked(side[what].get(key), side.get("run_id", "")) for side in (a, b))
            if va != vb:
                out.append(f"{what[:-1]} {key}: {va!r} vs {vb!r}")
    for key in sorted(set(a["metrics"]) | set(b["metrics"])):
        if key.startswith("system/"):
            continue
        ha, hb = a["metrics"].get(key), b["metrics"].get(key)
        if ha is None or hb is None:
            out.append(f"metric {key}: only in {'after' if ha is None else 'before'}")
        elif key.removeprefix(SUMMARY) in TIMING_METRICS:
            if [s for s, _ in ha] != [s for s, _ in hb]:
                out.append(f"metric {key}: steps {[s for s, _ in ha]} vs {[s for s, _ in hb]}")
        elif ha != hb:
            out.append(f"metric {key}: {ha[:4]}... vs {hb[:4]}...")
    if a["artifacts"] != b["artifacts"]:
        only_a = sorted(set(a["artifacts"]) - set(b["artifacts"]))
        only_b = sorted(set(b["artifacts"]) - set(a["artifacts"]))
        out.append(f"artifacts only before: {only_a}; only after: {only_b}")
    return out


def commit(checkout: Path) -> str:
    """The checkout's commit (or its folder where it is no git checkout)."""
    found = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return found.stdout.strip() or str(checkout)


def markdown(commits: dict, report: dict, machine: dict, date: str) -> str:
    lines = [
        "# Same behaviour: the same commands on two commits",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; torch {machine['torch']}, "
        f"Python {machine['python']}, {machine['platform']}. Date: {date}.",
        "",
        f"Before: `{commits['before']}`; after: `{commits['after']}`. Each command ran as "
        "`python -m runner ...` with each checkout's code, into its own SQLite store (a resumed "
        "command: its sessions one after the other, into the same store and checkpoint folder; "
        "a tuned one: from a tuning cache its first run with the before checkout filled, the "
        "same for both sides); compared: status, every param, every tag (not time, process, host "
        "or commit tags; each side's folder masked in the values), every metric history (timing "
        "metrics by their steps only, `system/*` not at all), and the artifact list. Command: "
        "`python -m tools.behaviour --before OLD --after NEW --out benchmarks/results/cpu`.",
        "",
        "| command | params | tags | metric points | artifacts | differences |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, row in report.items():
        diffs = "; ".join(row["differences"]) or "none"
        said = " then ".join(f"`{' '.join(session)}`" for session in row["command"])
        lines.append(
            f"| {name}: {said} | {row.get('params', '-')} | {row.get('tags', '-')} | "
            f"{row.get('metric_points', '-')} | {row.get('artifacts', '-')} | {diffs} |"
        )
    return "\n".join(lines) + "\n"


def compare_command(name: str, sessions: list[list[str]], before: Path, after: Path, work: Path):
    """The command run by both checkouts (a primed one after its first run, whose tuning cache
    each side starts from) and their stores compared: its row of the report."""
    primed = work / "primed" / name / "tune-cache"
    if name in PRIMED:
        code, seconds = run(before, name, sessions, work / "primed" / name, primed)
        print(f"{name} primed: exit {code} in {seconds:.0f} s", flush=True)
    stores = {}
    for side, checkout in (("before", before), ("after", after)):
        folder = work / side / name
        cache = folder / "tune-cache"
        if primed.is_dir():
            shutil.copytree(primed, cache)
        code, seconds = run(checkout, name, sessions, folder, cache)
        print(f"{name} {side}: exit {code} in {seconds:.0f} s", flush=True)
        stores[side] = read_store(folder / "mlflow.db") if code == 0 else None
    if stores["before"] is None or stores["after"] is None:
        return {"command": sessions, "differences": ["a side failed: see " + str(work)]}
    kept = stores["after"]
    return {
        "command": sessions,
        "differences": compare(stores["before"], kept),
        "params": len(kept["params"]),
        "tags": len(kept["tags"]),
        "metric_points": sum(len(v) for v in kept["metrics"].values()),
        "artifacts": len(kept["artifacts"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.behaviour", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--before", type=Path, required=True, help="the old checkout")
    parser.add_argument("--after", type=Path, required=True, help="the new checkout")
    parser.add_argument("--out", type=Path, default=None, help="folder for behaviour_cpu.md/.json")
    parser.add_argument(
        "--only", nargs="*", default=None, choices=list(COMMANDS), help="command names to run"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="behaviour-"))
    report = {}
    for name, sessions in COMMANDS.items():
        if args.only and name not in args.only:
            continue
        report[name] = compare_command(
            name, sessions, args.before.resolve(), args.after.resolve(), work
        )
        diffs = report[name]["differences"]
        print(f"{name}: {len(diffs)} differences", *diffs, sep="\n  ", flush=True)
    if args.out:
        commits = {
            side: commit(path) for side, path in (("before", args.before), ("after", args.after))
        }
        args.out.mkdir(parents=True, exist_ok=True)
        host, date = common.machine("cpu"), common.now()
        (args.out / "behaviour_cpu.json").write_text(
            json.dumps(
                {"commits": commits, "machine": host, "date": date, "runs": report}, indent=2
            )
        )
        (args.out / "behaviour_cpu.md").write_text(markdown(commits, report, host, date))
    failed = any(d.startswith("a side failed") for r in report.values() for d in r["differences"])
    if not failed:  # (a failed side's logs and store are kept to read, the folder named)
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not r["differences"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
