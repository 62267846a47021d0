"""The training loop with real parts: schedulers under skipped steps, clipping, logging cadence."""

from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from runner.components.data import build_datasets, build_loaders
from runner.components.models import build_model
from runner.components.optim import build_optimizer, build_scheduler
from runner.config import SyntheticConfig, TinyModelConfig, TrainerConfig
from runner.measure.probes import MemoryProbe
from runner.precision import AmpEngine, resolve
from runner.run.trainer import RunContext, Trainer
from tests.conftest import compose_config

CPU = torch.device("cpu")


def make_trainer(level: str, precision_overrides: dict, scheduler: str = "cosine", **trainer_kw):
    cfg = compose_config("optimizer=sgd", f"scheduler={scheduler}")
    data = build_datasets(
        OmegaConf.structured(
            SyntheticConfig(name="synthetic", num_train=64, num_val=16, image_size=8)
        )
    )
    train_loader, val_loader = build_loaders(data, 16, 0, "cpu", seed=0)
    model = build_model(OmegaConf.structured(TinyModelConfig(name="tiny", width=4)), 10, 8)
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    engine = AmpEngine(resolve(level, precision_overrides, device=CPU).properties, CPU)
    model, optimizer = engine.prepare(model, optimizer)
    trainer_cfg = OmegaConf.structured(
        TrainerConfig(max_epochs=2, progress_bar=False, log_every_n_steps=3, **trainer_kw)
    )
    scheduler = build_scheduler(cfg.scheduler, optimizer, len(train_loader), trainer_cfg.max_epochs)
    logged: list[tuple[dict, int]] = []
    trainer = Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        train_loader=train_loader,
        val_loader=val_loader,
        device=CPU,
        cfg=trainer_cfg,
        memory=MemoryProbe(CPU),
        context=RunContext(on_metrics=lambda m, s: logged.append((dict(m), s))),
    )
    return trainer, logged


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
