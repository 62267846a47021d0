"""Range diagnostics inside a run (`trainer.diagnose_every_n_steps`): the diagnosed steps' rows in
`layers.csv` and `exponents.csv`, the gradient-exponent figure, and the instrument that probes
the diagnosed steps of a training loop (`RangeInstrument`)."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

from torch import nn

from runner.measure.diagnostics import (
    ACTIVATION_GRAD,
    LOG2_MAX,
    LOG2_MIN,
    WEIGHT_GRAD,
    Format,
    LayerRecord,
    RangeProbe,
    model_metrics,
    total,
)
from runner.measure.instruments import ArtifactSink, Instrument, MetricsSink, output_folder

ARTIFACT_DIR = "diagnostics"
LAYERS_CSV, EXPONENTS_CSV, FIGURE_PNG = "layers.csv", "exponents.csv", "grad_exponents.png"


# ---- writers -------------------------------------------------------------------------------------
def layer_fields(formats: Sequence[Format]) -> list[str]:
    fields = [
        "step",
        "loss_scale",
        "layer",
        "module",
        "kind",
        "judged_at_scale",
        "elements",
        "zeros",
        "nonzero",
        "infs",
        "nans",
        "min_log2",
        "max_log2",
    ]
    for f in formats:
        fields += [f"{f.name}_underflow_frac", f"{f.name}_overflow_frac"]
    return fields


def layer_row(record: LayerRecord, formats: Sequence[Format], loss_scale: float) -> dict:
    s = record.stats
    row = {
        "step": record.step,
        "loss_scale": loss_scale,
        "layer": record.layer,
        "module": record.module,
        "kind": record.kind,
        "judged_at_scale": s.scale,
        "elements": s.count,
        "zeros": s.zeros,
        "nonzero": s.nonzero,
        "infs": s.infs,
        "nans": s.nans,
        "min_log2": s.min_log2,
        "max_log2": s.max_log2,
    }
    for f in formats:
        row[f"{f.name}_underflow_frac"] = s.underflow_frac(f.name)
        row[f"{f.name}_overflow_frac"] = s.overflow_frac(f.name)
    return row


EXPONENT_FIELDS = ["step", "layer", "kind", "log2_bin", "count"]


def exponent_rows(records: Sequence[LayerRecord]) -> list[dict]:
    """The histograms, long form, non-empty bins only (`log2_bin` k: 2^k <= |x| < 2^(k+1); the
    special bins are `zero`, `<-126`, `inf` and `nan`)."""
    return [
        {"step": r.step, "layer": r.layer, "kind": r.kind, "log2_bin": label, "count": n}
        for r in records
        for label, n in r.stats.histogram()
        if n
    ]


def _append_csv(path: Path, fields: Sequence[str], rows: Iterable[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def plot_exponents(
    records: Sequence[LayerRecord],
    formats: Sequence[Format],
    path: Path,
    title: str,
    loss_scale: Optional[float] = None,
) -> Path:
    """Micikevicius et al. (2018), Fig. 3: the histogram of log2|gradient| over all layers
    (activation and weight gradients), with the first format's range shaded (normal range
    green, subnormals yellow, values that become zero red) and the other formats' limits as
    lines. `loss_scale`: also outline the first format's range shifted by that scale, i.e. the
    unscaled values that the format holds once the loss is scaled by it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 5))
    drawn, lo, hi = _draw_histograms(ax, records)
    if formats:
        _draw_first_range(ax, formats[0], lo, hi, loss_scale)
        _draw_other_limits(ax, formats[1:], lo, hi)
    ax.set_xlim(lo, hi)
    if drawn:
        ax.set_yscale("log")
    else:
        ax.text(
            0.5,
            0.5,
            "no finite non-zero gradient (see the legend)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("% of values")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_histograms(ax: Any, records: Sequence[LayerRecord]) -> tuple[bool, float, float]:
    """The activation and the weight gradients' log2|value| histograms, as bars in % of each
    kind's values (zeros, infs and NaNs told in the legend): (whether any bar was drawn, the
    x range that shows them)."""
    lows, highs = [-30], [20]
    drawn = False
    for kind, label, color in (
        (ACTIVATION_GRAD, "activation gradients", "tab:blue"),
        (WEIGHT_GRAD, "weight gradients", "tab:orange"),
    ):
        stats = total(r.stats for r in records if r.kind == kind)
        if stats is None or not stats.count:
            continue
        xs = [LOG2_MIN + i for i, c in enumerate(stats.bins) if c]
        ys = [100 * c / stats.count for c in stats.bins if c]
        if stats.below:
            xs, ys = [LOG2_MIN - 1, *xs], [100 * stats.below / stats.count, *ys]
        if xs:
            lows.append(min(xs) - 2)
            highs.append(max(xs) + 2)
        special = "".join(
            f"; {name} {100 * n / stats.count:.1f}%"
            for name, n in (("zeros", stats.zeros), ("inf", stats.infs), ("NaN", stats.nans))
            if n
        )
        ax.bar(
            [x + 0.5 for x in xs],
            ys,
            width=0.9,
            alpha=0.6,
            color=color,
            label=f"{label} ({stats.count:,} values{special})",
        )
        drawn = drawn or bool(xs)
    return drawn, max(min(lows), LOG2_MIN - 2), min(max(highs), LOG2_MAX + 2)


def _draw_first_range(
    ax: Any, f: Format, lo: float, hi: float, loss_scale: Optional[float]
) -> None:
    """The first format's range shaded: lost below its smallest subnormal (red), subnormal
    (yellow), normal (green), overflow (red); at `loss_scale`, its range shifted by the scale
    outlined (the unscaled values it holds)."""
    sub, tiny, top = math.log2(f.min_subnormal), math.log2(f.tiny), math.log2(f.max)
    ax.axvspan(
        lo,
        sub,
        color="tab:red",
        alpha=0.10,
        label=f"below {f.name}'s smallest subnormal: lost (0 or 2^{sub:.0f})",
    )
    ax.axvspan(sub, tiny, color="gold", alpha=0.20, label=f"{f.name} subnormal")
    ax.axvspan(tiny, min(top, hi), color="tab:green", alpha=0.10, label=f"{f.name} normal range")
    if top < hi:
        ax.axvspan(top, hi, color="tab:red", alpha=0.20, label=f"overflow in {f.name}")
    if loss_scale:
        shift = math.log2(loss_scale)
        ax.axvspan(
            sub - shift,
            top - shift,
            fill=False,
            hatch="//",
            edgecolor="tab:green",
            label=f"{f.name} range at loss scale {loss_scale:g} (unscaled values)",
        )


def _draw_other_limits(ax: Any, others: Sequence[Format], lo: float, hi: float) -> None:
    """The other formats' smallest normal and largest values as lines, one style each."""
    styles = ["--", ":", "-."]
    for g, style in zip(others, styles):
        for value in (math.log2(g.tiny), math.log2(g.max)):
            if lo <= value <= hi:
                ax.axvline(value, color="0.3", linestyle=style, linewidth=1)
        ax.plot([], [], color="0.3", linestyle=style, label=f"{g.name} tiny / max")


# ---- diagnostics inside a run --------------------------------------------------------------------


class RunDiagnostics:
    """`trainer.diagnose_every_n_steps` inside a run: a probe for the diagnosed steps (step 1 and
    every n-th step after it), their records appended to `layers.csv` and `exponents.csv` in
    `folder` as they come, and the figure of the latest diagnosed step; `write()` draws the figure
    and hands the files to `on_artifact` (under `diagnostics/`)."""

    def __init__(
        self,
        every: int,
        formats: Sequence[Format],
        folder: Optional[Path] = None,
        on_artifact: Optional[ArtifactSink] = None,
        inputs: bool = False,
        layers: Optional[Callable[[nn.Module], Sequence[tuple[str, nn.Module]]]] = None,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.formats = list(formats)
        self.inputs = inputs  # probe the layers' inputs too (a layer plan's pre-flight)
        self.layers = layers  # which layers (default: layers_of)
        self._folder = Path(folder) if folder is not None else None
        self.on_artifact = on_artifact
        self.last: list[LayerRecord] = []
        self._last_loss_scale = 1.0
        self._dirty = False
        self._fresh = True  # the folder's CSV files are this object's own from the first collect

    @property
    def folder(self) -> Path:
        self._folder = output_folder(self._folder, "amp-runner-diagnostics-")
        return self._folder

    def due(self, step: int) -> bool:
        """Whether (1-based) training step `step` is diagnosed: 1, 1 + n, 1 + 2n, ..."""
        return (step - 1) % self.every == 0

    def probe(self, model: nn.Module) -> RangeProbe:
        return RangeProbe(
            model,
            self.formats,
            inputs=self.inputs,
            layers=self.layers(model) if self.layers is not None else None,
        )

    def collect(self, probe: RangeProbe, step: int, loss_scale: float) -> list[LayerRecord]:
        """Read the probe (one host sync) and append its records to the CSV files."""
        records = probe.read(step)
        folder = self.folder
        if self._fresh:  # never append to the files of an earlier run in the same folder
            for name in (LAYERS_CSV, EXPONENTS_CSV):
                (folder / name).unlink(missing_ok=True)
            self._fresh = False
        _append_csv(
            folder / LAYERS_CSV,
            layer_fields(self.formats),
            (layer_row(r, self.formats, loss_scale) for r in records),
        )
        _append_csv(folder / EXPONENTS_CSV, EXPONENT_FIELDS, exponent_rows(records))
        self.last, self._last_loss_scale, self._dirty = records, loss_scale, True
        return records

    def metrics(self, records: Sequence[LayerRecord]) -> dict[str, float]:
        """The `diag_*` metrics in the run's (first) format."""
        return model_metrics(records, self.formats[0])

    def write(self) -> list[Path]:
        """The figure of the latest diagnosed step, then every file to `on_artifact`; nothing
        when no step was diagnosed since the last call."""
        if not self._dirty:
            return []
        self._dirty = False
        folder = self.folder
        step = self.last[0].step if self.last else 0
        figure = plot_exponents(
            self.last,
            self.formats,
            folder / FIGURE_PNG,
            f"Gradient exponents at step {step}, as stored (loss scale "
            f"{self._last_loss_scale:g} included)",
        )
        paths = [folder / LAYERS_CSV, folder / EXPONENTS_CSV, figure]
        if self.on_artifact is not None:
            for path in paths:
                self.on_artifact(path, ARTIFACT_DIR)
        return paths


class RangeInstrument(Instrument):
    """The range probe on the diagnosed steps of a training loop: its hooks on `module`'s layers
    from before the forward to after the backward (other steps carry none), then the probe read
    once (one host sync), its rows appended to the CSV files and its `diag_*` metrics sent to
    `on_metrics` at the step; at an epoch's end the figure and files go to the artifact sink.
    `engine`: its `loss_scale` is written beside the rows."""

    def __init__(
        self, diagnostics: RunDiagnostics, module: nn.Module, engine: Any, on_metrics: MetricsSink
    ):
        self.diagnostics = diagnostics
        self.module = module
        self.engine = engine
        self.on_metrics = on_metrics
        self._probe: Optional[RangeProbe] = None

    def due(self, step: int) -> bool:
        return self.diagnostics.due(step)

    def start(self, step: int) -> None:
        self._probe = self.diagnostics.probe(self.module)
        self._probe.__enter__()

    def after_backward(self, step: int) -> None:
        probe = self._probe
        probe.observe_weight_grads()  # as stored: scaled by the loss scale
        self.close()
        records = self.diagnostics.collect(probe, step, self.engine.loss_scale)
        self.on_metrics(self.diagnostics.metrics(records), step)

    def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.__exit__(None, None, None)

    def end_epoch(self) -> None:
        self.diagnostics.write()
