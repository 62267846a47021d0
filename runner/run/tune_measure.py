"""`trainer.tune`'s measurements: a candidate's steady step time and first-step loss; the choice.

Each candidate (a set of settings on top of the run's config) is built from the plan as the run
would be (`runner.run.build`: the same seed, so the same initial weights), without loader workers,
and trained for a few steps on its first batch by a `Trainer` that reports nowhere: the first step
gives the loss (and, compiled, the compile time), the fastest of the steps after the warm ones the
steady step time. Nothing here touches the run's own parts; the caller keeps the random generators.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

from runner.config.values import with_values
from runner.measure.probes import synchronize
from runner.run import cuda_graphs
from runner.run.distributed import Comm
from runner.run.plan import RunPlan

log = logging.getLogger(__name__)

WARM_STEPS = 2  # steps left out of the steady time (the first one compiles, where compiled)
TIMED_STEPS = 5
# a slow step needs fewer samples for the same precision (its noise is a smaller share of it):
# from SLOW_STEP_S a step on, one warm step, and timed steps for about TIMED_S, at least MIN_TIMED
SLOW_STEP_S, TIMED_S, MIN_TIMED = 0.25, 1.0, 2
# a candidate replaces the fastest so far only when this much faster (noise is not a gain)
MARGIN = 0.03
# the first-step loss a candidate may differ by, relative, per the narrowest compute format
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2, "fp8": 5e-2}
# the least a compile may be guessed to take before it is measured (s): CPU, CUDA
COMPILE_GUESS_S = {"cpu": 30.0, "cuda": 60.0}
COMPILE_GAIN = 0.15  # compile is tried where this share of the run's time repays the guess
MAX_AUTOTUNE = "max-autotune-no-cudagraphs"  # the compile mode tried after the default one
BUDGET_NOTE = "left of trainer.tune_budget_s"  # the end of a candidate skipped for the budget
# max-autotune's compile, estimated from the default compile's measured time: it compiles what
# the default does, then benchmarks each distinct convolution and matmul against 10-20 generated
# kernels (3.5-10.6 s each for ResNet-50 at batch 128 on an H100): a cost per conv/linear layer,
# not a multiple of the default's, so the default's time plus AUTOTUNE_S_PER_LAYER a layer; at
# least AUTOTUNE_LEAST_FACTOR times the default (it also tunes every fused pointwise kernel's
# launch configs), and AUTOTUNE_UNKNOWN_FACTOR times it where the layers cannot be counted
AUTOTUNE_S_PER_LAYER, AUTOTUNE_LEAST_FACTOR, AUTOTUNE_UNKNOWN_FACTOR = 4.0, 2.0, 10.0


@dataclasses.dataclass
class Row:
    """One candidate as measured: its settings (config keys), steady ms per step (None: not
    measured), compile seconds, first-step loss, why it was refused or skipped ("" if not), and
    the seconds its first step took over a steady one (one-time work: cuDNN's search for its
    shapes, a compile, and for the first candidate the process's first CUDA work)."""

    settings: dict[str, Any]
    steady_ms: Optional[float] = None
    compile_s: float = 0.0
    loss: Optional[float] = None
    note: str = ""
    warmup_s: float = 0.0
    spread: float = 0.0  # the timed steps' (slowest - fastest) / fastest
    timed: int = 0  # how many steps were timed

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Row:
        return cls(
            dict(data["settings"]),
            data.get("steady_ms"),
            float(data.get("compile_s", 0.0)),
            data.get("loss"),
            str(data.get("note", "")),
            float(data.get("warmup_s", 0.0)),
            float(data.get("spread", 0.0)),
            int(data.get("timed", 0)),
        )

    def steady(self) -> str:
        """Its steady step as tune.md says it: ms, and the timed steps' spread and count."""
        if self.steady_ms is None:
            return "-"
        return f"{self.steady_ms:.1f} (+{100 * self.spread:.0f}%, {self.timed} steps)"


def tolerance(compute_dtypes: Sequence[Any]) -> float:
    """The relative first-step loss difference allowed at a level computing in `compute_dtypes`
    (none: fp32, tight; 16-bit and fp8 formats: loose, as their rounding moves with the order of
    the sums)."""
    names = [str(d).replace("torch.", "") for d in compute_dtypes]
    if any("float8" in n or "fp8" in n for n in names):
        return TOLERANCE["fp8"]
    return max([TOLERANCE.get(n, TOLERANCE["float16"]) for n in names] or [TOLERANCE["float32"]])


def step_counts(step_s: Optional[float]) -> tuple[int, int]:
    """(warm steps, timed steps) for a candidate whose step is expected to take `step_s` (None:
    unknown): a slow step needs fewer samples for the same precision, so the budget buys
    measurements of more candidates (a 7.6-s step timed 7 times a candidate left no candidate
    within 120 s)."""
    if step_s is None or step_s < SLOW_STEP_S:
        return WARM_STEPS, TIMED_STEPS
    return 1, max(MIN_TIMED, min(TIMED_STEPS, math.ceil(TIMED_S / step_s)))


def measure(
    plan: RunPlan,
    settings: Mapping[str, Any],
    device: torch.device,
    counts: tuple[int, int] = (WARM_STEPS, TIMED_STEPS),
) -> Row:
    """Build the run with `settings` and time its steps (`counts`: warm, then timed) as the run
    will take them: its training loader's batches, its workers and threads as configured."""
    # the candidates' builds and steps say what the run's will say (each build's news, each
    # first step's layer audit, "What ran where"): only their warnings reach the log
    with _quiet("runner"):
        return _measure(plan, settings, device, counts)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _measure(
    plan: RunPlan, settings: Mapping[str, Any], device: torch.device, counts: tuple[int, int]
) -> Row:
    from runner.run.build import build
    from runner.run.trainer import Trainer

    warm, timed = counts
    cfg = with_values(plan.cfg, settings)
    graphed = cuda_graphs.mode(cfg.trainer.cuda_graphs) == cuda_graphs.STEP
    candidate = dataclasses.replace(plan, cfg=cfg, resume=None)
    parts = build(candidate, device, Comm(), wait_for_kernels=False)
    try:
        trainer = Trainer(cfg.trainer, parts, device=device)
        trainer.model.train()
        times, first, batches = [], math.nan, _batches(parts.train_loader)
        while len(times) < warm + timed:
            synchronize(device)
            start = time.perf_counter()  # (a step as the run takes it: its batch fetched too)
            loss = trainer.train_step(*trainer.to_device(*next(batches)))
            synchronize(device)
            times.append(time.perf_counter() - start)
            if len(times) == 1:
                first = float(loss)
            if graphed and len(times) == warm and _uncaptured(trainer, warm):
                warm += 1  # (the whole step's eager warm-up and its capture: none is timed)
        # the fastest timed step: what the candidate does on its own (a machine shared with
        # other work only ever adds time to a step, and noise is no property of the settings)
        steady = min(times[warm:])
        spread = (max(times[warm:]) - steady) / steady if steady > 0 else 0.0
        warmup_s = max(times[0] - steady, 0.0)
        compile_s = warmup_s if cfg.trainer.compile else 0.0
        if graphed:  # its capture, charged as a compile: what its warm steps took over steady
            compile_s = sum(max(t - steady, 0.0) for t in times[:warm])
        return Row(dict(settings), steady * 1e3, compile_s, first, "", warmup_s, spread, timed)
    finally:
        parts.close()


def _uncaptured(trainer: Any, warm: int) -> bool:
    """Whether the trainer's whole-step graph is not captured yet after `warm` steps (its eager
    warm-up, a step measured eagerly for its memory), within a bound: a run whose batches it
    never takes times its eager steps."""
    graph = trainer.whole_step
    return graph is not None and graph.replays == 0 and warm < 4 * (cuda_graphs.WARMUP_STEPS + 1)


def _batches(loader: Any) -> Iterator[Any]:
    """The training loader's batches, from its first, again from the start where it has fewer
    than a measurement takes (a candidate's first batch is the same for every candidate: the
    order comes from the seed and the epoch)."""
    while True:
        yield from loader


def gemm_layers(model: Optional[torch.nn.Module]) -> Optional[int]:
    """The convolution and linear layers of `model` (None: no model to count)."""
    if model is None:
        return None
    kinds = (torch.nn.modules.conv._ConvNd, torch.nn.Linear)
    return sum(isinstance(module, kinds) for module in model.modules())


def autotune_estimate_s(default_s: float, layers: Optional[int]) -> float:
    """The seconds a max-autotune candidate is expected to take, where the default compile's
    took `default_s`, on a model of `layers` conv/linear layers (see AUTOTUNE_S_PER_LAYER)."""
    if layers is None:
        return default_s * AUTOTUNE_UNKNOWN_FACTOR
    return max(default_s * AUTOTUNE_LEAST_FACTOR, default_s + layers * AUTOTUNE_S_PER_LAYER)


def expected_s(
    trial: Mapping[str, Any],
    guess: float,
    costs: Mapping[str, float],
    layers: Optional[int],
    device: torch.device,
) -> tuple[str, float]:
    """(eager, compile or autotune; the seconds measuring `trial` is expected to take): an
    eager candidate, the longest an eager one took, past the search a new memory layout costs
    (plus its `guess`, which holds that search where it changes the layout); a compiled one, the
    longest a compiled one took, or before one did, an eager one's time and the least a compile
    is guessed to take; max-autotune, from the compiled one's (autotune_estimate_s)."""
    least = COMPILE_GUESS_S["cuda" if device.type == "cuda" else "cpu"]
    compiled = costs.get("compile", costs["eager"] + max(guess, least))
    if trial.get("trainer.compile") and trial.get("trainer.compile_mode") == MAX_AUTOTUNE:
        return "autotune", autotune_estimate_s(compiled, layers)
    if trial.get("trainer.compile"):
        return "compile", compiled
    return "eager", costs["eager"] + guess


def skipped_note(kind: str, expected: float, left: float) -> str:
    """A candidate's note where `expected` seconds do not fit the `left` of the budget."""
    what = {"eager": "measuring it", "compile": "compiling"}.get(kind)
    what = what or "compiling with max-autotune"
    return f"skipped: {what} would take ~{_secs(expected)}, over the {_secs(left)} {BUDGET_NOTE}"


def _secs(seconds: float) -> str:
    """Seconds as a note says them: a decimal under 10 s ("~0.4 s, over the 0.2 s left", where
    whole seconds would read "~0 s, over the 0 s left"), whole seconds above."""
    seconds = max(seconds, 0.0)
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def effective_ms(row: Row, steps: Optional[int]) -> float:
    """A row's cost per step over a run of `steps` steps: its steady time, with its compile
    time shared out over the steps (unknown length: the compile time is not charged)."""
    if row.steady_ms is None or row.note:
        return math.inf
    charge = row.compile_s * 1e3 / steps if steps else 0.0
    return row.steady_ms + charge


def choose(rows: Sequence[Row], steps: Optional[int]) -> Row:
    """The fastest row over a run of `steps` (the first, the untuned settings, unless another
    is MARGIN faster), among those measured and not refused."""
    best = rows[0]
    for row in rows[1:]:
        if effective_ms(row, steps) < effective_ms(best, steps) * (1 - MARGIN):
            best = row
    return best


def refuse_if_loss_differs(row: Row, reference: Optional[float], tol: float) -> None:
    """Mark `row` refused where its first-step loss is beyond `tol` (relative) of `reference`."""
    if row.loss is None or reference is None or row.note:
        return
    delta = abs(row.loss - reference) / max(abs(reference), 1e-12)
    if not math.isfinite(row.loss) or delta > tol:
        row.note = f"refused: first-step loss {row.loss:.6g} vs {reference:.6g} (tolerance {tol:g})"
