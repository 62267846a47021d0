"""Apex amp's O0-O3 on modern PyTorch: resolve the five properties, then run them with AmpEngine."""
from runner.precision.engine import AmpEngine, Stage
from runner.precision.properties import LEVELS, Finding, Properties, Resolution
from runner.precision.rules import resolve
from runner.precision import amp  # noqa: E402  (Apex-compatible facade)

__all__ = ["LEVELS", "Properties", "Finding", "Resolution", "resolve", "AmpEngine", "Stage", "amp"]
