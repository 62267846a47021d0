"""What is measured before a run's plan is made, and that plan, made once with it.

Two things are measured on builds of the config as given (its plan checked first, so bad input
stops before any measuring): the layer plan's pre-flight where `precision.layer_plan=auto`
(runner.run.autoplan: each layer's format from its measured ranges) and `trainer.tune` (runner.run.
tune: the settings left at their defaults, timed). What they decide is the input of the run's plan
(`runner.run.plan.Measured`: the entries, and the settings set on the config as overrides), so the
plan the run trains with is checked once and never replaced: its name, params, findings and
precision table are those of a run given the same settings by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner.precision import layers
from runner.run import autoplan, tune
from runner.run.distributed import Comm
from runner.run.plan import Measured, RunPlan, make_plan
from runner.run.recorded import Launch
from runner.run.tune_decision import Tuning


def measured_plan(
    given: RunPlan,
    comm: Comm,
    device: torch.device,
    launch: Optional[Launch] = None,
    datasets: Any = None,
) -> tuple[RunPlan, Optional[Tuning]]:
    """The run's plan: `given` (the config as given, planned), or where something was measured,
    the plan made with it; and trainer.tune's decision (None: it did not tune). Tuning times
    the config with the auto layer plan's entries, where there are some. `launch`: how the run
    was started (what its command line names, tuning keeps; a sweep job's name; the folder of
    the pre-flight's files); `datasets`: the run's, loaded where tuning counts on them."""
    launch = launch or Launch()
    plan, measured = given, Measured()
    if given.properties.layer_plan == layers.AUTO:  # the pre-flight plans each layer's format
        entries, text = autoplan.entries(given, comm, device, launch.output_dir)
        measured = Measured(layer_entries=entries, auto_plan=text)
        plan = make_plan(given.cfg, launch.apart, measured)
    tuning = tune.tuned(plan, comm, device, launch.overrides, datasets)
    if tuning is not None and _changes(plan, tuning.settings):
        measured = dataclasses.replace(measured, settings=dict(tuning.settings))
        plan = make_plan(given.cfg, launch.apart, measured)
    return plan, tuning


def _changes(plan: RunPlan, settings: dict[str, Any]) -> bool:
    """Whether `settings` set a key of `plan`'s config to another value."""
    return any(OmegaConf.select(plan.cfg, key) != value for key, value in settings.items())
