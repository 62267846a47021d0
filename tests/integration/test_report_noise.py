"""The report says what is noise: a headline of at most ten columns whose speed-ups carry their
95% interval (from the runs' traces of steady step times, logged as artifacts) and a verdict,
whose accuracy differences carry the seeds' std, and prose of short bullets; on stores written
with the runner's MlflowTracker (a synthetic step-time distribution: a fixed sleep plus a known
jitter), and end to end on a real two-level sweep on the CPU (the issue's bar)."""

from __future__ import annotations

import csv
import random
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.measure import step_trace
from runner.measure.step_trace import StepTrace
from runner.report.cli import main as report_main
from runner.report.headline import MAX_COLUMNS
from runner.report.notes import MAX_LINE
from runner.tracking.mlflow_tracker import MlflowTracker
from runner.tracking.tags import PARENT_RUN as PARENT_RUN_TAG
from runner.tracking.tags import SWEEP_DIR as SWEEP_DIR_TAG
from tests.helpers.runs import FAST, run_cli

BATCH = 32
INTERVAL = re.compile(r"^\d+\.\d\dx \[\d+\.\d\d, \d+\.\d\d\]( within noise)?$")


def headline(markdown: str) -> list[list[str]]:
    """The headline table (the first table of the page): its title row, then its rows, as cells."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    table = lines[start : lines.index("", start)]
    return [line.strip("| ").split(" | ") for line in table[:1] + table[2:]]


def prose(markdown: str) -> list[str]:
    """The page's lines that are neither a table's nor a figure's."""
    return [line for line in markdown.splitlines() if not line.startswith(("|", "!["))]


def log_traces(run, folder: Path, sleep: float, jitter: float, seed: int, epochs: int = 2):
    """Traces of `epochs` epochs of 60 steady steps: `sleep` plus a uniform jitter in [0,
    `jitter`) each, handed to the run as the step timer hands them (artifacts `timing/`); and the
    epochs' metrics as the timer logs them (the median step's rate and its spread)."""
    draw = random.Random(seed)
    for epoch in range(1, epochs + 1):
        trace = StepTrace()
        times = [sleep + jitter * draw.random() for _ in range(60)]
        for t in times:
            trace.add(t)
        path = step_trace.write(folder / f"run{seed}", epoch, trace, 60, BATCH, BATCH, 1)
        run.log_file(path, step_trace.ARTIFACT_DIR)
        ordered = sorted(times)
        run.log_metrics(
            {
                "samples_per_s": BATCH / ordered[29],
                "samples_per_s_p10": BATCH / ordered[53],
                "samples_per_s_p90": BATCH / ordered[5],
                "epoch_samples_per_s": BATCH / (sum(times) / 60),
            },
            epoch,
        )


def sweep(
    tracking_uri: str, tmp_path: Path, runs: list[tuple[str, int, float, float]], seeds: bool
) -> Path:
    """A sweep's parent and its runs: (level, seed, step sleep, best val acc) each (`seeds`: the
    seed is a param that varies; else it only draws the jitter); then the report, whose folder
    this returns."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep", {SWEEP_DIR_TAG: str(tmp_path)})
    for level, seed, sleep, accuracy in runs:
        params = {"model.name": "tiny", "precision.opt_level": level, "trainer.batch_size": "32"}
        if seeds:
            params["trainer.seed"] = str(seed)
        name = f"tiny-{level}" + (f" seed={seed}" if seeds else "")
        with tracker.start_run(name, params, {PARENT_RUN_TAG: parent.run_id}) as run:
            log_traces(run, tmp_path / "traces" / level, sleep, 0.004, seed + 10 * len(level))
            run.log_metrics({"val_acc": accuracy, "peak_mem_mb": 10.0, "skipped_steps": 0.0}, 2)
            run.log_metrics({"best_val_acc": accuracy, "train_time_s": 100 * sleep}, 2)
    parent.end("FINISHED")
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    return out


def test_the_headline_gives_each_speed_up_its_interval_and_verdict(tracking_uri, tmp_path):
    """O1's steps take what O0's do (10 ms and up to 4 ms of jitter, other draws): its speed-up
    is within noise; O2's sleep 5 ms (7 ms a median step against 12: 1.71x): its interval holds
    that and not 1.0. The headline fits a screen (at most ten columns), every prose line is a
    short bullet, and the CSV keeps the interval."""
    out = sweep(
        tracking_uri,
        tmp_path,
        [("O0", 1, 0.010, 0.7065), ("O1", 2, 0.010, 0.7045), ("O2", 3, 0.005, 0.7035)],
        seeds=False,
    )
    markdown = (out / "comparison.md").read_text()
    titles, *rows = headline(markdown)
    assert len(titles) <= MAX_COLUMNS and titles[:2] == ["run", "speed-up vs O0 [95%]"]
    cells = {row[0]: dict(zip(titles, row)) for row in rows}
    assert cells["tiny-O0"]["speed-up vs O0 [95%]"] == "baseline"
    o1, o2 = cells["tiny-O1"]["speed-up vs O0 [95%]"], cells["tiny-O2"]["speed-up vs O0 [95%]"]
    assert INTERVAL.match(o1) and o1.endswith("within noise"), o1
    assert INTERVAL.match(o2) and "noise" not in o2, o2
    low, high = (float(v) for v in re.findall(r"\d+\.\d\d", o2)[1:3])
    assert low < 12 / 7 < high
    assert re.match(r"^\d[\d,]* \(\d[\d,]*-\d[\d,]*\)$", cells["tiny-O1"]["samples/s (p10-p90)"])
    assert cells["tiny-O2"]["Δ acc vs O0 (pt)"] == "-0.30"  # (one run each: no verdict)
    assert all(len(line) <= MAX_LINE for line in prose(markdown))
    assert [line for line in prose(markdown) if line.startswith("- Speed-up:")]
    with (out / "comparison.csv").open(newline="") as f:
        table = {r["level"]: r for r in csv.DictReader(f)}
    assert table["O1"]["speedup_within_noise"] == "True"
    assert table["O2"]["speedup_within_noise"] == "False"
    assert float(table["O2"]["speedup_low"]) == pytest.approx(low, abs=0.005)
    assert float(table["O2"]["samples_per_s_p10"]) < float(table["O2"]["samples_per_s"])


def test_seeds_make_one_headline_row_whose_differences_carry_their_std(tracking_uri, tmp_path):
    """Two seeds a level: one headline row a configuration; its speed-up pools both seeds' steps
    (and resamples the seeds), its accuracy difference is the seeds' means with their std
    combined, within noise where the seeds overlap, not where they lie apart."""
    out = sweep(
        tracking_uri,
        tmp_path,
        [
            ("O0", 1, 0.010, 0.70),
            ("O0", 2, 0.010, 0.72),
            ("O2", 1, 0.005, 0.71),
            ("O2", 2, 0.005, 0.73),
            ("O3", 1, 0.005, 0.60),
            ("O3", 2, 0.005, 0.61),
        ],
        seeds=True,
    )
    titles, *rows = headline((out / "comparison.md").read_text())
    assert [row[0] for row in rows] == [f"tiny {level} (2 seeds)" for level in ("O0", "O2", "O3")]
    cells = {row[0].split()[1]: dict(zip(titles, row)) for row in rows}
    assert cells["O2"]["Δ acc vs O0 (pt)"] == "+1.00 ± 2.00 within noise"
    assert cells["O3"]["Δ acc vs O0 (pt)"].startswith("-10.50 ± ")
    assert "noise" not in cells["O3"]["Δ acc vs O0 (pt)"]
    assert cells["O2"]["best val acc (%)"] == "72.00 ± 1.41"
    assert INTERVAL.match(cells["O2"]["speed-up vs O0 [95%]"])
    assert cells["O2"]["status"] == "2 FINISHED"


@pytest.mark.slow
def test_a_two_level_sweep_on_the_cpu_reports_its_noise(tmp_path):
    """The issue's bar: `-m precision=o0,o1_bf16 model=tiny data=synthetic` (a few hundred
    samples, two epochs), then `python -m runner.report`: every run logged its rate's spread and
    its traces, the sweep's last lines and the headline give the speed-up with its interval, the
    headline has at most ten columns, and no prose line is over 400 characters."""
    result = run_cli(
        "-m",
        *FAST,
        "data.num_train=512",
        "data.num_val=64",
        "precision=o0,o1_bf16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout + result.stderr
    line = next(x for x in summary.splitlines() if x.startswith("  tiny-O1-bf16: "))
    assert re.search(r"samples/s \(p10-p90 [\d,.]+-[\d,.]+\) steady, [\d.]+x \[", line), line
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "amp-runner"]
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{PARENT_RUN_TAG}` != ''"
    )
    assert len(runs) == 2
    for run in runs:
        metrics = run.data.metrics
        assert metrics["samples_per_s_p10"] <= metrics["samples_per_s"]
        assert metrics["samples_per_s"] <= metrics["samples_per_s_p90"]
        assert {"summary/samples_per_s", "summary/best_val_acc"} <= set(metrics)
        traces = client.list_artifacts(run.info.run_id, step_trace.ARTIFACT_DIR)
        assert [a.path for a in traces] == ["timing/steps_0001.json", "timing/steps_0002.json"]
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    markdown = (out / "comparison.md").read_text()
    titles, *rows = headline(markdown)
    assert len(titles) <= MAX_COLUMNS and len(rows) == 2
    o1 = dict(zip(titles, rows[1]))
    assert INTERVAL.match(o1["speed-up vs O0 [95%]"]), o1
    assert all(len(line) <= MAX_LINE for line in prose(markdown))
