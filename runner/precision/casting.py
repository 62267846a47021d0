"""Cast a model to a 16-bit type for O2/O3, the way Apex did, without patching `forward`.

Parameters are cast in place (`param.data`), so an optimizer built before the cast still holds
the same Parameter objects. With `keep_batchnorm_fp32`, BatchNorm layers keep fp32 weights and
running statistics: PyTorch's batch_norm (CPU and CUDA) takes half/bf16 activations with fp32
weights natively and returns the activation dtype, so no casts are needed around them.
Model inputs are cast to the model dtype and floating outputs come back as fp32 through hooks
on the top module (removable), so the loss is computed in fp32 as in Apex. The hooks are
module-level functions bound with `functools.partial`, not closures: a cast model can be
deep-copied (the copy casts too) and pickled whole (`torch.save(model)`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from runner.precision.properties import HALF_DTYPES


def cast_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def cast_module_(
    model: nn.Module,
    dtype: torch.dtype,
    keep_batchnorm_fp32: Optional[bool],
    layer_dtypes: Optional[Mapping[int, torch.dtype]] = None,
) -> nn.Module:
    """Cast floating parameters (and their grads) and buffers to `dtype`, in place.

    With `keep_batchnorm_fp32`, every `_BatchNorm` (SyncBatchNorm included) is set to fp32 instead.
    `layer_dtypes` ({id(module): dtype}, a layer plan's) sets a module's own type, before either.
    Integer buffers (`num_batches_tracked`) are left alone.
    """
    layer_dtypes = layer_dtypes or {}
    for module in model.modules():
        target = layer_dtypes.get(id(module))
        if target is None:
            target = (
                torch.float32 if keep_batchnorm_fp32 and isinstance(module, _BatchNorm) else dtype
            )
        for param in module._parameters.values():
            if param is None or not param.is_floating_point() or param.dtype == target:
                continue
            with torch.no_grad():
                param.data = param.data.to(target)
                if param.grad is not None:
                    param.grad = param.grad.to(target)
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != target:
                module._buffers[name] = buf.to(target)
    return model


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor nested in tuples (named ones too), lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        out = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(out)
        except TypeError:
            return out
    return obj


class IOCastHooks:
    """Handles of the input/output cast hooks on one module; `remove()` restores plain forward."""

    def __init__(self, handles: list[RemovableHandle]):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _cast_inputs_hook(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook (with kwargs) body: floating inputs to `dtype`."""
    cast = functools.partial(cast_tensor, dtype=dtype)
    return map_tensors(args, cast), map_tensors(kwargs, cast)


def _cast_outputs_hook(dtype: torch.dtype, module: nn.Module, args: tuple, output: Any):
    """Forward hook body: floating outputs to `dtype`."""
    return map_tensors(output, functools.partial(cast_tensor, dtype=dtype))


def install_output_cast(model: nn.Module, output_dtype: torch.dtype) -> IOCastHooks:
    """Cast floating outputs to `output_dtype` (Apex's `cast_model_outputs` without a model
    cast)."""
    return IOCastHooks(
        [
            model.register_forward_hook(functools.partial(_cast_outputs_hook, output_dtype)),
        ]
    )


def install_io_casts(
    model: nn.Module, dtype: torch.dtype, output_dtype: torch.dtype = torch.float32
) -> IOCastHooks:
    """Cast floating inputs (args and kwargs) to `dtype` and floating outputs to `output_dtype`."""
    return IOCastHooks(
        [
            model.register_forward_pre_hook(
                functools.partial(_cast_inputs_hook, dtype), with_kwargs=True
            ),
            *install_output_cast(model, output_dtype).handles,
        ]
    )


def cast_model(
    model: nn.Module,
    dtype: torch.dtype,
    keep_batchnorm_fp32: Optional[bool],
    output_dtype: Optional[torch.dtype] = None,
    layer_dtypes: Optional[Mapping[int, torch.dtype]] = None,
    cast_inputs: bool = True,
) -> Optional[IOCastHooks]:
    """Apex-style model cast: weights to `dtype` (fp32 BatchNorm if asked; `layer_dtypes` per
    module, a layer plan's); for a 16-bit `dtype` also install the input/output casts (outputs to
    `output_dtype`, fp32 when None; inputs unless `cast_inputs` is False: a layer plan's layers
    then cast their own). Returns the hooks (None when `dtype` is fp32 and no output cast is asked
    for)."""
    cast_module_(model, dtype, keep_batchnorm_fp32, layer_dtypes)
    if dtype in HALF_DTYPES and not cast_inputs:
        return install_output_cast(model, output_dtype or torch.float32)
    if dtype in HALF_DTYPES:
        return install_io_casts(model, dtype, output_dtype or torch.float32)
    if output_dtype is not None:
        return install_output_cast(model, output_dtype)
    return None
