"""The runs a report compares, read through the tracking seam (runner.tracking.base.Reader): a
sweep's children, or an experiment's runs, each as a `Row`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path, PurePath

from runner import metrics as m
from runner.config.mistakes import did_you_mean
from runner.config.schema import CLASSIFICATION
from runner.measure import step_trace
from runner.metrics import (
    DEVICE_BUSY_FRAC,
    LAYERS_IN,
    MFU,
    SAMPLES_PER_S,
    TOKENS_PER_S,
    WARMUP_TIME_S,
    spread_names,
)
from runner.report.analysis import (
    DEVICE_BUSY,
    LM_METRICS,
    MEMORY_METRICS,
    MEMORY_TOTAL,
    METRICS,
    SYSTEM_GPU_BUSY,
    Row,
    describe_dtype,
)
from runner.tracking import tags as tag
from runner.tracking.base import Reader, RunNotFound, RunRecord
from runner.tracking.varying import ACCUMULATE, params_of


class NothingToReport(Exception):
    """No experiment, sweep or run matched: the message says what was looked for, and where."""


def _experiments(reader: Reader, name: str) -> tuple[str, str]:
    """(' (its experiments: a, b)', '; did you mean --experiment a?') for an experiment name
    that matched none."""
    names = reader.experiment_names()
    if not names:
        return " (it has no experiments)", ""
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f" (its experiments: {listed})", did_you_mean(name, names, prefix="--experiment ")


def select_runs(
    reader: Reader, experiment_name: str, parent: RunRecord | None, sweep: str | None
) -> tuple[RunRecord | None, list[RunRecord]]:
    """(parent run or None, its runs): the children of `parent` (a run `find_run` found), of the
    newest sweep whose parent is named `sweep` or whose folder ends with it, or of the newest
    sweep; in an experiment without sweeps, every run of the experiment but the pre-flights."""
    experiment_id = reader.experiment_id(experiment_name)
    if experiment_id is None:
        listed, near = _experiments(reader, experiment_name)
        raise NothingToReport(
            f"no experiment {experiment_name!r} in {reader.location}{listed}; "
            f"set --experiment (the runs' mlflow.experiment_name){near}"
        )
    ids = [experiment_id]
    if parent is None:
        sweeps = reader.runs(ids, having=[tag.SWEEP_DIR], newest_first=True)
        if sweep:
            every = sweeps
            sweeps = [r for r in sweeps if r.run_name == sweep or _in_folder(r, sweep)]
            if not sweeps:
                newest = "; ".join(f"{r.run_name!r} in {r.tags[tag.SWEEP_DIR]}" for r in every[:3])
                raise NothingToReport(
                    f"no sweep named {sweep!r} or in a folder ending with it in "
                    f"experiment {experiment_name!r} of {reader.location}"
                    + (f" (its newest: {newest})" if newest else " (it has no sweeps)")
                )
        parent = sweeps[0] if sweeps else None
    if parent is None:  # (not a range pre-flight's run: it trains nothing to compare)
        runs = [
            r
            for r in reader.runs(ids)
            if tag.PARENT_RUN not in r.tags and r.tags.get(tag.DIAGNOSE) != "true"
        ]
    else:
        runs = reader.runs([parent.experiment_id], tags={tag.PARENT_RUN: parent.run_id})
    if not runs:
        where = (
            f"sweep {parent.run_name!r} ({parent.run_id})"
            if parent
            else f"experiment {experiment_name!r}"
        )
        raise NothingToReport(
            f"no runs in {where} of {reader.location}: run a sweep first, "
            "e.g. python -m runner -m precision=o0,o1,o2,o3"
        )
    return parent, sorted(runs, key=lambda r: r.start_time)


def _in_folder(parent: RunRecord, folder: str) -> bool:
    """Whether the sweep of `parent` ran in `folder`: that folder (a path from here: `./sw`,
    `../runs/multirun/...`), or the end of the sweep's folder (`08-00-00`, `2026-11-29/08-00-00`:
    whole folder names)."""
    ran_in = PurePath(parent.tags[tag.SWEEP_DIR])
    if os.path.isdir(folder) and Path(folder).resolve() == ran_in:
        return True
    end = PurePath(os.path.normpath(folder)).parts
    return bool(end) and ran_in.parts[-len(end) :] == end


def find_run(reader: Reader, experiment_name: str, key: str) -> tuple[RunRecord, str | None]:
    """(the run `key` names, a warning to print or None): the run of that id (in any experiment);
    else, in experiment `experiment_name`, the run of that name (the newest where several share
    it, as a sweep's runs do from one sweep to the next: the line says so) or the one run whose
    id starts with it (the 8 characters a report shows). NothingToReport, naming the experiment's
    newest runs, when none or several match."""
    try:
        return reader.run(key), None
    except RunNotFound:
        pass
    experiment_id = reader.experiment_id(experiment_name)
    if experiment_id is None:
        listed, near = _experiments(reader, experiment_name)
        raise NothingToReport(
            f"no run {key!r} in {reader.location}, and no experiment {experiment_name!r} to look "
            f"for a run of that name in{listed}; set --experiment (the runs' "
            f"mlflow.experiment_name){near}"
        )
    runs = reader.runs([experiment_id], newest_first=True)
    named = [r for r in runs if r.run_name == key]
    if named:
        warning = None
        if len(named) > 1:
            warning = (
                f"{len(named)} runs are named {key!r} in experiment {experiment_name!r}: took the "
                f"newest, {named[0].run_id} (the others: {', '.join(r.run_id for r in named[1:4])}"
                f"{', ...' if len(named) > 4 else ''}); give a run id to take another"
            )
        return named[0], warning
    starting = [r for r in runs if key and r.run_id.startswith(key.lower())]
    if len(starting) == 1:
        return starting[0], None
    if starting:
        raise NothingToReport(
            f"{len(starting)} runs' ids start with {key!r} in experiment {experiment_name!r}: "
            + ", ".join(f"{r.run_name} ({r.run_id})" for r in starting[:5])
            + "; give more of the id"
        )
    newest = ", ".join(f"{r.run_name} ({r.run_id[:8]})" for r in runs[:5])
    raise NothingToReport(
        f"no run {key!r} in {reader.location}: no run has that id, the start of one or that "
        f"name in experiment {experiment_name!r}"
        + (f" (its newest: {newest})" if newest else " (it has no runs)")
    )


def _count(param: str | None) -> int | None:
    """A count a run logged as a param; None where it did not (runs made before it)."""
    return int(param) if param is not None and param.isdigit() else None


def to_row(reader: Reader, run: RunRecord) -> Row:
    """A run's line of the comparison, its curves read from `reader`."""
    params = run.params
    precision = {
        k.removeprefix("precision."): v for k, v in params.items() if k.startswith("precision.")
    }
    batchnorm = _count(params.get(m.BATCHNORM_LAYERS))
    row = Row(
        run_id=run.run_id,
        run_name=run.run_name,
        status=run.status,
        # a zoo model's arch or a _target_ model's class (the `model` tag), else the option name
        model=run.tags.get(tag.MODEL) or params.get("model.name", "?"),
        optimizer=params.get("optimizer.name", "?"),
        level=params.get("precision.opt_level", "?"),
        dtype=describe_dtype(precision, batchnorm) if precision else "?",
        batch_size=_count(params.get("trainer.batch_size")),
        accumulate=_count(params.get(ACCUMULATE)) or 1,
        metrics={
            k: v
            for k, v in run.metrics.items()
            if k in METRICS
            or k in LM_METRICS
            or k in MEMORY_METRICS
            or k == MEMORY_TOTAL
            or k.startswith(LAYERS_IN)
            or k in (m.EPOCH_SAMPLES_PER_S, m.EPOCH_TOKENS_PER_S)  # (why a steady one is missing)
        },
        val_acc=reader.history(run.run_id, m.VAL_ACC),
        peak_mem_kind=run.tags.get(tag.PEAK_MEM_KIND, "?"),
        task=params.get("task.name", CLASSIFICATION),
        reason=end_reason(run.status, run.tags),
        findings=run.tags.get(tag.FINDINGS_LIST, ""),
        params=dict(params_of(run)),  # (the machine it trained on among them)
    )
    if row.is_lm:
        row.val_loss = reader.history(run.run_id, m.VAL_LOSS)
    row.epoch_times = reader.history(run.run_id, m.EPOCH_TIME_S)  # (its time to a quality)
    row.steady = m.EPOCH_SAMPLES_PER_S in run.metrics
    for metric in (SAMPLES_PER_S, TOKENS_PER_S):
        row.metrics.pop(metric, None)
        values = [v for _, v in reader.history(run.run_id, metric)]
        if not row.steady:  # logged before the steady figure: the epoch's own, warm-up in it
            values = values[1:] if len(values) > 1 else values
        if values:  # the steady figure: the mean over the epochs that logged one
            row.metrics[metric] = sum(values) / len(values)
        for name in spread_names(metric):  # its spread, averaged alike (runs made before: none)
            if name in run.metrics:
                spread = [v for _, v in reader.history(run.run_id, name)]
                row.metrics[name] = sum(spread) / len(spread)
    if row.steady:  # the steady steps' times (runs made before the traces: none, no interval)
        row.traces = step_trace.read_all(reader.artifact_texts(run.run_id, step_trace.ARTIFACT_DIR))
    if DEVICE_BUSY_FRAC in run.metrics:  # the run's own measure (profiled steps), in percent
        row.metrics[DEVICE_BUSY] = 100 * run.metrics[DEVICE_BUSY_FRAC]
    elif SYSTEM_GPU_BUSY in run.metrics:  # else NVML's, over the run's samples
        busy = [v for _, v in reader.history(run.run_id, SYSTEM_GPU_BUSY)]
        row.metrics[DEVICE_BUSY] = sum(busy) / len(busy)
    if MFU in run.metrics:  # the mean over the epochs; the warm-up summed over the sessions
        mfu = [v for _, v in reader.history(run.run_id, MFU)]
        row.metrics[MFU] = sum(mfu) / len(mfu)
    if WARMUP_TIME_S in run.metrics:
        warmups = reader.history(run.run_id, WARMUP_TIME_S)
        row.metrics[WARMUP_TIME_S] = sum(v for _, v in warmups)
    return row


def end_reason(status: str, tags: Mapping[str, str]) -> str | None:
    """Why a run is not FINISHED, from its tags: its `error`, or for a RUNNING run when and where
    it last showed life (a run whose process vanished stays RUNNING until the next run or sweep
    of its experiment starts and ends it KILLED)."""
    if status == "FINISHED":
        return None
    if status == "RUNNING":
        if tag.HEARTBEAT not in tags:
            return "running (no heartbeat recorded)"
        return (
            f"running: last heartbeat {tags[tag.HEARTBEAT]} (host {tags.get(tag.HOST, '?')},"
            f" pid {tags.get(tag.PID, '?')})"
        )
    return tags.get(tag.ERROR)
