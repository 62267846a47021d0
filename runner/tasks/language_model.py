"""`LanguageModel`: next-token prediction over (B, T) token ids, logits (B, T, V); val_loss,
val_perplexity and val_token_acc, and a sweep minimises best_val_loss."""

from __future__ import annotations

import math

import torch

from runner import metrics as m
from runner.config.schema import LANGUAGE_MODEL
from runner.metrics import TOKENS_PER_S
from runner.tasks.base import Task


class LanguageModel(Task):
    name = LANGUAGE_MODEL
    objective = m.BEST_VAL_LOSS
    maximize = False
    input_dtype = torch.int64
    target_dims = 2  # (batch, tokens): the next token of every position
    items_metric = TOKENS_PER_S
    throughput_metric = TOKENS_PER_S

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
            m.EPOCH_SAMPLES_PER_S: samples / seconds if seconds > 0 else math.nan,
            m.EPOCH_TOKENS_PER_S: items / seconds if seconds > 0 else math.nan,
        }

    def epoch_summary(self, metrics):
        return (
            f"val_loss {metrics[m.VAL_LOSS]:.4f}  perplexity {metrics[m.VAL_PERPLEXITY]:.2f}"
            f"  token_acc {metrics[m.VAL_TOKEN_ACC]:.4f}  {metrics[m.EPOCH_TIME_S]:.1f} s  "
            + self.throughput_summary(metrics, m.EPOCH_TOKENS_PER_S, "tokens")
        )
