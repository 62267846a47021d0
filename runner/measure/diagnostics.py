"""Range diagnostics: where a 16-bit (or 8-bit) format loses the values a training step produces.

Mixed precision rests on two measured facts: gradients below fp16's range vanish unless the loss is
scaled, and forward values above its range become inf. This module measures both, per layer, on a
chosen training step, as base-2 exponent histograms and as the fraction of values each format
would lose.

**What is observed.** A *layer* is a module that owns parameters and has no child modules (a
convolution, a BatchNorm, a linear layer; parameterless modules such as ReLU or pooling only pass
values on and are not observed); a probe given its layers observes those instead (a layer plan's:
every module that owns parameters itself). Per layer and step, three kinds of values (four with
`inputs=True`: `input`, the layer's floating positional inputs, which a layer plan casts):
  `activation`       the layer's output in the forward pass (a forward hook);
  `activation_grad`  the gradient flowing back into that output (a tensor hook on it);
  `weight_grad`      the gradients of the layer's own parameters (their `.grad` after backward).

**Which values are scaled.** Gradients are observed as the backward produces and stores them: a
run with loss scale S backpropagates `S * loss`, so its gradients are already multiplied by S.
Activations are never scaled. A `RangeProbe(scale=S)` treats every observed value x as standing
for `x * S` in the format, which is how the pre-flight (`runner.diagnose`, an fp32 run with
unscaled gradients) asks "what at loss scale S?"; inside a run the probe's scale is 1, because the
stored gradients already carry the run's loss scale.

**Definitions.** For a format with smallest normal `tiny`, smallest subnormal `min_sub` and
largest finite `max` (`torch.finfo`), a value x at scale S
  underflows when  0 < |x * S| < tiny   (it becomes subnormal, losing precision, or zero when it
                                          is below min_sub / 2),
  overflows  when  |x * S| > max        (inf included; a value just above max that round-to-
                                          nearest would still take to max counts as overflow).
Fractions are over the observed *non-zero, non-NaN* values (zeros cannot underflow; NaN is counted
in its own bin). The thresholds tiny/S and max/S are compared in fp32, so they are exact for a
power-of-two S (every dynamic loss scale) and within one fp32 rounding otherwise.

**In-run versus pre-flight.** Values observed inside a 16-bit run are already rounded to that
format: the in-run figures show what the format *kept* (a gradient that underflowed to zero is a
zero, no longer an underflow; an overflow shows as inf). The pre-flight observes an fp32 run and
shows what each format *would lose*.

**Exponent histogram.** A value's bin is floor(log2|x|) read from its fp32 exponent bits: 254
bins for 2^-126 <= |x| < 2^128, plus explicit bins for zero, for non-zero values below 2^-126 (fp32
subnormals: below bf16's range too), for inf and for NaN, so a histogram sums to the number of
elements observed. Counting runs on the tensors' device into per-layer accumulators, with no
host sync per layer; `RangeProbe.read()` moves all of them to the host in one transfer.

fp8: activations are judged in e4m3 (max 448, tiny 2^-6) and gradients in e5m2 (max 57344, tiny
2^-14), the usual split (`torch.float8_e4m3fn`, `torch.float8_e5m2`).
"""

from __future__ import annotations

import csv
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import torch
from torch import nn

ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD = "activation", "activation_grad", "weight_grad"
INPUT = "input"  # a layer's floating inputs (only a probe made with inputs=True: a layer plan's)
KINDS = (INPUT, ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD)
GRADIENT_KINDS = (ACTIVATION_GRAD, WEIGHT_GRAD)

LOG2_MIN, LOG2_MAX = -126, 127  # the normal fp32 exponents: one bin each
_EXPONENT_BINS = 256  # fp32 biased exponents 0..255: 0 is zero/subnormal, 255 inf/NaN
_INF_BITS = 0x7F800000

ARTIFACT_DIR = "diagnostics"
LAYERS_CSV, EXPONENTS_CSV, FIGURE_PNG = "layers.csv", "exponents.csv", "grad_exponents.png"


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
    for prefix, stats in (("diag_grad", grads), ("diag_act", acts)):
        if stats is not None:
            out[f"{prefix}_underflow_frac"] = stats.underflow_frac(fmt.name)
            out[f"{prefix}_overflow_frac"] = stats.overflow_frac(fmt.name)
    return out


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
    lo, hi = max(min(lows), LOG2_MIN - 2), min(max(highs), LOG2_MAX + 2)
    if formats:
        f = formats[0]
        sub, tiny, top = math.log2(f.min_subnormal), math.log2(f.tiny), math.log2(f.max)
        ax.axvspan(
            lo,
            sub,
            color="tab:red",
            alpha=0.10,
            label=f"below {f.name}'s smallest subnormal: lost (0 or 2^{sub:.0f})",
        )
        ax.axvspan(sub, tiny, color="gold", alpha=0.20, label=f"{f.name} subnormal")
        ax.axvspan(
            tiny, min(top, hi), color="tab:green", alpha=0.10, label=f"{f.name} normal range"
        )
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
        styles = ["--", ":", "-."]
        for g, style in zip(formats[1:], styles):
            for value in (math.log2(g.tiny), math.log2(g.max)):
                if lo <= value <= hi:
                    ax.axvline(value, color="0.3", linestyle=style, linewidth=1)
            ax.plot([], [], color="0.3", linestyle=style, label=f"{g.name} tiny / max")
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


# ---- diagnostics inside a run --------------------------------------------------------------------
# (local file, artifact folder), e.g. runner.tracking.base.Run.log_file
ArtifactSink = Callable[[Path, str], None]


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
        if self._folder is None:
            import tempfile

            self._folder = Path(tempfile.mkdtemp(prefix="amp-runner-diagnostics-"))
        self._folder.mkdir(parents=True, exist_ok=True)
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
