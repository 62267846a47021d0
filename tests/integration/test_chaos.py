"""Chaos: a real run SIGKILLed at three moments, resumed with `resume=auto` after each, ends as if
it had never been interrupted.

The three kills: (1) once its MLflow run exists, before the first checkpoint; (2) in the middle of
epoch 2 (its last checkpoint is epoch 1's); (3) right after the checkpoint of epoch 2 is written.
Each kill comes while the process is held at a known sample (tests.helpers.held_data), not after
a guessed sleep: an epoch is half a second, and a third of one overshot epoch 2 on a loaded CI
machine.
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

import pytest
from mlflow.tracking import MlflowClient

from runner.run import checkpoint
from runner.tracking import tags as tag
from tests.helpers.held_data import HELD, HELD_DATA, HOLD_AFTER
from tests.helpers.runs import read_until, run_cli, start_cli
from tests.helpers.store import metric_history

EPOCHS = 3
SAMPLES = 512  # an epoch's (16 steps: bf16 steps cost 6x fp32's on a CPU without bf16 units)
CONFIG = [
    "model=tiny",
    *HELD_DATA,
    f"+data.num_train={SAMPLES}",
    "trainer.batch_size=32",
    f"trainer.max_epochs={EPOCHS}",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=4",
    "trainer.device=cpu",
    "precision=o2_bf16",
    "precision.kernels=torch",
]


def kill_held(args: list[str], cwd, at: int, after: str, seen: list[str]) -> None:
    """Start the run, and SIGKILL it while its dataset holds it at training sample `at` (counted
    in this process), once it has printed `after` before that."""
    proc = start_cli(*args, cwd=cwd, env={HOLD_AFTER: str(at)})
    lines = read_until(proc, HELD)
    seen.extend(lines)
    said = "".join(lines)
    assert lines and HELD in lines[-1] and after in said, "".join(seen)[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]


@pytest.mark.slow  # five real CLI processes (start-up ~5 s each) and three short trainings
def test_a_run_killed_three_times_resumes_to_the_uninterrupted_history(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*CONFIG, f"mlflow.tracking_uri={uri}"]
    reference = run_cli(*args, "mlflow.run_name=reference", cwd=tmp_path)
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]

    chaos = [*args, "mlflow.run_name=chaos", "resume=auto"]
    folder = tmp_path / "checkpoints" / "amp-runner" / "chaos"
    seen: list[str] = []

    # 1. the MLflow run exists, no checkpoint yet: held at epoch 1's 100th sample
    kill_held(chaos, tmp_path, 100, "MLflow run", seen)
    assert not list(folder.glob("*/last.pt")), "the first kill came after a checkpoint"

    # 2. mid-epoch 2 (this process trains from the start): a third into it
    kill_held(chaos, tmp_path, SAMPLES + SAMPLES // 3, "(after epoch 1)", seen)
    (path,) = folder.glob("*/last.pt")
    assert checkpoint.load(path)["epoch"] == 1, "the second kill missed epoch 2"

    # 3. right after epoch 2's checkpoint (this process resumes at epoch 2): epoch 3's 10th sample
    kill_held(chaos, tmp_path, SAMPLES + 10, "(after epoch 2)", seen)
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
    assert max(want["train_loss"]) == EPOCHS * SAMPLES // 32  # every step of every epoch is there
    assert not [p for p in tmp_path.rglob("*.tmp")], "a temporary checkpoint was left behind"
    assert os.path.getsize(path) > 0
