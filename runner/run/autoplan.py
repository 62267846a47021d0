"""A layer plan from measured ranges: `precision.layer_plan=auto`, and `python -m runner.diagnose
... --plan plan.yaml`.

**The pre-flight.** The run's own model and data, built in fp32 (O0: the values before any format
rounds them), train `precision.layer_plan_steps` steps (default 3) with the range probe of
`runner.measure.diagnostics` on every layer of the plan (every module that owns parameters), which
records per layer the exponent histograms of its inputs, outputs, output gradients and weight
gradients; its weights are read from the model.

**The choice, per layer** (`decide`): the narrowest format among
  1. fp8, only where the level runs fp8 (`fp8_linear`), for an `nn.Linear` that torchao's float8
     training converts (sizes multiples of 16) and whose shape makes fp8 worth it by the rule
     torchao documents (`torchao.float8._auto_filter_for_recipe`, from its H100 benchmarks:
     tensorwise needs K > 4096 or N > 1024; rowwise needs N > 2048, K > 1024 and not both
     N <= 4096 and K <= 2048; N x K is the weight's shape), and whose input and weight (e4m3)
     and output gradient (e5m2) keep their values with fp8's per-tensor scaling (the tensor's
     largest value is scaled to the format's max, so what is lost is what lies more than
     max/tiny below it: e4m3 2^14.8, e5m2 2^29.8);
  2. the level's 16-bit type (fp16 or bf16), where the layer's inputs, weights and outputs do not
     overflow it and its gradients, at the loss scale the level would use, neither underflow nor
     overflow;
  3. float32.
"Do not underflow / overflow" means: the share of the non-zero values below the format's
smallest normal (underflow) or above its max (overflow) is at most
`precision.layer_plan_max_underflow` (1%) / `layer_plan_max_overflow` (0). Activations and
weights are judged on overflow only (they are not scaled, and a value too small for the format is
small beside the
layer's others); gradients on both. Shares come from the power-of-two histograms, counted
conservatively (a bin that straddles a limit counts as lost).

**The loss scale.** A static `loss_scale` is taken as it is. With dynamic scaling (fp16) the scale
is the power of two (at most `max_loss_scale`, at least `min_loss_scale`) that keeps the most
layers' gradients in range, of those the nearest to `init_scale` (where the scaler starts): a layer
whose gradients are far larger than the
others' would hold the scaler down and make every other layer underflow, so it goes to fp32
instead, and the scaler settles higher.

**The plan** holds an entry for every layer whose format differs from the level's (and for a layer
inside such a one that keeps another format), each with its reason; every layer's choice and reason
is in the report and, as comments, in the plan file. A layer the pre-flight did not see run (its
parent uses its weights) and the model itself (its own parameters) follow the level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from runner.measure import diagnostics as diag
from runner.measure.run_diagnostics import RunDiagnostics
from runner.precision import Properties, resolve
from runner.precision.layers import (
    AUTO,
    FP8,
    LayerRule,
    config_rules,
    exact_glob,
    fp8_ineligible,
    fp8_refusal,
    level_expect,
    level_half,
    param_layers,
    plan_yaml,
    text_table,
)
from runner.precision.properties import dtype_name

log = logging.getLogger(__name__)


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


def _pct(x: float) -> str:
    return "0%" if x == 0 else "<0.01%" if x < 1e-4 else f"{100 * x:.2f}%"


def _scale_text(scale: float) -> str:
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


@dataclass
class Decision:
    """One layer's format in the plan, the level's, and why."""

    name: str
    module: str
    format: str
    level: str  # the level's compute format for it
    why: str
    entry: bool = False  # the plan has an entry for it


@dataclass
class AutoPlan:
    """The plan `decide` made: every layer's decision, the entries, the loss scale assumed."""

    decisions: list[Decision]
    rules: list[LayerRule]
    preset: str
    level_format: str  # the level's 16-bit type, or float32
    scale: Optional[float]  # the loss scale the gradients were judged at (None: no 16-bit)
    scale_note: str
    thresholds: Thresholds
    steps: int = 0

    def header(self, title: str = "") -> list[str]:
        lines = [title] if title else []
        lines += [
            f"amp-runner layer plan for precision={self.preset}, measured over {self.steps} "
            f"fp32 steps (precision.layer_plan=auto / python -m runner.diagnose --plan)",
            f"a format holds a layer when at most {_pct(self.thresholds.max_underflow)} of "
            f"its gradients underflow and at most {_pct(self.thresholds.max_overflow)} of "
            "its inputs, outputs and gradients overflow",
            self.scale_note,
            "",
            "every layer's choice (the entries below list those that differ from the level):",
        ]
        lines += [
            f"  {d.name}: {d.format}{'' if d.entry else ' (the level)'} -- {d.why}"
            for d in self.decisions
        ]
        return lines

    def yaml(self, title: str = "") -> str:
        """The plan file: the entries and their reasons, every layer's choice as comments. With
        no entry (every layer keeps the level's format) the file says so: `layers: {}`."""
        if not self.rules:  # (a plan all the same: every layer as the level makes it)
            return (
                "\n".join(f"# {line}" for line in self.header(title))
                + "\n# no layer needs another format than the level's: no entry\nlayers: {}\n"
            )
        return plan_yaml(self.rules, self.header(title))

    def table(self) -> str:
        return text_table(
            ("layer", "module", "format", "why"),
            [
                (d.name, d.module, d.format + ("" if d.entry else " (level)"), d.why)
                for d in self.decisions
            ],
        )

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.decisions:
            out[d.format] = out.get(d.format, 0) + 1
        return out


def _holds_16(layer: LayerRanges, fmt: diag.Format, scale: float, t: Thresholds) -> Optional[str]:
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
                f"{fmt.name} overflows in its {what} ({_pct(share)} above {fmt.max:g}; "
                f"max |x| >= 2^{top})"
                if top is not None
                else f"{fmt.name} overflows in its {what} ({_pct(share)} inf)"
            )
    grads = layer.grads
    over = overflow_share(grads, fmt, scale)
    if over > t.max_overflow:
        return (
            f"{_pct(over)} of its gradients overflow {fmt.name} at loss scale {_scale_text(scale)}"
        )
    under = underflow_share(grads, fmt, scale)
    if under > t.max_underflow:
        return (
            f"{_pct(under)} of its gradients underflow {fmt.name} at loss scale "
            f"{_scale_text(scale)} (limit {_pct(t.max_underflow)})"
        )
    return None


def _fp8_holds(layer: LayerRanges, t: Thresholds) -> Optional[str]:
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
                f"{_pct(share)} of its {what} fall below {fmt.name}'s range under "
                "per-tensor scaling"
            )
    return None


def _choose_scale(
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
        f"loss scale: {_scale_text(scale)}, the power of two that keeps the most layers' "
        f"gradients in {fmt.name} ({best[0]} of {len(layers)}); dynamic scaling starts at "
        f"{_scale_text(p.init_scale)}"
    )
    if scale > p.init_scale:
        note += f" (precision.init_scale={scale:g} starts it there)"
    return scale, note


def decide(
    model: nn.Module,
    records: Sequence[diag.LayerRecord],
    weights: Mapping[str, diag.TensorStats],
    p: Properties,
    thresholds: Thresholds = Thresholds(),
    preset: str = "",
    steps: int = 0,
) -> AutoPlan:
    """Each layer's format from the pre-flight's records (see the module docstring)."""
    layers = ranges(model, records, weights)
    half = level_half(p)
    fmt16 = diag.FP16 if half == torch.float16 else diag.BF16 if half == torch.bfloat16 else None
    observed = [layer for layer in layers if layer.observed]
    scale, scale_note = (
        _choose_scale(p, observed, fmt16, thresholds)
        if fmt16 is not None
        else (None, "no 16-bit format at this level: every layer in fp32")
    )
    fp8_ok = p.fp8_linear is not None and fp8_refusal(p) is None
    recipe = p.fp8_linear or "tensorwise"
    decisions: list[Decision] = []
    for layer in layers:
        level = level_expect(p, layer.module)[0].compute
        module = type(layer.module).__name__
        if not layer.observed:
            decisions.append(
                Decision(
                    layer.name,
                    module,
                    level,
                    level,
                    "not seen in the pre-flight (its forward did not run: its "
                    "parent uses its weights); the level's",
                )
            )
            continue
        if fmt16 is None:
            decisions.append(
                Decision(layer.name, module, "float32", level, f"{p.opt_level} computes in fp32")
            )
            continue
        fp8_why = None
        if fp8_ok:
            fp8_why = (
                fp8_ineligible(layer.module)
                or fp8_shape_refusal(layer.module, recipe)
                or _fp8_holds(layer, thresholds)
            )
            if fp8_why is None:
                decisions.append(
                    Decision(
                        layer.name,
                        module,
                        FP8,
                        level,
                        "fp8 holds its inputs, weights and output gradients "
                        "with per-tensor scaling, and its shape passes "
                        f"torchao's {recipe} rule",
                    )
                )
                continue
        half_why = _holds_16(layer, fmt16, scale, thresholds)
        name16 = dtype_name(half)
        if half_why is None:
            grads = layer.grads
            held = (
                f"{name16} holds its inputs, outputs and gradients (gradient underflow "
                f"{_pct(underflow_share(grads, fmt16, scale))} at loss scale "
                f"{_scale_text(scale)}, no overflow)"
            )
            decisions.append(
                Decision(
                    layer.name,
                    module,
                    name16,
                    level,
                    held + (f"; not fp8: {fp8_why}" if fp8_why else ""),
                )
            )
        else:
            decisions.append(
                Decision(
                    layer.name,
                    module,
                    "float32",
                    level,
                    half_why + (f"; not fp8: {fp8_why}" if fp8_why else ""),
                )
            )
    rules = _entries(decisions)
    return AutoPlan(
        decisions,
        rules,
        preset,
        dtype_name(half) if half else "float32",
        scale,
        scale_note,
        thresholds,
        steps,
    )


def _entries(decisions: Sequence[Decision]) -> list[LayerRule]:
    """An entry for each layer whose format differs from the level's, and for a layer inside one
    with an entry whose format differs from that entry's (a later entry wins), in module order."""
    rules: list[LayerRule] = []
    entered: dict[str, str] = {}  # name -> format, of the entries so far
    for d in decisions:
        outer = next(
            (f for n, f in reversed(list(entered.items())) if d.name.startswith(n + ".")), None
        )
        inherited = outer if outer is not None else d.level
        if d.format != inherited:
            d.entry = True
            entered[d.name] = d.format
            rules.append(LayerRule(exact_glob(d.name), d.format, AUTO, d.why))
    return rules


# ---- the pre-flight ------------------------------------------------------------------------------
def measure(
    trainer: Any,
    steps: int,
    folder: Path,
    inputs: bool = False,
    layers: Optional[Any] = None,
    echo: bool = True,
) -> list:
    """`steps` training steps of `trainer` (fp32: an O0 engine), every one diagnosed in every
    format (`inputs`: the layers' inputs too; `layers`: model -> the layers to probe, default
    the leaves with parameters); returns their layer records (scale 1: the gradients as an fp32
    run stores them)."""
    diagnostics = RunDiagnostics(
        1, list(diag.FORMATS.values()), folder, inputs=inputs, layers=layers
    )
    trainer.instruments = trainer.instrument(diagnostics, audit=False)  # (fp32: no audit)
    trainer.model.train()
    records = []
    for x, y in islice(iter(trainer.train_loader), steps):
        x, y = trainer._to_device(x, y)
        loss = trainer.train_step(x, y)
        trainer.global_step += 1
        records += diagnostics.last
        if echo:
            print(f"step {trainer.global_step}/{steps}: loss {float(loss):.4f}", flush=True)
        else:
            log.info(
                "layer plan pre-flight: step %d/%d, loss %.4f",
                trainer.global_step,
                steps,
                float(loss),
            )
    return records


def plan_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers a plan's pre-flight probes: every module that owns parameters, but the model."""
    return [(name, m) for name, m in param_layers(model) if name]


def weight_stats(model: nn.Module) -> dict[str, diag.TensorStats]:
    """Each layer's own weights' statistics (what fp8 casts to e4m3)."""
    out = {}
    for name, module in plan_layers(model):
        params = [p.detach() for p in module.parameters(recurse=False) if p.is_floating_point()]
        if params:
            out[name] = diag.tensor_stats(params, list(diag.FORMATS.values()))
    return out


def preflight(
    plan: Any, device: torch.device, steps: int, folder: Path, echo: bool = False
) -> tuple[list, nn.Module, dict[str, diag.TensorStats]]:
    """The run of `plan` built in fp32 (O0, no layer plan, nothing resumed), `steps` training
    steps with every layer probed; returns the records, the model and its layers' weight
    statistics (after the steps). Nothing is tracked."""
    from runner.run.build import build
    from runner.run.trainer import RunContext, Trainer, trainer_config

    measured = dataclasses.replace(
        plan, resolution=resolve("O0", device=device), resume=None, layer_rules=()
    )
    with contextlib.closing(build(measured, device, wait_for_kernels=False)) as parts:
        trainer = Trainer(
            trainer_config(plan.cfg.trainer),
            parts,
            RunContext(on_metrics=lambda metrics, step: None),
            device=device,
        )
        records = measure(trainer, steps, folder, inputs=True, layers=plan_layers, echo=echo)
        return records, parts.model, weight_stats(parts.model)


def planned(plan: Any, comm: Any, device: torch.device, output_dir: Optional[Path]) -> Any:
    """`plan` with `layer_plan=auto` made concrete: the pre-flight's entries (measured on rank 0,
    the same on every rank), then `precision.layers`' on top. A resumed run takes the entries its
    checkpoint was trained with instead of measuring again."""
    saved = plan.resume.state.get("layer_plan") if plan.resume is not None else None
    if saved is not None:
        rules = [LayerRule.from_list(r) for r in saved["rules"] if r[2] == AUTO]
        log.info("Layer plan: auto, as the checkpoint was trained (%d entries)", len(rules))
        text = ""
    else:
        cfg = plan.cfg
        steps = int(cfg.precision.layer_plan_steps)
        folder = (output_dir / "layers" / "preflight") if output_dir is not None else None

        def measure_and_decide() -> tuple[list[list[str]], str]:
            import tempfile

            where = folder or Path(tempfile.mkdtemp(prefix="amp-runner-preflight-"))
            where.mkdir(parents=True, exist_ok=True)
            log.info(
                "Layer plan: auto; a pre-flight of %d fp32 steps measures each layer's "
                "ranges first",
                steps,
            )
            records, model, weights = preflight(plan, device, steps, where)
            auto = decide(
                model,
                records,
                weights,
                plan.properties,
                Thresholds.from_config(cfg.precision),
                str(cfg.precision.preset),
                steps,
            )
            log.info("Layer plan (auto), %s:\n%s", auto.scale_note, auto.table())
            return [r.as_list() for r in auto.rules], auto.yaml()

        lists, text = comm.from_main(comm.on_main(measure_and_decide))
        rules = [LayerRule.from_list(r) for r in lists]
    return dataclasses.replace(
        plan, layer_rules=(*rules, *config_rules(plan.properties)), auto_plan=text
    )
