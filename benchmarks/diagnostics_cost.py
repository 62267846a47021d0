"""Range diagnostics cost: what does `trainer.diagnose_every_n_steps` add to a training step?

The runner's objects for each (model, level) (`common.build_runner`), stepped with the trainer's
own `Trainer.train_step` on one synthetic batch held in memory. Blocks of `--steps` steps
alternate, round after round, between three variants:
  off          `trainer.diagnose_every_n_steps=0`: no probe, no hook (checked: the model holds
               no hook during the step);
  diagnosed    every step diagnosed (a `RangeProbe` in the run's formats: hooks on every layer,
               the exponent histograms and threshold counts of every activation, activation
               gradient and weight gradient, the one host read, the CSV rows appended);
  memory meter every step under the activation meter and counted by kind (what a run does on
               its first step only).
Figures: the median step time per variant, the extra time of a diagnosed step over an off one
(per diagnosed step, and as a share of the step), that share amortised over the intervals n of
`--intervals` (diagnose_every_n_steps=n diagnoses one step in n), and the values observed per
diagnosed step.

    python -m benchmarks.diagnostics_cost                     # CPU: tiny and ResNet-18, ~3 min
    python -m benchmarks.diagnostics_cost --models resnet18 --levels o0 --steps 3 --rounds 2

Measures; does not gate. Exit 0 whatever the numbers, 1 if a cell crashed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    add_device_option,
    add_extra_option,
    add_out_option,
    add_threads_option,
    apply_threads,
    build_runner,
    check_at_least_one,
    compose,
    csv_list,
    int_list,
    interleaved_medians,
    one_batch_task,
    resolve_device,
    results_path,
    run_cells,
    setup_lines,
)

VARIANTS = ("off", "diagnosed", "memory meter")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diagnostics_cost",
        description="The cost of range diagnostics (and of the memory meter) per training step, "
        "against the same step without them; writes Markdown, CSV and JSON.",
    )
    add_device_option(p, auto=False)
    p.add_argument(
        "--models",
        type=csv_list,
        default=["tiny", "resnet18"],
        help="comma-separated model options (default tiny,resnet18)",
    )
    p.add_argument(
        "--levels",
        type=csv_list,
        default=None,
        help="comma-separated precision presets (default: o0,o2_bf16 on a CPU, o0,o2 on CUDA)",
    )
    p.add_argument("--image-size", type=int, default=32, help="synthetic image side (default 32)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--steps", type=int, default=4, help="steps per block (default 4)")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds, each one block per variant (default 3)"
    )
    p.add_argument(
        "--intervals",
        type=csv_list,
        default=["1", "50", "100"],
        help="diagnose_every_n_steps values to amortise over (default 1,50,100)",
    )
    add_out_option(p, "diagnostics_cost")
    add_extra_option(p, "more Hydra overrides, applied last")
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(p, args)

    from runner.config import BUILT_IN_MODELS as MODEL_NAMES  # by name alone

    args.device = resolve_device(p, args.device)
    unknown = [m for m in args.models if m not in MODEL_NAMES]
    if unknown or not args.models:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODEL_NAMES)}")
    check_at_least_one(p, args, ("image_size", "batch_size", "steps", "rounds"))
    args.intervals = int_list(p, "intervals", args.intervals)
    if not args.intervals or any(v < 1 for v in args.intervals):
        p.error("--intervals must be at least 1")
    args.levels = args.levels or (["o0", "o2_bf16"] if args.device == "cpu" else ["o0", "o2"])
    args.out = args.out or results_path(f"diagnostics_cost_{args.device}.md", args.device)
    return args


def cell_overrides(args, model: str, level: str) -> list[str]:
    return [
        *one_batch_task(model, args.image_size, args.batch_size, args.device),
        f"precision={level}",
        *args.extra,
    ]


def hook_count(module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in module.modules()
        if m is not module
    )


def run_cell(args, model: str, level: str, batches: dict) -> dict:
    """One (model, level): interleaved blocks of the three variants."""
    from runner.measure.diagnostics import run_formats
    from runner.measure.memory import MemoryInstrument
    from runner.measure.probes import synchronize
    from runner.measure.run_diagnostics import RunDiagnostics
    from runner.run import watch

    cell = {"model": model, "level": level, "status": "ok", "error": None}
    scratch: list[Path] = []
    gc.collect()
    try:
        cfg = compose(cell_overrides(args, model, level))
        key = (args.image_size, args.batch_size)
        parts = build_runner(cfg, cpu_batch=batches.get(key))
        batches[key] = parts.cpu_batch
        trainer, batch, device = parts.trainer, parts.batch, parts.device
        formats = run_formats(parts.properties.compute_dtypes)
        folder = Path(tempfile.mkdtemp(prefix="diagnostics-cost-"))
        scratch.append(folder)  # (removed when the cell is done)
        diagnosed = RunDiagnostics(1, formats, folder)
        # the layer audit that a run's diagnosed steps carry too is measured on its own
        # (benchmarks/layer_plan_cost.py): this is the range probe's cost
        off = watch.instruments(trainer, None, audit=False)
        watched = {"off": off, "diagnosed": watch.instruments(trainer, diagnosed, audit=False)}
        cell["formats"] = ",".join(f.name for f in formats)
        hooks = {"off": [], "diagnosed": []}
        criterion = trainer.criterion

        def counting(variant):
            def loss(logits, y):
                hooks[variant].append(hook_count(trainer.module))
                return criterion(logits, y)

            return loss

        def block(variant: str) -> float:
            trainer.instruments = watched.get(variant, off)
            memory = trainer.instruments.find(MemoryInstrument)
            trainer.criterion = counting(variant) if variant in hooks else criterion
            synchronize(device)
            started = time.perf_counter()
            for _ in range(args.steps):
                memory.final = variant != "memory meter"  # metered: every step
                trainer.train_step(*batch)
                trainer.global_step += 1
            synchronize(device)
            return (time.perf_counter() - started) / args.steps

        medians = interleaved_medians(VARIANTS, block, args.rounds, f"{model} {level}")
        off, on, meter = (medians[v] for v in VARIANTS)
        observed = sum(r.stats.count for r in diagnosed.last)
        cell.update(
            {
                "step_ms_off": 1e3 * off,
                "step_ms_diagnosed": 1e3 * on,
                "step_ms_memory_meter": 1e3 * meter,
                "diag_ms_per_diagnosed_step": 1e3 * (on - off),
                "diag_fraction": (on - off) / off,
                "meter_ms_per_step": 1e3 * (meter - off),
                "meter_fraction": (meter - off) / off,
                "values_observed_per_step": observed,
                "ns_per_value": 1e9 * (on - off) / observed if observed else None,
                "hooks_when_off": max(hooks["off"]),
                "hooks_when_diagnosed": max(hooks["diagnosed"]),
                "layers": len(diagnosed.last) // 3,
                **{f"amortised_fraction_every_{n}": (on - off) / n / off for n in args.intervals},
            }
        )
        parts = trainer = None  # (frees them; the closures above are done)
    except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
        cell["status"], cell["error"] = "crashed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    finally:
        for folder in scratch:
            shutil.rmtree(folder, ignore_errors=True)
    return cell


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def render(report: dict) -> str:
    intervals = report["intervals"]
    lines = [
        f"# Range diagnostics cost ({report['device']})",
        "",
        "The trainer's own step (`Trainer.train_step`) on one synthetic "
        f"{report['image_size']}x{report['image_size']} batch of {report['batch_size']} held "
        f"in memory; blocks of {report['steps']} steps alternate over {report['rounds']} rounds "
        "between diagnostics off, every step diagnosed (the run's formats: fp16 for O0 as the "
        "reference, bf16 for the bf16 presets) and every step under the memory meter (what a "
        "run does on its first step only). Step times are medians over the blocks; the cost of a "
        "diagnosed step is its median minus the off median, amortised over n for "
        "`trainer.diagnose_every_n_steps=n`.",
        "",
        "| model | level | layers | values per step | step ms (off) | step ms (diagnosed) | "
        "per diagnosed step | ns per value | "
        + " | ".join(f"every {n}" for n in intervals)
        + " | memory meter (first step) | hooks when off |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(intervals) + "---:|---:|",
    ]
    for c in report["results"]:
        if c["status"] != "ok":
            lines.append(f"| {c['model']} | {c['level']} | {c['status']}: {c['error']} |")
            continue
        lines.append(
            f"| {c['model']} | {c['level']} ({c['formats']}) | {c['layers']} | "
            f"{c['values_observed_per_step']:,} | {c['step_ms_off']:.1f} | "
            f"{c['step_ms_diagnosed']:.1f} | {c['diag_ms_per_diagnosed_step']:.1f} ms "
            f"({_pct(c['diag_fraction'])}) | {c['ns_per_value']:.1f} | "
            + " | ".join(_pct(c[f"amortised_fraction_every_{n}"]) for n in intervals)
            + f" | {c['meter_ms_per_step']:.1f} ms ({_pct(c['meter_fraction'])}) | "
            f"{c['hooks_when_off']} |"
        )
    lines += [
        "",
        "Off, no hook is installed (`hooks when off`: the most hooks any submodule of the model "
        "held during an off step, counted from inside the step) and nothing is computed, so the "
        "off step is the plain step; its cost is the timing noise.",
        "",
        "## Setup",
        "",
        *setup_lines(report),
        "",
    ]
    return "\n".join(lines)


def csv_fields(intervals: Sequence[int]) -> list[str]:
    return [
        "model",
        "level",
        "formats",
        "status",
        "layers",
        "values_observed_per_step",
        "step_ms_off",
        "step_ms_diagnosed",
        "step_ms_memory_meter",
        "diag_ms_per_diagnosed_step",
        "diag_fraction",
        "ns_per_value",
        *(f"amortised_fraction_every_{n}" for n in intervals),
        "meter_ms_per_step",
        "meter_fraction",
        "hooks_when_off",
        "hooks_when_diagnosed",
        "error",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    batches: dict = {}
    return run_cells(
        "diagnostics_cost",
        "Range diagnostics cost",
        args,
        argv,
        lambda model, level: run_cell(args, model, level, batches),
        lambda model, level: cell_overrides(args, model, level),
        render,
        csv_fields(args.intervals),
        intervals=args.intervals,
    )


if __name__ == "__main__":
    sys.exit(main())
