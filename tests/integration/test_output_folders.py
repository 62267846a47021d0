"""Launches started together get folders of their own (runner.run.output_folder): Hydra names
them by the second, so two runs or sweeps started in the same second shared one. A folder named
by the time is given here by the year (`${now:%Y}`), so that the launches always meet (by the
day, a test that ran across midnight put its launches in two folders)."""

from __future__ import annotations

import datetime
import os
import signal

import pytest

from tests.helpers.runs import FAST, read_until, run_cli, run_in_process, start_cli
from tests.integration.test_sweep_run_trees import sweep_tree

BY_THE_YEAR = "${now:%Y}"


def _this_year() -> str:
    return str(datetime.date.today().year)


@pytest.mark.slow
def test_two_sweeps_started_together_each_get_a_folder_and_a_parent(tmp_path):
    """Two sweeps of two jobs, started at once into a folder named by the time: each has its
    own folder and its own parent run with its two children. They shared one folder, and the
    second sweep's jobs found the first one's parent: one parent of three children, one of one."""
    sweeps = [
        start_cli(
            "-m",
            *FAST,
            "trainer.max_epochs=1",
            "precision=o0,o2_bf16",
            f"trainer.seed={seed}",
            f"hydra.sweep.dir=multirun/{BY_THE_YEAR}",
            f"mlflow.sweep_name=seed {seed}",
            cwd=tmp_path,
        )
        for seed in (1, 2)
    ]
    outputs = [sweep.communicate(timeout=600)[0] for sweep in sweeps]
    assert [sweep.returncode for sweep in sweeps] == [0, 0], outputs
    year = tmp_path / "multirun" / _this_year()
    folders = {year, year.with_name(year.name + "-1")}
    assert {p for p in year.parent.iterdir()} == folders
    assert sum("is taken (a launch in the same second)" in out for out in outputs) == 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("amp-runner")
    runs = client.search_runs([experiment.experiment_id])
    parents = {r.info.run_id: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert sorted(p.info.run_name for p in parents.values()) == ["seed 1", "seed 2"]
    for parent in parents.values():
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        seed = parent.info.run_name.split()[1]
        assert len(children) == 2 and all(c.data.params["trainer.seed"] == seed for c in children)
    for folder in folders:  # each job's log holds its own run alone
        logs = [(folder / str(job) / "runner.log").read_text() for job in (0, 1)]
        assert all(log.count("MLflow run '") == 1 for log in logs), logs


def test_two_runs_in_a_folder_named_by_the_time_do_not_share_it(tmp_path, monkeypatch):
    """A run whose folder, named by the time, exists already (a run of the same second) takes
    the next free name: each run's runner.log, attached to its record, holds that run alone."""
    monkeypatch.chdir(tmp_path)
    args = [*FAST, "trainer.max_epochs=1", f"hydra.run.dir=outputs/{BY_THE_YEAR}"]
    assert run_in_process(*args, "trainer.seed=1") == 0
    assert run_in_process(*args, "trainer.seed=2") == 0
    year = tmp_path / "outputs" / _this_year()
    logs = [(year / "runner.log").read_text(), (year.parent / f"{year.name}-1" / "runner.log")]
    assert logs[0].count("MLflow run '") == 1
    assert logs[1].read_text().count("MLflow run '") == 1


@pytest.mark.slow
def test_a_sweep_into_the_folder_of_a_running_sweep_stops_before_it_starts(tmp_path):
    """A folder the user names is theirs to reuse (resume=auto does), but not by two sweeps at
    once: the second (the same command twice, a resume while the first still runs) exits 2 with
    what to do, creating no run; it shared the first one's parent and ran its jobs again."""
    folder = tmp_path / "sweep"
    first = start_cli(
        "-m",
        *[o for o in FAST if not o.startswith("trainer.max_epochs")],
        "data.num_train=100000",
        "trainer.max_epochs=1",
        "precision=o0,o2_bf16",
        f"hydra.sweep.dir={folder}",
        cwd=tmp_path,
        new_session=True,
    )
    try:
        seen = read_until(first, "MLflow run '")
        second = run_cli("-m", *FAST, "precision=o0", f"hydra.sweep.dir={folder}", cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-3000:]
        message = second.stdout + second.stderr
        assert f"hydra.sweep.dir: {folder} is in use by a sweep that is running" in message
        assert "give this sweep a folder of its own" in message and "Traceback" not in message
        _, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert len(children) == 1 and parent.info.status == "RUNNING", "".join(seen)
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=240)
    assert first.returncode == 130


def test_a_sweep_that_does_not_start_leaves_its_folder_free(tmp_path, monkeypatch, capsys):
    """A sweep refused after it took its folder's lock (here `resume=auto` with other
    overrides than the sweep it would continue) lets go of it: the right command, in the same
    process, then runs there. The lock stayed held until the process ended: 'in use'."""
    monkeypatch.chdir(tmp_path)
    args = ["-m", *FAST, "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    assert run_in_process(*args, "precision=o0") == 0
    assert run_in_process(*args, "precision=o0,o2_bf16", "resume=auto") == 2
    assert "was run with other overrides" in "".join(capsys.readouterr())
    assert run_in_process(*args, "precision=o0", "resume=auto") == 0
    told = "".join(capsys.readouterr())
    assert "is in use" not in told and "Sweep finished: 1 job, none failed." in told


def test_a_sweep_with_a_space_in_a_value_resumes(tmp_path, monkeypatch, capsys):
    """An override whose value holds a space (a path such as `data.root='/data/my set'`) stays
    one override in the parent's `sweep.overrides` tag, so `resume=auto` with the same command
    continues the sweep. The tag's words were joined with spaces and read back split in two:
    the sweep was refused as run with other overrides."""
    import shlex

    monkeypatch.chdir(tmp_path)
    args = ["-m", *FAST, "trainer.max_epochs=1", "precision=o0"]
    args += ["+mlflow.tags.note='a b'", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    assert run_in_process(*args) == 0
    capsys.readouterr()
    assert run_in_process(*args, "resume=auto") == 0
    told = "".join(capsys.readouterr())
    assert "other overrides" not in told and "Resuming the sweep of" in told, told
    _, parent, children = sweep_tree(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(children) == 1
    assert "+mlflow.tags.note='a b'" in shlex.split(parent.data.tags["sweep.overrides"])


def _attached(tmp_path, name: str) -> dict[str, str]:
    """Each run's attached log `name` (under logs/), by run id; a run without one is left out."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("amp-runner")
    logs = {}
    for run in client.search_runs([experiment.experiment_id]):
        paths = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
        if f"logs/{name}" in paths:
            local = client.download_artifacts(run.info.run_id, f"logs/{name}", str(tmp_path))
            logs[run.info.run_id] = open(local).read()
    return logs


def test_runs_in_a_folder_named_outright_each_attach_their_own_lines(tmp_path, monkeypatch):
    """A folder the user names is theirs to run in again: its runner.log holds each run's lines
    in turn, and each MLflow run is attached its own, not those of the runs before it."""
    monkeypatch.chdir(tmp_path)
    args = [*FAST, "trainer.max_epochs=1", "hydra.run.dir=out"]
    for seed in (1, 2, 3):
        assert run_in_process(*args, f"trainer.seed={seed}") == 0
    assert (tmp_path / "out" / "runner.log").read_text().count("MLflow run '") == 3
    logs = _attached(tmp_path, "runner.log")
    assert len(logs) == 3
    for run_id, text in logs.items():
        assert text.count("MLflow run '") == 1 and f"({run_id})" in text, text
        assert text.startswith("[") and "Precision (Apex O0, resolved)" in text


def test_a_job_log_of_another_name_is_attached_under_its_name(tmp_path, monkeypatch):
    """Hydra names the job's log after `hydra.job.name` (`runner.log` by default): the run is
    attached the log Hydra writes, whatever its name; it was attached nothing."""
    monkeypatch.chdir(tmp_path)
    assert run_in_process(*FAST, "trainer.max_epochs=1", "hydra.job.name=exp") == 0
    [text] = _attached(tmp_path, "exp.log").values()
    assert text.count("MLflow run '") == 1 and "epoch 1/1:" in text


def test_a_resumed_run_keeps_the_log_of_each_session(tmp_path, monkeypatch):
    """A resumed run, in a folder of its own (Hydra's, by the time) or in the folder of its
    first session, adds its session's log beside the first's: it replaced it, and the first
    session's lines were lost from the record where the resume ran in another folder."""
    monkeypatch.chdir(tmp_path)
    args = [*FAST, "mlflow.run_name=long"]
    assert run_in_process(*args, "trainer.max_epochs=1", "hydra.run.dir=first") == 0
    assert run_in_process(*args, "trainer.max_epochs=2", "resume=auto") == 0
    assert run_in_process(*args, "trainer.max_epochs=3", "resume=auto", "hydra.run.dir=first") == 0
    [(run_id, first)] = _attached(tmp_path, "runner.log").items()
    assert _attached(tmp_path, "runner.resume-1.log").keys() == {run_id}
    second = _attached(tmp_path, "runner.resume-1.log")[run_id]
    third = _attached(tmp_path, "runner.resume-2.log")[run_id]
    assert "epoch 1/1:" in first and "epoch 2/2:" not in first
    assert "epoch 2/2:" in second and "epoch 1/1:" not in second and "epoch 3/3" not in second
    assert "epoch 3/3:" in third and "epoch 1/1:" not in third, third
    assert all(text.count(f"({run_id})") == 1 for text in (first, second, third))


@pytest.mark.parametrize("sweep", [False, True])
@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_launch_into_its_output_folder_is_refused_before_it_starts(
    sweep, tmp_path, monkeypatch, capsys
):
    """`hydra.job.chdir=true` ran each job in its output folder, where the relative store opened
    a database of its own: a sweep's children went there, and its parent, in the launch folder,
    ended with none ("Sweep finished: 0 jobs"). Refused, naming the key, before any folder,
    store or run exists."""
    monkeypatch.chdir(tmp_path)
    args = [*FAST, "trainer.max_epochs=1", "hydra.job.chdir=true"]
    args = ["-m", *args, "precision=o0,o2_bf16"] if sweep else args
    assert run_in_process(*args) == 2
    told = "".join(capsys.readouterr())
    assert "hydra.job.chdir: true is not supported" in told and "Traceback" not in told
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sweep", [False, True])
@pytest.mark.parametrize("where", ["taken/run", "/proc/amp-runner-output"])
@pytest.mark.new_store  # checks that nothing, no store, is created
def test_an_output_folder_that_cannot_be_made_is_refused_naming_its_key(
    sweep, where, tmp_path, monkeypatch, capsys
):
    """An output folder behind a file (or where nothing can be made, /proc) ended in Hydra's
    report, exit 1 (a sweep: after every job was checked, with a callback's warning). Refused
    with exit 2, naming hydra.run.dir or hydra.sweep.dir, before any store or run exists."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file, not a folder")
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    args = [*FAST, "trainer.max_epochs=1", f"{key}={where}"]
    args = ["-m", *args, "precision=o0,o2_bf16"] if sweep else args
    assert run_in_process(*args) == 2
    told = "".join(capsys.readouterr())
    assert f"{key}: " in told and "a folder you can write" in told and "Traceback" not in told
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("sweep", [False, True])
@pytest.mark.new_store  # checks that nothing, no store, is created
def test_an_output_folder_under_a_tilde_is_refused_with_the_full_path(
    sweep, tmp_path, monkeypatch, capsys
):
    """`"hydra.run.dir='~/runs'"` (quoted: Hydra's grammar refuses a bare `~`): Hydra does not
    expand the `~` and made a folder named `~` in the launch folder, one the shell's `rm -r ~`
    does not remove. Refused (exit 2), saying the full path, before anything is made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    args = [*FAST, "trainer.max_epochs=1", f"{key}='~/runs'"]
    args = ["-m", *args, "precision=o0,o2_bf16"] if sweep else args
    assert run_in_process(*args) == 2
    told = "".join(capsys.readouterr())
    assert f"{key}: ~/runs starts with '~', which Hydra does not expand" in told, told
    assert f"(allowed: the full path, e.g. {key}={tmp_path / 'home' / 'runs'})" in told
    assert list(tmp_path.iterdir()) == []


@pytest.mark.new_store
def test_a_store_under_a_tilde_is_in_the_home(tmp_path, monkeypatch):
    """`"mlflow.tracking_uri='sqlite:///~/runs.db'"`: SQLAlchemy took `~` for a folder of the
    launch folder (and made it); the store is the home's, as the runner's other paths are."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    args = [*FAST, "trainer.max_epochs=1", "mlflow.tracking_uri='sqlite:///~/runs.db'"]
    assert run_in_process(*args) == 0
    assert (tmp_path / "home" / "runs.db").is_file() and not (tmp_path / "~").exists()


@pytest.mark.new_store
def test_a_relative_file_store_is_printed_absolute(tmp_path, monkeypatch, capsys):
    """`mlflow.tracking_uri=file:./mlruns` (a folder store, where MLflow is told to take one):
    the printed `mlflow ui` command named `file:./mlruns`, a folder of wherever it is pasted;
    it names the launch folder's now, in a form MLflow reads (a space as %20)."""
    launch = tmp_path / "my runs"
    launch.mkdir()
    monkeypatch.chdir(launch)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert run_in_process(*FAST, "trainer.max_epochs=1", "mlflow.tracking_uri=file:./mlruns") == 0
    told = "".join(capsys.readouterr())
    uri = (launch / "mlruns").as_uri()
    assert f"mlflow ui --backend-store-uri {uri}\n" in told and "%20" in uri
    assert (launch / "mlruns").is_dir()
