"""A Trainer built from real parts (synthetic data, the tiny CNN, an engine at a level) without a
run around it, recording what it logs; or from a composed config through the run's own plan and
build (`planned_trainer`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from omegaconf import OmegaConf

from runner.components.data import build_datasets
from runner.components.loaders import build_loaders
from runner.components.models import build_model
from runner.components.optim import build_optimizer, build_scheduler
from runner.config import SyntheticConfig, TinyModelConfig, TrainerConfig
from runner.measure.probes import MemoryProbe
from runner.precision import AmpEngine, resolve
from runner.run.batches import optimizer_steps
from runner.run.build import build
from runner.run.context import RunContext
from runner.run.parts import Parts
from runner.run.plan import make_plan
from runner.run.trainer import Trainer, trainer_config
from tests.helpers.runs import compose_config

CPU = torch.device("cpu")


def make_trainer(
    level: str,
    precision_overrides: dict,
    scheduler: str = "cosine",
    *,
    batch_size: int = 16,
    norm: str = "batch",
    kernels: str = "torch",
    artifacts: Optional[list] = None,
    **trainer_kw,
):
    """A Trainer of the tiny CNN (`norm`: batch or group) on 64 synthetic 8-px images in batches
    of `batch_size` (shuffled alike whatever the size), SGD, at `level` (with `kernels`); the
    files it hands on, (path, artifact folder), appended to `artifacts` where given."""
    cfg = compose_config("optimizer=sgd", f"scheduler={scheduler}")
    data = build_datasets(
        OmegaConf.structured(
            SyntheticConfig(name="synthetic", num_train=64, num_val=16, image_size=8)
        )
    )
    train_loader, val_loader = build_loaders(data, batch_size, 0, "cpu", seed=0)
    tiny = TinyModelConfig(name="tiny", width=4, norm=norm)
    model = build_model(OmegaConf.structured(tiny), 10, 8)
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    properties = resolve(level, precision_overrides, device=CPU).properties
    engine = AmpEngine(properties, CPU, kernels=kernels)
    model, optimizer = engine.prepare(model, optimizer)
    settings = {"max_epochs": 2, "progress_bar": False, "log_every_n_steps": 3, **trainer_kw}
    trainer_cfg = TrainerConfig(**settings)
    steps = optimizer_steps(len(train_loader), trainer_cfg.accumulate_grad_batches)
    scheduler = build_scheduler(cfg.scheduler, optimizer, steps, trainer_cfg.max_epochs)
    logged: list[tuple[dict, int]] = []
    parts = Parts(
        data, train_loader, val_loader, model, optimizer, engine, scheduler, MemoryProbe(CPU)
    )
    trainer = Trainer(
        trainer_cfg,
        parts,
        RunContext(
            on_metrics=lambda m, s: logged.append((dict(m), s)),
            on_artifact=None if artifacts is None else lambda p, d: artifacts.append((p, d)),
        ),
        device=CPU,
    )
    return trainer, logged


def planned_trainer(cfg) -> tuple[Trainer, list[dict], Parts]:
    """The Trainer a run of `cfg` would train with (its plan checked, its parts built), the list
    each logging step's metrics are appended to, and the parts (to close)."""
    plan = make_plan(cfg)
    parts = build(plan)
    logged: list[dict] = []
    trainer = Trainer(
        trainer_config(cfg.trainer),
        parts,
        RunContext(on_metrics=lambda metrics, step: logged.append(dict(metrics))),
        device=plan.device,
    )
    return trainer, logged, parts


def trained_losses(
    cfg, epochs: int, before: Optional[Callable[[Trainer], None]] = None
) -> tuple[list[float], Trainer]:
    """The train losses logged over `epochs` epochs of the trainer a run of `cfg` would train
    with (`before`: called on it first, e.g. compile's warm-up), and the trainer (parts closed)."""
    trainer, logged, parts = planned_trainer(cfg)
    try:
        if before is not None:
            before(trainer)
        for epoch in range(1, epochs + 1):
            trainer.train_epoch(epoch)
    finally:
        parts.close()
    return [m["train_loss"] for m in logged if "train_loss" in m], trainer


def assert_same_losses(want: list[float], got: list[float], rtol: float) -> None:
    """As many losses, all finite, each within `rtol` (relative and absolute) of its twin."""
    assert len(want) == len(got) and all(map(torch.isfinite, torch.tensor(got)))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=rtol)


OVERFLOWING = ("optimizer=adam", "precision.init_scale=16777216", "precision.growth_interval=2")
"""O2 overrides whose loss scale (2^24) overflows fp16 at first and grows back every 2 good
steps: steps are skipped and the scale changes after a graph's capture too."""


def overflowing_runs(
    train: Callable[..., tuple[list[float], Trainer]], rtol: float
) -> tuple[Trainer, Trainer]:
    """`train(level, graphs, *overrides)` at O2 with OVERFLOWING, eagerly and graphed: their
    losses within `rtol` and the same final loss scale; (the graphed trainer, the eager one)."""
    eager, eager_trainer = train("o2", False, *OVERFLOWING)
    graphed, trainer = train("o2", True, *OVERFLOWING)
    assert_same_losses(eager, graphed, rtol)
    assert float(trainer.engine.loss_scale) == float(eager_trainer.engine.loss_scale)
    return trainer, eager_trainer


def step_counters(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each parameter's step counter in `optimizer`'s state (Adam's; a skipped step leaves it)."""
    return [float(state["step"]) for state in optimizer.state.values() if "step" in state]
