"""Range diagnostics: where a 16-bit (or 8-bit) format loses the values a training step produces.

Per layer (a module that owns parameters and has no children) and step, a `RangeProbe` counts its
outputs (`activation`), their gradients (`activation_grad`) and its parameters' gradients
(`weight_grad`) into base-2 exponent histograms and the share of values each `Format` would
underflow or overflow, on the device, read in one transfer. Definitions, scaling and the in-run
versus pre-flight reading: README.md beside this file. Inside a run: `run_diagnostics`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
from torch import nn

from runner.metrics import DIAG_ACT, DIAG_GRAD

ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD = "activation", "activation_grad", "weight_grad"
INPUT = "input"  # a layer's floating inputs (only a probe made with inputs=True: a layer plan's)
KINDS = (INPUT, ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD)
GRADIENT_KINDS = (ACTIVATION_GRAD, WEIGHT_GRAD)

LOG2_MIN, LOG2_MAX = -126, 127  # the normal fp32 exponents: one bin each
_EXPONENT_BINS = 256  # fp32 biased exponents 0..255: 0 is zero/subnormal, 255 inf/NaN
_INF_BITS = 0x7F800000


# ---- formats -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Format:
    """A floating-point format whose range a probe judges values against."""

    name: str
    dtype: torch.dtype

    @property
    def tiny(self) -> float:
        """The smallest normal value."""
        return float(torch.finfo(self.dtype).tiny)

    @property
    def min_subnormal(self) -> float:
        finfo = torch.finfo(self.dtype)
        return float(finfo.tiny) * float(finfo.eps)

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)


FP16 = Format("fp16", torch.float16)
BF16 = Format("bf16", torch.bfloat16)
FP8_E4M3 = Format("fp8_e4m3", torch.float8_e4m3fn)
FP8_E5M2 = Format("fp8_e5m2", torch.float8_e5m2)
FORMATS = {f.name: f for f in (FP16, BF16, FP8_E4M3, FP8_E5M2)}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}


def run_formats(compute_dtypes: Iterable[torch.dtype]) -> list[Format]:
    """The formats a run computes in (fp16 first, the narrower range); fp16 for an fp32 run, as
    the reference of what the usual 16-bit target would lose."""
    found = [_BY_DTYPE[d] for d in (torch.float16, torch.bfloat16) if d in set(compute_dtypes)]
    return found or [FP16]


def _fp32_bits(value: float) -> int:
    """The bit pattern of `value` rounded to fp32, as a non-negative int (inf for too large)."""
    if value >= 3.5e38:
        return _INF_BITS
    return struct.unpack("<i", struct.pack("<f", value))[0]


# ---- statistics of one kind of value of one layer ------------------------------------------------
@dataclass
class TensorStats:
    """Counts over every element observed (one or more tensors): the exponent histogram and, per
    format, how many values underflow and overflow at the probe's scale."""

    scale: float
    bins: list[int]  # bins[i]: 2^(LOG2_MIN+i) <= |x| < 2^(LOG2_MIN+i+1)
    below: int  # 0 < |x| < 2^-126 (fp32 subnormals)
    zeros: int
    infs: int
    nans: int
    underflow: dict[str, int] = field(default_factory=dict)  # format name -> count
    overflow: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        """Every element observed: the histogram's sum."""
        return sum(self.bins) + self.below + self.zeros + self.infs + self.nans

    @property
    def nonzero(self) -> int:
        """The denominator of the fractions: non-zero values that are not NaN (inf included)."""
        return sum(self.bins) + self.below + self.infs

    def underflow_frac(self, fmt: str) -> float:
        return self.underflow[fmt] / self.nonzero if self.nonzero else 0.0

    def overflow_frac(self, fmt: str) -> float:
        return self.overflow[fmt] / self.nonzero if self.nonzero else 0.0

    @property
    def max_log2(self) -> Optional[int]:
        """floor(log2 max|x|) over the finite values (None when all are zero or non-finite)."""
        top = [i for i, c in enumerate(self.bins) if c]
        if top:
            return LOG2_MIN + top[-1]
        return LOG2_MIN - 1 if self.below else None

    @property
    def min_log2(self) -> Optional[int]:
        """floor(log2 min|x|) over the non-zero values (LOG2_MIN - 1 for fp32 subnormals)."""
        if self.below:
            return LOG2_MIN - 1
        low = [i for i, c in enumerate(self.bins) if c]
        return LOG2_MIN + low[0] if low else None

    def underflow_at(self, fmt: Format, scale: float) -> int:
        """How many values underflow `fmt` at loss scale `scale` (a power of two), from the
        histogram alone: exact, because tiny and the scale are powers of two. Defined for the
        scales where values below 2^-126 all underflow (every fp16 and fp8 scale up to 2^100)."""
        log2_scale = math.log2(scale)
        if log2_scale != int(log2_scale):
            raise ValueError(f"scale {scale:g} is not a power of two")
        cut = int(math.log2(fmt.tiny)) - int(log2_scale)  # |x| < 2^cut underflows
        if cut <= LOG2_MIN:
            raise ValueError(
                f"{fmt.name} at scale {scale:g}: the threshold 2^{cut} falls among "
                "the fp32 subnormals, which the histogram does not resolve"
            )
        return self.below + sum(self.bins[: cut - LOG2_MIN])

    def __add__(self, other: TensorStats) -> TensorStats:
        if other.scale != self.scale:
            raise ValueError("statistics at different scales do not add up")
        return TensorStats(
            self.scale,
            [a + b for a, b in zip(self.bins, other.bins)],
            self.below + other.below,
            self.zeros + other.zeros,
            self.infs + other.infs,
            self.nans + other.nans,
            {k: v + other.underflow.get(k, 0) for k, v in self.underflow.items()},
            {k: v + other.overflow.get(k, 0) for k, v in self.overflow.items()},
        )

    def histogram(self) -> list[tuple[str, int]]:
        """(bin label, count) for every bin, the special ones included: sums to `count`."""
        rows = [("zero", self.zeros), (f"<{LOG2_MIN}", self.below)]
        rows += [(str(LOG2_MIN + i), c) for i, c in enumerate(self.bins)]
        return rows + [("inf", self.infs), ("nan", self.nans)]


def total(stats: Iterable[TensorStats]) -> Optional[TensorStats]:
    out = None
    for s in stats:
        out = s if out is None else out + s
    return out


# ---- counting on the device ----------------------------------------------------------------------
class _Thresholds:
    """The fp32 bit patterns a probe compares |x| against, and where each threshold's count is
    read from the bucket counts. Non-negative fp32 values order like their bit patterns."""

    def __init__(self, formats: Sequence[Format], scale: float):
        self.formats = list(formats)
        self.tiny = {f.name: _fp32_bits(f.tiny / scale) for f in formats}
        # |x| > max/S  <=>  bits > bits(max/S); inf always overflows
        self.over = {f.name: min(_fp32_bits(f.max / scale) + 1, _INF_BITS) for f in formats}
        values = {1, _INF_BITS, _INF_BITS + 1, *self.tiny.values(), *self.over.values()}
        self.boundaries = sorted(v for v in values if v > 0)
        self._tensors: dict[torch.device, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return _EXPONENT_BINS + len(self.boundaries) + 1

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._tensors.get(device)
        if t is None:
            t = self._tensors[device] = torch.tensor(
                self.boundaries, dtype=torch.int32, device=device
            )
        return t

    def stats(self, counts: Sequence[int], scale: float) -> TensorStats:
        exponents, buckets = counts[:_EXPONENT_BINS], counts[_EXPONENT_BINS:]
        # at_least[j]: how many bit patterns are >= boundaries[j]
        at_least, running = [0] * len(self.boundaries), 0
        for j in range(len(self.boundaries) - 1, -1, -1):
            running += buckets[j + 1]
            at_least[j] = running

        def ge(bits: int) -> int:
            return at_least[self.boundaries.index(bits)] if bits > 0 else sum(buckets)

        nans = ge(_INF_BITS + 1)
        infs = ge(_INF_BITS) - nans
        zeros = sum(buckets) - ge(1)
        return TensorStats(
            scale=scale,
            bins=list(exponents[1:255]),
            below=exponents[0] - zeros,
            zeros=zeros,
            infs=infs,
            nans=nans,
            underflow={n: ge(1) - ge(bits) for n, bits in self.tiny.items()},
            overflow={n: ge(bits) - nans for n, bits in self.over.items()},
        )


def _count_into(dst: torch.Tensor, index: torch.Tensor) -> None:
    """dst[i] += how many entries of `index` equal i (every entry < len(dst)), without a host
    sync: `bincount` sizes its output from the input's maximum, a sync on CUDA, so other
    devices add with `index_add_`."""
    if index.device.type == "cpu":
        dst += torch.bincount(index, minlength=dst.numel())
    else:
        ones = torch.ones((), dtype=dst.dtype, device=dst.device).expand(index.numel())
        dst.index_add_(0, index, ones)


@torch.no_grad()
def observe(acc: torch.Tensor, x: torch.Tensor, thresholds: _Thresholds) -> None:
    """Add every element of `x` to the accumulator `acc` (length `thresholds.size`, int64, on
    x's device): its fp32 exponent bin and the threshold bucket it falls in."""
    a = x.detach().reshape(-1)
    a = a.abs() if a.dtype == torch.float32 else a.float().abs_()
    bits = a.view(torch.int32)
    _count_into(acc[:_EXPONENT_BINS], bits >> 23)
    buckets = torch.bucketize(bits, thresholds.on(bits.device), right=True, out_int32=True)
    _count_into(acc[_EXPONENT_BINS:], buckets)


def tensor_stats(
    tensors: Iterable[torch.Tensor], formats: Sequence[Format], scale: float = 1.0
) -> TensorStats:
    """The statistics of some tensors' values, judged at loss scale `scale` (one host read)."""
    thresholds = _Thresholds(formats, scale)
    acc = None
    for t in tensors:
        if acc is None:
            acc = torch.zeros(thresholds.size, dtype=torch.int64, device=t.device)
        observe(acc, t, thresholds)
    counts = [0] * thresholds.size if acc is None else acc.tolist()
    return thresholds.stats(counts, scale)


# ---- the probe -----------------------------------------------------------------------------------
def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The observed layers: modules without children that own parameters, by qualified name."""
    return [
        (name or type(model).__name__, m)
        for name, m in model.named_modules()
        if not any(True for _ in m.children()) and any(True for _ in m.parameters(recurse=False))
    ]


def _tensors_in(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors_in(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors_in(o)]
    return []


@dataclass
class LayerRecord:
    """One layer's statistics of one kind of value at one diagnosed step."""

    step: int
    layer: str
    module: str  # the module's class name
    kind: str
    stats: TensorStats


class RangeProbe:
    """Hooks on a model's layers for one training step, removed when the step is over.

        probe = RangeProbe(model, [FP16, BF16])
        with probe:                       # forward hooks installed on the layers
            loss = criterion(model(x), y)
            loss.backward()               # tensor hooks on the outputs see the gradients
            probe.observe_weight_grads()  # the layers' parameters' .grad
        records = probe.read(step)        # the one host read

    Outside `with` the model holds no hook of the probe's."""

    def __init__(
        self,
        model: nn.Module,
        formats: Sequence[Format],
        scale: float = 1.0,
        inputs: bool = False,
        layers: Optional[Sequence[tuple[str, nn.Module]]] = None,
    ):
        self.model = model
        self.formats = list(formats)
        self.scale = float(scale)
        self.inputs = inputs
        self.thresholds = _Thresholds(self.formats, self.scale)
        self.layers = list(layers) if layers is not None else layers_of(model)
        self._acc: dict[tuple[str, str], torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> RangeProbe:
        for name, module in self.layers:
            self._handles.append(module.register_forward_hook(partial(self._forward_hook, name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _observe(self, layer: str, kind: str, x: torch.Tensor) -> None:
        acc = self._acc.get((layer, kind))
        if acc is None:
            acc = self._acc[(layer, kind)] = torch.zeros(
                self.thresholds.size, dtype=torch.int64, device=x.device
            )
        observe(acc, x, self.thresholds)

    def _forward_hook(self, layer: str, module: nn.Module, inputs, output) -> None:
        if self.inputs:
            for t in _tensors_in(inputs):
                self._observe(layer, INPUT, t)
        for t in _tensors_in(output):
            self._observe(layer, ACTIVATION, t)
            if t.requires_grad:
                # registered before any in-place op on the output (an inplace ReLU): the hook sees
                # the gradient of the layer's own output
                t.register_hook(partial(self._grad_hook, layer))

    def _grad_hook(self, layer: str, grad: torch.Tensor) -> None:
        self._observe(layer, ACTIVATION_GRAD, grad)

    def observe_weight_grads(self) -> None:
        """The layers' parameters' gradients as they are now (after backward, before the step)."""
        for name, module in self.layers:
            for p in module.parameters(recurse=False):
                if p.grad is not None:
                    self._observe(name, WEIGHT_GRAD, p.grad)

    def read(self, step: int) -> list[LayerRecord]:
        """Every layer's statistics, in layer order then kind order: one device-to-host copy."""
        keys = [
            (name, module, kind)
            for name, module in self.layers
            for kind in KINDS
            if (name, kind) in self._acc
        ]
        if not keys:
            return []
        accs = [self._acc[(name, kind)] for name, _, kind in keys]
        rows = torch.stack([a.to(accs[0].device) for a in accs]).tolist()
        return [
            LayerRecord(
                step, name, type(module).__name__, kind, self.thresholds.stats(row, self.scale)
            )
            for (name, module, kind), row in zip(keys, rows)
        ]


# ---- whole-model figures -------------------------------------------------------------------------
def model_metrics(records: Sequence[LayerRecord], fmt: Format) -> dict[str, float]:
    """The whole model's fractions in `fmt`: gradients (activation and weight gradients pooled)
    and activations, over every observed value of `records`."""
    grads = total(r.stats for r in records if r.kind in GRADIENT_KINDS)
    acts = total(r.stats for r in records if r.kind == ACTIVATION)
    out = {}
    for prefix, stats in ((DIAG_GRAD, grads), (DIAG_ACT, acts)):
        if stats is not None:
            out[f"{prefix}_underflow_frac"] = stats.underflow_frac(fmt.name)
            out[f"{prefix}_overflow_frac"] = stats.overflow_frac(fmt.name)
    return out
