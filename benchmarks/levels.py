"""Per-level table: throughput, step time and peak memory of each precision level, per model.

Every cell is the runner's real path: the objects `runner.run.app.run` builds for the config
(`common.build_runner`: model, optimizer, scheduler, AmpEngine from the preset, Trainer), stepped
with `Trainer.train_step` on one synthetic batch held in memory on the device (no data loading in
the timing). After warm-up steps, each timed step is device-synchronised; the step time is the
median, throughput is batch / median step time. Peak memory is the runner's own MemoryProbe,
reset before the cell's objects are built (as at the start of a run):
  CUDA: torch.cuda.max_memory_allocated (weights, masters, optimizer state, activations, batch).
  CPU:  the training state counted from the tensors on the trainer's first step (weights,
        masters, gradients, optimizer state, activations saved for backward: runner.measure.memory),
        which does not depend on what earlier cells left in the process. The hand-written
        torch_amp row, which the trainer does not step, reports the process's peak resident
        memory above its resident memory at the reset instead (VmHWM, Linux; freed memory of
        the previous cell handed back to the OS first with malloc_trim), a coarser figure that
        is not compared with O0's.

The `torch_amp` row is not a runner level: it is overhead.py's hand-written torch.autocast +
torch.amp.GradScaler loop (bf16 without a scaler on CPU) on the same model, data and optimizer,
the reference the O2 target is judged against.

A level `<preset>+compile` is the preset with `trainer.compile=true` (the model compiled in place,
as a run compiles it). Its first step, which compiles the training forward and backward, is timed
on its own and kept out of the step time: `compile_s` is that first step's time minus the median
step time. torch.compile's on-disk cache starts empty (a new TORCHINDUCTOR_CACHE_DIR per process
unless one is set), so compiles are cold. By default compiled rows are measured for one model per
device (COMPILE_MODELS: ResNet-18 on CPU, ResNet-50 and ViT-B/16 on CUDA): compiling a model
takes tens of seconds to minutes. A model is a model config option or `<zoo>:<arch>`
(`torchvision:vit_b_16` -> `model=torchvision model.arch=vit_b_16`).

    python -m benchmarks.levels                     # CPU: 32 px, O0 + bf16, 2 compiled cells
    python -m benchmarks.levels --device cuda --models resnet18,resnet50
    python -m benchmarks.levels --device cuda --models densenet161,vgg16_bn --merge
    python -m benchmarks.levels --device cuda --models torchvision:vit_b_16 --merge
    python -m benchmarks.levels --from-json a.json b.json --out results/levels_cuda.md

(gpu_suite.sh splits the GPU table into commands that each fit a 10-minute device call.)

GPU defaults: 224x224, batch 128 (256 for resnet18), channels_last and cudnn.benchmark on, TF32
off (the fp32 baseline is true fp32), 10 warm-up and 30 timed steps per cell: the whole table runs
as several commands of a few minutes each (model groups, each merged into the previous results;
see gpu_suite.sh). Targets (H100/H200, ResNet-50 at
224x224, batch 128): O1 and O2 at least 2x O0's throughput; O2 peak memory at most 0.6x O0's;
O2 not slower than torch_amp. Outputs: Markdown, CSV, JSON and a PNG figure (grouped bars).
Exit 0 whatever the verdict; 1 if a cell crashed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    COMPILE_SUFFIX,
    add_device_option,
    add_extra_option,
    add_out_option,
    add_threads_option,
    apply_threads,
    build_runner,
    check_at_least_one,
    command,
    compose,
    csv_list,
    describe_level,
    fresh_compile_cache,
    is_language_model,
    load_average,
    machine,
    model_label,
    model_problem,
    now,
    one_batch_task,
    parse_level,
    resolve_device,
    results_path,
    save_figure,
    show,
    write_results,
)
from benchmarks.overhead import handwritten_step, timed_block

MODELS = ["resnet18", "resnet50", "densenet161", "vgg16_bn"]
VIT = "torchvision:vit_b_16"  # the ViT of the GPU table (model=torchvision model.arch=vit_b_16)
HANDWRITTEN = "torch_amp"
CUDA_LEVELS = [
    "o0",
    "o1",
    "o2",
    "o3",
    "o1_bf16",
    "o2_bf16",
    "o3_bf16",
    "o1_fp8",
    "o2_fp8",
    HANDWRITTEN,
]
CPU_LEVELS = ["o0", "o1_bf16", "o2_bf16", "o3_bf16"]
# compiled rows, by default for these models only (compiling a model takes tens of seconds on a
# GPU machine, a minute or more on a small CPU)
CUDA_COMPILE_LEVELS = [
    "o0+compile",
    "o1_bf16+compile",
    "o2_bf16+compile",
    "o1_fp8+compile",
    "o2_fp8+compile",
]
CPU_COMPILE_LEVELS = ["o0+compile", "o2_bf16+compile"]
COMPILE_MODELS = {"cuda": ["resnet50", VIT], "cpu": ["resnet18"]}
_EAGER = ["o0", "o1", "o2", "o3", "o1_bf16", "o2_bf16", "o3_bf16", "o3_bf16_sr", "o1_fp8", "o2_fp8"]
LEVEL_ORDER = [*_EAGER, HANDWRITTEN, *(f"{lvl}{COMPILE_SUFFIX}" for lvl in _EAGER)]
DEFAULTS = {
    "cuda": {"image_size": 224, "steps": 30, "warmup": 10, "channels_last": True},
    "cpu": {"image_size": 32, "steps": 3, "warmup": 1, "channels_last": False},
}
# The GPU targets, judged on ResNet-50 at 224x224, batch 128, on an H100/H200.
TARGET_MODEL, TARGET_SIZE, TARGET_BATCH = "resnet50", 224, 128
TARGET_SPEEDUP, TARGET_MEMORY = 2.0, 0.6
# The fp8 target: compiled o1_fp8 at least this multiple of compiled o1_bf16, on the ViT
FP8_MODEL, FP8_TARGET = VIT, 1.2


def default_batch(device: str, model: str) -> int:
    if device == "cuda":
        return 256 if model == "resnet18" else 128
    return 64


def default_levels(device: str, model: str) -> list[str]:
    """The levels measured for `model` when --levels is not given: every level of the device,
    and the compiled rows for the models of COMPILE_MODELS."""
    levels = CUDA_LEVELS if device == "cuda" else CPU_LEVELS
    if model in COMPILE_MODELS[device]:
        levels = [*levels, *(CUDA_COMPILE_LEVELS if device == "cuda" else CPU_COMPILE_LEVELS)]
    return levels


def handwritten_preset(device: str) -> str:
    """The preset whose settings the torch_amp row takes: fp16 with a scaler on CUDA, bf16 on
    CPU (fp16 is emulated there)."""
    return "o1" if device == "cuda" else "o1_bf16"


# ---- arguments ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.levels",
        description="Per-level table: throughput, step time and peak memory of each precision "
        "level per model, on the runner's real training step; Markdown, CSV, JSON and a PNG.",
    )
    add_device_option(p)
    p.add_argument(
        "--models",
        type=csv_list,
        default=None,
        help=f"comma-separated model options, or <zoo>:<arch> (e.g. {VIT}) "
        f"(default {','.join(MODELS)})",
    )
    p.add_argument(
        "--levels",
        type=csv_list,
        default=None,
        help=f"comma-separated presets, each optionally with {COMPILE_SUFFIX} "
        f"(trainer.compile=true), and {HANDWRITTEN} for the hand-written autocast "
        f"loop, for every model (default: CUDA {','.join(CUDA_LEVELS)}; CPU "
        f"{','.join(CPU_LEVELS)}; plus, for {', '.join(COMPILE_MODELS['cuda'])} on "
        f"CUDA, {','.join(CUDA_COMPILE_LEVELS)}, and for "
        f"{', '.join(COMPILE_MODELS['cpu'])} on CPU, {','.join(CPU_COMPILE_LEVELS)})",
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="synthetic image side (default 224 on CUDA, 32 on CPU)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch size for every model (default: CUDA 128, 256 for resnet18; CPU 64)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per cell (default 30 on CUDA, 3 on CPU)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps per cell first (default 10 on CUDA, 1 on CPU)",
    )
    p.add_argument(
        "--channels-last",
        choices=["on", "off"],
        default=None,
        help="trainer.channels_last (default on for CUDA, off for CPU)",
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 for fp32 matmuls/convolutions on CUDA (default off: O0 is true fp32)",
    )
    add_out_option(p, "levels", beside=".csv, .json and .png")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the cells of an existing --out JSON (same device) that this run "
        "does not measure, so that several commands fill one table",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: merge these results files (later ones win per cell) "
        "and write the table and figure to --out",
    )
    add_extra_option(p, "more Hydra overrides for every cell, applied last")
    p.add_argument(
        "--no-prime",
        dest="prime",
        action="store_false",
        help="skip the throwaway pass before the first cell (quicker; one-time "
        "initialisation, torch.compile's start-up included, then lands in the first "
        "cells' figures)",
    )
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(p, args)

    if args.from_json:
        missing = [str(f) for f in args.from_json if not f.is_file()]
        if missing:
            p.error(f"--from-json: no such file: {', '.join(missing)}")
        files = [json.loads(f.read_text()) for f in args.from_json]
        devices = {d.get("device") for d in files}
        if len(devices) != 1:
            p.error(f"--from-json: the files are from different devices ({devices})")
        args.device = devices.pop()
        gpu = next((r["machine"].get("gpu", "") for d in files for r in d.get("runs", [])), "")
        args.out = args.out or results_path(f"levels_{args.device}.md", args.device, gpu)
        return args

    from runner.run.plan import preset_options

    args.device = resolve_device(p, args.device)
    d = DEFAULTS[args.device]
    args.image_size = d["image_size"] if args.image_size is None else args.image_size
    args.steps = d["steps"] if args.steps is None else args.steps
    args.warmup = d["warmup"] if args.warmup is None else args.warmup
    args.channels_last = (
        d["channels_last"] if args.channels_last is None else args.channels_last == "on"
    )
    check_at_least_one(p, args, ("image_size", "steps", "batch_size"))
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    args.models = list(dict.fromkeys(args.models or MODELS))
    for model in args.models:
        problem = model_problem(model)
        if problem:
            p.error(f"unknown model {model!r}: {problem}")
    known = preset_options()
    levels = {
        model: list(dict.fromkeys(args.levels or default_levels(args.device, model)))
        for model in args.models
    }
    for level in dict.fromkeys(lvl for lvls in levels.values() for lvl in lvls):
        if level == HANDWRITTEN:
            continue
        try:
            spec = parse_level(level, known)
        except ValueError as error:
            p.error(f"{error}, or {HANDWRITTEN}")
        if spec.state is not None:  # (accuracy.py and lm_parity.py have optimizer-state rows)
            p.error(
                f"{level!r}: this benchmark times the levels with their own optimizer "
                "state; the only suffix here is +compile"
            )
    args.levels = levels  # per model
    args.out = args.out or results_path(f"levels_{args.device}.md", args.device)
    if args.merge and args.out.with_suffix(".json").is_file():
        previous = json.loads(args.out.with_suffix(".json").read_text())
        if previous.get("device") != args.device:
            p.error(
                f"--merge: {args.out.with_suffix('.json')} holds {previous.get('device')} "
                f"results, not {args.device}"
            )
    return args


def cell_overrides(args, model: str, level: str) -> list[str]:
    """The cell's Hydra overrides; `level` a preset or `<preset>+compile`."""
    batch = args.batch_size or default_batch(args.device, model)
    preset, plus, _ = level.partition("+")
    return [
        *one_batch_task(model, args.image_size, batch, args.device),
        f"trainer.channels_last={str(args.channels_last).lower()}",
        "trainer.cudnn_benchmark=true",
        f"precision={preset}",
        *(["trainer.compile=true"] if plus else []),
        *args.extra,
    ]


# ---- measuring ----------------------------------------------------------------------------------
def release_memory(device) -> None:
    """Free the previous cell's memory before the next reset, so that its peak is the new cell's:
    the CUDA cache emptied; on CPU glibc's free lists handed back to the OS (else a later cell
    reuses resident memory and its peak above the reset under-counts)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_cell(args, model: str, level: str, batches: dict) -> dict:
    """One (model, level): build, warm up, time `args.steps` steps, read the peak memory."""
    import torch

    from runner.errors import ConfigError

    compiled = level.endswith(COMPILE_SUFFIX)
    preset = (
        handwritten_preset(args.device)
        if level == HANDWRITTEN
        else level.removesuffix(COMPILE_SUFFIX)
    )
    batch_size = args.batch_size or default_batch(args.device, model)
    cell = {
        "model": model,
        "level": level,
        "preset": preset,
        "compiled": compiled,
        "batch_size": batch_size,
        "image_size": args.image_size,
        "channels_last": args.channels_last,
        "steps": args.steps,
        "warmup": args.warmup,
        "status": "ok",
        "error": None,
    }
    device = torch.device(args.device)
    release_memory(device)
    if compiled:  # no compiled code of an earlier cell reused (nor counted towards its limit)
        torch._dynamo.reset()
    if device.type == "cuda":  # what earlier cells left behind (should be ~0): in the peak too
        cell["allocated_before_mb"] = torch.cuda.memory_allocated(device) / 2**20
    try:
        cfg = compose(cell_overrides(args, model, preset + (COMPILE_SUFFIX if compiled else "")))
        cell["opt_level"] = str(cfg.precision.opt_level)
        cell["dtype"] = describe_level(cfg.precision, compiled)
        key = (args.image_size, batch_size)
        parts = build_runner(cfg, cpu_batch=batches.get(key))
        batches[key] = parts.cpu_batch
        cell["kernels"] = parts.kernels
        if level == HANDWRITTEN:
            # the O1 engine leaves the model as built (fp32, no hooks): the loop takes it over
            step = handwritten_step(parts.model, cfg, parts.properties, parts.batch)
            cell["opt_level"] = "-"
            cell["dtype"] = (
                f"float32 weights, torch.autocast {parts.properties.autocast_dtype}".replace(
                    "torch.", ""
                )
                + (" + GradScaler" if parts.properties.dynamic_loss_scale else "")
            )
        else:
            trainer, batch = parts.trainer, parts.batch
            step = lambda: trainer.train_step(*batch)  # noqa: E731
        if parts.engine.fp8 is not None:  # Linear layers running in fp8 (precision.fp8_layers)
            cell["fp8_layers"] = len(parts.engine.fp8.converted)
        # The first step on its own: a compiled cell compiles the training forward and backward
        # there (it is also the first warm-up step; a compiled cell takes it even with
        # --warmup 0, so that compiling never lands in the timed steps)
        warmup = args.warmup
        if warmup > 0 or compiled:
            first, _ = timed_block(step, 1, device)
            cell["first_step_ms"] = 1e3 * first
            warmup = max(warmup - 1, 0)
            cell["warmup"] = max(args.warmup, 1)
        for _ in range(warmup):
            step()
        times = []
        for _ in range(args.steps):
            seconds, loss = timed_block(step, 1, device)
            times.append(seconds)
        loss = float(loss)
        median = statistics.median(times)
        peak, kind = parts.memory.peak_mb(), parts.memory.kind
        if math.isnan(peak):  # on a CPU, a loop the runner's trainer never stepped (torch_amp)
            peak, kind = parts.memory.rss_growth_mb(), parts.memory.rss_kind
        cell["memory_kind"] = kind
        cell.update(
            {
                "step_ms": 1e3 * median,
                "step_ms_min": 1e3 * min(times),
                "step_ms_max": 1e3 * max(times),
                "samples_per_s": batch_size / median,
                "peak_mem_mb": peak,
                "final_loss_finite": math.isfinite(loss),
                "skipped_steps": parts.engine.skipped_steps if level != HANDWRITTEN else None,
            }
        )
        if compiled:  # compiling: the first step's time beyond a compiled step's
            cell["compile_s"] = max(cell["first_step_ms"] - cell["step_ms"], 0.0) / 1e3
    except ConfigError as error:  # e.g. bf16 on a GPU before Ampere: an outcome, not a crash
        cell["status"], cell["error"] = "refused", str(error)
    except torch.cuda.OutOfMemoryError as error:
        cell["status"], cell["error"] = "out of memory", str(error).splitlines()[0]
    except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
        cell["status"], cell["error"] = "crashed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return cell  # the cell's objects go with this frame; the next cell releases their memory


# ---- merging and reporting ----------------------------------------------------------------------
def merge(reports: list[dict]) -> dict:
    """One report from several (same device): later reports' cells replace earlier ones with the
    same (model, level); every contributing run (command, date, machine) is kept."""
    runs: list[dict] = []
    cells: dict[tuple[str, str], dict] = {}
    for report in reports:
        offset = len(runs)
        runs.extend(report["runs"])
        for cell in report["cells"]:
            cells[(cell["model"], cell["level"])] = {**cell, "run": cell["run"] + offset}
    used = sorted({c["run"] for c in cells.values()})
    renumber = {old: new for new, old in enumerate(used)}
    ordered = sorted(
        cells.values(),
        key=lambda c: (
            MODELS.index(c["model"]) if c["model"] in MODELS else len(MODELS),
            c["model"],
            LEVEL_ORDER.index(c["level"]) if c["level"] in LEVEL_ORDER else len(LEVEL_ORDER),
        ),
    )
    return {
        "benchmark": "levels",
        "device": reports[-1]["device"],
        "runs": [runs[i] for i in used],
        "cells": [{**c, "run": renumber[c["run"]]} for c in ordered],
    }


def _ok(cell: dict | None) -> bool:
    return cell is not None and cell["status"] == "ok"


def relative(cells: list[dict]) -> None:
    """Throughput and peak memory as multiples of the same model's O0 cell (when measured); a
    compiled cell's throughput also as a multiple of its preset's eager cell (compile on/off)."""
    base = {c["model"]: c for c in cells if c["level"] == "o0" and _ok(c)}
    by_level = {(c["model"], c["level"]): c for c in cells if _ok(c)}
    for c in cells:
        b = base.get(c["model"])
        ok = _ok(c) and b is not None
        c["speedup_vs_o0"] = c["samples_per_s"] / b["samples_per_s"] if ok else None
        c["memory_vs_o0"] = (
            c["peak_mem_mb"] / b["peak_mem_mb"]
            if ok and b["peak_mem_mb"] > 0 and c["memory_kind"] == b["memory_kind"]
            else None
        )
        if c["level"].endswith(COMPILE_SUFFIX):
            eager = by_level.get((c["model"], c["level"].removesuffix(COMPILE_SUFFIX)))
            c["speedup_vs_eager"] = (
                c["samples_per_s"] / eager["samples_per_s"]
                if _ok(c) and eager is not None
                else None
            )


def compile_summary(cells: list[dict]) -> str:
    """`torch.compile against the same preset eager: <model>: <preset> 1.10x, ...`, or ''."""
    parts = []
    for model in dict.fromkeys(c["model"] for c in cells):
        ratios = [
            f"{c['level'].removesuffix(COMPILE_SUFFIX)} {c['speedup_vs_eager']:.2f}x"
            for c in cells
            if c["model"] == model and c.get("speedup_vs_eager") is not None
        ]
        if ratios:
            parts.append(f"{model_label(model)}: " + ", ".join(ratios))
    return (
        (" torch.compile, throughput against the same preset eager: " + "; ".join(parts) + ".")
        if parts
        else ""
    )


def verdict(report: dict) -> str:
    cells = {(c["model"], c["level"]): c for c in report["cells"]}
    if report["device"] != "cuda":
        parts = []
        for model in dict.fromkeys(c["model"] for c in report["cells"]):
            speedups = [
                f"{c['level']} {c['speedup_vs_o0']:.2f}x"
                for c in report["cells"]
                if c["model"] == model and c["level"] != "o0" and c.get("speedup_vs_o0") is not None
            ]
            if speedups:
                parts.append(f"{model_label(model)}: " + ", ".join(speedups))
        return (
            "NO TARGETS on CPU (the levels' targets are for ResNet-50 on an H100/H200). "
            "Throughput against O0: "
            + ("; ".join(parts) or "no O0 baseline")
            + "."
            + compile_summary(report["cells"])
        )
    o0, o1, o2, amp = (cells.get((TARGET_MODEL, lvl)) for lvl in ("o0", "o1", "o2", HANDWRITTEN))
    if not (_ok(o0) and _ok(o1) and _ok(o2) and _ok(amp)):
        return (
            f"NOT JUDGED: the targets need {TARGET_MODEL}'s o0, o1, o2 and {HANDWRITTEN} "
            "cells, and some are missing or failed."
            + fp8_verdict(cells)
            + compile_summary(report["cells"])
        )
    checks = [
        (
            f"O1 {o1['speedup_vs_o0']:.2f}x O0 throughput (>= {TARGET_SPEEDUP:g}x)",
            o1["speedup_vs_o0"] >= TARGET_SPEEDUP,
        ),
        (
            f"O2 {o2['speedup_vs_o0']:.2f}x O0 throughput (>= {TARGET_SPEEDUP:g}x)",
            o2["speedup_vs_o0"] >= TARGET_SPEEDUP,
        ),
        (
            f"O2 peak memory {o2['memory_vs_o0']:.2f}x O0 (<= {TARGET_MEMORY:g}x)",
            o2["memory_vs_o0"] <= TARGET_MEMORY,
        ),
        (
            f"O2 {o2['samples_per_s'] / amp['samples_per_s']:.2f}x the hand-written autocast + "
            "GradScaler loop's throughput (>= 1)",
            o2["samples_per_s"] >= amp["samples_per_s"],
        ),
    ]
    head = "PASS" if all(ok for _, ok in checks) else "MISS"
    text = (
        f"{head} ({TARGET_MODEL}): "
        + "; ".join(f"{label}: {'meets' if ok else 'misses'}" for label, ok in checks)
        + "."
    )
    gpu = report["runs"][o2["run"]]["machine"].get("gpu", "")
    if (o0["image_size"], o0["batch_size"]) != (TARGET_SIZE, TARGET_BATCH) or not any(
        name in gpu for name in ("H100", "H200")
    ):
        text += (
            f" (The targets are set for an H100/H200 at {TARGET_SIZE}x{TARGET_SIZE}, batch "
            f"{TARGET_BATCH}; this setting differs, so the verdict is informational.)"
        )
    return text + fp8_verdict(cells) + compile_summary(report["cells"])


def fp8_verdict(cells: dict) -> str:
    """' fp8 (ViT-B/16): compiled o1_fp8 N.NNx compiled o1_bf16 (>= 1.2x): meets/misses.' where
    both compiled cells of the ViT were measured, else ''."""
    fp8, bf16 = (cells.get((FP8_MODEL, f"{lvl}{COMPILE_SUFFIX}")) for lvl in ("o1_fp8", "o1_bf16"))
    if not (_ok(fp8) and _ok(bf16)):
        return ""
    ratio = fp8["samples_per_s"] / bf16["samples_per_s"]
    return (
        f" fp8 ({model_label(FP8_MODEL)}): compiled o1_fp8 {ratio:.2f}x compiled o1_bf16's "
        f"throughput (>= {FP8_TARGET:g}x): {'meets' if ratio >= FP8_TARGET else 'misses'}."
    )


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def render(report: dict) -> str:
    device = report["device"]
    memory_note = (
        "CUDA `max_memory_allocated`, reset per cell"
        if device == "cuda"
        else "the training state counted from the tensors (MemoryProbe, `cpu_tensor_accounted`: "
        "weights, masters, gradients, optimizer state and the activations saved for backward in "
        "one step, runner.measure.memory); the hand-written `torch_amp` row, which the runner's "
        "trainer "
        "does not step, has the process's peak resident memory above its resident memory when "
        "the cell started instead (`cpu_rss_peak_above_start`), not compared with O0's"
    )
    first = report["runs"][0] if report["runs"] else {}
    lines = [
        f"# Precision levels: throughput and memory ({device})",
        "",
        "Each cell is the runner's training step (`Trainer.train_step` on the objects "
        "`runner.run.app.run` builds) on one synthetic batch in memory: median step time over the "
        "timed steps (device-synchronised), throughput = batch / median step time, peak memory "
        f"= {memory_note}. `torch_amp` is a hand-written torch.autocast loop (+ GradScaler for "
        "fp16) on the same model, data and optimizer, for comparison. "
        + (
            "fp32 TF32 is off, so O0 is true fp32. "
            if device == "cuda" and not first.get("settings", {}).get("tf32")
            else ""
        )
        + "`x O0` columns are relative to the same model's O0 cell (eager). A throwaway pass "
        "(the tiny model, one step per level) runs before the first cell, so that one-time "
        "initialisation is charged to no cell"
        + (
            ""
            if all(r["settings"].get("primed", True) for r in report["runs"])
            else " (skipped in a run with --no-prime: see Setup)"
        )
        + ".",
        "",
        "| model | level | preset | dtype | image | batch | step ms | samples/s | x O0 "
        "throughput | peak MB | x O0 memory | compile s | note |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in report["cells"]:
        note = c["status"] if c["status"] != "ok" else ""
        if c["status"] == "ok" and not c.get("final_loss_finite", True):
            note = "loss non-finite (timing still valid)"
        if c.get("skipped_steps"):
            note = (note + "; " if note else "") + f"{c['skipped_steps']} skipped"
        if c.get("fp8_layers") is not None:
            note = (note + "; " if note else "") + f"{c['fp8_layers']} Linear layers in fp8"
        lines.append(
            f"| {model_label(c['model'])} | {c.get('opt_level', '?')} | `{c['level']}` | "
            f"{c.get('dtype', '?')} | {c['image_size']} | {c['batch_size']} | "
            f"{_fmt(c.get('step_ms'), '.1f')} | "
            f"{_fmt(c.get('samples_per_s'), '.0f')} | {_fmt(c.get('speedup_vs_o0'), '.2f', 'x')}"
            f" | {_fmt(c.get('peak_mem_mb'), '.0f')} | "
            f"{_fmt(c.get('memory_vs_o0'), '.2f', 'x')} | {_fmt(c.get('compile_s'), '.1f')} | "
            f"{note} |"
        )
    lines += ["", f"Verdict: {report['verdict']}", ""]
    if any(c.get("compiled") for c in report["cells"]):
        caches = {r["settings"].get("compile_cache") for r in report["runs"]} - {None}
        lines += [
            f"`<preset>{COMPILE_SUFFIX}`: the preset with `trainer.compile=true` (the model "
            "compiled in place, as a run compiles it; the engine's step stays eager). Its first "
            "step compiles the training forward and backward and is kept out of the timed "
            "steps; compile s = that first step's time minus the median step time. "
            "torch.compile's cache: "
            + ("; ".join(sorted(caches)) or "not recorded")
            + "."
            + (
                " On a CPU a compiled cell's peak memory also counts what compiling held in the "
                "process."
                if device != "cuda"
                else ""
            ),
            "",
        ]
    if any(c.get("fp8_layers") is not None for c in report["cells"]):
        lines += [
            "fp8 rows: the note gives how many Linear layers ran their GEMMs in fp8 (torchao "
            "converts those whose sizes are multiples of 16; convolutions stay in bf16)"
            + (
                "; on a CPU fp8 is emulated: no speed-up is expected"
                if device != "cuda"
                else "; without compilation torchao's fp8 is expected to be slower than bf16 (the "
                "runner warns), so compare the `+compile` rows"
            )
            + ".",
            "",
        ]
    failed = [c for c in report["cells"] if c["status"] != "ok"]
    if failed:
        lines += ["Cells without figures:", ""]
        lines += [f"- {c['model']} `{c['level']}`: {c['status']}: {c['error']}" for c in failed]
        lines.append("")
    lines += ["## Setup", ""]
    for i, run in enumerate(report["runs"]):
        m = run["machine"]
        s = run["settings"]
        models = sorted({model_label(c["model"]) for c in report["cells"] if c["run"] == i})
        lines += [
            f"- Run {i + 1} ({', '.join(models)}): {m['cpu']}, {m['cores']} cores (torch uses "
            f"{m['torch_threads']} threads)"
            + (f"; GPU {m['gpu']}, CUDA {m['cuda']}" if "gpu" in m else "")
            + f"; torch {m['torch']}, Python {m['python']}",
            f"  - {s['warmup']} warm-up + {s['steps']} timed steps per cell; channels_last "
            f"{'on' if s['channels_last'] else 'off'}; cudnn.benchmark on"
            + ("" if s.get("primed", True) else "; no throwaway pass (--no-prime)")
            + (f"; TF32 {'on' if s.get('tf32') else 'off'}" if device == "cuda" else ""),
            f"  - Load average (1, 5, 15 min): {run['load_start']} at start, {run['load_end']} "
            f"at end; date {run['date']}; wall time {run['wall_s']:.0f} s",
            f"  - Command: `{run['command']}`",
        ]
    if report["runs"]:
        lines += [
            "- Config per cell (Hydra overrides): "
            + " ".join(f"`{o}`" for o in report["runs"][-1]["overrides"])
        ]
    lines.append("")
    return "\n".join(lines)


def figure(report: dict, path: Path) -> Path | None:
    """Grouped bars, one group (column) per model with its own scale, since models differ by an
    order of magnitude: throughput (top row) and peak memory (bottom row) per level, each bar
    labelled with its multiple of the model's O0; a compiled level takes its preset's colour,
    cross-hatched. None (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no figure (render one later with --from-json)",
            file=sys.stderr,
        )
        return None
    cells = [c for c in report["cells"] if _ok(c)]
    if not cells:
        return None
    models = list(dict.fromkeys(c["model"] for c in cells))
    levels = [lvl for lvl in LEVEL_ORDER if any(c["level"] == lvl for c in cells)]
    levels += sorted({c["level"] for c in cells} - set(levels))
    presets = list(dict.fromkeys(lvl.removesuffix(COMPILE_SUFFIX) for lvl in levels))
    palette = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(presets)}
    color = {lvl: palette[lvl.removesuffix(COMPILE_SUFFIX)] for lvl in levels}
    hatch = {
        lvl: "//" if lvl == HANDWRITTEN else "xx" if lvl.endswith(COMPILE_SUFFIX) else ""
        for lvl in levels
    }
    most = max(sum(c["model"] == m for c in cells) for m in models)
    fig, axes = plt.subplots(
        2, len(models), figsize=(2.0 + max(2.6, 0.32 * most) * len(models), 6.5), squeeze=False
    )
    rows = (
        ("samples_per_s", "speedup_vs_o0", "throughput (samples/s)"),
        ("peak_mem_mb", "memory_vs_o0", "peak memory (MB)"),
    )
    for col, model in enumerate(models):
        mine = [c for lvl in levels for c in cells if c["model"] == model and c["level"] == lvl]
        for row, (key, rel, label) in enumerate(rows):
            ax = axes[row][col]
            xs = range(len(mine))
            bars = ax.bar(
                xs,
                [c[key] for c in mine],
                color=[color[c["level"]] for c in mine],
                edgecolor="white",
                hatch=[hatch[c["level"]] for c in mine],
            )
            for bar, c in zip(bars, mine):
                if c.get(rel) is not None:
                    ax.annotate(
                        f"{c[rel]:.2f}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
            ax.set_xticks(list(xs), [c["level"] for c in mine], rotation=45, ha="right", fontsize=8)
            ax.margins(y=0.12)
            ax.grid(axis="y", alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{model_label(model)}, batch {mine[0]['batch_size']}", fontsize=10)
    run = report["runs"][-1]
    where = run["machine"].get("gpu") or run["machine"]["cpu"]
    sizes = "/".join(str(s) for s in sorted({c["image_size"] for c in cells}))
    fig.suptitle(
        f"Precision levels on {report['device']} ({where})\n{sizes} px synthetic "
        "inputs; bar labels: multiple of the model's O0"
        + ("; cross-hatched: +compile" if any(c.get("compiled") for c in cells) else ""),
        fontsize=11,
    )
    return save_figure(fig, path)


CSV_FIELDS = [
    "model",
    "level",
    "preset",
    "compiled",
    "opt_level",
    "dtype",
    "image_size",
    "batch_size",
    "channels_last",
    "status",
    "step_ms",
    "samples_per_s",
    "speedup_vs_o0",
    "speedup_vs_eager",
    "peak_mem_mb",
    "memory_vs_o0",
    "first_step_ms",
    "compile_s",
    "fp8_layers",
    "memory_kind",
    "kernels",
    "steps",
    "warmup",
    "run",
]


def write_outputs(out: Path, report: dict, with_figure: bool = True) -> list[Path]:
    relative(report["cells"])
    report["verdict"] = verdict(report)
    paths = write_results(out, render(report), report["cells"], CSV_FIELDS, report)
    if with_figure:
        png = figure(report, out.with_suffix(".png"))
        if png is not None:
            paths.append(png)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.from_json:
        report = merge([json.loads(f.read_text()) for f in args.from_json])
        paths = write_outputs(args.out, report)
        show(render(report), paths)
        return 0

    import torch

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    previous = []
    json_path = args.out.with_suffix(".json")
    if args.merge and json_path.is_file():
        previous = [json.loads(json_path.read_text())]
    every_level = list(dict.fromkeys(lvl for lvls in args.levels.values() for lvl in lvls))
    compiling = [lvl for lvl in every_level if lvl.endswith(COMPILE_SUFFIX)]
    run = {
        "command": command("levels", argv),
        "date": now(),
        "machine": machine(args.device),
        "load_start": load_average(),
        "load_end": None,
        "wall_s": 0.0,
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "channels_last": args.channels_last,
            "tf32": args.tf32,
            "primed": args.prime,
            "compile_cache": fresh_compile_cache() if compiling else None,
        },
        # the first model's data stands for the others of its kind (images, or token sequences)
        "overrides": [
            o if not o.startswith("model=") else "model=<model>"
            for o in cell_overrides(args, next(iter(args.levels)), "<level>")
            if not o.startswith("model.arch=")
        ],
    }
    total = sum(len(lvls) for lvls in args.levels.values())
    print(
        f"Levels on {args.device}: "
        + "; ".join(f"{model} x {', '.join(lvls)}" for model, lvls in args.levels.items())
        + f" at {args.image_size} px, {args.warmup}+{args.steps} steps per cell; load average "
        f"{run['load_start']}",
        flush=True,
    )
    started = time.perf_counter()
    cells: list[dict] = []
    batches: dict = {}
    # A throwaway pass first (the tiny model, one step per level; of the compiled levels only
    # the first), so that one-time initialisation (thread pools, oneDNN/cuDNN/cuBLAS handles and
    # workspaces, the kernels' load, torch.compile's own start-up) is charged to no cell's time
    # or peak memory.
    # The primer's batch is one larger than the cells', so that no cell's graph is in
    # torch.compile's cache from it.
    # A language model's table is primed with the tiny GPT (its task, data and --extra keys:
    # model.vocab_size does not exist on the tiny CNN).
    tiny = "gpt_tiny" if is_language_model(args.models[0]) else "tiny"
    primer = argparse.Namespace(
        **{
            **vars(args),
            "steps": 1,
            "warmup": 0,
            "batch_size": (args.batch_size or default_batch(args.device, tiny)) + 1,
        }
    )
    if args.prime:
        for level in [lvl for lvl in every_level if lvl not in compiling] + compiling[:1]:
            primed = measure_cell(primer, tiny, level, batches)
            if primed["status"] != "ok":  # one-time start-up would land in the first cell
                print(
                    f"the throwaway pass's {tiny} {level} {primed['status']}: {primed['error']}",
                    flush=True,
                )
        print(f"primed in {time.perf_counter() - started:.0f} s", flush=True)
    for model in args.models:
        for level in args.levels[model]:
            print(f"[{len(cells) + 1}/{total}] {model} {level} ...", end=" ", flush=True)
            cell = measure_cell(args, model, level, batches)
            cell["run"] = 0
            cells.append(cell)
            if cell["status"] == "ok":
                compiled = (
                    ""
                    if cell.get("compile_s") is None
                    else f", compiled in {cell['compile_s']:.1f} s"
                )
                print(
                    f"{cell['step_ms']:.1f} ms/step, {cell['samples_per_s']:.0f} samples/s, "
                    f"peak {cell['peak_mem_mb']:.0f} MB{compiled}",
                    flush=True,
                )
            else:
                print(f"{cell['status']}: {cell['error']}", flush=True)
            # results after every cell: a command stopped at its time limit keeps what it measured
            run["load_end"], run["wall_s"] = load_average(), time.perf_counter() - started
            report = merge([*previous, {"device": args.device, "runs": [run], "cells": cells}])
            write_outputs(args.out, report, with_figure=False)
    paths = write_outputs(args.out, report)
    show(render(report), paths)
    return 1 if any(c["status"] == "crashed" for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
