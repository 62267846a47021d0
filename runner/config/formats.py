"""The words for number formats, each declared once: the float types by name, their other
spellings and short names, the optimizer-state and per-layer formats, and which type the optimizer
steps.

Torch-free (Hydra composes and checks without torch): a format is its name ("bfloat16"). The one
map from these names to torch dtypes is `runner.precision.dtypes`, built from `FLOAT_TYPES`.
"""

from __future__ import annotations

from typing import Any, Optional

FLOAT_TYPES = ("float32", "bfloat16", "float16")  # torch's float types the runner computes in
HALF_TYPES = ("float16", "bfloat16")  # the 16-bit ones
FP8 = "fp8"  # torchao's float8 (e4m3 forward, e5m2 gradients, dynamic scaling)

# Other spellings of a format (lower case, without "torch.") -> its name.
ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "e4m3": FP8,
    "float8": FP8,
    "float8_e4m3fn": FP8,
}
# How a format shows in run names, the layer audit's counts and the report's columns.
SHORT_NAMES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", FP8: "fp8"}

# How the optimizer stores its state (momentum, Adam's moments): a float type (the engine's own
# steps, arithmetic in fp32), or blockwise-quantised codes and scales (torchao's low-bit Adam).
FLOAT_STATES = FLOAT_TYPES
LOW_BIT_STATES = ("int8", "int4", FP8)
STATE_FORMATS = FLOAT_STATES + LOW_BIT_STATES

# The formats a layer may compute in (precision.layers, precision.layer_plan): a float type, or
# fp8 (torchao's float8 Linear).
LAYER_FORMATS = (*FLOAT_TYPES, FP8)


def spelling(value: Any) -> Optional[str]:
    """A format's name from any of its spellings: a string ("BF16", "torch.half", "e4m3") or a
    torch.dtype (read by its name: this module imports no torch), the alias resolved; None for
    anything else. The name may be one no format has (the caller judges it)."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        value = str(value)
    if not isinstance(value, str):
        return None
    text = value.strip().lower().removeprefix("torch.")
    return ALIASES.get(text, text)


def dtype_name_of(value: Any) -> Optional[str]:
    """The name of a float type given by any spelling ("bf16", "torch.half", torch.float32);
    None when it names none."""
    name = spelling(value)
    return name if name in FLOAT_TYPES else None


def short_name(fmt: str) -> str:
    """ "bf16" for "bfloat16"; a format without a short name ("int8") as it is."""
    return SHORT_NAMES.get(fmt, fmt)


def stepped_dtype_name(cast_model_type: Optional[str], master_weights: Any) -> str:
    """The type of the weights the optimizer steps: the model's 16-bit type without master
    weights, else float32 (masters, or an fp32 model). `cast_model_type` is a type's name (or
    None, "None"); `master_weights` is True or its param's string "True" where there are masters."""
    if cast_model_type in HALF_TYPES and master_weights not in (True, "True"):
        return cast_model_type
    return "float32"
