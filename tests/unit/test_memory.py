"""Memory by kind (runner.measure.memory): known answers from the tensors' sizes at each level, the
activation meter on graphs whose saved tensors are known, and CPU memory figures that do not
depend on what ran before in the same process (a sweep's jobs)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from runner.measure.memory import (
    MB,
    ActivationMeter,
    MemoryByKind,
    MemoryInstrument,
    measure,
    model_state_tensors,
)
from runner.measure.probes import MemoryProbe
from runner.run import app
from runner.run.build import build
from runner.run.context import RunContext
from runner.run.plan import make_plan
from runner.run.trainer import Trainer, trainer_config
from tests.helpers.runs import FAST, REPO, compose_config, run_in_process

CPU = torch.device("cpu")


def first_step(*overrides: str) -> Trainer:
    """The runner's own objects for FAST + `overrides` (build_parts, as a run builds them), one
    training step taken: the trainer holds its memory by kind."""
    cfg = compose_config(*FAST, "trainer.device=cpu", *overrides)
    plan = make_plan(cfg)
    parts = build(plan)
    trainer = Trainer(
        trainer_config(cfg.trainer),
        parts,
        RunContext(on_metrics=lambda m, s: None),
        device=plan.device,
    )
    x, y = trainer.to_device(*next(iter(parts.train_loader)))
    trainer.train_step(x, y)
    assert by_kind(trainer) is not None and trainer.engine.skipped_steps == 0
    return trainer


def by_kind(trainer: Trainer) -> MemoryByKind:
    """The memory by kind the trainer's memory instrument measured."""
    return trainer.instruments.find(MemoryInstrument).parts


def n_params(trainer: Trainer) -> int:
    return sum(p.numel() for p in trainer.module.parameters())


# ---- the state: weights, masters, gradients, optimizer state ------------------------------------
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_weights_masters_grads_and_state_per_level_match_the_tensor_sizes(kernels):
    """tiny_gn (GroupNorm: every parameter is cast, no buffers), SGD with momentum. n parameters:
    O0 holds 4n bytes of weights, 4n of grads and 4n of momentum; O2 fp16 2n of weights, 4n of
    masters (= O0's weights) and their 4n of momentum, and 2n of fp16 grads plus, where the
    masters' fp32 grads are materialised (torch's ops; the fused kernels read the fp16 grads
    directly), 4n more; O3 2n everywhere and no masters."""
    kernel = f"precision.kernels={kernels}"
    o0, o2, o3 = (first_step("model=tiny_gn", f"precision={p}", kernel) for p in ("o0", "o2", "o3"))
    n = n_params(o0)
    assert n == n_params(o2) == n_params(o3) and not list(o0.module.buffers())
    p0, p2, p3 = by_kind(o0), by_kind(o2), by_kind(o3)
    assert (p0.weights, p0.master_weights, p0.grads, p0.optimizer_state) == (4 * n, 0, 4 * n, 4 * n)
    assert p2.weights * 2 == p0.weights and p2.master_weights == p0.weights
    fused = o2.engine.kernels is not None
    assert p2.grads == 2 * n + (0 if fused else 4 * n) and p2.optimizer_state == 4 * n
    assert (p3.weights, p3.master_weights, p3.grads, p3.optimizer_state) == (2 * n, 0, 2 * n, 2 * n)
    for parts in (p0, p2, p3):
        assert parts.total == (
            parts.weights
            + parts.master_weights
            + parts.grads
            + parts.optimizer_state
            + parts.activations
        )
        metrics = parts.metrics()
        assert metrics["mem_total_mb"] == parts.total / MB
        assert metrics["mem_weights_mb"] == parts.weights / MB


def test_batchnorm_kept_in_fp32_counts_at_its_own_size():
    """The tiny model (BatchNorm) at O2: BatchNorm's weights and running statistics stay fp32
    (keep_batchnorm_fp32) and are their own masters; everything else is fp16 with an fp32 master."""
    o2 = first_step("precision=o2")
    module = o2.module
    bn = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    bn_params = sum(p.numel() for m in bn for p in m.parameters())
    other = n_params(o2) - bn_params
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    assert by_kind(o2).weights == 2 * other + 4 * bn_params + buffers
    assert by_kind(o2).master_weights == 4 * other


def test_o2_activations_are_about_half_of_o0s():
    """On the tiny model (FAST: width 16, 16-px images, batch 32) O2 saves its layer inputs and
    outputs in fp16; only BatchNorm's per-channel statistics and the fp32 loss's inputs stay
    fp32, a few KB against about 2 MB: within 2% of half."""
    o0, o2 = first_step("precision=o0"), first_step("precision=o2")
    ratio = by_kind(o2).activations / by_kind(o0).activations
    assert by_kind(o0).activations > 1 * MB
    assert ratio == pytest.approx(0.5, abs=0.01), ratio


# ---- the activation meter ------------------------------------------------------------------------
def test_the_meter_counts_each_saved_storage_once_and_never_a_weight():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    meter = ActivationMeter(exclude=model_state_tensors(layer))
    with meter:
        h = layer(x)  # saves x (input) and the weight (excluded)
        r = torch.relu(h)  # saves its result r
        loss = (r * r).sum()  # saves r twice: one storage
        loss.backward()
    assert meter.bytes == x.numel() * 4 + r.numel() * 4
    meter = ActivationMeter()
    with meter:
        # saves a view of x (for the other factor's gradient): x's whole storage; the other
        # factor is not saved (x needs no gradient)
        y = x[:, :2] * torch.ones(2, requires_grad=True)
        y.sum().backward()
    assert meter.bytes == x.numel() * 4


def test_the_meter_leaves_the_gradients_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )
    x = torch.randn(5, 3, 8, 8)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ActivationMeter(model_state_tensors(model)) as meter:
        model(x).square().sum().backward()
    assert meter.bytes > 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_measure_without_an_optimizer_or_engine():
    layer = nn.Linear(10, 10)
    layer(torch.randn(2, 10)).sum().backward()
    parts = measure(layer)
    assert (parts.weights, parts.grads, parts.master_weights, parts.optimizer_state) == (
        440,
        440,
        0,
        0,
    )


def test_the_cpu_probe_reports_the_largest_tensor_total():
    probe = MemoryProbe(CPU)
    probe.reset()
    assert probe.kind == "cpu_tensor_accounted" and math.isnan(probe.peak_mb())
    probe.record_tensors(3.0)
    probe.record_tensors(2.0)
    assert probe.peak_mb() == 3.0 and probe.rss_growth_mb() >= 0
    probe.reset()
    assert math.isnan(probe.peak_mb())


# ---- in a run, and in a sweep sharing one process ------------------------------------------------
def test_a_cpu_run_logs_memory_by_kind_and_its_peak_is_the_tensor_total(tracking_uri):
    cfg = compose_config(*FAST, "precision=o2_bf16", f"mlflow.tracking_uri={tracking_uri}")
    app.run(cfg)
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    metrics = run.data.metrics
    parts = [
        "mem_weights_mb",
        "mem_master_weights_mb",
        "mem_grads_mb",
        "mem_optimizer_state_mb",
        "mem_activations_mb",
    ]
    assert metrics["mem_total_mb"] == pytest.approx(sum(metrics[p] for p in parts))
    assert metrics["mem_master_weights_mb"] > 0 and metrics["mem_activations_mb"] > 0
    assert metrics["peak_mem_mb"] == metrics["mem_total_mb"]
    assert metrics["rss_growth_mb"] >= 0
    assert run.data.tags["peak_mem_kind"] == "cpu_tensor_accounted"
    history = client.get_metric_history(run.info.run_id, "mem_total_mb")
    assert [m.step for m in history] == [1]  # measured once, logged with epoch 1


SWEEP_LEVELS = ["o0", "o1_bf16", "o2_bf16", "o3_bf16"]
SWEEP = [*FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=2"]


def _memory(uri: str, experiment: str = "amp-runner") -> dict[str, tuple[float, float]]:
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {
        r.data.params["precision.preset"]: (
            r.data.metrics["peak_mem_mb"],
            r.data.metrics["mem_total_mb"],
        )
        for r in runs
        if "precision.preset" in r.data.params
    }


@pytest.mark.slow
def test_a_cpu_sweep_in_one_process_reports_the_memory_ratios_of_fresh_processes(tmp_path):
    """The four levels as one in-process sweep (the jobs share this process, as the default
    launcher runs them) and as four runs each in a fresh process: the memory ratios to O0 agree
    within 10%. (The process's resident-memory growth did not: later jobs reused what the first
    freed and showed 0.01-0.04x O0.) The fresh processes log into the same store (another
    experiment), created once by the sweep: four interpreter starts, one after another."""
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    code = run_in_process(
        "-m",
        *SWEEP,
        f"precision={','.join(SWEEP_LEVELS)}",
        f"mlflow.tracking_uri={shared}",
        f"hydra.sweep.dir={tmp_path / 'm'}",
    )
    assert code == 0
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    for level in SWEEP_LEVELS:  # (one at a time: on 2 cores concurrency only adds contention)
        folder = tmp_path / level
        folder.mkdir()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "runner",
                *SWEEP,
                f"precision={level}",
                f"mlflow.tracking_uri={shared}",
                "mlflow.experiment_name=fresh",
            ],
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    in_one = _memory(shared)
    fresh = _memory(shared, "fresh")
    assert set(in_one) == set(SWEEP_LEVELS)
    for column in (0, 1):  # peak_mem_mb, mem_total_mb
        for level in SWEEP_LEVELS[1:]:
            shared_ratio = in_one[level][column] / in_one["o0"][column]
            fresh_ratio = fresh[level][column] / fresh["o0"][column]
            assert shared_ratio == pytest.approx(fresh_ratio, rel=0.10), (level, column)
            assert 0.3 < shared_ratio < 1.2  # not the 0.01-0.04x of the resident-memory figure
