"""Apex amp's O0-O3 on modern PyTorch: resolve the five properties, then run them with AmpEngine.

The names below load on first use (PEP 562), so that `runner.config.levels` (the level table,
torch-free) can be imported while a config is composed without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AmpEngine": "runner.precision.engine",
    "Stage": "runner.precision.engine",
    "LEVELS": "runner.precision.properties",
    "Finding": "runner.precision.properties",
    "Properties": "runner.precision.properties",
    "Resolution": "runner.precision.properties",
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
