"""The step timer: where a training epoch's time goes, and the steady throughput that compares.

Each step is marked where it starts and where it ends (its watch's entry and exit): on a GPU with
CUDA events recorded on the stream (no host sync; they are read at the epoch's end, or earlier
once finished), on a CPU with the wall clock. A step's time runs from the end of the step before
it (or the epoch's start) to its own end: the wait for its batch (the loader, the copy to the
device, the periodic loss read) and its own work. From these, per epoch:

- `samples_per_s` (and a language model's `tokens_per_s`): the median steady step's rate, the
  steady steps' samples a step over their median time, summed over the ranks; with its spread,
  `samples_per_s_p10` and `_p90`: the same at the steps' 90th and 10th percentile times (the
  slow and the fast steps). Steady: not among the first `warmup_steps` steps of the session (a
  resumed run is a new session) and not a step that compiled or recompiled. The median, not
  the steps' mean: a step that another process on the machine held up (a straggler) moves it
  little, and the spread says how much the steps vary;
- `step_time_ms_p50`, `step_time_ms_p90` over the steady steps (a finding, once, when p90 > 1.5x
  p50: stragglers);
- the steady steps' times in order, a file an epoch among the run's artifacts where files go
  (`timing/steps_<epoch>.json`, runner.measure.step_trace): what a speed-up's interval is
  drawn from (runner.measure.spread);
- `data_wait_frac`: the share of the epoch's training time spent between steps, waiting for the
  next batch (a finding, once, at the end of the first epoch over 10%);
- `tflops` (the model's FLOPs per sample times the steady rate) and `mfu` (that over the
  device's dense peak for the level's format, times the ranks), where they are known;
- `warmup_time_s`, once per session, at the epoch in which its warm-up ends.

An epoch without a steady step logs no steady figure, and says why once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from runner.measure import step_trace
from runner.measure.instruments import ArtifactSink, Instrument, output_folder
from runner.measure.step_trace import StepTrace
from runner.metrics import (
    DATA_WAIT_FRAC,
    MFU,
    SAMPLES_PER_S,
    STEP_TIME_MS_P50,
    STEP_TIME_MS_P90,
    TFLOPS,
    WARMUP_TIME_S,
    spread_names,
)

log = logging.getLogger(__name__)

STRAGGLER_RATIO = 1.5  # p90 over p50 above this: some steps straggle
DATA_WAIT_LIMIT = 0.10  # a data_wait_frac above this after the first epoch: a finding
FOLD_EVERY = 256  # steps between folds of finished marks into the epoch's sums
_BIN = math.log(1.005)  # step times kept in 0.5% bins (the percentiles' resolution)


class HostClock:
    """Marks on the host's wall clock (a CPU run: the work is done when the call returns)."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: float) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, mark: float) -> None:
        pass

    def wait(self, mark: float) -> None:
        pass


class CudaClock:
    """Marks as CUDA events recorded on the current stream: recording never waits for the GPU;
    a mark is read once the GPU has passed it (`ready`, a query that does not block). Events are
    reused once read."""

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []

    def mark(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def release(self, mark: torch.cuda.Event) -> None:
        self._free.append(mark)

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock() if device.type == "cuda" else HostClock()


def percentile(bins: Counter, q: float, sums: Optional[dict[int, float]] = None) -> float:
    """The `q` quantile (0-1, nearest rank) of the binned step times, in seconds: the mean time
    of the bin it falls in where `sums` holds each bin's total (exact when the bin's steps took
    the same time), else the bin's middle."""
    total = sum(bins.values())
    rank, seen = max(1, math.ceil(q * total)), 0
    for key in sorted(bins):
        seen += bins[key]
        if seen >= rank:
            return sums[key] / bins[key] if sums else math.exp(key * _BIN)
    return math.nan


class TimingInstrument(Instrument):
    """Due at every step (`every_step`): marks its start and end, folds finished marks into the
    epoch's sums, and gives the epoch's figures (see the module docstring). `items_metric`:
    the name of the items' rate (a language model's TOKENS_PER_S; None: samples only).
    `flops_per_sample`: the model's training FLOPs per sample (None: no tflops). `peak`: one
    device's dense TFLOP/s in the level's format (None: no mfu; `no_peak` says why, once).
    `reduce`: sums a list of floats over the ranks (a collective every rank calls at the same
    epoch; None: one process). `compiles`: a count that grows when torch.compile compiles (None:
    nothing compiles). `data_advice`: what to change when the loop waits for data. `on_artifact`:
    where the epochs' traces of steady step times go (runner.measure.step_trace; None: none are
    written), written in `folder` (None: a temporary folder)."""

    every_step = True

    def __init__(
        self,
        device: torch.device,
        warmup_steps: int,
        *,
        items_metric: Optional[str] = None,
        flops_per_sample: Optional[float] = None,
        peak: Optional[float] = None,
        no_peak: str = "",
        world_size: int = 1,
        reduce: Optional[Callable[[Sequence[float]], Sequence[float]]] = None,
        compiles: Optional[Callable[[], int]] = None,
        data_advice: str = "",
        logger: logging.Logger = log,
        on_artifact: Optional[ArtifactSink] = None,
        folder: Optional[Path] = None,
    ):
        self.clock = clock_for(device)
        self.warmup_steps = warmup_steps
        self.items_metric = items_metric
        self.flops_per_sample = flops_per_sample
        self.peak, self.no_peak = peak, no_peak
        self.world_size = world_size
        self.reduce = reduce
        self.compiles = compiles
        self.data_advice = data_advice
        self.log = logger
        self.on_artifact, self.folder = on_artifact, folder
        self._trace_out: Optional[tuple] = None  # the epoch's trace, to write at its end
        self.session_steps = 0  # steps of this session (a resumed run starts a new one)
        self.warmup_s = 0.0  # the session's warm-up steps' time so far
        self._warmup_logged = False
        self._said: set[str] = set()  # the findings said once per session
        self._epoch: Optional[int] = None  # the epoch being timed (None: none)
        self._start = self._end = self._prev = self._entry = None
        self._compiled_at = 0
        self._last_steady = False
        self._pending: list[tuple[Any, Any, Any, int, bool]] = []
        self._reset_sums()

    def _reset_sums(self) -> None:
        self.steps = self.warm_steps = self.steady_steps = self.compiled_steps = 0
        self.steady_s = self.wait_s = self.first_wait_s = 0.0
        self.steady_samples = self.steady_items = 0
        self.bins: Counter = Counter()
        self.bin_s: dict[int, float] = {}  # each bin's steps' seconds, summed
        self.trace = StepTrace()

    # ---- the epoch ----------------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        self._reset_sums()
        self._epoch = epoch
        self._start = self._prev = self.clock.mark()
        self._end = None

    def steps_done(self) -> None:
        if self._epoch is not None:
            self._end = self.clock.mark()

    # ---- each step (the hot path: a mark, a tuple, a counter read where compiling) ------------
    def start(self, step: int) -> None:
        if self._epoch is None:
            return
        if self.compiles is not None:
            self._compiled_at = self.compiles()
        self._entry = self.clock.mark()

    def close(self) -> None:
        if self._epoch is None or self._entry is None:
            return
        end = self.clock.mark()
        compiled = self.compiles is not None and self.compiles() != self._compiled_at
        self.session_steps += 1
        self._last_steady = self.session_steps > self.warmup_steps and not compiled
        self._pending.append((self._prev, self._entry, end, self.session_steps, compiled))
        self._prev, self._entry = end, None
        if len(self._pending) >= FOLD_EVERY:
            self._fold()

    def counted(self, step: int, samples: int, items: int) -> None:
        if self._last_steady:
            self.steady_samples += samples
            self.steady_items += items
            self._last_steady = False

    def _fold(self) -> None:
        """The pending steps whose end the device has passed, into the epoch's sums."""
        done = 0
        for prev, entry, end, index, compiled in self._pending:
            if not self.clock.ready(end):
                break
            wait, work = self.clock.seconds(prev, entry), self.clock.seconds(entry, end)
            seconds = wait + work
            if prev is self._start:
                self.first_wait_s = wait
            self.steps += 1
            self.wait_s += wait
            if index <= self.warmup_steps:
                self.warm_steps += 1
                self.warmup_s += seconds
            elif compiled:
                self.compiled_steps += 1
            else:
                self.steady_steps += 1
                self.steady_s += seconds
                key = round(math.log(max(seconds, 1e-9)) / _BIN)
                self.bins[key] += 1
                self.bin_s[key] = self.bin_s.get(key, 0.0) + seconds
                self.trace.add(seconds)
            if prev is not self._start:
                self.clock.release(prev)
            self.clock.release(entry)
            done += 1
        del self._pending[:done]

    # ---- the epoch's figures --------------------------------------------------------------------
    def epoch_metrics(self) -> dict[str, float]:
        if self._epoch is None:
            return {}
        if self._end is None:
            self.steps_done()
        self.clock.wait(self._end)  # (the epoch's end: every mark before it is finished)
        self._fold()
        epoch_s = self.clock.seconds(self._start, self._end)
        epoch, self._epoch = self._epoch, None
        if self._prev is not self._start:
            self.clock.release(self._prev)
        self.clock.release(self._start)
        self.clock.release(self._end)
        out: dict[str, float] = {}
        rates = self._rates()
        if rates is not None:
            out.update(rates)
            out.update(self._flops(rates[SAMPLES_PER_S]))
            out[STEP_TIME_MS_P50] = 1e3 * percentile(self.bins, 0.5, self.bin_s)
            out[STEP_TIME_MS_P90] = 1e3 * percentile(self.bins, 0.9, self.bin_s)
            if self.on_artifact is not None and len(self.trace):
                self._trace_out = (epoch, self.trace, self.steady_steps, *self._per_step())
        if epoch_s > 0:
            out[DATA_WAIT_FRAC] = self.wait_s / epoch_s
        if not self._warmup_logged and self.session_steps >= self.warmup_steps:
            out[WARMUP_TIME_S] = self.warmup_s
            self._warmup_logged = True
        self._findings(epoch, out, epoch_s)
        return out

    def _per_step(self) -> tuple[float, float]:
        """(samples, items) a steady step of this process, their mean."""
        return self.steady_samples / self.steady_steps, self.steady_items / self.steady_steps

    def _rates(self) -> Optional[dict[str, float]]:
        """The steady rates, summed over the ranks: samples/s (and the task's items/s) at the
        median step time, and their spread at the 90th and 10th percentile times; None unless
        every rank had a steady step this epoch."""
        steady = self.steady_steps > 0 and self.steady_s > 0
        local = [0.0] * 7
        if steady:
            times = [percentile(self.bins, q, self.bin_s) for q in (0.5, 0.9, 0.1)]
            samples, items = self._per_step()
            local = [samples / t for t in times] + [items / t for t in times] + [1.0]
        total = list(self.reduce(local)) if self.reduce is not None else local
        if total[6] < self.world_size:
            return None
        out = dict(zip((SAMPLES_PER_S, *spread_names(SAMPLES_PER_S)), total[0:3]))
        if self.items_metric:
            out.update(zip((self.items_metric, *spread_names(self.items_metric)), total[3:6]))
        return out

    def end_epoch(self) -> None:
        """The epoch's trace of steady step times to the artifact sink (where there is one)."""
        if self._trace_out is None:
            return
        (epoch, trace, steady, samples, items), self._trace_out = self._trace_out, None
        if self.folder is None:
            self.folder = output_folder(None, "amp-timing-")
        path = step_trace.write(self.folder, epoch, trace, steady, samples, items, self.world_size)
        self.on_artifact(path, step_trace.ARTIFACT_DIR)

    def _flops(self, samples_per_s: float) -> dict[str, float]:
        if not self.flops_per_sample:
            return {}
        tflops = self.flops_per_sample * samples_per_s / 1e12
        if self.peak is None:
            if self.no_peak:
                self._say_once("peak", "%s", self.no_peak)
            return {TFLOPS: tflops}
        return {TFLOPS: tflops, MFU: tflops / (self.peak * self.world_size)}

    # ---- what is said, once per session --------------------------------------------------------
    def _say_once(self, key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log.log(level, message, *args)

    def _findings(self, epoch: int, out: dict[str, float], epoch_s: float) -> None:
        if SAMPLES_PER_S not in out and self.steps:
            self._say_once(
                "no-steady",
                "Epoch %d: no steady step (%d of its %d steps were warm-up: the first "
                "trainer.warmup_steps=%d of this session; %d compiled): no samples_per_s for it "
                "(epoch_samples_per_s, the epoch's own figure, counts the warm-up)",
                epoch,
                self.warm_steps,
                self.steps,
                self.warmup_steps,
                self.compiled_steps,
            )
        if self.compiled_steps:
            self._say_once(
                "compiled",
                "Epoch %d: %d step(s) compiled or recompiled (torch.compile) and are left out "
                "of the steady figures",
                epoch,
                self.compiled_steps,
            )
        p50, p90 = out.get(STEP_TIME_MS_P50), out.get(STEP_TIME_MS_P90)
        if p50 and p90 and p90 > STRAGGLER_RATIO * p50:
            self._say_once(
                "stragglers",
                "Epoch %d: steps straggle: step_time_ms_p90 %.1f ms is %.1fx the median %.1f ms "
                "(data_wait_frac %.2f): some steps wait for data, garbage collection or another "
                "process on this machine",
                epoch,
                p90,
                p90 / p50,
                p50,
                out.get(DATA_WAIT_FRAC, math.nan),
            )
        wait = out.get(DATA_WAIT_FRAC)
        if wait is None or wait <= DATA_WAIT_LIMIT:
            return
        # the wait after the epoch's first batch: a loader that only starts slowly (worker
        # processes, a dataset opening its files) is no pipeline that sets the pace
        later_s = max(self.wait_s - self.first_wait_s, 0.0)
        later = later_s / (epoch_s - self.first_wait_s) if epoch_s > self.first_wait_s else 0.0
        if later <= DATA_WAIT_LIMIT:
            self._say_once(
                "data-start",
                "Epoch %d: the loop waited for its next batch %.0f%% of the training time "
                "(data_wait_frac %.2f), %.2f s of it for the epoch's first batch: the loader "
                "starting (worker processes, a dataset opening its files). After it the wait "
                "was %.0f%%, within the %.0f%% a finding needs: the input pipeline keeps pace, "
                "and longer epochs amortise the start.",
                epoch,
                100 * wait,
                wait,
                self.first_wait_s,
                100 * later,
                100 * DATA_WAIT_LIMIT,
                level=logging.INFO,
            )
            return
        start_up = (
            " Most of it came before the epoch's first batch (the loader starting: worker "
            "processes, a dataset opening its files), which longer epochs amortise."
            if self.first_wait_s > self.wait_s / 2
            else ""
        )
        self._say_once(
            "data-wait",
            "Epoch %d: the loop waited for its next batch %.0f%% of the training time "
            "(data_wait_frac %.2f): the input pipeline, not the model, sets the pace.%s %s",
            epoch,
            100 * wait,
            wait,
            start_up,
            self.data_advice,
        )
