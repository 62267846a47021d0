"""The task interface: what the trainer and the plan ask of a task (`Task`), and what one
validation batch adds up (`EvalSums`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from runner import metrics as m
from runner.measure.spread import rate_text
from runner.metrics import MFU, SAMPLES_PER_S, TOKENS_PER_S, spread_names


@dataclass(frozen=True)
class EvalSums:
    """What one validation batch adds up (float64 tensors on the device: no host sync)."""

    loss_sum: torch.Tensor  # the criterion times the number of counted items
    correct: torch.Tensor  # items predicted right (samples or tokens)
    count: int  # items (samples or tokens)


def class_indices(criterion: torch.nn.Module, num_outputs: Optional[int]) -> Optional[tuple]:
    """(outputs, ignore_index) where `criterion` takes class indices (torch's cross-entropy and
    NLL losses: a classifier's labels, a language model's next tokens) and the model's outputs
    are known; None otherwise (a criterion of the user's takes what it takes)."""
    if num_outputs is None:
        return None
    if isinstance(criterion, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
        return int(num_outputs), int(criterion.ignore_index)
    fn = getattr(criterion, "fn", None)  # their functions, as loss._target_ (FunctionLoss)
    if fn in (F.cross_entropy, F.nll_loss):
        return int(num_outputs), int(criterion.kwargs.get("ignore_index", -100))
    return None


def target_problem(
    target: Any, indices: Optional[tuple], dims: Optional[int] = None
) -> Optional[str]:
    """Why a batch's targets, still on the host, are neither class indices of the model's
    outputs nor class probabilities (`indices`: `class_indices`'; `dims`: the dimensions of a
    batch of class indices, the task's `target_dims`), or None. Found by the criterion, an index
    out of range was an IndexError traceback ("Target 5 is out of bounds"), on a GPU a
    device-side assert that ends the process's CUDA context, a float label "expected target
    dtype to be Long", a label kept in a list of one "multi-target not supported"; read on the
    host before the copy, no device waits. Targets that are no tensor at all (strings: a list
    of them after collation) are named whatever the criterion."""
    if not isinstance(target, torch.Tensor):
        items = list(target)[:3] if isinstance(target, (list, tuple)) else [target]
        kinds = ", ".join(dict.fromkeys(type(t).__name__ for t in items))
        return (
            f"a batch of the data holds targets that are no tensor ({type(target).__name__} of "
            f"{kinds}: {', '.join(repr(t) for t in items)}, ...): give each label as its class "
            "index, an int (a dataset's classes list maps names to indices)"
        )
    if indices is None or target.device.type != "cpu" or target.numel() == 0:
        return None
    outputs, ignored = indices
    if not target.is_floating_point() and dims is not None and target.dim() != dims:
        one = "one class index per input" if dims == 1 else "one class index per position"
        return (
            f"a batch of the data holds class indices of shape {tuple(target.shape)}, where "
            f"cross-entropy takes {dims} dimension{'s' if dims > 1 else ''} ({one}): a label "
            "kept as a tensor of one item gives (batch, 1); give it as an int, or y.squeeze(-1)"
        )
    if target.is_floating_point():  # class probabilities: a last dimension of one per output
        if target.dim() >= 2 and target.shape[-1] == outputs:
            return None
        return (
            f"a batch of the data holds targets of {target.dtype} and shape "
            f"{tuple(target.shape)}: cross-entropy takes class indices (integers) or class "
            f"probabilities (a last dimension of {outputs}, one per output); give the labels as "
            "integers"
        )
    low, high = (int(v) for v in torch.aminmax(target))
    if high < outputs and (low >= 0 or low == ignored):
        return None
    bad = high if high >= outputs else low
    return (
        f"a batch of the data holds the target {bad}, but the model has {outputs} outputs (one "
        f"per class, or per token of a language model's vocabulary): a target must be in "
        f"[0, {outputs}) (or {ignored}, which the loss ignores); count every class of the data "
        f"in data.num_classes"
    )


class Task:
    """The interface the trainer and the plan use; see the package docstring (runner.tasks)."""

    name: str = ""
    objective: str = ""  # the metric a run returns and a sweep optimises
    maximize: bool = True
    input_dtype: torch.dtype = torch.float32  # of the model-output check's batch
    target_dims: int = 1  # the dimensions of a batch of class indices (a language model's: 2)
    # the steady rate of the task's items beside samples_per_s (runner.measure.timing), and the
    # figure that compares speed (the epoch line, the summaries, the report)
    items_metric: Optional[str] = None
    throughput_metric: str = SAMPLES_PER_S

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
        # class probabilities (soft or one-hot targets): the class they put most on is right
        soft = target.is_floating_point() and target.dim() == output.dim()
        truth = target.argmax(dim=-1) if soft else target
        n = self.items(truth)
        return EvalSums(loss * n, (predicted == truth).sum().double(), n)

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

    @property
    def unit(self) -> str:
        """What its throughput counts: "tokens" or "samples"."""
        return "tokens" if self.throughput_metric == TOKENS_PER_S else "samples"

    def speed(self, metrics: Mapping[str, float]) -> str:
        """The steady rate with its spread, "steady 1,045 samples/s (p10-p90 980-1,090)" (and
        the MFU where known), from an epoch's metrics; "" where it had no steady step."""
        steady = metrics.get(self.throughput_metric)
        if steady is None or not math.isfinite(steady):
            return ""
        p10, p90 = (metrics.get(k) for k in spread_names(self.throughput_metric))
        mfu = metrics.get(MFU)
        return (
            "steady "
            + rate_text(steady, p10, p90, self.unit)
            + (f" (mfu {mfu:.1%})" if mfu is not None else "")
        )

    def run_speed(self, epochs: Sequence[Mapping[str, float]]) -> str:
        """A run's steady rate and spread, each the mean over the epochs that logged one (as
        the report and a sweep's summary average them); "" where none did."""
        metric = self.throughput_metric
        steady = [e for e in epochs if math.isfinite(e.get(metric, math.nan))]
        if not steady:
            return ""
        names = (metric, *spread_names(metric), MFU)
        mean = {
            k: sum(e[k] for e in steady) / len(steady) for k in names if all(k in e for e in steady)
        }
        return self.speed(mean)

    def summary_metrics(
        self, epochs: Sequence[Mapping[str, float]], best: float, train_time_s: float
    ) -> dict[str, float]:
        """The run's headline figures under `summary/` (runner.metrics): its objective
        `best`, `train_time_s`, the highest epoch's peak memory, and each steady rate with its
        spread, the means over the epochs that logged them (none without a steady epoch); at
        four significant digits, which MLflow's table shows whole (15.1, not 15.097827911376953:
        the full values stay under their own names)."""
        out = {m.summary(self.objective): best, m.summary(m.TRAIN_TIME_S): train_time_s}
        peaks = [e[m.PEAK_MEM_MB] for e in epochs if m.PEAK_MEM_MB in e]
        if peaks:
            out[m.summary(m.PEAK_MEM_MB)] = max(peaks)
        for rate in dict.fromkeys((SAMPLES_PER_S, self.throughput_metric)):
            for name in (rate, *spread_names(rate)):
                values = [e[name] for e in epochs if math.isfinite(e.get(name, math.nan))]
                if values:
                    out[m.summary(name)] = sum(values) / len(values)
        return {k: float(f"{v:.4g}") for k, v in out.items() if math.isfinite(v)}

    def throughput_summary(self, metrics: dict[str, float], epoch_metric: str, unit: str) -> str:
        """The epoch line's speed: the steady figure with its spread (and the MFU where known),
        or the epoch's own where it has no steady step."""
        return (
            self.speed(metrics)
            or f"{metrics[epoch_metric]:.0f} {unit}/s over the epoch (no steady step)"
        )
