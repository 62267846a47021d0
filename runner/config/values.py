"""The predicates value rules are made of: `(key, predicate, what is allowed)`.

Torch-free: the option specs (`runner.config.options`) and `runner.config.validation` both use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Rule = tuple[str, Callable[[Any], bool], str]


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive(v: Any) -> bool:
    return finite(v) and v > 0


def non_negative(v: Any) -> bool:
    return finite(v) and v >= 0


def unit_interval(v: Any) -> bool:  # [0, 1)
    return finite(v) and 0 <= v < 1


SEED_RANGE = "an integer in [0, 2**63)"


def seed(v: Any) -> bool:  # what torch.manual_seed and a generator take, without wrapping
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def optional(rule: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or rule(v)


def one_of(choices: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: v in choices


def integer_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low
