"""`python -m runner.diagnose`'s command line: the config composed as `python -m runner` composes
it, a few fp32 steps measured (`preflight`), the findings printed, written and logged on a run
tagged `diagnose`, and with `--plan` a layer plan (see runner.diagnose)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import runner
from runner import files, shell
from runner.config import options
from runner.diagnose.analysis import Preflight, analyse, render
from runner.errors import RunnerError
from runner.files import write_atomic

DEFAULT_STEPS = 3
REPORT_TXT = "report.txt"


def measure(trainer, steps: int, folder: Path, inputs: bool = False, layers=None) -> list:
    """`steps` training steps of `trainer` (fp32: an O0 engine), every one diagnosed in every
    format; returns their layer records (runner.run.autoplan.measure)."""
    from runner.run.autoplan import measure as measure_steps

    return measure_steps(trainer, steps, folder, inputs=inputs, layers=layers)


def preflight(
    trainer, steps: int, folder: Path, title: str, device_type: str = "cpu", for_plan: bool = False
) -> tuple[Preflight, str, list[Path]]:
    """Measure, analyse, render, and write the artifacts into `folder` (the layers and
    exponents CSV files, the figure with the recommended loss scale outlined, the text).
    `for_plan`: probe every layer of a layer plan (every module that owns parameters) and their
    inputs (the records are kept in the result)."""
    from runner.measure.diagnostics import FORMATS, GRADIENT_KINDS
    from runner.measure.run_diagnostics import FIGURE_PNG, plot_exponents
    from runner.run.autoplan import plan_layers

    records = measure(
        trainer, steps, folder, inputs=for_plan, layers=plan_layers if for_plan else None
    )
    result = analyse([r for r in records if r.kind != "input"], steps, device_type)
    result.records = records
    text = render(result, title)
    figure = plot_exponents(
        [r for r in records if r.kind in GRADIENT_KINDS],
        list(FORMATS.values()),
        folder / FIGURE_PNG,
        f"Gradient exponents over {steps} fp32 steps (unscaled)",
        loss_scale=result.loss_scale,
    )
    (folder / REPORT_TXT).write_text(text)
    paths = [folder / "layers.csv", folder / "exponents.csv", figure, folder / REPORT_TXT]
    return result, text, paths


# ---- the command ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runner.diagnose",
        description="Pre-flight of a run's numeric range: a few fp32 training steps of the "
        "configured model and data, then, per layer, what fp16, bf16 and fp8 would lose "
        "(underflow, overflow), the fp16 loss scale that keeps the gradients in range, and "
        "which preset to try first. Takes the same overrides as python -m runner.",
    )
    parser.add_argument("--version", action="version", version=runner.version_line())
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"fp32 training steps to observe (default {DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--out",
        type=files.user_path,
        default=Path("diagnostics"),
        help="folder for the CSV files, the figure and the text (default ./diagnostics)",
    )
    parser.add_argument(
        "--plan",
        type=files.user_path,
        default=None,
        metavar="PLAN.yaml",
        help="also write a layer plan for the asked level (precision=...): each "
        "layer's narrowest format whose range holds its values, and why; run it "
        "with precision.layer_plan=PLAN.yaml",
    )
    parser.add_argument(
        "--max-underflow",
        type=float,
        default=None,
        metavar="SHARE",
        help="--plan: the share of a layer's gradients a format may lose to "
        "underflow (default precision.layer_plan_max_underflow, 0.01)",
    )
    parser.add_argument(
        "--max-overflow",
        type=float,
        default=None,
        metavar="SHARE",
        help="--plan: the share of a layer's values a format may lose to overflow "
        "(default precision.layer_plan_max_overflow, 0)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, as for python -m runner (e.g. model=resnet18 data=synthetic)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    for flag in ("max_underflow", "max_overflow"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a share in [0, 1)")
    return args


def compose(overrides: Sequence[str]):
    """The run's config, composed as `python -m runner` composes it; a bad override raises
    the RunnerError `python -m runner` says for it (runner.config.mistakes: the key or group,
    what was given, the closest choices), not Hydra's message of several lines."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import runner.config  # noqa: F401  (registers the schemas)
    from runner.config import mistakes
    from runner.config.finder import config_dir

    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    except Exception as error:
        if not mistakes.is_composition_error(error):
            raise
        raise mistakes.explain(error, overrides) from error


def run(
    cfg,
    overrides: Sequence[str],
    steps: int,
    out: Path,
    plan_path: Optional[Path] = None,
    max_underflow: Optional[float] = None,
    max_overflow: Optional[float] = None,
) -> Preflight:
    """The pre-flight of `cfg`: checked like a run (ConfigError before anything is built), then
    measured in fp32 in an MLflow run tagged `diagnose`; with `plan_path`, a layer plan for the
    asked level is written there too (runner.run.autoplan)."""
    import contextlib

    from runner.run import out_of_memory, recorded
    from runner.run.build import build
    from runner.run.context import RunContext
    from runner.run.plan import make_plan
    from runner.run.trainer import Trainer, trainer_config
    from runner.tracking import tags as tag
    from runner.tracking.trackers import open_tracker

    plan = make_plan(cfg)  # the run as asked for must be valid
    check_outputs(out, plan_path)
    device = plan.device
    tracker = open_tracker(cfg, out)
    measured = plan.in_fp32()  # the same run, in fp32 (no layer plan)

    def guarded(call):  # running out of memory: one line (runner.run.out_of_memory)
        # (the pre-flight measures in fp32 whatever the level: no 16-bit level to advise)
        return out_of_memory.guarded(call, device, "fp32", lambda: recorded.sizes(measured))

    with contextlib.closing(guarded(lambda: build(measured))) as parts:  # workers end with it
        target = str(cfg.precision.preset)
        name, params, tags = _record(measured, overrides, steps)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # (what check_outputs could not foresee: /proc, a race)
            raise _unwritable("the diagnostics", out, error, "--out to a folder") from None
        with tracker.start_run(name, params, tags) as tracked:
            trainer = Trainer(
                trainer_config(cfg.trainer),
                parts,
                RunContext(on_metrics=tracked.log_metrics),
                device=device,
            )
            title = (
                f"Range pre-flight: {options.label(cfg.model)} on "
                f"{options.label(cfg.data)}, batch {cfg.trainer.batch_size}, {steps} fp32 "
                f"training steps on {device.type} (asked for precision={target})"
            )
            result, text, paths = guarded(
                lambda: preflight(
                    trainer, steps, out, title, device.type, for_plan=plan_path is not None
                )
            )
            shell.say()
            shell.say(text, end="")
            if plan_path is not None:
                paths.append(
                    write_plan(
                        plan,
                        parts.model,
                        result.records,
                        steps,
                        plan_path,
                        max_underflow,
                        max_overflow,
                    )
                )
            tracked.log_metrics(_summary(result, trainer), steps)
            tracked.set_tag(tag.DIAGNOSE_RECOMMENDED, result.preset)
            tracked.set_tag(tag.DIAGNOSE_KEEP_FP32, ", ".join(result.keep_fp32) or "none")
            for path in paths:
                tracked.log_file(path, "diagnostics")
        shell.say(
            f"\nWrote {', '.join(str(p) for p in paths)}; logged them on {tracker.label} run "
            f"{name!r} ({tracked.run_id}).\n{tracker.hint()}"
        )
    return result


def _record(measured: Any, overrides: Sequence[str], steps: int) -> tuple[str, dict, dict]:
    """(name, params, tags) of the pre-flight's MLflow run of the fp32 plan `measured`: the run's
    params with its steps, its environment, the `diagnose` tags, the user's own tags."""
    from runner.run import recorded
    from runner.tracking import tags as tag
    from runner.tracking.record import typed_command

    cfg = measured.cfg
    params = recorded.config_params(measured)
    params["diagnose.steps"] = str(steps)
    tags = recorded.environment_tags(measured.device)
    tags.update(
        {
            tag.DIAGNOSE: "true",
            tag.DIAGNOSE_TARGET: str(cfg.precision.preset),
            tag.OVERRIDES: shell.join(overrides),
            tag.COMMAND: typed_command(),
        }
    )
    tags.update(tag.user_tags(cfg.mlflow.tags))
    return cfg.mlflow.run_name or f"{options.label(cfg.model)}-diagnose", params, tags


def _summary(result: Preflight, trainer: Any) -> dict[str, float]:
    """The pre-flight's metrics: the fp16 loss scale it recommends, the gradients' underflow at
    it, and the model's memory by kind."""
    from runner.measure.memory import MemoryInstrument

    underflow = result.underflow_at_scale
    summary = {
        "diagnose_fp16_loss_scale": result.loss_scale or math.nan,
        "diagnose_fp16_grad_underflow_frac_at_scale": math.nan if underflow is None else underflow,
    }
    memory = trainer.instruments.find(MemoryInstrument).parts
    if memory is not None:
        summary.update(memory.metrics())
    return summary


def check_outputs(out: Path, plan_path: Optional[Path]) -> None:
    """Refuse, before anything is built, an --out or --plan that cannot be written (found
    after the steps, it cost the measurement and ended in a traceback)."""
    problem = files.folder_problem(out)
    if problem is not None:
        raise RunnerError(
            f"Cannot write the diagnostics to {out}: {problem}; set --out to a folder you can write"
        )
    if plan_path is None:
        return
    if plan_path.is_dir():
        raise RunnerError(f"--plan {plan_path} is a folder; give the plan file's name (PLAN.yaml)")
    problem = files.folder_problem(plan_path.parent)
    if problem is not None:
        raise RunnerError(
            f"Cannot write the layer plan to {plan_path}: {problem}; set --plan to a file in a "
            "folder you can write"
        )


def _unwritable(what: str, path: Path, error: OSError, fix: str) -> RunnerError:
    return RunnerError(
        f"Cannot write {what} to {path}: {error.strerror or error}; set {fix} you can write"
    )


def write_plan(
    plan,
    model,
    records,
    steps: int,
    path: Path,
    max_underflow: Optional[float],
    max_overflow: Optional[float],
) -> Path:
    """Decide the layer plan of the asked level from the pre-flight's records, print it and write
    it (a plan file) to `path`."""
    from runner.run import autoplan

    node = plan.cfg.precision
    thresholds = autoplan.Thresholds(
        node.layer_plan_max_underflow if max_underflow is None else max_underflow,
        node.layer_plan_max_overflow if max_overflow is None else max_overflow,
    )
    preset = str(node.preset)
    auto = autoplan.decide(
        model, records, autoplan.weight_stats(model), plan.properties, thresholds, preset, steps
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, auto.yaml())  # a plan file a run may be reading
    except OSError as error:  # (a disk that filled while it measured)
        raise _unwritable("the layer plan", path, error, "--plan to a file in a folder") from None
    counts = ", ".join(f"{n} {fmt}" for fmt, n in auto.counts().items())
    shell.say(
        f"\nLayer plan for precision={preset} ({counts}; {len(auto.rules)} entries differ "
        f"from the level); {auto.scale_note}:\n{auto.table()}\n"
    )
    shell.say(
        f"Wrote the plan to {path}; train with it: python -m runner precision={preset} "
        f"{shell.override('precision.layer_plan', str(path))} ..."
    )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = compose(args.overrides)
        run(
            cfg,
            args.overrides,
            args.steps,
            args.out,
            args.plan,
            args.max_underflow,
            args.max_overflow,
        )
    except RunnerError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
