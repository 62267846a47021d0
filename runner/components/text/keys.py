"""The text datasets' `data` keys, read and checked: a missing or wrong value raises
`ConfigError` naming the key (`data.block_size`, ...), with what belongs there."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np
from omegaconf.errors import MissingMandatoryValue

from runner.errors import ConfigError

DEFAULT_BLOCK_SIZE = 256
DEFAULT_VAL_FRACTION = 0.1


def get(node: Any, key: str, default: Any = None) -> Any:
    """node.key, or `default` where it is absent, null or missing (`???`)."""
    try:
        value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    except MissingMandatoryValue:  # `???` in an option's YAML
        return default
    return default if value is None or (isinstance(value, str) and value == "???") else value


def int_key(node: Any, key: str, default: Any, minimum: int, why: str = "") -> int:
    """data.`key`, an integer >= `minimum` (`why`: what sets the minimum, told with it)."""
    value = get(node, f"{key}", default)
    allowed = f"an integer >= {minimum}" + (f" ({why})" if why else "")
    if value is None:
        raise ConfigError(f"data.{key}", "is not set", allowed)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"data.{key}", f"is {value!r}", allowed)
    return int(value)


def block_size(node: Any, default: Optional[int] = DEFAULT_BLOCK_SIZE) -> int:
    return int_key(node, "block_size", default, 1)


def val_fraction(node: Any) -> float:
    value = get(node, "val_fraction", DEFAULT_VAL_FRACTION)
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = math.nan
    if isinstance(value, bool) or not 0.0 < fraction < 1.0:
        raise ConfigError("data.val_fraction", f"is {value!r}", "a number in (0, 1)")
    return fraction


def path(node: Any, key: str, what: str) -> str:
    value = get(node, key)
    if value is None or str(value).strip() == "":
        raise ConfigError(f"data.{key}", "is not set", what)
    return os.path.abspath(os.path.expanduser(str(value)))
