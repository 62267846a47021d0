"""`trainer.cuda_graphs=step`, its speed: DenseNet-161's training step replayed as one CUDA graph
against the same step taken eagerly, beside a hand-written loop and Lightning `16-mixed`, with
the share of each step the GPU was busy.

Why this model: DenseNet-161 launches thousands of small kernels a step, and on an H200 the host's
launches (~100 ms a step) hid O2's gain: the GPU did 0.70x of O0's work and the step took 0.99x
(`results/h200/profile_step_densenet_h200.md`). At the mission's own shape (CIFAR-10's 32 px,
batch 128) the device's work a step is smaller still and the launches the same, so every level,
the runner's, a hand loop's and Lightning's alike, runs at the host's pace. The whole step
captured (runner.run.whole_step) launches one graph a step: what is left is the GPU's own time,
and the levels' difference shows.

For each shape (`--shapes`, images px x batch) and level (`--levels`), one group of sides built
from the same config (one synthetic batch held in memory, `scheduler=none`: the step alone; O0's
update is torch's own SGD, whose captured step holds a learning rate as captured) and timed
interleaved in one process, so that clocks, temperature and other load hit them alike:
  eager      the runner's `Trainer.train_step`, `trainer.cuda_graphs=false`
  optimizer  the same with `trainer.cuda_graphs=optimizer` (the clip and step alone replayed: it
             paid nothing on ResNet-18/50; one row, at the first shape's first level)
  step       the same with `trainer.cuda_graphs=step` (the whole step replayed)
  hand       the hand-written eager loop of the same level (`overhead.handwritten_step`: stock
             PyTorch, fp32 at O0; at O2 a 16-bit model, fp32 masters and BatchNorm, dynamic scale)
  lightning  Lightning's `16-mixed` (`peers.LightningSide`: the same fp32 weights, optimizer and
             batch; on a CPU `bf16-mixed`, Lightning's fp16 autocast being GPU-only), once a
             shape, in its first level's group
Each side is warmed up (`--warmup` steps; a captured side until its graph replays), then blocks
of `--steps` steps alternate over `--rounds` rounds (`common.interleaved_medians`), each block
device-synchronised at both ends and nothing between (the GPU may run behind the host, as in
training); a Lightning block is one `fit`, timed from its first timed step's
`on_train_batch_start` to its last's `on_train_batch_end` after `--warmup` untimed steps. The
figure is the median block's ms a step. Then each side's device busy share over `--busy-steps`
consecutive steps, measured as a run measures `device_busy_frac`: by runner.measure.busy's own
`BusyInstrument` (torch.profiler's CUDA activity, the union of the kernels' intervals over the
steps' wall time between two synchronisations), driven around the hand loop's steps and inside
Lightning's fit the same way as around the runner's.

Targets (issue 72, DenseNet-161 on a CUDA GPU): at 32 px, batch 128, O2's whole step captured
>= 2x its own eager step, >= 1.3x O0 captured, the device busy >= 0.9 captured, and >= 2x
Lightning `16-mixed`; at 224 px, batch 64, O2 captured >= 1.3x O0 captured (eagerly 0.99x).

    python -m benchmarks.graphs                        # CUDA: 32 px b128 and 224 px b64, O2, O0
    python -m benchmarks.graphs --shapes 32x128 --rounds 10
    python -m benchmarks.graphs --device cpu           # a CPU's check: 32 px, batch 2, 1 step

On a CPU planning refuses `trainer.cuda_graphs` (a CUDA graph needs a CUDA device): the eager
sides are timed at tiny sizes (a check of the configs and of this script, not a figure), the
busy share is the CPU operators' (the profiler's CPU activity), and the table says what planning
said. Measures; does not gate. Exit 0 whatever the numbers, 1 if a side crashed, 2 for bad
arguments (or Lightning missing where a Lightning side is asked for).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from benchmarks.common import (
    add_device_option,
    add_out_option,
    build_runner,
    check_at_least_one,
    check_presets,
    compose,
    csv_list,
    fill_defaults,
    fp32_model,
    interleaved_medians,
    load_average,
    model_label,
    model_problem,
    one_batch_task,
    provenance,
    resolve_device,
    results_path,
    setup_lines,
    show,
    write_results,
)

MODEL = "densenet161"
SHAPES = {"cuda": "32x128,224x64", "cpu": "32x2"}  # images px x batch
LEVELS = "o2,o0"  # the first: the optimizer graph's and Lightning's group
SIDES = ("eager", "optimizer", "step", "hand", "lightning")
MODES = {"eager": "false", "optimizer": "optimizer", "step": "step"}  # trainer.cuda_graphs
LIGHTNING = {"cuda": "16-mixed", "cpu": "bf16-mixed"}  # Lightning's fp16 autocast: GPU only
DEFAULTS = {
    "cuda": {"steps": 10, "rounds": 5, "warmup": 5, "busy_steps": 5},
    "cpu": {"steps": 1, "rounds": 1, "warmup": 1, "busy_steps": 2},
}
# what the hand-written loop does (overhead.handwritten_kind's names)
HAND_KINDS = {"fp32": "fp32", "autocast": "autocast + GradScaler", "o2": "16-bit, fp32 masters"}
REPLAY_WAIT = 30  # more warm-up steps at most, until a captured side replays (skipped steps)
# (name, shape, what, threshold): the targets of issue 72, DenseNet-161 on a CUDA GPU
TARGETS = (
    ("step_vs_eager", (32, 128), "O2 captured / its own eager step", 2.0),
    ("o2_vs_o0", (32, 128), "O2 captured / O0 captured", 1.3),
    ("busy", (32, 128), "device busy, O2 captured", 0.9),
    ("vs_lightning", (32, 128), "O2 captured / Lightning 16-mixed", 2.0),
    ("o2_vs_o0", (224, 64), "O2 captured / O0 captured", 1.3),
)
QUIET = logging.getLogger(__name__ + ".busy")  # (the busy finding: the table says it)
QUIET.setLevel(logging.ERROR)


def shape(text: str) -> tuple[int, int]:
    """`32x128` -> (32, 128): images px, batch."""
    px, x, batch = text.lower().partition("x")
    if not (x and px.isdigit() and batch.isdigit() and int(px) > 0 and int(batch) > 0):
        raise ValueError(text)
    return int(px), int(batch)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.graphs",
        description="The runner's step with trainer.cuda_graphs=step against the eager step, "
        "a hand-written loop and Lightning 16-mixed, interleaved in one process, with the "
        "device's busy share; writes Markdown, CSV and JSON.",
    )
    add_device_option(p)
    p.add_argument("--model", default=MODEL, help=f"a model option (default {MODEL})")
    p.add_argument(
        "--shapes",
        type=csv_list,
        default=None,
        help=f"images px x batch, comma-separated (default CUDA {SHAPES['cuda']}; CPU "
        f"{SHAPES['cpu']})",
    )
    p.add_argument("--levels", type=csv_list, default=csv_list(LEVELS), help=f"default {LEVELS}")
    p.add_argument(
        "--sides",
        type=csv_list,
        default=list(SIDES),
        help=f"from {', '.join(SIDES)} (default all; optimizer at the first shape's first level "
        "only, lightning at each shape's first level)",
    )
    p.add_argument("--steps", type=int, default=None, help="steps a block (CUDA 10, CPU 1)")
    p.add_argument("--rounds", type=int, default=None, help="blocks a side (CUDA 5, CPU 1)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps of each side before its blocks, and of each Lightning fit (CUDA 5, "
        "CPU 1); a captured side steps on until its graph replays",
    )
    p.add_argument(
        "--busy-steps",
        type=int,
        default=None,
        help="the steps the device's busy share is measured over, each side (CUDA 5, CPU 2)",
    )
    add_out_option(p, "graphs")
    args = p.parse_args(argv)
    args.device = resolve_device(p, args.device)
    fill_defaults(args, DEFAULTS[args.device])
    check_at_least_one(p, args, ("steps", "rounds", "busy_steps"))
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        args.shapes = [shape(s) for s in (args.shapes or csv_list(SHAPES[args.device]))]
    except ValueError as error:
        p.error(f"--shapes: {str(error)!r} is not <px>x<batch> (e.g. 32x128), both at least 1")
    if not args.levels:
        p.error("--levels: name at least one preset")
    check_presets(p, args.levels)
    unknown = [side for side in args.sides if side not in SIDES]
    if unknown or not args.sides:
        p.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    problem = model_problem(args.model)
    if problem:
        p.error(f"--model {args.model}: {problem}")
    if "lightning" in args.sides:
        try:
            import lightning  # noqa: F401
        except ImportError:
            print(
                "graphs.py: the Lightning side needs the `lightning` package (pip install "
                "lightning), or leave it out of --sides",
                file=sys.stderr,
            )
            sys.exit(2)
    args.out = args.out or results_path(f"graphs_{args.device}.md", args.device)
    return args


def overrides(args, px: int, batch: int, level: str, mode: str = "false") -> list[str]:
    return [
        *one_batch_task(args.model, px, batch, args.device),
        f"precision={level}",
        "scheduler=none",  # (the step alone; O0's torch SGD captured holds its rate)
        f"trainer.cuda_graphs={mode}",
    ]


def refusal(cfg) -> str | None:
    """What planning says of a config (None: it plans): ConfigError's first line."""
    from runner.errors import ConfigError
    from runner.run.plan import make_plan

    try:
        make_plan(cfg)
    except ConfigError as error:
        return str(error).splitlines()[0]
    return None


# ---- the device's busy share: runner.measure.busy's instrument, around any side's steps -------
def busy_meter(device, steps: int):
    """A `BusyInstrument` over the next `steps` steps it is told of (its window from the first),
    reporting nowhere: on a CUDA device the kernels' share of the steps' wall time, as a run
    measures `device_busy_frac`; on a CPU the operators' (the profiler's CPU activity), a check
    of the window, not a figure."""
    from runner.measure.busy import BusyInstrument

    kinds = {}
    if device.type != "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity

        kinds = {"activity": ProfilerActivity.CPU, "kind": DeviceType.CPU}
    return BusyInstrument(device, 1, lambda frac, step: None, steps=steps, logger=QUIET, **kinds)


def busy_share(step: Callable[[], object], device, steps: int) -> float:
    """The busy share of `steps` consecutive calls of `step`."""
    meter = busy_meter(device, steps)
    for index in range(1, steps + 1):
        meter.due(index)
        meter.start(index)
        step()
        meter.close()
    return math.nan if meter.frac is None else meter.frac


# ---- the sides ----------------------------------------------------------------------------------
class Stepped:
    """A side stepped by a Python function (the runner's trainer, the hand loop)."""

    def __init__(self, step: Callable[[], object], device, graph=None):
        self.step, self.device, self.graph = step, device, graph
        self.loss = math.nan

    def warm_up(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        for _ in range(REPLAY_WAIT if self.graph is not None else 0):
            if self.graph.replays >= 2:  # (captured, and replayed since)
                break
            self.step()

    def block(self, steps: int) -> float:
        from benchmarks.overhead import timed_block

        seconds, loss = timed_block(self.step, steps, self.device)
        self.loss = float(loss)
        return seconds

    def busy(self, steps: int) -> float:
        return busy_share(self.step, self.device, steps)


def runner_side(parts) -> Stepped:
    trainer, batch = parts.trainer, parts.batch

    def step():
        loss = trainer.train_step(*batch)
        trainer.global_step += 1  # (as the fit loop counts them: the instruments' steps)
        return loss

    return Stepped(step, parts.device, trainer.whole_step or trainer.step_graph)


class LightningRun:
    """The Lightning side: each block one `fit` of `warmup` + `steps` steps, timed from the first
    timed step's start to the last's end (its loop between the steps included: its DataLoader
    handing over the batch already on the device), device-synchronised at both."""

    def __init__(self, side, device, warmup: int):
        self.side, self.device, self.warmup = side, device, warmup
        self.loss = math.nan

    def _window(self, first: int, count: int, start: Callable, end: Callable):
        import lightning as L

        class Window(L.Callback):
            def on_train_batch_start(self, trainer, module, batch, index):
                if first <= index < first + count:
                    start(index - first)

            def on_train_batch_end(self, trainer, module, outputs, batch, index):
                if first <= index < first + count:
                    end(index - first)

        return Window()

    def warm_up(self, steps: int) -> None:
        self.side.fit(max(steps, 1))

    def block(self, steps: int) -> float:
        from runner.measure.probes import synchronize

        clock = {}

        def start(i):
            if i == 0:
                synchronize(self.device)
                clock["start"] = time.perf_counter()

        def end(i):
            if i == steps - 1:
                synchronize(self.device)
                clock["end"] = time.perf_counter()

        self.side.fit(self.warmup + steps, [self._window(self.warmup, steps, start, end)])
        self.loss = float(self.side.last_loss)
        return (clock["end"] - clock["start"]) / steps

    def busy(self, steps: int) -> float:
        meter = busy_meter(self.device, steps)

        def start(i):
            meter.due(i + 1)
            meter.start(i + 1)

        self.side.fit(
            self.warmup + steps, [self._window(self.warmup, steps, start, lambda i: meter.close())]
        )
        return math.nan if meter.frac is None else meter.frac


def sides_of(args, first_shape: bool, first_level: bool) -> list[str]:
    """The sides of a group: optimizer at the first shape's first level, lightning at each
    shape's first level."""
    return [
        s
        for s in args.sides
        if (s != "optimizer" or (first_shape and first_level)) and (s != "lightning" or first_level)
    ]


def build_sides(args, px, batch, level, names, rows) -> dict:
    """The group's sides, built; a side planning refuses (a CPU's graphs) or without a
    hand-written loop (O3) gets its row's status and no side."""
    from benchmarks.overhead import handwritten_kind, handwritten_step
    from benchmarks.peers import LightningSide

    built: dict = {}
    eager = build_runner(compose(overrides(args, px, batch, level)))
    for name in names:
        row = rows[name]
        if name in MODES:
            if name == "eager":
                built[name] = runner_side(eager)
                continue
            cfg = compose(overrides(args, px, batch, level, MODES[name]))
            row["refused"] = refusal(cfg)
            if row["refused"]:
                row["status"] = "refused"
                continue
            built[name] = runner_side(build_runner(cfg, cpu_batch=eager.cpu_batch))
        elif name == "hand":
            try:
                row["mode"] = HAND_KINDS[handwritten_kind(eager.properties)]
            except ValueError as error:
                row["status"], row["error"] = "n/a", str(error)
                continue
            step = handwritten_step(fp32_model(eager.cfg), eager.cfg, eager.properties, eager.batch)
            built[name] = Stepped(step, eager.device)
        else:
            side = LightningSide(
                fp32_model(eager.cfg),
                eager.cfg,
                eager.batch,
                LIGHTNING[args.device],
                eager.device,
                benchmark=bool(eager.cfg.trainer.cudnn_benchmark),
            )
            built[name] = LightningRun(side, eager.device, args.warmup)
    return built


def run_group(args, px: int, batch: int, level: str, names: list[str]) -> list[dict]:
    """One shape and level: its sides built, warmed up, timed interleaved, their busy share."""
    rows = {
        name: {
            "model": args.model,
            "image_size": px,
            "batch_size": batch,
            "level": level,
            "side": name,
            "mode": MODES.get(name, LIGHTNING[args.device] if name == "lightning" else "-"),
            "status": "ok",
            "error": None,
            "refused": None,
        }
        for name in names
    }
    gc.collect()
    label = f"{model_label(args.model)} {px} px b{batch} {level}"
    try:
        sides = build_sides(args, px, batch, level, names, rows)
        for side in sides.values():
            side.warm_up(args.warmup)
        replays = {n: s.graph.replays for n, s in sides.items() if getattr(s, "graph", None)}
        medians = interleaved_medians(
            list(sides), lambda n: sides[n].block(args.steps), args.rounds, label
        )
        timed = (args.rounds + 1) * args.steps  # (interleaved_medians' warm-up block too)
        for name, side in sides.items():
            row = rows[name]
            row["ms"] = 1e3 * medians[name]
            row["samples_per_s"] = batch / medians[name]
            row["loss"] = side.loss
            if name in replays:
                graph = side.graph
                row["captures"], row["replays"] = graph.captures, graph.replays
                row["replayed_every_timed_step"] = graph.replays - replays[name] == timed
            row["busy"] = side.busy(args.busy_steps)
        sides = None  # (frees the group before the next: a captured step holds its memory)
    except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
        for row in rows.values():
            if row["status"] == "ok":
                row["status"], row["error"] = "crashed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    _release()
    return list(rows.values())


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the figures and the verdict ----------------------------------------------------------------
def find(rows, px, batch, level, side) -> dict | None:
    for r in rows:
        key = (r["image_size"], r["batch_size"], r["level"], r["side"])
        if key == (px, batch, level, side) and r["status"] == "ok":
            return r
    return None


def lightning_row(rows, px, batch) -> dict | None:
    """The Lightning side's row at a shape (whatever its group's level)."""
    for r in rows:
        if r["side"] == "lightning" and (r["image_size"], r["batch_size"]) == (px, batch):
            return r if r["status"] == "ok" else None
    return None


def _ratio(reference: dict | None, row: dict | None) -> float | None:
    """reference's ms over row's: row's speed-up over reference (None: one is missing)."""
    return None if reference is None or row is None else reference["ms"] / row["ms"]


def speedups(rows: list[dict]) -> None:
    """Each row's speed-ups, in place: over the runner's eager step at its level (`vs_eager`),
    over the same side at O0 (`vs_o0`), over Lightning at its shape (`vs_lightning`)."""
    for r in rows:
        if r["status"] != "ok":
            continue
        px, batch = r["image_size"], r["batch_size"]
        lightning = lightning_row(rows, px, batch)
        r["vs_lightning"] = _ratio(lightning, r) if r["side"] != "lightning" else None
        if r["side"] == "lightning":
            r["vs_eager"] = r["vs_o0"] = None
            continue
        r["vs_eager"] = _ratio(find(rows, px, batch, r["level"], "eager"), r)
        r["vs_o0"] = _ratio(find(rows, px, batch, "o0", r["side"]), r)


def target_value(rows: list[dict], name: str, px: int, batch: int) -> float | None:
    o2_step = find(rows, px, batch, "o2", "step")
    if o2_step is None:
        return None
    if name == "step_vs_eager":
        return _ratio(find(rows, px, batch, "o2", "eager"), o2_step)
    if name == "o2_vs_o0":
        return _ratio(find(rows, px, batch, "o0", "step"), o2_step)
    if name == "vs_lightning":
        return _ratio(lightning_row(rows, px, batch), o2_step)
    busy = o2_step.get("busy")
    return None if busy is None or not math.isfinite(busy) else busy


def judged(report: dict) -> list[dict]:
    """Each target: what, where, the measured value, met (None: not measured)."""
    out = []
    for name, (px, batch), what, threshold in TARGETS:
        value = target_value(report["results"], name, px, batch)
        met = None if value is None else value >= threshold
        out.append(
            {
                "target": name,
                "shape": f"{px} px, batch {batch}",
                "what": what,
                "threshold": threshold,
                "value": value,
                "met": met,
            }
        )
    return out


def verdict(report: dict) -> list[str]:
    rows = report["results"]
    if report["device"] != "cuda" or report["model"] != MODEL:
        refused = sorted({r["side"] for r in rows if r["status"] == "refused"})
        why = (
            "a CPU: planning refuses the graphs"
            + (f" (refused: {', '.join(refused)})" if refused else "")
            if report["device"] != "cuda"
            else f"{report['model']}: the targets are DenseNet-161's"
        )
        return [
            f"Verdict: **NO TARGET** on {why}; the targets are DenseNet-161's on a CUDA GPU "
            "(the rows above check the sides' configs and this script, not the GPU's figures)."
        ]
    checks = judged(report)
    lines = []
    for c in checks:
        state = {True: "met", False: "MISSED", None: "NOT MEASURED"}[c["met"]]
        unit = "" if c["target"] == "busy" else "x"
        value = "-" if c["value"] is None else f"{c['value']:.2f}{unit}"
        lines.append(
            f"- {c['shape']}: {c['what']} {value} (target >= {c['threshold']:g}{unit}): **{state}**"
        )
    missed = [c for c in checks if c["met"] is False]
    unmeasured = [c for c in checks if c["met"] is None]
    state = "MISSED" if missed else ("INCOMPLETE" if unmeasured else "MET")
    said = f"{sum(c['met'] is True for c in checks)} of {len(checks)} targets met"
    said += f", {len(missed)} missed" if missed else ""
    if unmeasured:
        said += f", {len(unmeasured)} not measured (a side crashed, was refused or did not run)"
    return [f"Verdict: **{state}**: {said}.", "", *lines]


def _f(value, spec: str) -> str:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return "-" if missing else format(value, spec)


SIDE_LABELS = {
    "eager": "runner, eager",
    "optimizer": "runner, optimizer graph",
    "step": "runner, whole step captured",
    "hand": "hand-written loop",
    "lightning": "Lightning",
}


def render(report: dict) -> str:
    cuda = report["device"] == "cuda"
    lines = [
        f"# The whole training step as one CUDA graph: {model_label(report['model'])} "
        f"({report['device']})",
        "",
        "Per shape and level, the runner's `Trainer.train_step` with `trainer.cuda_graphs=false`, "
        "`optimizer` and `step`, the hand-written eager loop of the same level and Lightning "
        f"`{LIGHTNING[report['device']]}`, on the same model, weights, optimizer (SGD, "
        "`scheduler=none`) and synthetic batch held in memory; each side warmed up "
        f"({report['warmup']} steps; a captured one until it replays), then {report['rounds']} "
        f"interleaved rounds of {report['steps']}-step blocks, each block device-synchronised at "
        "both ends (a Lightning block: one `fit`, after "
        f"{report['warmup']} untimed steps). ms a step: the median block's. Device busy: the "
        f"share of {report['busy_steps']} consecutive steps' wall time the "
        + ("GPU ran a kernel or copy" if cuda else "CPU ran an operator (a CPU's check)")
        + ", measured by `runner.measure.busy`'s `BusyInstrument` as a run's "
        "`device_busy_frac`. Speed-ups: a reference's ms a step over the row's.",
        "",
        "| px | batch | level | side | `cuda_graphs` / precision | ms a step | samples/s | "
        "device busy | x runner eager | x same side at O0 | x Lightning | graph captures / "
        "replays | last loss |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in report["results"]:
        head = (
            f"| {r['image_size']} | {r['batch_size']} | {r['level']} | "
            f"{SIDE_LABELS[r['side']]} | {r['mode']}"
        )
        if r["status"] != "ok":
            said = "refused in planning (below)" if r["status"] == "refused" else r["error"]
            said = said if r["status"] == "refused" else f"{r['status']}: {said}"
            lines.append(f"{head} | {said} | | | | | | | |")
            continue
        graph = "-"
        if "captures" in r:
            graph = f"{r['captures']} / {r['replays']}" + (
                "" if r["replayed_every_timed_step"] else " (NOT every timed step)"
            )
        lines.append(
            f"{head} | {_f(r['ms'], '.2f')} | {_f(r['samples_per_s'], '.0f')} | "
            f"{_f(r.get('busy'), '.2f')} | {_f(r.get('vs_eager'), '.2f')} | "
            f"{_f(r.get('vs_o0'), '.2f')} | {_f(r.get('vs_lightning'), '.2f')} | {graph} | "
            f"{_f(r.get('loss'), '.4g')} |"
        )
    lines += [f"\nRefused in planning: {said}" for said in report["refusals"]]
    lines += [
        "",
        "## Verdict",
        "",
        "Issue 72's targets, DenseNet-161 on a CUDA GPU: at 32 px, batch 128 (the mission's "
        "shape), O2's whole step captured >= 2x its own eager step, >= 1.3x O0 captured, the "
        "device busy >= 0.9 captured, >= 2x Lightning `16-mixed`; at 224 px, batch 64, O2 "
        "captured >= 1.3x O0 captured (eagerly 0.99x on the H200 of 2026-11-29).",
        "",
        *verdict(report),
        "",
        "## Setup",
        "",
        *setup_lines(report, f"Lightning {report.get('lightning') or '-'}, "),
        "",
    ]
    return "\n".join(lines)


FIELDS = [
    "model",
    "image_size",
    "batch_size",
    "level",
    "side",
    "mode",
    "status",
    "ms",
    "samples_per_s",
    "busy",
    "vs_eager",
    "vs_o0",
    "vs_lightning",
    "captures",
    "replays",
    "replayed_every_timed_step",
    "loss",
    "refused",
    "error",
]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    load_start, started = load_average(), time.perf_counter()
    shapes = ", ".join(f"{px} px b{batch}" for px, batch in args.shapes)
    print(
        f"CUDA graphs on {args.device}: {model_label(args.model)} at {shapes}, levels "
        f"{', '.join(args.levels)}, {args.rounds} rounds of {args.steps}-step blocks; load "
        f"average {load_start}",
        flush=True,
    )
    try:
        import lightning

        lightning_version = lightning.__version__
    except ImportError:
        lightning_version = None
    results: list[dict] = []
    # the table after every group, so that a GPU lease's piece stopped at its limit keeps the
    # groups that ran (the mission's shape first)
    for i, (px, batch) in enumerate(args.shapes):
        for j, level in enumerate(args.levels):
            results += run_group(args, px, batch, level, sides_of(args, i == 0, j == 0))
            speedups(results)
            report = {
                "benchmark": "graphs",
                "device": args.device,
                "model": args.model,
                "steps": args.steps,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "busy_steps": args.busy_steps,
                "lightning": lightning_version,
                "refusals": sorted({r["refused"] for r in results if r.get("refused")}),
                "results": results,
                **provenance("graphs", argv, args.device, load_start, started),
                "overrides": {
                    f"{px}x{batch}/{lv}/{mode}": overrides(args, px, batch, lv, mode)
                    for px, batch in args.shapes
                    for lv in args.levels
                    for mode in ("false", "step")
                },
            }
            report["targets"] = judged(report) if args.device == "cuda" else []
            paths = write_results(args.out, render(report), results, FIELDS, report)
    show(render(report), paths)
    return 1 if any(r["status"] == "crashed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
