"""The training loop with real parts: schedulers under skipped steps, clipping, logging cadence."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.trainer import make_trainer


@pytest.mark.parametrize("scheduler", ["cosine", "step", "onecycle"])
def test_scheduler_advances_once_per_attempt_even_when_every_step_is_skipped(scheduler):
    """A static scale of 2^40 overflows fp16 gradients, so every step is skipped (a known Apex
    failure: the schedule froze or PyTorch warned); the schedule must still follow the data."""
    trainer, _ = make_trainer("O2", {"loss_scale": 2.0**40}, scheduler=scheduler)
    masters_before = [p.detach().clone() for p in trainer.engine.master_params(trainer.optimizer)]
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_epoch(1)
    attempts = trainer.train_batches
    assert trainer.engine.skipped_steps == attempts == 4
    assert trainer.scheduler.last_epoch == attempts
    assert trainer.optimizer.param_groups[0]["lr"] != lr_before or scheduler == "step"
    for before, after in zip(masters_before, trainer.engine.master_params(trainer.optimizer)):
        assert torch.equal(before, after)  # nothing reached the weights
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [
        str(w.message) for w in caught
    ]


LEVELS = [
    ("O0", {}),
    ("O1", {"autocast_dtype": "bfloat16"}),
    ("O2", {}),
    ("O2", {"cast_model_type": "bfloat16", "loss_scale": 1.0}),
    ("O3", {}),
    ("O3", {"loss_scale": "dynamic"}),
]


@pytest.mark.parametrize("scheduler", ["cosine", "step", "onecycle"])
@pytest.mark.parametrize("level,overrides", LEVELS, ids=lambda v: str(v))
def test_scheduler_steps_once_per_attempt_at_every_level_without_warnings(
    level, overrides, scheduler
):
    """Steps that are taken, at every level and type (fp16 is emulated here, the model tiny):
    the schedule advances once per step and PyTorch says nothing about the call order."""
    trainer, _ = make_trainer(level, overrides, scheduler=scheduler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_epoch(1)
    assert trainer.engine.skipped_steps < trainer.train_batches  # real steps, not only skips
    assert trainer.scheduler.last_epoch == trainer.train_batches == 4
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [
        str(w.message) for w in caught
    ]


def test_fit_logs_every_n_steps_and_each_epoch():
    trainer, logged = make_trainer("O0", {})
    result = trainer.fit()
    loss_steps = [s for m, s in logged if "train_loss" in m]
    # 4 steps per epoch, log every 3: step 3, the epoch's remainder at 4, then 6 and 8.
    assert loss_steps == [3, 4, 6, 8]
    epoch_steps = [s for m, s in logged if "val_acc" in m]
    assert epoch_steps == [1, 2]
    final = [m for m, s in logged if "best_val_acc" in m][0]
    assert final["best_val_acc"] == result.best_val_acc
    assert final["train_time_s"] >= sum(e["epoch_time_s"] for e in result.epochs)


def test_grad_clipping_bounds_the_update():
    """With clipping at 1e-3, one SGD step (lr 0.1, no momentum yet) moves the fp32 masters by at
    most lr * 1e-3 in L2 norm, whatever the loss scale (clipping sees unscaled gradients)."""
    trainer, _ = make_trainer("O2", {}, grad_clip_norm=1e-3, limit_train_batches=1)
    params = list(trainer.engine.master_params(trainer.optimizer))
    before = [p.detach().clone() for p in params]
    trainer.train_epoch(1)
    assert trainer.engine.skipped_steps == 0
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(params, before)))
    lr = trainer.optimizer.param_groups[0]["initial_lr"]
    # weight decay adds lr * wd * |w| to the step; bound it generously but far below unclipped
    decay = lr * 5e-4 * torch.sqrt(sum((b**2).sum() for b in before))
    assert 0 < moved <= lr * 1e-3 + decay + 1e-6
