"""A layer plan enforced on a built model (`enforce`, by the engine once the model is cast):
input casts at the layers' boundaries on a cast level, local autocasts under O1; `Enforcement`
takes them off again. See README.md beside this file."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.precision.casting import cast_tensor, map_tensors
from runner.precision.layers.assignment import LayerPlan
from runner.precision.layers.findings import level_half
from runner.precision.layers.rules import DTYPES, FP8
from runner.precision.properties import Properties


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook (with kwargs) body: floating inputs to `dtype`."""
    cast = functools.partial(cast_tensor, dtype=dtype)
    return map_tensors(args, cast), map_tensors(kwargs, cast)


def _autocast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's forward inside a local autocast of its planned format (O1): `enabled=False`
    with the floating inputs cast to fp32 for float32, else autocast in that type. Bound to the
    module as its `forward` (a deep copy rebinds it to the copy)."""
    device_type, dtype, forward = self._amp_runner_layer
    if dtype is None:
        args, kwargs = _cast_inputs(torch.float32, self, args, kwargs)
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)
    with torch.autocast(device_type, dtype=dtype):
        return forward(*args, **kwargs)


@dataclass
class Enforcement:
    """What `enforce` installed: the input-cast hooks and the wrapped forwards; `remove()` takes
    them off again."""

    handles: list[RemovableHandle] = field(default_factory=list)
    wrapped: list[nn.Module] = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for module in self.wrapped:
            if "forward" in module.__dict__:
                del module.forward
            if "_amp_runner_layer" in module.__dict__:
                del module._amp_runner_layer
        self.wrapped = []


def enforce(model: nn.Module, plan: LayerPlan, p: Properties, device_type: str) -> Enforcement:
    """Make `model` (converted to fp8 and cast already) compute as `plan` says: on a cast level,
    where the plan deviates from the level, every layer and every module an entry names casts its
    inputs to its compute type; under autocast, every module an entry names runs its forward in
    a local autocast of its format. See the module docstring."""
    out = Enforcement()
    if p.casts_to_half:
        if not plan.deviates:
            return out
        # (the model itself casts its inputs only where an entry names it: its layers cast
        # their own, so an fp32 first layer sees the inputs unrounded)
        targets: dict[str, torch.dtype] = {
            layer.name: layer.expect.input_dtype for layer in plan.layers if layer.name
        }
        for name, fmt in plan.regions.items():
            targets.setdefault(name, DTYPES[fmt] if fmt != FP8 else p.cast_model_type)
        for name, dtype in targets.items():
            module = model.get_submodule(name)
            out.handles.append(
                module.register_forward_pre_hook(
                    functools.partial(_cast_inputs, dtype), with_kwargs=True
                )
            )
        return out
    if p.autocasts:
        half = level_half(p)
        for name, fmt in plan.regions.items():
            module = model.get_submodule(name)
            if module is model and fmt != "float32":
                continue  # the whole model in the level's autocast: nothing to change
            dtype = None if fmt == "float32" else (half if fmt == FP8 else DTYPES[fmt])
            module._amp_runner_layer = (device_type, dtype, module.forward)
            module.forward = _autocast_forward.__get__(module, type(module))
            out.wrapped.append(module)
    return out
