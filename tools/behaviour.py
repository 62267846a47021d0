"""Same behaviour before and after a refactor: the same CLI commands run by two checkouts of the
runner, each into its own SQLite MLflow store, compared param by param, tag by tag and metric by
metric (deterministic metrics identical; timing and machine figures only present in both).

    python -m tools.behaviour --before /path/to/old/checkout --after . --out benchmarks/results/cpu

Each checkout runs as `python -m runner ...` with PYTHONPATH at that checkout, in a folder of its
own, so the two never share a store, a checkpoint folder or a cache.
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

# Seconds to minutes on a 2-core CPU: tiny models, the defaults a user has (workers, progress bar).
COMMON = [
    "data.num_train=96",
    "data.num_val=32",
    "trainer.max_epochs=2",
    "trainer.num_workers=2",
    "trainer.batch_size=16",
    "trainer.log_every_n_steps=2",
]
IMAGES = ["model=tiny", "data=synthetic", "data.image_size=16"]
TEXT = [
    "model=gpt_tiny",
    "data=synthetic_text",
    "data.block_size=32",
    "trainer.max_epochs=2",
    "trainer.num_workers=2",
    "trainer.batch_size=16",
    "trainer.log_every_n_steps=2",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
]
COMMANDS = {
    "o0": [*IMAGES, *COMMON, "precision=o0"],
    "o1_bf16": [*IMAGES, *COMMON, "precision=o1_bf16"],
    "o2_bf16": [*IMAGES, *COMMON, "precision=o2_bf16", "trainer.diagnose_every_n_steps=3"],
    "o3_bf16": [*IMAGES, *COMMON, "precision=o3_bf16"],
    "language_model": [*TEXT, "precision=o1_bf16"],
    "layer_plan": [*TEXT, "precision=o2_bf16", "+precision.layers.head=float32"],
}

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
)
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


def run(checkout: Path, name: str, args: list[str], folder: Path) -> tuple[int, float, str]:
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            *args,
            f"mlflow.tracking_uri={uri}",
            f"mlflow.run_name={name}",
            f"trainer.checkpoint_dir={folder / 'checkpoints'}",
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (folder / "output.txt").write_text(proc.stdout + proc.stderr)
    return proc.returncode, time.perf_counter() - started, uri


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
        "status": status,
        "params": params,
        "tags": tags,
        "metrics": metrics,
        "artifacts": artifacts,
    }


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
            va, vb = (side[what].get(key) for side in (a, b))
            if key == "overrides" and va and vb:  # the store's and checkpoints' folders differ
                va, vb = (
                    v.replace("/before/", "/SIDE/").replace("/after/", "/SIDE/") for v in (va, vb)
                )
            if va != vb:
                out.append(f"{what[:-1]} {key}: {va!r} vs {vb!r}")
    for key in sorted(set(a["metrics"]) | set(b["metrics"])):
        if key.startswith("system/"):
            continue
        ha, hb = a["metrics"].get(key), b["metrics"].get(key)
        if ha is None or hb is None:
            out.append(f"metric {key}: only in {'after' if ha is None else 'before'}")
        elif key in TIMING_METRICS:
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


def markdown(commits: dict, report: dict) -> str:
    lines = [
        "# Same behaviour: the same commands on two commits",
        "",
        f"Before: `{commits['before']}`; after: `{commits['after']}`. Each command ran as "
        "`python -m runner ...` with each checkout's code, into its own SQLite store; compared: "
        "status, every param, every tag (not time, process, host or commit tags; the overrides "
        "tag with each side's folder masked), every metric history (timing metrics by their steps "
        "only, `system/*` not at all), and the artifact list. Command: "
        "`python -m tools.behaviour --before OLD --after NEW --out benchmarks/results/cpu`.",
        "",
        "| command | params | tags | metric points | artifacts | differences |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, row in report.items():
        diffs = "; ".join(row["differences"]) or "none"
        lines.append(
            f"| {name}: `{' '.join(row['command'])}` | {row.get('params', '-')} | "
            f"{row.get('tags', '-')} | {row.get('metric_points', '-')} | "
            f"{row.get('artifacts', '-')} | {diffs} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="folder for behaviour.md/.json")
    parser.add_argument("--only", nargs="*", default=None, help="command names to run")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="behaviour-"))
    report = {}
    for name, command in COMMANDS.items():
        if args.only and name not in args.only:
            continue
        stores = {}
        for side, checkout in (("before", args.before), ("after", args.after)):
            code, seconds, _ = run(checkout.resolve(), name, command, work / side / name)
            print(f"{name} {side}: exit {code} in {seconds:.0f} s", flush=True)
            stores[side] = read_store(work / side / name / "mlflow.db") if code == 0 else None
        if stores["before"] is None or stores["after"] is None:
            diffs = ["a side failed: see " + str(work)]
        else:
            diffs = compare(stores["before"], stores["after"])
        counts = (
            {
                "params": len(stores["after"]["params"]),
                "tags": len(stores["after"]["tags"]),
                "metric_points": sum(len(v) for v in stores["after"]["metrics"].values()),
                "artifacts": len(stores["after"]["artifacts"]),
            }
            if stores["after"]
            else {}
        )
        report[name] = {"command": command, "differences": diffs, **counts}
        print(f"{name}: {len(diffs)} differences", *diffs, sep="\n  ", flush=True)
    if args.out:
        commits = {
            side: commit(path) for side, path in (("before", args.before), ("after", args.after))
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "behaviour_cpu.json").write_text(
            json.dumps({"commits": commits, "runs": report}, indent=2)
        )
        (args.out / "behaviour_cpu.md").write_text(markdown(commits, report))
    failed = any(d.startswith("a side failed") for r in report.values() for d in r["differences"])
    if not failed:  # (a failed side's logs and store are kept to read, the folder named)
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not r["differences"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
