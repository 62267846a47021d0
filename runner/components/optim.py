"""Optimizers and LR schedulers from config: each option's builder (named by its spec in
`runner.config.options`).

Schedulers are built per optimizer-step attempt (not per epoch), so the trainer steps them once per
attempt, skipped steps included: the schedule stays aligned with the data at every precision level.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from typing import Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from runner.config import options

log = logging.getLogger(__name__)


def build_optimizer(
    cfg, params: Iterable[torch.nn.Parameter], spec: Optional[options.Spec] = None
) -> torch.optim.Optimizer:
    """The optimizer of `cfg`'s option (its builder in `runner.config.options.SPECS`; `spec`: the
    option's, where the caller has it). A low-bit `precision.optimizer_state` replaces it with
    torchao's optimizer of the same hyperparameters: `runner.run.build`."""
    return _spec("optimizer", cfg, spec).build()(cfg, list(params))


def build_scheduler(
    cfg,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    max_epochs: int,
    spec: Optional[options.Spec] = None,
) -> LRScheduler | None:
    """The scheduler of `cfg`'s option, over `max_epochs` epochs of `steps_per_epoch` steps."""
    return _spec("scheduler", cfg, spec).build()(cfg, optimizer, steps_per_epoch, max_epochs)


def _spec(group: str, cfg, spec: Optional[options.Spec] = None) -> options.Spec:
    spec = spec or options.spec_for(group, cfg)
    if spec is None:  # validation rejects it earlier
        raise ValueError(f"unknown {group} {getattr(cfg, 'name', None)!r}")
    return spec


def build_sgd(cfg, params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=cfg.momentum,
        dampening=cfg.dampening,
        weight_decay=cfg.weight_decay,
        nesterov=cfg.nesterov,
    )


def _adam(cls: type, cfg, params: list) -> torch.optim.Optimizer:
    return cls(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        amsgrad=cfg.amsgrad,
    )


def build_adam(cfg, params: list) -> torch.optim.Optimizer:
    return _adam(torch.optim.Adam, cfg, params)


def build_adamw(cfg, params: list) -> torch.optim.Optimizer:
    return _adam(torch.optim.AdamW, cfg, params)


def _total_steps(steps_per_epoch: int, max_epochs: int) -> int:
    return max(1, steps_per_epoch * max_epochs)


def build_no_scheduler(cfg, optimizer, steps_per_epoch: int, max_epochs: int) -> None:
    return None


def build_cosine(cfg, optimizer, steps_per_epoch: int, max_epochs: int) -> LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=_total_steps(steps_per_epoch, max_epochs), eta_min=cfg.eta_min
    )


def build_step(cfg, optimizer, steps_per_epoch: int, max_epochs: int) -> LRScheduler:
    if cfg.step_epochs >= max_epochs:
        log.warning(
            "scheduler.step_epochs=%d with trainer.max_epochs=%d: the learning rate never "
            "decays in this run (scheduler=step multiplies it by gamma=%g every step_epochs "
            "epochs)",
            cfg.step_epochs,
            max_epochs,
            cfg.gamma,
        )
    return torch.optim.lr_scheduler.StepLR(
        optimizer, step_size=max(1, cfg.step_epochs * steps_per_epoch), gamma=cfg.gamma
    )


def build_onecycle(cfg, optimizer, steps_per_epoch: int, max_epochs: int) -> LRScheduler:
    max_lr = cfg.max_lr if cfg.max_lr is not None else optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=max_lr,
        total_steps=_total_steps(steps_per_epoch, max_epochs),
        pct_start=cfg.pct_start,
        div_factor=cfg.div_factor,
        final_div_factor=cfg.final_div_factor,
    )


def rebuild_scheduler_at(
    cfg,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    max_epochs: int,
    step: int,
    base_lr: float,
) -> LRScheduler | None:
    """The schedule for a new length, positioned at `step`: for a resumed run whose
    `trainer.max_epochs` changed (a cosine or one-cycle schedule of the old length would turn
    back up, or refuse to step, past its end). Every group's lr goes back to `base_lr` (the
    configured optimizer.lr) without the old scheduler's keys, a fresh scheduler of the new
    length is built and stepped `step` times (no optimizer step)."""
    for group in optimizer.param_groups:
        for key in ("initial_lr", "max_lr", "min_lr"):
            group.pop(key, None)
        if torch.is_tensor(group["lr"]):  # torchao's low-bit optimizers keep lr a tensor
            group["lr"].fill_(base_lr)
        else:
            group["lr"] = base_lr
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch, max_epochs)
    if scheduler is not None:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended
            warnings.simplefilter("ignore")
            for _ in range(step):
                scheduler.step()
    return scheduler
