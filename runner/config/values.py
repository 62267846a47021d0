"""Plain values read from a config: the predicates value rules are made of (`(key, predicate,
what is allowed)`), and how a boolean, a number or a null is read from what a user typed.

Torch-free: the option specs (`runner.config.options`), `runner.config.validation` and the
property table's parsers (`runner.config.precision`) use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

from runner.errors import ConfigError

Rule = tuple[str, Callable[[Any], bool], str]


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive(v: Any) -> bool:
    return finite(v) and v > 0


BARE_DATABASE_PATH = (
    "a URI with its scheme: a database file is sqlite:///relative/mlflow.db or "
    "sqlite:////absolute/mlflow.db (a bare path is read by MLflow as a folder store)"
)


def bare_database_path(uri: Any) -> bool:
    """A tracking URI that is a path to a database file without `sqlite:///` in front: MLflow
    would take it for a folder store, which it refuses or keeps in maintenance mode."""
    uri = str(uri).strip()
    return "://" not in uri and uri.lower().endswith((".db", ".sqlite", ".sqlite3"))


def bare_database_refusal(path: Any) -> str:
    """What a refusal of a bare database path says (`mlflow.tracking_uri`, the report's
    `--tracking-uri`): the path, and its own `sqlite:///` URI to paste (absolute: the launch
    folder's where relative, the home's for a leading ~)."""
    import os

    uri = "sqlite:///" + os.path.abspath(os.path.expanduser(str(path).strip()))
    return f"got {path!r}, a path; its URI: {uri}"


def with_values(cfg: Any, settings: Mapping[str, Any]) -> Any:
    """A copy of the config `cfg` with `settings` (dotted keys) set, as command-line overrides
    would set them (trainer.tune's chosen settings, a tuning candidate's)."""
    import copy

    from omegaconf import OmegaConf, read_write

    out = copy.deepcopy(cfg)
    with read_write(out):
        for key, value in settings.items():
            OmegaConf.update(out, key, value, merge=False)
    return out


def override_text(value: Any) -> str:
    """A config value as an override writes it: true/false, null, else its text."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending: the sizes that split it evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def heads_refusal(width_key: str, width: int, heads_key: str, heads: int) -> ConfigError:
    """`model.<heads_key>`: an attention splits the width `<width_key>`=`width` into `heads`
    heads, which does not divide it (the GPT's n_embd / n_head, the ViT's hidden_dim /
    num_heads); the heads that do, up to 64."""
    return ConfigError(
        f"model.{heads_key}",
        f"the width {width_key}={width} is split into {heads_key}={heads} heads, which does not "
        "divide it",
        [str(d) for d in divisors(width) if d <= 64],
    )


def non_negative(v: Any) -> bool:
    return finite(v) and v >= 0


def unit_interval(v: Any) -> bool:  # [0, 1)
    return finite(v) and 0 <= v < 1


SEED_RANGE = "an integer in [0, 2**63)"


def seed(v: Any) -> bool:  # what torch.manual_seed and a generator take, without wrapping
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def optional(rule: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or rule(v)


BATCH_LIMIT = "null, an integer >= 1 (batches an epoch) or a number in (0, 1] (a share of them)"


def batch_limit(value: Any) -> bool:
    """`trainer.limit_*_batches`: a count of batches, or a share of the epoch's (Lightning's)."""
    return integer_at_least(1)(value) or (isinstance(value, float) and 0.0 < value <= 1.0)


def one_of(choices: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: v in choices


def integer_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


# ---- reading what a user typed ------------------------------------------------------------------
NONE_STRINGS = ("none", "null", "~", "")
TRUE_STRINGS = ("true", "yes", "on")
FALSE_STRINGS = ("false", "no", "off")


def is_none(value: Any) -> bool:
    """None, or a string that says it ("null", "None", "~", "")."""
    return value is None or (isinstance(value, str) and value.strip().lower() in NONE_STRINGS)


def parse_bool(key: str, value: Any, allow_none: bool) -> Optional[bool]:
    """True/False (also "yes", "off", ...), or None where `allow_none`; else ConfigError(key)."""
    allowed = ["True", "False"] + (["None"] if allow_none else [])
    if isinstance(value, bool):
        return value
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        s = value.strip().lower()
        if s in TRUE_STRINGS:
            return True
        if s in FALSE_STRINGS:
            return False
        if allow_none and s in NONE_STRINGS:
            return None
    raise ConfigError(key, f"expected a boolean, got {value!r}", allowed)


def to_number(value: Any) -> Optional[float]:
    """A float from a number or a numeric string ("128.0"); None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None
