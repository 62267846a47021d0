"""An epoch's batches and optimizer steps, as `trainer.limit_*_batches` and
`trainer.accumulate_grad_batches` make them (the trainer, the build's schedule and trainer.tune
count them alike)."""

from __future__ import annotations

import math
from typing import Any, Optional

from omegaconf import OmegaConf

from runner.config.options import LANGUAGE_MODEL, Spec


def limit_batches(n_batches: int, limit: int | float | None) -> int:
    """Batches per epoch after `trainer.limit_*_batches`: None all, an integer at most that many,
    a number in (0, 1] that share of them (rounded down, as Lightning's, but at least one)."""
    if limit is None:
        return n_batches
    if isinstance(limit, float):
        return min(n_batches, max(1, int(n_batches * limit)))
    return min(n_batches, limit)


def optimizer_steps(batches: int, accumulate: int) -> int:
    """An epoch's optimizer steps over its `batches`, `trainer.accumulate_grad_batches` a step
    (the last step takes the batches left)."""
    return math.ceil(batches / accumulate)


def _train_size(cfg: Any, task: str, data: Optional[Spec], datasets: Any) -> Optional[int]:
    """The training samples as the config tells them (`data`: its spec's `train_size`, or
    `data.num_train`; a language model's tokens cut into sequences of `data.block_size`), else
    the loaded `datasets`' (None where neither tells)."""
    size = data.train_size(cfg.data) if data is not None and data.train_size else None
    if size is None:
        size = OmegaConf.select(cfg, "data.num_train", default=None)
        block = OmegaConf.select(cfg, "data.block_size", default=None)
        if isinstance(size, int) and task == LANGUAGE_MODEL:  # tokens, cut into sequences
            size = (size - 1) // block if isinstance(block, int) and block > 0 else None
    if not isinstance(size, int) and datasets is not None:
        size = len(datasets.train)
    return size if isinstance(size, int) else None


def estimated_steps(
    cfg: Any,
    task: str,
    data: Optional[Spec] = None,
    datasets: Any = None,
    world_size: int = 1,
) -> Optional[int]:
    """A run's training steps (its batches: one an optimizer step with no accumulation) as its
    config tells them, for each of `world_size` ranks (each trains on its share of the samples,
    DistributedSampler's, padded to equal shares): from `trainer.limit_train_batches`, the
    data's size (`_train_size`), or the loaded `datasets`; None where only the data can tell and
    none are given."""
    limit = cfg.trainer.limit_train_batches
    per_epoch = limit if isinstance(limit, int) else None  # (a share: of a count to be known)
    size = _train_size(cfg, task, data, datasets if per_epoch is None else None)
    if size is not None:
        batches = math.ceil(math.ceil(size / world_size) / cfg.trainer.batch_size)
        per_epoch = limit_batches(batches, limit)
    return None if per_epoch is None else per_epoch * cfg.trainer.max_epochs


def estimated_samples(cfg: Any, task: str, data: Optional[Spec] = None) -> Optional[int]:
    """The samples a run trains on over its epochs (`estimated_steps`' batches, the last of an
    epoch as short as the data leaves it: 16 samples make one batch of 16, not of
    trainer.batch_size); None where the steps are unknown."""
    steps = estimated_steps(cfg, task, data)
    if steps is None:
        return None
    epochs = cfg.trainer.max_epochs
    per_epoch = steps // epochs * cfg.trainer.batch_size
    size = _train_size(cfg, task, data, None)
    return (per_epoch if size is None else min(per_epoch, size)) * epochs
