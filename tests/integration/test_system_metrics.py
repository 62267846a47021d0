"""System metrics: MLflow's own monitors sampled into the run's buffered metrics
(runner.tracking.system); the end-to-end check with the defaults is in test_e2e's CLI run."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError
from runner.run.app import run
from runner.tracking.system import SystemSampler
from tests.helpers.runs import FAST, compose_config


def test_the_sampler_logs_every_period_and_once_more_at_stop():
    logged: list[tuple[dict, int]] = []
    sampler = SystemSampler(lambda metrics, step: logged.append((dict(metrics), step)), 0.1)
    assert sampler.start()
    deadline = time.monotonic() + 10  # (0.2 s idle; a loaded machine wakes the thread later)
    while len(logged) < 2:
        assert time.monotonic() < deadline, "the sampler logged nothing for 10 s"
        time.sleep(0.05)
    sampler.stop()
    steps = [step for _, step in logged]
    assert len(steps) >= 3 and steps == list(range(len(steps)))  # 0, 1, 2, ... and the last
    for metrics, _ in logged:
        assert metrics["system/system_memory_usage_megabytes"] > 0
        assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100
        assert all(k.startswith("system/") for k in metrics)
    count = len(logged)
    time.sleep(0.25)
    assert len(logged) == count  # stopped


def test_system_metrics_off_with_one_key(tracking_uri):
    cfg = compose_config(
        *FAST,
        "trainer.max_epochs=1",
        "mlflow.system_metrics_s=0",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    run(cfg)
    client = MlflowClient(tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert r.info.status == "FINISHED"
    assert not [k for k in r.data.metrics if k.startswith("system/")]
    assert r.data.params["mlflow.system_metrics_s"] == "0.0"


@pytest.mark.parametrize("value", ["-1", "0.01", "nan"])
def test_a_bad_period_is_refused_naming_the_key(value, tracking_uri):
    cfg = compose_config(
        *FAST, f"mlflow.system_metrics_s={value}", f"mlflow.tracking_uri={tracking_uri}"
    )
    with pytest.raises(ConfigError, match="mlflow.system_metrics_s"):
        run(cfg)


def test_a_resumed_run_goes_on_after_its_system_metric_steps(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [
        *FAST,
        f"mlflow.tracking_uri={uri}",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
        "mlflow.run_name=resumed",
    ]
    run(compose_config(*common, "trainer.max_epochs=1"))
    run(compose_config(*common, "trainer.max_epochs=2", "resume=auto"))
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    steps = [
        m.step
        for m in client.get_metric_history(r.info.run_id, "system/system_memory_usage_megabytes")
    ]
    assert steps == [0, 1]  # one last sample per process, numbered on


def test_the_datasets_digest_follows_the_data_settings(tracking_uri):
    """MLflow's dataset inputs: the same data settings give the same digest in any run (an lr
    does not change it), other data settings another."""
    for name, extra in (
        ("a", "optimizer.lr=0.01"),
        ("b", "optimizer.lr=0.02"),
        ("c", "data.num_train=64"),
    ):
        run(
            compose_config(
                *FAST,
                "trainer.max_epochs=1",
                extra,
                f"mlflow.run_name={name}",
                "mlflow.system_metrics_s=0",
                f"mlflow.tracking_uri={tracking_uri}",
            )
        )
    client = MlflowClient(tracking_uri)
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    }
    digests = {
        name: {d.dataset.name: d.dataset.digest for d in r.inputs.dataset_inputs}
        for name, r in runs.items()
    }
    assert digests["a"] == digests["b"]
    assert digests["a"]["synthetic/train"] != digests["c"]["synthetic/train"]
