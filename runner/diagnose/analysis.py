"""The pre-flight's analysis: per-layer statistics of the diagnosed fp32 steps, what fp16, bf16 and
fp8 would lose (underflow, overflow), the fp16 loss scale that keeps the gradients in range, the
recommended preset, and all of it as text (`render`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from runner.config.levels import SCALER_DEFAULTS

HEADROOM_LOG2 = 15  # the recommended scale keeps every gradient below 2^15 = fp16 max / 2
MAX_SCALE_LOG2 = int(math.log2(SCALER_DEFAULTS["max_loss_scale"]))  # the dynamic scaler's ceiling
NOTABLE_UNDERFLOW = 0.01  # a layer "underflows" when at least this share of its values does


@dataclass
class Layer:
    """One layer's statistics over the diagnosed steps."""

    name: str
    module: str
    activation: object = None  # diagnostics.TensorStats (None: not observed)
    activation_grad: object = None
    weight_grad: object = None

    @property
    def grads(self):
        from runner.measure.diagnostics import total

        return total(s for s in (self.activation_grad, self.weight_grad) if s is not None)


@dataclass
class Judgement:
    """What one format does to the model's values (gradients unscaled)."""

    name: str  # fp16 | bf16 | fp8
    act_format: str
    grad_format: str
    act_overflow: list[str] = field(default_factory=list)  # layer names
    act_underflow: list[str] = field(default_factory=list)
    grad_overflow: list[str] = field(default_factory=list)
    grad_underflow: list[str] = field(default_factory=list)


@dataclass
class Preflight:
    """The pre-flight's findings: per-layer statistics, per-format judgements, the loss scale
    and the recommendation."""

    layers: list[Layer]
    steps: int
    judgements: list[Judgement]
    grads: object  # all gradients pooled (TensorStats or None)
    activations: object
    loss_scale: Optional[float]  # the recommended fp16 loss scale (None: no non-zero gradient)
    underflow_at_scale: Optional[float]  # fp16 gradient underflow share at that scale
    preset: str
    keep_fp32: list[str]
    advice: list[str]
    records: list = field(default_factory=list)  # the probe's (what a layer plan is decided from)


def _aggregate(records) -> list[Layer]:
    from runner.measure.diagnostics import total

    layers: dict[str, Layer] = {}
    for r in records:
        layer = layers.setdefault(r.layer, Layer(r.layer, r.module))
        setattr(layer, r.kind, total([s for s in (getattr(layer, r.kind), r.stats) if s]))
    return list(layers.values())


def _judge(layers: Sequence[Layer], name: str, act_format: str, grad_format: str) -> Judgement:
    j = Judgement(name, act_format, grad_format)
    for layer in layers:
        act, grads = layer.activation, layer.grads
        if act is not None:
            if act.overflow[act_format]:
                j.act_overflow.append(layer.name)
            if act.underflow_frac(act_format) >= NOTABLE_UNDERFLOW:
                j.act_underflow.append(layer.name)
        if grads is not None:
            if grads.overflow[grad_format]:
                j.grad_overflow.append(layer.name)
            if grads.underflow_frac(grad_format) >= NOTABLE_UNDERFLOW:
                j.grad_underflow.append(layer.name)
    return j


def recommended_scale(grads) -> Optional[float]:
    """The largest power of two S with max|g| * S < 2^15 (all gradients at most half of fp16's
    max), capped at 2^24; None when no gradient is finite and non-zero."""
    top = grads.max_log2 if grads is not None else None
    if top is None:
        return None
    return 2.0 ** min(HEADROOM_LOG2 - 1 - top, MAX_SCALE_LOG2)


def _percent(x: float) -> str:
    if x == 0:
        return "-"
    if x < 1e-4:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def analyse(records, steps: int, device_type: str = "cpu") -> Preflight:
    """Per-layer statistics of an fp32 run (`RangeProbe` records at scale 1, every format probed)
    -> the judgement of each format, the fp16 loss scale and the recommendation."""
    from runner.measure.diagnostics import ACTIVATION, FP16, GRADIENT_KINDS, total

    layers = _aggregate(records)
    grads = total(r.stats for r in records if r.kind in GRADIENT_KINDS)
    acts = total(r.stats for r in records if r.kind == ACTIVATION)
    judgements = [
        _judge(layers, "fp16", "fp16", "fp16"),
        _judge(layers, "bf16", "bf16", "bf16"),
        _judge(layers, "fp8", "fp8_e4m3", "fp8_e5m2"),
    ]
    fp16, bf16, fp8 = judgements
    scale = recommended_scale(grads)
    under_at = (
        grads.underflow_at(FP16, scale) / grads.nonzero
        if scale is not None and grads.nonzero
        else None
    )
    advice = _fp32_advice(grads, acts)
    preset, keep, said = _fp16_advice(layers, fp16, grads, scale, under_at, device_type)
    advice += [*said, _bf16_advice(bf16), _fp8_advice(layers, fp8)]
    return Preflight(layers, steps, judgements, grads, acts, scale, under_at, preset, keep, advice)


def _fp32_advice(grads: Any, acts: Any) -> list[str]:
    """What to fix first where fp32 itself produced inf/NaN values ([] where it did not)."""
    if (
        grads is not None
        and (grads.infs or grads.nans)
        or acts is not None
        and (acts.infs or acts.nans)
    ):
        return [
            "Even fp32 produced inf/NaN values in these steps: the model or the "
            "learning rate diverges whatever the precision; fix that first "
            "(a lower optimizer.lr, gradient clipping)."
        ]
    return []


def _fp16_advice(
    layers: Sequence[Layer],
    fp16: Judgement,
    grads: Any,
    scale: Optional[float],
    under_at: Optional[float],
    device_type: str,
) -> tuple[str, list[str], list[str]]:
    """(the preset to try first, the layers to keep in fp32, what to say) from what fp16 does to
    these values: activations that overflow, gradients that overflow unscaled or span more than
    its range (bf16 first), else the loss scale that keeps them (fp16 first)."""
    if fp16.act_overflow:
        keep = list(fp16.act_overflow)
        tops = ", ".join(
            f"{n} (max |activation| >= 2^{_layer(layers, n).activation.max_log2})"
            for n in fp16.act_overflow[:6]
        )
        return (
            "o2_bf16",
            keep,
            [
                f"fp16 OVERFLOWS in the forward pass: the activations of {tops} exceed fp16's "
                "max 65504 and would become inf. Loss scaling cannot help (it scales gradients, "
                "not activations).",
                "Try precision=o2_bf16 first (bfloat16 has fp32's range; precision=o1_bf16 if "
                "the model needs fp32 weights), on hardware with bf16 (a CPU, or a GPU of compute "
                f"capability 8.0 or newer). To stay in fp16, keep {_names(keep)} in fp32 (e.g. "
                "run them outside autocast under O1, or scale their inputs down).",
            ],
        )
    if scale is not None and scale < 1:
        return (
            "o2_bf16",
            list(fp16.grad_overflow),
            [
                f"fp16 OVERFLOWS in the gradients even unscaled (in {_names(fp16.grad_overflow)}"
                f"): only a loss scale below 1 ({scale:g}) keeps them in range. Try "
                f"precision=o2_bf16 first, or precision=o2 precision.loss_scale={scale:g}."
            ],
        )
    if under_at is not None and under_at >= NOTABLE_UNDERFLOW:
        return (
            "o2_bf16",
            [],
            [
                f"The gradients span more than fp16's range: at the largest safe loss scale "
                f"({scale:g}) {_percent(under_at)} of them still underflow. Try precision=o2_bf16 "
                "first (bfloat16 keeps fp32's range; no loss scaling needed)."
            ],
        )
    return "o2", [], _scaled_fp16_advice(fp16, grads, scale, under_at, device_type)


def _scaled_fp16_advice(
    fp16: Judgement, grads: Any, scale: Any, under_at: Any, device_type: str
) -> list[str]:
    """What to say where fp16 holds the gradients, scaled or not: how much a loss scale saves,
    the presets to try, and on a CPU that fp16 is emulated there."""
    if fp16.grad_underflow:
        advice = [
            f"fp16 needs loss scaling: unscaled, {_percent(_frac(grads, 'fp16'))} of the "
            f"gradients underflow (in {len(fp16.grad_underflow)} layers). At loss scale "
            f"{scale:g}, {_percent(under_at)} underflow and none overflows."
        ]
    else:
        advice = ["fp16 holds these gradients even unscaled (no layer underflows by 1% or more)."]
    advice.append(
        f"Try precision=o2 first (fp16 with fp32 masters and dynamic loss scaling: it "
        f"starts at {SCALER_DEFAULTS['init_scale']:g}, and these gradients overflow above "
        f"about {2 * scale:g}), or a "
        f"static precision.loss_scale={scale:g}; precision=o2_bf16 needs no scaling at all."
    )
    if device_type == "cpu":
        advice.append(
            "On a CPU fp16 is emulated and slow: there, precision=o2_bf16 is the practical choice."
        )
    return advice


def _bf16_advice(bf16: Judgement) -> str:
    """What bf16 loses, where it loses anything."""
    if bf16.act_overflow or bf16.grad_overflow or bf16.grad_underflow:
        return (
            "bf16 loses values too: overflow in "
            f"{_names(bf16.act_overflow + bf16.grad_overflow) or 'no layer'}, "
            f"gradient underflow in {_names(bf16.grad_underflow) or 'no layer'}."
        )
    return "bf16: no layer's activations or gradients under- or overflow."


def _fp8_advice(layers: Sequence[Layer], fp8: Judgement) -> str:
    """What fp8 would do: under the fp8 presets' per-tensor scaling, to the Linear layers'
    output gradients (e5m2: exactly what their GEMMs take), and unscaled, to every layer."""
    from runner.measure.diagnostics import FP8_E5M2
    from runner.run.layer_ranges import scaled_underflow_share

    linear = [layer for layer in layers if layer.module.endswith("Linear")]
    lost = [
        layer.name
        for layer in linear
        if scaled_underflow_share(layer.activation_grad, FP8_E5M2) >= NOTABLE_UNDERFLOW
    ]
    unscaled = (
        f"Unscaled, e4m3 activations overflow in {len(fp8.act_overflow)} and underflow in "
        f"{len(fp8.act_underflow)} layers, e5m2 gradients overflow in {len(fp8.grad_overflow)} "
        f"and underflow in {len(fp8.grad_underflow)} (of {len(layers)})."
    )
    if not linear:
        return (
            "fp8 (precision=o1_fp8 / o2_fp8 run the Linear layers' GEMMs in fp8): this model "
            f"has no Linear layer. {unscaled}"
        )
    where = f" ({_names(lost)})" if lost else ""
    return (
        "fp8 (precision=o1_fp8 / o2_fp8 run the Linear layers' GEMMs in fp8, each tensor scaled "
        f"to its own max): so scaled, the e5m2 output gradients of {len(lost)} of the "
        f"{len(linear)} Linear layers lose 1% or more to underflow{where}; --plan FILE with "
        "precision=o2_fp8 judges their inputs and weights (e4m3) too and picks the layers worth "
        f"it. {unscaled}"
    )


def _layer(layers: Sequence[Layer], name: str) -> Layer:
    return next(layer for layer in layers if layer.name == name)


def _frac(stats, fmt: str) -> float:
    return stats.underflow_frac(fmt) if stats is not None else 0.0


def _limits(fmt) -> str:
    return f"{fmt.name} (max {fmt.max:g}, smallest normal 2^{math.log2(fmt.tiny):.0f})"


# ---- rendering -----------------------------------------------------------------------------------
def render(result: Preflight, title: str) -> str:
    from runner.measure.diagnostics import FORMATS

    lines = [title, ""]
    for j in result.judgements:
        act_f, grad_f = FORMATS[j.act_format], FORMATS[j.grad_format]
        affected = [
            layer
            for layer in result.layers
            if layer.name
            in {*j.act_overflow, *j.act_underflow, *j.grad_overflow, *j.grad_underflow}
        ]
        grads = result.grads
        acts = result.activations
        whole = (
            f"whole model: activations {_percent(acts.underflow_frac(act_f.name))} "
            f"under / {_percent(acts.overflow_frac(act_f.name))} over, "
            f"gradients {_percent(_frac(grads, grad_f.name))} under / "
            f"{_percent(grads.overflow_frac(grad_f.name) if grads else 0.0)} over"
            if result.activations is not None
            else "nothing observed"
        )
        formats = (
            _limits(act_f)
            if act_f is grad_f
            else f"activations in {_limits(act_f)}, gradients in {_limits(grad_f)}"
        )
        lines.append(f"{j.name}: {formats}, gradients unscaled; {whole}")
        if not affected:
            lines += ["  no layer underflows (>= 1%) or overflows", ""]
            continue
        width = max(len("layer"), *(len(layer.name) for layer in affected))
        mwidth = max(len("module"), *(len(layer.module) for layer in affected))
        head = (
            f"  {'layer':<{width}}  {'module':<{mwidth}}  {'act under':>9}  {'act over':>9}  "
            f"{'a-grad under':>12}  {'a-grad over':>11}  {'w-grad under':>12}  "
            f"{'w-grad over':>11}"
        )
        lines += [head, "  " + "-" * (len(head) - 2)]
        for layer in affected:
            cells = []
            for stats, fmt in (
                (layer.activation, act_f),
                (layer.activation_grad, grad_f),
                (layer.weight_grad, grad_f),
            ):
                if stats is None:
                    cells += ["", ""]
                else:
                    cells += [
                        _percent(stats.underflow_frac(fmt.name)),
                        _percent(stats.overflow_frac(fmt.name)),
                    ]
            lines.append(
                f"  {layer.name:<{width}}  {layer.module:<{mwidth}}  {cells[0]:>9}  "
                f"{cells[1]:>9}  {cells[2]:>12}  {cells[3]:>11}  {cells[4]:>12}  "
                f"{cells[5]:>11}"
            )
        lines.append("")
    if result.loss_scale is not None:
        lines.append(
            f"fp16 loss scale that keeps every gradient below 2^{HEADROOM_LOG2} "
            f"(half of fp16's max): {result.loss_scale:g}; at it "
            f"{_percent(result.underflow_at_scale)} of the gradients still underflow."
        )
    else:
        lines.append("No finite non-zero gradient was observed: no loss scale to recommend.")
    lines += [
        "",
        f"Recommendation: precision={result.preset}"
        + (f"; keep in fp32: {_names(result.keep_fp32)}" if result.keep_fp32 else ""),
    ]
    lines += [f"- {a}" for a in result.advice]
    return "\n".join(lines) + "\n"
