"""What ran where: the dtypes each layer of a model actually computed in during one training step.

A *layer* is a module that owns parameters itself (the unit of a layer plan). `DtypeAudit` hooks
each for one step and records, from its first call, the dtypes of its parameters, floating inputs
and outputs, whether it is one of torchao's float8 modules, and after the backward its gradients'
dtypes: metadata only, no device read. `AuditInstrument` compares audited steps of a run with the
layer plan; `write_csv` and `plot` render the comparison (`layers_ran.csv` and its figure).
README.md beside this file says more.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from runner.measure.diagnostics import _tensors_in
from runner.measure.instruments import ArtifactSink, Instrument, MetricsSink, output_folder
from runner.metrics import LAYERS_IN, LAYERS_OFF_PLAN

log = logging.getLogger(__name__)

ARTIFACT_DIR = "layers"
LAYERS_RAN_CSV, LAYERS_RAN_PNG = "layers_ran.csv", "layers_ran.png"
PLAN_YAML, PLAN_TXT = "layer_plan.yaml", "layer_plan.txt"
AUTO_PLAN_YAML = "auto_plan.yaml"  # layer_plan=auto: the pre-flight's choice for every layer
FIELDS = [
    "step",
    "layer",
    "module",
    "planned",
    "observed",
    "off_plan",
    "inputs",
    "weights",
    "outputs",
    "grads",
    "note",
    "why",
]


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_fp8_module(module: nn.Module) -> bool:
    """torchao's float8 training modules (Float8Linear and its kind), by their module."""
    return type(module).__module__.startswith("torchao.float8")


@dataclass
class Observation:
    """One layer as the audited step ran it."""

    layer: str  # qualified name ("" for the model itself)
    module: str  # class name
    fp8: bool  # one of torchao's float8 modules
    called: bool = False
    inputs: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)

    @property
    def computed(self) -> str:
        """What the layer computed in: fp8 for torchao's float8 modules, else its (first)
        floating output's type; "not called", or "none" for a layer without a floating output."""
        if not self.called:
            return "not called"
        if self.fp8:
            return "fp8"
        return self.outputs[0] if self.outputs else "none"


class DtypeAudit:
    """Forward hooks on `layers` ((name, module) pairs) for one step:

        audit = DtypeAudit(param_layers(model))
        with audit:                # hooks installed
            loss = criterion(model(x), y)
            loss.backward()
            audit.observe_grads()  # the layers' parameters' .grad, before the step
        observations = audit.read()

    Outside `with` the model holds no hook of the audit's."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]):
        self.layers = list(layers)
        self._obs = {
            name: Observation(name, type(m).__name__, is_fp8_module(m)) for name, m in self.layers
        }
        self._handles: list = []

    def __enter__(self) -> DtypeAudit:
        for name, module in self.layers:
            self._handles.append(module.register_forward_pre_hook(partial(self._weights, name)))
            self._handles.append(
                module.register_forward_hook(partial(self._hook, name), with_kwargs=True)
            )
        return self

    def _weights(self, name: str, module: nn.Module, args: tuple) -> None:
        """The weights as the forward uses them, read before it (a sharded unit gathers its
        parameters in its own earlier pre-hook and frees them in its forward hook)."""
        obs = self._obs[name]
        if not obs.weights:
            obs.weights = [
                dtype_label(p.dtype)
                for p in module.parameters(recurse=False)
                if p.is_floating_point()
            ]

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        obs = self._obs[name]
        if obs.called:  # the first call tells (a module called twice computes alike)
            return
        obs.called = True
        obs.inputs = [dtype_label(t.dtype) for t in _tensors_in((args, kwargs))]
        obs.outputs = [dtype_label(t.dtype) for t in _tensors_in(output)]

    def observe_grads(self) -> None:
        """The gradients' types, and the weights' of a layer whose forward was not called (its
        parent computed with them: an attention's out_proj)."""
        for name, module in self.layers:
            if not self._obs[name].called:
                self._weights(name, module, ())
            self._obs[name].grads = [
                dtype_label(p.grad.dtype) if p.grad is not None else "none"
                for p in module.parameters(recurse=False)
                if p.is_floating_point()
            ]

    def read(self) -> list[Observation]:
        return [self._obs[name] for name, _ in self.layers]


# ---- rendering -----------------------------------------------------------------------------------
def write_csv(
    path: Path, rows: Iterable[Mapping[str, Any]], step: int, append: bool = False
) -> Path:
    """The comparison rows (`LayerPlan.compare`) of the audited step `step` as `layers_ran.csv`
    (appended to an existing file with `append`)."""
    new = not (append and path.exists())
    with path.open("a" if not new else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({"step": step, **{k: row.get(k, "") for k in FIELDS if k != "step"}})
    return path


COLORS = {"float32": "#4C72B0", "bfloat16": "#55A868", "float16": "#DD8452", "fp8": "#C44E52"}
_OTHER = "#BBBBBB"


def _format(label: str) -> str:
    """A planned or observed label's format, its first word: `bfloat16 (autocast)` is bfloat16."""
    return label.split(" ", 1)[0]


def _color(label: str) -> str:
    return COLORS.get(_format(label), _OTHER)


def plot(path: Path, rows: Sequence[Mapping[str, Any]], title: str, max_rows: int = 400) -> Path:
    """One row per layer: the planned format beside the observed one, coloured by format, a
    layer that ran off plan marked and its two formats written out; at most `max_rows` layers
    (the off-plan ones first). Drawn in few calls (two bar sets; names, formats and notes as
    text, not ticks; no tight_layout): drawn row by row, DenseNet-161's 322 layers took 4 s
    here and 7 s on a GPU machine, inside the run's first step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = list(rows)
    if len(shown) > max_rows:
        off = [r for r in shown if r["off_plan"]]
        shown = (off + [r for r in shown if not r["off_plan"]])[:max_rows]
    n = max(len(shown), 1)
    labels = [f"{r['layer']} ({r['module']})" for r in reversed(shown)] or [""]
    height = 1.2 + 0.22 * n
    fig, ax = plt.subplots(figsize=(9, height))
    ys = [n - 1 - i for i in range(len(shown))]
    for left, key in ((0, "planned"), (1, "observed")):
        colors = [_color(str(r[key])) for r in shown]
        ax.barh(ys, 1, left=left, color=colors, edgecolor="white")
    for y, row in zip(ys, shown):
        if row["off_plan"]:
            ax.text(0.5, y, str(row["planned"]), ha="center", va="center", fontsize=7)
            ax.text(1.5, y, str(row["observed"]), ha="center", va="center", fontsize=7)
            ax.text(
                2.05,
                y,
                "off plan: " + str(row.get("note", "")),
                va="center",
                fontsize=7,
                color="#C44E52",
            )
    # the names as plain text, not tick labels: axis ticks cost about 5 ms each to draw
    for y, label in enumerate(labels):
        ax.text(-0.05, y, label, ha="right", va="center", fontsize=7)
    ax.set_yticks([])
    ax.set_xticks([0.5, 1.5])
    ax.set_xticklabels(["planned", "observed"])
    ax.set_xlim(0, 4.5)
    ax.set_ylim(-0.6, n - 0.4)
    for spine in ("top", "right", "bottom"):
        ax.spines[spine].set_visible(False)
    off = sum(1 for r in rows if r["off_plan"])
    fig.suptitle(f"{title}: {len(rows)} layers, {off} off plan", fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()] + [
        Patch(color=_OTHER, label="other / not called")
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper right", frameon=False)
    # the margins by hand: room on the left for the longest name (7-pt characters are about
    # 0.055 inch wide), half an inch below the axes and above them for the title
    left = min(0.7, (0.3 + 0.055 * max(len(s) for s in labels)) / 9)
    fig.subplots_adjust(left=left, right=0.98, bottom=0.5 / height, top=1 - 0.45 / height)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# A format's short name: runner.config.formats.SHORT_NAMES restated, as measure imports nothing
# else of the runner (a test holds the two equal).
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8"}


def counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many layers computed in each format (observed): fp32, bf16, fp16, fp8."""
    out = {s: 0 for s in SHORT_NAMES.values()}
    for row in rows:
        key = SHORT_NAMES.get(str(row["observed"]))
        if key is not None:
            out[key] += 1
    return out


def summary(rows: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """The off-plan layers as findings' text, one line each (None: every layer on plan)."""
    off = [r for r in rows if r["off_plan"]]
    if not off:
        return None
    return "\n".join(
        f"[warning] precision.layers: {r['layer']} ({r['module']}) ran off plan: "
        f"{r['note']} (planned {r['planned']} by {r['why']})"
        for r in off
    )


def worth_a_figure(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the figure shows more than the log line and the metrics say: some layer ran off
    plan, or the layers were planned or ran in more than one format (a layer not called counts
    as one; `bfloat16 (autocast)` is bfloat16, as the figure colours it). A run whose every
    layer ran as planned in one format (O0: all fp32; O1 bf16 on a small CNN: all bf16) gets
    none: two bars of one colour per layer, drawn in its first step (1 to 2 s with matplotlib's
    import, more for hundreds of layers), would say nothing more."""
    rows = list(rows)
    formats = {_format(str(r[key])) for r in rows for key in ("planned", "observed")}
    return any(r["off_plan"] for r in rows) or len(formats) > 1


# ---- inside a run --------------------------------------------------------------------------------


def never(step: int) -> bool:
    return False


class AuditInstrument(Instrument):
    """The layer audit of a run's steps against its layer `plan` (`LayerPlan`: its layers, its
    `compare` and `strict`): the run's first step (`first`; a compiled run audits an eager step
    instead) and every step `also` names (the diagnosed ones). Each audited step sends
    `layers_off_plan` and the layers per observed format to `on_metrics`, appends its rows to
    `layers_ran.csv` in `folder` (where `writes`: rank 0), draws the figure where it shows
    something (`worth_a_figure`) and hands the files to `on_artifact` (the session's first audit
    at once, later ones at their epoch's end), warns once per layer that ran off plan (to
    `logger`), and raises `error` for it when the plan is strict."""

    def __init__(
        self,
        plan: Any,
        module: nn.Module,
        on_metrics: MetricsSink,
        *,
        error: type[Exception],
        first: bool = True,
        also: Callable[[int], bool] = never,
        writes: bool = True,
        folder: Optional[Path] = None,
        on_artifact: Optional[ArtifactSink] = None,
        logger: logging.Logger = log,
    ):
        self.plan = plan
        self.module = module
        self.on_metrics = on_metrics
        self.error = error
        self.first = first
        self.also = also
        self.writes = writes
        self._folder = folder
        self.on_artifact = on_artifact
        self.log = logger
        self.audited = False  # some step was audited (the first step's audit is done)
        self._files = False  # layers_ran.csv was started by this instrument
        self._last: Optional[tuple[list, int]] = None  # (rows, step) not drawn and logged yet
        self._reported: set[str] = set()
        self._audit: Optional[DtypeAudit] = None

    def due(self, step: int) -> bool:
        return self.also(step) or (step == 1 and self.first and not self.audited)

    def audit(self) -> DtypeAudit:
        """A dtype audit of the plan's layers."""
        return DtypeAudit(
            [(layer.name, self.module.get_submodule(layer.name)) for layer in self.plan]
        )

    def start(self, step: int) -> None:
        self._audit = self.audit().__enter__()

    def after_backward(self, step: int) -> None:
        audit = self._audit
        audit.observe_grads()
        self.close()
        self.record(audit, step)

    def close(self) -> None:
        audit, self._audit = self._audit, None
        if audit is not None:
            audit.__exit__(None, None, None)

    def end_epoch(self) -> None:
        self.write()

    @property
    def folder(self) -> Path:
        self._folder = output_folder(self._folder, "amp-runner-layers-")
        return self._folder

    def record(self, audit: DtypeAudit, step: int) -> None:
        """Compare the audited step with the plan (see the class)."""
        first = not self._files
        self.audited = True
        rows = self.plan.compare(audit.read())
        off = [r for r in rows if r["off_plan"]]
        metrics = {LAYERS_OFF_PLAN: float(len(off))}
        metrics.update({f"{LAYERS_IN}{k}": float(v) for k, v in counts(rows).items()})
        self.on_metrics(metrics, step)
        if self.writes:
            write_csv(self.folder / LAYERS_RAN_CSV, rows, step, append=self._files)
            self._files = True
            self._last = (rows, step)
            if first:  # the figure now; later audits' at the end of their epoch
                self.write()
        new = [r for r in off if r["layer"] not in self._reported]
        self._reported.update(r["layer"] for r in new)
        if new:
            text = summary(new)
            if self.plan.strict:
                raise self.error(
                    f"{len(new)} layer(s) ran off plan at step {step} (precision.strict=true):\n"
                    f"{text}"
                )
            self.log.warning(
                "What ran where, step %d: %d layer(s) ran off plan:\n%s", step, len(new), text
            )
        elif first:
            self.log.info(
                "What ran where, step %d: every layer ran as planned (%s)",
                step,
                ", ".join(f"{v} {k}" for k, v in counts(rows).items() if v),
            )

    def write(self) -> None:
        """The figure of the latest audited step, then `layers_ran.csv` and the figure to the
        artifact sink (under `layers/`); nothing when no step was audited since the last call."""
        if self._last is None:
            return
        rows, step = self._last
        self._last = None
        folder = self.folder
        paths = [folder / LAYERS_RAN_CSV]
        if worth_a_figure(rows):
            paths.append(plot(folder / LAYERS_RAN_PNG, rows, f"What ran where at step {step}"))
        if self.on_artifact is not None:
            for path in paths:
                self.on_artifact(path, ARTIFACT_DIR)
