"""`trainer.cuda_graphs=true` on a GPU: the optimizer step captured once after its eager warm-up
steps and replayed trains as the eager step does (the same loss at every step, within the level's
format), replayed once a step after the capture; a new learning rate (cosine: at every step)
replays the same graph where the runner's kernels step, and is captured again where torch's
optimizer does; with torch.compile, forward and backward replayed as graphs too."""

from __future__ import annotations

import pytest

from runner.run import cuda_graphs
from runner.run.compile_warmup import compile_warmup
from tests.helpers.runs import FAST, compose_config
from tests.helpers.trainer import (
    assert_same_losses,
    overflowing_runs,
    planned_trainer,
    step_counters,
    trained_losses,
)

STEPS = 12  # a batch of 32 from 384 samples: 3 eager warm-up steps, a capture, 9 replays
# how far the losses of two runs may drift apart through the convolutions' nondeterministic
# reductions: a few units of the format the level computes in (fp16 and O0's TF32 convolutions
# 2^-10, bf16 2^-7)
RTOL = {"o0": 4e-3, "o2": 4e-3, "o1_bf16": 3e-2, "o2_bf16": 3e-2}


def _train(level: str, graphs: bool, *overrides: str, epochs: int = 1):
    """The per-step losses of `epochs` epochs of STEPS steps, and the trainer."""
    cfg = compose_config(
        *FAST,
        f"data.num_train={32 * STEPS}",
        f"precision={level}",
        "scheduler=none",
        "trainer.device=cuda",
        f"trainer.max_epochs={epochs}",
        "trainer.log_every_n_steps=1",  # (the loss read between steps, never inside one)
        "trainer.cudnn_benchmark=false",  # (the same convolution algorithms in both runs)
        f"trainer.cuda_graphs={str(graphs).lower()}",
        *overrides,
    )
    return trained_losses(cfg, epochs, compile_warmup if cfg.trainer.compile else None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "level,optimizer",
    [("o2", "adam"), ("o2", "sgd"), ("o2_bf16", "adamw"), ("o1_bf16", "sgd"), ("o0", "sgd")],
)
def test_a_replayed_step_trains_as_the_eager_step(level, optimizer):
    eager, _ = _train(level, False, f"optimizer={optimizer}")
    graphed, trainer = _train(level, True, f"optimizer={optimizer}")
    assert_same_losses(eager, graphed, RTOL[level])
    graph = trainer.step_graph
    assert (graph.eager_steps, graph.captures) == (cuda_graphs.WARMUP_STEPS, 1)
    assert graph.replays == STEPS - cuda_graphs.WARMUP_STEPS  # the captured step's too


@pytest.mark.gpu
def test_skips_and_the_loss_scale_replay_as_the_eager_step_takes_them():
    """A loss scale of 2^24 in fp16 overflows at first, and grows back every 2 good steps: steps
    skip and scales change after the capture too, and the replayed step ends with the eager
    run's scale, skip count and Adam step counters (a skipped step leaves them as they were)."""
    trainer, eager_trainer = overflowing_runs(_train, RTOL["o2"])
    engine, eager_engine = trainer.engine, eager_trainer.engine
    assert int(engine.skipped_steps) == int(eager_engine.skipped_steps) >= 1
    assert step_counters(trainer.optimizer) == step_counters(eager_trainer.optimizer)
    assert trainer.step_graph.replays == STEPS - cuda_graphs.WARMUP_STEPS


@pytest.mark.gpu
def test_the_clip_is_captured_with_the_step():
    eager, _ = _train("o2", False, "trainer.grad_clip_norm=0.5")
    graphed, trainer = _train("o2", True, "trainer.grad_clip_norm=0.5")
    assert_same_losses(eager, graphed, RTOL["o2"])
    assert trainer.step_graph.replays == STEPS - cuda_graphs.WARMUP_STEPS


DECAY = ("scheduler=step", "scheduler.step_epochs=1", "scheduler.gamma=0.1")


@pytest.mark.gpu
def test_a_new_learning_rate_replays_the_same_graph_where_the_kernels_step():
    """scheduler=step decays the rate after the first epoch: the runner's kernels read it from
    the device (runner.precision.rates), so the one graph replays with the new rate and trains
    as the eager step."""
    eager, _ = _train("o2_bf16", False, *DECAY, epochs=2)
    graphed, trainer = _train("o2_bf16", True, *DECAY, epochs=2)
    assert_same_losses(eager, graphed, RTOL["o2_bf16"])
    graph = trainer.step_graph
    assert graph.captures == 1 and graph.rates.covers()
    assert graph.replays == 2 * STEPS - cuda_graphs.WARMUP_STEPS


@pytest.mark.gpu
def test_torchs_own_step_is_captured_again_with_a_new_learning_rate():
    """o1_bf16's SGD is torch's own (no precision work for the kernels): the rate is a number
    the capture holds, and the decay captures the step again."""
    eager, _ = _train("o1_bf16", False, "optimizer=sgd", *DECAY, epochs=2)
    graphed, trainer = _train("o1_bf16", True, "optimizer=sgd", *DECAY, epochs=2)
    assert_same_losses(eager, graphed, RTOL["o1_bf16"])
    graph = trainer.step_graph
    assert graph.captures == 2 and not graph.rates.covers()
    assert graph.replays == 2 * STEPS - cuda_graphs.WARMUP_STEPS


@pytest.mark.gpu
@pytest.mark.parametrize("level,optimizer", [("o2", "sgd"), ("o2", "adam"), ("o2_bf16", "adamw")])
def test_a_cosine_schedule_replays_one_graph_with_each_steps_rate(level, optimizer):
    """A new rate at every step, set in place on the device before each replay (no host read,
    no new capture): the losses and the final rate are the eager run's."""
    cosine = (f"optimizer={optimizer}", "scheduler=cosine")
    eager, eager_trainer = _train(level, False, *cosine)
    graphed, trainer = _train(level, True, *cosine)
    assert_same_losses(eager, graphed, RTOL[level])
    graph = trainer.step_graph
    assert graph.captures == 1
    assert graph.replays == STEPS - cuda_graphs.WARMUP_STEPS
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == eager_trainer.optimizer.param_groups[0]["lr"]
    graph.rates.refresh()
    rate = graph.rates.rate(group, group["params"][0].device)  # (the graph's own tensor)
    assert graph.rates.covers() and float(rate) == group["lr"]


@pytest.mark.gpu
def test_compiled_forward_and_backward_replay_as_graphs_too():
    """With trainer.compile the model compiles in reduce-overhead mode (CUDA graphs of its own)
    beside the captured step, and trains as the compiled eager-step run."""
    eager, _ = _train("o2_bf16", False, "trainer.compile=true")
    graphed, trainer = _train("o2_bf16", True, "trainer.compile=true")
    assert_same_losses(eager, graphed, RTOL["o2_bf16"])
    assert trainer.step_graph.replays == STEPS - cuda_graphs.WARMUP_STEPS


# ---- the benchmark's runs: both trainers of one run, their steps taken in turn ----------------
# (what a replay costs, eager against replayed, is benchmarks/graphs.py's: timings belong there)
def _pair(overrides: tuple[str, ...]) -> list[tuple]:
    """(trainer, parts, one batch on the device) of the run without and with cuda_graphs."""
    runs = []
    for graphs in (False, True):
        cfg = compose_config(
            *FAST,
            "scheduler=none",
            "trainer.device=cuda",
            "trainer.cudnn_benchmark=false",  # (the same convolution algorithms in both runs)
            f"trainer.cuda_graphs={str(graphs).lower()}",
            *overrides,
        )
        trainer, _, parts = planned_trainer(cfg)
        runs.append((trainer, parts, trainer.to_device(*next(iter(trainer.train_loader)))))
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "level,overrides",
    [
        ("o2", ("model=resnet18", "optimizer=adam", "trainer.batch_size=8")),
        (
            "o2_bf16",
            (
                "model=resnet50",
                "data.image_size=224",
                "data.num_train=128",
                "trainer.batch_size=64",
                "trainer.channels_last=true",
            ),
        ),
    ],
    ids=["resnet18_16px", "resnet50_224px"],
)
def test_the_benchmarks_runs_replay_every_step_as_the_eager_step_trains(level, overrides):
    """The runs benchmarks/graphs.py times (a host-bound and a GPU-bound one), stepped in turn
    on one batch: from the capture on every step is a replay of the one graph, and each step's
    loss is the eager trainer's."""
    steps = cuda_graphs.WARMUP_STEPS + 3
    runs = _pair((f"precision={level}", *overrides))
    losses: list[list[float]] = [[], []]
    try:
        for _ in range(steps):
            for k, (trainer, _, batch) in enumerate(runs):
                losses[k].append(float(trainer.train_step(*batch)))
    finally:
        for _, parts, _ in runs:
            parts.close()
    assert_same_losses(losses[0], losses[1], RTOL[level])
    graph = runs[1][0].step_graph
    assert (graph.eager_steps, graph.captures) == (cuda_graphs.WARMUP_STEPS, 1)
    assert graph.replays == steps - cuda_graphs.WARMUP_STEPS
