"""Rates with their spread, speed-ups with their interval: the step timer on a scripted clock whose
steps take a fixed sleep plus a known jitter writes its traces, and the bootstrap
(runner.measure.spread) read from them holds the true rate and ratio, calls two identical
configurations "within noise", widens for a slow spell and for runs that differ, and says how
accuracy differences compare with the seeds' spread."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from runner.measure import spread, step_trace
from runner.measure.instruments import Instruments
from runner.measure.step_trace import EpochTrace, StepTrace
from runner.measure.timing import HostClock, TimingInstrument
from runner.metrics import SAMPLES_PER_S, SAMPLES_PER_S_P10, SAMPLES_PER_S_P90, TOKENS_PER_S

CPU = torch.device("cpu")
BATCH = 16


class ScriptedClock(HostClock):
    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now


def timed_run(
    folder: Path, sleep: float, jitter: float, seed: int, steps: int = 200, epochs: int = 1
) -> tuple[list[dict], list[EpochTrace]]:
    """A run through the step timer on a scripted clock: every step takes `sleep` plus a uniform
    jitter in [0, `jitter`) (drawn from `seed`), two warm-up steps of 1 s first; its epochs'
    metrics and its traces as read back from the files it handed to the artifact sink."""
    handed: list[tuple[Path, str]] = []
    timer = TimingInstrument(
        CPU, 2, on_artifact=lambda path, where: handed.append((path, where)), folder=folder
    )
    clock = timer.clock = ScriptedClock()
    instruments, draw, step, out = Instruments(timer), random.Random(seed), 0, []
    for epoch in range(1, epochs + 1):
        instruments.start_epoch(epoch)
        for _ in range(steps):
            step += 1
            with instruments.step(step):
                clock.now += 1.0 if step <= 2 else sleep + jitter * draw.random()
            instruments.counted(step, BATCH, BATCH)
        instruments.steps_done()
        out.append(instruments.epoch_metrics())
        instruments.end_epoch()
    assert [where for _, where in handed] == [step_trace.ARTIFACT_DIR] * epochs
    traces = [step_trace.read(path.read_text()) for path, _ in handed]
    return out, traces


def test_the_rate_is_the_median_step_and_its_spread_the_p10_p90_steps(tmp_path):
    """10 ms plus up to 4 ms of uniform jitter: the median step takes 12 ms, the 10th percentile
    10.4 ms and the 90th 13.6 ms; the rates are the batch over those (the percentiles' 0.5% bins
    and 200 draws of the jitter: within 2%). A step held up (a straggler) moves the median
    little, where the mean of the steps' times would take it in."""
    (metrics,), (trace,) = timed_run(tmp_path, 0.010, 0.004, seed=1)
    assert metrics[SAMPLES_PER_S] == pytest.approx(BATCH / 0.012, rel=0.02)
    assert metrics[SAMPLES_PER_S_P10] == pytest.approx(BATCH / 0.0136, rel=0.02)
    assert metrics[SAMPLES_PER_S_P90] == pytest.approx(BATCH / 0.0104, rel=0.02)
    assert TOKENS_PER_S not in metrics  # (a classifier's timer: samples only)
    assert len(trace.step_time_s) == 198 and trace.samples_per_step == BATCH  # the steady ones
    assert spread.epoch_rate(trace) == pytest.approx(metrics[SAMPLES_PER_S], rel=0.005)


def test_the_interval_holds_the_true_rate_and_ratio(tmp_path):
    """The rate's interval holds the true 1,333 samples/s (16 over the 12 ms median); a level
    whose steps sleep 5 ms (7 ms median) is 12/7 = 1.71x faster: the interval holds that and
    not 1.0; over 40 jitters the 95% interval of the rate holds the truth at least 34 times (a
    bootstrap that ignored the blocks' length or the median's spread would miss more)."""
    _, slow = timed_run(tmp_path / "slow", 0.010, 0.004, seed=2)
    _, fast = timed_run(tmp_path / "fast", 0.005, 0.004, seed=3)
    rate, low, high = spread.rate_interval([slow])
    assert low < BATCH / 0.012 < high and low <= rate <= high
    ratio = spread.speedup([fast], [slow])
    assert ratio.low < 12 / 7 < ratio.high and ratio.noise is False
    assert spread.ratio_text(ratio).startswith(f"{ratio.value:.2f}x [")
    held = 0
    for seed in range(40):
        _, run = timed_run(tmp_path / f"s{seed}", 0.010, 0.004, seed=100 + seed)
        _, low, high = spread.rate_interval([run], seed=seed)
        held += low <= BATCH / 0.012 <= high
    assert held >= 34


def test_two_identical_configurations_are_within_noise(tmp_path):
    """The same sleep and jitter twice (other draws): their ratio's interval holds 1.0, and the
    text says so."""
    _, a = timed_run(tmp_path / "a", 0.010, 0.004, seed=4, epochs=2)
    _, b = timed_run(tmp_path / "b", 0.010, 0.004, seed=5, epochs=2)
    ratio = spread.speedup([a], [b])
    assert ratio.noise is True and 0.95 < ratio.value < 1.05
    assert spread.ratio_text(ratio).endswith("] within noise")


def _trace(times: list[float], epoch: int = 1) -> EpochTrace:
    return EpochTrace(epoch, times, samples_per_step=BATCH, items_per_step=BATCH)


def test_a_slow_spell_widens_the_interval_where_single_steps_would_not():
    """The same step times in two orders: shuffled, and as a run whose second half the machine
    slowed by a fifth (a spell of consecutive slow steps). Resampled in blocks, the spell widens
    the interval of the median: a bootstrap of single steps would call both equally sure."""
    draw = random.Random(6)
    times = [0.010 + 0.001 * draw.random() for _ in range(200)]
    times = times[:100] + [1.2 * t for t in times[100:]]
    shuffled = random.Random(7).sample(times, len(times))
    _, low, high = spread.rate_interval([[_trace(times)]])
    _, low_s, high_s = spread.rate_interval([[_trace(shuffled)]])
    assert (high - low) > 1.2 * (high_s - low_s)  # (1.28-1.39x over 8 draws of the times)


def test_runs_that_differ_widen_the_interval_of_their_configuration():
    """Two seeds of one configuration, one run on a busy machine (12 ms steps), one on a quiet one
    (10 ms), against a baseline at 11 ms: resampling the runs puts the difference between them
    in the interval, which then holds 1.0; either run alone would be called faster or slower."""
    draw = random.Random(8)

    def run(step: float) -> list[EpochTrace]:
        return [_trace([step + 0.0002 * draw.random() for _ in range(100)])]

    busy, quiet, base = run(0.012), run(0.010), run(0.011)
    assert spread.speedup([busy, quiet], [base]).noise is True
    assert spread.speedup([busy], [base]).noise is False
    assert spread.speedup([quiet], [base]).noise is False


def test_too_few_steps_give_no_interval_and_no_trace_no_ratio():
    short = [[_trace([0.01, 0.011, 0.012])]]
    ratio = spread.speedup(short, short)
    assert ratio.value == pytest.approx(1.0) and ratio.low is None and ratio.noise is None
    assert spread.ratio_text(ratio) == "1.00x (under 8 steady steps: no interval)"
    assert spread.ratio_text(spread.Ratio(1.07)) == "1.07x"  # (runs made before the traces)
    assert spread.speedup([], short) is None and spread.rate_interval([[]]) is None


def test_accuracy_differences_against_the_seeds_spread():
    """Seeds that overlap: within noise; seeds apart: a difference; one run a side: the
    difference alone."""
    overlap = spread.difference([0.70, 0.72, 0.71], [0.71, 0.73])
    assert overlap.noise is True and overlap.value == pytest.approx(0.71 - 0.72)
    assert overlap.text(100, unit=" pt").endswith("pt within noise")
    apart = spread.difference([0.80, 0.81], [0.70, 0.71])
    assert apart.noise is False and apart.std == pytest.approx(0.01, rel=1e-6)
    assert apart.text(100, unit=" pt") == "+10.00 ± 1.00 pt"
    single = spread.difference([0.7065], [0.7045])
    assert single.std is None and single.noise is None and single.text(100) == "+0.20"


def test_rates_read_as_people_write_them():
    assert spread.rate_text(1045.2, 980.4, 1090.0, "samples") == (
        "1,045 samples/s (p10-p90 980-1,090)"
    )
    assert spread.rate_text(12.34, None, None, "tokens") == "12 tokens/s"
    assert spread.ratio_text(spread.Ratio(4.356, 4.1, 4.6)) == "4.36x [4.10, 4.60]"


def test_a_long_epoch_keeps_an_even_bounded_sample_in_order():
    trace = StepTrace(capacity=8)
    for step in range(100):
        trace.add(float(step))
    assert len(trace) < 8 and trace.every == 16
    assert list(trace.times) == [float(s) for s in range(0, 100, 16)]


def test_the_headline_metrics_sort_together_and_read_whole():
    """A run's headline figures again under summary/ (one search in MLflow's column picker finds
    them), each the figure the report gives: the objective, the train time, the highest peak
    memory, the steady rate and its spread averaged over the epochs that logged one; at four
    significant digits."""
    from runner.tasks import Classification, LanguageModel

    epochs = [
        {"peak_mem_mb": 15.097827911376953, "val_acc": 0.4},  # (an epoch of warm-up only)
        {"samples_per_s": 300.0, "samples_per_s_p10": 100.0, "samples_per_s_p90": 400.0},
        {"samples_per_s": 343.5347, "samples_per_s_p10": 120.0, "samples_per_s_p90": 500.0},
    ]
    epochs[1]["peak_mem_mb"] = epochs[2]["peak_mem_mb"] = 14.0
    assert Classification().summary_metrics(epochs, 0.458984375, 44.61234) == {
        "summary/best_val_acc": 0.459,
        "summary/train_time_s": 44.61,
        "summary/peak_mem_mb": 15.1,
        "summary/samples_per_s": 321.8,
        "summary/samples_per_s_p10": 110.0,
        "summary/samples_per_s_p90": 450.0,
    }
    lm = LanguageModel().summary_metrics([{"tokens_per_s": 5e4, "samples_per_s": 50.0}], 3.2, 1.0)
    assert lm["summary/best_val_loss"] == 3.2 and lm["summary/tokens_per_s"] == 5e4
    assert lm["summary/samples_per_s"] == 50.0 and "summary/best_val_acc" not in lm
    assert Classification().speed(epochs[2]) == "steady 344 samples/s (p10-p90 120-500)"
    assert Classification().run_speed(epochs) == "steady 322 samples/s (p10-p90 110-450)"
