"""`trainer.cuda_graphs`, its speed: the trainer's step with the optimizer step replayed from a
CUDA graph against the same step taken eagerly, side by side in one process.

For each case the runner's objects are built twice (`common.build_runner`), with
`trainer.cuda_graphs=false` and `=true`, from the same seed and on the same batch held in memory;
both are warmed up (the graphed trainer through its eager steps and its capture), then blocks of
`--steps` steps of the trainer's own `Trainer.train_step` alternate over `--rounds` rounds, each
block device-synchronised at its start and end, so that the GPU's clocks, its temperature and
any other load hit both alike. Figures: the median step time of each, their ratio, and the
device-time split of what follows the backward (CUDA events, median over `--reps`): the eager
trainer's `engine.step`, and the graphed trainer's gradient copy into the graph's tensors and
its replay; beside them, one contiguous copy of the gradients' bytes (what the copy costs at the
GPU's bandwidth).

Cases and what is expected of them (the verdict):
  host_rn18_o2       ResNet-18, 16 px, batch 8, O2, Adam: the host bounds the step (the GPU
                     waits for its launches): the replayed step is faster than the eager one.
  gpu_rn50_o2        ResNet-50, 224 px, batch 64, channels_last, O2 and o2_bf16: the GPU bounds
  gpu_rn50_o2_bf16   the step and the launches hide behind the backward, so the replay cannot
                     pay: its step is no more than 2% slower, the gradient copy at most twice
                     one contiguous copy of its bytes, the replay no slower on the device than
                     the eager step (5% and 0.05 ms).

    python -m benchmarks.graphs                        # CUDA: the three cases, about 2 minutes
    python -m benchmarks.graphs --cases gpu_rn50_o2 --rounds 20
    python -m benchmarks.graphs --device cpu           # a CPU: the eager step only (16 px,
                                                       # batch 2); planning refuses the graphs

On a CPU `trainer.cuda_graphs=true` is refused in planning: the eager step is timed (a check of
the cases' configs and of this script, not a figure) and the table says what planning said.
Measures; does not gate. Exit 0 whatever the numbers, 1 if a case crashed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Sequence

from benchmarks.common import (
    add_device_option,
    add_out_option,
    build_runner,
    check_at_least_one,
    command,
    compose,
    csv_list,
    interleaved_medians,
    load_average,
    machine,
    now,
    one_batch_task,
    resolve_device,
    results_path,
    setup_lines,
    write_results,
)

HOST, GPU = "host", "gpu"
# name: (what bounds the step, model, image size, batch size, level, more overrides)
CASES = {
    "host_rn18_o2": (HOST, "resnet18", 16, 8, "o2", ("optimizer=adam",)),
    "gpu_rn50_o2": (GPU, "resnet50", 224, 64, "o2", ("trainer.channels_last=true",)),
    "gpu_rn50_o2_bf16": (GPU, "resnet50", 224, 64, "o2_bf16", ("trainer.channels_last=true",)),
}
CPU_SIZE = (16, 2)  # a CPU's image size and batch where none is given: a check, not a figure
SLOWER = 1.02  # where the GPU bounds the step: the replayed step at most 2% slower
COPY_FACTOR = 2.0  # the gradient copy at most twice one contiguous copy of the same bytes
REPLAY = (1.05, 0.05)  # the replay on the device at most 5% and 0.05 ms over the eager step
VARIANTS = ("eager", "graphed")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.graphs",
        description="The trainer's step with trainer.cuda_graphs against the eager step, "
        "interleaved in one process, with the device-time split of the optimizer step; "
        "writes Markdown, CSV and JSON.",
    )
    add_device_option(p)
    p.add_argument(
        "--cases",
        type=csv_list,
        default=list(CASES),
        help=f"comma-separated cases ({', '.join(CASES)}; default all)",
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help=f"every case's image side (default each case's own; on a CPU {CPU_SIZE[0]})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"every case's batch (default each case's own; on a CPU {CPU_SIZE[1]})",
    )
    p.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    p.add_argument(
        "--rounds", type=int, default=10, help="rounds, one block per variant each (default 10)"
    )
    p.add_argument(
        "--reps", type=int, default=20, help="device-time samples of each part (default 20)"
    )
    add_out_option(p, "graphs")
    args = p.parse_args(argv)
    args.device = resolve_device(p, args.device)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    check_at_least_one(p, args, ("image_size", "batch_size", "steps", "rounds", "reps"))
    if args.device == "cpu":
        args.image_size = args.image_size or CPU_SIZE[0]
        args.batch_size = args.batch_size or CPU_SIZE[1]
    args.out = args.out or results_path(f"graphs_{args.device}.md", args.device)
    return args


def case_overrides(args, name: str, graphs: bool) -> list[str]:
    _, model, size, batch, level, extra = CASES[name]
    return [
        *one_batch_task(model, args.image_size or size, args.batch_size or batch, args.device),
        f"precision={level}",
        "scheduler=none",  # (the step alone: no schedule's rate set before each step)
        *extra,
        f"trainer.cuda_graphs={str(graphs).lower()}",
    ]


def _refusal(args, name: str) -> str | None:
    """What planning says of the graphed run (None: it plans)."""
    from runner.errors import ConfigError
    from runner.run.plan import make_plan

    try:
        make_plan(compose(case_overrides(args, name, True)))
    except ConfigError as error:
        return str(error).splitlines()[0]
    return None


def warmup_steps(args) -> int:
    """Steps each trainer takes before the timed blocks' own warm-up block: on CUDA the graphed
    trainer's eager steps and its capture, and two replays; none where there is no graph."""
    from runner.run import cuda_graphs

    return cuda_graphs.WARMUP_STEPS + 2 if args.device == "cuda" else 0


def _steps(parts, count: int) -> None:
    for _ in range(count):
        parts.trainer.train_step(*parts.batch)
        parts.trainer.global_step += 1


def device_ms(runs: dict, reps: int) -> dict[str, float]:
    """The GPU time (ms, CUDA events, median of `reps`) of what follows the backward: the eager
    trainer's step (its clip, where one is set, and `engine.step`), and the graphed trainer's
    gradient copy and replay. Each is enqueued while the GPU still runs the backward, so the
    events time kernels, not the host's launches."""
    import torch

    times: dict[str, list[float]] = {"eager_step": [], "copy": [], "replay": []}
    for _ in range(reps):
        for variant, parts in runs.items():
            trainer = parts.trainer
            x, y = parts.batch
            with trainer.engine.autocast():
                loss = trainer.task.loss(trainer.criterion, trainer.model(x), y)
            trainer.engine.backward(loss)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            graph = trainer.step_graph
            if variant == "eager":
                if trainer.cfg.grad_clip_norm:
                    trainer.engine.clip_grad_norm_(trainer.cfg.grad_clip_norm, trainer.optimizer)
                trainer.engine.step(trainer.optimizer, wait=False)
            else:
                graph._feed()
            marks[1].record()
            if variant == "graphed":
                graph.graph.replay()
            marks[2].record()
            trainer.engine.zero_grad(trainer.optimizer)
            torch.cuda.synchronize()
            if variant == "eager":
                times["eager_step"].append(marks[0].elapsed_time(marks[1]))
            else:
                times["copy"].append(marks[0].elapsed_time(marks[1]))
                times["replay"].append(marks[1].elapsed_time(marks[2]))
    return {name: statistics.median(values) for name, values in times.items()}


def flat_copy_ms(nbytes: int, dtype, reps: int) -> float:
    """One contiguous copy of `nbytes` bytes (CUDA events, median of `reps`): the gradient
    copy's cost at the GPU's bandwidth, measured in the same run."""
    import torch

    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(numel, dtype=dtype, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def run_case(args, name: str) -> dict:
    """One case: the eager and graphed trainers, stepped in interleaved blocks."""
    from runner.measure.memory import MemoryInstrument
    from runner.measure.probes import synchronize
    from runner.run import cuda_graphs

    bound, model, size, batch, level, _ = CASES[name]
    cell = {
        "case": name,
        "bound": bound,
        "model": model,
        "image_size": args.image_size or size,
        "batch_size": args.batch_size or batch,
        "level": level,
        "status": "ok",
        "error": None,
        "refused": None,
    }
    gc.collect()
    try:
        cell["refused"] = _refusal(args, name)
        variants = VARIANTS if cell["refused"] is None else VARIANTS[:1]
        runs: dict = {}
        for variant in variants:
            cpu_batch = runs["eager"].cpu_batch if runs else None
            overrides = case_overrides(args, name, variant == "graphed")
            runs[variant] = build_runner(compose(overrides), cpu_batch=cpu_batch)
            runs[variant].trainer.instruments.find(MemoryInstrument).final = True  # (unmetered)
        device = runs["eager"].device
        warmup = warmup_steps(args)
        for parts in runs.values():
            _steps(parts, warmup)

        def block(variant: str) -> float:
            synchronize(device)
            started = time.perf_counter()
            _steps(runs[variant], args.steps)
            synchronize(device)
            return (time.perf_counter() - started) / args.steps

        medians = interleaved_medians(variants, block, args.rounds, name)
        cell["eager_ms"] = 1e3 * medians["eager"]
        if "graphed" in runs:
            graph = runs["graphed"].trainer.step_graph
            stepped = warmup + (args.rounds + 1) * args.steps
            cell["graphed_ms"] = 1e3 * medians["graphed"]
            cell["ratio"] = medians["graphed"] / medians["eager"]
            cell["graph"] = {
                "steps": stepped,
                "eager_steps": graph.eager_steps,
                "captures": graph.captures,
                "replays": graph.replays,
            }
            cell["replays_every_step"] = graph.captures == 1 and graph.replays == stepped - (
                cuda_graphs.WARMUP_STEPS
            )
            cell.update(device_ms(runs, args.reps))
            nbytes = sum(t.numel() * t.element_size() for t in graph.static)
            cell["grad_mb"] = nbytes / 2**20
            cell["flat_copy_ms"] = flat_copy_ms(nbytes, graph.static[0].dtype, args.reps)
        runs = None  # (frees them before the next case)
    except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
        cell["status"], cell["error"] = "crashed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return cell


def judge(cell: dict) -> list[tuple[str, bool]]:
    """The case's checks against the stated expectations: (what is expected, whether met)."""
    if cell["status"] != "ok" or "graphed_ms" not in cell:
        return []
    if cell["bound"] == HOST:
        return [("the replayed step faster than the eager one", cell["ratio"] < 1.0)]
    factor, slack = REPLAY
    return [
        (f"the step at most {100 * (SLOWER - 1):.0f}% slower", cell["ratio"] <= SLOWER),
        (
            f"the gradient copy at most {COPY_FACTOR:g}x one contiguous copy of its bytes",
            cell["copy"] <= COPY_FACTOR * cell["flat_copy_ms"],
        ),
        (
            f"the replay on the device at most {100 * (factor - 1):.0f}% + {slack} ms over the "
            "eager step",
            cell["replay"] <= factor * cell["eager_step"] + slack,
        ),
    ]


def verdict_lines(report: dict) -> list[str]:
    lines = []
    for c in report["results"]:
        if c["status"] != "ok":
            lines.append(f"- `{c['case']}`: not judged, it crashed ({c['error']})")
        elif c["refused"]:
            lines.append(f"- `{c['case']}`: not judged, planning refused the graphs here")
        else:
            checks = judge(c)
            said = "; ".join(f"{what}: {'met' if ok else 'NOT met'}" for what, ok in checks)
            graph = "" if c["replays_every_step"] else " (the graph did NOT replay every step)"
            lines.append(
                f"- `{c['case']}` ({c['bound']}-bound): {said}: "
                f"**{'met' if all(ok for _, ok in checks) else 'not met'}**{graph}"
            )
    return lines


def _ms(cell: dict, key: str, digits: int = 2) -> str:
    return "-" if cell.get(key) is None else f"{cell[key]:.{digits}f}"


def render(report: dict) -> str:
    lines = [
        f"# CUDA graphs: the replayed step against the eager one ({report['device']})",
        "",
        "The trainer's own step (`Trainer.train_step`) with `trainer.cuda_graphs=false` and "
        "`=true`, built from the same seed, on one synthetic batch held in memory; after "
        f"{report['warmup']} warm-up steps each (on CUDA the graphed trainer's eager steps and "
        f"its capture among them), blocks of {report['steps']} steps alternate over "
        f"{report['rounds']} rounds, each block device-synchronised at both ends. Medians over "
        "the blocks. Device times (CUDA events, median of "
        f"{report['reps']}): what follows the backward, enqueued while the GPU still runs it: "
        "the eager `engine.step`, the graphed trainer's gradient copy and its replay; and one "
        "contiguous copy of the gradients' bytes (the copy at the GPU's bandwidth).",
        "",
        "| case | model | px | batch | level | eager step ms | graphed step ms | graphed / eager "
        "| device: eager step ms | copy ms | replay ms | gradients MB | contiguous copy ms | "
        "graph: captures / replays of steps |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in report["results"]:
        head = (
            f"| {c['case']} | {c['model']} | {c['image_size']} | {c['batch_size']} | {c['level']}"
        )
        if c["status"] != "ok":
            lines.append(f"{head} | {c['status']}: {c['error']} |")
            continue
        if c["refused"]:
            lines.append(f"{head} | {_ms(c, 'eager_ms')} | refused (below) |")
            continue
        g = c["graph"]
        lines.append(
            f"{head} | {_ms(c, 'eager_ms')} | {_ms(c, 'graphed_ms')} | {c['ratio']:.3f} | "
            f"{_ms(c, 'eager_step', 3)} | {_ms(c, 'copy', 3)} | {_ms(c, 'replay', 3)} | "
            f"{c['grad_mb']:.1f} | {_ms(c, 'flat_copy_ms', 3)} | "
            f"{g['captures']} / {g['replays']} of {g['steps']} |"
        )
    lines += [f"\nRefused in planning: {said}" for said in report["refusals"]]
    lines += [
        "",
        "## Verdict",
        "",
        "Where the host bounds the step (the GPU waits for the launches) the replay saves the "
        "host the step's Python and kernel calls and should pay; where the GPU bounds it the "
        "launches already hide behind the backward, and the replay adds one read and write of "
        "every gradient: the step at most 2% slower, that copy near its bandwidth cost.",
        "",
        *verdict_lines(report),
        "",
        "## Setup",
        "",
        *setup_lines(report),
        "",
    ]
    return "\n".join(lines)


CSV_FIELDS = [
    "case",
    "bound",
    "model",
    "image_size",
    "batch_size",
    "level",
    "status",
    "eager_ms",
    "graphed_ms",
    "ratio",
    "eager_step",
    "copy",
    "replay",
    "grad_mb",
    "flat_copy_ms",
    "replays_every_step",
    "refused",
    "error",
]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    load_start = load_average()
    started = time.perf_counter()
    print(
        f"CUDA graphs on {args.device}: {', '.join(args.cases)}, {args.rounds} rounds of "
        f"{args.steps}-step blocks; load average {load_start}",
        flush=True,
    )
    results = []

    def report() -> dict:
        return {
            "benchmark": "graphs",
            "device": args.device,
            "steps": args.steps,
            "rounds": args.rounds,
            "reps": args.reps,
            "warmup": warmup_steps(args) + args.steps,
            "refusals": sorted({c["refused"] for c in results if c.get("refused")}),
            "results": results,
            "machine": machine(args.device),
            "command": command("graphs", argv),
            "date": now(),
            "load_start": load_start,
            "load_end": load_average(),
            "wall_s": time.perf_counter() - started,
            "overrides": {name: case_overrides(args, name, True) for name in args.cases},
        }

    # the table after every case, so that a GPU lease's piece stopped at its limit keeps the
    # cases that ran
    for name in args.cases:
        cell = run_case(args, name)
        cell["checks"] = [{"expected": what, "met": ok} for what, ok in judge(cell)]
        results.append(cell)
        final = report()
        paths = write_results(args.out, render(final), results, CSV_FIELDS, final)
    print()
    print(render(final))
    print("Wrote " + ", ".join(str(p) for p in paths))
    return 1 if any(c["status"] != "ok" for c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
