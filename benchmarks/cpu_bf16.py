"""bfloat16 against fp32 on this CPU: whether the bf16 presets can train faster than O0 here.

On a CPU the bf16 presets are the faster only where the CPU computes bf16 in hardware
(AVX512_BF16 or AMX: Intel Cooper Lake, Sapphire Rapids and newer; AMD Zen 4 and newer).
Elsewhere (AVX2 machines) oneDNN takes a slow path for bf16 matrix products and convolutions, and
a bf16 level trains slower than O0; the runner measures this at the start of a bf16 run and warns
(`runner.precision.checks`, from `BF16_SLOW_RATIO`). This benchmark shows the whole picture:

1. The operations a step is made of, each timed in fp32 and in bf16 on the same inputs: square
   matrix products (128, 256, 512), a 3 x 3 convolution's forward and its forward + backward
   (batch 4, 64 channels, 32 px), and an elementwise `a * b + c` over 4M values (memory-bound:
   bf16 moves half the bytes). On one thread and on torch's threads; the median of interleaved
   rounds; bf16 / fp32 per operation.
2. The runner's training step (`Trainer.train_step`, `common.build_runner`) on the tiny CNN and
   the tiny ViT (32 px, batch 32, one batch in memory) at `o0`, `o1_bf16` and `o2_bf16`, blocks
   interleaved in one process: each bf16 level's step time over O0's.
3. What the runner measures at start (`cpu_bf16_matmul_ratio`, 128 x 128 on one thread) and
   whether its finding fires; the CPU's flags and torch's CPU capability.

    python -m benchmarks.cpu_bf16                        # results/cpu_bf16_cpu.md
    python -m benchmarks.cpu_bf16 --rounds 3 --no-steps  # the operations only, quicker

No targets: the figures say which side of fp32 this CPU's bf16 is on (verdict line). Exit 0
whatever they say; 1 if a training step crashed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.common import (
    add_out_option,
    build_runner,
    compose,
    interleaved_medians,
    load_average,
    model_problem,
    one_batch_task,
    provenance,
    results_path,
    setup_lines,
    show,
    write_results,
)

MATMUL_SIZES = (128, 256, 512)
CONV = (4, 64, 32)  # batch, channels (in and out), side
ELEMENTWISE = 1 << 22
STEP_MODELS = ("tiny", "vit_tiny")
STEP_LEVELS = ("o0", "o1_bf16", "o2_bf16")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
FIELDS = ["section", "name", "shape", "threads", "fp32_ms", "bf16_ms", "ratio"]


def cpu_flags() -> list[str]:
    """Which of FLAGS /proc/cpuinfo lists for this CPU (Linux; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    return [flag for flag in FLAGS if flag in present]


def operations() -> list[tuple[str, str, Callable]]:
    """(name, shape, make) per operation: `make(dtype)` builds its inputs and returns a
    zero-argument callable that runs it once."""
    import torch
    import torch.nn.functional as F

    def matmul(n: int) -> Callable:
        def make(dtype):
            g = torch.Generator().manual_seed(0)
            a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
            return lambda: torch.mm(a, b)

        return make

    batch, channels, side = CONV

    def conv(backward: bool) -> Callable:
        def make(dtype):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(batch, channels, side, side, generator=g).to(dtype)
            w = torch.randn(channels, channels, 3, 3, generator=g).mul(0.05).to(dtype)
            if not backward:
                return lambda: F.conv2d(x, w, padding=1)
            x.requires_grad_(True)
            w.requires_grad_(True)

            def run():
                F.conv2d(x, w, padding=1).sum().backward()
                x.grad = w.grad = None

            return run

        return make

    def elementwise(dtype):
        g = torch.Generator().manual_seed(0)
        a, b, c = (torch.randn(ELEMENTWISE, generator=g).to(dtype) for _ in range(3))
        return lambda: torch.addcmul(c, a, b)

    return [
        *((f"matmul {n}", f"{n}x{n} @ {n}x{n}", matmul(n)) for n in MATMUL_SIZES),
        ("conv 3x3 forward", f"{batch}x{channels}x{side}x{side}, {channels} filters", conv(False)),
        (
            "conv 3x3 forward + backward",
            f"{batch}x{channels}x{side}x{side}, {channels} filters",
            conv(True),
        ),
        ("elementwise a * b + c", f"{ELEMENTWISE // (1 << 20)}M values", elementwise),
    ]


def time_operations(rounds: int, threads: Sequence[int]) -> list[dict]:
    """Each operation in fp32 and bf16 on each thread count: one untimed call each, then `rounds`
    rounds of one timed call per dtype (the order alternating); the medians and their ratio."""
    import torch

    found = torch.get_num_threads()
    rows = []
    try:
        for count in threads:
            torch.set_num_threads(count)
            for name, shape, make in operations():
                runs = {"fp32": make(torch.float32), "bf16": make(torch.bfloat16)}
                samples: dict[str, list[float]] = {"fp32": [], "bf16": []}
                for run in runs.values():
                    run()
                for index in range(rounds):
                    for dtype in ("fp32", "bf16") if index % 2 == 0 else ("bf16", "fp32"):
                        start = time.perf_counter()
                        runs[dtype]()
                        samples[dtype].append(time.perf_counter() - start)
                fp32, bf16 = (1e3 * statistics.median(samples[d]) for d in ("fp32", "bf16"))
                rows.append(
                    {
                        "section": "operation",
                        "name": name,
                        "shape": shape,
                        "threads": count,
                        "fp32_ms": fp32,
                        "bf16_ms": bf16,
                        "ratio": bf16 / fp32,
                    }
                )
                print(f"{name} ({count} thread(s)): bf16 {bf16 / fp32:.1f}x fp32", flush=True)
    finally:
        torch.set_num_threads(found)
    return rows


def time_steps(models: Sequence[str], steps: int, rounds: int) -> tuple[list[dict], list[str]]:
    """The runner's step per model at each of STEP_LEVELS, blocks of `steps` steps interleaved;
    each level's median step time, its ratio to O0's. Returns (rows, errors)."""
    import torch

    rows, errors = [], []
    for model in models:
        try:
            task = one_batch_task(model, 32, 32, "cpu")
            trainers = {}
            cpu_batch = None
            for level in STEP_LEVELS:
                parts = build_runner(compose([*task, f"precision={level}"]), cpu_batch=cpu_batch)
                cpu_batch = parts.cpu_batch
                trainers[level] = (parts.trainer, parts.batch)

            def block(level: str, trainers: dict = trainers) -> float:
                trainer, batch = trainers[level]
                started = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step(*batch)
                    trainer.global_step += 1
                return (time.perf_counter() - started) / steps

            medians = interleaved_medians(STEP_LEVELS, block, rounds, model)
        except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
            errors.append(f"{model}: {type(error).__name__}: {error}")
            traceback.print_exc()
            continue
        for level in STEP_LEVELS:
            rows.append(
                {
                    "section": "training step",
                    "name": f"{model} {level}",
                    "shape": "32 px, batch 32",
                    "threads": torch.get_num_threads(),
                    "fp32_ms": 1e3 * medians["o0"],
                    "bf16_ms": 1e3 * medians[level],
                    "ratio": medians[level] / medians["o0"],
                }
            )
    return rows, errors


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_bf16", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per operation (default 7)")
    p.add_argument(
        "--steps", type=int, default=3, help="training steps per timed block (default 3)"
    )
    p.add_argument("--step-rounds", type=int, default=5, help="timed blocks per level (default 5)")
    p.add_argument(
        "--no-steps", dest="train", action="store_false", help="time the operations only"
    )
    p.add_argument(
        "--models",
        default=",".join(STEP_MODELS),
        help=f"models whose training step is timed (default {','.join(STEP_MODELS)})",
    )
    add_out_option(p, "cpu_bf16", default="benchmarks/results/cpu/cpu_bf16_cpu.md")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps, args.step_rounds) < 1:
        p.error("--rounds, --steps and --step-rounds must be at least 1")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in args.models if args.train else ():
        problem = model_problem(model)
        if problem:
            p.error(f"unknown model {model!r}: {problem}")
    if args.out is None:
        args.out = results_path("cpu_bf16_cpu.md", "cpu")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from runner.precision import checks

    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    started, load_start = time.perf_counter(), load_average()
    threads = sorted({1, torch.get_num_threads()})
    print(f"bf16 against fp32 on this CPU; load average {load_start}", flush=True)
    rows = time_operations(args.rounds, threads)
    errors: list[str] = []
    if args.train:
        step_rows, errors = time_steps(args.models, args.steps, args.step_rounds)
        rows += step_rows
    ratio = checks.cpu_bf16_matmul_ratio()
    report = {
        "benchmark": "cpu_bf16",
        "rows": rows,
        "errors": errors,
        "runner_ratio": ratio,
        "slow_ratio": checks.BF16_SLOW_RATIO,
        "finding_fires": ratio >= checks.BF16_SLOW_RATIO,
        "flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **provenance("cpu_bf16", argv, "cpu", load_start, started),
    }
    paths = write_results(args.out, render(report), rows, FIELDS, report)
    show(render(report), paths)
    if errors:
        print("Crashed: " + "; ".join(errors), file=sys.stderr)
    return 1 if errors else 0


def verdict(report: dict) -> str:
    """Which side of fp32 this CPU's bf16 is on: by the compute-bound operations on one thread,
    the training steps, and the runner's own measurement."""
    compute = [
        r["ratio"]
        for r in report["rows"]
        if r["section"] == "operation" and r["threads"] == 1 and not r["name"].startswith("elem")
    ]
    steps = [
        r
        for r in report["rows"]
        if r["section"] == "training step" and not r["name"].endswith(" o0")
    ]
    side = "SLOWER" if statistics.median(compute) >= 1 else "FASTER"
    line = (
        f"Verdict: bf16 computes {side} than fp32 on this CPU: matrix products and convolutions "
        f"{min(compute):.1f}-{max(compute):.1f}x fp32's time on one thread"
    )
    if steps:
        line += "; the runner's training step " + ", ".join(
            f"{r['name']} {r['ratio']:.2f}x O0's" for r in steps
        )
    fires = "fires" if report["finding_fires"] else "does not fire"
    return (
        line + f". The runner measured {report['runner_ratio']:.1f}x at start, so its finding "
        f"(from {report['slow_ratio']:g}x) {fires}."
    )


def render(report: dict) -> str:
    flags = report["flags"]
    missing = [f for f in FLAGS if f not in flags]
    lines = [
        "# bfloat16 against fp32 (cpu)",
        "",
        "Each operation in fp32 and in bfloat16 on the same inputs, the median of interleaved "
        "rounds; `ratio` is bf16's time over fp32's (above 1: bf16 is slower). The training "
        "steps are the runner's own (`Trainer.train_step`, 32 px, batch 32, one batch in "
        "memory), blocks of the three levels interleaved in one process; their `fp32 ms` column "
        "is O0's step and `ratio` the level's step time over O0's.",
        "",
        f"CPU flags: {', '.join(flags) or 'none of ' + ', '.join(FLAGS)}"
        + (f" (not: {', '.join(missing)})" if flags and missing else "")
        + f"; torch's CPU capability: {report['cpu_capability']}.",
        "",
        "| section | name | shape | threads | fp32 ms | bf16 ms | ratio |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['section']} | {r['name']} | {r['shape']} | {r['threads']} | "
            f"{r['fp32_ms']:.2f} | {r['bf16_ms']:.2f} | {r['ratio']:.2f}x |"
        )
    lines += ["", verdict(report), ""]
    if report["errors"]:
        lines += ["Crashed: " + "; ".join(report["errors"]), ""]
    lines += ["## Setup", "", *setup_lines(report), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
