"""Gradient accumulation as a user runs it: `python -m runner ... trainer.accumulate_grad_batches=3`
in a real subprocess with the defaults on (two DataLoader workers, the progress bar), a real
MLflow store. (The numerics: tests/unit/test_accumulation.py; under torchrun:
test_distributed.py and test_fsdp.py; an interrupted step resumed: test_resume.py.)"""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from tests.helpers.runs import TINY, run_cli
from tests.helpers.store import runs_by_name


def test_a_run_steps_once_per_three_batches_and_logs_the_batch_a_step_learns_from(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli(
        *TINY,
        "precision=o2_bf16",
        "trainer.batch_size=16",
        "trainer.accumulate_grad_batches=3",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "6/6" in output  # the bar counts the epoch's batches
    (run,) = runs_by_name(uri).values()
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.accumulate_grad_batches"] == "3"
    assert run.data.params["trainer.global_batch_size"] == "48"
    client = MlflowClient(uri)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps == [1, 2, 3, 4]  # 6 batches an epoch: 2 steps of 3
    assert run.data.metrics["skipped_steps"] == 0
