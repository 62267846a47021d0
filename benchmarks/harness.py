"""The levels x seeds harness of the training-run benchmarks (accuracy.py, rounding.py,
lm_parity.py): every (level, seed) is a real run of the runner (`runner.run.app.run` on the
project's config tree, composed with Hydra's compose API), logged to an MLflow store of the
benchmark's own (a new SQLite store in a temporary folder unless `--tracking-uri`, never the
user's ./mlflow.db), and what a benchmark reports of it is read back from that store. A run stopped
by the runner's divergence guard is an outcome ("diverged"); any other exception is a crash,
listed under the table, and the exit status is 1. The results are written after every run, so a
command stopped at a time limit keeps the runs it finished.

A benchmark brings its task (Hydra overrides), its run's record (a `Run` subclass naming the
objective: what `app.run` returns), what it reads back from the store, its summary per level and
its table; the harness brings the options, the runs, the loop, the per-seed statistics and the
setup lines. The optimizer-state rows (`<preset>+<format>state`), which accuracy.py and
lm_parity.py check against the same level with its own state, are judged here too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from benchmarks.common import (
    add_extra_option,
    add_out_option,
    command,
    compose,
    csv_list,
    describe_level,
    int_list,
    machine,
    now,
    parse_level,
    prepare_store,
    show,
    store_uri,
)

log = logging.getLogger("benchmarks.harness")


# ---- options ------------------------------------------------------------------------------------
def add_options(
    parser,
    experiment: str,
    name: str,
    levels_help: str,
    fixed: str,
    beside: str = ".csv and .json",
    extra_help: str = "more Hydra overrides, applied after the benchmark's own",
) -> None:
    """The options of every levels x seeds benchmark: `--levels`, `--seeds` (`trainer.seed`;
    `fixed`, e.g. the dataset, stays the same), where the results go (`--out`), the MLflow store
    and experiment, more overrides, and the runner's log."""
    parser.add_argument("--levels", type=csv_list, default=None, help=levels_help)
    parser.add_argument(
        "--seeds",
        type=csv_list,
        default=None,
        help=f"comma-separated trainer.seed values (default 0,1,2); {fixed} stays fixed",
    )
    add_out_option(parser, name, beside)
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow store (default: sqlite:///<a new temporary folder>/mlflow.db)",
    )
    parser.add_argument(
        "--experiment", default=experiment, help=f"MLflow experiment name (default {experiment})"
    )
    add_extra_option(parser, extra_help)
    parser.add_argument("--verbose", "-v", action="store_true", help="show the runner's log")


def parse_seeds(parser, seeds: Optional[Sequence[str]], default: Sequence[int]) -> list[int]:
    """`--seeds` (its parts, or None) as integers, `default` where none were given; the parser's
    error where one is not an integer or none are left."""
    seeds = int_list(parser, "seeds", seeds or default)
    if not seeds:
        parser.error("--seeds is empty")
    return seeds


def parse_levels(
    parser, levels: Sequence[str], baseline: Optional[str] = None, compiled: bool = True
) -> list[str]:
    """`--levels` (or the benchmark's default) as `common.parse_level` names them, unique and in
    order, `baseline` first where it is missing; the parser's error, naming what is allowed, for
    a level that is no preset (or has a suffix not allowed: `+compile` only where `compiled`)."""
    from runner.run.plan import preset_options

    known = preset_options()
    names = []
    for level in levels:
        try:
            spec = parse_level(level, known)
        except ValueError as error:
            parser.error(str(error))
        if spec.compile and not compiled:
            parser.error(f"{level}: this benchmark has no compiled rows (+compile)")
        names.append(spec.name)
    if baseline is not None and baseline not in names:
        names.insert(0, baseline)
    return list(dict.fromkeys(names))


def open_store(args, prefix: str) -> None:
    """The runner's log as `-v` says, the benchmark's MLflow store and experiment (created
    before the runs, as the runner's own tracker does), and this invocation's session (the tag
    its runs are read back by)."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    args.tracking_uri = store_uri(args.tracking_uri, prefix)
    prepare_store(args.tracking_uri, args.experiment)
    args.session = uuid.uuid4().hex[:12]


# ---- one run ------------------------------------------------------------------------------------
@dataclass
class Run:
    """One (level, seed) run as every levels x seeds benchmark records it; a benchmark's own
    figures are the fields of its subclass, whose OBJECTIVE names the field that takes what
    `app.run` returns and what it is."""

    OBJECTIVE: ClassVar[tuple[str, str]] = ("objective", "objective")

    level: str
    seed: int
    opt_level: str = ""
    dtype: str = ""
    fp8: str | None = None  # precision.fp8_linear (tensorwise | rowwise) where the level has fp8
    status: str = "finished"  # finished | diverged | crashed
    wall_s: float | None = None
    run_id: str | None = None
    error: str | None = None


@dataclass
class StoredRun:
    """What a benchmark reads back from the MLflow store about one of its runs."""

    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the latest value of each
    params: dict[str, str] = field(default_factory=dict)
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # (step, value)


def read_run(
    tracking_uri: str, experiment: str, key: str, histories: Sequence[str] = ()
) -> StoredRun:
    """The run tagged `benchmark_key=<key>`: its latest metric values, its params, and the whole
    history of each metric named in `histories`, by step. An empty StoredRun when there is none.
    Read through the runner's tracking seam (runner.tracking.trackers.open_reader)."""
    from runner.tracking.trackers import open_reader

    reader = open_reader(tracking_uri)
    experiment_id = reader.experiment_id(experiment)
    if experiment_id is None:
        return StoredRun()
    runs = reader.runs([experiment_id], tags={"benchmark_key": key})
    if not runs:
        return StoredRun()
    run = runs[0]
    stored = StoredRun(run.run_id, dict(run.metrics), dict(run.params))
    for name in histories:
        stored.histories[name] = [(int(s), float(v)) for s, v in reader.history(run.run_id, name)]
    return stored


def run_overrides(task: Sequence[str], result: Run, args, run_name: str, key: str) -> list[str]:
    """One run's Hydra overrides: its task, its level (`common.parse_level`: the preset, its
    optimizer state, compile), its seed, the benchmark's store and experiment, its run name, and
    the tags a later read finds it by (`benchmark_key`)."""
    from runner.run.plan import preset_options

    return [
        *task,
        *parse_level(result.level, preset_options()).overrides(),
        f"trainer.seed={result.seed}",
        f"mlflow.tracking_uri={args.tracking_uri}",
        f"mlflow.experiment_name={args.experiment}",
        f"mlflow.run_name={run_name}",
        f"+mlflow.tags.benchmark={args.experiment}",
        f"+mlflow.tags.benchmark_key={key}",
        f"+mlflow.tags.benchmark_seed={result.seed}",
    ]


def train(
    args, result: Run, task: Sequence[str], run_name: str, histories: Sequence[str] = ()
) -> StoredRun:
    """`result`'s level at its seed trained by a real `app.run`: what the level computes in, the
    outcome (finished, diverged, crashed), the wall time and the objective set on `result`; then
    the run read back from the store (its run id set on `result`, every metric and param, the
    histories of `histories`). A compiled level compiles from scratch: no code of an earlier run
    of the process reused."""
    from runner.errors import DivergenceError
    from runner.run.app import run
    from runner.run.plan import preset_options

    key = f"{args.session}/{result.level}/s{result.seed}"
    overrides = run_overrides(task, result, args, run_name, key)
    compiled = parse_level(result.level, preset_options()).compile
    if compiled:
        import torch

        torch._dynamo.reset()
    attribute, what = result.OBJECTIVE
    started = time.perf_counter()
    try:
        cfg = compose(overrides)
        result.opt_level = str(cfg.precision.opt_level)
        result.dtype = describe_level(cfg.precision, compiled)
        result.fp8 = cfg.precision.get("fp8_linear") or None
        value = run(cfg, overrides=overrides)
        setattr(result, attribute, None if value is None else float(value))
    except DivergenceError as error:  # an outcome (pure 16-bit may do this), not a crash
        result.status, result.error = "diverged", str(error)
    except Exception as error:  # noqa: BLE001  (reported, and the exit status says so)
        result.status, result.error = "crashed", f"{type(error).__name__}: {error}"
        print(traceback.format_exc(), file=sys.stderr)
    result.wall_s = time.perf_counter() - started
    try:
        stored = read_run(args.tracking_uri, args.experiment, key, histories)
    except Exception as error:  # noqa: BLE001
        stored = StoredRun()
        log.warning("could not read the run's metrics back: %s", error)
    result.run_id = stored.run_id
    if getattr(result, attribute) is None and result.status == "finished":
        result.status, result.error = "crashed", f"the run returned no {what}"
    return stored


# ---- the grid -----------------------------------------------------------------------------------
def report_fields(name: str, argv: Sequence[str], args) -> dict:
    """The fields every levels x seeds report ends with, in the order their JSON results list
    them (`setup_lines` reads them back); `_results` holds the runs as they finish."""
    return {
        "command": command(name, argv),
        "date": now(),
        "total_wall_s": 0.0,
        "tracking_uri": args.tracking_uri,
        "experiment": args.experiment,
        "machine": machine(args.device),
        "runs": [],
        "_results": [],
    }


def run_all(
    args,
    report: dict,
    one: Callable[[str, int], Run],
    said: Callable[[Run], str],
    save: Callable[[], object],
    seed_major: bool = False,
) -> list[Run]:
    """Every level at every seed (level by level, or seed by seed with `seed_major`, so that a
    command stopped early leaves every level compared): `one(level, seed)` runs it, `said` is
    the line printed after it, `save` writes the results so far after each run."""
    pairs = [(lv, s) for lv in args.levels for s in args.seeds]
    if seed_major:
        pairs = [(lv, s) for s in args.seeds for lv in args.levels]
    results: list[Run] = report["_results"]
    started = time.perf_counter()
    for level, seed in pairs:
        print(f"[{len(results) + 1}/{len(pairs)}] {level} seed {seed} ...", end=" ", flush=True)
        result = one(level, seed)
        results.append(result)
        print(said(result), flush=True)
        report["runs"] = [asdict(r) for r in results]
        report["total_wall_s"] = time.perf_counter() - started
        save()
    return results


def finish(text: str, paths: Sequence[Path], results: Sequence[Run]) -> int:
    """The table printed, the files written named; the exit status: 1, with the crashed runs
    (level, seed, error) on stderr, where a run crashed; 0 otherwise."""
    show(text, paths)
    crashed = [r for r in results if r.status == "crashed"]
    if crashed:
        print(
            f"{len(crashed)} run(s) crashed: "
            + "; ".join(f"{r.level} seed {r.seed}: {r.error}" for r in crashed),
            file=sys.stderr,
        )
        return 1
    return 0


# ---- per level ----------------------------------------------------------------------------------
def finite(values) -> list[float]:
    """The values that are numbers (no None, NaN or infinity), as floats."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean(values) -> float | None:
    values = finite(values)
    return statistics.fmean(values) if values else None


def by_seed(runs: Sequence[Run], attribute: str) -> dict[int, float | None]:
    """Each run's `attribute` by its seed, None where the run did not finish."""
    return {r.seed: getattr(r, attribute) if r.status == "finished" else None for r in runs}


def seed_stats(values: dict[int, float | None], seeds: Sequence[int]) -> tuple:
    """(mean, std) over the seeds, only where every seed has a number; (None, None) otherwise."""
    got = finite(values.get(s) for s in seeds)
    if not got or len(got) != len(seeds):
        return None, None
    return statistics.fmean(got), statistics.stdev(got) if len(got) > 1 else 0.0


def seed_cells(
    values: dict[int, float | None], level: str, report: dict, written: Callable[[float], str]
) -> list[str]:
    """A level's table cells, one a seed: its value as `written` writes it, or where there is none
    the run's status ("missing" where it never ran)."""
    cells = []
    for seed in report["seeds"]:
        value = values.get(seed)
        if value is None:
            status = (r.status for r in report["_results"] if r.level == level and r.seed == seed)
            cells.append(next(status, "missing"))
        else:
            cells.append(written(value))
    return cells


def setup_lines(report: dict) -> list[str]:
    """A levels x seeds report's Setup lines: the machine, the date, the command, the total
    wall time over its runs, the MLflow experiment and store."""
    m = report["machine"]
    return [
        f"- Machine: {m['cpu']}, {m['cores']} cores (torch uses {m['torch_threads']} threads)"
        + (f", GPU {m['gpu']} (CUDA {m['cuda']})" if "gpu" in m else "")
        + f"; torch {m['torch']}, Python {m['python']}, {m['platform']}",
        f"- Date: {report['date']}",
        f"- Command: `{report['command']}`",
        f"- Total wall time: {report['total_wall_s'] / 60:.1f} min for {len(report['runs'])} runs",
        f"- MLflow: experiment `{report['experiment']}` in `{report['tracking_uri']}`",
    ]


def unfinished_lines(results: Sequence[Run]) -> list[str]:
    """The Markdown section on the runs that did not finish (level, seed, status, error); no
    lines where every run finished."""
    unfinished = [r for r in results if r.status != "finished"]
    if not unfinished:
        return []
    return [
        "## Runs that did not finish",
        "",
        *(f"- `{r.level}` seed {r.seed}: {r.status}: {r.error}" for r in unfinished),
        "",
    ]


# ---- optimizer-state rows -----------------------------------------------------------------------
# the formats whose accuracy is checked against their level's own state (int4 and fp8 are
# reported), and the largest optimizer-state memory, as a fraction of fp32 state, per format
STATE_CHECKED = ("bf16", "int8")
STATE_MEMORY_TARGETS = {"int8": 0.3, "int4": 0.2}
# bytes an element of plain optimizer state, by its `precision.optimizer_state` param
PLAIN_STATE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the presets whose optimizer state is not their level's own: preset -> (its level's preset, format)
STATE_PRESETS = {
    "o2_bf16_int8state": ("o2_bf16", "int8"),
    "o3_bf16_sr_int8state": ("o3_bf16_sr", "int8"),
}


def state_reference(level: str) -> tuple[str | None, str | None]:
    """An optimizer-state level's (reference level, state format), or (None, None): the same
    level without the state suffix (`o2_bf16+int8state` -> `o2_bf16`), or the level's preset for
    a preset with int8 state (`o2_bf16_int8state` -> `o2_bf16`); a compiled row's reference is
    compiled too."""
    from runner.run.plan import preset_options

    spec = parse_level(level, preset_options())
    if spec.state is not None:
        return dataclasses.replace(spec, state=None).name, spec.state
    if spec.preset in STATE_PRESETS:
        base, fmt = STATE_PRESETS[spec.preset]
        return dataclasses.replace(spec, preset=base).name, fmt
    return None, None


def fp32_state_ratio(
    state_mb: float | None, reference_mb: float | None, reference_type: str | None
) -> float | None:
    """A state's memory as a fraction of fp32 state for the same parameters, the basis of
    STATE_MEMORY_TARGETS ("of fp32 state"): the reference level's measured plain state
    scaled to 4 bytes an element. The basis differs from the reference itself where that keeps its
    state in the weights' 16-bit type (O3: `o3_bf16_sr`'s state is bf16, half of fp32's). None
    where a figure or the reference's type is unknown."""
    size = PLAIN_STATE_BYTES.get(reference_type or "")
    if state_mb is None or not reference_mb or size is None:
        return None
    return state_mb / (reference_mb * 4 / size)


def compare_state(row: Any, ref: Any) -> None:
    """An optimizer-state row's memory against its reference level's (both a benchmark's level
    summary, with `state_mb` and `state_type`), where both were measured: `state_vs_reference`,
    the reference's `reference_state_type`, `state_memory_ratio` (the fraction of fp32 state
    that the targets judge) and `within_memory_target` where its format has a target."""
    if ref is None or not ref.state_mb or row.state_mb is None:
        return
    row.state_vs_reference = row.state_mb / ref.state_mb
    row.reference_state_type = ref.state_type
    row.state_memory_ratio = fp32_state_ratio(row.state_mb, ref.state_mb, ref.state_type)
    if row.state_memory_ratio is not None and row.state_format in STATE_MEMORY_TARGETS:
        row.within_memory_target = row.state_memory_ratio <= STATE_MEMORY_TARGETS[row.state_format]
