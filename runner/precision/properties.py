"""Apex amp's optimization levels as five resolved properties, plus the rules that judge them.

A level (O0-O3) is only a preset for five properties; users override any of them by key, so the
runner works on the resolved `Properties`, never on the level name. `resolve` parses and
normalises every value once (config files, the CLI and Python callers spell them differently)
and runs the rules in `RULES`, which return `Finding`s (info / warning / error) for the caller to
print and log. Invalid values raise `ConfigError` naming the `precision.<key>`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Union

import torch

from runner.errors import ConfigError

LossScale = Union[float, Literal["dynamic"]]

# The five properties each Apex level fixes (apex/amp/frontend.py).
LEVELS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}

LEVEL_DESCRIPTIONS = {
    "O0": "fp32 baseline",
    "O1": "mixed precision (autocast)",
    "O2": "almost fp16 (half model, fp32 BatchNorm, fp32 master weights)",
    "O3": "pure fp16",
}

HALF_DTYPES = (torch.float16, torch.bfloat16)

# Keys an override may name: the five Apex properties, plus the dtype O1's autocast uses.
PROPERTY_KEYS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                 "master_weights", "loss_scale", "autocast_dtype")

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
_NONE_STRINGS = ("none", "null", "~", "")
_TRUE_STRINGS = ("true", "yes", "on")
_FALSE_STRINGS = ("false", "no", "off")


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """`torch.float16` -> "float16"; None -> "None" (the spelling the config files use)."""
    return "None" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Properties:
    """The resolved precision recipe the engine executes; immutable so it can be logged once."""

    opt_level: str
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[bool]
    loss_scale: LossScale
    autocast_dtype: torch.dtype = torch.float16

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def casts_to_half(self) -> bool:
        """True when the model itself is cast to a 16-bit type (O2/O3-like)."""
        return self.cast_model_type in HALF_DTYPES

    @property
    def uses_master_weights(self) -> bool:
        """Masters only mean something for a model cast to a 16-bit type."""
        return bool(self.master_weights) and self.casts_to_half

    def as_params(self) -> dict[str, str]:
        """Flat string values for tracking (MLflow params); the caller adds `precision.`."""
        def fmt(v: Any) -> str:
            if v is None or isinstance(v, torch.dtype):
                return dtype_name(v)
            return str(v)

        return {
            "opt_level": self.opt_level,
            "cast_model_type": fmt(self.cast_model_type),
            "patch_torch_functions": fmt(self.patch_torch_functions),
            "keep_batchnorm_fp32": fmt(self.keep_batchnorm_fp32),
            "master_weights": fmt(self.master_weights),
            "loss_scale": fmt(self.loss_scale),
            "autocast_dtype": fmt(self.autocast_dtype),
        }

    def table(self) -> str:
        """A small aligned property | value table, printed at the start of a run."""
        rows = list(self.as_params().items())
        w = max(len("property"), *(len(k) for k, _ in rows))
        v = max(len("value"), *(len(val) for _, val in rows))
        lines = [f"{'property':<{w}}  {'value':<{v}}".rstrip(), f"{'-' * w}  {'-' * v}"]
        lines += [f"{k:<{w}}  {val}" for k, val in rows]
        return "\n".join(lines)


@dataclass
class Finding:
    """One remark about a resolved configuration; `hint` says what to change."""

    level: Literal["info", "warning", "error"]
    property: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"[{self.level}] precision.{self.property}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


@dataclass
class Resolution:
    """What `resolve` returns: the properties to run with and every finding about them."""

    properties: Properties
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def findings_table(self) -> str:
        """The findings as printed before training, by dry runs, and attached to the run."""
        if not self.findings:
            return "No findings: the precision properties are consistent."
        w = max(len("property"), *(len(f.property) for f in self.findings))
        lines = [f"{'level':<8} {'property':<{w}}  message"]
        for f in self.findings:
            hint = f" Hint: {f.hint}" if f.hint else ""
            lines.append(f"{f.level:<8} {f.property:<{w}}  {f.message}{hint}")
        return "\n".join(lines)


# ---- parsing -------------------------------------------------------------------------------
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


def _parse_dtype(name: str, value: Any, allowed: tuple[torch.dtype, ...],
                 allow_none: bool) -> Optional[torch.dtype]:
    names = [dtype_name(d) for d in allowed] + (["None"] if allow_none else [])
    if value is None:
        if allow_none:
            return None
        raise ConfigError(_key(name), "must not be None", names)
    dtype: Optional[torch.dtype] = None
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        s = value.strip().lower()
        if allow_none and s in _NONE_STRINGS:
            return None
        dtype = _DTYPE_ALIASES.get(s.removeprefix("torch."))
    if dtype is None or dtype not in allowed:
        raise ConfigError(_key(name), f"unsupported dtype {value!r}", names)
    return dtype


def _parse_bool(name: str, value: Any, allow_none: bool) -> Optional[bool]:
    allowed = ["True", "False"] + (["None"] if allow_none else [])
    if isinstance(value, bool):
        return value
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        s = value.strip().lower()
        if s in _TRUE_STRINGS:
            return True
        if s in _FALSE_STRINGS:
            return False
        if allow_none and s in _NONE_STRINGS:
            return None
    raise ConfigError(_key(name), f"expected a boolean, got {value!r}", allowed)


def parse_loss_scale(value: Any) -> LossScale:
    allowed = '"dynamic" or a positive finite number'
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    number: Optional[float] = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ConfigError(_key("loss_scale"), f"invalid loss scale {value!r}", allowed)
    return number


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "cast_model_type": lambda v: _parse_dtype(
        "cast_model_type", v, (torch.float16, torch.bfloat16, torch.float32), allow_none=True),
    "patch_torch_functions": lambda v: _parse_bool("patch_torch_functions", v, allow_none=False),
    "keep_batchnorm_fp32": lambda v: _parse_bool("keep_batchnorm_fp32", v, allow_none=True),
    "master_weights": lambda v: _parse_bool("master_weights", v, allow_none=True),
    "loss_scale": parse_loss_scale,
    "autocast_dtype": lambda v: _parse_dtype(
        "autocast_dtype", v, (torch.float16, torch.bfloat16), allow_none=False),
}


# ---- rules ---------------------------------------------------------------------------------
# A rule looks at resolved properties (and the device, None when unknown) and yields findings.
# Add one by decorating a function with @rule; `resolve` runs them all in order.
Rule = Callable[[Properties, Optional[torch.device]], Iterable[Finding]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


@rule
def _fp16_on_cpu(p: Properties, device: Optional[torch.device]) -> Iterable[Finding]:
    if device is None or device.type != "cpu":
        return
    if p.cast_model_type == torch.float16:
        yield Finding("warning", "cast_model_type",
                      "fp16 is emulated on CPU and far slower than bfloat16",
                      "set precision.cast_model_type=bfloat16 on CPU")
    if p.patch_torch_functions and p.autocast_dtype == torch.float16:
        yield Finding("warning", "patch_torch_functions",
                      "fp16 is emulated on CPU and far slower than bfloat16",
                      "autocast with autocast_dtype=bfloat16 on CPU")


@rule
def _master_weights_without_half_model(p: Properties, device: Optional[torch.device]
                                       ) -> Iterable[Finding]:
    if p.master_weights and not p.casts_to_half:
        if p.opt_level == "O1" and p.cast_model_type is None:
            what = "O1 keeps the model in fp32"
        else:
            what = ("the model is not cast to a 16-bit type "
                    f"(cast_model_type={dtype_name(p.cast_model_type)})")
        yield Finding("warning", "master_weights",
                      f"master_weights=True is meaningless here and ignored: {what}",
                      "leave precision.master_weights unset (null) for this level")


def _as_device(device: torch.device | str | None) -> Optional[torch.device]:
    return None if device is None else torch.device(device)


def resolve(opt_level: str, overrides: Mapping[str, Any] | None = None,
            device: torch.device | str | None = None) -> Resolution:
    """Level defaults, then `overrides` by key, parsed and normalised; then every rule's findings.

    `overrides` may be the whole precision config (its values equal to the level's defaults are
    fine, and an `opt_level` key is accepted when it names the same level).
    """
    level = parse_opt_level(opt_level)
    values: dict[str, Any] = dict(LEVELS[level])
    for key, raw in (overrides or {}).items():
        if key == "opt_level":
            if parse_opt_level(raw) != level:
                raise ConfigError(_key("opt_level"),
                                  f"override {raw!r} contradicts the level {level}", tuple(LEVELS))
            continue
        if key not in _PARSERS:
            raise ConfigError(_key(str(key)), "unknown precision property", PROPERTY_KEYS)
        values[key] = _PARSERS[key](raw)
    props = Properties(opt_level=level, **values)
    dev = _as_device(device)
    findings = [f for r in RULES for f in r(props, dev)]
    return Resolution(properties=props, findings=findings)

