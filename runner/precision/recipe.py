"""`Properties`: the resolved precision recipe the engine executes, one value per row of the
property table (`runner.config.precision.PROPERTIES`), a dtype as a torch.dtype.

The table is the only place a property is declared: `Properties` takes its fields from it, and
their types from each row's kind (`field_type`: a dtype's name becomes a torch.dtype, the
layers' mapping an ordered tuple of pairs), since the table itself may not import torch.
Resolving a level and overrides into `Properties` is `runner.precision.properties`'s job.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch

from runner.config import formats
from runner.config import precision as ptable
from runner.precision.dtypes import HALF_DTYPES, TORCH_DTYPES, dtype_name

LossScale = Union[float, Literal["dynamic"]]

# The type of a row's value in `Properties`, by the row's kind (a "number" row: int or float, as
# its `integer` says); a nullable row's is Optional.
KIND_TYPES: dict[str, Any] = {
    "dtype": torch.dtype,
    "bool": bool,
    "choice": str,
    "loss_scale": LossScale,
    "layers": tuple[tuple[str, str], ...],
    "layer_plan": str,
}


def field_type(row: ptable.Property) -> Any:
    """The type of `row`'s value in `Properties`, from its kind."""
    base = (int if row.integer else float) if row.kind == "number" else KIND_TYPES[row.kind]
    return Optional[base] if row.allow_none else base


def property_types() -> dict[str, Any]:
    """{property: its type in `Properties`}, one per row of the table, in the table's order."""
    return {row.name: field_type(row) for row in ptable.PROPERTIES}


class Properties:
    """The resolved precision recipe the engine executes: the level and one value per property
    of `runner.config.precision.PROPERTIES` (a dtype as a torch.dtype); immutable, so it can be
    logged once. Read a property as an attribute: `props.cast_model_type`. Its fields and their
    types are the table's rows (`property_types()`, set as its annotations below); the values
    live in `_values`, keyed by the table at run time."""

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
        name = formats.stepped_dtype_name(dtype_name(self.cast_model_type), self.master_weights)
        return TORCH_DTYPES[name]

    @property
    def state_format(self) -> str:
        """How the optimizer stores its state: `optimizer_state`, or (unset) the stepped
        weights' own type, as torch's optimizers keep it ("float32", "float16", ...)."""
        return self.optimizer_state or dtype_name(self.stepped_dtype)

    @property
    def low_bit_state(self) -> bool:
        """Whether the state is quantised in blocks (int8, int4, fp8: torchao's optimizers)."""
        return self.state_format in formats.LOW_BIT_STATES

    @property
    def state_dtype(self) -> Optional[torch.dtype]:
        """The float type the state is stored in; None for a low-bit format."""
        return None if self.low_bit_state else TORCH_DTYPES[self.state_format]

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


# The fields, for readers and `typing.get_type_hints`: the table's rows, not a copy of them.
Properties.__annotations__ = property_types()


def _rebuild_properties(opt_level: str, values: dict[str, Any]) -> Properties:
    return Properties(opt_level, **values)
