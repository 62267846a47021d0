"""End-to-end runs on CUDA at every Apex level, read back from a real SQLite MLflow store: the
device's memory figures, and the tensor-core shape finding that only a GPU raises."""

from __future__ import annotations

import math

import pytest

from runner.run import app
from tests.helpers.runs import FAST, compose_config
from tests.helpers.store import EPOCH_METRICS, only_run


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["o0", "o1", "o2", "o3"])
def test_each_level_on_cuda(level, tracking_uri):
    cfg = compose_config(
        *FAST,
        f"precision={level}",
        "trainer.device=cuda",
        "trainer.channels_last=true",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    app.run(cfg)
    _, run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    assert run.data.tags["peak_mem_kind"] == "cuda_max_allocated"
    assert run.data.metrics["peak_mem_mb"] > 0
    assert all(math.isfinite(run.data.metrics[m]) for m in EPOCH_METRICS)


@pytest.mark.gpu
def test_tensor_core_shapes_are_an_info_on_cuda(tracking_uri):
    """The tiny model's last Linear has 10 outputs and the batch is 30: one info finding, tagged
    and attached, and the run still finishes."""
    cfg = compose_config(
        *FAST,
        "precision=o2",
        "trainer.device=cuda",
        "trainer.batch_size=30",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    app.run(cfg)
    client, run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    assert run.data.tags["precision.findings"].endswith("1 info")
    assert "info model" in run.data.tags["precision.findings_list"]
    content = open(client.download_artifacts(run.info.run_id, "precision.txt")).read()
    assert "not multiples of 8" in content and "batch size 30" in content
