"""Layer rules and plan files: the entries of a layer plan (module-name glob -> format), where
each comes from (`precision.layers`, a plan file, the auto plan), and plan files read and written
(untrusted YAML: read as plain data). See README.md beside this file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config import formats
from runner.config import precision as ptable
from runner.errors import ConfigError
from runner.precision.dtypes import TORCH_DTYPES
from runner.precision.properties import Properties

LAYERS_KEY = "precision.layers"
PLAN_KEY = "precision.layer_plan"
AUTO = ptable.AUTO_PLAN
FP8 = formats.FP8
DTYPES = TORCH_DTYPES
SHORT = formats.SHORT_NAMES
MAX_PLAN_BYTES = 16 * 2**20  # a plan file is a mapping of names: anything larger is not one
PLAN_FILE_KEYS = ("layers", "why", "about")  # the keys of a plan file's long form


@dataclass(frozen=True)
class LayerRule:
    """One entry: a module-name glob and its format, from `source` (`precision.layers`, a plan
    file's path, or `auto`), with the plan's reason for it where it has one."""

    pattern: str
    format: str
    source: str = LAYERS_KEY
    why: str = ""

    @property
    def key(self) -> str:
        """The config key an error about this entry names."""
        return f"{LAYERS_KEY}.{self.pattern}" if self.source == LAYERS_KEY else PLAN_KEY

    def origin(self) -> str:
        """Where the entry comes from, as a person reads it."""
        if self.source == LAYERS_KEY:
            return f"precision.layers['{self.pattern}']"
        if self.source == AUTO:
            return f"the auto plan ('{self.pattern}')"
        return f"{self.source}: '{self.pattern}'"

    def where(self) -> str:
        """`precision.layers` or `precision.layer_plan (plan.yaml)`, for messages."""
        return LAYERS_KEY if self.source == LAYERS_KEY else f"{PLAN_KEY} ({self.source})"

    def as_list(self) -> list[str]:
        """The rule as a checkpoint keeps it (plain values)."""
        return [self.pattern, self.format, self.source, self.why]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> LayerRule:
        pattern, fmt, source, why = (str(x) for x in item)
        return cls(pattern, ptable.parse_layer_format(LAYERS_KEY, fmt), source, why)


def config_rules(properties: Properties) -> list[LayerRule]:
    """`precision.layers` as rules, in order."""
    return [LayerRule(pattern, fmt) for pattern, fmt in properties.layers]


def load_plan_file(path: str | Path) -> list[LayerRule]:
    """The rules of a plan file (untrusted input: read as plain YAML, nothing in it runs), in
    order. Refused with a ConfigError naming `precision.layer_plan` and the file: missing,
    unreadable, not YAML, not a mapping of globs to formats, an unknown key."""
    import yaml

    p = Path(path).expanduser()
    where = f"the plan file {path}"
    if not p.is_file():
        raise ConfigError(
            PLAN_KEY,
            f"{where} does not exist (or is not a file)",
            "null, auto, or the path of a YAML file (python -m runner.diagnose "
            "... --plan plan.yaml writes one)",
        )
    if p.stat().st_size > MAX_PLAN_BYTES:
        raise ConfigError(
            PLAN_KEY,
            f"{where} is {p.stat().st_size} bytes: not a plan (at most {MAX_PLAN_BYTES} bytes)",
            "a YAML mapping of globs to formats",
        )
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(PLAN_KEY, f"{where} cannot be read: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(
            PLAN_KEY, f"{where} is not valid YAML: {' '.join(str(error).split())}"
        ) from None
    return parse_plan(data, str(path))


def parse_plan(data: Any, source: str) -> list[LayerRule]:
    """A plan's rules from its YAML data: either the mapping itself (`head: float32`), or the
    long form `{layers: {...}, why: {glob: reason}, about: ...}` that `plan_yaml` writes (where
    `layers: {}` is a plan that keeps every layer as the level makes it)."""
    where = f"the plan file {source}"
    if isinstance(data, Mapping) and isinstance(data.get("layers"), Mapping):
        unknown = [str(k) for k in data if k not in PLAN_FILE_KEYS]
        if unknown:
            raise ConfigError(
                PLAN_KEY,
                f"{where} has unknown key(s) {', '.join(unknown)}",
                ", ".join(PLAN_FILE_KEYS),
            )
        layers, why = data["layers"], data.get("why") or {}
        if not isinstance(why, Mapping):
            raise ConfigError(
                PLAN_KEY, f"{where}: 'why' must map globs to reasons, got {type(why).__name__}"
            )
    elif isinstance(data, Mapping):
        layers, why = data, {}
    else:
        raise ConfigError(
            PLAN_KEY,
            f"{where} holds {type(data).__name__ if data is not None else 'nothing'}"
            ", not a mapping of module-name globs to formats",
            "e.g. 'head: float32' on a line of its own",
        )
    if not layers and "layers" not in data:  # (`layers: {}` says it: the level everywhere)
        raise ConfigError(PLAN_KEY, f"{where} names no layer", "at least one 'glob: format' entry")
    rules = []
    for key, fmt in layers.items():
        pattern = ptable.layer_glob(key, PLAN_KEY, f"{where}: ")
        try:
            fmt = ptable.parse_layer_format(PLAN_KEY, fmt)
        except ConfigError as error:
            raise ConfigError(
                PLAN_KEY, f"{where}: '{pattern}': {error.problem}", error.allowed
            ) from None
        reason = why.get(pattern, "")
        rules.append(LayerRule(pattern, fmt, source, str(reason) if reason else ""))
    return rules


def plan_yaml(rules: Sequence[LayerRule], header: Sequence[str] = ()) -> str:
    """A plan file: `header` as comments, then `layers` (glob: format) and `why` (glob: reason,
    where a rule has one). `load_plan_file` reads it back to the same rules."""
    import yaml

    body: dict[str, Any] = {"layers": {r.pattern: r.format for r in rules}}
    why = {r.pattern: r.why for r in rules if r.why}
    if why:
        body["why"] = why
    lines = [f"# {line}" if line else "#" for line in header]
    text = yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(lines + [text]) if lines else text
