"""fp16 on a CPU: a run that would not finish in reasonable time is refused in planning, saying
its estimate, the bfloat16 preset with its own and the key that runs it anyway; a small run at O2
(a smoke test) plans as before (runner.run.cpu_fp16)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError
from runner.measure.probes import training_rate
from runner.run import app, batches, cpu_fp16
from runner.run.plan import make_plan
from tests.helpers.runs import FAST, compose_config, run_cli

MISSION = ["model=densenet161", "data=synthetic", "trainer.device=cpu"]


@pytest.mark.parametrize("level", ["o1", "o2", "o3"])
def test_a_long_fp16_run_on_a_cpu_is_refused_with_its_estimate_and_what_to_do(level):
    """DenseNet-161 on 10,000 images for 10 epochs (790 steps of 128) at an fp16 level: days on
    a CPU (550 s a step was measured), refused before anything is built."""
    with pytest.raises(ConfigError) as refused:
        make_plan(compose_config(*MISSION, f"precision={level}"))
    said = str(refused.value)
    assert refused.value.key == "precision"
    assert re.search(r"this run would take ~\d+ (d|h)", said), said
    assert "790 steps of ~" in said and "GFLOP/s on this CPU" in said
    assert f"precision={level}_bf16 (bfloat16, ~" in said
    assert "trainer.allow_slow_fp16=true to run it anyway" in said


def test_the_estimate_is_the_runs_flops_at_this_cpus_measured_rate():
    """The estimate: steps x batch x the model's training FLOPs per sample over the rate of an
    fp16 convolution's training step measured on this CPU; bfloat16's at its own rate."""
    plan = make_plan(compose_config(*MISSION, "precision=o0"))  # (the same model and steps)
    flops, steps = plan.flops_per_sample(), plan.estimated_steps()
    assert steps == 790 and flops > 1e9
    fp16 = cpu_fp16.estimate_s(10_000 * 10, flops, torch.float16)  # (10 epochs of 10,000)
    assert fp16 == pytest.approx(100_000 * flops / training_rate(torch.float16))
    assert fp16 > cpu_fp16.MAX_RUN_S
    assert training_rate(torch.float16) < training_rate(torch.float32)  # (emulated)


@pytest.mark.parametrize(
    "overrides,samples",
    [
        ([], 100_000),  # 10 epochs of 10,000: the last batch of each 16, not 128
        (["data.num_train=16"], 160),  # one batch of 16 an epoch
        (["trainer.limit_train_batches=2"], 2 * 128 * 10),
        (["trainer.max_epochs=1", "data.num_train=200", "trainer.batch_size=64"], 200),
    ],
)
def test_the_estimate_counts_the_samples_the_run_trains_on(overrides, samples):
    """A smoke test on 16 images trains on 16 a step, not a batch of 128: its estimate is 8x
    shorter than 10 full batches'."""
    plan = make_plan(compose_config(*MISSION, "precision=o0", *overrides))
    assert batches.estimated_samples(plan.cfg, plan.task, plan.specs["data"]) == samples


def test_the_key_runs_it_anyway_and_a_small_run_plans_as_before():
    plan = make_plan(compose_config(*MISSION, "precision=o2", "trainer.allow_slow_fp16=true"))
    assert plan.properties.opt_level == "O2"
    assert make_plan(compose_config(*FAST, "precision=o2")).properties.opt_level == "O2"
    bf16 = make_plan(compose_config(*MISSION, "precision=o2_bf16"))  # (bfloat16: no refusal)
    assert bf16.properties.opt_level == "O2"


def test_a_dry_run_says_it_would_refuse(capsys):
    app.run(compose_config(*MISSION, "precision=o2", "dry_run=true"))
    said = capsys.readouterr().out
    assert "Would refuse: precision: precision=o2 computes in fp16" in said


def test_the_missions_command_on_a_cpu_exits_2_in_seconds_naming_bf16(tmp_path):
    """`python -m runner precision=o2 model=densenet161 data=synthetic`, as typed: one line,
    exit 2, within 60 s, no MLflow run."""
    started = time.monotonic()
    result = run_cli("precision=o2", "model=densenet161", "data=synthetic", cwd=tmp_path)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    first = result.stderr.splitlines()[0]
    assert first.startswith("precision: precision=o2 computes in fp16") and "o2_bf16" in first
    assert took < 60, took
    store = tmp_path / "mlflow.db"  # (no run: not even its experiment)
    assert not store.exists() or not MlflowClient(f"sqlite:///{store}").search_experiments(
        filter_string="name = 'amp-runner'"
    )
