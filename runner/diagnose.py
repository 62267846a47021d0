"""`python -m runner.diagnose <overrides>`: a pre-flight of a run's numeric range, before choosing a
precision level.

It composes the config exactly as `python -m runner` does (same config tree, same overrides; a bad
override or value exits 2 with the message and no traceback, before anything is built), then
trains a few steps (`--steps`, default 3) of the configured model on the configured data in fp32
(O0, whatever `precision=` says: the point is to see the values before any format rounds them),
with the range probe of `runner.measure.diagnostics` on every step and the judging formats fp16,
bf16,
fp8 e4m3 (activations) and fp8 e5m2 (gradients). It prints:

- per format, the layers whose activations or gradients would underflow (at least 1% of their
  non-zero values below the format's smallest normal) or overflow (any value above its max), with
  the gradients unscaled (loss scale 1);
- the loss scale that keeps every gradient in fp16's range: the largest power of two S with
  max|g| * S < 2^15 (half of fp16's max 65504: one back-off of headroom), from the gradients'
  exponent histogram (the largest gradient is known to its power of two), capped at 2^24 (the
  dynamic scaler's ceiling), and the share of gradients that still underflow at S (exact: the
  histogram's bins and S are powers of two);
- a recommendation: the preset to try first and the layers to keep in fp32.

It writes `diagnostics/layers.csv`, `exponents.csv` and `grad_exponents.png` (also under `--out`)
and the printed text (`diagnostics/report.txt`) into an MLflow run tagged `diagnose` in the
configured store (`mlflow.tracking_uri`, `mlflow.experiment_name`), whose params are the config
with the precision properties actually used (O0); the level asked for is the tag
`diagnose.target_preset`. Exit 0 when the table was printed (whatever it says), 2 for bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from runner.config import options
from runner.errors import RunnerError

DEFAULT_STEPS = 3
HEADROOM_LOG2 = 15  # the recommended scale keeps every gradient below 2^15 = fp16 max / 2
MAX_SCALE_LOG2 = 24  # the dynamic loss scaler's default ceiling (precision.max_loss_scale)
NOTABLE_UNDERFLOW = 0.01  # a layer "underflows" when at least this share of its values does
REPORT_TXT = "report.txt"


# ---- analysis ------------------------------------------------------------------------------------
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
    advice: list[str] = []
    keep: list[str] = []
    if (
        grads is not None
        and (grads.infs or grads.nans)
        or acts is not None
        and (acts.infs or acts.nans)
    ):
        advice.append(
            "Even fp32 produced inf/NaN values in these steps: the model or the "
            "learning rate diverges whatever the precision; fix that first "
            "(a lower optimizer.lr, gradient clipping)."
        )
    if fp16.act_overflow:
        keep = list(fp16.act_overflow)
        tops = ", ".join(
            f"{n} (max |activation| >= 2^{_layer(layers, n).activation.max_log2})"
            for n in fp16.act_overflow[:6]
        )
        advice.append(
            f"fp16 OVERFLOWS in the forward pass: the activations of {tops} exceed fp16's max "
            "65504 and would become inf. Loss scaling cannot help (it scales gradients, not "
            "activations)."
        )
        preset = "o2_bf16"
        advice.append(
            "Try precision=o2_bf16 first (bfloat16 has fp32's range; precision=o1_bf16 if the "
            "model needs fp32 weights), on hardware with bf16 (a CPU, or a GPU of compute "
            f"capability 8.0 or newer). To stay in fp16, keep {_names(keep)} in fp32 (e.g. run "
            "them outside autocast under O1, or scale their inputs down)."
        )
    elif scale is not None and scale < 1:
        preset = "o2_bf16"
        keep = list(fp16.grad_overflow)
        advice.append(
            f"fp16 OVERFLOWS in the gradients even unscaled (in {_names(fp16.grad_overflow)}): "
            f"only a loss scale below 1 ({scale:g}) keeps them in range. Try precision=o2_bf16 "
            f"first, or precision=o2 precision.loss_scale={scale:g}."
        )
    elif under_at is not None and under_at >= NOTABLE_UNDERFLOW:
        preset = "o2_bf16"
        advice.append(
            f"The gradients span more than fp16's range: at the largest safe loss scale "
            f"({scale:g}) {_percent(under_at)} of them still underflow. Try precision=o2_bf16 "
            "first (bfloat16 keeps fp32's range; no loss scaling needed)."
        )
    else:
        preset = "o2"
        if fp16.grad_underflow:
            advice.append(
                f"fp16 needs loss scaling: unscaled, {_percent(_frac(grads, 'fp16'))} of the "
                f"gradients underflow (in {len(fp16.grad_underflow)} layers). At loss scale "
                f"{scale:g}, {_percent(under_at)} underflow and none overflows."
            )
        else:
            advice.append(
                "fp16 holds these gradients even unscaled (no layer underflows by 1% or more)."
            )
        advice.append(
            f"Try precision=o2 first (fp16 with fp32 masters and dynamic loss scaling: it "
            f"starts at 65536, and these gradients overflow above about {2 * scale:g}), or a "
            f"static precision.loss_scale={scale:g}; precision=o2_bf16 needs no scaling at all."
        )
        if device_type == "cpu":
            advice.append(
                "On a CPU fp16 is emulated and slow: there, precision=o2_bf16 is the "
                "practical choice."
            )
    if bf16.act_overflow or bf16.grad_overflow or bf16.grad_underflow:
        advice.append(
            "bf16 loses values too: overflow in "
            f"{_names(bf16.act_overflow + bf16.grad_overflow) or 'no layer'}, "
            f"gradient underflow in {_names(bf16.grad_underflow) or 'no layer'}."
        )
    else:
        advice.append("bf16: no layer's activations or gradients under- or overflow.")
    advice.append(
        f"fp8 (no runner preset; it needs per-tensor scaling): e4m3 activations overflow in "
        f"{len(fp8.act_overflow)} and underflow in {len(fp8.act_underflow)} layers, e5m2 "
        f"gradients overflow in {len(fp8.grad_overflow)} and underflow in "
        f"{len(fp8.grad_underflow)} layers (of {len(layers)}), unscaled."
    )
    return Preflight(layers, steps, judgements, grads, acts, scale, under_at, preset, keep, advice)


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
        head = (
            f"  {'layer':<{width}}  {'module':<12}  {'act under':>9}  {'act over':>9}  "
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
                f"  {layer.name:<{width}}  {layer.module:<12}  {cells[0]:>9}  "
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


# ---- measuring -----------------------------------------------------------------------------------
def measure(trainer, steps: int, folder: Path, inputs: bool = False, layers=None) -> list:
    """`steps` training steps of `trainer` (fp32: an O0 engine), every one diagnosed in every
    format; returns their layer records (runner.run.autoplan.measure)."""
    from runner.run.autoplan import measure as measure_steps

    return measure_steps(trainer, steps, folder, inputs=inputs, layers=layers)


def preflight(
    trainer, steps: int, folder: Path, title: str, device_type: str = "cpu", for_plan: bool = False
) -> tuple[Preflight, str, list[Path]]:
    """Measure, analyse, render, and write the artifacts into `folder` (the layers and
    exponents CSV files, the figure with the recommended loss scale outlined, the text).
    `for_plan`: probe every layer of a layer plan (every module that owns parameters) and their
    inputs (the records are kept in the result)."""
    from runner.measure.diagnostics import FIGURE_PNG, FORMATS, GRADIENT_KINDS, plot_exponents
    from runner.run.autoplan import plan_layers

    records = measure(
        trainer, steps, folder, inputs=for_plan, layers=plan_layers if for_plan else None
    )
    result = analyse([r for r in records if r.kind != "input"], steps, device_type)
    result.records = records
    text = render(result, title)
    figure = plot_exponents(
        [r for r in records if r.kind in GRADIENT_KINDS],
        list(FORMATS.values()),
        folder / FIGURE_PNG,
        f"Gradient exponents over {steps} fp32 steps (unscaled)",
        loss_scale=result.loss_scale,
    )
    (folder / REPORT_TXT).write_text(text)
    paths = [folder / "layers.csv", folder / "exponents.csv", figure, folder / REPORT_TXT]
    return result, text, paths


# ---- the command ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runner.diagnose",
        description="Pre-flight of a run's numeric range: a few fp32 training steps of the "
        "configured model and data, then, per layer, what fp16, bf16 and fp8 would lose "
        "(underflow, overflow), the fp16 loss scale that keeps the gradients in range, and "
        "which preset to try first. Takes the same overrides as python -m runner.",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"fp32 training steps to observe (default {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("diagnostics"),
        help="folder for the CSV files, the figure and the text (default ./diagnostics)",
    )
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        metavar="PLAN.yaml",
        help="also write a layer plan for the asked level (precision=...): each "
        "layer's narrowest format whose range holds its values, and why; run it "
        "with precision.layer_plan=PLAN.yaml",
    )
    parser.add_argument(
        "--max-underflow",
        type=float,
        default=None,
        metavar="SHARE",
        help="--plan: the share of a layer's gradients a format may lose to "
        "underflow (default precision.layer_plan_max_underflow, 0.01)",
    )
    parser.add_argument(
        "--max-overflow",
        type=float,
        default=None,
        metavar="SHARE",
        help="--plan: the share of a layer's values a format may lose to overflow "
        "(default precision.layer_plan_max_overflow, 0)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, as for python -m runner (e.g. model=resnet18 data=synthetic)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    for flag in ("max_underflow", "max_overflow"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a share in [0, 1)")
    return args


def compose(overrides: Sequence[str]):
    """The run's config, composed as `python -m runner` composes it; a bad override raises
    RunnerError with Hydra's message."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import runner.config  # noqa: F401  (registers the schemas)
    from runner.config.finder import config_dir

    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        cause = f": {error.__cause__}" if error.__cause__ else ""
        raise RunnerError(f"{error}{cause}") from error


def run(
    cfg,
    overrides: Sequence[str],
    steps: int,
    out: Path,
    plan_path: Optional[Path] = None,
    max_underflow: Optional[float] = None,
    max_overflow: Optional[float] = None,
) -> Preflight:
    """The pre-flight of `cfg`: checked like a run (ConfigError before anything is built), then
    measured in fp32 in an MLflow run tagged `diagnose`; with `plan_path`, a layer plan for the
    asked level is written there too (runner.run.autoplan)."""
    import contextlib
    import dataclasses

    from runner.precision import resolve
    from runner.run import app
    from runner.run.plan import make_plan
    from runner.run.trainer import RunContext
    from runner.tracking import tags as tag
    from runner.tracking.lifecycle import Tracker

    plan = make_plan(cfg)  # the run as asked for must be valid
    device = plan.device
    fp32 = resolve("O0", device=device)
    tracker = Tracker.from_config(cfg.mlflow)
    # the same run, in fp32 (no layer plan)
    measured = dataclasses.replace(plan, resolution=fp32, resume=None, layer_rules=())
    with contextlib.closing(app.build(measured)) as parts:  # its workers end with it
        target = str(cfg.precision.preset)
        params = app.config_params(measured)
        params["diagnose.steps"] = str(steps)
        tags = app.environment_tags(device)
        tags.update(
            {
                tag.DIAGNOSE: "true",
                tag.DIAGNOSE_TARGET: target,
                tag.OVERRIDES: " ".join(overrides),
                tag.COMMAND: " ".join(["python -m runner.diagnose", *sys.argv[1:]]),
            }
        )
        tags.update({str(k): str(v) for k, v in cfg.mlflow.tags.items()})
        name = cfg.mlflow.run_name or f"{options.label(cfg.model)}-diagnose"
        out.mkdir(parents=True, exist_ok=True)
        with tracker.start_run(name, params, tags) as tracked:
            trainer = parts.trainer(cfg.trainer, device, RunContext(on_metrics=tracked.log_metrics))
            title = (
                f"Range pre-flight: {options.label(cfg.model)} on "
                f"{options.label(cfg.data)}, batch {cfg.trainer.batch_size}, {steps} fp32 "
                f"training steps on {device.type} (asked for precision={target})"
            )
            result, text, paths = preflight(
                trainer, steps, out, title, device.type, for_plan=plan_path is not None
            )
            print()
            print(text, end="")
            if plan_path is not None:
                paths.append(
                    write_plan(
                        plan,
                        parts.model,
                        result.records,
                        steps,
                        plan_path,
                        max_underflow,
                        max_overflow,
                    )
                )
            underflow = result.underflow_at_scale
            summary = {
                "diagnose_fp16_loss_scale": result.loss_scale or math.nan,
                "diagnose_fp16_grad_underflow_frac_at_scale": math.nan
                if underflow is None
                else underflow,
            }
            if trainer.memory_parts is not None:
                summary.update(trainer.memory_parts.metrics())
            tracked.log_metrics(summary, steps)
            tracked.set_tag(tag.DIAGNOSE_RECOMMENDED, result.preset)
            tracked.set_tag(tag.DIAGNOSE_KEEP_FP32, ", ".join(result.keep_fp32) or "none")
            for path in paths:
                tracked.log_file(path, "diagnostics")
        print(
            f"\nWrote {', '.join(str(p) for p in paths)}; logged them on MLflow run {name!r} "
            f"({tracked.run_id}).\n{tracker.hint()}"
        )
    return result


def write_plan(
    plan,
    model,
    records,
    steps: int,
    path: Path,
    max_underflow: Optional[float],
    max_overflow: Optional[float],
) -> Path:
    """Decide the layer plan of the asked level from the pre-flight's records, print it and write
    it (a plan file) to `path`."""
    from runner.run import autoplan

    node = plan.cfg.precision
    thresholds = autoplan.Thresholds(
        node.layer_plan_max_underflow if max_underflow is None else max_underflow,
        node.layer_plan_max_overflow if max_overflow is None else max_overflow,
    )
    preset = str(node.preset)
    auto = autoplan.decide(
        model, records, autoplan.weight_stats(model), plan.properties, thresholds, preset, steps
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(auto.yaml())
    counts = ", ".join(f"{n} {fmt}" for fmt, n in auto.counts().items())
    print(
        f"\nLayer plan for precision={preset} ({counts}; {len(auto.rules)} entries differ "
        f"from the level); {auto.scale_note}:\n{auto.table()}\n"
    )
    print(
        f"Wrote the plan to {path}; train with it: python -m runner precision={preset} "
        f"precision.layer_plan={path} ..."
    )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = compose(args.overrides)
        run(
            cfg,
            args.overrides,
            args.steps,
            args.out,
            args.plan,
            args.max_underflow,
            args.max_overflow,
        )
    except RunnerError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
