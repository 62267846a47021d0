"""Runner overhead: the runner's training step against a hand-written PyTorch loop doing the same
work, per precision level, timed interleaved in one process.

The runner's side is the real thing: the objects `runner.run.app.run` builds (model, optimizer,
scheduler, AmpEngine from the resolved preset, Trainer; `common.build_runner`), stepped with
`Trainer.train_step`. The hand-written side is what a user would write with stock PyTorch, from
the same initial weights, on the same batch in memory, with the same optimizer and scheduler
settings (built by the runner's own `build_optimizer`/`build_scheduler`, which are the torch
constructors):
  O0  plain fp32: forward, loss, backward, optimizer step, scheduler step, zero_grad.
  O1  torch.autocast around forward and loss; torch.amp.GradScaler where the preset scales the
      loss dynamically (fp16); no scaler where it does not (bf16: `o1_bf16`, the CPU preset).
  O2  a 16-bit model (BatchNorm kept fp32) with fp32 master weights in stock torch ops:
      torch._foreach_copy_ of the 16-bit grads into fp32 master grads,
      torch._amp_foreach_non_finite_check_and_unscale_ and the host read of its flag (only where
      the preset scales the loss: a bf16 preset's scale is 1 and the runner checks nothing
      either), the optimizer's step on the masters, torch._foreach_copy_ back into the model.
Blocks of steps alternate between the two (the order flips every round) for every level, so
load drift on a shared machine hits both sides alike; the figure is the median step time of each
side and their ratio, runner / hand-written.

    python -m benchmarks.overhead                       # CPU: o0, o1_bf16, o2_bf16
    python -m benchmarks.overhead --device cuda         # GPU: o0, o1, o2 (fp16)
    python -m benchmarks.overhead --levels o0 --rounds 5 --model tiny
    python -m benchmarks.overhead --startup             # start-up: whole processes (startup.py)
    python -m benchmarks.overhead --instruments         # the instruments' cost at a usual step

Targets: ratio <= 1.03 for O0 and O1 (bf16 on CPU), ResNet-18 on 32x32 inputs at batch
64, CPU and GPU; O2: the runner faster than the stock loop (ratio < 1). Exit 0 whatever the
verdict; 1 if a step crashed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.common import (
    add_device_option,
    add_extra_option,
    add_out_option,
    add_threads_option,
    apply_threads,
    build_runner,
    check_at_least_one,
    check_presets,
    compose,
    csv_list,
    fp32_model,
    load_average,
    one_batch_task,
    provenance,
    resolve_device,
    results_path,
    setup_lines,
    show,
    write_results,
)

TARGET_RATIO = 1.03  # O0 and O1: runner / hand-written at most this
CPU_LEVELS = ["o0", "o1_bf16", "o2_bf16"]
CUDA_LEVELS = ["o0", "o1", "o2"]
# (rounds, steps per block, warm-up steps) per device: CPU steps take ~0.5-2 s, GPU ones ~10 ms
DEFAULTS = {"cpu": (15, 1, 2), "cuda": (20, 25, 20)}


# ---- the hand-written loops ---------------------------------------------------------------------
def handwritten_kind(properties) -> str:
    """Which stock loop does the work of this resolved preset: fp32, autocast or o2."""
    if properties.opt_level == "O0":
        return "fp32"
    if properties.autocasts and not properties.casts_to_half:
        return "autocast"
    if properties.casts_to_half and properties.uses_master_weights:
        return "o2"
    raise ValueError(
        f"no hand-written loop for {properties.opt_level} with these properties "
        "(only O0, O1 and O2 with master weights have one)"
    )


def _static_or_dynamic(properties) -> bool:
    """True for dynamic loss scaling; a static scale other than 1 has no stock equivalent here."""
    if properties.dynamic_loss_scale:
        return True
    if float(properties.loss_scale) != 1.0:
        raise ValueError(
            f"the hand-written loops take a dynamic loss scale or none, not a static "
            f"scale of {properties.loss_scale}"
        )
    return False


def handwritten_step(model, cfg, properties, batch) -> Callable[[], object]:
    """A stock-PyTorch training step doing the work of the runner's step under `properties`,
    on `model` (fp32, already on the device and in its memory format; it is cast here for O2).
    Returns a function running one step on `batch` (and returning the detached loss)."""
    import torch
    from torch import nn

    from runner.components.optim import build_optimizer, build_scheduler

    kind = handwritten_kind(properties)
    x, y = batch
    device_type = x.device.type
    cross_entropy = nn.CrossEntropyLoss()

    def criterion(logits, target):
        # a language model's (B, T, V) logits: every position against the next token, as
        # nanoGPT's loop computes it (logits.view(-1, V) against targets.view(-1))
        return (
            cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            if logits.dim() == 3
            else cross_entropy(logits, target)
        )

    dynamic = _static_or_dynamic(properties)

    def scheduler_for(optimizer):
        return build_scheduler(cfg.scheduler, optimizer, 1, cfg.trainer.max_epochs)

    if kind == "fp32":
        optimizer = build_optimizer(cfg.optimizer, model.parameters())
        scheduler = scheduler_for(optimizer)

        def step():
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    if kind == "autocast":
        optimizer = build_optimizer(cfg.optimizer, model.parameters())
        scheduler = scheduler_for(optimizer)
        dtype = properties.autocast_dtype
        scaler = (
            torch.amp.GradScaler(
                device_type,
                init_scale=properties.init_scale,
                growth_factor=properties.growth_factor,
                backoff_factor=properties.backoff_factor,
                growth_interval=properties.growth_interval,
            )
            if dynamic
            else None
        )

        def step():
            with torch.autocast(device_type, dtype=dtype):
                loss = criterion(model(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            if scheduler is not None:
                with warnings.catch_warnings():  # a skipped first step is expected
                    warnings.simplefilter("ignore", UserWarning)
                    scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    # kind == "o2": 16-bit model, fp32 BatchNorm, fp32 masters, in stock torch ops
    from torch.nn.modules.batchnorm import _BatchNorm

    half = properties.cast_model_type
    model.to(half)
    if properties.keep_batchnorm_fp32:
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                module.float()
    params = list(model.parameters())
    half_params = [p for p in params if p.dtype == half]
    masters = {id(p): p.detach().float().requires_grad_(True) for p in half_params}
    master_list = [masters[id(p)] for p in half_params]
    master_grads = [torch.empty_like(m) for m in master_list]
    fp32_params = [p for p in params if id(p) not in masters]
    optimizer = build_optimizer(cfg.optimizer, [masters.get(id(p), p) for p in params])
    scheduler = scheduler_for(optimizer)
    found = torch.zeros(1, device=x.device)
    scale = {"value": float(properties.init_scale) if dynamic else 1.0, "clean": 0}
    inv = torch.full((1,), 1.0 / scale["value"], device=x.device)

    @torch.no_grad()
    def update_scale(overflow: bool) -> None:
        if overflow:
            scale["value"] *= properties.backoff_factor
            scale["clean"] = 0
        else:
            scale["clean"] += 1
            if scale["clean"] >= properties.growth_interval:
                scale["value"] = min(
                    scale["value"] * properties.growth_factor, properties.max_loss_scale
                )
                scale["clean"] = 0
        inv.fill_(1.0 / scale["value"])

    def step():
        # floating inputs cast in every step (token ids stay integers) and outputs back to fp32,
        # as the runner's model hooks do
        loss = criterion(model(x.to(half) if x.is_floating_point() else x).float(), y)
        (loss * scale["value"] if dynamic else loss).backward()
        with torch.no_grad():
            for m, g in zip(master_list, master_grads):
                m.grad = g
            torch._foreach_copy_(master_grads, [p.grad for p in half_params])
            overflow = False
            if dynamic:
                found.zero_()
                torch._amp_foreach_non_finite_check_and_unscale_(
                    master_grads + [p.grad for p in fp32_params], found, inv
                )
                overflow = found.item() != 0
            if not overflow:
                optimizer.step()
                torch._foreach_copy_(half_params, master_list)
            if dynamic:
                update_scale(overflow)
        if scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ---- arguments ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Runner overhead: Trainer.train_step against a hand-written PyTorch loop "
        "doing the same work, interleaved, per precision level; writes Markdown, CSV and JSON.",
    )
    add_device_option(p)
    p.add_argument(
        "--levels",
        type=csv_list,
        default=None,
        help=f"comma-separated presets (default: CPU {','.join(CPU_LEVELS)}; CUDA "
        f"{','.join(CUDA_LEVELS)}); O3 has no hand-written counterpart",
    )
    p.add_argument("--model", default="resnet18", help="model config option (default resnet18)")
    p.add_argument("--image-size", type=int, default=32, help="synthetic image side (default 32)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds, each one block per side and level (default 15 on "
        "CPU, 20 on CUDA)",
    )
    p.add_argument(
        "--block",
        type=int,
        default=None,
        help="steps per timed block (default 1 on CPU, 25 on CUDA)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps per side and level first (default 2 on CPU, 20 on CUDA)",
    )
    p.add_argument(
        "--channels-last",
        action="store_true",
        help="trainer.channels_last=true (model and inputs channels-last, both sides)",
    )
    add_out_option(p, "overhead")
    add_extra_option(
        p,
        "more Hydra overrides for the runner's config, applied last "
        "(e.g. optimizer=adamw); the hand-written loop takes the same settings",
    )
    p.add_argument(
        "--startup",
        action="store_true",
        help="measure start-up instead: whole-process wall time of a tiny run against "
        "a hand-written loop (benchmarks/startup.py; its own options follow)",
    )
    p.add_argument(
        "--instruments",
        action="store_true",
        help="measure instead what the trainer's instruments cost at a usual step (after the "
        "first step, diagnostics off: the step timer alone), against no instruments at all, "
        "for the first level (target: at most 1%% of the step); writes "
        "overhead_instruments_<device>.md",
    )
    p.add_argument(
        "--calls",
        type=int,
        default=100_000,
        help="--instruments: usual steps per timed block (default 100000)",
    )
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(p, args)

    args.device = resolve_device(p, args.device)
    rounds, block, warmup = DEFAULTS[args.device]
    args.rounds = rounds if args.rounds is None else args.rounds
    args.block = block if args.block is None else args.block
    args.warmup = warmup if args.warmup is None else args.warmup
    check_at_least_one(p, args, ("rounds", "block", "batch_size", "image_size"))
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    from runner.config import BUILT_IN_MODELS as MODEL_NAMES  # by name alone

    if args.model not in MODEL_NAMES:
        p.error(f"unknown model {args.model!r}; choose from {', '.join(MODEL_NAMES)}")
    levels = args.levels or (CUDA_LEVELS if args.device == "cuda" else CPU_LEVELS)
    check_presets(p, levels)
    o3 = [lvl for lvl in levels if lvl.startswith("o3")]
    if o3:
        p.error(
            f"{', '.join(o3)}: O3 has no hand-written counterpart here; choose O0, O1 or O2 presets"
        )
    args.levels = list(dict.fromkeys(levels))
    name = "overhead_instruments" if args.instruments else "overhead"
    args.out = args.out or results_path(f"{name}_{args.device}.md", args.device)
    return args


def task_overrides(args: argparse.Namespace, level: str) -> list[str]:
    """The runner's config for one level: synthetic data of exactly one batch, in memory."""
    return [
        *one_batch_task(args.model, args.image_size, args.batch_size, args.device),
        f"trainer.channels_last={str(args.channels_last).lower()}",
        f"precision={level}",
        *args.extra,
    ]


# ---- timing -------------------------------------------------------------------------------------
def timed_block(step: Callable[[], object], steps: int, device) -> tuple[float, object]:
    """Seconds per step over `steps` steps, device-synchronised at both ends (queued GPU work
    counts; within the block the CPU may run ahead, as in training), and the last step's
    result."""
    from runner.measure.probes import synchronize

    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        result = step()
    synchronize(device)
    return (time.perf_counter() - started) / steps, result


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def describe(times: list[float]) -> dict:
    p25, p75 = _quartiles(times)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "p25_ms": 1e3 * p25,
        "p75_ms": 1e3 * p75,
        "min_ms": 1e3 * min(times),
        "samples": len(times),
    }


def target_for(opt_level: str) -> tuple[str, float]:
    """('<=', 1.03) for O0/O1, ('<', 1.0) for O2: the runner must beat the stock O2 loop."""
    return ("<", 1.0) if opt_level == "O2" else ("<=", TARGET_RATIO)


def meets(ratio: float, target: tuple[str, float]) -> bool:
    op, bound = target
    return ratio < bound if op == "<" else ratio <= bound


class Level:
    """One level's two sides, built once and stepped in blocks."""

    def __init__(self, args, level: str):
        cfg = compose(task_overrides(args, level))
        start = fp32_model(cfg)  # the weights the runner's model starts from, in fp32
        parts = build_runner(cfg)
        self.level = level
        self.device = parts.device
        self.opt_level = parts.properties.opt_level
        self.kind = handwritten_kind(parts.properties)
        self.kernels = parts.kernels
        self.engine = parts.engine
        self.dynamic = parts.properties.dynamic_loss_scale  # a loss scaler of its own
        trainer, batch = parts.trainer, parts.batch
        self.sides: dict[str, Callable[[], object]] = {
            "runner": lambda: trainer.train_step(*batch),
            "handwritten": handwritten_step(start, cfg, parts.properties, batch),
        }
        self.first_loss = {name: float(step()) for name, step in self.sides.items()}
        self.times: dict[str, list[float]] = {name: [] for name in self.sides}

    def warm_up(self, steps: int) -> None:
        for step in self.sides.values():
            for _ in range(steps):
                step()

    def run_round(self, index: int, block: int) -> None:
        order = list(self.sides) if index % 2 == 0 else list(reversed(self.sides))
        for name in order:
            self.times[name].append(timed_block(self.sides[name], block, self.device)[0])

    def result(self) -> dict:
        runner, hand = self.times["runner"], self.times["handwritten"]
        ratio = statistics.median(runner) / statistics.median(hand)
        paired = [r / h for r, h in zip(runner, hand)]
        p25, p75 = _quartiles(paired)
        target = target_for(self.opt_level)
        return {
            "level": self.level,
            "opt_level": self.opt_level,
            "handwritten": self.kind,
            "kernels": self.kernels,
            "runner_ms": describe(runner),
            "handwritten_ms": describe(hand),
            "ratio": ratio,
            "ratio_of_minima": min(runner) / min(hand),
            "paired_ratio_median": statistics.median(paired),
            "paired_ratio_p25": p25,
            "paired_ratio_p75": p75,
            "target": f"{target[0]} {target[1]:g}",
            "meets_target": meets(ratio, target),
            "first_loss_runner": self.first_loss["runner"],
            "first_loss_handwritten": self.first_loss["handwritten"],
            "runner_skipped_steps": self.engine.skipped_steps,
        }


# ---- report -------------------------------------------------------------------------------------
TARGET_TASK = {"model": "resnet18", "image_size": 32, "batch_size": 64}

HANDWRITTEN_LABELS = {
    "fp32": "plain fp32 loop",
    "autocast": "torch.autocast{scaler}",
    "o2": "16-bit model + fp32 masters (_foreach_copy_, {check}optimizer step, copy back)",
}


def handwritten_label(row: dict, dynamic: bool) -> str:
    label = HANDWRITTEN_LABELS[row["handwritten"]]
    return label.format(
        scaler=" + GradScaler" if dynamic else " (no scaler: bf16)",
        check="unscale+check, " if dynamic else "",
    )


def ratio_verdict(rows: Sequence[dict]) -> str:
    """PASS or MISS, and each level's ratio against its target (lm_parity.py's too)."""
    parts = [
        f"{r['opt_level']} (`{r['level']}`) {r['ratio']:.3f} (target {r['target']}: "
        f"{'meets' if r['meets_target'] else 'misses'})"
        for r in rows
    ]
    head = "PASS" if all(r["meets_target"] for r in rows) else "MISS"
    return f"{head}: runner / hand-written median step time: " + "; ".join(parts) + "."


def verdict(report: dict) -> str:
    task = report["task"]
    text = ratio_verdict(report["results"])
    if any(task[k] != v for k, v in TARGET_TASK.items()):
        text += (
            " (The targets are set for resnet18 on 32x32 inputs at batch 64; this task "
            "differs, so the verdict is informational.)"
        )
    return text


def measure(args: argparse.Namespace, prefix: str = "") -> list[Level]:
    """Every level's two sides built, warmed up and stepped in `args.rounds` interleaved rounds
    (progress printed, each line starting with `prefix`); the levels hold their times."""
    levels = []
    for level in args.levels:
        print(f"{prefix}building {level} ...", flush=True)
        levels.append(Level(args, level))
    for lv in levels:
        lv.warm_up(args.warmup)
    for index in range(args.rounds):
        for lv in levels:
            lv.run_round(index, args.block)
        print(
            f"{prefix}round {index + 1}/{args.rounds}: "
            + ", ".join(
                f"{lv.level} {1e3 * lv.times['runner'][-1]:.1f}/"
                f"{1e3 * lv.times['handwritten'][-1]:.1f} ms"
                for lv in levels
            ),
            flush=True,
        )
    return levels


def table_lines(report: dict, ms: str = ".1f") -> list[str]:
    """The per-level table of a report (`results`, `dynamic_levels`): each side's median step
    time (`ms` its format), the ratios, the target, the first losses; lm_parity.py shows it too."""
    lines = [
        "| level | preset | hand-written loop | runner ms | hand-written ms | ratio | paired "
        "ratio [IQR] | ratio of minima | target | meets | first loss (runner / hand-written) |",
        "|---|---|---|---:|---:|---:|---|---:|---|---|---|",
    ]
    for r in report["results"]:
        dynamic = r["level"] in report["dynamic_levels"]
        lines.append(
            f"| {r['opt_level']} | `{r['level']}` | {handwritten_label(r, dynamic)} | "
            f"{r['runner_ms']['median_ms']:{ms}} | {r['handwritten_ms']['median_ms']:{ms}} | "
            f"{r['ratio']:.3f} | {r['paired_ratio_median']:.3f} [{r['paired_ratio_p25']:.3f}, "
            f"{r['paired_ratio_p75']:.3f}] | {r['ratio_of_minima']:.3f} | {r['target']} | "
            f"{'yes' if r['meets_target'] else '**no**'} | "
            f"{r['first_loss_runner']:.4f} / {r['first_loss_handwritten']:.4f} |"
        )
    return lines


def render(report: dict) -> str:
    t = report["task"]
    rows = report["results"]
    lines = [
        f"# Runner overhead ({report['device']})",
        "",
        f"The runner's training step (`Trainer.train_step` on the objects `runner.run.app.run` "
        f"builds) against a hand-written PyTorch loop doing the same work, {t['model']} on "
        f"{t['image_size']}x{t['image_size']} synthetic inputs at batch {t['batch_size']}"
        f"{', channels-last' if t['channels_last'] else ''}, the same initial weights, the same "
        f"batch in memory and the same optimizer and scheduler settings. {report['rounds']} "
        f"interleaved rounds per level of one {report['block']}-step block per side (the order "
        f"flips every round), after {report['warmup']} warm-up steps per side; times are per "
        "step, medians over the blocks; the ratio is runner / hand-written (below 1: the runner "
        "is faster). The paired ratio is the median of the per-round ratios of adjacent blocks, "
        "with its interquartile range: the spread that load on the machine left. The ratio of "
        "the fastest blocks (minima) is the least disturbed by other processes; the verdict "
        "uses the medians.",
        "",
        *table_lines(report),
    ]
    lines += [
        "",
        f"Verdict: {report['verdict']}",
        "",
        "The first-loss column is the loss of each side's first step, on the same weights and "
        "batch: equal values show that both sides start from the same model and data. The "
        f"runner's kernel backend: {', '.join(sorted({r['kernels'] for r in rows}))} (O0 has "
        "nothing to fuse and steps with its optimizer).",
        "",
        "## Setup",
        "",
        *setup_lines(report),
        "- Runner config (Hydra overrides, per level `precision=<level>`): "
        + " ".join(f"`{o}`" for o in report["overrides"]),
        "",
    ]
    return "\n".join(lines)


CSV_FIELDS = [
    "level",
    "opt_level",
    "handwritten",
    "runner_median_ms",
    "handwritten_median_ms",
    "ratio",
    "paired_ratio_median",
    "paired_ratio_p25",
    "paired_ratio_p75",
    "ratio_of_minima",
    "target",
    "meets_target",
    "samples",
    "first_loss_runner",
    "first_loss_handwritten",
]


def write_outputs(out: Path, report: dict) -> list[Path]:
    rows = [
        {
            **r,
            "runner_median_ms": r["runner_ms"]["median_ms"],
            "handwritten_median_ms": r["handwritten_ms"]["median_ms"],
            "samples": r["runner_ms"]["samples"],
        }
        for r in report["results"]
    ]
    return write_results(out, render(report), rows, CSV_FIELDS, report)


# ---- the instruments at a usual step ------------------------------------------------------------
INSTRUMENTS_TARGET = 0.01  # the instruments at a usual step: at most 1% of the runner's step


def idle_instruments(args: argparse.Namespace) -> dict:
    """What the trainer's instruments cost at a usual step, the step timer's marks alone (no
    other instrument due): a step's points (enter, `after_backward`, `after_step`, exit, then
    `counted`) in a tight loop inside an open epoch, against the same loop without them,
    interleaved; the bytes, hooks and device reads such a step adds; the runner's step for
    scale. The first step is taken first (memory by kind measured, layers audited)."""
    import tracemalloc

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    parts = build_runner(compose(task_overrides(args, args.levels[0])))
    trainer, batch = parts.trainer, parts.batch
    trainer.train_step(*batch)
    trainer.global_step += 1
    instruments, step, calls = trainer.instruments, trainer.global_step + 1, args.calls
    due = [type(i).__name__ for i in instruments.step(step).instruments]
    if any(not i.every_step for i in instruments.step(step).instruments):
        raise RuntimeError(f"{due} are due at step {step}: not a usual step")
    size = batch[1].shape[0]
    instruments.start_epoch(1)

    def watched(n: int = calls) -> float:
        started = time.perf_counter()
        for _ in range(n):
            with instruments.step(step) as watch:
                watch.after_backward()
                watch.after_step(True)
            instruments.counted(step, size, size)
        return (time.perf_counter() - started) / n

    def bare(n: int = calls) -> float:
        started = time.perf_counter()
        for _ in range(n):
            pass
        return (time.perf_counter() - started) / n

    times: dict[str, list[float]] = {"instruments": [], "none": []}
    for index in range(args.rounds):
        for name in ("instruments", "none") if index % 2 == 0 else ("none", "instruments"):
            times[name].append((watched if name == "instruments" else bare)())

    class Reads(TorchDispatchMode):  # host reads of device values (.item(), .tolist(), ...)
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    grown = {}
    for n in (10, 10_000):  # the same peak for 10 and 10,000 steps: a constant, nothing kept
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        with Reads():
            watched(n)
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        grown[n] = (current - base, peak - base)
    with instruments.step(step):
        hooks = sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) for m in trainer.module.modules()
        )
    instruments.steps_done()
    logging.disable(logging.WARNING)  # (this "epoch" is the timing loops: no finding about it)
    try:
        instruments.epoch_metrics()  # (the epoch closed: its marks read and let go)
    finally:
        logging.disable(logging.NOTSET)
    step_s = statistics.median(
        timed_block(lambda: trainer.train_step(*batch), 1, parts.device)[0] for _ in range(5)
    )
    cost = statistics.median(times["instruments"]) - statistics.median(times["none"])
    return {
        "level": args.levels[0],
        "calls": calls,
        "due": ", ".join(due),
        "ns_per_step_instruments": 1e9 * statistics.median(times["instruments"]),
        "ns_per_step_none": 1e9 * statistics.median(times["none"]),
        "ns_per_step_cost": 1e9 * cost,
        "runner_step_ms": 1e3 * step_s,
        "fraction_of_step": cost / step_s,
        "target_fraction": INSTRUMENTS_TARGET,
        "meets_target": cost / step_s <= INSTRUMENTS_TARGET,
        "bytes_kept_after_10": grown[10][0],
        "bytes_kept_after_10000": grown[10_000][0],
        "peak_bytes_10": grown[10][1],
        "peak_bytes_10000": grown[10_000][1],
        "device_reads": Reads.count,
        "hooks_during_an_idle_step": hooks,
    }


def render_instruments(report: dict) -> str:
    r = report["result"]
    verdict = "PASS" if r["meets_target"] else "MISS"
    return "\n".join(
        [
            f"# The trainer's instruments at a usual step ({report['device']})",
            "",
            *setup_lines(report),
            "",
            f"A usual step is one only the every-step instruments are due at ({r['due']}): "
            "its start and end marked, the step's samples counted.",
            "",
            "| per step | ns |",
            "|---|---:|",
            f"| a step's points and count, instruments at a usual step | "
            f"{r['ns_per_step_instruments']:.0f} |",
            f"| the same loop without them | {r['ns_per_step_none']:.0f} |",
            f"| **cost** | **{r['ns_per_step_cost']:.0f}** |",
            "",
            f"The runner's whole step ({report['task']['model']}, `{r['level']}`): "
            f"{r['runner_step_ms']:.2f} ms; the instruments at a usual step are "
            f"{100 * r['fraction_of_step']:.2g}% of it (target: at most "
            f"{100 * r['target_fraction']:.0f}%): **{verdict}**. Over 10 and 10,000 usual steps "
            f"the instruments kept {r['bytes_kept_after_10']} and "
            f"{r['bytes_kept_after_10000']} bytes (traced peak {r['peak_bytes_10']} and "
            f"{r['peak_bytes_10000']}: bounded, the step times folded into a histogram), read "
            f"{r['device_reads']} device values and held {r['hooks_during_an_idle_step']} "
            "module hooks.",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--startup" in argv:  # whole processes instead of steps: benchmarks/startup.py
        from benchmarks import startup

        return startup.main([a for a in argv if a != "--startup"])
    args = parse_args(argv)
    load_start = load_average()
    started = time.perf_counter()
    if args.instruments:
        report = {
            "benchmark": "overhead_instruments",
            "device": args.device,
            "task": {
                "model": args.model,
                "image_size": args.image_size,
                "batch_size": args.batch_size,
            },
            "rounds": args.rounds,
            "result": idle_instruments(args),
            **provenance("overhead", argv, args.device, load_start, started),
        }
        text = render_instruments(report)
        paths = write_results(args.out, text, [report["result"]], list(report["result"]), report)
        show(text, paths)
        return 0
    print(
        f"Runner overhead on {args.device}: {args.model} {args.image_size}px batch "
        f"{args.batch_size}, levels {', '.join(args.levels)}; {args.rounds} rounds of "
        f"{args.block}-step blocks; load average {load_start}",
        flush=True,
    )
    try:
        levels = measure(args)
    except Exception:  # noqa: BLE001  (a crash is reported and the exit status says so)
        traceback.print_exc()
        return 1
    results = [lv.result() for lv in levels]
    report = {
        "benchmark": "overhead",
        "device": args.device,
        "levels": args.levels,
        "task": {
            "model": args.model,
            "image_size": args.image_size,
            "batch_size": args.batch_size,
            "channels_last": args.channels_last,
        },
        "rounds": args.rounds,
        "block": args.block,
        "warmup": args.warmup,
        "dynamic_levels": [lv.level for lv in levels if lv.dynamic],
        "results": results,
        "overrides": task_overrides(args, "<level>"),
        **provenance("overhead", argv, args.device, load_start, started),
    }
    report["verdict"] = verdict(report)
    paths = write_outputs(args.out, report)
    show(render(report), paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
