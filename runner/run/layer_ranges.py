"""What a format keeps of a layer's measured values, for the auto layer plan (runner.run.autoplan):
the shares of a layer's values that underflow or overflow a format at a loss scale (from the range
probe's power-of-two histograms, counted conservatively), torchao's fp8 shape rule, and the loss
scale the gradients are judged at. The rules: autoplan.md beside this file."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from runner.measure import diagnostics as diag
from runner.precision import Properties
from runner.precision.layers import param_layers


@dataclass(frozen=True)
class Thresholds:
    """The shares of a layer's non-zero values a format may lose."""

    max_underflow: float = 0.01
    max_overflow: float = 0.0

    @classmethod
    def from_config(cls, node: Any) -> Thresholds:
        return cls(float(node.layer_plan_max_underflow), float(node.layer_plan_max_overflow))


# ---- shares from the histograms (TensorStats), at a scale ---------------------------------------
def _bins(s: diag.TensorStats):
    return ((diag.LOG2_MIN + i, c) for i, c in enumerate(s.bins) if c)


def underflow_share(s: Optional[diag.TensorStats], fmt: diag.Format, scale: float = 1.0) -> float:
    """The share of the non-zero values x with |x * scale| below `fmt`'s smallest normal,
    counting a bin whose lower edge falls below the limit as lost (exact for a power-of-two
    scale, whose limit falls on a bin edge); fp32 subnormals always count."""
    if s is None or not s.nonzero:
        return 0.0
    if scale == s.scale and fmt.name in s.underflow:  # counted exactly by the probe
        return s.underflow[fmt.name] / s.nonzero
    cut = math.log2(fmt.tiny / scale)
    return (s.below + sum(c for k, c in _bins(s) if k < cut)) / s.nonzero


def overflow_share(s: Optional[diag.TensorStats], fmt: diag.Format, scale: float = 1.0) -> float:
    """The share of the non-zero values x with |x * scale| above `fmt`'s max (inf included):
    exact at the scale the probe judged at, else counting a bin whose upper edge passes the
    limit as lost."""
    if s is None or not s.nonzero:
        return 0.0
    if scale == s.scale and fmt.name in s.overflow:  # counted exactly by the probe
        return s.overflow[fmt.name] / s.nonzero
    limit = math.log2(fmt.max / scale)
    return (s.infs + sum(c for k, c in _bins(s) if k + 1 > limit)) / s.nonzero


def scaled_underflow_share(s: Optional[diag.TensorStats], fmt: diag.Format) -> float:
    """Under fp8's per-tensor scaling (the largest |x| scaled to `fmt`'s max): the share of the
    non-zero values that fall below its smallest normal, with the largest value bounded by its
    bin's upper edge (conservative)."""
    if s is None or not s.nonzero or s.max_log2 is None:
        return 0.0
    cut = s.max_log2 + 1 + math.log2(fmt.tiny / fmt.max)
    return (s.below + sum(c for k, c in _bins(s) if k < cut)) / s.nonzero


def pct(x: float) -> str:
    return "0%" if x == 0 else "<0.01%" if x < 1e-4 else f"{100 * x:.2f}%"


def scale_text(scale: float) -> str:
    k = math.log2(scale)
    return f"2^{int(k)}" if k == int(k) and k != 0 else f"{scale:g}"


# ---- torchao's shape rule ------------------------------------------------------------------------
def fp8_shape_refusal(module: nn.Linear, recipe: str) -> Optional[str]:
    """Why fp8 is not worth it for this Linear's shape by torchao's documented rule
    (`torchao.float8._auto_filter_for_recipe`; N x K the weight's shape); None when it is."""
    n, k = module.weight.shape
    if recipe == "rowwise":
        if n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048):
            return (
                f"its {n}x{k} weight is below torchao's rowwise shape rule (N > 2048, K > "
                "1024, not N <= 4096 and K <= 2048: torchao.float8._auto_filter_for_recipe)"
            )
        return None
    if k <= 4096 and n <= 1024:
        return (
            f"its {n}x{k} weight is below torchao's tensorwise shape rule (K > 4096 or N > "
            "1024: torchao.float8._auto_filter_for_recipe)"
        )
    return None


# ---- the choice ---------------------------------------------------------------------------------
@dataclass
class LayerRanges:
    """One layer's statistics over the pre-flight's steps (None: not observed)."""

    name: str
    module: nn.Module
    input: Optional[diag.TensorStats] = None
    activation: Optional[diag.TensorStats] = None
    activation_grad: Optional[diag.TensorStats] = None
    weight_grad: Optional[diag.TensorStats] = None
    weight: Optional[diag.TensorStats] = None

    @property
    def observed(self) -> bool:
        return self.activation is not None or self.input is not None

    @property
    def grads(self) -> Optional[diag.TensorStats]:
        return diag.total(s for s in (self.activation_grad, self.weight_grad) if s is not None)


def ranges(
    model: nn.Module, records: Sequence[diag.LayerRecord], weights: Mapping[str, diag.TensorStats]
) -> list[LayerRanges]:
    """Every layer of the plan (the model itself aside) with its statistics."""
    by_name = {name: LayerRanges(name, m) for name, m in param_layers(model) if name}
    for r in records:
        layer = by_name.get(r.layer)
        if layer is not None:
            old = getattr(layer, r.kind)
            setattr(layer, r.kind, r.stats if old is None else old + r.stats)
    for name, stats in weights.items():
        if name in by_name:
            by_name[name].weight = stats
    return list(by_name.values())


def holds_16(layer: LayerRanges, fmt: diag.Format, scale: float, t: Thresholds) -> Optional[str]:
    """Why the 16-bit format `fmt` does not hold the layer at loss scale `scale` (None: it does)."""
    for what, stats in (
        ("inputs", layer.input),
        ("weights", layer.weight),
        ("outputs", layer.activation),
    ):
        share = overflow_share(stats, fmt)
        if share > t.max_overflow:
            top = stats.max_log2
            return (
                f"{fmt.name} overflows in its {what} ({pct(share)} above {fmt.max:g}; "
                f"max |x| >= 2^{top})"
                if top is not None
                else f"{fmt.name} overflows in its {what} ({pct(share)} inf)"
            )
    grads = layer.grads
    over = overflow_share(grads, fmt, scale)
    if over > t.max_overflow:
        return f"{pct(over)} of its gradients overflow {fmt.name} at loss scale {scale_text(scale)}"
    under = underflow_share(grads, fmt, scale)
    if under > t.max_underflow:
        return (
            f"{pct(under)} of its gradients underflow {fmt.name} at loss scale "
            f"{scale_text(scale)} (limit {pct(t.max_underflow)})"
        )
    return None


def fp8_holds(layer: LayerRanges, t: Thresholds) -> Optional[str]:
    """Why fp8's ranges (per-tensor scaling) do not hold the layer (None: they do)."""
    e4m3, e5m2 = diag.FP8_E4M3, diag.FP8_E5M2
    for what, stats, fmt in (
        ("inputs", layer.input, e4m3),
        ("weights", layer.weight, e4m3),
        ("output gradients", layer.activation_grad, e5m2),
    ):
        if stats is not None and (stats.infs or stats.nans):
            return f"its {what} hold inf/NaN"
        share = scaled_underflow_share(stats, fmt)
        if share > t.max_underflow:
            return (
                f"{pct(share)} of its {what} fall below {fmt.name}'s range under per-tensor scaling"
            )
    return None


def choose_scale(
    p: Properties, layers: Sequence[LayerRanges], fmt: diag.Format, t: Thresholds
) -> tuple[float, str]:
    """The loss scale the gradients are judged at, and a line saying where it comes from: a
    static one as it is; a dynamic one, the power of two that keeps the most layers' gradients
    in range, the nearest to `init_scale` among those (where the scaler starts)."""
    if not p.dynamic_loss_scale:
        return float(p.loss_scale), f"loss scale: {p.loss_scale:g} (static, the level's)"
    high = int(math.floor(math.log2(p.max_loss_scale)))
    low = int(math.ceil(math.log2(p.min_loss_scale))) if p.min_loss_scale else -24
    held = {
        k: sum(
            1
            for layer in layers
            if layer.grads is not None
            and overflow_share(layer.grads, fmt, 2.0**k) <= t.max_overflow
            and underflow_share(layer.grads, fmt, 2.0**k) <= t.max_underflow
        )
        for k in range(low, high + 1)
    }
    most = max(held.values())
    start = math.log2(p.init_scale)  # of the scales that hold the most: the nearest to the start
    k = min((k for k, n in held.items() if n == most), key=lambda k: (abs(k - start), -k))
    best = (most, k)
    scale = 2.0 ** best[1]
    note = (
        f"loss scale: {scale_text(scale)}, the power of two that keeps the most layers' "
        f"gradients in {fmt.name} ({best[0]} of {len(layers)}); dynamic scaling starts at "
        f"{scale_text(p.init_scale)}"
    )
    if scale > p.init_scale:
        note += f" (precision.init_scale={scale:g} starts it there)"
    return scale, note
