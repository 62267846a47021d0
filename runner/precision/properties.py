"""Apex amp's optimization levels as five resolved properties, plus the rules that judge them.

A level (O0-O3) is only a preset for five properties; users override any of them by key, so the
runner works on the resolved `Properties`, never on the level name. `resolve_properties` parses
and normalises every value once (config files, the CLI and Python callers spell them
differently); invalid values raise `ConfigError` naming the `precision.<key>`. The rules in
`LEVEL_RULES` judge the combination of properties and return `Finding`s (info / warning / error).

Rules about the hardware, the optimizer's epsilon and the model's shapes live in
`runner.precision.checks` (which builds on this module); `runner.precision.resolver.resolve` runs
both sets (with `strict=True` every warning becomes an error).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Union

import torch

from runner.errors import ConfigError
from runner.config.levels import LEVEL_VALUES, SCALER_DEFAULTS

LossScale = Union[float, Literal["dynamic"]]

# The five properties each Apex level fixes (apex/amp/frontend.py), from the one table of
# `runner.config.levels` with its dtype names parsed (set below, after the parsers).
LEVELS: dict[str, dict[str, Any]] = {}

LEVEL_DESCRIPTIONS = {
    "O0": "fp32 baseline",
    "O1": "mixed precision (autocast)",
    "O2": "almost fp16 (half model, fp32 BatchNorm, fp32 master weights)",
    "O3": "pure fp16",
}

HALF_DTYPES = (torch.float16, torch.bfloat16)

# Keys an override may name: the five Apex properties, the dtype O1's autocast uses, and the
# dynamic loss scaling knobs; `strict` is accepted too (it changes findings, not properties).
PROPERTY_KEYS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                 "master_weights", "loss_scale", "autocast_dtype", "fp8_linear",
                 "stochastic_rounding", *SCALER_DEFAULTS)

# torchao's float8 training recipes for Linear layers (e4m3 forward, e5m2 gradients, dynamic
# scaling): one scale per tensor, or per row (more accurate, slower).
FP8_RECIPES = ("tensorwise", "rowwise")

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
    # dynamic loss scaling (see runner.precision.scaler.LossScaler)
    init_scale: float = SCALER_DEFAULTS["init_scale"]
    growth_factor: float = SCALER_DEFAULTS["growth_factor"]
    backoff_factor: float = SCALER_DEFAULTS["backoff_factor"]
    growth_interval: int = SCALER_DEFAULTS["growth_interval"]
    hysteresis: int = SCALER_DEFAULTS["hysteresis"]
    min_loss_scale: Optional[float] = SCALER_DEFAULTS["min_loss_scale"]
    max_loss_scale: float = SCALER_DEFAULTS["max_loss_scale"]
    # beyond Apex: torchao's float8 recipe for the Linear layers' GEMMs (None: none), and
    # stochastic rounding of a bf16 model's weights at each update (no fp32 masters)
    fp8_linear: Optional[str] = None
    stochastic_rounding: bool = False

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def autocasts(self) -> bool:
        """True when forward runs under autocast (O1-like)."""
        return self.patch_torch_functions

    @property
    def compute_dtypes(self) -> set[torch.dtype]:
        """The 16-bit types the forward/backward actually compute in (empty: fp32 only)."""
        used = set()
        if self.casts_to_half:
            used.add(self.cast_model_type)
        if self.patch_torch_functions:
            used.add(self.autocast_dtype)
        return used

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        """The type of the weights the optimizer steps, hence of its state (Adam's moments):
        the model's 16-bit type without master weights, else fp32."""
        if self.casts_to_half and not self.uses_master_weights:
            return self.cast_model_type
        return torch.float32

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
            "fp8_linear": fmt(self.fp8_linear),
            "stochastic_rounding": fmt(self.stochastic_rounding),
            **{k: fmt(getattr(self, k)) for k in SCALER_DEFAULTS},
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

    @property
    def key(self) -> str:
        """The config key to change: `precision.<property>`, or the property itself when it
        already names another group's key (`optimizer.eps`) or a whole group (`model`)."""
        if "." in self.property or self.property in _OTHER_GROUPS:
            return self.property
        return f"precision.{self.property}"

    def __str__(self) -> str:
        text = f"[{self.level}] {self.key}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


_OTHER_GROUPS = ("model", "data", "optimizer", "scheduler", "trainer")


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

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "info"]

    def summary(self) -> str:
        """Counts, e.g. "0 error, 2 warning, 1 info" (the `precision.findings` MLflow tag)."""
        return f"{len(self.errors)} error, {len(self.warnings)} warning, {len(self.infos)} info"

    def compact(self) -> str:
        """One line per run: "warning precision.cast_model_type; info model" (empty: none)."""
        return "; ".join(f"{f.level} {f.key}" for f in self.findings)

    def findings_table(self) -> str:
        """The findings as printed before training, by dry runs, and attached to the run."""
        if not self.findings:
            return "No findings: the precision properties are consistent."
        w = max(len("property"), *(len(f.key) for f in self.findings))
        lines = [f"{'level':<8} {'property':<{w}}  message"]
        for f in self.findings:
            hint = f" Hint: {f.hint}" if f.hint else ""
            lines.append(f"{f.level:<8} {f.key:<{w}}  {f.message}{hint}")
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


def _parse_choice(name: str, value: Any, choices: tuple[str, ...]) -> Optional[str]:
    """One of `choices` (case-insensitive), or None (null, "none")."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS):
        return None
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ConfigError(_key(name), f"got {value!r}", ["null", *choices])


def parse_loss_scale(value: Any) -> LossScale:
    allowed = '"dynamic" or a positive finite number'
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    number = _to_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ConfigError(_key("loss_scale"), f"invalid loss scale {value!r}", allowed)
    return number


def _to_number(value: Any) -> Optional[float]:
    """A float from a number or a numeric string ("128.0"); None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _parse_number(name: str, value: Any, ok: Callable[[float], bool], allowed: str,
                  allow_none: bool = False, integer: bool = False) -> Any:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS):
        if allow_none:
            return None
        raise ConfigError(_key(name), "must not be None", allowed)
    number = _to_number(value)
    if number is None or not math.isfinite(number) or not ok(number):
        raise ConfigError(_key(name), f"got {value!r}", allowed)
    if integer:
        if number != int(number):
            raise ConfigError(_key(name), f"got {value!r}", allowed)
        return int(number)
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
    "init_scale": lambda v: _parse_number(
        "init_scale", v, lambda x: x > 0, "a finite number > 0, e.g. 65536"),
    "growth_factor": lambda v: _parse_number(
        "growth_factor", v, lambda x: x > 1, "a finite number > 1, e.g. 2"),
    "backoff_factor": lambda v: _parse_number(
        "backoff_factor", v, lambda x: 0 < x < 1, "a number in (0, 1), e.g. 0.5"),
    "growth_interval": lambda v: _parse_number(
        "growth_interval", v, lambda x: x >= 1, "an integer >= 1, e.g. 2000", integer=True),
    "hysteresis": lambda v: _parse_number(
        "hysteresis", v, lambda x: x >= 1, "an integer >= 1 (1 = Apex, 2 = DeepSpeed)",
        integer=True),
    "min_loss_scale": lambda v: _parse_number(
        "min_loss_scale", v, lambda x: x > 0, "null or a finite number > 0", allow_none=True),
    "max_loss_scale": lambda v: _parse_number(
        "max_loss_scale", v, lambda x: x > 0, "a finite number > 0, e.g. 16777216 (2^24)"),
    "fp8_linear": lambda v: _parse_choice("fp8_linear", v, FP8_RECIPES),
    "stochastic_rounding": lambda v: _parse_bool("stochastic_rounding", v, allow_none=False),
}

LEVELS.update({level: {key: _PARSERS[key](value) for key, value in values.items()}
               for level, values in LEVEL_VALUES.items()})


# ---- rules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """What a rule may look at besides the properties; None where the caller does not know."""

    device: Any = None  # runner.precision.checks.DeviceInfo
    optimizer: Optional[Mapping[str, Any]] = None  # the optimizer config: name, eps, ...
    compiled: Optional[bool] = None  # whether the forward runs through torch.compile


# A rule looks at resolved properties and the context and yields findings.
Rule = Callable[[Properties, Context], Iterable[Finding]]


class RuleSet(list):
    """An ordered list of rules; decorating a function with the set appends it."""

    def __call__(self, fn: Rule) -> Rule:
        self.append(fn)
        return fn


# The rules about the combination of properties; `runner.precision.resolver.resolve` runs these,
# then the hardware and optimizer rules of `runner.precision.checks`.
LEVEL_RULES = RuleSet()


def level_preset(level: str, dtype: Optional[torch.dtype] = None) -> str:
    """The preset to choose for `level`: precision=o2, or precision=o2_bf16 for bfloat16."""
    suffix = "_bf16" if dtype == torch.bfloat16 and level != "O0" else ""
    return f"precision={level.lower()}{suffix}"


@LEVEL_RULES
def _master_weights_without_half_model(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.master_weights and not p.casts_to_half:
        if p.opt_level == "O1" and p.cast_model_type is None:
            what = ("O1 keeps the model's weights in fp32, so they are their own masters "
                    "(Apex refused master_weights with O1)")
        else:
            what = ("the model is not cast to a 16-bit type "
                    f"(cast_model_type={dtype_name(p.cast_model_type)})")
        yield Finding("warning", "master_weights",
                      f"master_weights=True is meaningless here and ignored: {what}",
                      "leave precision.master_weights unset (null) for this level")


@LEVEL_RULES
def _o1_cast_model(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O1" and p.casts_to_half:
        yield Finding(
            "warning", "cast_model_type",
            f"O1 casts around ops (autocast) and keeps the weights fp32; cast_model_type="
            f"{dtype_name(p.cast_model_type)} makes every weight 16-bit as well, which is O2/O3 "
            "with autocast on top (Apex refused this: with O1 the weights should remain fp32)",
            f"leave precision.cast_model_type null under O1, or use "
            f"{level_preset('O2', p.cast_model_type)} for a 16-bit model")


@LEVEL_RULES
def _o1_keep_batchnorm(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O1" and p.keep_batchnorm_fp32 is not None:
        yield Finding(
            "warning", "keep_batchnorm_fp32",
            f"keep_batchnorm_fp32={p.keep_batchnorm_fp32} under O1: autocast already runs "
            "batch norm in fp32 and the model is not cast, so the setting has no effect "
            "(Apex refused it: with O1 it should be None)",
            "leave precision.keep_batchnorm_fp32 null under O1")


@LEVEL_RULES
def _patch_outside_o1(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.patch_torch_functions and p.opt_level != "O1":
        yield Finding(
            "warning", "patch_torch_functions",
            f"patch_torch_functions=True under {p.opt_level}: autocast now runs on top of the "
            "level's casts, a mix Apex refused outright (only opt_level O1 may patch functions)",
            f"set precision.patch_torch_functions=false, or use {level_preset('O1')}")


@LEVEL_RULES
def _o0_loss_scaling(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O0" and p.loss_scale != 1.0 and not p.compute_dtypes:
        what = "dynamic loss scaling" if p.dynamic_loss_scale else f"loss_scale={p.loss_scale:g}"
        yield Finding(
            "warning", "loss_scale",
            f"{what} under O0: fp32 gradients do not underflow, so scaling only adds a pass over "
            "the gradients each step (and skips steps that overflow)",
            "set precision.loss_scale=1.0 for the fp32 baseline")


# Relative size below which an update to a weight is lost to rounding (half its spacing).
_VANISHING_UPDATE = {torch.float16: "2^-11", torch.bfloat16: "2^-8"}


@LEVEL_RULES
def _o2_without_masters(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O2" and p.casts_to_half and not p.master_weights \
            and not p.stochastic_rounding:
        name = dtype_name(p.cast_model_type)
        hint = "keep precision.master_weights=true (fp32 master copies) under O2"
        if p.cast_model_type == torch.bfloat16:
            hint += (", or round the bf16 weights stochastically "
                     "(precision.stochastic_rounding=true, as precision=o3_bf16_sr does)")
        yield Finding(
            "warning", "master_weights",
            f"O2 without master weights: the optimizer updates the {name} weights directly, and "
            f"an update smaller than {_VANISHING_UPDATE[p.cast_model_type]} of a weight rounds "
            f"away in {name}, so small learning rates (and late, decayed ones) stop training",
            hint)


@LEVEL_RULES
def _stochastic_rounding(p: Properties, ctx: Context) -> Iterable[Finding]:
    """Stochastic rounding stores a bf16 model's weights at each update; it replaces fp32
    masters, so it needs a bf16 model and no masters."""
    if not p.stochastic_rounding:
        return
    if p.cast_model_type != torch.bfloat16:
        yield Finding(
            "error", "stochastic_rounding",
            "stochastic rounding stores bfloat16 weights rounded up or down at random, but this "
            f"level keeps the weights in {dtype_name(p.cast_model_type or torch.float32)}"
            + (" (O1 does not cast the model)" if p.cast_model_type is None else ""),
            "use precision=o3_bf16_sr (a bf16 model without master weights), or set "
            "precision.stochastic_rounding=false")
    elif p.uses_master_weights:
        yield Finding(
            "error", "stochastic_rounding",
            "stochastic rounding replaces fp32 master weights (the update is computed in fp32 "
            "and stored in bf16 unbiased); with master_weights=true the weights are updated "
            "in fp32 already",
            "set precision.master_weights=false (or use precision=o3_bf16_sr), or "
            "precision.stochastic_rounding=false")


@LEVEL_RULES
def _fp8_linear_level(p: Properties, ctx: Context) -> Iterable[Finding]:
    """torchao's float8 training: Linear GEMMs in fp8 (e4m3 forward, e5m2 gradients), the rest of
    the model in bf16 (autocast or a cast model) with the weights updated in high precision."""
    if p.fp8_linear is None:
        return
    if torch.float16 in p.compute_dtypes:
        yield Finding(
            "error", "fp8_linear",
            "fp8 Linear layers with float16: torchao's float8 training runs the rest of the "
            "model in bfloat16 or fp32 (its scaled fp8 GEMMs output bf16), not fp16",
            "use precision=o1_fp8 (bf16 autocast) or precision=o2_fp8 (bf16 model)")
    elif p.opt_level == "O3":
        yield Finding(
            "error", "fp8_linear",
            "fp8 Linear layers under O3: torchao's float8 training needs the weights updated in "
            "high precision (fp32 masters, or an fp32 model), and O3 keeps no masters",
            "use precision=o2_fp8 (bf16 model, fp32 master weights)")
    elif p.opt_level == "O0":
        yield Finding(
            "error", "fp8_linear",
            "fp8 Linear layers under O0: O0 is the fp32 baseline the other levels are compared "
            "with",
            "use precision=o1_fp8 or precision=o2_fp8")


@LEVEL_RULES
def _bf16_dynamic_scaling(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.dynamic_loss_scale and p.compute_dtypes == {torch.bfloat16}:
        yield Finding(
            "info", "loss_scale",
            "dynamic loss scaling is unneeded with bfloat16: it has fp32's exponent range, so "
            "gradients do not underflow; scaling only adds a pass over the gradients per step",
            "set precision.loss_scale=1.0 (the *_bf16 presets do)")


@LEVEL_RULES
def _o3_batchnorm_fp32(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O3" and p.keep_batchnorm_fp32:
        yield Finding(
            "info", "keep_batchnorm_fp32",
            "O3 with keep_batchnorm_fp32=True: everything 16-bit except BatchNorm, Apex's "
            "\"speed of light\" setting; allowed", "")


def _check_scaler_bounds(values: Mapping[str, Any]) -> None:
    low, high = values["min_loss_scale"], values["max_loss_scale"]
    if low is not None and low > high:
        raise ConfigError(_key("min_loss_scale"),
                          f"{low:g} is above max_loss_scale {high:g}",
                          "null or a number <= max_loss_scale")


def resolve_properties(opt_level: str, overrides: Mapping[str, Any] | None = None
                       ) -> tuple[Properties, bool]:
    """Level defaults, then `overrides` by key, parsed and normalised: (properties, strict).

    `overrides` may be the whole precision config (its values equal to the level's defaults are
    fine, an `opt_level` key is accepted when it names the same level, a `strict` key is read
    and returned, and `kernels` (the engine's backend choice) and `preset` (the option file's
    name) are ignored here). Invalid values raise ConfigError naming the `precision.<key>`.
    """
    level = parse_opt_level(opt_level)
    values: dict[str, Any] = dict(LEVELS[level])
    values.update(SCALER_DEFAULTS)
    strict_value: Any = False
    for key, raw in (overrides or {}).items():
        if key == "opt_level":
            if parse_opt_level(raw) != level:
                raise ConfigError(_key("opt_level"),
                                  f"override {raw!r} contradicts the level {level}", tuple(LEVELS))
            continue
        if key == "strict":
            strict_value = raw
            continue
        if key in ("kernels", "preset"):
            continue  # how the engine runs (AmpEngine(kernels=...)); the preset's file name
        if key not in _PARSERS:
            raise ConfigError(_key(str(key)), "unknown precision property",
                              (*PROPERTY_KEYS, "strict"))
        values[key] = _PARSERS[key](raw)
    strict = bool(_parse_bool("strict", strict_value, allow_none=False))
    _check_scaler_bounds(values)
    return Properties(opt_level=level, **values), strict


def strict_finding(finding: Finding) -> Finding:
    """`finding` as `precision.strict=true` sees it: a warning becomes an error."""
    if finding.level != "warning":
        return finding
    hint = finding.hint + ("; " if finding.hint else "") + "an error because precision.strict=true"
    return Finding("error", finding.property, finding.message, hint)
