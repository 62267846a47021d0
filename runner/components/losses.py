"""The loss: the criterion `loss._target_` names (cross-entropy by default)."""

from __future__ import annotations

import torch

from runner.config import targets
from runner.errors import ConfigError


def build_loss(cfg) -> torch.nn.Module:
    """The criterion `loss._target_` names (torch.nn.CrossEntropyLoss by default, and for a
    config without a loss group), called as criterion(logits, targets)."""
    if "loss" not in cfg:
        return torch.nn.CrossEntropyLoss()
    criterion = targets.call("loss", cfg.loss)
    if not isinstance(criterion, torch.nn.Module):
        raise ConfigError(
            "loss._target_",
            f"{cfg.loss._target_} returned a "
            f"{type(criterion).__name__}, not an nn.Module (a criterion)",
        )
    return criterion
