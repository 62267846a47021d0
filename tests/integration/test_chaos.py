"""Chaos: a real run SIGKILLed at three moments, resumed with `resume=auto` after each, ends as if
it had never been interrupted.

The three kills: (1) once its MLflow run exists, before the first checkpoint; (2) in the middle of
epoch 2 (its last checkpoint is epoch 1's); (3) right after the checkpoint of epoch 2 is written.
After the last resume: every metric of the run has the history of an uninterrupted run with the
same config, point for point (a resumed epoch logs again the steps the killed process had already
sent, with the same values: CPU, `num_workers=0`, so bit for bit); exactly one FINISHED run of
that name; the run killed before its first checkpoint was ended KILLED by the next start (it had
nothing to resume from, so training started again in a new run, as the README says); no run left
RUNNING; no temporary checkpoint file left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from mlflow.tracking import MlflowClient

from runner.run import checkpoint
from runner.tracking import tags as tag
from tests.helpers.runs import epoch_seconds, read_until, run_cli, start_cli
from tests.helpers.store import metric_history

EPOCHS = 3
CONFIG = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=1536",
    "data.num_val=64",
    "data.image_size=16",
    "trainer.batch_size=32",
    f"trainer.max_epochs={EPOCHS}",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=4",
    "trainer.device=cpu",
    "precision=o2_bf16",
    "precision.kernels=torch",
]


# metrics that depend on the clock or the machine's memory, not on the training
def kill(proc: subprocess.Popen, after: str, seen: list[str], epoch_s: float = 0.0) -> None:
    """SIGKILL `proc` once it has printed `after`, or with `epoch_s` a third of an epoch later
    (the shorter of `epoch_s` and the epoch `proc` has just run)."""
    lines = read_until(proc, after)
    seen.extend(lines)
    assert lines and after in lines[-1], "".join(seen)[-3000:]
    if epoch_s:
        time.sleep(min([epoch_s, *epoch_seconds("".join(lines))]) / 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]


@pytest.mark.slow  # five real CLI processes (start-up ~5 s each) and three short trainings
def test_a_run_killed_three_times_resumes_to_the_uninterrupted_history(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*CONFIG, f"mlflow.tracking_uri={uri}"]
    reference = run_cli(*args, "mlflow.run_name=reference", cwd=tmp_path)
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    # a third of an epoch after epoch 1's checkpoint is well inside epoch 2, even when the
    # machine is busier or idler than it was for the reference (half of epoch 1's time overshot
    # epoch 2 on a loaded CPU): the shortest of the uninterrupted run's epochs (the first one
    # includes warm-up) or of this run's first, whichever is shorter (an idler machine now)
    epoch_s = min(epoch_seconds(reference.stdout + reference.stderr))

    chaos = [*args, "mlflow.run_name=chaos", "resume=auto"]
    folder = tmp_path / "checkpoints" / "amp-runner" / "chaos"
    seen: list[str] = []

    # 1. the MLflow run exists, no checkpoint yet
    kill(start_cli(*chaos, cwd=tmp_path), "MLflow run", seen)
    assert not list(folder.glob("*/last.pt")), "the first kill came after a checkpoint"

    # 2. mid-epoch 2: a third of an epoch after epoch 1's checkpoint
    kill(start_cli(*chaos, cwd=tmp_path), "(after epoch 1)", seen, epoch_s=epoch_s)
    (path,) = folder.glob("*/last.pt")
    assert checkpoint.load(path)["epoch"] == 1, "the second kill missed epoch 2"

    # 3. right after epoch 2's checkpoint
    kill(start_cli(*chaos, cwd=tmp_path), "(after epoch 2)", seen)
    assert checkpoint.load(path)["epoch"] == 2

    last = run_cli(*chaos, cwd=tmp_path)
    output = "".join(seen) + last.stdout + last.stderr
    assert last.returncode == 0, output[-3000:]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    by_status = {}
    for r in runs:
        if r.info.run_name == "chaos":
            by_status.setdefault(r.info.status, []).append(r)
    assert sorted(by_status) == ["FINISHED", "KILLED"], output[-3000:]
    (finished,), (first,) = by_status["FINISHED"], by_status["KILLED"]
    assert first.data.tags[tag.ERROR].startswith("process vanished: no heartbeat since")
    assert tag.ERROR not in finished.data.tags  # killed twice, resumed twice, ended well
    assert finished.data.tags["resume.count"] == "2"
    assert finished.info.run_id in str(path)

    (straight,) = [r for r in runs if r.info.run_name == "reference"]
    want = metric_history(client, straight)
    assert {"train_loss", "val_acc", "val_loss"} <= set(want)
    assert metric_history(client, finished) == want
    assert max(want["train_loss"]) == EPOCHS * 1536 // 32  # every step of every epoch is there
    assert not [p for p in tmp_path.rglob("*.tmp")], "a temporary checkpoint was left behind"
    assert os.path.getsize(path) > 0
