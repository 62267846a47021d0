"""`trainer.cuda_graphs=step` on a GPU: the whole training step (forward, loss, backward, clip, the
engine's step) captured once after its eager warm-up steps and replayed trains as the eager step
does, at every level: the same loss at every one of 50 steps, BatchNorm's running statistics and
dropout's draws included (a small CNN with both), bit for bit where cuDNN is deterministic;
overflowing steps skipped inside the graph exactly as eagerly; the epoch's last, partial batch
run eagerly beside the graph; a run resumed from its checkpoint as the eager run resumed; the
device's busy share logged, and higher with the graph on a launch-bound step; trainer.tune's
candidate measured with its capture charged as a compile."""

from __future__ import annotations

import logging

import pytest
import torch

from runner.run import app, whole_step
from tests.helpers.resume import settings
from tests.helpers.runs import FAST, compose_config
from tests.helpers.store import history, runs_by_name
from tests.helpers.trainer import (
    assert_same_losses,
    overflowing_runs,
    step_counters,
    trained_losses,
)

STEPS = 50  # a batch of 32 from 1600 samples: warm-up, a capture, replays
LEVELS = ["o0", "o1", "o2", "o3", "o1_bf16", "o2_bf16"]
# how far the losses of two runs may drift apart through the convolutions' nondeterministic
# reductions (cuDNN's default algorithms): a few units of the format the level computes in
# (fp16 and O0's TF32 convolutions 2^-10, O3's fp16 weights and sums more, bf16 2^-7)
RTOL = {"o0": 4e-3, "o1": 4e-3, "o2": 4e-3, "o3": 1e-2, "o1_bf16": 3e-2, "o2_bf16": 3e-2}
MODEL = ["model=custom", "model._target_=tests.helpers.graph_models.DropoutCNN"]


def _config(level: str, graphs: bool, *overrides: str, samples: int = 32 * STEPS):
    return compose_config(
        *FAST,
        *MODEL,
        f"data.num_train={samples}",
        f"precision={level}",
        "optimizer=sgd",
        "scheduler=none",
        "trainer.device=cuda",
        "trainer.log_every_n_steps=1",  # (the loss read between steps, never inside one)
        "trainer.cudnn_benchmark=false",  # (the same convolution algorithms in both runs)
        f"trainer.cuda_graphs={'step' if graphs else 'false'}",
        *overrides,
    )


def _train(level: str, graphs: bool, *overrides: str, epochs: int = 1, **kw):
    """The per-step losses of `epochs` epochs, and the trainer (its parts closed)."""
    cfg = _config(level, graphs, f"trainer.max_epochs={epochs}", *overrides, **kw)
    return trained_losses(cfg, epochs)


def _state(trainer) -> dict[str, torch.Tensor]:
    """The model's weights and buffers (BatchNorm's running statistics and batch counts)."""
    return {k: v.detach().float().cpu() for k, v in trainer.module.state_dict().items()}


def _replayed(graph: whole_step.WholeStepGraph, steps: int) -> None:
    """Every step was the graph's (warm-up, capture, replays) but those watched or of another
    shape, which ran eagerly beside it: a handful, at the session's start."""
    assert (graph.eager_steps, graph.captures) == (whole_step.WARMUP_STEPS, 1)
    assert graph.eager_steps + graph.replays + graph.beside == steps
    assert graph.replays >= steps - 10, graph.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("level", LEVELS)
def test_a_captured_step_trains_as_the_eager_step_at_every_level(level):
    """50 steps of a CNN with BatchNorm and dropout: the same loss at every step, and the same
    weights and running statistics after them, within the level's format."""
    eager, eager_trainer = _train(level, False)
    graphed, trainer = _train(level, True)
    assert_same_losses(eager, graphed, RTOL[level])
    _replayed(trainer.whole_step, STEPS)
    want, got = _state(eager_trainer), _state(trainer)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL[level], atol=RTOL[level])
    assert trainer.engine.skipped_steps == eager_trainer.engine.skipped_steps
    assert float(trainer.engine.loss_scale) == float(eager_trainer.engine.loss_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["o0", "o2", "o2_bf16"])
def test_with_deterministic_cudnn_the_replayed_step_is_the_eager_step_bit_for_bit(
    level, monkeypatch
):
    """A replay runs the kernels the eager step launches, on the same values: with cuDNN's
    deterministic algorithms nothing differs, dropout's masks included (each replay draws at
    the generator's offset the eager step would have)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    eager, eager_trainer = _train(level, False)
    graphed, trainer = _train(level, True)
    assert graphed == eager
    want, got = _state(eager_trainer), _state(trainer)
    assert all(torch.equal(got[key], want[key]) for key in want), level
    _replayed(trainer.whole_step, STEPS)


@pytest.mark.gpu
def test_overflowing_steps_are_skipped_inside_the_graph_as_eagerly():
    """A loss scale of 2^24 overflows fp16 at first and grows back every 2 good steps: steps
    overflow and are skipped after the capture too, each inside a replay; the run ends with
    the eager run's scale, skip count, skip streak and Adam step counters."""
    trainer, eager_trainer = overflowing_runs(_train, RTOL["o2"])
    engine, eager_engine = trainer.engine, eager_trainer.engine
    graph = trainer.whole_step
    skipped = int(engine.skipped_steps)
    assert skipped == int(eager_engine.skipped_steps)
    assert skipped > graph.eager_steps + graph.beside  # (some skipped inside replays)
    assert trainer.guard.skip_streak == eager_trainer.guard.skip_streak
    counters = step_counters(trainer.optimizer)
    eager_counters = step_counters(eager_trainer.optimizer)
    assert counters == eager_counters and counters[0] == STEPS - skipped
    assert graph.replays >= STEPS - 20, graph.summary()  # (the first overflows: eager, watched)


@pytest.mark.gpu
def test_the_epochs_last_partial_batch_runs_eagerly_beside_the_graph():
    """1600 + 8 samples: each epoch ends with a batch of 8, another shape than the captured
    one's, which the trainer's own step takes; the graph replays again after it (the next
    epoch), and the losses are the eager run's."""
    eager, _ = _train("o2", False, epochs=2, samples=32 * STEPS + 8)
    graphed, trainer = _train("o2", True, epochs=2, samples=32 * STEPS + 8)
    assert_same_losses(eager, graphed, RTOL["o2"])
    graph = trainer.whole_step
    assert graph.beside >= 2 and graph.captures == 1
    _replayed(graph, 2 * (STEPS + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["o0", "o2"])
def test_a_resumed_graph_run_trains_as_the_resumed_eager_run(tmp_path, level):
    """One epoch, then resume=auto to two, with and without the graph: the checkpoint is
    restored before fit, before any capture, and every logged figure of the resumed runs
    agrees (each session warms up and captures anew)."""
    for graphs in ("false", "step"):
        common = settings(
            tmp_path,
            *MODEL,
            "data.num_train=640",  # (20 steps an epoch: warm-up, capture and replays in each)
            f"precision={level}",
            "optimizer=sgd",
            "scheduler=none",
            "trainer.device=cuda",
            "trainer.cudnn_benchmark=false",
            f"trainer.cuda_graphs={graphs}",
        )
        name = f"mlflow.run_name=resumed-{graphs}"
        app.run(compose_config(*common, "trainer.max_epochs=1", name))
        app.run(compose_config(*common, "trainer.max_epochs=2", name, "resume=auto"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = runs_by_name(uri)
    eager, graphed = (history(uri, runs[f"resumed-{g}"].info.run_id) for g in ("false", "step"))
    assert eager.keys() == graphed.keys() and eager["train_loss"]
    for metric, points in eager.items():
        steps = [s for s, _ in points]
        assert [s for s, _ in graphed[metric]] == steps, metric
        assert_same_losses([v for _, v in points], [v for _, v in graphed[metric]], RTOL[level])


@pytest.mark.gpu
def test_the_busy_share_is_logged_once_and_the_graph_raises_it(tmp_path, caplog):
    """A launch-bound step (a small CNN, batch 32, 16 px): device_busy_frac is logged once per
    run, said in the summary line, and higher with the whole step replayed."""
    from tests.helpers.store import only_run

    busy = {}
    for graphs in ("false", "step"):
        folder = tmp_path / graphs
        folder.mkdir()
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        cfg = _config("o2", graphs == "step", "trainer.max_epochs=1", f"mlflow.tracking_uri={uri}")
        with caplog.at_level(logging.INFO, logger="runner"):
            app.run(cfg)
        client, run = only_run(uri)
        (point,) = client.get_metric_history(run.info.run_id, "device_busy_frac")
        assert 0.0 < point.value <= 1.0
        busy[graphs] = point.value
    finished = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished")]
    assert len(finished) == 2 and all(", device busy " in line for line in finished), finished
    assert busy["step"] > busy["false"], busy


@pytest.mark.gpu
def test_tuning_measures_the_whole_step_with_its_capture_charged_as_a_compile():
    """The candidate's timed steps are replays (its warm-up and capture before them), and what
    those took over a steady step is its compile_s, which the run's steps repay or not."""
    from runner.run.distributed import Comm
    from runner.run.measured import measured_plan
    from runner.run.plan import make_plan
    from runner.run.recorded import Launch

    command = [*FAST, *MODEL, "precision=o2", "scheduler=none", "trainer.device=cuda"]
    command += ["trainer.tune=on", "trainer.compile=false"]  # (no compile to spend the budget)
    given = make_plan(compose_config(*command))
    _, tuning = measured_plan(given, Comm(), torch.device("cuda"), Launch(tuple(command)))
    (row,) = [r for r in tuning.rows if r.settings.get("trainer.cuda_graphs") == "step"]
    assert row.note == "" and row.steady_ms is not None and row.compile_s > 0, tuning.table()
