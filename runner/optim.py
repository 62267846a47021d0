"""Optimizers and LR schedulers from config.

Schedulers are built per optimizer-step attempt (not per epoch), so the trainer steps them once per
attempt, skipped steps included: the schedule stays aligned with the data at every precision level.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler


def build_optimizer(cfg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            dampening=cfg.dampening,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
        )
    if cfg.name in ("adam", "adamw"):
        cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
        return cls(
            params,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            amsgrad=cfg.amsgrad,
        )
    raise ValueError(f"unknown optimizer {cfg.name!r}")  # validation rejects it earlier


def build_scheduler(
    cfg, optimizer: torch.optim.Optimizer, steps_per_epoch: int, max_epochs: int
) -> LRScheduler | None:
    total_steps = max(1, steps_per_epoch * max_epochs)
    if cfg.name == "none":
        return None
    if cfg.name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=total_steps, eta_min=cfg.eta_min
        )
    if cfg.name == "step":
        return torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=max(1, cfg.step_epochs * steps_per_epoch), gamma=cfg.gamma
        )
    if cfg.name == "onecycle":
        max_lr = cfg.max_lr if cfg.max_lr is not None else optimizer.param_groups[0]["lr"]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=max_lr,
            total_steps=total_steps,
            pct_start=cfg.pct_start,
            div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor,
        )
    raise ValueError(f"unknown scheduler {cfg.name!r}")


def rebuild_scheduler_at(cfg, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                         max_epochs: int, step: int, base_lr: float) -> LRScheduler | None:
    """The schedule for a new length, positioned at `step`: for a resumed run whose
    `trainer.max_epochs` changed (a cosine or one-cycle schedule of the old length would turn
    back up, or refuse to step, past its end). Every group's lr goes back to `base_lr` (the
    configured optimizer.lr) without the old scheduler's keys, a fresh scheduler of the new
    length is built and stepped `step` times (no optimizer step)."""
    for group in optimizer.param_groups:
        for key in ("initial_lr", "max_lr", "min_lr"):
            group.pop(key, None)
        group["lr"] = base_lr
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch, max_epochs)
    if scheduler is not None:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended
            warnings.simplefilter("ignore")
            for _ in range(step):
                scheduler.step()
    return scheduler
