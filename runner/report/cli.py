"""`python -m runner.report`'s command line: the comparison of a sweep's runs written and logged
on its parent run, or `--diff` of two runs (see runner.report)."""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import runner
from runner import files, shell
from runner import metrics as m
from runner.report.analysis import EXPERIMENT, TARGET_GAP, add_baseline_ratios
from runner.report.plots import plot_bars, plot_curves, plot_memory
from runner.report.runs import NothingToReport, find_run, select_runs, to_row
from runner.report.tables import (
    ARTIFACT_DIR,
    MEMORY_PNG,
    TABLE_CSV,
    TABLE_MD,
    figure_files,
    render_markdown,
    write_csv,
)
from runner.tracking.base import Reader, RunRecord, StoreUnreadable
from runner.tracking.trackers import open_reader
from runner.tracking.varying import params_of


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runner.report",
        description="Compare the runs of a sweep (precision levels, models, batch sizes) from "
        "MLflow: a Markdown and CSV table and PNG figures, also logged on the sweep's parent run.",
        epilog="The report reads an MLflow store, or the records of a sweep run with "
        "tracking=none (a JSON file in its folder and in each job's): --sweep <its folder>.",
    )
    parser.add_argument("--version", action="version", version=runner.version_line())
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
        metavar="RUN",
        help="the sweep's parent run: its id (printed at the end of the sweep), the start of "
        "one, or its name",
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
        help="print the params that differ between two runs and their status and objective; "
        "writes nothing. A run by id, the start of one (8 characters), or name (tiny-O2: the "
        "newest run of that name in --experiment)",
    )
    parser.add_argument(
        "--out",
        type=files.user_path,
        default=Path("report"),
        help="folder for the table and figures (default: ./report)",
    )
    parser.add_argument(
        "--target-gap",
        type=float,
        default=TARGET_GAP,
        metavar="GAP",
        help="how close to its O0 run's best validation a run counts as reaching it, for the "
        "time-to columns: accuracy points below (0.01: one point), a language model's nats "
        f"above (default: {TARGET_GAP})",
    )
    args = parser.parse_args(argv)
    if not (args.target_gap >= 0 and math.isfinite(args.target_gap)):
        parser.error(f"--target-gap: {args.target_gap} (allowed: a number >= 0, e.g. 0.01)")
    from runner.config.values import BARE_DATABASE_PATH, bare_database_path, bare_database_refusal

    if bare_database_path(args.tracking_uri):
        refusal = bare_database_refusal(args.tracking_uri)
        parser.error(f"--tracking-uri: {refusal} (allowed: {BARE_DATABASE_PATH})")
    return args


def _run(reader: Reader, experiment_name: str, key: str) -> RunRecord:
    """The run `key` names (runner.report.runs.find_run), its warning, if any, on stderr."""
    run, warning = find_run(reader, experiment_name, key)
    if warning:
        print(warning, file=sys.stderr)
    return run


def diff_runs(reader: Reader, experiment_name: str, run_a: str, run_b: str) -> str:
    """The params whose values differ between two runs (a param one of them lacks shows `-`),
    then each run's status and objective, as a Markdown table. Each run by id, the start of one
    or name (in `experiment_name`: runner.report.runs.find_run)."""
    runs = [_run(reader, experiment_name, key) for key in (run_a, run_b)]
    a, b = (params_of(r) for r in runs)  # (the machine each trained on among them)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    head = [
        f"| param | {runs[0].run_name} ({runs[0].run_id[:8]}) | "
        f"{runs[1].run_name} ({runs[1].run_id[:8]}) |",
        "|---|---|---|",
    ]
    body = [f"| {k} | {a.get(k, '-')} | {b.get(k, '-')} |" for k in keys]
    tail = [f"| status | {runs[0].status} | {runs[1].status} |"]
    for metric in (m.BEST_VAL_ACC, m.BEST_VAL_LOSS):
        values = [r.metrics.get(metric) for r in runs]
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
    from runner.tracking.json_file import is_record_folder
    from runner.tracking.store import resolve_tracking_uri, sqlite_path

    uri = resolve_tracking_uri(args.tracking_uri)
    try:
        if args.sweep and is_record_folder(args.sweep):  # tracking=none: its records
            reader, parent, runs = records_of(Path(args.sweep))
            uri, args.experiment = reader.location, parent.experiment_id
        else:
            database = sqlite_path(uri)
            if database is not None and not database.is_file():
                raise NothingToReport(
                    f"no MLflow store at {uri} (opening it would create an empty "
                    "one); set --tracking-uri to the runs' mlflow.tracking_uri"
                )
            reader = open_reader(uri)
            if args.diff:
                shell.say(diff_runs(reader, args.experiment, *args.diff))
                return 0
            parent = _run(reader, args.experiment, args.parent) if args.parent else None
            parent, runs = select_runs(reader, args.experiment, parent, args.sweep)
    except NothingToReport as reason:
        print(f"Nothing to report: {reason}", file=sys.stderr)
        return 1
    except StoreUnreadable as error:  # a server that is away, a store that cannot be read
        fix = (
            " Start the server, or set --tracking-uri to the runs' mlflow.tracking_uri."
            if sqlite_path(uri) is None
            else ""
        )
        print(f"Cannot read the runs from {error}{fix}", file=sys.stderr)
        return 1
    return _write(args, reader, uri, parent, runs)


def records_of(folder: Path) -> tuple[Reader, RunRecord, list[RunRecord]]:
    """The reader of a tracking=none sweep's records under `folder` (the sweep's folder, its
    parent's record in it), its parent and its jobs' runs; NothingToReport for the folder of a
    single run."""
    from runner.tracking import tags as tag
    from runner.tracking.json_file import FILE, JsonReader, as_run_record, read_record

    record = read_record(folder / FILE)
    if record is None:
        raise NothingToReport(f"{folder / FILE} is not a run's record")
    parent = as_run_record(record)
    if tag.SWEEP_DIR not in parent.tags:
        raise NothingToReport(
            f"{folder} holds the record of one run ({parent.run_name!r}), not a sweep's: there "
            "is nothing to compare it with; --sweep takes a sweep's folder (multirun/<date>/"
            "<time>)"
        )
    reader = JsonReader(folder)
    reader.location = f"the records (tracking=none) under {folder.resolve()}"
    return (reader, *select_runs(reader, parent.experiment_id, parent, None))


def _write(
    args: argparse.Namespace,
    reader: Reader,
    uri: str,
    parent: RunRecord | None,
    runs: list[RunRecord],
) -> int:
    """The table and figures of `runs` into `args.out`, printed, and logged on `parent`."""
    rows = [to_row(reader, run) for run in runs]
    add_baseline_ratios(rows, args.target_gap)

    title = (
        f"Precision comparison: {parent.run_name}"
        if parent
        else f"Precision comparison: experiment {args.experiment}"
    )
    source = (
        f"{len(rows)} runs from `{uri}`, experiment `{args.experiment}`"
        + (f", parent run `{parent.run_id}`" if parent else "")
        + f"; written {_dt.datetime.now().isoformat(timespec='seconds')}."
    )
    markdown = render_markdown(rows, title, source, args.target_gap)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / TABLE_MD).write_text(markdown)
    except OSError as error:  # (a folder that cannot be made, a file of that name, no rights)
        print(
            f"Cannot write the report to {args.out}: {error.strerror or error}; set --out to a "
            "folder you can write",
            file=sys.stderr,
        )
        return 2
    write_csv(rows, args.out / TABLE_CSV)
    bars, curves = figure_files(rows)
    plot_bars(rows, args.out / bars)
    plot_curves(rows, args.out / curves)
    plot_memory(rows, args.out / MEMORY_PNG)

    shell.say(markdown)
    written = (TABLE_MD, TABLE_CSV, bars, MEMORY_PNG, curves)
    shell.say(f"Wrote {', '.join(str(args.out / n) for n in written)}")
    if parent is not None:
        reader.log_artifacts(parent.run_id, args.out, ARTIFACT_DIR)
        shell.say(
            f"Logged them on the sweep's parent run {parent.run_id} "
            f"(artifacts/{ARTIFACT_DIR}). " + reader.hint(parent.experiment_id)
        )
    else:
        shell.say("No sweep parent run: the files were not logged to MLflow.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
