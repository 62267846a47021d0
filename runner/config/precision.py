"""The precision properties, each declared once: the table the rest derives from.

One `Property` row says everything about a property: its name, how a value is parsed (its kind
and the values allowed), its default, how it is logged (the MLflow param `precision.<name>`) and
how it shows in a run's name. From `PROPERTIES` derive:
- the schema's precision node (`precision_schema()`, registered in Hydra's ConfigStore),
- the parsers (`parse(name, value)`, which raise `ConfigError` naming `precision.<name>`),
- the resolved `runner.precision.properties.Properties`: its fields and their types
  (`runner.precision.recipe.property_types`, by each row's kind) and its params (`as_params`),
- the run name's suffixes (`run_name_suffixes`).
Adding a property = one row here + its rule(s) in `runner.precision`.

Torch-free on purpose (Hydra composes and checks without torch): a dtype is parsed to its name
("bfloat16", the words of `runner.config.formats`); `runner.precision.dtypes` turns names into
torch dtypes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

from omegaconf import MISSING

from runner.config.formats import (
    HALF_TYPES,
    LAYER_FORMATS,
    STATE_FORMATS,
    dtype_name_of,
    short_name,
    spelling,
    stepped_dtype_name,
)
from runner.config.levels import SCALER_DEFAULTS
from runner.config.values import is_none, parse_bool, to_number
from runner.errors import ConfigError

Kind = Literal["dtype", "bool", "choice", "loss_scale", "number", "layers", "layer_plan"]

# torchao's float8 training recipes for Linear layers (e4m3 forward, e5m2 gradients, dynamic
# scaling): one scale per tensor, or per row (more accurate, slower).
FP8_RECIPES = ("tensorwise", "rowwise")

# `precision.layer_plan`: a plan measured before training (runner.run.autoplan)
AUTO_PLAN = "auto"


@dataclass(frozen=True)
class Property:
    """One precision property: how it is parsed, its default, how it is logged and named."""

    name: str
    kind: Kind
    default: Any  # the schema's default (a level's own values take precedence: levels.py)
    schema_type: Any  # the type of its key in the schema's precision node
    doc: str = ""
    allow_none: bool = False
    choices: tuple[str, ...] = ()  # kind "dtype": dtype names; kind "choice": the choices
    check: Optional[Callable[[float], bool]] = None  # kind "number": what is allowed ...
    allowed: str = ""  # ... said in words
    integer: bool = False  # kind "number": an integer
    # kind "choice": the choices are number formats, read by any spelling (runner.config.formats)
    formats: bool = False
    # how it is logged: the param's string from the parsed value (None: the default format)
    param: Optional[Callable[[Any], str]] = None
    # its run-name suffix ("bf16", "sr", ...) from the run's params (every property's string), or
    # None: the run name does not show it
    suffix: Optional[Callable[[Mapping[str, str]], Optional[str]]] = None

    @property
    def key(self) -> str:
        return f"precision.{self.name}"


def _number(
    name: str,
    check: Callable[[float], bool],
    allowed: str,
    *,
    integer: bool = False,
    allow_none: bool = False,
    doc: str = "",
) -> Property:
    """A dynamic-loss-scaling knob: a number, default from `levels.SCALER_DEFAULTS`."""
    default = SCALER_DEFAULTS[name]
    kind_type = int if integer else float
    return Property(
        name,
        "number",
        default,
        Optional[kind_type] if allow_none else kind_type,
        doc,
        allow_none=allow_none,
        check=check,
        allowed=allowed,
        integer=integer,
    )


def _state_suffix(params: Mapping[str, str]) -> Optional[str]:
    """ "int8state", "bf16state", ...: where the state is not kept in the stepped weights' type."""
    fmt = params.get("optimizer_state", "None")
    stepped = stepped_dtype_name(params.get("cast_model_type"), params.get("master_weights"))
    if fmt in ("None", stepped):
        return None
    return f"{short_name(fmt)}state"


def _plan_suffix(params: Mapping[str, str]) -> Optional[str]:
    """ "autoplan" where a pre-flight plans the layers' formats, "plan" where a plan file or
    `precision.layers` does."""
    plan = params.get("layer_plan", "None")
    if plan == AUTO_PLAN:
        return "autoplan"
    if plan != "None" or params.get("layers", "{}") != "{}":
        return "plan"
    return None


def _computes_in_bf16(params: Mapping[str, str]) -> Optional[str]:
    """ "bf16" where the model computes in bfloat16 (a bf16 model, or O1's bf16 autocast), unless
    its Linear layers run in fp8 (then "fp8" says more)."""
    if params.get("fp8_linear", "None") != "None":
        return None
    cast = params.get("cast_model_type") == "bfloat16"
    autocast = (
        params.get("patch_torch_functions") == "True" and params.get("autocast_dtype") == "bfloat16"
    )
    return "bf16" if cast or autocast else None


# The order is the order of the params, of the property table printed at the start of a run and
# of the run name's suffixes.
PROPERTIES: list[Property] = [
    # Apex's five (each level sets them: runner.config.levels.LEVEL_VALUES)
    Property(
        "cast_model_type",
        "dtype",
        None,
        Optional[str],
        "float32 | float16 | bfloat16 | null: the model's own type",
        allow_none=True,
        choices=(*HALF_TYPES, "float32"),
        suffix=_computes_in_bf16,
    ),
    Property("patch_torch_functions", "bool", False, bool, "autocast around ops (O1)"),
    Property("keep_batchnorm_fp32", "bool", None, Any, "true | false | null", allow_none=True),
    Property(
        "master_weights",
        "bool",
        None,
        Optional[bool],
        "fp32 master copies of the weights",
        allow_none=True,
    ),
    Property("loss_scale", "loss_scale", 1.0, Any, '"dynamic" or a positive number'),
    # beyond Apex
    Property(
        "autocast_dtype",
        "dtype",
        "float16",
        str,
        "O1's autocast type: float16 | bfloat16 (bf16 on CPU)",
        choices=HALF_TYPES,
    ),
    Property(
        "fp8_linear",
        "choice",
        None,
        Optional[str],
        "torchao float8 Linear layers: null | tensorwise | rowwise",
        allow_none=True,
        choices=FP8_RECIPES,
        suffix=lambda p: "fp8" if p.get("fp8_linear", "None") != "None" else None,
    ),
    Property(
        "stochastic_rounding",
        "bool",
        False,
        bool,
        "a bf16 model without masters, its updates rounded at random",
        suffix=lambda p: "sr" if p.get("stochastic_rounding") == "True" else None,
    ),
    Property(
        "optimizer_state",
        "choice",
        None,
        Optional[str],
        "null (the stepped weights' own type) | float32 | bfloat16 | float16 | int8 | int4 "
        "| fp8: how the optimizer stores momentum and Adam's moments",
        allow_none=True,
        choices=STATE_FORMATS,
        formats=True,
        suffix=_state_suffix,
    ),
    # per layer, on top of the level (runner.precision.layers): glob -> format, and a plan file
    Property(
        "layers",
        "layers",
        {},
        dict[Any, str],  # (Any: a name Hydra reads as a number, 5, is a key too)
        "module-name glob -> float32 | bfloat16 | float16 | fp8, in order (a later entry "
        "wins); e.g. +precision.layers.head=float32",
        param=lambda v: layers_string(v),
    ),
    Property(
        "layer_plan",
        "layer_plan",
        None,
        Optional[str],
        "null | a YAML file of the same mapping | auto (a pre-flight plans each layer)",
        allow_none=True,
        suffix=_plan_suffix,
    ),
    # dynamic loss scaling (used when loss_scale is "dynamic")
    _number("init_scale", lambda x: x > 0, "a finite number > 0, e.g. 65536", doc="2^16"),
    _number("growth_factor", lambda x: x > 1, "a finite number > 1, e.g. 2"),
    _number("backoff_factor", lambda x: 0 < x < 1, "a number in (0, 1), e.g. 0.5"),
    _number(
        "growth_interval",
        lambda x: x >= 1,
        "an integer >= 1, e.g. 2000",
        integer=True,
        doc="clean steps before it grows",
    ),
    _number(
        "hysteresis",
        lambda x: x >= 1,
        "an integer >= 1 (1 = Apex, 2 = DeepSpeed)",
        integer=True,
        doc="overflows tolerated before a back-off (1 = Apex, 2 = DeepSpeed)",
    ),
    _number("min_loss_scale", lambda x: x > 0, "null or a finite number > 0", allow_none=True),
    _number(
        "max_loss_scale", lambda x: x > 0, "a finite number > 0, e.g. 16777216 (2^24)", doc="2^24"
    ),
]


def property_names() -> tuple[str, ...]:
    return tuple(p.name for p in PROPERTIES)


def property_for(name: str) -> Optional[Property]:
    return next((p for p in PROPERTIES if p.name == name), None)


# ---- the schema's precision node -------------------------------------------------------------
# Keys of the node that are not properties: the preset's file name and level, the findings'
# strictness and the kernels' choice (how the engine runs, not what it computes).
_OTHER_KEYS: list[tuple[str, Any, Any]] = [
    ("preset", str, MISSING),  # the option file it came from (o2, o2_bf16, ...): see opt_level
    ("opt_level", str, MISSING),
]
_TRAILING_KEYS: list[tuple[str, Any, Any]] = [
    ("strict", bool, False),  # every precision warning becomes an error
    # fused C++/CUDA kernels (runner.csrc): auto (build on first use; torch's ops if that
    # fails, with a warning), fused (the kernels or an error), torch (never build)
    ("kernels", str, "auto"),
    # precision.layer_plan=auto: the fp32 steps its pre-flight measures, and the shares of a
    # layer's non-zero values that may underflow / overflow a format the plan gives it
    ("layer_plan_steps", int, 3),
    ("layer_plan_max_underflow", float, 0.01),
    ("layer_plan_max_overflow", float, 0.0),
]
# the keys of the precision node that are not properties, nor the level: read elsewhere
NON_PROPERTY_KEYS = ("preset", "strict", *(name for name, _, _ in _TRAILING_KEYS))


def _field(default: Any) -> Any:
    """A dataclass field with `default` (a mutable one, the layers' mapping, by a factory)."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default))
    return dataclasses.field(default=default)


def precision_schema() -> type:
    """The typed schema of the precision group (`PrecisionConfig`), from `PROPERTIES`."""
    fields = [(name, typ, dataclasses.field(default=default)) for name, typ, default in _OTHER_KEYS]
    fields += [(p.name, p.schema_type, _field(p.default)) for p in PROPERTIES]
    fields += [
        (name, typ, dataclasses.field(default=default)) for name, typ, default in _TRAILING_KEYS
    ]
    return dataclasses.make_dataclass(
        "PrecisionConfig",
        fields,
        namespace={
            "__doc__": "Apex amp's five properties and ours (runner.config.precision); "
            "resolved by runner.precision."
        },
    )


# ---- parsing ----------------------------------------------------------------------------------
def parse(name: str, value: Any) -> Any:
    """`value` of the property `name`, parsed and normalised (a dtype by its name, "bfloat16");
    a bad value raises ConfigError naming `precision.<name>` and what is allowed."""
    prop = property_for(name)
    if prop is None:
        raise ConfigError(
            f"precision.{name}", "unknown precision property", (*property_names(), "strict")
        )
    return _PARSERS[prop.kind](prop, value)


def _parse_dtype(prop: Property, value: Any) -> Optional[str]:
    names = list(prop.choices) + (["None"] if prop.allow_none else [])
    if prop.allow_none and is_none(value):
        return None
    if value is None:
        raise ConfigError(prop.key, "must not be None", names)
    name = dtype_name_of(value)
    if name is None or name not in prop.choices:
        raise ConfigError(prop.key, f"unsupported dtype {value!r}", names)
    return name


def _parse_choice(prop: Property, value: Any) -> Optional[str]:
    """One of the choices (case-insensitive; a format by any of its spellings), or None (null,
    "none")."""
    if is_none(value):
        return None
    if prop.formats:
        text = spelling(value)
    else:
        text = value.strip().lower() if isinstance(value, str) else None
    if text in prop.choices:
        return text
    raise ConfigError(prop.key, f"got {value!r}", ["null", *prop.choices])


def _parse_loss_scale(prop: Property, value: Any) -> Any:
    allowed = '"dynamic" or a positive finite number'
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    number = to_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ConfigError(prop.key, f"invalid loss scale {value!r}", allowed)
    return number


def _parse_number(prop: Property, value: Any) -> Any:
    if is_none(value):
        if prop.allow_none:
            return None
        raise ConfigError(prop.key, "must not be None", prop.allowed)
    number = to_number(value)
    if number is None or not math.isfinite(number) or not prop.check(number):
        raise ConfigError(prop.key, f"got {value!r}", prop.allowed)
    if prop.integer:
        if number != int(number):
            raise ConfigError(prop.key, f"got {value!r}", prop.allowed)
        return int(number)
    return number


def parse_layer_format(key: str, value: Any) -> str:
    """A layer's format by any of its spellings ("bf16", "torch.float32", "e4m3") -> its name;
    else ConfigError(key)."""
    name = spelling(value)
    if name in LAYER_FORMATS:
        return name
    raise ConfigError(key, f"unknown layer format {value!r}", LAYER_FORMATS)


_NUMBER_NAME = (
    "the module name {0!r} arrived as a number: Hydra reads a name such as 0.1 as one and drops "
    "its zeros (1.10 becomes 1.1, another module); give it as text in a plan file, "
    'precision.layer_plan=FILE with the name quoted (layers: {{"1.10": float32}}), or as a glob '
    "Hydra reads as text ('+precision.layers={{1.10*: float32}}')"
)


def parse_layers(value: Any, key: str = "precision.layers") -> tuple[tuple[str, str], ...]:
    """An ordered mapping of module-name globs to formats (a dict, or (glob, format) pairs) ->
    a tuple of (glob, format name) pairs, in order; ConfigError naming `<key>.<glob>`."""
    if is_none(value):
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
        isinstance(i, (list, tuple)) and len(i) == 2 for i in value
    ):
        items = [tuple(i) for i in value]
    else:
        raise ConfigError(
            key,
            f"expected a mapping of module-name globs to formats, got {value!r}",
            ["{head: float32}", "+precision.layers.head=float32"],
        )
    out = []
    for pattern, fmt in items:
        name = layer_glob(pattern, key)
        out.append((name, parse_layer_format(f"{key}.{name}", fmt)))
    return tuple(out)


def layer_glob(pattern: Any, key: str, where: str = "") -> str:
    """A module-name glob as a layer plan's key gives it: an int is the name it reads as (`{5:
    float32}`: Hydra and YAML read the name 5 as a number); a float has lost its text and is
    refused, as is anything but a non-empty string (`where`: the file it came from)."""
    if type(pattern) is int:
        return str(pattern)
    if type(pattern) is float:
        raise ConfigError(key, where + _NUMBER_NAME.format(pattern))
    if not isinstance(pattern, str) or not pattern.strip():
        raise ConfigError(
            key,
            f"{where}a module-name glob must be a non-empty string, got {pattern!r}",
            ["head", "blocks.*.attn.*", "*norm*"],
        )
    return pattern.strip()


def layers_string(layers: tuple[tuple[str, str], ...], limit: int = 400) -> str:
    """How `precision.layers` is logged: "{}" or "{head: float32, *norm*: float32}", cut at
    `limit` characters with the count of entries (MLflow params are short)."""
    text = "{" + ", ".join(f"{p}: {f}" for p, f in layers) + "}"
    if len(text) > limit:
        text = text[: limit - 40].rsplit(", ", 1)[0] + f", ... ({len(layers)} entries)}}"
    return text


def _parse_layer_plan(prop: Property, value: Any) -> Optional[str]:
    """null, "auto", or the path of a plan file (read when the run is planned)."""
    if is_none(value):
        return None
    if not isinstance(value, str):
        raise ConfigError(
            prop.key,
            f"expected a path or auto, got {value!r}",
            ["null", AUTO_PLAN, "path/to/plan.yaml"],
        )
    text = value.strip()
    return AUTO_PLAN if text.lower() == AUTO_PLAN else text


_PARSERS: dict[str, Callable[[Property, Any], Any]] = {
    "layers": lambda prop, value: parse_layers(value, prop.key),
    "layer_plan": _parse_layer_plan,
    "dtype": _parse_dtype,
    "bool": lambda prop, value: parse_bool(prop.key, value, prop.allow_none),
    "choice": _parse_choice,
    "loss_scale": _parse_loss_scale,
    "number": _parse_number,
}


# ---- params and the run name --------------------------------------------------------------------
def param_string(prop: Property, value: Any) -> str:
    """How a parsed value is logged: the row's own format, else None -> "None", a dtype by its
    name ("float16"), anything else as str()."""
    if prop.param is not None:
        return prop.param(value)
    if value is None:
        return "None"
    name = dtype_name_of(value) if prop.kind == "dtype" else None
    return name if name is not None else str(value)


def run_name_suffixes(params: Mapping[str, str]) -> list[str]:
    """The suffixes the properties add to a run's name, in table order (["bf16", "sr"])."""
    return [s for p in PROPERTIES if p.suffix is not None for s in [p.suffix(params)] if s]


def check_scaler_bounds(values: Mapping[str, Any]) -> None:
    low, high = values["min_loss_scale"], values["max_loss_scale"]
    if low is not None and low > high:
        raise ConfigError(
            "precision.min_loss_scale",
            f"{low:g} is above max_loss_scale {high:g}",
            "null or a number <= max_loss_scale",
        )


def level_values(level_table: Mapping[str, Any]) -> dict[str, Any]:
    """Every property's default (the table's), with a level's own values (`level_table`, from
    `levels.LEVEL_VALUES`) on top, all parsed."""
    values = {p.name: parse(p.name, p.default) for p in PROPERTIES}
    values.update({k: parse(k, v) for k, v in level_table.items()})
    return values
