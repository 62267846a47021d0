"""Where one training step's time goes, per level: the runner's step (`Trainer.train_step` on the
objects a run builds, one batch kept in memory) under torch.profiler, its device time by kind of
work, and how much of the step's wall time the device is busy.

    python -m benchmarks.profile_step --device cuda   # densenet161, 224 px, batch 64, o0 and o2
    python -m benchmarks.profile_step --device cuda --extra trainer.channels_last=true
    python -m benchmarks.profile_step --device cpu --model tiny --image-size 16 --batch-size 8

Why: on an H200 (2026-11-28) DenseNet-161 trained no faster at O2 than at O0 (103 ms a step
each, the loader idle), where ResNet-50's O2 is 5x O0. Either the host bounds the step (the GPU
waits for launches: busy well under the wall time) or the device time goes to work that 16 bits
do not speed up (normalisation, concatenation, copies, casts rather than convolutions); the
table says which.

Each device kernel's time is charged to the outermost ATen operator that launched it (a
convolution's backward to `aten::convolution_backward`, every kernel of a batch norm to
`aten::batch_norm`), and the operator to a kind by its name (`KINDS`). Kernels launched outside
any ATen operator (the runner's fused optimizer kernels) are their own kind. On a CPU the
"device" is the CPU: each operator's own CPU time; what no operator holds (Python, the runner's
C++ kernels, which the profiler does not see) is the rest of the wall time. The profiler adds
host time to every operator it records (microseconds each: thousands a DenseNet step), so the same
steps are first timed without it (`plain ms`). Busy: on a GPU the kernels' time over that plain
step time, under about 90%: the host bounds the step; on a CPU the operators' time over the
profiled wall (both carry the profiler's cost). Exit 0, 1 if a level failed, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
import traceback
from collections.abc import Iterable, Sequence

from benchmarks.common import (
    add_device_option,
    add_extra_option,
    add_out_option,
    build_runner,
    check_at_least_one,
    check_presets,
    compose,
    csv_list,
    fill_defaults,
    load_average,
    one_batch_task,
    provenance,
    resolve_device,
    results_path,
    setup_lines,
    show,
    write_results,
)

DEFAULTS = {
    "cuda": dict(
        model="densenet161", image_size=224, batch_size=64, levels=["o0", "o2"], warmup=10, steps=10
    ),
    "cpu": dict(
        model="resnet18", image_size=32, batch_size=16, levels=["o0", "o2_bf16"], warmup=2, steps=3
    ),
}
# a kind of work: the first whose pattern the outermost operator's name matches
KINDS = [
    ("convolution", r"conv|cudnn_convolution"),
    ("matmul", r"::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)\b"),
    ("normalisation", r"norm"),
    ("concatenation", r"::(cat|stack)\b"),
    ("copies and casts", r"::(copy_|_to_copy|to|clone|contiguous)\b"),
    ("pooling", r"pool"),
    ("optimizer (torch's)", r"_foreach|_fused_adam|_fused_sgd"),
    ("loss", r"cross_entropy|nll_loss|log_softmax"),
]
OTHER_OPS = "other operators (activations, elementwise)"
OUTSIDE = "outside any ATen operator (the runner's kernels, Python)"
FIELDS = ["level", "status", "plain_ms", "wall_ms", "busy_ms", "busy_share", "kernels"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_step",
        description="Where one training step's time goes per level: torch.profiler over the "
        "runner's step, device time by kind of work, and the device's busy share; writes "
        "Markdown, CSV and JSON.",
    )
    add_device_option(p)
    p.add_argument("--model", default=None, help="model config option (CUDA densenet161)")
    p.add_argument("--image-size", type=int, default=None, help="(CUDA 224, CPU 32)")
    p.add_argument("--batch-size", type=int, default=None, help="(CUDA 64, CPU 16)")
    p.add_argument("--levels", type=csv_list, default=None, help="presets (CUDA o0,o2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (CUDA 10)")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (CUDA 10, CPU 3)")
    add_extra_option(p, "more Hydra overrides, e.g. trainer.channels_last=true")
    add_out_option(p, "profile_step")
    args = p.parse_args(argv)
    args.device = resolve_device(p, args.device)
    fill_defaults(args, DEFAULTS[args.device])
    check_at_least_one(p, args, ("image_size", "batch_size", "steps"))
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    check_presets(p, args.levels)
    args.out = args.out or results_path(f"profile_step_{args.device}.md", args.device)
    return args


def kind_of(op: str | None) -> str:
    if op is None:
        return OUTSIDE
    return next((kind for kind, pattern in KINDS if re.search(pattern, op)), OTHER_OPS)


def outermost_op(event) -> str | None:
    """The name of the outermost ATen operator above `event` (itself included), else None."""
    name = None
    while event is not None:
        if event.name.startswith("aten::"):
            name = event.name
        event = event.cpu_parent
    return name


def split(events: Iterable, on_gpu: bool) -> tuple[dict[str, float], dict[str, float], float]:
    """(microseconds by kind, by outermost operator, the device's total) of profiled `events`
    (torch.profiler's FunctionEvents). On a GPU: every device event's time is the total; the
    kernels each CPU event launched are charged to its outermost operator, the rest to OUTSIDE.
    On a CPU: each ATen operator's own CPU time, charged to its outermost operator. User
    annotations (record_function ranges, mirrored on the GPU's timeline) are left out."""
    kinds: dict[str, float] = {}
    ops: dict[str, float] = {}
    total = 0.0
    for event in events:
        if getattr(event, "is_user_annotation", False):
            continue  # a record_function range (and its GPU span), not work: as torch's tables
        if on_gpu:
            if event.device_type.name != "CPU":
                total += event.time_range.elapsed_us()
                continue
            spent = sum(k.duration for k in event.kernels)
        else:
            if event.device_type.name != "CPU" or not event.name.startswith("aten::"):
                continue
            spent = event.self_cpu_time_total
            total += spent
        if spent <= 0:
            continue
        op = outermost_op(event)
        kinds[kind_of(op)] = kinds.get(kind_of(op), 0.0) + spent
        key = op or OUTSIDE
        ops[key] = ops.get(key, 0.0) + spent
    if on_gpu:
        kinds[OUTSIDE] = kinds.get(OUTSIDE, 0.0) + max(0.0, total - sum(kinds.values()))
    return kinds, ops, total


def profile_level(args, level: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runner.measure.probes import synchronize

    row: dict = {"level": level, "status": "ok", "error": None}
    gc.collect()  # the previous level's objects
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        overrides = [
            *one_batch_task(args.model, args.image_size, args.batch_size, args.device),
            f"precision={level}",
            "scheduler=none",
            *args.extra,
        ]
        parts = build_runner(compose(overrides))
        trainer, device = parts.trainer, parts.device
        row["kernels"] = parts.kernels

        def steps(count: int) -> None:
            for _ in range(count):
                trainer.train_step(*parts.batch)
                trainer.global_step += 1

        steps(args.warmup)
        synchronize(device)
        started = time.perf_counter()  # the same steps unprofiled: the step's own wall time
        steps(args.steps)
        synchronize(device)
        plain_us = (time.perf_counter() - started) * 1e6
        on_gpu = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            steps(args.steps)
            synchronize(device)
            wall_us = (time.perf_counter() - started) * 1e6
        kinds, ops, busy_us = split(prof.events(), on_gpu)
        if not on_gpu:
            kinds[OUTSIDE] = max(0.0, wall_us - busy_us)
        per_step = 1e-3 / args.steps  # microseconds over all steps -> ms a step
        row.update(
            plain_ms=plain_us * per_step,
            wall_ms=wall_us * per_step,
            busy_ms=busy_us * per_step,
            # a GPU's kernel times are its own, profiler or not: their share of the plain step;
            # a CPU's operator times include the profiler's cost: their share of the profiled one
            busy_share=busy_us / (plain_us if on_gpu else wall_us),
            kinds={k: v * per_step for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            top_ops=[(k, v * per_step) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])][:10],
        )
    except Exception as error:  # a level that fails is a row saying so, not a lost table
        row.update(status="failed", error=f"{type(error).__name__}: {error}")
        traceback.print_exc()
    return row


def render(report: dict) -> str:
    device = report["device"]
    where = "GPU kernels" if device == "cuda" else "CPU time of ATen operators"
    lines = [
        f"# Where a step's time goes ({device})",
        "",
        f"{report['model']}, {report['image_size']} px, batch {report['batch_size']}, the runner's "
        f"step profiled over {report['steps']} steps after {report['warmup']} untimed ones; "
        f"overrides {' '.join(report['extra']) or '(none)'}. Device time: {where}, each charged "
        "to the outermost operator that ran it; ms a step. Plain: the same steps without the "
        "profiler (which adds host time to each operator); busy: device time over plain (on a "
        "CPU: over the profiled wall).",
        "",
        "| level | plain ms | profiled wall ms | device busy ms | busy | kernels |",
        "|---|---:|---:|---:|---:|---|",
    ]
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    for r in rows:
        lines.append(
            f"| {r['level']} | {r['plain_ms']:.1f} | {r['wall_ms']:.1f} | {r['busy_ms']:.1f} | "
            f"{r['busy_share']:.0%} | {r['kernels']} |"
        )
    if rows:
        kinds = list(dict.fromkeys(k for r in rows for k in r["kinds"]))
        lines += ["", "| kind of work | " + " | ".join(r["level"] for r in rows) + " |"]
        lines.append("|---|" + "---:|" * len(rows))
        for kind in kinds:
            cells = []
            for r in rows:
                ms = r["kinds"].get(kind, 0.0)
                cells.append(f"{ms:.2f} ({ms / r['wall_ms']:.0%})")
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        for r in rows:
            lines += ["", f"Operators with the most device time, {r['level']} (ms a step): "]
            lines[-1] += "; ".join(f"`{op}` {ms:.2f}" for op, ms in r["top_ops"]) + "."
        if len(rows) >= 2:
            a, b = rows[0], rows[-1]
            lines += [
                "",
                f"{b['level']} / {a['level']}: plain step time "
                f"{b['plain_ms'] / a['plain_ms']:.2f}x, device busy "
                f"{b['busy_ms'] / max(a['busy_ms'], 1e-9):.2f}x.",
            ]
    lines += ["", "## Setup", "", *setup_lines(report)]
    lines += [f"- `{r['level']}` failed: {r['error']}" for r in report["rows"] if r["error"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    load_start, started = load_average(), time.perf_counter()
    print(
        f"Profiling the step on {args.device}: {args.model} {args.image_size}px batch "
        f"{args.batch_size}, levels {', '.join(args.levels)}",
        flush=True,
    )
    rows: list[dict] = []
    for level in args.levels:
        rows.append(profile_level(args, level))
        report = {
            "benchmark": "profile_step",
            "device": args.device,
            "model": args.model,
            "image_size": args.image_size,
            "batch_size": args.batch_size,
            "warmup": args.warmup,
            "steps": args.steps,
            "extra": args.extra,
            "rows": rows,
            **provenance("profile_step", argv, args.device, load_start, started),
        }
        paths = write_results(args.out, render(report), rows, FIELDS, report)  # after each level
        print(f"  {level}: {rows[-1].get('plain_ms', 0):.1f} ms a step", flush=True)
    show(render(report), paths)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
