"""Apex amp's optimization levels resolved into `Properties`: a level's values, the user's
overrides by key, every value parsed and normalised once.

A level (O0-O3) is only a preset for five properties; users override any of them by key, so the
runner works on the resolved `Properties`, never on the level name. `resolve_properties` parses
and normalises every value once (config files, the CLI and Python callers spell them
differently); invalid values raise `ConfigError` naming the `precision.<key>`.

The names this module always held stay importable from it: `Properties` (`recipe`), `Finding`,
`Resolution`, `Context`, `RuleSet`, `strict_finding` (`findings`), `LEVEL_RULES` and
`level_preset` (`level_rules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner.config import formats
from runner.config import precision as ptable
from runner.config.levels import LEVEL_VALUES
from runner.errors import ConfigError
from runner.precision.findings import (
    Context,
    Finding,
    Resolution,
    Rule,
    RuleSet,
    strict_finding,
)
from runner.precision.level_rules import LEVEL_RULES, level_preset
from runner.precision.recipe import (
    HALF_DTYPES,
    TORCH_DTYPES,
    LossScale,
    Properties,
    dtype_name,
)
from runner.precision.recipe import (
    _rebuild_properties as _rebuild_properties,  # pickles made before the move name it here
)

__all__ = [
    "LEVELS",
    "LEVEL_DESCRIPTIONS",
    "PROPERTY_KEYS",
    "FP8_RECIPES",
    "HALF_DTYPES",
    "LossScale",
    "Properties",
    "dtype_name",
    "parse_opt_level",
    "parse_property",
    "resolve_properties",
    "Finding",
    "Resolution",
    "Context",
    "Rule",
    "RuleSet",
    "strict_finding",
    "LEVEL_RULES",
    "level_preset",
]

# The five properties each Apex level fixes (apex/amp/frontend.py), from the one table of
# `runner.config.levels` with its dtype names parsed (set below, after the parsers).
LEVELS: dict[str, dict[str, Any]] = {}

LEVEL_DESCRIPTIONS = {
    "O0": "fp32 baseline",
    "O1": "mixed precision (autocast)",
    "O2": "almost fp16 (half model, fp32 BatchNorm, fp32 master weights)",
    "O3": "pure fp16",
}

# Keys an override may name: every property of the table (runner.config.precision.PROPERTIES);
# `strict` is accepted too (it changes findings, not properties).
PROPERTY_KEYS = ptable.property_names()

# torchao's float8 training recipes for Linear layers
FP8_RECIPES = ptable.FP8_RECIPES


# ---- parsing (the table's parsers, dtype names made torch dtypes) ------------------------------
def _key(name: str) -> str:
    return f"precision.{name}"


def parse_opt_level(value: Any) -> str:
    allowed = tuple(LEVELS)
    if not isinstance(value, str):
        raise ConfigError(_key("opt_level"), f"expected a level name, got {value!r}", allowed)
    level = value.strip().upper()
    if level in LEVELS:
        return level
    if len(level) == 2 and level[0] == "0" and level[1] in "0123":
        raise ConfigError(
            _key("opt_level"),
            f"{value!r} starts with the digit zero; the prefix is the letter O (O{level[1]})",
            allowed,
        )
    raise ConfigError(_key("opt_level"), f"unknown level {value!r}", allowed)


def _runtime(name: str, value: Any) -> Any:
    """A parsed value as the engine uses it: a dtype's name becomes the torch.dtype."""
    prop = ptable.property_for(name)
    return TORCH_DTYPES[value] if prop.kind == "dtype" and value is not None else value


def parse_property(name: str, value: Any) -> Any:
    """`value` of the property `name` parsed (runner.config.precision.parse), as the engine
    uses it; ConfigError naming `precision.<name>` for a bad one."""
    return _runtime(name, ptable.parse(name, value))


def _level_properties(level: str) -> dict[str, Any]:
    """Every property's value at `level`: the table's defaults, the level's own on top."""
    return {k: _runtime(k, v) for k, v in ptable.level_values(LEVEL_VALUES[level]).items()}


LEVELS.update(
    {
        level: {k: parse_property(k, v) for k, v in values.items()}
        for level, values in LEVEL_VALUES.items()
    }
)


def resolve_properties(
    opt_level: str, overrides: Mapping[str, Any] | None = None
) -> tuple[Properties, bool]:
    """Level defaults, then `overrides` by key, parsed and normalised: (properties, strict).

    `overrides` may be the whole precision config (its values equal to the level's defaults are
    fine, an `opt_level` key is accepted when it names the same level, a `strict` key is read
    and returned, and `kernels` (the engine's backend choice) and `preset` (the option file's
    name) are ignored here). Invalid values raise ConfigError naming the `precision.<key>`.
    """
    level = parse_opt_level(opt_level)
    values = _level_properties(level)
    strict_value: Any = False
    for key, raw in (overrides or {}).items():
        if key == "opt_level":
            if parse_opt_level(raw) != level:
                raise ConfigError(
                    _key("opt_level"),
                    f"override {raw!r} contradicts the level {level}",
                    tuple(LEVELS),
                )
            continue
        if key == "strict":
            strict_value = raw
            continue
        if key in ptable.NON_PROPERTY_KEYS:
            continue  # how the engine runs (kernels), the preset's file name, how a plan is made
        values[key] = parse_property(str(key), raw)  # an unknown key: ConfigError, named
    strict = bool(ptable.parse_bool(_key("strict"), strict_value, allow_none=False))
    ptable.check_scaler_bounds(values)
    if values["optimizer_state"] is None:  # named, so that the params say the state's format:
        # the stepped weights' own type (`Properties.state_format`'s default), before building
        stepped = formats.stepped_dtype_name(
            dtype_name(values["cast_model_type"]), values["master_weights"]
        )
        values["optimizer_state"] = stepped
    return Properties(level, **values), strict
