"""Runs whose process is gone, and crowds at a new store: real SQLite stores, real processes.

A run killed outright (SIGKILL, the OOM killer, a lost node) cannot end its MLflow run; the next run
or sweep of the experiment ends it KILLED, judging by the run's liveness tags
(runner.tracking.liveness):
on this host by its pid and process start time, elsewhere by its heartbeat. A live run, here or
elsewhere, is never touched. Several processes opening a store that does not exist yet all succeed
(the store is created under a file lock), and a store that cannot be used is one clear error.
"""

from __future__ import annotations

import csv
import fcntl
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import RunnerError
from runner.report.cli import main as report_main
from runner.tracking import job_log
from runner.tracking import tags as tag
from runner.tracking.base import end_state
from runner.tracking.liveness import ProcessIdentity, now_iso, parse_iso, process_state, vanished
from runner.tracking.mlflow_reader import record
from runner.tracking.mlflow_run import MlflowRun
from runner.tracking.mlflow_tracker import MlflowTracker
from tests.helpers.runs import FAST, read_until, run_cli, start_cli

STALE = time.time() - 3600  # an hour ago: older than the default mlflow.stale_after_s (600 s)


def dead_pid() -> int:
    """The pid of a process that has exited (and been waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def fake_run(tracker: MlflowTracker, name: str, **tags: str) -> str:
    """A RUNNING run written straight into the store, as another process would leave it."""
    return tracker.client.create_run(tracker.experiment_id, run_name=name, tags=tags).info.run_id


def elsewhere(beat: float) -> dict[str, str]:
    """Liveness tags of a runner on another host, last heartbeat at `beat`."""
    return {
        tag.HOST: "gpu-node-17",
        tag.PID: "4242",
        tag.PID_START: "123456",
        tag.PID_SPACE: "another-boot:pid:[1]",
        tag.HEARTBEAT: now_iso(beat),
    }


# ---- who a process is ----------------------------------------------------------------------------
def test_the_process_table_tells_this_process_a_dead_one_and_a_reused_pid_apart():
    me = ProcessIdentity.current()
    assert me.host == socket.gethostname() and me.pid == os.getpid()
    assert me.start is not None and me.space is not None  # Linux: /proc
    assert process_state(me.pid, me.start) == "same"
    assert process_state(me.pid, str(int(me.start) + 1)) == "other"  # the pid, another process
    assert process_state(dead_pid(), None) == "gone"
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(zombie.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # killed, not waited for: a zombie, in the process table
    try:
        while process_state(zombie.pid, None) != "gone":
            assert time.monotonic() < deadline, "a killed (zombie) process is taken for alive"
            time.sleep(0.05)
    finally:
        zombie.wait()
    assert ProcessIdentity.from_tags(me.tags()) == me
    assert parse_iso(now_iso(1_700_000_000)) == 1_700_000_000


def test_the_rules_judge_by_pid_here_and_by_heartbeat_elsewhere():
    here = ProcessIdentity.current()
    now = time.time()
    fresh_here = {**here.tags(), tag.HEARTBEAT: now_iso(now)}
    assert vanished(fresh_here, 600, here, now) is None
    # this very process with an hour-old heartbeat (a long stall): alive, by its pid
    assert vanished({**fresh_here, tag.HEARTBEAT: now_iso(STALE)}, 600, here, now) is None
    gone = {**fresh_here, tag.PID: str(dead_pid())}
    assert vanished(gone, 600, here, now) == (
        f"process vanished: no heartbeat since {now_iso(now)} (host {here.host}, "
        f"pid {gone[tag.PID]})"
    )
    assert vanished(elsewhere(now - 60), 600, here, now) is None
    assert vanished(elsewhere(now - 601), 600, here, now).startswith("process vanished")
    # the same host name in another container (another PID namespace): the heartbeat decides
    container = {**fresh_here, tag.PID_SPACE: "other-boot:pid:[7]", tag.PID: "1"}
    assert vanished(container, 600, here, now) is None
    assert vanished({**container, tag.HEARTBEAT: now_iso(STALE)}, 600, here, now) is not None
    # no liveness tags (an older runner, another tool): never judged, however old
    assert vanished({"mlflow.runName": "old"}, 600, here, now) is None
    assert vanished({**elsewhere(now), tag.HEARTBEAT: "yesterday"}, 600, here, now) is None


def test_a_vanished_run_is_said_oom_killed_where_the_machine_counted_a_kill_since(tracking_uri):
    """Every heartbeat records the machine's count of processes the kernel's OOM killer ended
    (/proc/vmstat, readable by anyone): a count grown since a dead run's last heartbeat, on the
    same machine and boot, names the likely cause in its `error` tag."""
    from runner.tracking.liveness import (
        heartbeat_tags,
        oom_killed_since,
        oom_kills,
        vanished_reason,
    )

    count = oom_kills()
    assert isinstance(count, int) and count >= 0  # (Linux 4.13+)
    assert heartbeat_tags()[tag.OOM_KILLS] == str(count)
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    run = tracker.create_run("counted", {})
    assert tracker.client.get_run(run.run_id).data.tags[tag.OOM_KILLS] == str(count)
    run.end("FINISHED")

    here = ProcessIdentity.current()
    dead = {**here.tags(), tag.PID: str(dead_pid()), tag.HEARTBEAT: now_iso(), tag.OOM_KILLS: "5"}
    assert oom_killed_since(dead, here, count=7) == 2
    assert oom_killed_since(dead, here, count=5) == 0
    assert oom_killed_since({**dead, tag.OOM_KILLS: ""}, here, count=7) == 0  # an older runner
    rebooted = {**dead, tag.PID_SPACE: "another-boot:" + here.space.split(":", 1)[1]}
    assert oom_killed_since(rebooted, here, count=7) == 0  # a count of another boot
    assert oom_killed_since(elsewhere(STALE) | {tag.OOM_KILLS: "5"}, here, count=7) == 0
    plain = vanished_reason(dead)
    assert vanished_reason(dead, here, count=5) == plain
    assert vanished_reason(dead, here, count=6) == (
        f"{plain}; the kernel's OOM killer ended 1 process on this machine after that "
        "heartbeat: most likely this one, out of memory"
    )
    assert "ended 3 processes" in vanished_reason(dead, here, count=8)


# ---- reaping, on a real store --------------------------------------------------------------------
def test_reap_ends_only_the_runs_whose_process_is_gone(tracking_uri, caplog):
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    client = MlflowClient(tracking_uri)
    here = ProcessIdentity.current()
    stale_elsewhere = fake_run(tracker, "stale-elsewhere", **elsewhere(STALE))
    fresh_elsewhere = fake_run(tracker, "fresh-elsewhere", **elsewhere(time.time()))
    dead_here = fake_run(
        tracker, "dead-here", **{**here.tags(), tag.PID: str(dead_pid()), tag.HEARTBEAT: now_iso()}
    )
    reused_pid = fake_run(
        tracker,
        "reused-pid",
        **{**here.tags(), tag.HEARTBEAT: now_iso(), tag.PID_START: str(int(here.start) - 1)},
    )
    untagged = fake_run(tracker, "older-runner")
    live = tracker.create_run("live-here", {})  # this process: alive whatever its heartbeat
    client.set_tag(live.run_id, tag.HEARTBEAT, now_iso(STALE))
    finished = fake_run(tracker, "finished", **elsewhere(STALE))
    client.set_terminated(finished, "FINISHED")

    with caplog.at_level(logging.WARNING, logger="runner.tracking"):
        ended = tracker.reap()
    assert sorted(ended) == sorted([stale_elsewhere, dead_here, reused_pid])
    for run_id in ended:
        run = client.get_run(run_id)
        tags = run.data.tags
        assert run.info.status == "KILLED"
        assert tags[tag.ERROR] == (
            f"process vanished: no heartbeat since {tags[tag.HEARTBEAT]} "
            f"(host {tags[tag.HOST]}, pid {tags[tag.PID]})"
        )
        # ended at its last sign of life (never before it started: heartbeats are to the second)
        assert run.info.end_time == max(
            run.info.start_time, int(parse_iso(tags[tag.HEARTBEAT]) * 1000)
        )
        assert end_state(record(run)) == f"KILLED: {tags[tag.ERROR]}"
    lines = [r.getMessage() for r in caplog.records if "as KILLED" in r.getMessage()]
    assert len(lines) == 3 and all("process vanished" in line for line in lines)
    for run_id in (fresh_elsewhere, untagged, live.run_id):
        run = client.get_run(run_id)
        assert run.info.status == "RUNNING" and tag.ERROR not in run.data.tags
    assert client.get_run(finished).info.status == "FINISHED"

    before = {r: client.get_run(r).data.tags for r in ended}
    assert tracker.reap() == []  # a second reaper finds nothing left, and changes nothing
    assert {r: client.get_run(r).data.tags for r in ended} == before
    live.end("FINISHED")


def test_a_run_reopened_after_it_was_judged_is_not_ended(tracking_uri):
    """Two processes at once: one judges a run dead while the other reopens it (resume): the
    reaper re-reads the run before ending it and leaves it alone."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    run_id = fake_run(tracker, "resumed", **elsewhere(STALE))
    (judged,) = tracker.running_runs()
    reason = tracker.vanished(judged)
    assert reason is not None
    reopened = tracker.reopen_run(run_id, {})
    assert tracker.end_vanished(judged, reason) is False
    run = tracker.client.get_run(run_id)
    assert run.info.status == "RUNNING" and tag.ERROR not in run.data.tags
    assert run.data.tags[tag.PID] == str(os.getpid())  # its new owner
    reopened.end("FINISHED")


def test_a_reaped_run_gets_the_part_of_its_job_log_it_wrote(tracking_uri, tmp_path, caplog):
    """A process killed outright cannot attach its log: the reaper attaches the lines its session
    wrote (from the byte its tags name; up to where the reaper's own begin, in a folder run in
    again), named as the run would have (a resumed session's `runner.resume-<N>.log`). Never a
    file that is not the one the run wrote: gone, replaced meanwhile, on another host (the
    warning names where it is then), or no job log at all (the tags come from the store)."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    client = MlflowClient(tracking_uri)
    here = ProcessIdentity.current()

    def dead(name: str, run_log, since: int, **more: str) -> str:
        log_tags = job_log.tags(run_log, since, job_log.head(run_log, since))
        assert log_tags
        owner = {**here.tags(), tag.PID: str(dead_pid()), tag.HEARTBEAT: now_iso()}
        return fake_run(tracker, name, **owner, **log_tags, **more)

    def job_folder(name: str):  # a Hydra output folder, as the runner's jobs have
        (tmp_path / name / ".hydra").mkdir(parents=True)
        return tmp_path / name / "runner.log"

    shared = job_folder("out")  # hydra.run.dir=out, run in again
    shared.write_text("an earlier run's lines\n")
    since = shared.stat().st_size
    with shared.open("a") as file:
        file.write("first: epoch 1/9\n")
    first = dead("first", shared, since, **{tag.RESUME_COUNT: "2"})
    with shared.open("a") as file:
        file.write("first: epoch 2/9\n")
    own_from = shared.stat().st_size  # where the reaper's own lines begin, in the same file
    with shared.open("a") as file:
        file.write("the reaper's own lines\n")
    own = job_folder("own")
    own.write_text("whole: precision\n")
    whole = dead("whole", own, 0)  # its own folder: everything in it, to the end
    with own.open("a") as file:
        file.write("whole: epoch 3/9\n")
    replaced = job_folder("replaced")
    replaced.write_text("the dead run's lines\n")
    swapped = dead("swapped", replaced, 0)
    replaced.unlink()
    replaced.write_text("a later run's lines, in a file of its own (perhaps at the same inode)\n")
    gone = job_folder("gone")
    gone.write_text("lines\n")
    removed = dead("removed", gone, 0)
    gone.unlink()
    far = job_folder("far")
    far.write_text("another host's file of that name\n")
    log_tags = job_log.tags(far, 0, job_log.head(far, 0))
    elsewhere_run = fake_run(tracker, "elsewhere", **elsewhere(STALE), **log_tags)
    untagged = fake_run(
        tracker, "untagged", **{**here.tags(), tag.PID: str(dead_pid()), tag.HEARTBEAT: now_iso()}
    )
    # tags naming a file that is no job log (a store others write): never uploaded
    secret = tmp_path / "keys" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    not_a_log = dead("not-a-log", secret, 0)
    link = job_folder("linked").parent / "runner.log"
    link.symlink_to(secret)
    linked = dead("linked", link, 0)

    with caplog.at_level(logging.WARNING, logger="runner.tracking"):
        ended = tracker.reap(own_log=(shared, own_from))
    assert sorted(ended) == sorted(
        [first, whole, swapped, removed, elsewhere_run, untagged, not_a_log, linked]
    )

    def logs(run_id: str) -> dict[str, str]:
        found = {}
        for item in client.list_artifacts(run_id, "logs"):
            with open(client.download_artifacts(run_id, item.path)) as file:
                found[item.path] = file.read()
        return found

    assert logs(first) == {"logs/runner.resume-2.log": "first: epoch 1/9\nfirst: epoch 2/9\n"}
    assert logs(whole) == {"logs/runner.log": "whole: precision\nwhole: epoch 3/9\n"}
    for run_id in (swapped, removed, elsewhere_run, untagged, not_a_log, linked):
        assert logs(run_id) == {}
    lines = {r.getMessage().split("'")[1]: r.getMessage() for r in caplog.records}
    assert lines["first"].endswith("; its log attached (logs/runner.resume-2.log)")
    assert lines["swapped"].endswith(f"; its log: {here.host}:{replaced.resolve()}")
    assert lines["elsewhere"].endswith(f"; its log: gpu-node-17:{far.resolve()}")
    assert lines["untagged"].endswith(f"pid {client.get_run(untagged).data.tags[tag.PID]})")


def test_a_resumed_session_without_a_log_drops_the_last_sessions_log_tags(tracking_uri, tmp_path):
    """The log tags say where the running session writes: a session that writes none (a run
    started from Python) must not leave a reaper the last session's file to attach as its own."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    run_log = tmp_path / "runner.log"
    run_log.write_text("the first session\n")
    first = tracker.create_run("resumed", job_log.tags(run_log, 0, job_log.head(run_log, 0)))
    first.end("KILLED")
    second = tracker.reopen_run(first.run_id, {})
    tags = tracker.client.get_run(first.run_id).data.tags
    assert not set(job_log.TAGS) & set(tags), tags
    second.end("FINISHED")


@pytest.mark.parametrize("name", ["tiny-O2", 'it\'s "quoted"'])
def test_latest_run_finds_the_newest_run_of_a_name(tracking_uri, name):
    """What `resume=auto` asks before it continues a run: what became of the last one."""
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    assert tracker.latest_run(name) is None
    first = fake_run(tracker, name, **elsewhere(STALE))
    tracker.reap()
    time.sleep(0.01)  # start times are in milliseconds
    second = tracker.create_run(name, {})
    fake_run(tracker, "another name")
    latest = tracker.latest_run(name)
    assert latest.run_id == second.run_id and latest.status == "RUNNING"
    assert tracker.vanished(latest) is None  # this process: alive
    second.end("FINISHED")
    assert tracker.latest_run(name).status == "FINISHED"
    assert tracker.client.get_run(first).info.status == "KILLED"


def test_the_heartbeat_goes_on_until_the_end(tracking_uri):
    tracker = MlflowTracker(tracking_uri, "amp-runner", heartbeat_s=0.2)
    tracked = tracker.create_run("beating", {})
    tags = lambda: tracker.client.get_run(tracked.run_id).data.tags  # noqa: E731
    first = tags()[tag.HEARTBEAT]
    deadline = time.monotonic() + 10
    while tags()[tag.HEARTBEAT] == first:  # heartbeats are written to the second
        assert time.monotonic() < deadline, "the heartbeat was not refreshed"
        time.sleep(0.1)
    assert parse_iso(tags()[tag.HEARTBEAT]) > parse_iso(first)
    tracked.end("FINISHED")
    last = tags()[tag.HEARTBEAT]
    time.sleep(1.2)
    assert tags()[tag.HEARTBEAT] == last  # stopped with the run


def test_a_live_run_ended_by_a_reaper_elsewhere_comes_back(tracking_uri, caplog, monkeypatch):
    """A reaper on another host that could not see the heartbeat for longer than its
    stale_after_s (a store out of reach, this process suspended) ends a live run: its next
    heartbeat makes it RUNNING again, and it ends FINISHED without the reaper's error."""
    suspended = threading.Event()  # (set: the heartbeat goes on)
    beat = MlflowRun._beat
    monkeypatch.setattr(MlflowRun, "_beat", lambda run: suspended.wait(30) and beat(run))
    tracker = MlflowTracker(tracking_uri, "amp-runner", heartbeat_s=0.2)
    tracked = tracker.create_run("suspended", {})
    reaper = MlflowTracker(tracking_uri, "amp-runner", stale_after_s=600)
    far_away = ProcessIdentity("gpu-node-17", 1)
    # (a beat between the reaper's search and its end would change the heartbeat tag, and the
    # reaper rightly leave the run alone; one after the end would undo it before it is read)
    assert reaper.reap(here=far_away, now=time.time() + 3600) == [tracked.run_id]
    assert tracker.client.get_run(tracked.run_id).info.status == "KILLED"
    deadline = time.monotonic() + 10

    def said_so() -> bool:  # the heartbeat thread warns after it has set RUNNING
        return any("RUNNING again" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="runner.tracking"):
        suspended.set()
        while tracker.client.get_run(tracked.run_id).info.status != "RUNNING" or not said_so():
            assert time.monotonic() < deadline, "the live run stayed KILLED, or nothing said so"
            time.sleep(0.1)
    assert tag.ERROR not in tracker.client.get_run(tracked.run_id).data.tags
    tracked.end("FINISHED")
    assert tracker.client.get_run(tracked.run_id).info.status == "FINISHED"


def test_the_report_shows_reaped_runs_as_killed_with_the_reason(tracking_uri, tmp_path):
    tracker = MlflowTracker(tracking_uri, "amp-runner")
    parent = tracker.create_run("sweep precision=o0,o1", {tag.SWEEP_DIR: str(tmp_path)})
    params = {
        "model.name": "tiny",
        "optimizer.name": "sgd",
        "trainer.batch_size": "32",
        "precision.opt_level": "O0",
    }
    with tracker.start_run("tiny-O0", params, {tag.PARENT_RUN: parent.run_id}) as run:
        run.log_metrics({"best_val_acc": 0.5, "train_time_s": 1.0}, 1)
    lost = fake_run(tracker, "tiny-O1", **{tag.PARENT_RUN: parent.run_id, **elsewhere(STALE)})
    tracker.reap()
    parent.end("FINISHED")

    out = tmp_path / "report"
    assert report_main(["--tracking-uri", tracking_uri, "--out", str(out)]) == 0
    reason = tracker.client.get_run(lost).data.tags[tag.ERROR]
    assert f"- tiny-O1 (run {lost}, KILLED): {reason}" in (out / "comparison.md").read_text()
    with (out / "comparison.csv").open(newline="") as f:
        rows = {r["run_name"]: r for r in csv.DictReader(f)}
    assert rows["tiny-O1"]["status"] == "KILLED" and rows["tiny-O1"]["reason"] == reason
    assert rows["tiny-O0"]["reason"] == ""


# ---- the store at start-up -----------------------------------------------------------------------
def test_a_store_another_process_keeps_locked_is_a_clear_error(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with open(tmp_path / "mlflow.db.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RunnerError) as e:
            MlflowTracker(uri, "amp-runner", lock_timeout_s=0.5)
    message = str(e.value)
    assert message.startswith("mlflow.tracking_uri: the tracking store")
    assert uri in message and "mlflow.db.lock" in message
    MlflowTracker(uri, "amp-runner", lock_timeout_s=0.5)  # released: it opens


@pytest.mark.parametrize("case", ["folder is a file", "not a database"])
def test_an_unusable_store_is_a_clear_error(tmp_path, case):
    if case == "folder is a file":
        (tmp_path / "store").write_text("a file where the folder should be")
        uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    else:
        (tmp_path / "mlflow.db").write_bytes(b"not an SQLite database" * 100)
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(RunnerError) as e:
        MlflowTracker(uri, "amp-runner")
    message = str(e.value)
    assert message.startswith(f"mlflow.tracking_uri: cannot use the tracking store {uri!r}: ")
    assert "set mlflow.tracking_uri to another store" in message


@pytest.mark.slow
def test_the_cli_says_what_is_wrong_with_the_store_and_exits_2(tmp_path):
    (tmp_path / "store").write_text("a file where the folder should be")
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    result = run_cli(*FAST, f"mlflow.tracking_uri={uri}", cwd=tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert f"cannot use the tracking store {uri!r}" in output and "Traceback" not in output


# ---- real processes ------------------------------------------------------------------------------
@pytest.mark.slow
def test_six_runs_started_at_once_against_a_new_store_all_finish(tmp_path):
    """What a shell loop, a SLURM array or two people sharing a folder do: six runs start at once
    against a store that does not exist yet; MLflow's table creation must not race."""
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    names = [f"crowd-{i}" for i in range(6)]
    procs = [
        start_cli(
            *FAST,
            "trainer.log_every_n_steps=1",
            "precision.kernels=torch",
            f"mlflow.tracking_uri={uri}",
            f"mlflow.run_name={name}",
            cwd=tmp_path,
        )
        for name in names
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert sorted(r.info.run_name for r in runs) == names
    for run in runs:  # 96 samples in batches of 32: 3 steps an epoch, 2 epochs, every step
        assert run.info.status == "FINISHED"
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
        assert steps == [1, 2, 3, 4, 5, 6], run.info.run_name
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]


@pytest.mark.slow
def test_a_starting_run_ends_a_sigkilled_run_and_leaves_a_live_one_alone(tmp_path):
    """Three runs in one store: `live` trains throughout; `killed` is SIGKILLed mid-training (after
    its first epoch); `next` starts and finishes meanwhile. `next` ends `killed` KILLED (its pid
    is gone) and never touches `live`; `live`, which started first, saw nothing to end."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    long = [
        *FAST,
        "data.num_train=640",
        "trainer.max_epochs=100",
        "precision.kernels=torch",
        f"mlflow.tracking_uri={uri}",
    ]
    live = start_cli(*long, "mlflow.run_name=live", cwd=tmp_path)
    killed = start_cli(*long, "mlflow.run_name=killed", cwd=tmp_path)
    try:
        # `live` has looked for runs to end (it says "MLflow run" after) before `killed` dies:
        # otherwise a slow start of `live` would end `killed` itself, not `next`
        seen_live = read_until(live, "MLflow run")
        assert "MLflow run" in seen_live[-1], "".join(seen_live)[-3000:]
        seen_killed = read_until(killed, "epoch 1/")
        assert "epoch 1/" in seen_killed[-1], "".join(seen_killed)[-3000:]
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)

        nxt = run_cli(
            *FAST,
            "precision.kernels=torch",
            f"mlflow.tracking_uri={uri}",
            "mlflow.run_name=next",
            cwd=tmp_path,
            timeout=600,
        )
        output = nxt.stdout + nxt.stderr
        assert nxt.returncode == 0, output[-3000:]
        assert live.poll() is None, "the live run ended before the next one started"

        client = MlflowClient(uri)
        runs = {
            r.info.run_name: r
            for r in client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
        }
        dead = runs["killed"]
        assert dead.info.status == "KILLED"
        assert re.fullmatch(
            rf"process vanished: no heartbeat since \S+ \(host {re.escape(socket.gethostname())}"
            rf", pid {killed.pid}\)",
            dead.data.tags[tag.ERROR],
        )
        ended = [line for line in output.splitlines() if "as KILLED" in line]
        assert len(ended) == 1 and dead.info.run_id in ended[0], output[-3000:]
        # its own folder's log, as far as it got: attached to it by the reaper
        assert ended[0].endswith("; its log attached (logs/runner.log)"), ended[0]
        with open(client.download_artifacts(dead.info.run_id, "logs/runner.log")) as file:
            kept = file.read()
        # (from its first line; its last may be short of the console's: killed in between)
        # (its first line: the session's first, trainer.tune's where it ran before the precision
        # table of the run's one plan)
        first = kept.splitlines()[0]
        assert kept.startswith("[") and ("trainer.tune" in first or "Precision (Apex O0" in first)
        assert "Precision (Apex O0, resolved)" in kept
        assert f"MLflow run 'killed' ({dead.info.run_id})" in kept and "'next'" not in kept
        assert runs["next"].info.status == "FINISHED"
        assert runs["live"].info.status == "RUNNING" and tag.ERROR not in runs["live"].data.tags
    finally:
        for proc in (live, killed):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # ends `live` cleanly, as KILLED by SIGTERM
    rest, _ = live.communicate(timeout=120)
    assert live.returncode == 143, rest[-3000:]
    final = MlflowClient(uri).get_run(runs["live"].info.run_id)
    assert final.info.status == "KILLED"
    assert final.data.tags[tag.ERROR].startswith("interrupted by SIGTERM")  # its own end
