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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch

from runner.config import precision as ptable
from runner.config.levels import LEVEL_VALUES
from runner.errors import ConfigError

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

# Keys an override may name: every property of the table (runner.config.precision.PROPERTIES);
# `strict` is accepted too (it changes findings, not properties).
PROPERTY_KEYS = ptable.property_names()

# torchao's float8 training recipes for Linear layers
FP8_RECIPES = ptable.FP8_RECIPES

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """`torch.float16` -> "float16"; None -> "None" (the spelling the config files use)."""
    return "None" if dtype is None else str(dtype).removeprefix("torch.")


class Properties:
    """The resolved precision recipe the engine executes: the level and one value per property
    of `runner.config.precision.PROPERTIES` (a dtype as a torch.dtype); immutable, so it can be
    logged once. Read a property as an attribute: `props.cast_model_type`."""

    # the table's properties, for readers and type checkers (the values live in `_values`)
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[bool]
    loss_scale: LossScale
    autocast_dtype: torch.dtype
    fp8_linear: Optional[str]  # torchao's float8 recipe for the Linear layers' GEMMs
    stochastic_rounding: bool  # a bf16 model's weights rounded at random at each update
    optimizer_state: Optional[str]  # the state's format (None: the stepped weights' own type)
    layers: tuple[tuple[str, str], ...]  # (module-name glob, format) per layer, in order
    layer_plan: Optional[str]  # a plan file's path, "auto", or None
    init_scale: float  # dynamic loss scaling (runner.precision.scaler.LossScaler)
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_loss_scale: Optional[float]
    max_loss_scale: float

    __slots__ = ("opt_level", "_values")

    def __init__(self, opt_level: str, **values: Any) -> None:
        names = ptable.property_names()
        unknown = sorted(set(values) - set(names))
        missing = [n for n in names if n not in values]
        if unknown or missing:
            raise TypeError(f"Properties: unknown {unknown}, missing {missing}")
        object.__setattr__(self, "opt_level", opt_level)
        object.__setattr__(self, "_values", {n: values[n] for n in names})

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"'Properties' has no property {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Properties are immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Properties) and (self.opt_level, self._values) == (
            other.opt_level,
            other._values,
        )

    def __hash__(self) -> int:
        return hash((self.opt_level, tuple(self._values.items())))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"Properties(opt_level={self.opt_level!r}, {inner})"

    def __reduce__(self):
        return (_rebuild_properties, (self.opt_level, dict(self._values)))

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
    def stepped_dtype(self) -> torch.dtype:
        """The type of the weights the optimizer steps: the model's 16-bit type without master
        weights, else fp32 (the masters, or an fp32 model)."""
        if self.casts_to_half and not self.uses_master_weights:
            return self.cast_model_type
        return torch.float32

    @property
    def state_format(self) -> str:
        """How the optimizer stores its state: `optimizer_state`, or (unset) the stepped
        weights' own type, as torch's optimizers keep it ("float32", "float16", ...)."""
        return self.optimizer_state or dtype_name(self.stepped_dtype)

    @property
    def low_bit_state(self) -> bool:
        """Whether the state is quantised in blocks (int8, int4, fp8: torchao's optimizers)."""
        return self.state_format in ptable.LOW_BIT_STATES

    @property
    def state_dtype(self) -> Optional[torch.dtype]:
        """The float type the state is stored in; None for a low-bit format."""
        return None if self.low_bit_state else _DTYPES[self.state_format]

    @property
    def state_follows_weights(self) -> bool:
        """Whether the state is kept in the stepped weights' own type (torch's layout)."""
        return self.state_format == dtype_name(self.stepped_dtype)

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        """The type the optimizer's arithmetic on its state runs in (Adam's sqrt(v) + eps): the
        stepped weights' type where the optimizer keeps its state in that type (torch's own
        step), else fp32 (every other format is loaded to fp32, updated and stored back)."""
        if self.state_follows_weights:
            return self.stepped_dtype
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
        """Flat string values for tracking (MLflow params), one per property of the table as
        its row logs it; the caller adds `precision.`."""
        return {
            "opt_level": self.opt_level,
            **{p.name: ptable.param_string(p, self._values[p.name]) for p in ptable.PROPERTIES},
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


def _rebuild_properties(opt_level: str, values: dict[str, Any]) -> Properties:
    return Properties(opt_level, **values)


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
    return _DTYPES[value] if prop.kind == "dtype" and value is not None else value


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
            what = (
                "O1 keeps the model's weights in fp32, so they are their own masters "
                "(Apex refused master_weights with O1)"
            )
        else:
            what = (
                "the model is not cast to a 16-bit type "
                f"(cast_model_type={dtype_name(p.cast_model_type)})"
            )
        yield Finding(
            "warning",
            "master_weights",
            f"master_weights=True is meaningless here and ignored: {what}",
            "leave precision.master_weights unset (null) for this level",
        )


@LEVEL_RULES
def _o1_cast_model(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O1" and p.casts_to_half:
        yield Finding(
            "warning",
            "cast_model_type",
            f"O1 casts around ops (autocast) and keeps the weights fp32; cast_model_type="
            f"{dtype_name(p.cast_model_type)} makes every weight 16-bit as well, which is O2/O3 "
            "with autocast on top (Apex refused this: with O1 the weights should remain fp32)",
            f"leave precision.cast_model_type null under O1, or use "
            f"{level_preset('O2', p.cast_model_type)} for a 16-bit model",
        )


@LEVEL_RULES
def _o1_keep_batchnorm(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O1" and p.keep_batchnorm_fp32 is not None:
        yield Finding(
            "warning",
            "keep_batchnorm_fp32",
            f"keep_batchnorm_fp32={p.keep_batchnorm_fp32} under O1: autocast already runs "
            "batch norm in fp32 and the model is not cast, so the setting has no effect "
            "(Apex refused it: with O1 it should be None)",
            "leave precision.keep_batchnorm_fp32 null under O1",
        )


@LEVEL_RULES
def _patch_outside_o1(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.patch_torch_functions and p.opt_level != "O1":
        yield Finding(
            "warning",
            "patch_torch_functions",
            f"patch_torch_functions=True under {p.opt_level}: autocast now runs on top of the "
            "level's casts, a mix Apex refused outright (only opt_level O1 may patch functions)",
            f"set precision.patch_torch_functions=false, or use {level_preset('O1')}",
        )


@LEVEL_RULES
def _o0_loss_scaling(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O0" and p.loss_scale != 1.0 and not p.compute_dtypes:
        what = "dynamic loss scaling" if p.dynamic_loss_scale else f"loss_scale={p.loss_scale:g}"
        yield Finding(
            "warning",
            "loss_scale",
            f"{what} under O0: fp32 gradients do not underflow, so scaling only adds a pass over "
            "the gradients each step (and skips steps that overflow)",
            "set precision.loss_scale=1.0 for the fp32 baseline",
        )


# Relative size below which an update to a weight is lost to rounding (half its spacing).
_VANISHING_UPDATE = {torch.float16: "2^-11", torch.bfloat16: "2^-8"}


@LEVEL_RULES
def _o2_without_masters(p: Properties, ctx: Context) -> Iterable[Finding]:
    if (
        p.opt_level == "O2"
        and p.casts_to_half
        and not p.master_weights
        and not p.stochastic_rounding
    ):
        name = dtype_name(p.cast_model_type)
        hint = "keep precision.master_weights=true (fp32 master copies) under O2"
        if p.cast_model_type == torch.bfloat16:
            hint += (
                ", or round the bf16 weights stochastically "
                "(precision.stochastic_rounding=true, as precision=o3_bf16_sr does)"
            )
        yield Finding(
            "warning",
            "master_weights",
            f"O2 without master weights: the optimizer updates the {name} weights directly, and "
            f"an update smaller than {_VANISHING_UPDATE[p.cast_model_type]} of a weight rounds "
            f"away in {name}, so small learning rates (and late, decayed ones) stop training",
            hint,
        )


@LEVEL_RULES
def _stochastic_rounding(p: Properties, ctx: Context) -> Iterable[Finding]:
    """Stochastic rounding stores a bf16 model's weights at each update; it replaces fp32
    masters, so it needs a bf16 model and no masters."""
    if not p.stochastic_rounding:
        return
    if p.cast_model_type != torch.bfloat16:
        yield Finding(
            "error",
            "stochastic_rounding",
            "stochastic rounding stores bfloat16 weights rounded up or down at random, but this "
            f"level keeps the weights in {dtype_name(p.cast_model_type or torch.float32)}"
            + (" (O1 does not cast the model)" if p.cast_model_type is None else ""),
            "use precision=o3_bf16_sr (a bf16 model without master weights), or set "
            "precision.stochastic_rounding=false",
        )
    elif p.uses_master_weights:
        yield Finding(
            "error",
            "stochastic_rounding",
            "stochastic rounding replaces fp32 master weights (the update is computed in fp32 "
            "and stored in bf16 unbiased); with master_weights=true the weights are updated "
            "in fp32 already",
            "set precision.master_weights=false (or use precision=o3_bf16_sr), or "
            "precision.stochastic_rounding=false",
        )


@LEVEL_RULES
def _fp8_linear_level(p: Properties, ctx: Context) -> Iterable[Finding]:
    """torchao's float8 training: Linear GEMMs in fp8 (e4m3 forward, e5m2 gradients), the rest of
    the model in bf16 (autocast or a cast model) with the weights updated in high precision."""
    if p.fp8_linear is None:
        return
    if torch.float16 in p.compute_dtypes:
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers with float16: torchao's float8 training runs the rest of the "
            "model in bfloat16 or fp32 (its scaled fp8 GEMMs output bf16), not fp16",
            "use precision=o1_fp8 (bf16 autocast) or precision=o2_fp8 (bf16 model)",
        )
    elif p.opt_level == "O3":
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers under O3: torchao's float8 training needs the weights updated in "
            "high precision (fp32 masters, or an fp32 model), and O3 keeps no masters",
            "use precision=o2_fp8 (bf16 model, fp32 master weights)",
        )
    elif p.opt_level == "O0":
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers under O0: O0 is the fp32 baseline the other levels are compared "
            "with",
            "use precision=o1_fp8 or precision=o2_fp8",
        )


@LEVEL_RULES
def _bf16_dynamic_scaling(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.dynamic_loss_scale and p.compute_dtypes == {torch.bfloat16}:
        yield Finding(
            "info",
            "loss_scale",
            "dynamic loss scaling is unneeded with bfloat16: it has fp32's exponent range, so "
            "gradients do not underflow; scaling only adds a pass over the gradients per step",
            "set precision.loss_scale=1.0 (the *_bf16 presets do)",
        )


@LEVEL_RULES
def _o3_batchnorm_fp32(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O3" and p.keep_batchnorm_fp32:
        yield Finding(
            "info",
            "keep_batchnorm_fp32",
            "O3 with keep_batchnorm_fp32=True: everything 16-bit except BatchNorm, Apex's "
            '"speed of light" setting; allowed',
            "",
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
    properties = Properties(level, **values)
    if values["optimizer_state"] is None:  # named, so that the params say the state's format
        values["optimizer_state"] = properties.state_format
        properties = Properties(level, **values)
    return properties, strict


def strict_finding(finding: Finding) -> Finding:
    """`finding` as `precision.strict=true` sees it: a warning becomes an error."""
    if finding.level != "warning":
        return finding
    hint = finding.hint + ("; " if finding.hint else "") + "an error because precision.strict=true"
    return Finding("error", finding.property, finding.message, hint)
