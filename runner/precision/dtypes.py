"""The torch dtype of each float format: the one map from the names of `runner.config.formats`
(torch-free, what a config says) to torch's types (what the engine casts to), and back."""

from __future__ import annotations

from typing import Optional

import torch

from runner.config import formats

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in formats.FLOAT_TYPES}
HALF_DTYPES = tuple(TORCH_DTYPES[name] for name in formats.HALF_TYPES)  # float16, bfloat16


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """`torch.float16` -> "float16"; None -> "None" (the spelling the config files use)."""
    return "None" if dtype is None else str(dtype).removeprefix("torch.")
