"""`precision.layer_plan=auto` and `python -m runner.diagnose ... --plan plan.yaml`: a layer plan
from measured ranges. The pre-flight (`preflight`, `measure`: the run's own model and data trained
a few steps in fp32 with every layer probed), each layer's choice from what it measured (`decide`:
fp8, else the level's 16-bit type, else float32; the shares it judges by: runner.run.layer_ranges),
and the entries the run's plan is made with (`entries`). The rules in full: autoplan.md beside
this file."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from runner import shell
from runner.measure import diagnostics as diag
from runner.measure.instruments import output_folder
from runner.measure.run_diagnostics import RunDiagnostics
from runner.precision import Properties
from runner.precision.layers import (
    AUTO,
    FP8,
    LayerRule,
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
from runner.run import watch
from runner.run.layer_ranges import (
    Thresholds,
    choose_scale,
    fp8_holds,
    fp8_shape_refusal,
    holds_16,
    pct,
    ranges,
    scale_text,
    underflow_share,
)

log = logging.getLogger(__name__)


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
            f"a format holds a layer when at most {pct(self.thresholds.max_underflow)} of "
            f"its gradients underflow and at most {pct(self.thresholds.max_overflow)} of "
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


def decide(
    model: nn.Module,
    records: Sequence[diag.LayerRecord],
    weights: Mapping[str, diag.TensorStats],
    p: Properties,
    thresholds: Optional[Thresholds] = None,
    preset: str = "",
    steps: int = 0,
) -> AutoPlan:
    """Each layer's format from the pre-flight's records (the rules: autoplan.md beside this
    file); `thresholds`: the shares a format may lose (default: `Thresholds()`)."""
    thresholds = thresholds if thresholds is not None else Thresholds()
    layers = ranges(model, records, weights)
    half = level_half(p)
    fmt16 = diag.FP16 if half == torch.float16 else diag.BF16 if half == torch.bfloat16 else None
    observed = [layer for layer in layers if layer.observed]
    scale, scale_note = (
        choose_scale(p, observed, fmt16, thresholds)
        if fmt16 is not None
        else (None, "no 16-bit format at this level: every layer in fp32")
    )
    judge = _Judge(p, fmt16, half, scale, thresholds)
    decisions: list[Decision] = []
    for layer in layers:
        decisions.append(judge.decision(layer, decisions))
    return AutoPlan(
        decisions,
        _entries(decisions),
        preset,
        dtype_name(half) if half else "float32",
        scale,
        scale_note,
        thresholds,
        steps,
    )


@dataclass
class _Judge:
    """What decides a layer's format: the level (`p`), its 16-bit format (`fmt16`, `half`: None
    at a level without one), the loss scale the gradients are judged at, the thresholds."""

    p: Properties
    fmt16: Any
    half: Optional[torch.dtype]
    scale: Optional[float]
    thresholds: Thresholds

    def decision(self, layer: Any, before: Sequence[Decision]) -> Decision:
        """`layer`'s format and why: the parent's where the pre-flight did not see it (the
        decisions `before` it hold its parent's), fp32 at a level computing in fp32, else fp8
        where it holds, else the level's 16-bit format where it holds, else fp32."""
        p = self.p
        level = level_expect(p, layer.module)[0].compute
        module = type(layer.module).__name__
        if not layer.observed:
            # its parent computes with its weights (an attention's out_proj): its parent's
            # format, which is what it runs in (a plan that split the two is refused)
            around = next(
                (d for d in reversed(before) if layer.name.startswith(d.name + ".")), None
            )
            why = "not seen in the pre-flight (its forward did not run: its parent uses its "
            why += "weights); " + (
                f"{around.name}'s, the layer around it" if around else "the level's"
            )
            return Decision(layer.name, module, around.format if around else level, level, why)
        if self.fmt16 is None:
            return Decision(layer.name, module, "float32", level, f"{p.opt_level} computes in fp32")
        fp8_why = self._fp8_refusal(layer)
        if fp8_why is None:
            recipe = p.fp8_linear or "tensorwise"
            why = "fp8 holds its inputs, weights and output gradients with per-tensor scaling, "
            why += f"and its shape passes torchao's {recipe} rule"
            return Decision(layer.name, module, FP8, level, why)
        not_fp8 = f"; not fp8: {fp8_why}" if fp8_why != _NO_FP8 else ""
        half_why = holds_16(layer, self.fmt16, self.scale, self.thresholds)
        if half_why is not None:
            return Decision(layer.name, module, "float32", level, half_why + not_fp8)
        held = (
            f"{dtype_name(self.half)} holds its inputs, outputs and gradients (gradient underflow "
            f"{pct(underflow_share(layer.grads, self.fmt16, self.scale))} at loss scale "
            f"{scale_text(self.scale)}, no overflow)"
        )
        return Decision(layer.name, module, dtype_name(self.half), level, held + not_fp8)

    def _fp8_refusal(self, layer: Any) -> Optional[str]:
        """Why `layer` does not run in fp8 (None: it does); `_NO_FP8` where the level has no
        fp8 (nothing to say about it)."""
        p = self.p
        if p.fp8_linear is None or fp8_refusal(p) is not None:
            return _NO_FP8
        return (
            fp8_ineligible(layer.module)
            or fp8_shape_refusal(layer.module, p.fp8_linear or "tensorwise")
            or fp8_holds(layer, self.thresholds)
        )


_NO_FP8 = ""  # (a level without fp8: no layer's reason names it)


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
    run stores them). A step is the run's: with `trainer.accumulate_grad_batches` k, k batches,
    the first observed, its gradients those of its loss divided by k as the run's are (k times
    smaller than one batch's alone, so k times nearer underflow)."""
    diagnostics = RunDiagnostics(
        1, list(diag.FORMATS.values()), folder, inputs=inputs, layers=layers
    )
    trainer.instruments = watch.instruments(trainer, diagnostics, audit=False)  # (fp32: no audit)
    trainer.model.train()
    records = []
    batches, k = iter(trainer.train_loader), trainer.cfg.accumulate_grad_batches
    for _ in range(steps):
        group = [trainer.to_device(x, y) for x, y in islice(batches, k)]
        if not group:
            break
        loss = trainer.train_step(*group[0], *group[1:])
        trainer.global_step += 1
        records += diagnostics.last
        if echo:
            shell.say(f"step {trainer.global_step}/{steps}: loss {float(loss):.4f}")
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
    from runner.run.trainer import Trainer

    with contextlib.closing(build(plan.in_fp32(device), device, wait_for_kernels=False)) as parts:
        trainer = Trainer(plan.cfg.trainer, parts, device=device)
        records = measure(trainer, steps, folder, inputs=True, layers=plan_layers, echo=echo)
        return records, parts.model, weight_stats(parts.model)


def entries(
    plan: Any, comm: Any, device: torch.device, output_dir: Optional[Path]
) -> tuple[tuple[LayerRule, ...], str]:
    """The entries `layer_plan=auto` makes for the run of `plan` (planned from its config, before
    them), and the plan file with every layer's choice: the pre-flight's (measured on rank 0, the
    same on every rank). A resumed run takes the entries its checkpoint was trained with instead
    of measuring again (and no file). The run's plan is then made with them
    (runner.run.plan.Measured), `precision.layers`' entries on top."""
    saved = plan.resume.state.get("layer_plan") if plan.resume is not None else None
    if saved is not None:
        rules = [LayerRule.from_list(r) for r in saved["rules"] if r[2] == AUTO]
        log.info("Layer plan: auto, as the checkpoint was trained (%d entries)", len(rules))
        return tuple(rules), ""
    folder = (output_dir / "layers" / "preflight") if output_dir is not None else None
    lists, text = comm.from_main(comm.on_main(partial(_measure_and_decide, plan, device, folder)))
    return tuple(LayerRule.from_list(r) for r in lists), text


def _measure_and_decide(
    plan: Any, device: torch.device, folder: Optional[Path]
) -> tuple[list[list[str]], str]:
    """The pre-flight of `plan` and the plan `decide` makes of it: (its entries as lists, the
    plan file)."""
    cfg = plan.cfg
    steps = int(cfg.precision.layer_plan_steps)
    where = output_folder(folder, "amp-runner-preflight-")
    log.info(
        "Layer plan: auto; a pre-flight of %d fp32 steps measures each layer's ranges first", steps
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
