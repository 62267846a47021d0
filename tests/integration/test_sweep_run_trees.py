"""Hydra multiruns as MLflow run trees: one parent per sweep, one child per job, read back from a
real SQLite store. Two sweeps run as real subprocesses (the default launcher over O0-O3, and the
joblib launcher with a failing job); the rest go through the real CLI and Hydra in this process.
"""

from __future__ import annotations

import _thread
import math
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from runner.measure import spread
from runner.sweep.gpus import claim_gpu
from runner.tracking.store import retry_when_locked
from runner.tracking.tags import PARENT_RUN as PARENT_RUN_TAG
from tests.helpers.runs import (
    FAST,
    compose_config,
    read_until,
    run_cli,
    run_in_process,
    start_cli,
)
from tests.helpers.store import EPOCH_METRICS, FINAL_METRICS


def sweep_tree(uri: str, experiment: str = "amp-runner"):
    """(client, the one parent run, its children by run name); every run must be in the tree."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {uri}"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if PARENT_RUN_TAG not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    parent = parents[0]
    children = {r.info.run_name: r for r in runs if r is not parent}
    assert all(c.data.tags[PARENT_RUN_TAG] == parent.info.run_id for c in children.values())
    return client, parent, children


def test_the_sweep_summary_gives_each_job_its_mean_steady_throughput():
    """The summary's figure is the mean over a job's epochs that logged a steady throughput, the
    figure of its "Finished" line and of the report; it gave the last epoch's, so that on a busy
    machine a sweep said 2.12x where the report said 0.97x."""
    from runner.sweep.speed import speed_summary
    from runner.tracking.base import RunRecord

    def job(num: int, name: str, status: str = "FINISHED") -> RunRecord:
        tags = {"sweep.job_num": str(num)}
        return RunRecord(f"id{num}", name, "1", status, tags=tags, metrics={"samples_per_s": 1.0})

    histories = {
        "id0": [(1, 100.0), (2, 300.0)],
        "id1": [(1, float("nan")), (2, 400.0)],  # (an epoch of warm-up only)
        "id2": [],
    }
    children = [job(1, "b"), job(0, "a"), job(2, "c"), job(3, "d", status="FAILED")]
    spreads = {"samples_per_s_p10": [(1, 80.0), (2, 240.0)], "samples_per_s_p90": [(2, 330.0)]}

    def history(run_id: str, metric: str) -> list[tuple[int, float]]:
        return histories[run_id] if metric == "samples_per_s" else spreads.get(metric, [])

    said = speed_summary(children, lambda run_id, metric: histories[run_id])
    assert said == (
        "  a: 200 samples/s (p10-p90 200-200) steady, the baseline\n"
        "  b: 400 samples/s (p10-p90 400-400) steady, 2.00x vs a\n"
        "  c: no steady throughput (every step was warm-up)\n"
    )
    said = speed_summary(children, history)  # the spread: the epochs' p10 and p90, averaged
    assert said.splitlines()[0] == "  a: 200 samples/s (p10-p90 160-330) steady, the baseline"


def test_the_sweep_summary_compares_each_job_with_the_o0_of_its_model():
    """`-m precision=o2,o0 model=tiny,resnet18`: the summary compared every job with the sweep's
    first (tiny-O2), where the report compares each with the O0 run of its model: the two said
    different things of one sweep. It names the O0 job of the job's model now (else the model's
    first job)."""
    from runner.sweep.speed import speed_summary
    from runner.tracking.base import RunRecord

    def job(num: int, model: str, level: str, rate: float) -> RunRecord:
        return RunRecord(
            f"id{num}",
            f"{model}-{level}",
            "1",
            "FINISHED",
            params={"precision.opt_level": level, "model.name": model},
            tags={"sweep.job_num": str(num), "model": model},
            metrics={"samples_per_s": rate},
        )

    children = [
        job(0, "tiny", "O2", 300.0),
        job(1, "tiny", "O0", 100.0),
        job(2, "resnet18", "O2", 90.0),
        job(3, "resnet18", "O0", 30.0),
        job(4, "vit", "O2", 50.0),  # (no O0 of its model: its model's first job)
    ]
    rates = {c.run_id: [(1, c.metrics["samples_per_s"])] for c in children}
    said = speed_summary(
        children, lambda run_id, metric: rates[run_id] if metric == "samples_per_s" else []
    )
    assert said == (
        "  tiny-O2: 300 samples/s steady, 3.00x vs tiny-O0\n"
        "  tiny-O0: 100 samples/s steady, the baseline\n"
        "  resnet18-O2: 90 samples/s steady, 3.00x vs resnet18-O0\n"
        "  resnet18-O0: 30 samples/s steady, the baseline\n"
        "  vit-O2: 50 samples/s steady, the baseline\n"
    )


def test_the_sweep_summary_compares_each_job_with_the_o0_the_report_gives_it():
    """`-m optimizer.lr=0.1,0.2 precision=o0,o2 trainer.seed=1,2`: the summary compared every
    O2 with the model's first O0 (lr 0.1, seed 1), where the report compares each with the O0
    of its lr, of its seed where that ran. Both read what varies from runner.tracking.varying."""
    from runner.sweep.speed import speed_summary
    from runner.tracking.base import RunRecord

    children, rates = [], {}
    for lr, seed, level, rate in [
        ("0.1", "1", "O0", 100.0),
        ("0.1", "2", "O0", 110.0),
        ("0.2", "1", "O0", 50.0),
        ("0.2", "2", "O0", 55.0),
        ("0.1", "1", "O2", 300.0),
        ("0.2", "2", "O2", 220.0),
    ]:
        params = {"precision.opt_level": level, "model.name": "tiny", "optimizer.lr": lr}
        params |= {"trainer.seed": seed, "mlflow.run_name": f"{level} {lr} {seed}"}
        tags = {"sweep.job_num": str(len(children)), "model": "tiny"}
        name = f"tiny-{level} lr={lr} seed={seed}"
        record = RunRecord(f"id{len(children)}", name, "1", "FINISHED", params=params, tags=tags)
        children.append(record)
        rates[record.run_id] = rate
    said = speed_summary(
        children, lambda run_id, metric: [(1, rates[run_id])] if metric == "samples_per_s" else []
    )
    assert "  tiny-O2 lr=0.1 seed=1: 300 samples/s steady, 3.00x vs tiny-O0 lr=0.1 seed=1\n" in said
    assert "  tiny-O2 lr=0.2 seed=2: 220 samples/s steady, 4.00x vs tiny-O0 lr=0.2 seed=2\n" in said
    assert "  tiny-O0 lr=0.2 seed=1: 50 samples/s steady, the baseline\n" in said


# ---- the default launcher: O0-O3 in one process --------------------------------------------------
@pytest.mark.slow
def test_level_sweep_is_one_parent_with_a_child_per_level(levels_sweep):
    result, uri = levels_sweep
    client, parent, children = sweep_tree(uri)
    assert sorted(children) == ["tiny-O0", "tiny-O1", "tiny-O2", "tiny-O3"]
    for name, child in children.items():
        assert child.info.status == "FINISHED", name
        for metric in ["train_loss", *EPOCH_METRICS, *FINAL_METRICS]:
            assert math.isfinite(child.data.metrics[metric]), (name, metric)
        assert child.data.params["precision.opt_level"] == name[-2:]
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [1, 2]
    assert sorted(c.data.tags["sweep.job_num"] for c in children.values()) == ["0", "1", "2", "3"]
    # the sweep's summary: each job's steady throughput and its spread, the means over its
    # epochs as the report and its "Finished" line give them (not its last epoch's), against
    # the O0 job's (an interval only from 8 steady steps: this sweep's jobs take one each)
    output = result.stdout + result.stderr

    def steady(child, metric: str = "samples_per_s") -> float:
        rates = [m.value for m in client.get_metric_history(child.info.run_id, metric)]
        return sum(rates) / len(rates)

    first = steady(children["tiny-O0"])
    for name, child in children.items():
        rate, p10, p90 = (
            steady(child, m) for m in ("samples_per_s", "samples_per_s_p10", "samples_per_s_p90")
        )
        said = f"  {name}: {spread.rate_text(rate, p10, p90, 'samples')} steady, "
        if name == "tiny-O0":
            assert said + "the baseline\n" in output
        else:
            assert (
                said + f"{rate / first:.2f}x (under 8 steady steps: no interval) vs tiny-O0\n"
                in output
            )
        assert f"Finished {name}: best val_acc " in output
        assert f", steady {spread.rate_text(rate, p10, p90, 'samples')}." in output

    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "sweep precision=o0,o1,o2,o3"
    tags = parent.data.tags
    assert (
        "precision=o0,o1,o2,o3" in tags["sweep.overrides"]
        and "model=tiny" in tags["sweep.overrides"]
    )
    assert (
        Path(tags["sweep.dir"]).is_dir() and (Path(tags["sweep.dir"]) / "multirun.yaml").is_file()
    )
    assert tags["sweep.launcher"] == "BasicLauncher"
    assert parent.data.metrics["jobs"] == 4 and parent.data.metrics["failed_jobs"] == 0
    assert tags["sweep.failed_jobs"] == "none"
    # the parent existed before the first job started, and ended after the last one
    assert parent.info.start_time <= min(c.info.start_time for c in children.values())
    assert parent.info.end_time >= max(c.info.end_time for c in children.values())
    output = result.stdout + result.stderr
    assert f"--parent {parent.info.run_id}" in output and "python -m runner.report" in output
    assert f"#/experiments/{parent.info.experiment_id}/runs" in output


# ---- the joblib launcher: parallel processes, one job fails --------------------------------------
@pytest.mark.slow
def test_parallel_sweep_records_a_failing_job_and_goes_on(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install '.[joblib]'")
    # A static loss scale of 1e10 overflows fp16 gradients (O3 diverges), not fp32 ones (O0 trains).
    result = run_cli(
        "-m",
        "hydra/launcher=parallel",
        "hydra.launcher.n_jobs=2",
        *FAST,
        "data.num_train=64",
        "precision=o0,o3",
        "precision.loss_scale=1e10",
        "trainer.max_bad_steps=2",
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]  # a job failed: the sweep's status says so
    assert "Sweep finished: 2 jobs, 1 failed: tiny-O3" in output
    _, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.launcher"] == "JoblibLauncher"
    assert parent.data.metrics["jobs"] == 2 and parent.data.metrics["failed_jobs"] == 1
    assert parent.data.tags["sweep.failed_jobs"] == "tiny-O3 (FAILED)"
    # the closing lines, kept on the parent where no console may be (nohup, a closed ssh)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    kept = Path(client.download_artifacts(parent.info.run_id, "sweep_summary.txt", str(tmp_path)))
    told = kept.read_text()
    assert told.startswith("Sweep finished: 2 jobs, 1 failed: tiny-O3 (FAILED).\n")
    assert "  tiny-O0: " in told and told.splitlines()[-1] in output
    assert told.splitlines()[-1].startswith("Compare them:  python -m runner.report --tracking-uri")
    assert children["tiny-O3"].info.status == "FAILED"
    assert children["tiny-O3"].data.tags["error"].startswith("DivergenceError: training diverged")
    ok = children["tiny-O0"]
    assert ok.info.status == "FINISHED"
    assert all(math.isfinite(ok.data.metrics[m]) for m in [*EPOCH_METRICS, *FINAL_METRICS])


@pytest.mark.slow
def test_a_joblib_sweep_runs_with_loader_workers_and_progress_bars(tmp_path):
    """A parallel sweep as users run it, the defaults on: each job, in one of joblib's loky
    worker processes, starts its DataLoader's two workers and shows its progress bar. Loky's
    default start method there made every job fail at its first batch ('Process' object has no
    attribute 'env'): the loaders now start their workers the platform's own way."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install '.[joblib]'")
    own = ("trainer.num_workers", "trainer.progress_bar", "trainer.max_epochs")
    result = run_cli(
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *[o for o in FAST if not o.startswith(own)],
        "trainer.num_workers=2",
        "trainer.max_epochs=1",
        "precision=o0,o2_bf16",
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Sweep finished: 2 jobs, none failed" in output and "batch/s" in output
    _, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert parent.data.tags["sweep.launcher"] == "JoblibLauncher"
    assert sorted(children) == ["tiny-O0", "tiny-O2-bf16"]
    assert all(c.info.status == "FINISHED" for c in children.values())
    assert all(c.data.params["trainer.num_workers"] == "2" for c in children.values())


def _long_sweep(tmp_path, *args: str, new_session: bool = False):
    """A sweep of jobs that train for a while (one epoch of 100,000 samples, unless `args` say
    otherwise), started in the background in `tmp_path`, its folder `tmp_path`/sweep."""
    defaults = [
        *FAST,
        "data.num_train=100000",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    given = {a.split("=", 1)[0] for a in args}
    latest = {d.split("=", 1)[0]: d for d in defaults if d.split("=", 1)[0] not in given}
    return start_cli("-m", *latest.values(), *args, cwd=tmp_path, new_session=new_session)


def _wait_for_submitit_runs(tmp_path, proc, count: int) -> None:
    """Until `count` jobs of submitit's (which write to files of their own) have their run."""
    deadline = time.monotonic() + 240
    logs = tmp_path / "sweep" / ".submitit"
    while sum("MLflow run '" in f.read_text() for f in logs.rglob("*_log.out")) < count:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)


def _stopped_sweep(tmp_path, *args: str, signum: int, group: bool = True, launcher: str = "joblib"):
    """A sweep of long jobs in processes of their own (joblib's by default), in its own process
    group, sent `signum` (to the group, as a terminal's Ctrl-C, or to the sweep's process alone)
    once two of its jobs train; asserts what every stopped sweep shows: the signal's exit
    status, no traceback, the two jobs KILLED with their checkpoints. Returns (what it printed,
    the parent run, the children by name)."""
    plugin = {"joblib": "hydra_joblib_launcher", "submitit_local": "hydra_submitit_launcher"}
    pytest.importorskip(f"hydra_plugins.{plugin[launcher]}", reason="pip install '.[dev]'")
    proc = _long_sweep(tmp_path, f"hydra/launcher={launcher}", *args, new_session=True)
    if launcher == "submitit_local":  # (its jobs write to files of their own)
        _wait_for_submitit_runs(tmp_path, proc, 2)
        seen = []
    else:
        seen = read_until(proc, "MLflow run '") + read_until(proc, "MLflow run '")  # each job's
    time.sleep(4)  # (past the runs' first steps)
    (os.killpg if group else os.kill)(proc.pid, signum)
    rest, _ = proc.communicate(timeout=240)
    output = "".join(seen) + rest
    assert proc.returncode == 128 + signum, output[-4000:]
    assert "Traceback" not in output and "BrokenProcessPool" not in output, output[-4000:]
    _, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert parent.info.status == "KILLED", parent.data.tags.get("error")
    assert {n: c.info.status for n, c in children.items()} == {n: "KILLED" for n in children}
    assert len(children) == 2 and len(list(tmp_path.rglob("last.pt"))) == 2, output[-4000:]
    return output, parent, children


@pytest.mark.slow
def test_ctrl_c_stops_every_job_of_a_joblib_sweep_with_its_checkpoint(tmp_path):
    """A terminal's Ctrl-C reaches the sweep's process and joblib's workers at once. Each job
    stops after its step with its checkpoint and the sweep ends KILLED with 130, as one run does.
    It ended the jobs before their checkpoint: the sweep's process raised KeyboardInterrupt, or
    joblib ended the other workers on the first job that came back interrupted; and with more
    workers than jobs (n_jobs=4 for 2 jobs), the idle ones died of the signal and broke joblib's
    pool. The jobs run with their DataLoader workers, as users run them."""
    output, parent, children = _stopped_sweep(
        tmp_path,
        "hydra.launcher.n_jobs=4",
        "trainer.num_workers=2",
        "precision=o0,o2_bf16",
        signum=signal.SIGINT,
    )
    assert sorted(children) == ["tiny-O0", "tiny-O2-bf16"]
    assert parent.data.tags["error"] == "interrupted by SIGINT"
    assert "Sweep stopped by SIGINT: 2 job(s) stopped with a checkpoint" in output
    assert "resume=auto hydra.sweep.dir=" in output


@pytest.mark.slow
def test_a_sigterm_to_a_joblib_sweeps_process_alone_reaches_its_jobs(tmp_path):
    """A SIGTERM to the sweep's process only (a container's stop): the sweep passes it on to
    its workers, the running jobs stop after their step with their checkpoints, the jobs that
    had not started do not start, and the sweep exits 143. The jobs ran on to their end, or
    were killed with the pool."""
    output, _, _ = _stopped_sweep(
        tmp_path,
        "hydra.launcher.n_jobs=2",
        "precision=o0,o2_bf16",
        "trainer.seed=1,2",
        signum=signal.SIGTERM,
        group=False,
    )
    assert "2 job(s) stopped with a checkpoint" in output and "2 not started" in output
    assert output.count("not started: the sweep was stopped (SIGTERM)") == 2


@pytest.mark.slow
def test_ctrl_c_ends_an_optuna_study_on_joblib_killed(tmp_path):
    """Under Optuna the stopped jobs are failed trials (a NaN objective crashed its study), the
    sweeper raises on them, and that error is the interruption: exit 130, the parent KILLED. It
    printed Optuna's traceback and ended the parent FAILED with exit 1."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install '.[dev]'")
    output, _, children = _stopped_sweep(
        tmp_path,
        "hydra/sweeper=optuna",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.direction=maximize",
        "optimizer.lr=choice(0.05,0.02)",
        "hydra.launcher.n_jobs=2",
        signum=signal.SIGINT,
    )
    assert "Sweep stopped by SIGINT: 2 job(s) stopped with a checkpoint" in output
    assert "To go on: the same command with resume=auto hydra.sweep.dir=" in output
    assert sorted(children) == ["tiny-O0 trial 0", "tiny-O0 trial 1"]  # no trial after the stop


@pytest.mark.slow
def test_ctrl_c_stops_the_jobs_of_submitits_local_launcher_with_their_checkpoints(tmp_path):
    """Each job (a process of submitit's) stops after its step with its checkpoint and returns;
    the sweep ends KILLED with 130. A job that raised the interruption left submitit no result:
    the sweep failed on submitit's UncompletedJobError, with its traceback, FAILED with 1. And
    the Ctrl-C ended the controller process submitit runs each job under (its traceback), which
    killed its job a second later, often before the checkpoint; the sweep, seeing the job's
    controller gone, exited while the job was still running."""
    output, _, children = _stopped_sweep(
        tmp_path,
        "precision=o0,o2_bf16",
        "trainer.num_workers=2",
        signum=signal.SIGINT,
        launcher="submitit_local",
    )
    assert sorted(children) == ["tiny-O0", "tiny-O2-bf16"]
    assert "UncompletedJobError" not in output
    assert "Sweep stopped by SIGINT: 2 job(s) stopped with a checkpoint" in output


@pytest.mark.slow
def test_a_submitit_job_at_its_time_limit_checkpoints_is_requeued_and_continues(tmp_path):
    """submitit's time-limit and preemption signal (SIGUSR2: SLURM sends it `signal_delay_s`
    before the limit; submitit's local controller too) reaches a job: its run stops after the
    step with its checkpoint, submitit requeues the job, and the job continues the same run from
    there to its end. submitit's own handler ran inside the training loop: the run FAILED with
    no checkpoint and each requeue started the job afresh, until submitit gave up (four FAILED
    runs for one job, seen with `timeout_min=1`)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[dev]'")
    from tests.helpers.held_data import HELD, HELD_RUN, hold_in_step

    # the job is held by its dataset in its sixth step (tests.helpers.held_data), signalled
    # there, then let go; the requeued job (the file made) trains through (it was an epoch of
    # 20,000 samples signalled 1 s in)
    release = tmp_path / "release"
    proc = start_cli(
        "-m",
        *HELD_RUN,  # 20 steps
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra/launcher=submitit_local",
        cwd=tmp_path,
        env=hold_in_step(6, release),
    )
    logs = tmp_path / "sweep" / ".submitit"
    deadline = time.monotonic() + 240
    while not any(HELD in f.read_text() for f in logs.rglob("*_log.out")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    (job,) = [int(p.name) for p in (tmp_path / "sweep" / ".amp-runner-workers").iterdir()]
    os.kill(job, signal.SIGUSR2)
    release.touch()
    output, _ = proc.communicate(timeout=300)
    job_log = "".join(f.read_text() for f in logs.rglob("*_log.out"))
    assert proc.returncode == 0, output[-3000:] + job_log[-3000:]
    assert "Requeued job" in job_log and "Sweep job #0 resumes its run" in job_log, job_log
    client, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (child,) = children.values()  # one run, continued
    assert child.info.status == parent.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(child.info.run_id, "train_loss")]
    # every logged step, to the end, none twice: the first, every second, and the step the
    # signal stopped the first session at (its loss kept with its checkpoint)
    logged = [1, *range(2, 21, 2)]
    assert len(steps) == len(set(steps)) and set(logged) <= set(steps), steps
    (stopped,) = set(steps) - set(logged) or {None}
    assert stopped is None or 2 < stopped < 20, steps


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie that nobody reaps has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_the_workers_of_a_killed_sweep_stop_their_jobs_and_exit(tmp_path):
    """The sweep's process killed outright (SIGKILL: the OOM killer, `kill -9`) ends nothing
    else: each joblib worker stops its job after its step with a checkpoint (KILLED, for
    resume=auto) and exits. They trained on as orphans (a RUNNING run that resume=auto would
    start a second time beside it), then idled, holding their memory, for hours."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install '.[dev]'")
    proc = _long_sweep(
        tmp_path,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "precision=o0,o2_bf16",
        new_session=True,
    )
    seen = read_until(proc, "MLflow run '") + read_until(proc, "MLflow run '")
    time.sleep(4)  # (past the runs' first steps)
    workers = [int(p.name) for p in (tmp_path / "sweep" / ".amp-runner-workers").iterdir()]
    assert len(workers) == 2, "".join(seen)
    proc.kill()
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.append(proc.stdout.read()), daemon=True)
    drain.start()  # (the workers write to the same pipe)
    deadline = time.monotonic() + 120
    while any(_alive(w) for w in workers):
        assert time.monotonic() < deadline, f"workers still running: {workers}"
        time.sleep(0.5)
    drain.join(timeout=10)
    output = "".join(seen + rest)
    assert output.count("The sweep's process") == 2, output[-3000:]
    _, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert {n: c.info.status for n, c in children.items()} == {
        "tiny-O0": "KILLED",
        "tiny-O2-bf16": "KILLED",
    }
    assert len(list(tmp_path.rglob("last.pt"))) == 2
    assert parent.info.status == "RUNNING"  # (its process is gone: the next start reaps it)


def _stopped_job(signum: int) -> None:
    """A sweep job that a signal stopped after its checkpoint, as runner.run.app raises it."""
    from runner.run.interrupts import RunInterrupted

    raise RunInterrupted(signum, "/ck/last.pt")


def test_a_jobs_interruption_reaches_a_joblib_sweep_whole():
    """A job that Ctrl-C stopped raises RunInterrupted in its loky worker; joblib pickles it back
    to the sweep, which marks its parent KILLED and exits with its exit code. The error did not
    survive the trip (its constructor takes a signal number): the sweep crashed with
    BrokenProcessPool and its parent was FAILED."""
    joblib = pytest.importorskip("joblib")
    from runner.run.interrupts import RunInterrupted

    with pytest.raises(RunInterrupted) as info:
        joblib.Parallel(n_jobs=2, backend="loky")(
            joblib.delayed(_stopped_job)(signal.SIGINT) for _ in range(2)
        )
    assert info.value.exit_code == 130 and "checkpoint /ck/last.pt" in str(info.value)


# ---- in this process, through the CLI ------------------------------------------------------------
def test_jobs_in_one_process_do_not_leak_into_each_other(tmp_path):
    """Two identical jobs run one after the other in this process give identical results: seeds,
    memory statistics and the tracking state are reset for each."""
    uri = f"sqlite:///{tmp_path / 'same.db'}"
    status = run_in_process(
        "-m", *FAST, "trainer.seed=3", "mlflow.run_name=first,second", f"mlflow.tracking_uri={uri}"
    )
    assert status == 0
    client, parent, children = sweep_tree(uri)
    assert sorted(children) == ["first", "second"] and parent.info.run_name == (
        "sweep mlflow.run_name=first,second"
    )

    def history(name, metric):
        return [m.value for m in client.get_metric_history(children[name].info.run_id, metric)]

    for metric in ["train_loss", "val_loss", "val_acc"]:
        assert history("first", metric) == history("second", metric), metric
    import mlflow

    assert mlflow.active_run() is None


def test_jobs_are_named_by_the_values_that_vary_and_the_report_lists_failed_ones(tmp_path):
    """An lr x seed sweep: each child is `<model>-<level>` and its own values of the swept keys
    (short key names), its checkpoints in a folder of that name; the two lrs that diverge fail,
    and the report's list of runs that did not finish names them with their run ids."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "ckpt"
    status = run_in_process(
        "-m",
        *FAST,
        "trainer.max_epochs=1",
        "scheduler=none",
        "trainer.max_bad_steps=1",
        "optimizer.lr=0.05,1e30",
        "trainer.seed=1,2",
        f"trainer.checkpoint_dir={folder}",
        f"mlflow.tracking_uri={uri}",
    )
    assert status == 1  # two jobs failed
    _, parent, children = sweep_tree(uri)
    # (the values as Hydra gives them to the jobs: 1e30 is 1e+30)
    names = [f"tiny-O0 lr={lr} seed={seed}" for lr in ("0.05", "1e+30") for seed in (1, 2)]
    assert sorted(children) == names
    finished, failed = names[:2], names[2:]
    assert all(children[n].info.status == "FINISHED" for n in finished)
    assert all(children[n].info.status == "FAILED" for n in failed)
    assert set(parent.data.tags["sweep.failed_jobs"].split("; ")) == {
        f"{n} (FAILED)" for n in failed
    }
    saved = sorted(p.name for p in (folder / "amp-runner").iterdir())
    assert saved == ["tiny-O0_lr=0.05_seed=1", "tiny-O0_lr=0.05_seed=2"]
    for name in finished:
        assert (
            folder / "amp-runner" / name.replace(" ", "_") / children[name].info.run_id
        ).is_dir()

    from runner.report.cli import main as report_main

    assert report_main(["--tracking-uri", uri, "--out", str(tmp_path / "report")]) == 0
    markdown = (tmp_path / "report" / "comparison.md").read_text()
    listed = markdown.split("Runs that did not finish:")[1]
    for name in failed:
        run_id = children[name].info.run_id
        assert f"- {name} (run {run_id}, FAILED): DivergenceError: training diverged" in listed
    assert all(f"| {name} |" in markdown for name in names)  # the rows the list refers to


@pytest.mark.parametrize(
    "sweep,needles",
    [
        (
            "optimizer.lr=0.1,-1",
            ["optimizer.lr: got -1.0 (in sweep job #1:", "a finite number > 0"],
        ),
        (
            "trainer.max_epoch=1,2",
            ["sweep job #0 (", "trainer.max_epoch: unknown key; did you mean trainer.max_epochs?"],
        ),
        (  # a key submitit's local executor does not take (SLURM's executor does)
            "hydra/launcher=submitit_local +hydra.launcher.signal_delay_s=45 precision=o0,o1",
            [
                "hydra.launcher.signal_delay_s: submitit's 'local' executor has no such ",
                "(allowed: cpus_per_task, gpus_per_node, max_num_timeout,",
            ],
        ),
        pytest.param(  # SLURM's launcher where there is no SLURM (its traceback, a parent run)
            "hydra/launcher=slurm precision=o0,o1",
            [
                "hydra/launcher: submitit's 'slurm' executor cannot run on this machine (its "
                "command, srun, is not on the PATH",
                "(allowed: here: hydra/launcher=submitit_local",
            ],
            marks=pytest.mark.skipif(shutil.which("srun") is not None, reason="SLURM is here"),
        ),
    ],
    ids=["bad-value", "typo-key", "launcher-key", "slurm-absent"],
)
def test_bad_input_in_any_job_stops_the_sweep_before_it_starts(sweep, needles, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'never.db'}"
    folder = f"hydra.sweep.dir={tmp_path / 'multirun'}/${{now:%H-%M-%S}}"
    status = run_in_process("-m", *FAST, *sweep.split(), f"mlflow.tracking_uri={uri}", folder)
    assert status == 2
    output = "".join(capsys.readouterr())
    assert all(needle in output for needle in needles), output[-2000:]
    assert "Traceback" not in output and "UserWarning" not in output
    assert not (tmp_path / "never.db").exists()  # no store, no parent, no job ran
    assert not (tmp_path / "multirun").exists()  # nor the sweep's folder


def test_the_tracking_store_cannot_be_swept(tmp_path, capsys):
    a, b = (f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db"))
    assert run_in_process("-m", *FAST, f"mlflow.tracking_uri={a},{b}") == 2
    assert "mlflow.tracking_uri: a sweep's jobs log to their parent run's store" in "".join(
        capsys.readouterr()
    )


def test_a_job_failing_before_its_run_exists_is_still_recorded(tmp_path):
    """A dataset that cannot be read fails the job before its MLflow run is created (the files are
    all there, as the plan checks, but damaged): the sweep records a FAILED child with the error,
    ends the parent with the failure counted, and exits 1."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    other = [o for o in FAST if not o.startswith("data")]
    damaged = tmp_path / "damaged" / "cifar-10-batches-py"
    damaged.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (damaged / name).write_bytes(b"not a pickle")
    status = run_in_process(
        "-m",
        *other,
        "data=cifar10",
        "data.download=false",
        f"data.root={damaged.parent}",
        "precision=o0,o2",
        f"mlflow.tracking_uri={uri}",
    )
    assert status == 1
    _, parent, children = sweep_tree(uri)
    assert sorted(children) == ["tiny-O0", "tiny-O2"]
    for child in children.values():
        assert child.info.status == "FAILED"
        assert (
            child.data.tags["error"].startswith("DataError:")
            and "data.root" in child.data.tags["error"]
        )
    assert parent.info.status == "FINISHED" and parent.data.metrics["failed_jobs"] == 2


def test_ctrl_c_during_a_sweep_marks_the_job_and_the_parent_killed(tmp_path, capfd):
    """The default launcher's jobs run in the sweep's process: a Ctrl-C stops the job after its
    step, ends the parent KILLED and says, as for parallel jobs, which job stopped and the
    command that goes on (it said the job's "resume=auto continues", which without the sweep's
    folder starts a new sweep)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)

    def interrupt_once_a_job_trains():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                exp = client.get_experiment_by_name("amp-runner")
                running = exp and client.search_runs(
                    [exp.experiment_id],
                    filter_string=(
                        f"attributes.status = 'RUNNING' and tags.`{PARENT_RUN_TAG}` != ''"
                    ),
                )
            except MlflowException:
                running = None  # the store is being created
            if running:
                time.sleep(1.0)
                _thread.interrupt_main()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=interrupt_once_a_job_trains, daemon=True)
    watcher.start()
    status = run_in_process(
        "-m",
        *FAST,
        "data.num_train=100000",
        "trainer.max_epochs=1",
        "precision=o0,o1",
        f"mlflow.tracking_uri={uri}",
    )
    watcher.join(timeout=5)
    assert status == 130
    _, parent, children = sweep_tree(uri)
    assert list(children) == ["tiny-O0"]  # the sweep stopped: the second job never started
    assert children["tiny-O0"].info.status == "KILLED"
    assert parent.info.status == "KILLED" and "interrupted" in parent.data.tags["error"]
    told = "".join(capfd.readouterr())
    said = re.search(
        r"Sweep stopped by SIGINT: 1 job\(s\) stopped with a checkpoint \(tiny-O0\), 0 finished, "
        r"1 not started\. To go on: the same command with resume=auto hydra\.sweep\.dir=(\S+)\n",
        told,
    )
    assert said is not None, told[-3000:]
    assert (tmp_path / said[1]).resolve() == Path(parent.data.tags["sweep.dir"]).resolve()
    assert "Interrupted:" not in told


# ---- building blocks -----------------------------------------------------------------------------
def test_parallel_launcher_runs_one_job_per_gpu_or_one_on_cpu():
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install '.[joblib]'")
    import torch

    cfg = compose_config("hydra/launcher=parallel", return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher")
    assert cfg.hydra.launcher.n_jobs == max(1, torch.cuda.device_count())
    assert (
        compose_config(
            "hydra/launcher=parallel", "hydra.launcher.n_jobs=3", return_hydra_config=True
        ).hydra.launcher.n_jobs
        == 3
    )


@pytest.mark.parametrize("launcher", ["slurm", "submitit_slurm", "submitit_local"])
def test_submitits_launchers_keys_are_checked_against_submitit(launcher):
    """Each submitit launcher as shipped passes the check (no key of it is refused); a key its
    executor does not take is refused by name, one it takes (beyond Hydra's own keys) is not."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[slurm]'")
    from runner.errors import ConfigError
    from runner.sweep.preflight import check_launcher

    def passes(cfg) -> None:  # (SLURM's launchers, where SLURM is not here: that refusal only)
        try:
            check_launcher(cfg)
        except ConfigError as refused:
            if refused.key != "hydra/launcher" or shutil.which("srun") is not None:
                raise

    passes(compose_config(f"hydra/launcher={launcher}", return_hydra_config=True))
    for key, slurm_takes_it in (
        ("+hydra.launcher.mail_user", True),
        ("+hydra.launcher.gpu", False),
    ):
        cfg = compose_config(f"hydra/launcher={launcher}", f"{key}=x", return_hydra_config=True)
        if slurm_takes_it and launcher != "submitit_local":
            passes(cfg)
            continue
        with pytest.raises(ConfigError, match=f"^{key[1:]}: submitit's '(slurm|local)' executor"):
            check_launcher(cfg)


def test_each_parallel_job_gets_a_gpu_of_its_own(tmp_path):
    first, second = claim_gpu(tmp_path, 2), claim_gpu(tmp_path, 2)
    assert first[0] == 0 and second[0] == 1
    assert claim_gpu(tmp_path, 2) is None  # both taken: the caller warns and shares
    first[1].close()  # a job ended
    third = claim_gpu(tmp_path, 2)
    assert third[0] == 0
    second[1].close()
    third[1].close()


def test_a_locked_store_is_retried_and_other_errors_are_not():
    calls = []

    def locked_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise MlflowException("(sqlite3.OperationalError) database is locked")
        return "written"

    assert retry_when_locked(locked_twice) == "written" and len(calls) == 3

    def broken():
        calls.append(1)
        raise MlflowException("RESOURCE_DOES_NOT_EXIST: no such run")

    calls.clear()
    with pytest.raises(MlflowException, match="no such run"):
        retry_when_locked(broken)
    assert len(calls) == 1


# ---- a sweep that is killed, then continued -----------------------------------------------------
@pytest.mark.slow
def test_a_killed_sweep_continues_with_resume_auto(tmp_path):
    """A 3-job sweep SIGKILLed during job #1 (after its epoch-1 checkpoint) and run again with
    resume=auto in the same folder: one parent (the same run), 3 FINISHED children: job #0 kept
    (not run again), job #1 resumed in its own run from its checkpoint, job #2 run; a changed
    sweep in that folder is refused before anything runs."""
    import signal

    from tests.helpers.runs import read_until, start_cli

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = [
        *FAST,
        "data.num_train=1536",
        "trainer.max_epochs=3",
        "trainer.log_every_n_steps=8",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "trainer.device=cpu",
    ]
    proc = start_cli("-m", *sweep, "trainer.seed=1,2,3", cwd=tmp_path)
    seen = read_until(proc, "(after epoch 1)")  # job #0's first checkpoint
    seen += read_until(proc, "(after epoch 1)")  # job #1's
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("amp-runner").experiment_id
    before = {r.data.tags.get("sweep.job_num"): r for r in client.search_runs([experiment])}
    assert sorted(k for k in before if k is not None) == ["0", "1"], "".join(seen)[-3000:]
    assert before["0"].info.status == "FINISHED" and before["1"].info.status == "RUNNING"
    parent_id = before[None].info.run_id

    result = run_cli("-m", *sweep, "trainer.seed=1,2,3", "resume=auto", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Sweep job #0 finished in an earlier session" in output
    assert f"Sweep job #1 resumes its run {before['1'].info.run_id}" in output
    runs = client.search_runs([experiment])
    assert len(runs) == 4  # no duplicate: one parent, a child per job
    _, parent, _ = sweep_tree(uri)
    assert parent.info.run_id == parent_id and parent.info.status == "FINISHED"
    assert parent.data.metrics["jobs"] == 3 and parent.data.metrics["failed_jobs"] == 0
    children = {r.data.tags["sweep.job_num"]: r for r in runs if r.info.run_id != parent_id}
    assert all(c.info.status == "FINISHED" for c in children.values())
    # each job named by its seed, its checkpoints in a folder of that name: found again
    assert [children[j].info.run_name for j in "012"] == [f"tiny-O0 seed={s}" for s in (1, 2, 3)]
    resumed = tmp_path / "checkpoints" / "amp-runner" / "tiny-O0_seed=2" / before["1"].info.run_id
    assert (resumed / "last.pt").is_file()
    assert children["0"].info.end_time == before["0"].info.end_time  # kept as it was
    assert children["1"].info.run_id == before["1"].info.run_id
    assert children["1"].data.tags["resume.count"] == "1"
    assert [m.step for m in client.get_metric_history(children["1"].info.run_id, "val_acc")] == [
        1,
        2,
        3,
    ]
    assert "resume.count" not in children["2"].data.tags

    changed = run_cli("-m", *sweep, "trainer.seed=1,2,4", "resume=auto", cwd=tmp_path)
    text = changed.stdout + changed.stderr
    assert changed.returncode == 2, text[-3000:]
    assert "resume: the sweep in" in text and "+trainer.seed=1,2,4" in text
    assert "Traceback" not in text
    assert len(client.search_runs([experiment])) == 4
