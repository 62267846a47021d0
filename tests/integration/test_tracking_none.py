"""`tracking=none`: runs recorded on the console and in `<run folder>/tracking.json`, with no store.

A real CLI run writes its record (params, metrics at their steps, artifacts, the final status) and
creates no MLflow store and loads no MLflow; a failing run is recorded FAILED with its error; a
sweep records its parent in the sweep's folder and each job in its own, which the report refuses
to read (it reads an MLflow store). The tracker choice cannot be swept, and is no param.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.config import TRACKERS
from runner.errors import DivergenceError
from runner.report.cli import main as report_main
from runner.run import app
from runner.tracking import tags as tag
from runner.tracking.base import FAILED, FINISHED, MLFLOW, NONE, RunNotFound
from runner.tracking.json_file import FILE, JsonTracker
from tests.helpers.runs import FAST, REPO, compose_config, run_cli, run_in_process
from tests.helpers.store import EPOCH_METRICS, FINAL_METRICS, runs_by_name

pytestmark = pytest.mark.new_store  # no store anywhere, and none created

DIVERGING = ["precision=o3", "precision.loss_scale=1e10", "trainer.max_bad_steps=2"]
STORE_FILES = ("mlflow.db", "mlruns", "mlartifacts")


def record(folder: Path) -> dict:
    return json.loads((folder / FILE).read_text())


def steps(rec: dict, metric: str) -> list[int]:
    return [step for step, *_ in rec["metrics"][metric]]


def test_a_run_writes_its_record_and_no_store(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        *FAST,
        "tracking=none",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        python_flags=("-X", "importtime"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rec = record(out)
    assert rec["tracker"] == "none" and rec["status"] == FINISHED and rec["run_name"] == "tiny-O0"
    assert rec["experiment"] == "amp-runner" and rec["end_time"] >= rec["start_time"]
    params = rec["params"]
    assert params["precision.opt_level"] == "O0" and params["trainer.batch_size"] == "32"
    assert params["model.name"] == "tiny" and not any(k.startswith("tracking.") for k in params)
    assert rec["tags"][tag.OPT_LEVEL] == "O0" and tag.ERROR not in rec["tags"]
    for metric in EPOCH_METRICS:
        assert steps(rec, metric) == [1, 2], metric  # one value per epoch, at the epoch
    logged = steps(rec, "train_loss")  # the first step, every 2 (and an epoch's end), in order
    assert len(logged) >= 4 and logged == sorted(logged) and logged[:2] == [1, 2]
    for metric in FINAL_METRICS:
        assert steps(rec, metric) == [2], metric
    for artifact in ("config.yaml", "overrides.yaml", "precision.txt", "logs/runner.log"):
        assert artifact in rec["artifacts"] and (out / "artifacts" / artifact).is_file()
    assert [d["name"] for d in rec["datasets"]] == ["synthetic/train", "synthetic/val"]
    # the console says where the record is, and carries the metrics
    assert f"See the run's record: {out / FILE}" in result.stdout + result.stderr
    assert "train_loss" in (out / "runner.log").read_text()
    # no store anywhere, and MLflow never imported
    assert not [p for p in tmp_path.rglob("*") if p.name in STORE_FILES]
    imported = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert imported and not [line for line in imported if " mlflow" in line]


def test_a_failed_run_is_recorded_failed_with_its_error(tmp_path):
    cfg = compose_config(*FAST, "data.num_train=64", *DIVERGING, "tracking=none")
    with pytest.raises(DivergenceError):
        app.run(cfg, output_dir=tmp_path / "run")
    rec = record(tmp_path / "run")
    assert rec["status"] == FAILED
    assert rec["tags"][tag.ERROR].startswith("DivergenceError: training diverged")
    assert rec["params"]["precision.opt_level"] == "O3" and rec["end_time"] is not None
    assert not [p for p in tmp_path.rglob("*") if p.name in STORE_FILES]


def test_a_sweep_records_its_parent_and_each_job_and_the_report_reads_them(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    status = run_in_process(
        "-m",
        *FAST,
        "data.num_train=64",
        "precision=o0,o3",
        "precision.loss_scale=1e10",
        "trainer.max_bad_steps=2",
        "tracking=none",
        f"hydra.sweep.dir={sweep}",
    )
    assert status == 1  # a job failed, as under MLflow
    parent = record(sweep)
    assert parent["run_name"] == "sweep precision=o0,o3" and parent["status"] == FINISHED
    assert parent["tags"][tag.SWEEP_DIR] == str(sweep.resolve())
    assert parent["tags"][tag.FAILED_JOBS] == "tiny-O3 (FAILED)"
    assert parent["metrics"]["jobs"][0][:2] == [0, 2.0]
    assert parent["metrics"]["failed_jobs"][0][:2] == [0, 1.0]
    jobs = {record(sweep / n)["run_name"]: record(sweep / n) for n in ("0", "1")}
    assert {name: j["status"] for name, j in jobs.items()} == {
        "tiny-O0": FINISHED,
        "tiny-O3": FAILED,
    }
    for number, job in enumerate(jobs.values()):
        assert job["tags"][tag.PARENT_RUN] == parent["run_id"]
        assert job["tags"][tag.JOB_NUM] == str(number)
    assert not [p for p in tmp_path.rglob("*") if p.name in STORE_FILES]
    said = "".join(capsys.readouterr())
    assert f"Compare them:  python -m runner.report --sweep {sweep}" in said
    kept = (sweep / "artifacts" / "sweep_summary.txt").read_text()  # (the closing lines, kept)
    assert kept.startswith("Sweep finished: 2 jobs, 1 failed: tiny-O3 (FAILED).\n")
    assert kept.endswith(f"Compare them:  python -m runner.report --sweep {sweep}\n")

    # the report reads the sweep's records, and keeps its files with the parent's
    assert report_main(["--sweep", str(sweep), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "report" / "comparison.md").read_text()
    assert "# Precision comparison: sweep precision=o0,o3" in table
    assert f"2 runs from `the records (tracking=none) under {sweep.resolve()}`" in table
    assert "| tiny-O0 |" in table and "| tiny-O3 |" in table and "| FAILED |" in table
    assert "Logged them on the sweep's parent run" in out
    assert (sweep / "artifacts" / "report" / "comparison.md").read_text() == table
    assert "report/comparison.md" in record(sweep)["artifacts"]
    # a run's folder is not a sweep's: nothing to compare
    assert report_main(["--sweep", str(sweep / "0"), "--out", str(tmp_path / "r2")]) == 1
    err = capsys.readouterr().err
    assert "holds the record of one run ('tiny-O0'), not a sweep's" in err
    assert not (tmp_path / "r2").exists()


def test_a_folder_that_holds_a_runs_record_takes_no_other_run(tmp_path, capsys):
    """tracking=none keeps a run's only record in its folder: a second run or sweep given a
    folder that holds another's (named outright, used again) stops before it builds anything,
    exit 2, the record kept; the run itself goes on there with resume=auto. The second
    replaced the first's record and artifacts without a word."""
    out, sweep = tmp_path / "run", tmp_path / "sweep"
    assert run_in_process(*FAST, "tracking=none", f"hydra.run.dir={out}") == 0
    first = record(out)
    capsys.readouterr()
    assert run_in_process(*FAST, "tracking=none", "precision=o1_bf16", f"hydra.run.dir={out}") == 2
    said = "".join(capsys.readouterr())
    assert f"hydra.run.dir: {out} holds the record of the run 'tiny-O0' ({first['run_id']}" in said
    assert "Traceback" not in said and "MLflow run" not in said
    assert record(out) == first  # kept whole
    more = ("trainer.max_epochs=3", "resume=auto", f"hydra.run.dir={out}")
    assert run_in_process(*FAST, "tracking=none", *more) == 0  # the same run, one epoch more
    rec = record(out)
    assert rec["run_id"] == first["run_id"] and rec["tags"][tag.RESUME_COUNT] == "1"
    assert steps(rec, "val_acc") == [1, 2, 3]

    sweep_args = (*FAST, "data.num_train=32", "tracking=none", f"hydra.sweep.dir={sweep}")
    assert run_in_process("-m", *sweep_args, "precision=o0,o3_bf16") == 0
    parent = record(sweep)
    capsys.readouterr()
    assert run_in_process("-m", *sweep_args, "precision=o0,o1_bf16") == 2
    said = "".join(capsys.readouterr())
    assert (
        f"hydra.sweep.dir: {sweep} holds the record of the run 'sweep precision=o0,o3_bf16'" in said
    )
    assert "Traceback" not in said and "#0 :" not in said  # no job launched
    assert record(sweep) == parent and record(sweep / "1")["run_name"] == "tiny-O3-bf16"


def test_the_tracker_cannot_be_swept(tmp_path, capsys):
    assert run_in_process("-m", *FAST, "tracking=mlflow,none", f"hydra.sweep.dir={tmp_path}") == 2
    out = "".join(capsys.readouterr())
    assert "tracking.name: a sweep's jobs are recorded by their parent run's tracker" in out


def test_help_says_what_tracking_none_does(tmp_path, capsys):
    result = run_cli("--help", cwd=tmp_path)
    assert "tracking=none" in result.stdout and "report: --sweep DIR" in result.stdout
    assert "tracking: mlflow, none" in result.stdout  # the group's options
    with pytest.raises(SystemExit):
        report_main(["--help"])
    assert "tracking=none" in " ".join(capsys.readouterr().out.split())


def test_the_trackers_are_named_once_in_the_config_and_its_group():
    assert set(TRACKERS) == {MLFLOW, NONE}
    options = {  # (each option as composed: a file restates no schema default, mlflow's name)
        path.stem: compose_config(f"tracking={path.stem}").tracking.name
        for path in (REPO / "conf" / "tracking").glob("*.yaml")
    }
    assert options == {name: name for name in TRACKERS}


def test_an_interrupted_run_is_killed_and_a_resumed_one_goes_on_under_its_id(tmp_path):
    tracker = JsonTracker(tmp_path, "amp-runner")
    with pytest.raises(KeyboardInterrupt):
        with tracker.start_run("stopped", {}, {}, folder=tmp_path / "stopped"):
            raise KeyboardInterrupt
    assert record(tmp_path / "stopped")["status"] == "KILLED"
    assert record(tmp_path / "stopped")["tags"][tag.ERROR] == "interrupted by the user (Ctrl-C)"

    with tracker.start_run("r", {"a": "1"}, {"t": "x"}, folder=tmp_path / "first") as run:
        run.log_metrics({"val_acc": 0.5}, 1)
    # the same root: the record goes on in the resumed run's folder, with its history
    again = JsonTracker(tmp_path, "amp-runner")
    with again.start_run("r", {}, {tag.RESUMED_FROM: "ckpt"}, run.run_id, tmp_path / "second"):
        pass
    rec = record(tmp_path / "second")
    assert rec["run_id"] == run.run_id and rec["status"] == FINISHED
    assert rec["params"] == {"a": "1"} and rec["tags"][tag.RESUME_COUNT] == "1"
    assert rec["tags"][tag.RESUMED_FROM] == "ckpt" and steps(rec, "val_acc") == [1]
    # another root (a new output folder): a record of its own, under the same id and name
    elsewhere = JsonTracker(tmp_path / "third", "amp-runner")
    with elsewhere.start_run("r", {}, {}, run.run_id):
        pass
    rec = record(tmp_path / "third")
    assert rec["run_id"] == run.run_id and rec["run_name"] == "r"
    assert rec["tags"][tag.RESUME_COUNT] == "1"
    with pytest.raises(RunNotFound):
        elsewhere.reader.run("no-such-run")


def test_a_run_checkpointed_under_mlflow_resumes_under_none_in_a_record_of_its_own(tmp_path):
    """The tracker is no training setting: a checkpoint of an MLflow run resumes under
    tracking=none (its record, in the resumed run's folder, goes on under the MLflow run's id)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # (the same config: unused under none)
    common = [
        *FAST,
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
        f"mlflow.tracking_uri={uri}",
    ]
    app.run(compose_config(*common, "trainer.max_epochs=1"))
    (run,) = runs_by_name(uri).values()
    resumed = compose_config(*common, "trainer.max_epochs=2", "resume=auto", "tracking=none")
    app.run(resumed, output_dir=tmp_path / "resumed")
    rec = record(tmp_path / "resumed")
    assert rec["run_id"] == run.info.run_id and rec["run_name"] == run.info.run_name
    assert rec["status"] == FINISHED and rec["tags"][tag.RESUME_COUNT] == "1"
    assert steps(rec, "val_acc") == [2]  # only the epoch this session trained
