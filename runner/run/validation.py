"""Validation: the model over each rank's share of the validation batches, under the engine's
autocast, its loss (the training criterion) and accuracy per sample (a classifier) or per token (a
language model: runner.tasks), summed over the ranks once at the end."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


@torch.no_grad()
def evaluate(trainer: Any) -> tuple[float, float]:
    """(mean loss, accuracy) of `trainer`'s model over the validation batches of all ranks (each
    rank evaluates its own share with the model itself: no collective inside the loop): per
    sample for a classifier, per token for a language model (runner.tasks)."""
    trainer.module.eval()
    loss_sum = torch.zeros((), device=trainer.device, dtype=torch.float64)
    correct = torch.zeros((), device=trainer.device, dtype=torch.float64)
    seen = 0
    last = None
    batches = min(len(trainer.val_loader), trainer.val_batches)
    # a sharded model's forward is a collective: every rank runs as many as the one with
    # the most batches (decided before the first forward)
    most = (
        int(trainer.comm.max_(torch.tensor(float(batches), device=trainer.device)).item())
        if trainer.sharded
        else batches
    )
    for index, (x, y) in enumerate(trainer.val_loader):
        if index >= trainer.val_batches:
            break
        x, y = trainer.to_device(x, y)
        last = x
        with trainer.engine.autocast():
            logits = trainer.module(x)
        # the training criterion, as a sum over the items (it returns their mean)
        sums = trainer.task.eval_sums(trainer.criterion, logits, y)
        loss_sum += sums.loss_sum
        correct += sums.correct
        seen += sums.count
    for _ in range(most - batches):  # (sharded: this rank's share is a batch short)
        _forward_in_step(trainer, last)
    totals = trainer.comm.sum_(
        torch.stack(
            [
                loss_sum,
                correct,
                torch.tensor(float(seen), device=trainer.device, dtype=torch.float64),
            ]
        )
    )
    loss_total, correct_total, seen_total = totals.tolist()
    if seen_total == 0:
        return math.nan, math.nan
    return loss_total / seen_total, correct_total / seen_total


def _forward_in_step(trainer: Any, last: Optional[torch.Tensor]) -> None:
    """A forward counted nowhere, on this rank's last validation batch (or a training batch
    where it had none): a sharded model's forward is a collective (each unit gathers its
    parameters from all ranks), and the ranks' validation shares differ by a sample."""
    if last is None:
        last, _ = trainer.to_device(*next(iter(trainer.train_loader)))
    with trainer.engine.autocast():
        trainer.module(last)
