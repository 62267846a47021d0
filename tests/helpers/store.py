"""Reading runs back from a real MLflow store: the metrics every image run logs, a store's runs,
and metric histories compared point for point."""

from __future__ import annotations

import re

from mlflow.tracking import MlflowClient

# What an image-classification run logs every epoch, and once at its end.
EPOCH_METRICS = [
    "val_loss",
    "val_acc",
    "epoch_time_s",
    "epoch_samples_per_s",  # (the steady samples_per_s: every epoch with a steady step)
    "data_wait_frac",
    "peak_mem_mb",
    "loss_scale",
    "skipped_steps",
]
FINAL_METRICS = ["best_val_acc", "train_time_s"]

# The metrics a resumed run must repeat bit for bit (no timing, no memory figure).
NON_TIMING = (
    "train_loss",
    "lr",
    "val_loss",
    "val_acc",
    "loss_scale",
    "skipped_steps",
    "best_val_acc",
)

# Metrics that differ between two runs of the same config (timings, throughput, memory, the
# machine's load).
VARIABLE = re.compile(r"time|per_s|data_wait|flops|mfu|mem|rss|^system/")


def metric_history(client: MlflowClient, run) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of a run; a step logged twice (by a killed process, then by the
    resumed one) must hold the same value both times."""
    out: dict[str, dict[int, float]] = {}
    for key in run.data.metrics:
        if VARIABLE.search(key):
            continue
        points: dict[int, float] = {}
        for m in client.get_metric_history(run.info.run_id, key):
            assert points.setdefault(m.step, m.value) == m.value, (key, m.step)
        out[key] = points
    return out


def only_run(uri: str, experiment: str = "amp-runner"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment!r} missing in {uri}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def all_runs(uri: str):
    client = MlflowClient(uri)
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def runs_by_name(uri: str) -> dict:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("amp-runner")
    return {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}


def history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(uri)
    return {
        name: sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        for name in NON_TIMING
    }
