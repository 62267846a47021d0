"""`Classification`: one label per input, logits (B, classes); val_loss and val_acc, and a sweep
maximises best_val_acc."""

from __future__ import annotations

import math

import torch

from runner import metrics as m
from runner.config.schema import CLASSIFICATION
from runner.tasks.base import Task


class Classification(Task):
    name = CLASSIFICATION
    objective = m.BEST_VAL_ACC
    maximize = True
    input_dtype = torch.float32

    def output_fits(self, got, batch, num_outputs):
        return got == (batch[0], num_outputs)

    def output_description(self, num_outputs: int) -> str:
        return f"a model whose output is (batch, {num_outputs}): logits, one per class"

    def loss(self, criterion, output, target):
        return criterion(output, target)

    def items(self, target: torch.Tensor) -> int:
        return int(target.shape[0])

    def epoch_metrics(self, val_loss, val_accuracy, seconds, samples, items):
        return {
            m.VAL_LOSS: val_loss,
            m.VAL_ACC: val_accuracy,
            m.EPOCH_TIME_S: seconds,
            m.EPOCH_SAMPLES_PER_S: samples / seconds if seconds > 0 else math.nan,
        }

    def epoch_summary(self, metrics):
        return (
            f"val_acc {metrics[m.VAL_ACC]:.4f}  val_loss {metrics[m.VAL_LOSS]:.4f}  "
            f"{metrics[m.EPOCH_TIME_S]:.1f} s  "
            + self.throughput_summary(metrics, m.EPOCH_SAMPLES_PER_S, "samples")
        )
