"""Tasks: what a batch is, how the loss and the validation metrics are computed, and what a sweep
optimises. One small class per task, chosen once per run (`task_for`):

- `Classification` (images, and a user's dataset by default): inputs (B, C, H, W) (any floating
  tensor), logits (B, classes), one label per input; val_loss (the criterion's batch mean,
  averaged over the samples), val_acc; a sweep maximises best_val_acc.
- `LanguageModel` (next-token prediction): inputs (B, T) integer token ids, logits (B, T, V),
  targets (B, T) the inputs shifted by one token (the dataset yields them so); the loss is the
  criterion over every token (the mean token cross-entropy, nats per token); val_loss,
  val_perplexity = exp(val_loss), val_token_acc; throughput also in tokens per second; a sweep
  minimises best_val_loss.

The trainer calls only this interface, so a new task is one class here and its name in the task
group (conf/task/). Nothing here casts an input: integer token ids stay integers at every level
(the engine casts floating inputs only, as Apex did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from runner.config.options import CLASSIFICATION, LANGUAGE_MODEL, TASKS
from runner.tracking import metrics as m


@dataclass(frozen=True)
class EvalSums:
    """What one validation batch adds up (float64 tensors on the device: no host sync)."""

    loss_sum: torch.Tensor  # the criterion times the number of counted items
    correct: torch.Tensor  # items predicted right (samples or tokens)
    count: int  # items (samples or tokens)


class Task:
    """The interface the trainer and the plan use; see the module docstring."""

    name: str = ""
    objective: str = ""  # the metric a run returns and a sweep optimises
    maximize: bool = True
    input_dtype: torch.dtype = torch.float32  # of the model-output check's batch

    def input_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        return sample_shape

    def output_fits(self, got: Any, batch: tuple[int, ...], num_outputs: int) -> bool:
        """Whether a model's output of shape `got` (a tuple; a type name where the output is no
        tensor) for a batch of shape `batch` is what this task trains on."""
        raise NotImplementedError

    def output_description(self, num_outputs: int) -> str:
        raise NotImplementedError

    def loss(
        self, criterion: torch.nn.Module, output: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def items(self, target: torch.Tensor) -> int:
        """How many predictions a batch holds (samples, or tokens)."""
        raise NotImplementedError

    def eval_sums(
        self, criterion: torch.nn.Module, output: torch.Tensor, target: torch.Tensor
    ) -> EvalSums:
        loss = self.loss(criterion, output.float(), target).double()
        predicted = output.argmax(dim=-1)
        n = self.items(target)
        return EvalSums(loss * n, (predicted == target).sum().double(), n)

    def epoch_metrics(
        self, val_loss: float, val_accuracy: float, seconds: float, samples: int, items: int
    ) -> dict[str, float]:
        raise NotImplementedError

    def better(self, value: float, best: float) -> bool:
        if math.isnan(value):
            return False
        if math.isnan(best) or best in (math.inf, -math.inf):
            return True
        return value > best if self.maximize else value < best

    @property
    def worst(self) -> float:
        return -math.inf if self.maximize else math.inf

    def epoch_summary(self, metrics: dict[str, float]) -> str:
        raise NotImplementedError


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
            m.SAMPLES_PER_S: samples / seconds if seconds > 0 else math.nan,
        }

    def epoch_summary(self, metrics):
        return (
            f"val_acc {metrics[m.VAL_ACC]:.4f}  val_loss {metrics[m.VAL_LOSS]:.4f}  "
            f"{metrics[m.EPOCH_TIME_S]:.1f} s  {metrics[m.SAMPLES_PER_S]:.0f} samples/s"
        )


class LanguageModel(Task):
    name = LANGUAGE_MODEL
    objective = m.BEST_VAL_LOSS
    maximize = False
    input_dtype = torch.int64

    def output_description(self, num_outputs: int) -> str:
        return (
            f"a model whose output is (batch, tokens, V) with V >= {num_outputs}: logits "
            "over the vocabulary at every position (a vocabulary padded past the data's, "
            "as nanoGPT pads GPT-2's 50257 to 50304, is fine)"
        )

    def output_fits(self, got, batch, num_outputs):
        # a padded vocabulary: the extra logits are never a target, and softmax learns to
        # push them down (nanoGPT's 50304 for GPT-2's 50257 tokens, a multiple of 64)
        return (
            isinstance(got, tuple)
            and len(got) == len(batch) + 1
            and got[:-1] == tuple(batch)
            and got[-1] >= num_outputs
        )

    def loss(self, criterion, output, target):
        # every position is a prediction: (B, T, V) -> (B*T, V) against (B*T,) next tokens
        return criterion(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def items(self, target: torch.Tensor) -> int:
        return int(target.numel())

    def epoch_metrics(self, val_loss, val_accuracy, seconds, samples, items):
        return {
            m.VAL_LOSS: val_loss,
            m.VAL_PERPLEXITY: math.exp(val_loss) if val_loss < 700 else math.inf,
            m.VAL_TOKEN_ACC: val_accuracy,
            m.EPOCH_TIME_S: seconds,
            m.SAMPLES_PER_S: samples / seconds if seconds > 0 else math.nan,
            m.TOKENS_PER_S: items / seconds if seconds > 0 else math.nan,
        }

    def epoch_summary(self, metrics):
        return (
            f"val_loss {metrics[m.VAL_LOSS]:.4f}  perplexity {metrics[m.VAL_PERPLEXITY]:.2f}"
            f"  token_acc {metrics[m.VAL_TOKEN_ACC]:.4f}  {metrics[m.EPOCH_TIME_S]:.1f} s  "
            f"{metrics[m.TOKENS_PER_S]:.0f} tokens/s"
        )


TASK_CLASSES: dict[str, type[Task]] = {
    CLASSIFICATION: Classification,
    LANGUAGE_MODEL: LanguageModel,
}
assert set(TASK_CLASSES) == set(TASKS)


def task_for(name: Any) -> Task:
    """The task of a resolved name (`runner.run.plan` resolves `task=auto`)."""
    return TASK_CLASSES[str(name)]()
