"""Checkpoints, resume, interrupts and the divergence guard's checkpoint rule, on CPU with real
runs, real MLflow stores, real checkpoint files and a real SIGTERM to a real subprocess.

Tolerance: none. A resumed run computes exactly what the uninterrupted one computes (same data
order, restored RNG, optimizer, scaler and scheduler state), so parameters and every non-timing
metric are compared bit for bit.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError, DivergenceError
from runner.run import app, checkpoint
from runner.run.build import build
from runner.run.checkpointer import restore_trainer
from runner.run.context import RunContext
from runner.run.interrupts import RunInterrupted, StopRequest
from runner.run.plan import make_plan
from runner.run.trainer import Trainer, trainer_config
from tests.helpers.held_data import (
    BUSY,
    BUSY_AT,
    BUSY_DONE,
    BUSY_S,
    HELD,
    HELD_BATCH,
    HELD_DATA,
    HELD_RUN,
    HOLD_AFTER,
    hold_in_step,
)
from tests.helpers.resume import last_checkpoint, settings, straight_and_resumed
from tests.helpers.runs import compose_config, read_until, run_cli, start_cli
from tests.helpers.store import history, runs_by_name


# ---- resume at an epoch boundary -----------------------------------------------------------------
@pytest.mark.parametrize("level", ["o0", "o2"])
def test_two_epochs_straight_equal_one_then_resume_one_more(tmp_path, level):
    """o2: fp16 model, fp32 masters, dynamic loss scale: the masters, Adam's moments and the
    scaler's state all have to come back exactly."""
    # a schedule that does not depend on max_epochs (the first session's budget is 1 epoch)
    uri = straight_and_resumed(
        tmp_path,
        f"precision={level}",
        "optimizer=adam",
        "optimizer.eps=1e-4",
        "scheduler=step",
        "scheduler.step_epochs=1",
        "scheduler.gamma=0.5",
    )
    runs = runs_by_name(uri)
    assert set(runs) == {"straight", "resumed"}  # the resumed run continued its own MLflow run
    resumed = runs["resumed"]
    assert resumed.info.status == "FINISHED" and resumed.data.tags["resume.count"] == "1"
    assert resumed.data.tags["trainer.max_epochs"] == "2"  # the param stays 1 (immutable)
    assert resumed.data.params["trainer.max_epochs"] == "1"
    got, want = history(uri, resumed.info.run_id), history(uri, runs["straight"].info.run_id)
    # the 1-epoch session ended too and logged its own best_val_acc at step 1: the final value
    # is the one to compare; every per-step and per-epoch metric must be identical
    assert got.pop("best_val_acc")[-1] == want.pop("best_val_acc")[-1]
    assert got == want
    a, b = last_checkpoint(tmp_path, "straight"), last_checkpoint(tmp_path, "resumed")
    assert a["epoch"] == b["epoch"] == 2 and a["global_step"] == b["global_step"]
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["engine"] == b["engine"]  # loss scaler: scale, growth and hysteresis counters


def test_a_grown_budget_stretches_a_step_count_schedule(tmp_path):
    """One-cycle over 1 epoch, resumed to 2: the schedule is rebuilt for 2 epochs at the step
    reached (stepping the old one past its end would raise), so epoch 2's learning rates are a
    2-epoch one-cycle schedule's (each logged at the step that trained with it)."""
    common = settings(tmp_path, "scheduler=onecycle", "trainer.log_every_n_steps=1")
    app.run(compose_config(*common, "trainer.max_epochs=1"))
    app.run(compose_config(*common, "trainer.max_epochs=2", "resume=auto"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "FINISHED"
    lrs = dict(history(uri, run.info.run_id)["lr"])
    steps_per_epoch = 5  # 160 images, batch 32
    ref = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        ref,
        max_lr=0.1,
        total_steps=2 * steps_per_epoch,
        pct_start=0.3,
        div_factor=25.0,
        final_div_factor=1e4,
    )
    want = {}
    for step in range(1, 2 * steps_per_epoch + 1):
        want[step] = ref.param_groups[0]["lr"]  # the rate step `step` trains with
        ref.step()
        sched.step()
    for step in range(steps_per_epoch + 1, 2 * steps_per_epoch + 1):
        assert lrs[step] == pytest.approx(want[step], rel=1e-9), step


def test_checkpoint_holds_the_contract(tmp_path):
    app.run(compose_config(*settings(tmp_path, "precision=o2", "trainer.max_epochs=1")))
    state = last_checkpoint(tmp_path, "tiny-O2")
    assert {
        "model",
        "optimizer",
        "engine",
        "scheduler",
        "epoch",
        "batch",
        "global_step",
        "rng",
        "mlflow_run_id",
        "config",
        "history",
        "best_val_acc",
    } <= set(state)
    assert all(v.dtype != torch.float16 for v in state["model"].values())  # fp32 (masters)
    assert state["engine"]["loss_scaler0"]["loss_scale"] > 0
    assert state["config"]["precision"]["opt_level"] == "O2"
    run = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}")["tiny-O2"]
    assert state["mlflow_run_id"] == run.info.run_id
    folder = checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", "tiny-O2")
    assert checkpoint.find("auto", folder) == folder / run.info.run_id / "last.pt"
    assert not list(folder.rglob("*.tmp"))  # written atomically: no temporary file left


def test_a_new_run_never_overwrites_another_runs_checkpoint(tmp_path):
    cfg = compose_config(*settings(tmp_path, "trainer.max_epochs=1"))
    app.run(cfg)
    first = sorted((tmp_path / "checkpoints").rglob("last.pt"))
    before = first[0].read_bytes()
    app.run(cfg)
    both = sorted((tmp_path / "checkpoints").rglob("last.pt"))
    assert len(both) == 2 and first[0].read_bytes() == before


# ---- what resume refuses -------------------------------------------------------------------------
def test_resume_refuses_a_changed_config_naming_every_key(tmp_path):
    app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=1")))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose_config(
        *settings(
            tmp_path, "trainer.max_epochs=2", "resume=auto", "optimizer.lr=0.05", "trainer.seed=7"
        )
    )
    with pytest.raises(ConfigError) as e:
        app.run(cfg)
    assert e.value.key == "resume"
    assert "optimizer.lr: 0.1 -> 0.05" in str(e.value) and "trainer.seed: 42 -> 7" in str(e.value)
    assert "2 key(s)" in str(e.value)
    shrunk = compose_config(*settings(tmp_path, "trainer.max_epochs=1", "resume=auto"))
    app.run(shrunk)  # the same budget: nothing left to train, it just finishes
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "FINISHED"
    with pytest.raises(ConfigError, match="resume: no checkpoint at"):
        app.run(compose_config(*settings(tmp_path, f"resume={tmp_path / 'nope.pt'}")))


def test_a_folder_above_the_checkpoints_names_them(tmp_path):
    """`resume=checkpoints/amp-runner/tiny-O0` (what `ls` shows: the run name's folder, its run
    id folders below) said only "no checkpoint at ...". The error names the checkpoints below a
    folder, newest first, as `resume=` takes them; `resume=true` (read as 'True') names
    resume=auto. Nothing is reopened or trained."""
    app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=1")))
    (path,) = (tmp_path / "checkpoints").rglob("last.pt")
    for above in (path.parent.parent, tmp_path / "checkpoints"):
        with pytest.raises(ConfigError) as e:
            app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=2", f"resume={above}")))
        assert e.value.key == "resume"
        assert f"the folder holds none of its own, one below it: resume={path.parent}" in str(
            e.value
        )
    assert checkpoint.load(path)["epoch"] == 1  # untouched
    with pytest.raises(ConfigError, match="to continue this run's newest checkpoint, resume=auto"):
        app.run(compose_config(*settings(tmp_path, "resume=true")))
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="nor the three levels of folders below it hold one"):
        app.run(compose_config(*settings(tmp_path, f"resume={tmp_path / 'empty'}")))


def test_a_run_name_too_long_for_a_folder_name_checkpoints_and_resumes(tmp_path):
    """`mlflow.run_name` of 300 characters (or a sweep job's name holding long swept values)
    failed at the first checkpoint, "File name too long", the run FAILED. Its folder keeps the
    name's start and a digest of the whole: two long names alike but at the end keep their own
    folders, and resume=auto finds its own."""
    names = ["x" * 300 + "-a", "x" * 300 + "-b"]
    for name in names:
        app.run(
            compose_config(*settings(tmp_path, "trainer.max_epochs=1", f"mlflow.run_name={name}"))
        )
    folders = sorted((tmp_path / "checkpoints" / "amp-runner").iterdir())
    assert len(folders) == 2 and all(len(f.name) == 255 for f in folders)
    assert all(f.name.startswith("x" * 200) for f in folders)
    resumed = settings(tmp_path, "trainer.max_epochs=2", f"mlflow.run_name={names[0]}")
    app.run(compose_config(*resumed, "resume=auto"))
    epochs = {name: last_checkpoint(tmp_path, name)["epoch"] for name in names}
    assert epochs == {names[0]: 2, names[1]: 1}
    runs = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert {n: r.info.status for n, r in runs.items()} == {n: "FINISHED" for n in names}
    assert runs[names[0]].data.tags["resume.count"] == "1"


def test_names_that_share_a_folder_resume_their_own_checkpoints(tmp_path):
    """`my run` and `my_run` share a checkpoint folder (a folder name takes no space). A first
    `my_run` with resume=auto found `my run`'s checkpoint and was refused ("the config differs
    from the checkpoint's ... mlflow.run_name"): it could not start. Each now starts, and
    resumes, from its own."""
    first, second = "'my run'", "my_run"
    for name in (first, second):
        app.run(
            compose_config(
                *settings(tmp_path, "trainer.max_epochs=1", f"mlflow.run_name={name}"),
                "resume=auto",
            )
        )
    (folder,) = (tmp_path / "checkpoints" / "amp-runner").iterdir()
    assert folder.name == "my_run" and len(list(folder.iterdir())) == 2
    again = settings(tmp_path, "trainer.max_epochs=2", f"mlflow.run_name={first}", "resume=auto")
    app.run(compose_config(*again))  # its own, though my_run's checkpoint is newer
    runs = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert {n: r.info.status for n, r in runs.items()} == {
        "my run": "FINISHED",
        "my_run": "FINISHED",
    }
    assert runs["my run"].data.tags["resume.count"] == "1"
    assert "resume.count" not in runs["my_run"].data.tags
    saved = {p.parent.name: checkpoint.load(p)["epoch"] for p in folder.glob("*/last.pt")}
    assert saved == {runs["my run"].info.run_id: 2, runs["my_run"].info.run_id: 1}
    # a name given where the checkpoint's was the default (or the other way): the same folder by
    # the same name, so the checkpoint is taken, and the difference refused as before
    app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=1")))  # tiny-O0, by default
    named = settings(tmp_path, "trainer.max_epochs=2", "mlflow.run_name=tiny-O0", "resume=auto")
    with pytest.raises(ConfigError, match="mlflow.run_name: None -> 'tiny-O0'"):
        app.run(compose_config(*named))


def test_checkpoints_moved_to_another_disk_resume_from_there(tmp_path):
    """A disk full at a checkpoint: the user moves the checkpoints to a disk with room and
    resumes with trainer.checkpoint_dir set there; it was refused as a changed config
    ("trainer.checkpoint_dir: ... -> ..."), though where checkpoints live trains nothing."""
    app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=1")))
    moved = tmp_path / "bigger-disk"
    (tmp_path / "checkpoints").rename(moved)
    resumed = settings(
        tmp_path, "trainer.max_epochs=2", "resume=auto", f"trainer.checkpoint_dir={moved}"
    )
    app.run(compose_config(*resumed, "trainer.progress_bar=true"))
    (path,) = moved.rglob("last.pt")
    assert checkpoint.load(path)["epoch"] == 2
    (run,) = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}").values()
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"


def test_a_run_another_process_resumes_is_not_resumed_twice(tmp_path):
    """Two `resume=auto` started together both trained the run: every metric logged twice into
    one MLflow run, one checkpoint written by both. The resuming process holds a lock on the
    run's checkpoint folder (here held by this test, as another resumer would): the second is
    refused before the run is reopened, and the run goes on once the lock is free."""
    from runner.files import try_lock

    app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=1")))
    (path,) = (tmp_path / "checkpoints").rglob("last.pt")
    before = path.read_bytes()
    cfg = compose_config(*settings(tmp_path, "trainer.max_epochs=2", "resume=auto"))
    with try_lock(path.parent / checkpoint.folders.RESUMED_LOCK):
        with pytest.raises(ConfigError) as refused:
            app.run(cfg)
    assert refused.value.key == "resume" and "is being resumed by another process" in str(
        refused.value
    )
    assert path.read_bytes() == before
    (run,) = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}").values()
    assert run.info.status == "FINISHED" and "resume.count" not in run.data.tags
    app.run(cfg)  # the other process is done: it resumes
    assert checkpoint.load(path)["epoch"] == 2


@pytest.mark.slow
def test_a_run_whose_first_session_still_trains_is_not_resumed(tmp_path):
    """`resume=auto` while the run's own first session still trains (its epoch-1 checkpoint
    written): refused, naming the live process, instead of a second process training the run.
    The first session is held in epoch 2 by its dataset (tests.helpers.held_data): it was an
    epoch of 30,000 samples, 100 s on a loaded machine."""
    args = [
        "model=tiny",
        *HELD_DATA,
        "+data.num_train=256",
        "trainer.batch_size=32",
        "trainer.max_epochs=3",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
    ]
    first = start_cli(*args, cwd=tmp_path, env={HOLD_AFTER: str(256 + 10)})
    try:
        seen = read_until(first, HELD)
        said = "".join(seen)
        assert HELD in said and "Checkpoint: " in said, said[-3000:]
        with pytest.raises(ConfigError) as refused:
            app.run(compose_config(*args, "resume=auto"))
        said = str(refused.value)
        assert f"is still running (pid {first.pid} on " in said and "heartbeat " in said
    finally:
        first.kill()
        first.wait(timeout=60)


def test_resume_auto_without_a_checkpoint_starts_fresh(tmp_path):
    app.run(compose_config(*settings(tmp_path, "trainer.max_epochs=1", "resume=auto")))
    (run,) = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}").values()
    assert run.info.status == "FINISHED" and "resume.count" not in run.data.tags


# ---- a run stopped mid-epoch continues at its step -----------------------------------------------
@dataclass
class Checkpoints:
    """A trainer's checkpoints outside a run (runner.run.context.Checkpoints): `save(state)`."""

    save: Callable[[dict], str]
    writes: bool = True


def _trainer(cfg, **kw) -> Trainer:
    plan = make_plan(cfg)
    parts = build(plan)
    return Trainer(trainer_config(cfg.trainer), parts, RunContext(**kw), device=plan.device)


@pytest.mark.parametrize("accumulate,stop_at,steps", [(1, 7, 10), (2, 4, 6)])
def test_a_stop_mid_epoch_resumes_at_its_step_exactly(tmp_path, accumulate, stop_at, steps):
    """A stop request (what SIGINT/SIGTERM set) after step 7 of 10 (epoch 2 of 2, batch 2), or
    with two batches a step (5 batches an epoch: steps of 2, 2 and 1) after step 4 of 6 (the
    same batch): the checkpoint says so, and a fresh trainer restored from it ends bit for bit
    where the uninterrupted one does: the skipped batches are the ones already trained on."""
    cfg = compose_config(
        *settings(
            tmp_path,
            "precision=o2",
            "trainer.max_epochs=2",
            "trainer.log_every_n_steps=1",
            f"trainer.accumulate_grad_batches={accumulate}",
        )
    )
    straight = _trainer(cfg, on_metrics=lambda m, s: None)
    straight.fit()

    stop = StopRequest()
    path = tmp_path / "ckpt.pt"

    def sink(metrics, step):
        if step == stop_at and "train_loss" in metrics:
            stop.signum = signal.SIGTERM  # as the signal handler would

    def save(state):
        checkpoint.save(path, state)
        return str(path)

    interrupted = _trainer(cfg, on_metrics=sink, stop=stop, checkpointer=Checkpoints(save))
    with pytest.raises(RunInterrupted) as e:
        interrupted.fit()
    assert e.value.exit_code == 143 and str(path) in str(e.value)
    state = checkpoint.load(path)
    assert (state["epoch"], state["batch"], state["global_step"]) == (1, 2, stop_at)

    resumed = _trainer(cfg, on_metrics=lambda m, s: None)
    restore_trainer(resumed, state)
    resumed.fit()
    assert resumed.global_step == straight.global_step == steps
    for (name, p), q in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(
        straight.engine.master_params(straight.optimizer),
        resumed.engine.master_params(resumed.optimizer),
    ):
        assert torch.equal(p, q)
    assert straight.engine.state_dict() == resumed.engine.state_dict()


# ---- divergence keeps the last good checkpoint ---------------------------------------------------
def test_divergence_keeps_the_last_good_checkpoint(tmp_path):
    cfg = compose_config(
        *settings(tmp_path, "trainer.max_epochs=3", "trainer.max_bad_steps=2", "scheduler=none")
    )
    saved = []

    def save(state):
        saved.append(state["epoch"])
        trainer.optimizer.param_groups[0]["lr"] = 1e30  # epoch 2 blows the weights up
        return "memory"

    trainer = _trainer(cfg, on_metrics=lambda m, s: None, checkpointer=Checkpoints(save))
    with pytest.raises(DivergenceError, match="inf/NaN"):
        trainer.fit()
    assert saved == [1]  # no checkpoint of the diverged state


def test_weights_blown_up_before_the_guard_stops_the_run_are_never_checkpointed(tmp_path):
    """O0 skips no step: with lr=1e30 the weights are inf/NaN from step 2 on, yet the guard
    (trainer.max_bad_steps=8, longer than an epoch of 5 steps) stops the run only in epoch 2. The
    end of epoch 1 must not write those weights; a real run, a real checkpoint folder."""
    cfg = compose_config(
        *settings(
            tmp_path,
            "precision=o0",
            "optimizer.lr=1e30",
            "scheduler=none",
            "trainer.max_bad_steps=8",
            "trainer.max_epochs=4",
            "mlflow.run_name=blown",
        )
    )
    with pytest.raises(DivergenceError, match="inf/NaN"):
        app.run(cfg)
    folder = checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", "blown")
    assert checkpoint.find("auto", folder) is None
    assert runs_by_name(cfg.mlflow.tracking_uri)["blown"].info.status == "FAILED"


def test_a_collapsed_dynamic_loss_scale_stops_the_run(tmp_path):
    """Weights blown up to inf: every step overflows at every scale; the dynamic scale halves
    each time and the run stops once it is below trainer.collapsed_loss_scale (2^-14), before the
    max_bad_steps limit (1000 here) would, and within the epoch (40 steps: its end stops a model
    whose weights are inf anyway)."""
    cfg = compose_config(
        *settings(
            tmp_path,
            "precision=o2",
            "trainer.max_bad_steps=1000",
            "scheduler=none",
            "data.num_train=320",
            "trainer.batch_size=8",
            "trainer.max_epochs=1",
        )
    )
    trainer = _trainer(cfg, on_metrics=lambda m, s: None)
    trainer.optimizer.param_groups[0]["lr"] = 1e30
    with pytest.raises(DivergenceError) as e:
        trainer.fit()
    assert "loss scale collapsed" in str(e.value) and "trainer.collapsed_loss_scale" in str(e.value)
    assert trainer.engine.loss_scale < 2**-14 <= 2 * trainer.engine.loss_scale


# ---- SIGTERM to a real process, then resume=auto -------------------------------------------------
@pytest.mark.slow
def test_sigterm_checkpoints_marks_killed_and_resumes(tmp_path):
    """A SIGTERM while the run trains (held by its dataset in epoch 1's sixth step, then let go:
    tests.helpers.held_data): the run stops after that step with its checkpoint, KILLED, exit
    143; resume=auto with a budget of one epoch finishes that epoch in the same MLflow run, no
    step logged twice. (It was an epoch of 20,000 samples signalled 2 s in.)"""
    release = tmp_path / "release"
    args = [
        *HELD_RUN,  # 20 steps an epoch
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
    ]
    proc = start_cli(*args, cwd=tmp_path, env=hold_in_step(6, release))
    seen = read_until(proc, HELD)
    proc.send_signal(signal.SIGTERM)
    release.touch()
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode == 143, output
    assert "SIGTERM received: stopping after the step in progress, with a checkpoint" in output
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "KILLED"
    assert run.data.tags["error"].startswith("interrupted by SIGTERM; checkpoint ")
    state = last_checkpoint(tmp_path, "tiny-O0")
    assert state["mlflow_run_id"] == run.info.run_id and 0 < state["global_step"] < 20

    resumed = run_cli(*args, "trainer.max_epochs=1", "resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    steps = [m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "train_loss")]
    assert steps == list(range(1, 21))  # one epoch, no step twice, none lost


def _busy_run(tmp_path, step: int, seconds: float, *more: str) -> tuple[list[str], list]:
    """A run of `HELD_RUN` whose step `step` spends about `seconds` inside one long operation
    (tests.helpers.held_data.busy): started, and read up to that operation's start; (the lines
    so far, its arguments)."""
    args = [
        *HELD_RUN,
        "trainer.max_epochs=1",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
        *more,
    ]
    env = {BUSY_AT: str((step - 1) * HELD_BATCH + 1), BUSY_S: str(seconds)}
    proc = start_cli(*args, cwd=tmp_path, env=env)
    return proc, read_until(proc, BUSY)


@pytest.mark.slow
def test_a_sigterm_in_a_slow_step_is_said_at_once_and_the_run_keeps_what_it_measured(tmp_path):
    """A SIGTERM while step 3 is inside one long operation (as a 200-s emulated fp16 step is):
    the run says so as it comes, not when the step ends, in SIGTERM's words; it stops after the
    step with a checkpoint, within 20 s, and its KILLED run holds the loss from the first step
    (not only every log_every_n_steps=50) and the memory by kind."""
    proc, seen = _busy_run(tmp_path, 3, 8.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    said = read_until(proc, "SIGTERM received")
    assert BUSY_DONE not in "".join(said)  # (said while the operation still ran)
    assert "Ctrl-C" in said[-1] and "kill -INT" in said[-1] and "again" not in said[-1]
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen + said) + rest
    assert proc.returncode == 143, output[-3000:]
    assert time.monotonic() - sent < 20, output[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "KILLED"
    losses = MlflowClient(uri).get_metric_history(run.info.run_id, "train_loss")
    stopped = last_checkpoint(tmp_path, "tiny-O0")["global_step"]
    assert [m.step for m in losses] == [1, stopped] and stopped > 1  # (the first read; the stop)
    assert run.data.metrics["mem_weights_mb"] > 0 and "mem_activations_mb" in run.data.metrics


@pytest.mark.slow
def test_a_second_ctrl_c_in_a_slow_step_stops_at_once_and_says_so(tmp_path):
    """Ctrl-C, then Ctrl-C again, while step 3 is inside a long operation: the second stops the
    run at once (not when the operation returns), exit 130, and its run ends KILLED saying it
    was stopped at once, without a checkpoint of that step."""
    proc, seen = _busy_run(tmp_path, 3, 60.0)
    proc.send_signal(signal.SIGINT)
    said = read_until(proc, "Ctrl-C (SIGINT) received")
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    output = "".join(seen + said) + rest
    assert proc.returncode == 130, output[-3000:]
    assert time.monotonic() - sent < 15 and BUSY_DONE not in output, output[-3000:]
    assert "Ctrl-C (SIGINT) again: stopping at once" in output
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "KILLED"
    assert run.data.tags["error"].startswith("stopped at once by a second Ctrl-C (SIGINT)")
    folder = checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", "tiny-O0")
    assert checkpoint.find("auto", folder) is None  # (the step in progress: none written)


def test_resume_auto_of_a_finished_run_says_so_and_changes_nothing(tmp_path, caplog):
    """resume=auto of a run that met its epoch budget: nothing trains, the MLflow run keeps its
    status, tags and metrics (no resume.count bump), the checkpoint is untouched."""
    common = settings(tmp_path, "trainer.max_epochs=1")
    best = app.run(compose_config(*common))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (before,) = runs_by_name(uri).values()
    path = checkpoint.find(
        "auto", checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", before.info.run_name)
    )
    stamp = path.stat().st_mtime_ns
    with caplog.at_level("INFO", logger="runner"):
        again = app.run(compose_config(*common, "resume=auto"))
    assert again == best
    assert "already trained 1 epochs" in caplog.text and "raise trainer.max_epochs" in caplog.text
    (after,) = runs_by_name(uri).values()
    assert after.info.status == before.info.status == "FINISHED"
    assert after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags and after.data.metrics == before.data.metrics
    assert history(uri, after.info.run_id) == history(uri, before.info.run_id)
    assert path.stat().st_mtime_ns == stamp
