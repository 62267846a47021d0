"""The O1 context: Apex's "patch torch functions" is today's `torch.autocast`.

Autocast casts per op (matmul/conv in 16 bit, reductions and losses in fp32) and leaves the model's
weights in fp32, which is what Apex O1 achieved by monkey-patching torch functions.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from runner.precision.properties import Properties


def autocast_context(properties: Properties, device: torch.device | str) -> ContextManager:
    """`torch.autocast(<device type>, dtype=autocast_dtype)` under patch_torch_functions,
    else a no-op context."""
    if not properties.patch_torch_functions:
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=properties.autocast_dtype)
