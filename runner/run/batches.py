"""An epoch's batches and optimizer steps, as `trainer.limit_*_batches` and
`trainer.accumulate_grad_batches` make them (the trainer, the build's schedule and trainer.tune
count them alike)."""

from __future__ import annotations

import math


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
