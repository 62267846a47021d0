"""Precision per layer, its cost: what a layer plan and the layer audit add to a training step.

The runner's objects for each (model, level) built twice (`common.build_runner`): once at the level
alone, once with a plan that keeps the model's head in fp32 (`+precision.layers.<head>=float32`).
On a cast level (O2/O3) such a plan deviates from the level, so every layer casts its own inputs
(a forward pre-hook each); under autocast (O1) the head runs in a local autocast region (a
wrapped forward). Both are stepped with the trainer's own `Trainer.train_step` on one synthetic
batch held in memory; blocks of `--steps` steps alternate, round after round, between:
  level    the level's step (no plan; the audit already done);
  plan     the planned model's step;
  audited  the level's step with the layer audit's hooks (what the first step and every
           diagnosed step of a run carry).
Figures: median step times, the plan's extra time per step and the audit's per audited step.

    python -m benchmarks.layer_plan_cost                  # CPU: tiny, resnet18, gpt_tiny; ~3 min
    python -m benchmarks.layer_plan_cost --models resnet18 --levels o2_bf16 --rounds 2

Measures; does not gate. Exit 0 whatever the numbers, 1 if a cell crashed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from collections.abc import Sequence

from benchmarks.common import (
    add_device_option,
    add_out_option,
    add_threads_option,
    apply_threads,
    build_runner,
    check_at_least_one,
    compose,
    csv_list,
    interleaved_medians,
    one_batch_task,
    resolve_device,
    results_path,
    run_cells,
    setup_lines,
)

VARIANTS = ("level", "plan", "audited")
HEADS = {
    "tiny": "5",
    "tiny_gn": "5",
    "resnet18": "fc",
    "resnet50": "fc",
    "vit_tiny": "heads",
    "gpt_tiny": "head",
    "gpt": "head",
    "gpt2_small": "head",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.layer_plan_cost",
        description="The cost of a layer plan (a head kept in fp32) and of the layer audit per "
        "training step, against the level's own step; writes Markdown, CSV and JSON.",
    )
    add_device_option(p, auto=False)
    p.add_argument(
        "--models",
        type=csv_list,
        default=["tiny", "resnet18", "gpt_tiny"],
        help=f"comma-separated model options with a known head ({', '.join(HEADS)}; "
        "default tiny,resnet18,gpt_tiny)",
    )
    p.add_argument(
        "--levels",
        type=csv_list,
        default=None,
        help="comma-separated presets (default o1_bf16,o2_bf16 on a CPU, o1,o2 on CUDA)",
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="synthetic image side, or a language model's sequence length (default 32)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--steps", type=int, default=4, help="steps per block (default 4)")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds, each one block per variant (default 3)"
    )
    add_out_option(p, "layer_plan_cost")
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(p, args)
    args.device = resolve_device(p, args.device)
    unknown = [m for m in args.models if m not in HEADS]
    if unknown or not args.models:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(HEADS)}")
    check_at_least_one(p, args, ("image_size", "batch_size", "steps", "rounds"))
    args.levels = args.levels or (["o1_bf16", "o2_bf16"] if args.device == "cpu" else ["o1", "o2"])
    args.out = args.out or results_path(f"layer_plan_cost_{args.device}.md", args.device)
    return args


def cell_overrides(args, model: str, level: str, planned: bool) -> list[str]:
    plan = [f"+precision.layers.{HEADS[model]}=float32"] if planned else []
    return [
        *one_batch_task(model, args.image_size, args.batch_size, args.device),
        f"precision={level}",
        *plan,
    ]


def run_cell(args, model: str, level: str) -> dict:
    """One (model, level): interleaved blocks of the three variants."""
    from runner.measure.audit import AuditInstrument
    from runner.measure.memory import MemoryInstrument
    from runner.measure.probes import synchronize

    cell = {"model": model, "level": level, "status": "ok", "error": None}
    gc.collect()
    try:
        level_parts = build_runner(compose(cell_overrides(args, model, level, False)))
        plan_parts = build_runner(
            compose(cell_overrides(args, model, level, True)), cpu_batch=level_parts.cpu_batch
        )
        device = level_parts.device
        plan = plan_parts.engine.layer_plan
        cell["layers"] = len(plan.layers)
        cell["deviates"] = plan.deviates
        cell["hooks"] = sum(len(m._forward_pre_hooks) for m in plan_parts.model.modules())
        cell["wrapped"] = sum("forward" in m.__dict__ for m in plan_parts.model.modules())

        def block(variant: str) -> float:
            parts = plan_parts if variant == "plan" else level_parts
            trainer = parts.trainer
            trainer.instruments.find(MemoryInstrument).final = True  # (memory is not metered)
            audit = trainer.instruments.find(AuditInstrument)
            synchronize(device)
            started = time.perf_counter()
            for _ in range(args.steps):
                if variant == "audited":  # every step audited as a run's first step is
                    audit.audited, trainer.global_step = False, 0
                trainer.train_step(*parts.batch)
                trainer.global_step += 1
            synchronize(device)
            return (time.perf_counter() - started) / args.steps

        medians = interleaved_medians(VARIANTS, block, args.rounds, f"{model} {level}")
        base, planned, audited = (medians[v] for v in VARIANTS)
        cell.update(
            {
                "step_ms_level": 1e3 * base,
                "step_ms_plan": 1e3 * planned,
                "step_ms_audited": 1e3 * audited,
                "plan_ms_per_step": 1e3 * (planned - base),
                "plan_fraction": (planned - base) / base,
                "audit_ms_per_step": 1e3 * (audited - base),
                "audit_fraction": (audited - base) / base,
            }
        )
        level_parts = plan_parts = None  # (frees them; the closures above are done)
    except Exception as error:  # noqa: BLE001  (reported; the exit status says so)
        cell["status"], cell["error"] = "crashed", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return cell


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def render(report: dict) -> str:
    lines = [
        f"# Layer plan and audit cost ({report['device']})",
        "",
        "The trainer's own step (`Trainer.train_step`) on one synthetic batch held in memory "
        f"(images {report['image_size']} px, or sequences of {report['image_size']} tokens; batch "
        f"{report['batch_size']}); blocks of {report['steps']} steps alternate over "
        f"{report['rounds']} rounds between the level's step, the step of the same model with "
        "its head planned in fp32, and the level's step with the layer audit's hooks (the first "
        "step of every run, and each diagnosed step). Medians over the blocks; the extra time "
        "is the variant's median minus the level's.",
        "",
        "| model | level | layers | plan: pre-hooks / wrapped forwards | step ms (level) | "
        "step ms (plan) | plan's extra per step | step ms (audited) | audit's extra per "
        "audited step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["results"]:
        if c["status"] != "ok":
            lines.append(f"| {c['model']} | {c['level']} | {c['status']}: {c['error']} |")
            continue
        lines.append(
            f"| {c['model']} | {c['level']} | {c['layers']} | {c['hooks']} / {c['wrapped']} | "
            f"{c['step_ms_level']:.1f} | {c['step_ms_plan']:.1f} | "
            f"{c['plan_ms_per_step']:+.2f} ms ({_pct(c['plan_fraction'])}) | "
            f"{c['step_ms_audited']:.1f} | {c['audit_ms_per_step']:+.2f} ms "
            f"({_pct(c['audit_fraction'])}) |"
        )
    lines += [
        "",
        "A plan that changes a cast model (O2/O3) puts an input cast on every layer (the "
        "`pre-hooks` column: one per layer and per module an entry names; the model's own "
        "input cast is then left to the layers) and runs the planned layers in fp32, which is "
        "part of what the plan's extra time measures; under autocast only the named modules are "
        "wrapped. The audit reads dtypes only (no device sync, no copy); a run audits its first "
        "step and its diagnosed steps.",
        "",
        "## Setup",
        "",
        *setup_lines(report),
        "",
    ]
    return "\n".join(lines)


CSV_FIELDS = [
    "model",
    "level",
    "status",
    "layers",
    "deviates",
    "hooks",
    "wrapped",
    "step_ms_level",
    "step_ms_plan",
    "step_ms_audited",
    "plan_ms_per_step",
    "plan_fraction",
    "audit_ms_per_step",
    "audit_fraction",
    "error",
]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return run_cells(
        "layer_plan_cost",
        "Layer plan cost",
        args,
        argv,
        lambda model, level: run_cell(args, model, level),
        lambda model, level: cell_overrides(args, model, level, True),
        render,
        CSV_FIELDS,
    )


if __name__ == "__main__":
    sys.exit(main())
