"""The steady steps' times in the order they ran, one file an epoch: what a comparison of two runs
needs to say how much of their ratio is noise (`runner.measure.spread`).

The step timer keeps its percentiles in bins (`runner.measure.timing`), which say how the times
spread but not when: a slow spell of the machine (another process, a thermal throttle) makes a
run of consecutive slow steps, which an interval must move as one block, not as many independent
draws. So the timer also keeps each steady step's time in order, as float32 (4 bytes a step);
past `CAPACITY` steps in an epoch it keeps every second one of those kept and from then on every
second step, and so on (`every` doubles): an evenly spaced sample of the epoch, in order, bounded
however long the epoch. At the epoch's end the trace is one JSON file, `timing/steps_<epoch>.json`
among the run's artifacts:

    {"format": 1, "epoch": 3, "every": 1, "ranks": 1, "steady_steps": 250,
     "samples_per_step": 64.0, "items_per_step": 64.0, "step_time_s": [0.0123, ...]}

`samples_per_step` (and `items_per_step`: a language model's tokens) is the mean over this
process's steady steps; a run of several ranks counts `ranks` times that a step (its steps are in
lockstep), as its `samples_per_s` sums the ranks' rates.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

FORMAT = 1
ARTIFACT_DIR = "timing"  # the run's artifact folder of the traces
CAPACITY = 4096  # steps kept an epoch at most (then every second, every fourth, ...)


def file_name(epoch: int) -> str:
    return f"steps_{epoch:04d}.json"


class StepTrace:
    """The steady steps' times of one epoch, in order, thinned past `capacity` (see the module)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = max(2, capacity)
        self.times = array("f")
        self.every = 1  # one step kept in `every`
        self._seen = 0

    def add(self, seconds: float) -> None:
        self._seen += 1
        if (self._seen - 1) % self.every:
            return
        self.times.append(seconds)
        if len(self.times) >= self.capacity:
            self.times = self.times[::2]
            self.every *= 2

    def __len__(self) -> int:
        return len(self.times)


@dataclass
class EpochTrace:
    """One epoch's trace as read back (`read`): its steady steps' times in seconds, in order."""

    epoch: int
    step_time_s: list[float]
    samples_per_step: float
    items_per_step: float
    ranks: int = 1
    every: int = 1
    steady_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def per_step(self, items: bool) -> float:
        """What one step trained on, every rank's: samples, or with `items` the task's items."""
        return self.ranks * (self.items_per_step if items else self.samples_per_step)


def write(
    folder: Path,
    epoch: int,
    trace: StepTrace,
    steady_steps: int,
    samples_per_step: float,
    items_per_step: float,
    ranks: int,
) -> Path:
    """The epoch's trace as `folder/steps_<epoch>.json` (made if missing); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(epoch)
    record = {
        "format": FORMAT,
        "epoch": epoch,
        "every": trace.every,
        "ranks": ranks,
        "steady_steps": steady_steps,
        "samples_per_step": samples_per_step,
        "items_per_step": items_per_step,
        "step_time_s": [float(f"{t:.6g}") for t in trace.times],
    }
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return path


def read(text: str) -> Optional[EpochTrace]:
    """An epoch's trace from its file's text; None for a file that is not one (another format,
    a truncated write, no step)."""
    try:
        record = json.loads(text)
        times = [float(t) for t in record["step_time_s"]]
        trace = EpochTrace(
            epoch=int(record["epoch"]),
            step_time_s=times,
            samples_per_step=float(record["samples_per_step"]),
            items_per_step=float(record["items_per_step"]),
            ranks=int(record.get("ranks", 1)),
            every=int(record.get("every", 1)),
            steady_steps=int(record.get("steady_steps", len(times))),
        )
    except (ValueError, KeyError, TypeError):
        return None
    if record.get("format") != FORMAT or not times or not all(t > 0 for t in times):
        return None
    if not (trace.samples_per_step > 0 and math.isfinite(trace.samples_per_step)):
        return None
    return trace


def read_all(texts: Mapping[str, str]) -> list[EpochTrace]:
    """A run's traces from its `timing/` files' texts (by name: `Reader.artifact_texts`), by
    epoch; the files that are no trace are left out (a run made before them has none)."""
    traces = {}
    for name in sorted(texts):
        if name.startswith("steps_") and name.endswith(".json"):
            trace = read(texts[name])
            if trace is not None:
                traces[trace.epoch] = trace
    return [traces[e] for e in sorted(traces)]
