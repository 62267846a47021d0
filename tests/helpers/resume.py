"""Runs that stop and resume: the settings of a checkpointed run in a temporary folder, its last
checkpoint, and the same run made straight and resumed for bit-for-bit comparison."""

from __future__ import annotations

from pathlib import Path

from runner.run import app, checkpoint
from tests.helpers.runs import FAST, compose_config


def last_checkpoint(tmp_path: Path, run_name: str) -> dict:
    folder = checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", run_name)
    return checkpoint.load(checkpoint.find("auto", folder))


def settings(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *FAST,
        "data.num_train=160",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
        *extra,
    ]


def straight_and_resumed(tmp_path: Path, *extra: str) -> str:
    """Two runs of `settings(tmp_path, *extra)`: `straight`, two epochs in one session;
    `resumed`, one epoch, then resume=auto to two. Returns the store's URI."""
    common = settings(tmp_path, *extra)
    app.run(compose_config(*common, "trainer.max_epochs=2", "mlflow.run_name=straight"))
    app.run(compose_config(*common, "trainer.max_epochs=1", "mlflow.run_name=resumed"))
    app.run(
        compose_config(*common, "trainer.max_epochs=2", "mlflow.run_name=resumed", "resume=auto")
    )
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
