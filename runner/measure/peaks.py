"""The dense peak of each GPU the runner knows, per compute format: what `mfu` divides by.

One table, matched on the name torch reports (`torch.cuda.get_device_name`); the figures are
the vendors' datasheet peaks for dense matrix math (not the 2:4 sparse ones, half of which they
are), in TFLOP/s. A GPU outside the table gets `tflops` and no `mfu`; a CPU has no peak here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Peak:
    """One GPU: its name, the pattern its torch name matches, its dense TFLOP/s per format."""

    gpu: str
    pattern: str  # a regular expression searched in torch's name (case-insensitive)
    tflops: Mapping[str, float]

    def matches(self, device_name: str) -> bool:
        return re.search(self.pattern, device_name, re.IGNORECASE) is not None


def _peak(gpu: str, pattern: str, fp32, tf32, bf16, fp16, fp8=None) -> Peak:
    values = dict(zip(FORMATS, (fp32, tf32, bf16, fp16, fp8)))
    return Peak(gpu, pattern, {k: v for k, v in values.items() if v is not None})


# The more specific names first: an H100 NVL is no H100 SXM. NVIDIA's datasheets; the RTX 4090's
# 16-bit and fp8 figures are Ada's with fp32 accumulation (what torch's GEMMs use), half the
# fp16-accumulation figures its whitepaper also lists; the A100 has no fp8.
PEAKS: tuple[Peak, ...] = (
    _peak("H100 NVL", r"H100.*NVL", 60.0, 417.5, 835.5, 835.5, 1670.5),
    _peak("H100 PCIe", r"H100.*PCIe", 51.2, 378.0, 756.0, 756.0, 1513.0),
    _peak("H100 SXM", r"H100", 66.9, 494.7, 989.4, 989.4, 1978.9),
    _peak("H200 NVL", r"H200.*NVL", 60.0, 417.5, 835.5, 835.5, 1670.5),
    _peak("H200", r"H200", 66.9, 494.7, 989.4, 989.4, 1978.9),
    _peak("A100", r"A100", 19.5, 156.0, 312.0, 312.0),
    _peak("L40S", r"L40S", 91.6, 183.0, 362.05, 362.05, 733.0),
    _peak("L4", r"\bL4\b", 30.3, 60.0, 121.0, 121.0, 242.5),
    _peak("RTX 4090", r"RTX 4090(?!\s*D\b)", 82.6, 82.6, 165.2, 165.2, 330.3),
)


def find_peak(device_name: str) -> Optional[Peak]:
    """The table's row for a GPU by the name torch reports (None: not in the table)."""
    return next((p for p in PEAKS if p.matches(device_name)), None)


def peak_tflops(device_name: str, fmt: str) -> Optional[float]:
    """The dense peak of `device_name` in `fmt` (one of FORMATS), TFLOP/s; None where the GPU
    is not in the table or has no such format (fp8 on an A100)."""
    peak = find_peak(device_name)
    return None if peak is None else peak.tflops.get(fmt)


def compute_format(dtypes: Iterable[torch.dtype], fp8: bool, model: nn.Module) -> str:
    """The format a level's matrix math runs in, for its peak: fp8 where Linear layers run in
    fp8, else its 16-bit type, else fp32 math in tf32 where torch allows it for the model's
    products (matmuls with `allow_tf32`; convolutions with cuDNN's, on by default), else fp32."""
    if fp8:
        return "fp8"
    found = set(dtypes)
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        if dtype in found:
            return name
    convolves = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    if torch.backends.cuda.matmul.allow_tf32 or (convolves and torch.backends.cudnn.allow_tf32):
        return "tf32"
    return "fp32"
