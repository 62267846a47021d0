"""How much of a rate, a speed-up or an accuracy difference is noise: the figures the epoch line,
the run's last line, a sweep's summary and the report give beside every number that compares.

- A rate's spread: the steady steps' rate at their 10th and 90th percentile step times
  (`samples_per_s_p10` / `_p90`, runner.measure.timing), written "1,045 samples/s (p10-p90
  980-1,090)". It says how the steps vary, not how sure the median is.
- A speed-up's interval: the ratio of two configurations' rates with a 95% bootstrap interval
  from their steady steps' times (`runner.measure.step_trace`). A run's rate is its epochs'
  median-step rates averaged (what its `samples_per_s` averages to); a configuration's, its
  runs' (seeds) averaged. Each bootstrap draw resamples, in every epoch of every run, blocks of
  about sqrt(n) consecutive steps (a circular moving-block bootstrap: a slow spell of the
  machine moves as a block, so it widens the interval as it should, where single-step draws
  would call it precise), and, where a configuration has several runs, the runs themselves
  (so a run that was slow throughout, a machine busier for one run than for another, widens it
  too). The interval is the draws' 2.5th to 97.5th percentile of the ratio; a ratio whose
  interval holds 1.0 is "within noise". With one run a configuration, a machine whose load
  differed between the two runs is not in the interval: only repeats (seeds) put it there.
- An accuracy difference: the difference of the seeds' means, with the seeds' sample std of
  each side combined (sqrt(a^2 + b^2)); "within noise" where the two sides' seeds overlap (the
  best seed of the lower side reaches the worst of the higher). One run a side: no spread, no
  verdict.

Deterministic: the bootstrap draws from a fixed seed, so a report written twice says the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from runner.measure.step_trace import EpochTrace

DRAWS = 1000  # bootstrap draws of a ratio
LEVEL = 0.95  # the interval's coverage
MIN_STEPS = 8  # fewer steady steps a configuration: no interval (too few to say)
SEED = 20240613  # the draws' seed: a report written twice gives the same intervals
NOISE = "within noise"


@dataclass(frozen=True)
class Ratio:
    """A ratio and its interval (low, high: None where too few steps were timed)."""

    value: float
    low: Optional[float] = None
    high: Optional[float] = None
    note: str = ""  # why it has no interval, where the traces could not give one

    @property
    def noise(self) -> Optional[bool]:
        """Whether the interval holds 1.0 (None: no interval)."""
        if self.low is None or self.high is None:
            return None
        return self.low <= 1.0 <= self.high


def number(value: float) -> str:
    """A rate as people read it: 1,045 / 98 / 7.25 (whole numbers from 10, thousands
    separated; below 10 three figures)."""
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 10 else f"{value:.3g}"


def rate_text(rate: float, p10: Optional[float], p90: Optional[float], unit: str) -> str:
    """ "1,045 samples/s (p10-p90 980-1,090)"; without a spread "1,045 samples/s"."""
    text = f"{number(rate)} {unit}/s"
    if p10 is None or p90 is None or not (math.isfinite(p10) and math.isfinite(p90)):
        return text
    return f"{text} (p10-p90 {number(p10)}-{number(p90)})"


def ratio_text(ratio: Ratio) -> str:
    """The ratio as people read it: "4.36x [4.10, 4.60]", "1.02x [0.97, 1.08] within noise";
    "1.07x" with no interval (and why, where known: "1.40x (under 8 steady steps: ...)")."""
    text = f"{ratio.value:.2f}x"
    if ratio.low is None or ratio.high is None:
        return text + (f" ({ratio.note})" if ratio.note else "")
    text += f" [{ratio.low:.2f}, {ratio.high:.2f}]"
    return text + (f" {NOISE}" if ratio.noise else "")


# ---- rates and their bootstrap -------------------------------------------------------------------
def median(times: np.ndarray, axis: Optional[int] = None) -> np.ndarray:
    """The nearest-rank median (the ceil(n/2)-th smallest), as the step timer's percentiles
    take it: of an even count, one of the steps, not the mean of the middle two (on a busy
    machine two middle steps can be a third apart)."""
    return np.quantile(times, 0.5, axis=axis, method="inverted_cdf")


def epoch_rate(trace: EpochTrace, items: bool = False) -> float:
    """The epoch's median-step rate: what a step trained on over the median step time."""
    return trace.per_step(items) / float(median(np.asarray(trace.step_time_s)))


def run_rate(run: Sequence[EpochTrace], items: bool = False) -> float:
    """A run's rate: its epochs' median-step rates, averaged (as its `samples_per_s` is)."""
    return sum(epoch_rate(t, items) for t in run) / len(run)


def group_rate(runs: Sequence[Sequence[EpochTrace]], items: bool = False) -> float:
    """A configuration's rate: its runs' (seeds'), averaged."""
    return sum(run_rate(r, items) for r in runs) / len(runs)


def _block_medians(times: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """`draws` medians of `times` resampled in circular blocks of about sqrt(n) steps."""
    n = len(times)
    block = max(1, math.ceil(math.sqrt(n)))
    blocks = math.ceil(n / block)
    starts = rng.integers(0, n, size=(draws, blocks))
    index = (starts[:, :, None] + np.arange(block)) % n
    return median(times[index.reshape(draws, -1)[:, :n]], axis=1)


def _run_draws(
    run: Sequence[EpochTrace], items: bool, draws: int, rng: np.random.Generator
) -> np.ndarray:
    """`draws` bootstrap values of a run's rate (each epoch's steps resampled in blocks)."""
    total = np.zeros(draws)
    for trace in run:
        times = np.asarray(trace.step_time_s, dtype=np.float64)
        total += trace.per_step(items) / _block_medians(times, draws, rng)
    return total / len(run)


def _group_draws(
    runs: Sequence[Sequence[EpochTrace]], items: bool, draws: int, rng: np.random.Generator
) -> np.ndarray:
    """`draws` bootstrap values of a configuration's rate: its runs resampled (where it has
    several), each run's steps resampled in blocks."""
    per_run = np.stack([_run_draws(r, items, draws, rng) for r in runs])  # (runs, draws)
    if len(runs) == 1:
        return per_run[0]
    chosen = rng.integers(0, len(runs), size=(draws, len(runs)))
    return per_run[chosen, np.arange(draws)[:, None]].mean(axis=1)


def steps(runs: Sequence[Sequence[EpochTrace]]) -> int:
    return sum(len(t.step_time_s) for run in runs for t in run)


def speedup(
    runs: Sequence[Sequence[EpochTrace]],
    base: Sequence[Sequence[EpochTrace]],
    items: bool = False,
    draws: int = DRAWS,
    level: float = LEVEL,
    seed: int = SEED,
    value: Optional[float] = None,
) -> Optional[Ratio]:
    """The rate of the configuration whose runs' traces are `runs` over that of `base`, with
    its bootstrap interval (see the module); no interval where either side timed fewer than
    MIN_STEPS steady steps; None where either has no trace. `value`: the ratio as the caller
    computed it from the runs' logged rates (the same figure but for the percentiles' 0.5% bins),
    to give in its place and hold in the interval."""
    runs = [r for r in runs if r]
    base = [r for r in base if r]
    if not runs or not base:
        return None
    if value is None:
        value = group_rate(runs, items) / group_rate(base, items)
    if min(steps(runs), steps(base)) < MIN_STEPS:
        return Ratio(value, note=f"under {MIN_STEPS} steady steps: no interval")
    rng = np.random.default_rng(seed)
    ratios = _group_draws(runs, items, draws, rng) / _group_draws(base, items, draws, rng)
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    # (the point is the data's own ratio; a skewed bootstrap cannot leave it outside)
    return Ratio(value, min(float(low), value), max(float(high), value))


def rate_interval(
    runs: Sequence[Sequence[EpochTrace]],
    items: bool = False,
    draws: int = DRAWS,
    level: float = LEVEL,
    seed: int = SEED,
) -> Optional[tuple[float, Optional[float], Optional[float]]]:
    """A configuration's rate (its runs' traces) with the bootstrap interval of `speedup`, as
    (rate, low, high); (rate, None, None) below MIN_STEPS; None without a trace."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    value = group_rate(runs, items)
    if steps(runs) < MIN_STEPS:
        return value, None, None
    tail = (1 - level) / 2
    values = _group_draws(runs, items, draws, np.random.default_rng(seed))
    low, high = np.quantile(values, [tail, 1 - tail])
    return value, min(float(low), value), max(float(high), value)


# ---- accuracy differences ------------------------------------------------------------------------
@dataclass(frozen=True)
class Difference:
    """A difference of the seeds' means, the seeds' std combined (None: one run a side) and
    whether the two sides' seeds overlap (None: one run a side, no verdict)."""

    value: float
    std: Optional[float]
    noise: Optional[bool]

    def text(self, scale: float = 1.0, spec: str = "+.2f", unit: str = "") -> str:
        """ "+0.20 ± 0.35 pt within noise", "-1.30 ± 0.10 pt", "+0.20 pt (one run each)"."""
        text = format(self.value * scale, spec)
        if self.std is None:
            return f"{text}{unit}"
        text += f" ± {self.std * scale:.2f}{unit}"
        return text + (f" {NOISE}" if self.noise else "")


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def difference(values: Sequence[float], base: Sequence[float]) -> Optional[Difference]:
    """mean(values) - mean(base), with the seeds' spread and verdict (see the module)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    base = [v for v in base if v is not None and math.isfinite(v)]
    if not values or not base:
        return None
    value = sum(values) / len(values) - sum(base) / len(base)
    if len(values) < 2 or len(base) < 2:
        return Difference(value, None, None)
    std = math.sqrt(_std(values) ** 2 + _std(base) ** 2)
    overlap = min(values) <= max(base) and min(base) <= max(values)
    return Difference(value, std, overlap)
