"""`python -m runner.report` on real MLflow stores: the O0-O3 sweep's SQLite store (made once per
session by a real multirun), the same runs served by a real `mlflow server` on localhost through
its REST API, and small stores written with the runner's MlflowTracker for the edge cases."""

from __future__ import annotations

import csv
import json
import math
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.report.analysis import MEMORY_METRICS, Row, seed_groups
from runner.report.cli import main as report_main
from runner.report.plots import bar_labels
from runner.report.runs import to_row
from runner.tracking.mlflow_tracker import MlflowTracker
from runner.tracking.tags import PARENT_RUN as PARENT_RUN_TAG
from runner.tracking.tags import SWEEP_DIR as SWEEP_DIR_TAG
from runner.tracking.trackers import open_reader
from tests.helpers.runs import run_cli
from tests.helpers.server import MlflowServer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT_FILES = {
    "comparison.md",
    "comparison.csv",
    "time_memory_accuracy.png",
    "memory_by_kind.png",
    "val_acc_curves.png",
}


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def sweep_parent(uri: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("amp-runner")
    parents = client.search_runs([exp.experiment_id], filter_string=f"tags.`{SWEEP_DIR_TAG}` != ''")
    assert len(parents) == 1
    return client, parents[0]


def tiny_params(level: str, **more: str) -> dict[str, str]:
    """The params of a tiny-model run at `level` (SGD, batch 32), as the runner logs them, and
    `more` (keys with their dots: `**{"optimizer.lr": "0.1"}`)."""
    return {
        "model.name": "tiny",
        "optimizer.name": "sgd",
        "trainer.batch_size": "32",
        "precision.opt_level": level,
        **more,
    }


def full_table(markdown: str) -> list[str]:
    """The lines of the full table (every column), below the headline."""
    lines = markdown.splitlines()
    start = lines.index("## Every column")
    return lines[start : lines.index("", start + 3)]


def headline(markdown: str) -> list[list[str]]:
    """The headline table's rows (its title row first), as cells."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    table = lines[start : lines.index("", start)]
    return [line.strip("| ").split(" | ") for line in table[:1] + table[2:]]


def assert_png(path: Path, width: int, height: int) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # something was drawn, not a blank canvas


# ---- the level sweep -----------------------------------------------------------------------------
@pytest.mark.slow
def test_report_compares_the_levels_and_logs_itself_on_the_parent(levels_sweep, tmp_path, capsys):
    _, uri = levels_sweep
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == REPORT_FILES

    client, parent = sweep_parent(uri)
    rows = read_csv(out / "comparison.csv")
    assert [(r["model"], r["level"], r["status"]) for r in rows] == [
        ("tiny", level, "FINISHED") for level in ("O0", "O1", "O2", "O3")
    ]
    assert [r["dtype"] for r in rows] == [
        "float32",
        "float32 weights, autocast float16",
        "float16 (fp32 BatchNorm, fp32 master weights)",
        "float16",
    ]
    runs = {r["level"]: client.get_run(r["run_id"]) for r in rows}
    assert all(run.data.tags[PARENT_RUN_TAG] == parent.info.run_id for run in runs.values())
    o0_rate = float(rows[0]["samples_per_s"])
    o0_memory = runs["O0"].data.metrics["peak_mem_mb"]
    for row in rows:
        metrics = runs[row["level"]].data.metrics
        assert float(row["best_val_acc"]) == pytest.approx(metrics["best_val_acc"])
        assert float(row["train_time_s"]) == pytest.approx(metrics["train_time_s"])
        assert float(row["peak_mem_mb"]) == pytest.approx(metrics["peak_mem_mb"])
        assert float(row["skipped_steps"]) == metrics["skipped_steps"]
        assert row["batch_size"] == "32" and row["baseline_run"] == "tiny-O0"
        # speed: the steady throughputs' ratio
        assert float(row["speedup_vs_o0"]) == pytest.approx(float(row["samples_per_s"]) / o0_rate)
        if o0_memory > 0:
            assert float(row["memory_vs_o0"]) == pytest.approx(metrics["peak_mem_mb"] / o0_memory)
    # throughput: the steady figure, the mean over the epochs that logged one (epoch 2 of 2:
    # the first is the warm-up's), and the warm-up's time
    history = client.get_metric_history(runs["O1"].info.run_id, "samples_per_s")
    assert [m.step for m in history] == [2]
    assert float(rows[1]["samples_per_s"]) == pytest.approx(history[0].value)
    assert float(rows[1]["warmup_time_s"]) == runs["O1"].data.metrics["warmup_time_s"] > 0
    assert rows[1]["mfu"] == ""  # a CPU has no peak

    markdown = (out / "comparison.md").read_text()
    assert markdown.startswith("# Precision comparison: sweep precision=o0,o1,o2,o3")
    table = [line for line in full_table(markdown) if line.startswith("| tiny-O")]
    assert len(table) == 4
    assert table[0].strip("| ").split(" | ")[-2] == "1.00"  # O0's speedup against itself
    assert "speedup vs O0" in markdown and "Runs lacking metrics" not in markdown
    assert_png(out / "time_memory_accuracy.png", 1500, 450)
    assert_png(out / "val_acc_curves.png", 1400, 500)

    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert logged == {f"report/{name}" for name in REPORT_FILES}
    assert f"Logged them on the sweep's parent run {parent.info.run_id}" in capsys.readouterr().out


def rest(base: str, endpoint: str, payload: dict | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{endpoint}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_a_tracking_server_serves_the_sweep_tree(levels_sweep, tmp_path):
    """What the MLflow UI reads: a real `mlflow server` on the sweep's store, over REST."""
    _, uri = levels_sweep
    server = MlflowServer(uri, tmp_path).start()
    base = server.url
    try:
        experiment = rest(base, "experiments/get-by-name?experiment_name=amp-runner")["experiment"]
        ids = [experiment["experiment_id"]]
        tags = {t["key"]: t["value"] for t in experiment["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"  # the runs page
        parents = rest(
            base, "runs/search", {"experiment_ids": ids, "filter": f"tags.`{SWEEP_DIR_TAG}` != ''"}
        )["runs"]
        assert len(parents) == 1
        parent_id = parents[0]["info"]["run_id"]
        children = rest(
            base,
            "runs/search",
            {"experiment_ids": ids, "filter": f"tags.`{PARENT_RUN_TAG}` = '{parent_id}'"},
        )["runs"]
        assert sorted(c["info"]["run_name"] for c in children) == [
            "tiny-O0",
            "tiny-O1",
            "tiny-O2",
            "tiny-O3",
        ]
        for child in children:
            assert child["info"]["status"] == "FINISHED"
            metrics = {m["key"]: m["value"] for m in child["data"]["metrics"]}
            assert 0 <= metrics["best_val_acc"] <= 1 and metrics["train_time_s"] > 0
            assert math.isfinite(metrics["samples_per_s"]) and "peak_mem_mb" in metrics
        parent_metrics = {m["key"]: m["value"] for m in parents[0]["data"]["metrics"]}
        assert parent_metrics == {"jobs": 4.0, "failed_jobs": 0.0}

        # the report reads the same runs through the server
        out = tmp_path / "via-server"
        assert report_main(["--tracking-uri", base, "--parent", parent_id, "--out", str(out)]) == 0
        assert [r["level"] for r in read_csv(out / "comparison.csv")] == ["O0", "O1", "O2", "O3"]
    finally:
        server.stop()


# ---- edge cases, on small stores written with the runner's MlflowTracker ------------------------
def test_runs_lacking_metrics_are_reported_not_fatal(tracking_uri, tmp_path, capsys):
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep precision=o0,o3", {SWEEP_DIR_TAG: str(tmp_path)})
    child_tags = {PARENT_RUN_TAG: parent.run_id}
    params = tiny_params("O0", **{"precision.cast_model_type": "float32"})
    with tracker.start_run("tiny-O0", params, child_tags) as run:
        for epoch, acc in [(1, 0.5), (2, 0.7)]:
            run.log_metrics(
                {
                    "val_acc": acc,
                    "samples_per_s": 100.0 * epoch,
                    "peak_mem_mb": 50.0,
                    "skipped_steps": 0.0,
                },
                epoch,
            )
        run.log_metrics({"best_val_acc": 0.7, "train_time_s": 10.0}, 2)
    failed = tracker.record_failure("tiny-O3", child_tags, RuntimeError("diverged"))
    parent.end("FINISHED")

    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {r["run_name"]: r for r in read_csv(out / "comparison.csv")}
    assert rows["tiny-O0"]["samples_per_s"] == "200.0" and rows["tiny-O0"]["speedup_vs_o0"] == "1.0"
    assert rows["tiny-O3"]["status"] == "FAILED" and rows["tiny-O3"]["best_val_acc"] == ""
    assert rows["tiny-O3"]["level"] == "?"  # it failed before any param was logged
    markdown = (out / "comparison.md").read_text()
    assert (
        f"- tiny-O3 (run {failed}, FAILED): no best_val_acc, train_time_s, samples_per_s, "
        "peak_mem_mb, skipped_steps"
    ) in markdown
    assert f"- tiny-O3 (run {failed}, FAILED): RuntimeError: diverged" in markdown
    assert {p.name for p in out.iterdir()} == REPORT_FILES


def test_a_run_with_no_steady_step_is_told_why(tracking_uri, tmp_path):
    """A run shorter than its warm-up (2 steps, trainer.warmup_steps=3) logs only the epoch's own
    throughput: the report says why its steady figure is missing and what to do, with the epoch
    figure; a run lacking both is listed as before, without the reason."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    params = {"model.name": "tiny", "precision.opt_level": "O1", "trainer.warmup_steps": "3"}
    with tracker.start_run("tiny-O1", params, {}) as run:
        run.log_metrics({"val_acc": 0.4, "epoch_samples_per_s": 53.2, "peak_mem_mb": 15.0}, 1)
        run.log_metrics({"best_val_acc": 0.4, "train_time_s": 5.0, "skipped_steps": 0.0}, 1)
    with tracker.start_run("tiny-O0", {"precision.opt_level": "O0"}, {}) as bare:
        bare.log_metrics({"best_val_acc": 0.5}, 1)
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    markdown = (out / "comparison.md").read_text()
    assert (
        f"- tiny-O1 (run {run.run_id}, FINISHED): no samples_per_s (no steady step: every step "
        "was warm-up, the first trainer.warmup_steps=3 of a session or a step that compiled; "
        "epoch_samples_per_s, which counts them, is 53; train more steps for the steady figure)"
    ) in markdown
    (bare_line,) = [ln for ln in markdown.splitlines() if ln.startswith("- tiny-O0 (run")]
    assert bare_line.endswith("no train_time_s, samples_per_s, peak_mem_mb, skipped_steps")


def test_the_runs_precision_warnings_are_listed_under_the_table(tracking_uri, tmp_path):
    """A level slower than O0 may have been warned about at start (bf16 on a CPU without bf16
    instructions): the report lists each run's warnings and errors from its findings tag, with
    where the messages are; info findings, and runs without warnings, are not listed."""
    from runner.tracking.tags import FINDINGS_LIST

    tracker = MlflowTracker(tracking_uri, "amp-runner")
    listed = {
        "tiny-O1-bf16": "warning precision.autocast_dtype; info model",
        "tiny-O0": "none",
        "tiny-O2": "info precision.loss_scale",
    }
    ids = {}
    for name, findings in listed.items():
        level = name.split("-")[1]
        with tracker.start_run(
            name, {"precision.opt_level": level}, {FINDINGS_LIST: findings}
        ) as run:
            run.log_metrics({"best_val_acc": 0.5}, 1)
        ids[name] = run.run_id
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    markdown = (out / "comparison.md").read_text()
    assert "Runs that started with precision warnings (each message and hint is in " in markdown
    warned = [ln for ln in markdown.splitlines() if ln.startswith("- ") and "warning" in ln]
    assert warned == [
        f"- tiny-O1-bf16 (run {ids['tiny-O1-bf16']}): warning precision.autocast_dtype"
    ]


def test_an_out_that_cannot_be_a_folder_is_refused_without_a_traceback(
    tracking_uri, tmp_path, capsys
):
    """--out naming a file (or a folder inside one) ended in mkdir's traceback; it is refused
    with the reason, exit 2, and the file is left as it was."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    with tracker.start_run("tiny-O0", {"precision.opt_level": "O0"}, {}) as run:
        run.log_metrics({"best_val_acc": 0.5}, 1)
    taken = tmp_path / "report"
    taken.write_text("a file of that name")
    for out in (taken, taken / "inside"):
        assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"Cannot write the report to {out}: " in err and "Traceback" not in err
        assert "set --out to a folder you can write" in err
    assert taken.read_text() == "a file of that name"


def test_an_out_under_a_tilde_is_in_the_home(tracking_uri, tmp_path, monkeypatch, capsys):
    """`--out=~/reports`: the shell leaves a `~` after `=` as it is, and the report made a folder
    named `~` where it was run; the folder is the home's, as the runner's other paths are."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    with tracker.start_run("tiny-O0", {"precision.opt_level": "O0"}, {}) as run:
        run.log_metrics({"best_val_acc": 0.5}, 1)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert report_main(["--tracking-uri", tracking_uri, "--out=~/reports"]) == 0
    assert {p.name for p in (tmp_path / "home" / "reports").iterdir()} == REPORT_FILES
    assert not (tmp_path / "~").exists()


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_missing_store_is_not_created(tmp_path, capsys):
    assert report_main(["--out", str(tmp_path / "r")]) == 1  # ./mlflow.db, the default
    assert "no MLflow store at sqlite:///" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "r").exists()


def test_a_database_path_without_its_scheme_is_refused_with_the_uri_to_type(tmp_path, capsys):
    """`--tracking-uri mlflow.db` (a path, no sqlite:///): MLflow would open it as a folder store
    and raise; the report refuses it at once, exit 2, with the URI forms, no traceback."""
    with pytest.raises(SystemExit) as info:
        report_main(["--tracking-uri", str(tmp_path / "mlflow.db"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "sqlite:////absolute/mlflow.db" in err
    assert f"a path; its URI: sqlite:///{tmp_path / 'mlflow.db'} (" in err  # to paste
    assert "Traceback" not in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--experiment", "nope"], "no experiment 'nope'"),
        (
            ["--experiment", "amp-runer"],
            "amp-runner); set --experiment (the runs' mlflow.experiment_name); did you mean "
            "--experiment amp-runner?",
        ),
        ([], "no runs in experiment 'amp-runner'"),
        (["--parent", "0123456789abcdef"], "no run '0123456789abcdef'"),
        (["--sweep", "multirun/never"], "no sweep named 'multirun/never'"),
    ],
)
def test_nothing_to_report_says_why(args, needle, tracking_uri, tmp_path, capsys):
    MlflowTracker(tracking_uri, "amp-runner")  # an empty experiment
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(tmp_path / "r"), *args]) == 1
    err = capsys.readouterr().err
    assert "Nothing to report: " in err and needle in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_both_stores_list_their_experiments(tracking_uri, tmp_path):
    from runner.tracking.json_file import JsonTracker

    assert "amp-runner" in MlflowTracker(tracking_uri, "amp-runner").reader.experiment_names()
    records = JsonTracker(tmp_path / "none", "mine")
    records.create_run("r", {}, tmp_path / "none" / "run")
    assert records.reader.experiment_names() == ["mine"]


def test_speed_is_compared_at_the_steady_throughput(tracking_uri, tmp_path):
    """Runs with the steady figure: O2 runs twice O0's steady samples_per_s but spent longer
    warming up (its train time is the longer): the throughput column is the mean of the steady
    epochs, the speedup their ratio, and mfu and warm-up get columns of their own."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep precision=o0,o2", {SWEEP_DIR_TAG: str(tmp_path)})
    for level, steady, warmup, mfu in (("O0", 100.0, 1.0, 0.2), ("O2", 200.0, 30.0, 0.1)):
        params = tiny_params(level)
        with tracker.start_run(f"tiny-{level}", params, {PARENT_RUN_TAG: parent.run_id}) as run:
            for epoch in (1, 2):
                epoch_metrics = {
                    "val_acc": 0.5,
                    "epoch_samples_per_s": steady / (10 if epoch == 1 else 1.1),
                    "samples_per_s": steady * (0.9 if epoch == 1 else 1.1),
                    "mfu": mfu,
                    "skipped_steps": 0.0,
                    "peak_mem_mb": 10.0,
                }
                if epoch == 1:
                    epoch_metrics["warmup_time_s"] = warmup
                run.log_metrics(epoch_metrics, epoch)
            run.log_metrics({"best_val_acc": 0.5, "train_time_s": 10.0 + warmup}, 2)
    parent.end("FINISHED")

    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {r["level"]: r for r in read_csv(out / "comparison.csv")}
    assert float(rows["O2"]["samples_per_s"]) == pytest.approx(200.0)
    assert float(rows["O2"]["speedup_vs_o0"]) == pytest.approx(2.0)  # not 11/40 of the time
    assert float(rows["O2"]["warmup_time_s"]) == 30.0 and float(rows["O2"]["mfu"]) == 0.1
    markdown = (out / "comparison.md").read_text()
    assert "| mfu (%) | warm-up (s) |" in markdown
    line = next(x for x in full_table(markdown) if x.startswith("| tiny-O2 "))
    assert "| 200 | 10.0 | 30.0 |" in line
    assert "Runs lacking metrics" not in markdown


def test_each_run_is_timed_to_its_o0_runs_best_accuracy(tracking_uri, tmp_path, capsys):
    """O2 steps faster and gets within the target gap (0.01) of O0's best (0.82) an epoch sooner:
    its time to that accuracy is its first three epochs' training time, 14 s against O0's four,
    34 s (2.43x); O3 never gets there. A wider gap (0.2: 0.62) is reached sooner by both and
    not by O3's 0.6; a negative gap is refused."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep precision=o0,o2,o3", {SWEEP_DIR_TAG: str(tmp_path)})
    curves = {
        "O0": ([0.5, 0.7, 0.805, 0.82], [10.0, 8.0, 8.0, 8.0]),
        "O2": ([0.6, 0.79, 0.815, 0.80], [6.0, 4.0, 4.0, 4.0]),
        "O3": ([0.3, 0.4, 0.5, 0.6], [5.0, 3.0, 3.0, 3.0]),
    }
    for level, (accuracy, seconds) in curves.items():
        params = tiny_params(level)
        with tracker.start_run(f"tiny-{level}", params, {PARENT_RUN_TAG: parent.run_id}) as run:
            for epoch, (acc, s) in enumerate(zip(accuracy, seconds), 1):
                run.log_metrics({"val_acc": acc, "epoch_time_s": s, "peak_mem_mb": 10.0}, epoch)
            summary = {"best_val_acc": max(accuracy), "train_time_s": sum(seconds) + 4}
            run.log_metrics(summary, 4)
    parent.end("FINISHED")

    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {r["level"]: r for r in read_csv(out / "comparison.csv")}
    assert {level: float(rows[level]["target"]) for level in rows} == pytest.approx(
        {"O0": 0.81, "O2": 0.81, "O3": 0.81}
    )
    assert (rows["O0"]["epoch_to_target"], rows["O2"]["epoch_to_target"]) == ("4", "3")
    assert float(rows["O0"]["time_to_target_s"]) == 34.0
    assert float(rows["O2"]["time_to_target_s"]) == 14.0
    assert float(rows["O2"]["speedup_to_target"]) == pytest.approx(34 / 14)
    assert float(rows["O0"]["speedup_to_target"]) == 1.0
    assert rows["O3"]["epoch_to_target"] == rows["O3"]["speedup_to_target"] == ""
    markdown = (out / "comparison.md").read_text()
    assert "| time to O0's best (s) | speedup to O0's best |" in markdown
    line = next(x for x in full_table(markdown) if x.startswith("| tiny-O2 "))
    assert "| 14.0 (epoch 3) | 2.43 | tiny-O0 |" in line
    line = next(x for x in full_table(markdown) if x.startswith("| tiny-O3 "))
    assert "| not reached | - | tiny-O0 |" in line
    assert "`--target-gap` 0.01" in markdown and "Targets: tiny-O0 0.81." in markdown

    wide = tmp_path / "wide"
    assert (
        report_main(["--tracking-uri", tracking_uri, "--out", str(wide), "--target-gap", "0.2"])
        == 0
    )
    rows = {r["level"]: r for r in read_csv(wide / "comparison.csv")}
    assert (rows["O0"]["time_to_target_s"], rows["O2"]["time_to_target_s"]) == ("18.0", "10.0")
    assert float(rows["O2"]["speedup_to_target"]) == pytest.approx(1.8)
    assert rows["O3"]["epoch_to_target"] == ""  # 0.6 < 0.62
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        report_main(["--tracking-uri", tracking_uri, "--target-gap", "-0.1"])
    assert refused.value.code == 2
    assert "--target-gap: -0.1 (allowed: a number >= 0" in capsys.readouterr().err


def test_a_language_model_reaches_a_loss_and_an_epoch_logged_twice_counts_once():
    """A language model's target is a loss to get down to; a resumed session that logged an
    epoch again counts its last value once; a run that logged no epoch times tells the epoch."""
    from runner.config.schema import LANGUAGE_MODEL

    row = Row("r", "gpt-O1", "FINISHED", "gpt", "adamw", "O1", "float32", 8, task=LANGUAGE_MODEL)
    row.val_loss = [(1, 3.0), (2, 2.7), (2, 2.55), (3, 2.4)]
    row.epoch_times = [(1, 5.0), (2, 6.0), (2, 6.0), (3, 5.0)]
    reach = row.reaching(2.6)
    assert (reach.epoch, reach.seconds) == (2, 11.0)
    assert row.best_quality() == 2.4
    assert row.reaching(2.0).epoch is None
    row.epoch_times = []
    assert (row.reaching(2.6).epoch, row.reaching(2.6).seconds) == (2, None)


def test_the_seeds_table_says_how_many_seeds_reached_o0s_best():
    """Two seeds a level: both O2 seeds have a speedup to O0's best only where they reached it;
    the seeds' table averages the one that did and says 1 of 2 reached."""
    from runner.report.analysis import add_baseline_ratios
    from runner.report.tables import render_seed_table

    def row(level: str, seed: str, accuracy: list[float]) -> Row:
        r = Row(f"{level}{seed}", f"tiny-{level}", "FINISHED", "tiny", "sgd", level, "float32", 32)
        r.params = {"trainer.seed": seed}
        r.metrics = {"train_time_s": 10.0, "peak_mem_mb": 1.0, "best_val_acc": max(accuracy)}
        r.val_acc = list(enumerate(accuracy, 1))
        r.epoch_times = [(e, 5.0 if level == "O0" else 2.0) for e in (1, 2)]
        return r

    rows = [
        row("O0", "1", [0.5, 0.8]),
        row("O0", "2", [0.5, 0.8]),
        row("O2", "1", [0.8, 0.8]),
        row("O2", "2", [0.5, 0.6]),
    ]
    add_baseline_ratios(rows)
    assert [r.reach_speedup for r in rows] == [1.0, 1.0, 5.0, None]
    line = next(x for x in render_seed_table(rows) if x.startswith("| tiny | O2 "))
    assert line.endswith("| 5.00 ± 0.00 (1 of 2 reached) |"), line
    line = next(x for x in render_seed_table(rows) if x.startswith("| tiny | O0 "))
    assert line.endswith("| 1.00 ± 0.00 |"), line


def test_memory_by_kind_columns_and_stacked_bars(tracking_uri, tmp_path):
    """Runs that logged mem_*_mb get them in the table and CSV and a stacked bar each; a run
    without them (made before they existed) shows - and is not listed as lacking metrics."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep precision=o0,o2", {SWEEP_DIR_TAG: str(tmp_path)})
    parts = {"O0": (4.0, 0.0, 4.0, 4.0, 20.0), "O2": (2.0, 4.0, 2.0, 4.0, 10.0)}
    for level in ("O0", "O2", "O3"):
        params = tiny_params(level)
        with tracker.start_run(f"tiny-{level}", params, {PARENT_RUN_TAG: parent.run_id}) as run:
            memory = dict(zip(MEMORY_METRICS, parts.get(level, ())))
            if memory:
                memory["mem_total_mb"] = sum(memory.values())
            run.log_metrics(
                {
                    "val_acc": 0.5,
                    "samples_per_s": 10.0,
                    "skipped_steps": 0.0,
                    "peak_mem_mb": memory.get("mem_total_mb", 30.0),
                    **memory,
                },
                1,
            )
            run.log_metrics({"best_val_acc": 0.5, "train_time_s": 1.0}, 1)
    parent.end("FINISHED")

    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == REPORT_FILES
    rows = {r["level"]: r for r in read_csv(out / "comparison.csv")}
    assert float(rows["O2"]["mem_master_weights_mb"]) == 4.0
    assert float(rows["O2"]["mem_total_mb"]) == 22.0 and float(rows["O0"]["mem_total_mb"]) == 32.0
    assert rows["O3"]["mem_weights_mb"] == ""
    assert float(rows["O2"]["memory_vs_o0"]) == pytest.approx(22.0 / 32.0)
    markdown = (out / "comparison.md").read_text()
    line = next(x for x in full_table(markdown) if x.startswith("| tiny-O2 "))
    cells = line.strip("| ").split(" | ")
    assert cells[-11:-5] == ["2.00", "4.00", "2.00", "4.00", "10.00", "22.00"]
    assert cells[-1] == "tiny-O0"  # the baseline each ratio uses
    assert "Runs lacking metrics" not in markdown and "memory_by_kind.png" in markdown
    assert_png(out / "memory_by_kind.png", 1200, 420)  # (a panel per kind, each its own scale)


# ---- a report for every axis ------------------------------------------------------------------
def _axes_sweep(tracking_uri, tmp_path):
    """A sweep of 2 lrs x 2 levels x 2 seeds, as Optuna or a grid leaves it: all runs share their
    names (tiny-O0, tiny-O2); O0's time depends on the lr, O2 is always 2x faster than its O0."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep lr x level x seed", {SWEEP_DIR_TAG: str(tmp_path)})
    ids = {}
    for lr, o0_time in (("0.1", 8.0), ("0.01", 4.0)):
        for level in ("O0", "O2"):
            for seed in ("1", "2"):
                params = tiny_params(
                    level,
                    **{
                        "optimizer.lr": lr,
                        "trainer.seed": seed,
                        "model.num_parameters": "1000",
                        "mlflow.tracking_uri": tracking_uri,
                    },
                )
                time = o0_time if level == "O0" else o0_time / 2
                with tracker.start_run(
                    f"tiny-{level}", params, {PARENT_RUN_TAG: parent.run_id}
                ) as run:
                    run.log_metrics(
                        {
                            "val_acc": 0.5,
                            "samples_per_s": 10.0,
                            "skipped_steps": 0.0,
                            "peak_mem_mb": 10.0,
                            "best_val_acc": 0.5,
                            "train_time_s": time,
                        },
                        1,
                    )
                    ids[(lr, level, seed)] = run.run_id
    parent.end("FINISHED")
    return ids


def test_the_report_has_a_column_per_varying_param_and_baselines_per_group(tracking_uri, tmp_path):
    ids = _axes_sweep(tracking_uri, tmp_path)
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = read_csv(out / "comparison.csv")
    assert len(rows) == 8
    header = list(rows[0])
    # what differs, and only that: lr and seed (not the params every run shares, not the level's
    # own precision.* params, not a derived one)
    assert header[2:4] == ["optimizer.lr", "trainer.seed"]
    assert "model.num_parameters" not in header and "mlflow.tracking_uri" not in header
    by_id = {r["run_id"]: r for r in rows}
    for (lr, level, seed), run_id in ids.items():
        row = by_id[run_id]
        assert (row["optimizer.lr"], row["trainer.seed"]) == (lr, seed)
        # the baseline is the O0 of the same lr and seed: O2 is 2x faster than it, O0 1x
        assert float(row["speedup_vs_o0"]) == (2.0 if level == "O2" else 1.0), (lr, level, seed)
        assert row["baseline_run"] == f"tiny-O0 ({ids[(lr, 'O0', seed)][:8]})"
    markdown = (out / "comparison.md").read_text()
    assert "| run | optimizer.lr | trainer.seed | model |" in markdown
    assert "O0 run of the same model with the same `optimizer.lr`" in markdown
    # the seeds aggregated: one line per configuration, mean ± sample std and the seed count
    assert "Across seeds (mean ± sample std" in markdown and "`trainer.seed`" in markdown
    assert "| tiny | O2 lr=0.1 | 2 | 50.00 ± 0.00 | 4.0 ± 0.0 | 10 ± 0 | 2.00 ± 0.00 |" in markdown
    assert "| tiny | O0 lr=0.01 | 2 | 50.00 ± 0.00 | 4.0 ± 0.0 | 10 ± 0 | 1.00 ± 0.00 |" in markdown
    # every run has a bar of its own, labelled by what differs
    reader = open_reader(tracking_uri)
    labels = bar_labels([to_row(reader, reader.run(i)) for i in ids.values()])
    assert len(set(labels)) == 8 and "O2 lr=0.1 seed=2" in labels


def test_the_keys_of_an_option_other_runs_did_not_pick_are_no_column():
    """A CNN beside a GPT (or SGD beside Adam): each model's own keys (model.width, model.n_embd,
    data.block_size, optimizer.momentum) were columns of "what differs", twenty of them for two
    runs, though the model, data and optimizer columns already tell the runs apart. A key one
    run added to the same option still is one."""
    from runner.tracking.base import RunRecord
    from runner.tracking.varying import varying_params

    def run(**params: str) -> RunRecord:
        return RunRecord("id", "name", "1", "FINISHED", params=params)

    cnn = {"model.name": "tiny", "model.width": "16", "data.name": "synthetic"}
    cnn |= {"data.image_size": "32", "optimizer.name": "sgd", "optimizer.momentum": "0.9"}
    gpt = {"model.name": "gpt", "model.n_embd": "64", "data.name": "synthetic_text"}
    gpt |= {"data.block_size": "64", "optimizer.name": "adam", "optimizer.eps": "1e-8"}
    assert varying_params([run(**cnn), run(**gpt)]) == ["data.name"]
    wider = {**cnn, "model.small_input": "false"}  # (added to one run of the same model)
    assert varying_params([run(**cnn), run(**wider)]) == ["model.small_input"]


def test_a_group_without_an_o0_run_gets_no_ratio(tracking_uri, tmp_path):
    """A different lr's O0 is not a baseline (the old report took "the first O0 run")."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep", {SWEEP_DIR_TAG: str(tmp_path)})
    for level, lr in (("O0", "0.1"), ("O2", "0.01")):
        params = {"model.name": "tiny", "precision.opt_level": level, "optimizer.lr": lr}
        with tracker.start_run(f"tiny-{level}", params, {PARENT_RUN_TAG: parent.run_id}) as run:
            run.log_metrics({"train_time_s": 1.0, "best_val_acc": 0.5, "peak_mem_mb": 1.0}, 1)
    parent.end("FINISHED")
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {r["level"]: r for r in read_csv(out / "comparison.csv")}
    assert rows["O0"]["speedup_vs_o0"] == "1.0" and rows["O2"]["speedup_vs_o0"] == ""
    assert rows["O2"]["baseline_run"] == ""


def test_runs_on_two_machines_compare_each_with_the_o0_of_its_machine(
    tracking_uri, tmp_path, capsys
):
    """One tracking server, runs from two machines (a sweep's SLURM jobs on two GPU types, or
    an O0 rerun on a laptop): trainer.device logs `auto` on both, so an O2 on an H100 was given
    against an O0 on an A100. The machine (the runs' `device_name` tag) is an axis: a column
    where it differs, and each run's baseline is an O0 of its own machine."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep", {SWEEP_DIR_TAG: str(tmp_path)})
    a100, h100 = "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"
    times = {("O0", a100): 12.0, ("O2", a100): 4.0, ("O0", h100): 6.0, ("O2", h100): 1.5}
    for (level, machine), time in times.items():
        params = {"model.name": "tiny", "precision.opt_level": level, "trainer.device": "auto"}
        tags = {PARENT_RUN_TAG: parent.run_id, "device_name": machine}
        with tracker.start_run(f"tiny-{level}", params, tags) as run:
            run.log_metrics({"train_time_s": time, "best_val_acc": 0.5, "peak_mem_mb": 1.0}, 1)
    parent.end("FINISHED")
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {(r["level"], r["machine"]): r for r in read_csv(out / "comparison.csv")}
    assert float(rows[("O2", a100)]["speedup_vs_o0"]) == 3.0  # 12 s / 4 s, not 6 s / 4 s
    assert float(rows[("O2", h100)]["speedup_vs_o0"]) == 4.0
    assert float(rows[("O0", h100)]["speedup_vs_o0"]) == 1.0
    assert "| machine |" in (out / "comparison.md").read_text()
    # the sweep's closing summary groups alike (runner.tracking.varying, both)
    from runner.sweep.speed import speed_summary

    reader = open_reader(tracking_uri)
    children = reader.runs([parent.experiment_id], tags={PARENT_RUN_TAG: parent.run_id})
    rate = {
        c.run_id: 100.0 / times[(c.params["precision.opt_level"], c.tags["device_name"])]
        for c in children
    }
    said = speed_summary(
        children, lambda run_id, metric: [(1, rate[run_id])] if metric == "samples_per_s" else []
    )
    ids = {(c.params["precision.opt_level"], c.tags["device_name"]): c.run_id for c in children}
    for machine, o2_rate, ratio in ((a100, 25, "3.00"), (h100, 67, "4.00")):  # (100 / time)
        o2, o0 = ids[("O2", machine)][:8], ids[("O0", machine)][:8]  # named apart by their ids
        line = f"  tiny-O2 ({o2}): {o2_rate} samples/s steady, {ratio}x vs tiny-O0 ({o0})\n"
        assert line in said, said
    # and --diff of two runs configured alike names the machine (it said "No param differs")
    o2 = {c.tags["device_name"]: c.run_id for c in children if "O2" in c.run_name}
    capsys.readouterr()
    assert report_main(["--tracking-uri", tracking_uri, "--diff", o2[a100], o2[h100]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 params differ:") and f"| machine | {a100} | {h100} |" in out


def test_a_tuned_sweep_compares_each_level_with_its_o0(tracking_uri, tmp_path):
    """trainer.tune decides per run (channels_last for O0 only, the kernels kept for O2 after
    measuring, one run's decisions from the cache): the report grouped runs by those `tune.*`
    params and the settings, so a tuned sweep's O2 had no O0 and no speedup. What tune decided
    is a run's result, shown in one column; what the user swept still groups."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep", {SWEEP_DIR_TAG: str(tmp_path)})
    kept = "false (kept: the default measured as fast or faster)"
    runs = {
        ("O0", "0.1"): ("true", "true (tuned: 1.49x the untuned steady step)", "cache", 10.0),
        ("O2", "0.1"): ("false", kept, "measured", 4.0),
        ("O0", "0.2"): ("false", "kept: given", "measured", 9.0),
        ("O2", "0.2"): ("true", "kept: given", "measured", 3.0),
    }
    for (level, lr), (channels_last, why, source, time) in runs.items():
        params = {
            "model.name": "tiny",
            "precision.opt_level": level,
            "optimizer.lr": lr,
            "trainer.channels_last": channels_last,
            "tune.trainer.channels_last": why,
            "tune.source": source,
        }
        with tracker.start_run(f"tiny-{level}", params, {PARENT_RUN_TAG: parent.run_id}) as run:
            run.log_metrics({"train_time_s": time, "best_val_acc": 0.5, "peak_mem_mb": 1.0}, 1)
    parent.end("FINISHED")
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {(r["level"], r["optimizer.lr"]): r for r in read_csv(out / "comparison.csv")}
    assert float(rows[("O2", "0.1")]["speedup_vs_o0"]) == 2.5  # against the tuned O0
    assert rows[("O0", "0.1")]["tuned"] == "channels_last=true"
    assert rows[("O2", "0.1")]["tuned"] == ""  # kept after measuring: nothing changed
    # given by the user at lr=0.2 but decided by tune at lr=0.1: not an axis of this sweep
    assert float(rows[("O2", "0.2")]["speedup_vs_o0"]) == 3.0
    header = list(next(iter(rows.values())))
    assert not [k for k in header if k.startswith("tune.")]
    assert "trainer.channels_last" not in header
    markdown = (out / "comparison.md").read_text()
    assert "| run | optimizer.lr | tuned (trainer.tune) | model |" in markdown
    assert "what trainer.tune chose is a run's result, not a difference" in markdown


def test_diff_prints_the_params_that_differ(tracking_uri, tmp_path, capsys):
    ids = _axes_sweep(tracking_uri, tmp_path)
    a, b = ids[("0.1", "O0", "1")], ids[("0.01", "O2", "1")]
    assert (
        report_main(
            ["--tracking-uri", tracking_uri, "--diff", a, b, "--out", str(tmp_path / "report")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("2 params differ:")
    assert "| optimizer.lr | 0.1 | 0.01 |" in out and "| precision.opt_level | O0 | O2 |" in out
    assert "trainer.seed" not in out and "| status | FINISHED | FINISHED |" in out
    assert "| best_val_acc | 0.5 | 0.5 |" in out
    assert not (tmp_path / "report").exists()  # writes nothing
    assert report_main(["--tracking-uri", tracking_uri, "--diff", a, "no-such-run"]) == 1
    assert "no run 'no-such-run'" in capsys.readouterr().err


def test_a_run_is_named_by_id_its_start_or_its_name(tracking_uri, tmp_path, capsys):
    """--diff and --parent take what a user sees: a run's name (the sweep's summary prints names;
    the newest of that name, said on stderr when several share it) or the 8 characters of its id
    a diff shows. A start that fits several ids, or nothing, is refused naming what there is."""
    ids = _axes_sweep(tracking_uri, tmp_path)
    newest = {"tiny-O0": ids[("0.01", "O0", "2")], "tiny-O2": ids[("0.01", "O2", "2")]}
    args = ["--tracking-uri", tracking_uri]
    assert report_main([*args, "--diff", "tiny-O0", "tiny-O2"]) == 0
    out, err = capsys.readouterr()
    assert (
        f"| param | tiny-O0 ({newest['tiny-O0'][:8]}) | tiny-O2 ({newest['tiny-O2'][:8]}) |" in out
    )
    assert "1 params differ:" in out and "| precision.opt_level | O0 | O2 |" in out
    assert "4 runs are named 'tiny-O0' in experiment 'amp-runner': took the newest, " in err
    assert newest["tiny-O0"] in err and "give a run id to take another" in err

    a, b = ids[("0.1", "O0", "1")], ids[("0.01", "O2", "1")]
    assert report_main([*args, "--diff", a[:8], b[:8]]) == 0
    out, err = capsys.readouterr()
    assert "| optimizer.lr | 0.1 | 0.01 |" in out and err == ""

    assert report_main([*args, "--diff", "", b]) == 1
    assert "no run ''" in capsys.readouterr().err
    assert report_main([*args, "--diff", "tiny-O3", b]) == 1
    err = capsys.readouterr().err
    assert "no run 'tiny-O3' in sqlite:///" in err and "its newest: tiny-O2 (" in err

    parent = MlflowClient(tracking_uri).get_run(a).data.tags[PARENT_RUN_TAG]
    out_dir = tmp_path / "report"
    assert report_main([*args, "--parent", parent[:8], "--out", str(out_dir)]) == 0
    assert len(read_csv(out_dir / "comparison.csv")) == 8


def test_an_ambiguous_start_of_an_id_is_refused(tracking_uri, capsys):
    """Runs whose ids share their start: that start names none of them, and they are listed.
    (Ids are random: of 17 runs, two share their first character.)"""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    by_start: dict[str, list[str]] = {}
    while max(map(len, by_start.values()), default=0) < 2:
        with tracker.start_run("tiny-O0", {"precision.opt_level": "O0"}, {}) as run:
            by_start.setdefault(run.run_id[0], []).append(run.run_id)
    shared, both = next((k, v) for k, v in by_start.items() if len(v) == 2)
    assert report_main(["--tracking-uri", tracking_uri, "--diff", shared, both[0]]) == 1
    err = capsys.readouterr().err
    assert f"2 runs' ids start with {shared!r} in experiment 'amp-runner': " in err
    assert all(f"tiny-O0 ({run_id})" in err for run_id in both) and "give more of the id" in err


def test_an_experiment_without_sweeps_reports_its_runs_not_its_preflights(tracking_uri, tmp_path):
    """A range pre-flight (python -m runner.diagnose) logs a run, tagged `diagnose`, into the
    experiment; it trains nothing to compare and is not a row of the experiment's report."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    with tracker.start_run("tiny-O0", {"precision.opt_level": "O0"}, {}) as run:
        run.log_metrics({"best_val_acc": 0.5, "train_time_s": 2.0}, 1)
    with tracker.start_run("tiny-diagnose", {"diagnose.steps": "3"}, {"diagnose": "true"}):
        pass
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    assert [r["run_name"] for r in read_csv(out / "comparison.csv")] == ["tiny-O0"]
    assert "diagnose" not in (out / "comparison.md").read_text()


def test_a_sweep_is_found_by_its_folder_as_a_path_or_its_end(
    tracking_uri, tmp_path, monkeypatch, capsys
):
    """--sweep takes the sweep's folder as a path from here (`./multirun/...`, `../...`, what a
    shell completes) or its end, whole folder names (`10-00-00`); a part of a name is no end
    (`00` named any sweep at a full hour). A miss names the experiment's newest sweeps."""
    folder = tmp_path / "multirun" / "2026-01-01" / "10-00-00"
    folder.mkdir(parents=True)
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep precision=o0,o2", {SWEEP_DIR_TAG: str(folder)})
    with tracker.start_run(
        "tiny-O0", {"precision.opt_level": "O0"}, {PARENT_RUN_TAG: parent.run_id}
    ):
        pass
    parent.end("FINISHED")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for sweep in ("../multirun/2026-01-01/10-00-00/", str(folder), "2026-01-01/10-00-00"):
        assert report_main(["--tracking-uri", tracking_uri, "--sweep", sweep]) == 0, sweep
        assert f"parent run `{parent.run_id}`" in capsys.readouterr().out
    assert report_main(["--tracking-uri", tracking_uri, "--sweep", "00"]) == 1
    assert (
        f"no sweep named '00' or in a folder ending with it in experiment 'amp-runner' of "
        f"{tracking_uri} (its newest: 'sweep precision=o0,o2' in {folder})"
    ) in capsys.readouterr().err


def test_a_reader_that_has_gone_does_not_stop_the_report(tracking_uri, tmp_path):
    """`python -m runner.report | head -3`: once the reader has gone, the report still writes its
    files and logs them on the parent run, exit 0, no BrokenPipeError traceback (the first
    print ended it: nothing written after it, nothing logged)."""
    _axes_sweep(tracking_uri, tmp_path)
    out = tmp_path / "report"
    result = run_cli(
        "--tracking-uri",
        tracking_uri,
        "--out",
        str(out),
        module="runner.report",
        cwd=tmp_path,
        reader_gone=True,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert {p.name for p in out.iterdir()} == REPORT_FILES
    client, parent = sweep_parent(tracking_uri)
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/comparison.md" in logged


def test_seed_statistics_are_the_sample_mean_and_std():
    rows = [
        Row(
            run_id=f"r{i}",
            run_name="tiny-O0",
            status="FINISHED",
            model="tiny",
            optimizer="sgd",
            level="O0",
            dtype="float32",
            batch_size=32,
            metrics={"best_val_acc": acc},
            params={"trainer.seed": str(i)},
        )
        for i, acc in enumerate((0.5, 0.7, 0.9))
    ]
    (group,) = seed_groups(rows)
    mean, std, n = group.stats(lambda r: r.get("best_val_acc"))
    assert n == 3 and mean == pytest.approx(0.7) and std == pytest.approx(0.2)  # (n - 1)


@pytest.mark.slow
def test_the_report_of_a_real_lr_level_seed_sweep(tmp_path):
    """A real 2-lr x 2-level x 2-seed sweep through the CLI (in this process): the report's
    columns are exactly what the sweep varied, each O2 run's baseline is the O0 of its lr and
    seed, and the seeds are aggregated per configuration."""
    from tests.helpers.runs import FAST, run_in_process

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (
        run_in_process(
            "-m",
            *FAST,
            "data.num_train=64",
            "trainer.max_epochs=1",
            "optimizer.lr=0.05,0.1",
            "precision=o0,o2_bf16",
            "trainer.seed=1,2",
            "trainer.progress_bar=false",
            f"mlflow.tracking_uri={uri}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        )
        == 0
    )
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    rows = read_csv(out / "comparison.csv")
    assert len(rows) == 8
    assert list(rows[0])[2:4] == ["optimizer.lr", "trainer.seed"]  # and nothing else varies
    by_config = {(r["optimizer.lr"], r["level"], r["trainer.seed"]): r for r in rows}
    for (lr, _level, seed), row in by_config.items():
        base = by_config[(lr, "O0", seed)]
        # the jobs' names tell them apart (the swept values): no run id is needed
        assert base["run_name"] == f"tiny-O0 lr={lr} seed={seed}"
        assert row["baseline_run"] == base["run_name"]
        assert float(row["speedup_vs_o0"]) == pytest.approx(
            float(base["train_time_s"]) / float(row["train_time_s"])
        )
    markdown = (out / "comparison.md").read_text()
    assert markdown.count("| tiny | O2 bf16 lr=") == 2 and "| 2 |" in markdown  # 2 seeds each


def test_a_model_without_batchnorm_keeps_none_in_fp32(tmp_path):
    """O2's keep_batchnorm_fp32 is the level's property: the dtype column said "fp32 BatchNorm"
    of models that have none (a GroupNorm CNN, a transformer). A run logs its model's count of
    BatchNorm layers; the report names them where there are some, or where a run did not count
    them (a run made before the count)."""
    from tests.helpers.runs import FAST, run_in_process

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["-m", *FAST, "model=tiny,tiny_gn", "precision=o2_bf16", "trainer.max_epochs=1"]
    sweep = [f"hydra.sweep.dir={tmp_path / 'sweep'}", "trainer.progress_bar=false"]
    assert run_in_process(*args, *sweep, f"mlflow.tracking_uri={uri}") == 0
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    rows = {r["model.norm"]: r for r in read_csv(out / "comparison.csv")}  # (tiny_gn: group)
    assert rows["batch"]["dtype"] == "bfloat16 (fp32 BatchNorm, fp32 master weights)"
    assert rows["group"]["dtype"] == "bfloat16 (fp32 master weights)"
    reader = open_reader(uri)
    counts = {
        norm: reader.run(r["run_id"]).params["model.batchnorm_layers"] for norm, r in rows.items()
    }
    assert counts == {"batch": "3", "group": "0"}
    assert "model.batchnorm_layers" not in list(read_csv(out / "comparison.csv")[0])  # (derived)


def test_an_o2_batch_compares_with_the_o0_that_accumulated_it(tracking_uri, tmp_path):
    """`precision=o0 trainer.batch_size=64 trainer.accumulate_grad_batches=4` beside
    `precision=o2 trainer.batch_size=256` (the O0 of 256 did not fit): the O2 run's baseline is
    that O0, of the same samples a step (the batches a step sums are shown with the batch, not an
    axis that would leave O2 without an O0), not the O0 of 64 alone; the batch column says
    "64 x 4". The O2 of 64 compares with the O0 of 64. The report and the sweep's summary alike."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep", {SWEEP_DIR_TAG: str(tmp_path)})
    times = {("O0", 64, 4): 8.0, ("O2", 256, 1): 2.0, ("O0", 64, 1): 3.0, ("O2", 64, 1): 1.0}
    for (level, batch, accumulate), time in times.items():
        params = {
            "model.name": "tiny",
            "precision.opt_level": level,
            "trainer.batch_size": str(batch),
            "trainer.accumulate_grad_batches": str(accumulate),
            "trainer.global_batch_size": str(batch * accumulate),  # (as a run logs it)
        }
        name = f"tiny-{level}-{batch}" + (f"x{accumulate}" if accumulate > 1 else "")
        with tracker.start_run(name, params, {PARENT_RUN_TAG: parent.run_id}) as run:
            run.log_metrics({"train_time_s": time, "best_val_acc": 0.5, "peak_mem_mb": 1.0}, 1)
    parent.end("FINISHED")
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {r["run_name"]: r for r in read_csv(out / "comparison.csv")}
    assert rows["tiny-O2-256"]["baseline_run"] == "tiny-O0-64x4"
    assert float(rows["tiny-O2-256"]["speedup_vs_o0"]) == 4.0  # 8 s / 2 s
    assert rows["tiny-O2-64"]["baseline_run"] == "tiny-O0-64"
    assert float(rows["tiny-O2-64"]["speedup_vs_o0"]) == 3.0
    assert rows["tiny-O0-64x4"]["accumulate_grad_batches"] == "4"
    table = (out / "comparison.md").read_text()
    assert "| 64 x 4 |" in table and "| 256 |" in table
    assert "accumulate_grad_batches" not in table.splitlines()[0]  # (not a column of its own)
    from runner.sweep.speed import speed_summary

    children = open_reader(tracking_uri).runs(
        [parent.experiment_id], tags={PARENT_RUN_TAG: parent.run_id}
    )
    rate = {c.run_id: 100.0 / times[_config(c)] for c in children}
    said = speed_summary(
        children, lambda run_id, metric: [(1, rate[run_id])] if metric == "samples_per_s" else []
    )
    assert "tiny-O2-256: 50 samples/s steady, 4.00x vs tiny-O0-64x4" in said, said
    assert "tiny-O2-64: 100 samples/s steady, 3.00x vs tiny-O0-64" in said, said


def _config(run) -> tuple[str, int, int]:
    p = run.params
    return (
        p["precision.opt_level"],
        int(p["trainer.batch_size"]),
        int(p["trainer.accumulate_grad_batches"]),
    )


def test_the_devices_busy_share_is_in_the_headline_and_the_sweeps_summary(tracking_uri, tmp_path):
    """A GPU run logs `device_busy_frac` (its profiled steps, runner.measure.busy): the report's
    headline gives it in percent ("GPU busy (%)", the CSV's device_busy_pct) and the sweep's
    summary on the job's line; a run without it falls back to NVML's utilization."""
    from runner.sweep.speed import speed_summary

    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep", {SWEEP_DIR_TAG: str(tmp_path)})
    runs = {"O0": ({"device_busy_frac": 0.98}, 10.0), "O2": ({}, 5.0)}
    for level, (busy, time) in runs.items():
        tags = {PARENT_RUN_TAG: parent.run_id}
        with tracker.start_run(f"tiny-{level}", tiny_params(level), tags) as run:
            metrics = {"train_time_s": time, "best_val_acc": 0.5, "peak_mem_mb": 1.0}
            metrics.update({"samples_per_s": 320.0 / time, **busy})
            run.log_metrics(metrics, 1)
            if not busy:
                run.log_metrics({"system/gpu_0_utilization_percentage": 40.0}, 1)
    parent.end("FINISHED")
    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    rows = {r["level"]: r for r in read_csv(out / "comparison.csv")}
    assert float(rows["O0"]["device_busy_pct"]) == pytest.approx(98.0)
    assert float(rows["O2"]["device_busy_pct"]) == pytest.approx(40.0)
    title, *cells = headline((out / "comparison.md").read_text())
    assert "GPU busy (%)" in title
    reader = open_reader(tracking_uri)
    children = reader.runs([parent.experiment_id], tags={PARENT_RUN_TAG: parent.run_id})
    said = speed_summary(children, reader.history)
    assert "tiny-O0: 32 samples/s steady, device busy 98%, the baseline" in said, said
    assert "tiny-O2: 64 samples/s steady, 2.00x vs tiny-O0" in said, said
