"""What `trainer.tune` decided (`Tuning`): the settings it set and why, the candidates' rows, how
it was reached; what the run logs of it (its params, tune.md, tune_time_s)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch

from runner import metrics as m
from runner.config import tunable_defaults
from runner.config.values import override_text
from runner.run import tune_data
from runner.run.tune_measure import COMPILE_GAIN, COMPILE_GUESS_S, Row

DEFAULTS = tunable_defaults()


def named(settings: Mapping[str, Any]) -> str:
    """Settings (config keys) as a line says them (`trainer.channels_last=true`); "defaults"
    for none."""
    return ", ".join(f"{k}={override_text(v)}" for k, v in settings.items()) or "defaults"


def not_tried(key: str, steps: Optional[int], base: Row, device: torch.device) -> str:
    """Why a key left to tune had no candidate: a compile the run's `steps` at the untuned step
    (`base`) would not repay (runner.run.tune's rule), max-autotune off CUDA, channels_last
    without a convolution."""
    guess = COMPILE_GUESS_S["cuda" if device.type == "cuda" else "cpu"]
    if key == "trainer.compile_mode" and device.type != "cuda":
        return "kept: max-autotune is tried on a CUDA GPU only"
    if key in ("trainer.compile", "trainer.compile_mode") and steps and base.steady_ms:
        run_s = steps * base.steady_ms / 1e3
        return (
            f"kept: not tried: {steps} steps of {base.steady_ms:.0f} ms (~{run_s:.0f} s) would "
            f"not repay a compile (~{guess:.0f} s; tried where {COMPILE_GAIN:.0%} of the run's "
            "time exceeds it)"
        )
    if key == "trainer.channels_last":
        return "kept: the model has no convolution to lay out"
    return "kept: not a candidate for this run"


@dataclasses.dataclass
class Tuning:
    """What tuning decided and why: the settings (config keys) it set, the reasons per key, the
    candidates' rows, how the decision was reached (measured, cache, checkpoint) and the seconds
    it took."""

    settings: dict[str, Any]
    reasons: dict[str, str]
    rows: list[Row] = dataclasses.field(default_factory=list)
    source: str = "measured"
    seconds: float = 0.0
    chosen: int = 0  # the row chosen
    loader: list[Row] = dataclasses.field(default_factory=list)  # the worker counts' rows

    def params(self) -> dict[str, str]:
        """`tune.<key>`: each tunable setting's value and why it has it; `tune.source`."""
        out = {
            f"tune.{key}": f"{override_text(self.settings[key])} ({why})"
            if key in self.settings
            else why
            for key, why in self.reasons.items()
        }
        out["tune.source"] = self.source
        return out

    def picked(self) -> str:
        """What tuning changed from the defaults, by the keys' last names (`channels_last=true,
        compile=true`); "the defaults" when it changed nothing."""
        changed = [
            f"{key.split('.')[-1]}={override_text(value)}"
            for key, value in self.settings.items()
            if value != DEFAULTS[key]
        ]
        return ", ".join(changed) or "the defaults"

    def table(self) -> str:
        """tune.md: the candidates (settings, steady ms/step, compile s, loss delta, chosen),
        then every decision."""
        lines = [f"# trainer.tune ({self.source}, {self.seconds:.1f} s)", ""]
        if self.rows:
            base = self.rows[0].loss
            lines += [
                "| candidate | steady ms/step (spread, timed) | compile s | loss delta | chosen |",
                "|---|---|---|---|---|",
            ]
            for index, row in enumerate(self.rows):
                name = named(row.settings)
                ms = row.steady()
                delta = (
                    f"{row.loss - base:+.2e}" if row.loss is not None and base is not None else "-"
                )
                chosen = "yes" if index == self.chosen else row.note
                lines.append(f"| {name} | {ms} | {row.compile_s:.1f} | {delta} | {chosen} |")
            lines.append("")
        lines += tune_data.table(self.loader, self.settings)
        lines += [
            f"- {key}"
            + (f"={override_text(self.settings[key])}" if key in self.settings else "")
            + f": {why}"
            for key, why in self.reasons.items()
        ]
        return "\n".join(lines) + "\n"

    def log_to(self, tracked) -> None:
        """The decisions' artifact and the time tuning took (metric tune_time_s)."""
        tracked.log_text(self.table(), "tune.md")
        tracked.log_metrics({m.TUNE_TIME_S: self.seconds}, 0)

    def against_run(self, run_ms: Optional[float], batch: int) -> str:
        """What tune.md adds once the run has trained: its steady step (`run_ms`, a batch of
        `batch` samples) beside the step the tuner measured for the chosen settings, and how far
        apart they are (on a quiet machine within 20%: both take the run's batches through its
        loader, threads and layout); "" where either is unknown."""
        measured = self.rows[self.chosen].steady_ms if self.rows else None
        if run_ms is None or measured is None or measured <= 0:
            return ""
        apart = run_ms / measured - 1
        verdict = "within 20%" if abs(apart) <= 0.2 else "more than 20% apart"
        why = (
            ""
            if abs(apart) <= 0.2
            else ": the machine's load differed between tuning and training, or the run's "
            "loader waited for data the tuner's steps did not (data_wait_frac says which)"
        )
        return (
            f"The run's steady step: {run_ms:.1f} ms a batch of {batch} (its samples_per_s); the "
            f"tuner measured {measured:.1f} ms for the chosen settings: {apart:+.0%}, {verdict}"
            f"{why}.\n"
        )
