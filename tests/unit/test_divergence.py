"""The divergence guard: `trainer.max_bad_steps` consecutive skipped steps or non-finite losses stop
the run with a DivergenceError; real runs, real MLflow stores, no mocks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runner.errors import DivergenceError, RunnerError
from runner.run import app
from tests.helpers.runs import FAST, compose_config
from tests.helpers.store import only_run
from tests.helpers.trainer import make_trainer


# ---- the guard on a Trainer ------------------------------------------------------------------
def test_consecutive_skips_stop_at_the_step_they_reach_the_limit():
    """O2 at a static scale of 2^40 overflows the fp16 gradients: every step is skipped (the loss
    itself is finite)."""
    trainer, _ = make_trainer("O2", {"loss_scale": 2.0**40}, max_bad_steps=6)
    with pytest.raises(DivergenceError) as e:
        trainer.fit()
    # 4 steps per epoch: the streak carries over the epoch boundary and trips at step 6
    assert trainer.global_step == 6 and trainer.engine.skipped_steps == 6
    msg = str(e.value)
    assert "6 consecutive steps were skipped" in msg and "up to step 6" in msg
    assert "(trainer.max_bad_steps=6)" in msg
    assert "static loss scale 1.09951e+12" in msg and "precision.loss_scale" in msg
    # fp16: the loss scale and the level, not the fp32 advice
    assert "try a bf16 preset (precision=o2_bf16" in msg and "precision.layer_plan=auto" in msg
    assert "initialisation" not in msg
    assert isinstance(e.value, RunnerError)


def test_non_finite_losses_stop_at_the_next_periodic_read():
    """A huge lr blows the fp32 weights up after the first step: the loss is inf/NaN from step 2
    on, nothing is skipped (scale 1 has no check). The device-side counter is read only every
    log_every_n_steps (3) steps: detection lags up to then."""
    trainer, logged = make_trainer("O0", {}, max_bad_steps=1, scheduler="none")
    trainer.optimizer.param_groups[0]["lr"] = 1e30
    with pytest.raises(DivergenceError) as e:
        trainer.train_epoch(1)
    assert trainer.global_step == 3  # bad since step 2, read at step 3
    assert trainer.engine.skipped_steps == 0
    msg = str(e.value)
    assert msg.startswith(
        "training diverged: the loss was inf/NaN for 1 consecutive step, step 2 "
        "(trainer.max_bad_steps=1; found at step 3, when the loss was read)"
    )
    # the first step's read logged its (finite) loss; the run failed before logging a NaN
    losses = [(m["train_loss"], s) for m, s in logged if "train_loss" in m]
    assert len(losses) == 1 and losses[0][1] == 1 and math.isfinite(losses[0][0])


FP32_ADVICE = (
    "the run computes in fp32 (O0), so no 16-bit format is the cause: try a lower optimizer.lr "
    "(now 1e+30), check the model's initialisation (weights of a sane scale) and the data "
    "(inf/NaN values, unnormalised inputs)"
)


def test_an_fp32_run_is_told_the_learning_rate_initialisation_and_data():
    """O0 computes in fp32: no loss scale, 16-bit type or level is the cause. The count is
    `max_bad_steps` (2), however long the streak is by the read that finds it (step 4: the end of
    epoch 1; the loss is inf/NaN from step 2 on, 3 steps by then)."""
    trainer, _ = make_trainer("O0", {}, max_bad_steps=2, scheduler="none", log_every_n_steps=50)
    trainer.optimizer.param_groups[0]["lr"] = 1e30
    with pytest.raises(DivergenceError) as e:
        trainer.fit()
    msg = str(e.value)
    assert trainer.global_step == 4
    assert msg == (
        "training diverged: the loss was inf/NaN for 2 consecutive steps, steps 2 to 3 "
        "(trainer.max_bad_steps=2; found at step 4, when the loss was read): the training "
        f"itself produces non-finite values; {FP32_ADVICE}"
    )
    for wrong in ("loss scale", "fp16", "bf16", "precision=o"):
        assert wrong not in msg


def test_weights_gone_inf_nan_stop_the_run_at_the_epochs_end():
    """A streak shorter than trainer.max_bad_steps (50) by the run's end: the run ended FINISHED
    with inf/NaN weights, their accuracy chance's. Every later step starts from them: the epoch's
    end stops the run."""
    trainer, _ = make_trainer("O0", {}, scheduler="none", log_every_n_steps=50)
    trainer.optimizer.param_groups[0]["lr"] = 1e30
    with pytest.raises(DivergenceError) as e:
        trainer.fit()
    assert trainer.global_step == 4 and trainer.guard.max_bad_steps == 50
    assert str(e.value) == (
        "training diverged: the model's weights or buffers (a BatchNorm's running statistics) "
        "are inf/NaN after epoch 1 (step 4), and every later step would start from them; the "
        "last checkpoint, if any, is the last good state: the training itself produces "
        f"non-finite values; {FP32_ADVICE}"
    )


@pytest.mark.parametrize(
    "level, overrides, told",
    [
        ("O2", {}, "in fp16 the model produces non-finite values"),
        (
            "O2",
            {"cast_model_type": "bfloat16", "autocast_dtype": "bfloat16", "loss_scale": 1.0},
            "(in bf16, whose range is fp32's",
        ),
    ],
)
def test_a_16_bit_run_is_told_the_level(level, overrides, told):
    """fp16: a bf16 preset or fp32 layers (the loss scale cannot make a loss finite); bf16 has
    fp32's range: the learning rate, and fp32 to compare."""
    trainer, _ = make_trainer(level, overrides, max_bad_steps=2, scheduler="none")
    trainer.optimizer.param_groups[0]["lr"] = 1e30
    with pytest.raises(DivergenceError) as e:
        trainer.train_epoch(1)
    msg = str(e.value)
    assert "the loss was inf/NaN for 2 consecutive steps, steps 2 to 3" in msg and told in msg
    if "bf16" in told:
        assert "try a lower optimizer.lr (now 1e+30)" in msg
        assert "or precision=o0 to see whether fp32 trains" in msg
    else:
        assert "try a bf16 preset (precision=o2_bf16: fp32's range, no loss scale)" in msg
        assert "or precision=o0 to tell (if fp32 diverges too: a lower optimizer.lr)" in msg
    assert "initialisation" not in msg


def test_skips_of_an_fp32_run_name_its_loss_scale_and_the_fp32_advice():
    """O0 with a static loss scale of 2^200 (a user's override): the scaled fp32 gradients
    overflow at every step, the loss stays finite."""
    trainer, _ = make_trainer("O0", {"loss_scale": 2.0**200}, max_bad_steps=3)
    with pytest.raises(DivergenceError) as e:
        trainer.fit()
    msg = str(e.value)
    assert msg.startswith(
        "training diverged: 3 consecutive steps were skipped (inf/NaN gradients) up to step 3 "
        "(trainer.max_bad_steps=3): the static loss scale 1.60694e+60 overflows the gradients "
        "even in fp32 (an fp32 run needs none: precision.loss_scale=1); the run computes in fp32 "
        "(O0), so no 16-bit format is the cause"
    )
    assert "precision=o2" not in msg and "bf16" not in msg


def test_bad_steps_below_the_limit_or_interrupted_do_not_trip_the_guard():
    trainer, _ = make_trainer("O2", {"loss_scale": 2.0**40}, max_bad_steps=3, limit_train_batches=1)
    trainer.fit()  # two skipped steps in a row (one per epoch): below the limit
    assert trainer.guard.skip_streak == 2 and trainer.engine.skipped_steps == 2
    trainer, _ = make_trainer("O0", {}, max_bad_steps=2)
    trainer.guard.skip_streak = 1  # a clean step resets the streak
    trainer.train_epoch(1)
    assert trainer.guard.skip_streak == 0 and trainer.engine.skipped_steps == 0
    assert int(trainer.guard.bad_loss_streak) == 0


def test_guard_adds_no_host_sync_to_a_step():
    """O0 at scale 1 reads nothing from the device per step; the guard must not either."""

    class CountSyncs(TorchDispatchMode):
        syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
                CountSyncs.syncs += 1
            return func(*args, **(kwargs or {}))

    trainer, _ = make_trainer("O0", {})
    x, y = next(iter(trainer.train_loader))
    with CountSyncs():
        for _ in range(3):
            trainer.train_step(x, y)
    assert CountSyncs.syncs == 0
    assert int(trainer.guard.bad_loss_streak) == 0


# ---- real runs -------------------------------------------------------------------------------
def _failed_run(tracking_uri, overrides, needle):
    cfg = compose_config(*FAST, *overrides, f"mlflow.tracking_uri={tracking_uri}")
    with pytest.raises(DivergenceError) as e:
        app.run(cfg, overrides=overrides)
    assert needle in str(e.value)
    _, run = only_run(tracking_uri)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("DivergenceError: training diverged")
    assert needle in run.data.tags["error"]
    return str(e.value), run


def test_pure_fp16_overflowing_every_step_fails_the_run(tracking_uri):
    """O3 with a static scale of 1e10: fp16 gradients overflow at every step."""
    msg, run = _failed_run(
        tracking_uri,
        ["precision=o3", "precision.loss_scale=1e10", "trainer.max_bad_steps=2"],
        "2 consecutive steps were skipped (inf/NaN gradients) up to step 2",
    )
    assert run.data.params["trainer.max_bad_steps"] == "2"


def test_non_finite_loss_fails_the_run(tracking_uri):
    """O0 with an absurd lr: the loss is inf/NaN from step 2 on; read at the epoch's end (step 3:
    3 batches per epoch, log_every_n_steps 2)."""
    msg, _ = _failed_run(
        tracking_uri,
        ["precision=o0", "optimizer.lr=1e30", "scheduler=none", "trainer.max_bad_steps=2"],
        "the loss was inf/NaN for 2 consecutive steps, steps 2 to 3 (trainer.max_bad_steps=2)",
    )
    assert "the run computes in fp32 (O0)" in msg and "precision=o2" not in msg
