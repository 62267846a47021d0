"""How busy the device is: `device_busy_frac`, the share of a few training steps' wall time in
which the GPU was running something (a kernel, a copy, a memset), measured once per run.

A step whose device work takes less time than the host takes to launch it leaves the GPU idle
between launches: a faster precision level, which cuts the device's work, then changes nothing
the run logs (DenseNet-161 on an H200: O2 cut the device's work to 0.70x of O0's and the step
stayed at 0.99x, ~100 ms a step of launches). The step timer cannot tell this from a step the GPU
bounds; this can. `BusyInstrument` profiles `BUSY_STEPS` consecutive steps of one epoch, after
the session's warm-up, with torch.profiler (CUDA activity only: no CPU op is recorded), between
two device synchronisations: the busy time is the union of the device activities' intervals
(concurrent kernels of several streams counted once), the wall time the span of those steps on
the host's clock, from the device idle at their start to the device idle at their end. Once: the
profiler's tracing costs those steps a little, and nothing after them.

Below `BUSY_LIMIT` it says so once, as a finding that names the levers and what each can gain
(`busy_finding`): at most 1/device_busy_frac, the step at the GPU's own pace.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from runner.measure.instruments import Instrument

log = logging.getLogger(__name__)

BUSY_STEPS = 5  # the steps measured, consecutive, in one epoch
BUSY_LIMIT = 0.8  # a device busy less than this share of the steps: a finding
# the levers a finding names (the config's overrides), each with what it is expected to gain
GRAPHS, COMPILE, BATCH = "trainer.cuda_graphs=step", "trainer.compile=true", "trainer.batch_size"


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of the intervals (start, end): overlapping ones (kernels of
    several streams, a copy beside a kernel) count once; an empty or reversed one counts 0."""
    total, start, end = 0.0, None, None
    for lo, hi in sorted((lo, hi) for lo, hi in intervals if hi > lo):
        if end is None or lo > end:  # (a gap: the last run of intervals ends)
            total += 0.0 if end is None else end - start
            start, end = lo, hi
        else:
            end = max(end, hi)
    return total + (0.0 if end is None else end - start)


def busy_fraction(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """The union of `intervals` over `wall` (the same unit), at most 1 (the device's clock and
    the host's may disagree by a few microseconds); nan for no wall time."""
    if not wall > 0:
        return math.nan
    return min(union_length(intervals) / wall, 1.0)


def busy_finding(frac: float, steps: int, on: Sequence[str] = ()) -> Optional[str]:
    """What a run whose device was busy `frac` of `steps` steps is told, below BUSY_LIMIT (else
    None): that the host bounds the step, and the levers not already `on` (their overrides),
    each with its expected gain."""
    if not math.isfinite(frac) or frac >= BUSY_LIMIT:
        return None
    most = 1.0 / max(frac, 1e-3)
    levers = {
        GRAPHS: "the whole step replayed as one CUDA graph, its launches gone: 1.2-3x on "
        "launch-bound steps, per NVIDIA's CUDA graphs guide",
        COMPILE: "fewer, fused kernels: fewer launches and less device work; its "
        "reduce-overhead mode replays them as CUDA graphs too",
        BATCH: "a larger one: more work per launch, the launches the same; samples/s grows "
        "until the GPU is busy",
    }
    named = "; ".join(f"{key} ({why})" for key, why in levers.items() if key not in on)
    said = math.floor(100 * frac) / 100  # (rounded down: 0.798 is not said as 0.80, the limit)
    return (
        f"The GPU was busy {100 * said:.0f}% of {steps} steps after the warm-up "
        f"(device_busy_frac {said:.2f}, below {BUSY_LIMIT:g}): the host, launching the step's "
        "kernels one by one, sets the pace, not the GPU, so a level that cuts the device's work "
        f"shows little of its gain. At most {most:.1f}x is to be had here (the step at the "
        f"GPU's own pace). Levers: {named}."
    )


class BusyInstrument(Instrument):
    """`device_busy_frac` of `steps` consecutive steps of one epoch, starting at the `first`th
    step of the session (counted from the steps it is asked about: a resumed run's warm-up
    again), reported once through `report(frac, step)`; the finding (`busy_finding`, the levers
    `on` left out) said through `logger`. Due at a replayed step too (`replayable`: no hook, the
    profiler sees a graph's kernels as any others). An epoch that ends inside the window ends
    the measurement with the steps it holds (the wall time holds no validation).
    `activity`/`kind`: what the profiler records and which of its events count (a CUDA device's
    by default; a CPU's ops for a test of the window on a machine without one)."""

    replayable = True

    def __init__(
        self,
        device: torch.device,
        first: int,
        report: Callable[[float, int], None],
        *,
        steps: int = BUSY_STEPS,
        on: Sequence[str] = (),
        logger: logging.Logger = log,
        activity: Any = None,
        kind: Any = None,
    ):
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity

        self.device, self.first, self.steps = device, max(int(first), 1), int(steps)
        self.report, self.on, self.log = report, tuple(on), logger
        self.activity = ProfilerActivity.CUDA if activity is None else activity
        self.kind = DeviceType.CUDA if kind is None else kind
        self.frac: Optional[float] = None  # the measurement, once made
        self.measured = 0  # the steps it holds
        self._asked = 0  # the session's steps so far (due is asked once a step)
        self._profile: Any = None
        self._started = 0.0
        self._step = 0  # the (global) step being measured

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def due(self, step: int) -> bool:
        self._asked += 1
        return self.frac is None and self.first <= self._asked < self.first + self.steps

    def start(self, step: int) -> None:
        self._step = step
        if self._profile is None:  # the window's first step: the device idle, then the clock
            from torch.profiler import profile

            self._profile = profile(activities=[self.activity])
            self._profile.__enter__()
            self._sync()
            self._started = time.perf_counter()

    def close(self) -> None:
        if self._profile is None:
            return
        self.measured += 1
        if self._asked + 1 >= self.first + self.steps:  # (the window's last step)
            self._finish()

    def steps_done(self) -> None:
        if self._profile is not None:  # the epoch ended inside the window
            self._finish()

    def _finish(self) -> None:
        self._sync()
        wall = time.perf_counter() - self._started
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        intervals = [
            (e.time_range.start, e.time_range.end)
            for e in profile.events()
            if e.device_type == self.kind
        ]
        self.frac = busy_fraction(intervals, wall * 1e6)  # (the profiler's unit: microseconds)
        if not math.isfinite(self.frac):
            return
        self.report(self.frac, self._step)
        said = busy_finding(self.frac, self.measured, self.on)
        if said is not None:
            self.log.warning("%s", said)
        else:
            self.log.info(
                "device_busy_frac %.2f over %d steps: the GPU sets the pace",
                self.frac,
                self.measured,
            )
