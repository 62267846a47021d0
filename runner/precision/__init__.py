"""Precision: Apex amp's O0-O3 (and bf16, fp8, stochastic rounding) on modern PyTorch: resolve
the properties, then run them around a plain training step with `AmpEngine`.

What it holds, by job:
- the properties: `recipe` (`Properties`), `properties` (a level and overrides resolved into
  them), `findings`, `level_rules`, `checks` and `optimizer_rules` (the rules), `resolver`
  (`resolve`: every set);
- the engine: `engine` (`AmpEngine`, the trainer's: one loss, one optimizer), `model_cast` (what
  it does to the models), `stepper` (an optimizer's round and its stages), `paths` and `fused`
  (torch's ops or the kernels), `rates` (learning rates the kernels read on the device),
  `device_skip` (an optimizer's own step undone on the device's overflow flag), `master`,
  `scaler`, `casting`, `autocast`, `rounding`, `state` (the optimizer state's format), `fp8`,
  `layers` (precision per layer);
- the Apex facade: `amp` (its calls), `apex_engine` (`ApexEngine`: several losses and optimizers),
  `amp_state`, `amp_wrappers`, `apex_o1`, `apex_lists`.
README.md beside this file explains the engine's step and the facade.

The names below load on first use (PEP 562), so that `runner.config.levels` (the level table,
torch-free) can be imported while a config is composed without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AmpEngine": "runner.precision.engine",
    "Stage": "runner.precision.stepper",
    "LEVELS": "runner.precision.properties",
    "Finding": "runner.precision.findings",
    "Properties": "runner.precision.recipe",
    "Resolution": "runner.precision.findings",
    "resolve": "runner.precision.resolver",
    "amp": "runner.precision.amp",
}

__all__ = ["LEVELS", "Properties", "Finding", "Resolution", "resolve", "AmpEngine", "Stage", "amp"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runner.precision' has no attribute {name!r}")
    value = importlib.import_module(module)
    return value if name == "amp" else getattr(value, name)
