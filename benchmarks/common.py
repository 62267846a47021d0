"""Shared by the benchmarks. What every benchmark records beside its numbers (the machine, the
versions, the exact command, the date, the load average), so that a committed result can be
reproduced and compared like with like; and the runner's own objects built from a composed config
(`build_runner`), so that the timing benchmarks step exactly what a run steps."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import re
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # one folder a machine: cpu/, h100/, h200/


def results_path(name: str, device: str, gpu: Optional[str] = None) -> Path:
    """Where a benchmark writes `name` given no --out: benchmarks/results/<machine>/, the machine
    being `cpu` or the GPU's model (`h100` from "NVIDIA H100 80GB HBM3", `cuda` where its name
    holds none): the folder its committed results are found in. `gpu`: the GPU's name, where it
    is not this machine's (results measured elsewhere, merged here)."""
    folder = "cpu"
    if device == "cuda":
        if gpu is None:
            import torch

            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        model = re.search(r"\b([A-Z]\d{2,4})\b", gpu)
        folder = model.group(1).lower() if model else "cuda"
    return RESULTS / folder / name


def machine(device: str) -> dict[str, str]:
    """CPU (and GPU) model, core and thread counts, torch/CUDA/Python versions, platform."""
    import torch

    from runner.precision.checks import DeviceInfo

    info = {
        "cpu": DeviceInfo.from_torch("cpu").name,
        "cores": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = DeviceInfo.from_torch("cuda").describe()
        info["cuda"] = str(torch.version.cuda)
    return info


def command(name: str, argv: Sequence[str]) -> str:
    """The command line that reproduces this run of benchmark `name` (`levels`)."""
    return " ".join([f"python -m benchmarks.{name}", *([shlex.join(argv)] if argv else [])])


def now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def add_device_option(parser, auto: bool = True) -> None:
    """`--device`: cpu or cuda; with `auto` (then the default) cuda where there is one."""
    choices = ["auto", "cpu", "cuda"] if auto else ["cpu", "cuda"]
    parser.add_argument("--device", choices=choices, default=choices[0])


def add_out_option(parser, name: str, beside: str = ".csv and .json", default: str = "") -> None:
    """`--out`: the Markdown results, the other formats beside it (default
    benchmarks/results/<machine>/<name>_<device>.md unless `default` says otherwise)."""
    where = default or f"benchmarks/results/<machine>/{name}_<device>.md"
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"Markdown results; {beside} beside (default {where})"
        if beside
        else f"Markdown results (default {where})",
    )


def add_extra_option(parser, help: str = "more Hydra overrides, applied last") -> None:
    """`--extra KEY=VALUE ...`: more Hydra overrides; given twice, the lists add up."""
    parser.add_argument(
        "--extra", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help=help
    )


def add_threads_option(parser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's CPU threads (default: torch's choice, one per core). On a small shared "
        "machine 1 makes CPU timings far less sensitive to other processes (a parallel op "
        "waits for its slowest thread), at the cost of speed",
    )


def apply_threads(parser, args) -> None:
    """`--threads` into torch, before `machine()` records the thread count."""
    if args.threads is None:
        return
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    import torch

    torch.set_num_threads(args.threads)


def csv_list(text: str) -> list[str]:
    """An argparse type: "a, b,c" -> ["a", "b", "c"] (empty parts dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def int_list(parser, option: str, values: Sequence[Any]) -> list[int]:
    """`values` (an option's comma-separated parts, or its default) as integers; otherwise the
    parser's error `--<option> must be integers, got <values>`."""
    try:
        return [int(v) for v in values]
    except ValueError:
        parser.error(f"--{option} must be integers, got {values}")


def resolve_device(parser, device: str) -> str:
    """`--device`: `auto` is cuda where a CUDA device is available, cpu otherwise; `cuda` where
    none is available is the parser's error."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return device


def fill_defaults(args, defaults: dict[str, Any]) -> None:
    """Each option of `defaults` (attribute names) left unset (None) takes its value there: the
    per-device defaults of a benchmark (a 0 given is kept, for the checks to refuse)."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def check_at_least_one(parser, args, names: Sequence[str]) -> None:
    """The parser's error `--<name> must be at least 1` for the first of the integer options
    `names` (attribute names, `image_size` for `--image-size`) below 1; None (an option left to a
    per-case default) is not checked."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def check_presets(parser, levels: Sequence[str]) -> None:
    """The parser's error, with the known presets, where a level of `levels` is not a precision
    preset (no `+compile` suffix here: see `parse_level` for that)."""
    from runner.run.plan import preset_options

    known = preset_options()
    unknown = [lvl for lvl in levels if lvl not in known]
    if unknown:
        parser.error(f"unknown level(s) {', '.join(unknown)}; choose from {', '.join(known)}")


def setup_lines(report: dict, versions: str = "") -> list[str]:
    """A timing benchmark's Setup lines: the machine (`versions`, e.g. "MLflow 2.x, ", stands
    between Python's version and the platform), the load average at start and end, the date and
    wall time, the command."""
    m = report["machine"]
    return [
        f"- Machine: {m['cpu']}, {m['cores']} cores (torch uses {m['torch_threads']} threads)"
        + (f"; GPU {m['gpu']}, CUDA {m['cuda']}" if "gpu" in m else "")
        + f"; torch {m['torch']}, Python {m['python']}, {versions}{m['platform']}",
        f"- Load average (1, 5, 15 min): {report['load_start']} at start, {report['load_end']} "
        "at end",
        f"- Date: {report['date']}; wall time {report['wall_s']:.0f} s",
        f"- Command: `{report['command']}`",
    ]


def save_figure(fig, path: Path) -> Path:
    """A benchmark's figure: laid out, written to `path` (its folder made) at 110 dpi, closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(
    out: Path, markdown: str, rows: Sequence[dict], fields: Sequence[str], payload: dict
) -> list[Path]:
    """The files every benchmark leaves: `out` (the Markdown table), `out`.csv (one row per
    result, the columns `fields`; other keys of a row are left out) and `out`.json (`payload`,
    everything). Returns their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown)
    csv_path, json_path = out.with_suffix(".csv"), out.with_suffix(".json")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return [out, csv_path, json_path]


def show(text: str, paths: Sequence[Path]) -> None:
    """The results printed, and the files they were written to named."""
    print()
    print(text)
    print("Wrote " + ", ".join(str(p) for p in paths))


def provenance(name: str, argv: Sequence[str], device: str, load_start: list, started: float):
    """Where, how and when a timing benchmark measured (called once the measuring is done): the
    machine, the command, the date, the load averages at start and end, the wall time."""
    return {
        "machine": machine(device),
        "command": command(name, argv),
        "date": now(),
        "load_start": load_start,
        "load_end": load_average(),
        "wall_s": time.perf_counter() - started,
    }


def load_average() -> list[float]:
    """1-, 5- and 15-minute load averages: timings on a shared machine are only as good as its
    quiet, so every timing benchmark records them at its start and end."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


COMPILE_SUFFIX = "+compile"


@dataclass(frozen=True)
class LevelSpec:
    """A benchmark's level: a precision preset, run eagerly or with `trainer.compile=true`
    (written `<preset>+compile`, e.g. `o2_bf16+compile`), with the preset's optimizer state or
    another format (`<preset>+<format>state`, e.g. `o2_bf16+int4state`:
    `precision.optimizer_state=int4`)."""

    preset: str
    compile: bool = False
    state: str | None = None  # precision.optimizer_state (int8, int4, fp8, bf16, fp32, fp16)

    @property
    def name(self) -> str:
        return (
            self.preset
            + (f"+{self.state}state" if self.state else "")
            + (COMPILE_SUFFIX if self.compile else "")
        )

    def overrides(self) -> list[str]:
        return [
            f"precision={self.preset}",
            *([f"precision.optimizer_state={self.state}"] if self.state else []),
            *(["trainer.compile=true"] if self.compile else []),
        ]


# the optimizer-state formats a level may name (`+int8state`), as precision.optimizer_state spells
# them or their short names
STATE_SUFFIXES = ("int8", "int4", "fp8", "bf16", "fp32", "fp16")
_SUFFIXES_SAID = (
    f"{COMPILE_SUFFIX} (trainer.compile=true) and +<format>state "
    f"(precision.optimizer_state; format: {', '.join(STATE_SUFFIXES)})"
)


def parse_level(text: str, known: Sequence[str]) -> LevelSpec:
    """`<preset>`, `<preset>+<format>state`, each optionally with `+compile`, into a LevelSpec;
    a ValueError saying what is wrong (an unknown preset, with the known ones, or an unknown
    suffix) otherwise."""
    preset, *suffixes = text.split("+")
    compile_, state = False, None
    for suffix in suffixes:
        if suffix == COMPILE_SUFFIX[1:] and not compile_:
            compile_ = True
        elif suffix.endswith("state") and suffix[:-5] in STATE_SUFFIXES and state is None:
            state = suffix[:-5]
        else:
            raise ValueError(f"{text!r}: the suffixes are {_SUFFIXES_SAID}")
    if preset not in known:
        raise ValueError(
            f"unknown level {preset!r}; choose from {', '.join(known)} (each "
            f"optionally with {_SUFFIXES_SAID})"
        )
    return LevelSpec(preset, compile_, state)


def describe_level(precision: Any, compiled: bool = False) -> str:
    """What a level computes in (`runner.report.analysis.describe_dtype`: fp8 Linear layers and
    stochastic rounding included), plus torch.compile, which is a trainer setting, not a precision
    property."""
    from runner.report.analysis import describe_dtype

    return describe_dtype(precision) + ("; torch.compile" if compiled else "")


def fresh_compile_cache() -> str:
    """Point torch.compile's on-disk cache (Inductor's graphs and kernels, Triton's too) at a new
    empty folder for this process, unless `TORCHINDUCTOR_CACHE_DIR` is set already, so that a
    compile time measured here is a cold compile and not a hit on an earlier run's cache. Returns
    what the results should say about the cache."""
    import tempfile

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return (
            f"TORCHINDUCTOR_CACHE_DIR={os.environ['TORCHINDUCTOR_CACHE_DIR']} (set by the "
            "user: compiles may reuse what earlier runs cached)"
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    return "a new empty folder for this run (the first compile of each graph is cold)"


def compose(overrides: Sequence[str]):
    """The project's config tree composed with Hydra's compose API, as `python -m runner` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import runner.config  # noqa: F401  (registers the schemas)
    from runner.config.finder import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def store_uri(given: Optional[str], prefix: str) -> str:
    """A benchmark's MLflow store: `given` (its --tracking-uri), or else a SQLite database in a
    new temporary folder named `prefix`..., resolved as the runner resolves a tracking URI."""
    import tempfile

    from runner.tracking.store import resolve_tracking_uri

    if given is None:
        folder = Path(tempfile.mkdtemp(prefix=prefix))
        given = f"sqlite:///{folder / 'mlflow.db'}"
    return resolve_tracking_uri(given)


def prepare_store(tracking_uri: str, experiment: str) -> None:
    """Create the store and the experiment (artifacts beside a SQLite database) before the runs,
    as the runner's own Tracker does."""
    from runner.tracking.mlflow_tracker import MlflowTracker

    MlflowTracker(tracking_uri, experiment)


@dataclass
class RunnerParts:
    """What `runner.run.app.run` builds for one config, plus one training batch on the device."""

    cfg: Any
    device: Any
    properties: Any
    model: Any
    optimizer: Any
    scheduler: Any
    engine: Any
    trainer: Any
    memory: Any
    batch: tuple
    cpu_batch: tuple  # the same batch as the loader gave it (host memory), for reuse
    kernels: str


def model_overrides(model: str) -> list[str]:
    """A benchmark's model: a model config option (`resnet50`), or `<zoo>:<arch>` for a model of
    a zoo by name (`torchvision:vit_b_16` -> `model=torchvision model.arch=vit_b_16`)."""
    zoo, colon, arch = model.partition(":")
    return [f"model={zoo}", f"model.arch={arch}"] if colon else [f"model={model}"]


def model_problem(model: str) -> str | None:
    """Why `model` (an option, or `<zoo>:<arch>`) does not compose with the config tree, or None:
    the composition error's first line."""
    try:
        compose(model_overrides(model))
    except Exception as error:  # noqa: BLE001  (Hydra's own errors: reported as the reason)
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return None


def model_label(model: str) -> str:
    """The short name of a benchmark's model: the zoo's architecture name for `<zoo>:<arch>`."""
    return model.partition(":")[2] or model


def is_language_model(model: str) -> bool:
    """Whether a benchmark's model (as `model_overrides` takes it) is a language model: the
    runner's GPTs (gpt, gpt_tiny, gpt2_small) and Hugging Face's (`hf:<type>`)."""
    from runner.config import options

    zoo, colon, _ = model.partition(":")
    spec = next((s for s in options.SPECS if s.group == "model" and s.name == zoo), None)
    return spec is not None and spec.task == options.LANGUAGE_MODEL


def one_batch_task(model: str, image_size: int, batch_size: int, device: str) -> list[str]:
    """Overrides for a timing benchmark's task: synthetic data of exactly one batch (drawn once,
    kept in memory), no worker processes, no progress bar. `model` as `model_overrides` takes
    it. For a language model the size is the sequence length: a batch of `batch_size` sequences
    of `image_size` tokens of the synthetic language (samples per second are sequences per
    second; tokens per second are that times the length)."""
    if is_language_model(model):
        tokens = batch_size * image_size + 1  # exactly one batch of windows
        data = [
            "data=synthetic_text",
            f"data.block_size={image_size}",
            f"data.num_train={tokens}",
            f"data.num_val={tokens}",
        ]
    else:
        data = [
            "data=synthetic",
            f"data.image_size={image_size}",
            f"data.num_train={batch_size}",
            f"data.num_val={batch_size}",
        ]
    return [
        *model_overrides(model),
        *data,
        f"trainer.batch_size={batch_size}",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        f"trainer.device={device}",
    ]


def build_runner(
    cfg, on_metrics: Optional[Callable] = None, cpu_batch: Optional[tuple] = None
) -> RunnerParts:
    """The runner's own objects for `cfg`, built by `runner.run.build.build` exactly as a run
    builds them (without the MLflow run), a Trainer over them, then one batch of the training
    data moved to the device the trainer's way. A benchmark times
    `parts.trainer.train_step(*parts.batch)`: the runner's step.

    The memory probe is reset where a run resets it (once the data is in memory), so
    `parts.memory.peak_mb()` counts weights, masters, optimizer state and activations.
    `cpu_batch` (a previous build's `cpu_batch`, for the same data config) skips drawing the
    batch again: synthetic 224-px images take seconds."""
    from runner import csrc
    from runner.run.build import build
    from runner.run.context import RunContext
    from runner.run.plan import make_plan
    from runner.run.trainer import Trainer

    plan = make_plan(cfg)
    parts = build(plan)
    context = RunContext(on_metrics=on_metrics) if on_metrics is not None else None
    trainer = Trainer(cfg.trainer, parts, context, device=plan.device)
    x, y = cpu_batch if cpu_batch is not None else next(iter(parts.train_loader))
    return RunnerParts(
        cfg=cfg,
        device=plan.device,
        properties=plan.resolution.properties,
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        engine=parts.engine,
        trainer=trainer,
        memory=parts.memory,
        batch=trainer.to_device(x, y),
        cpu_batch=(x, y),
        kernels=csrc.name_of(parts.engine.kernels),
    )


def fp32_model(cfg):
    """The model a run of `cfg` starts from, in fp32: built by that run's own O0 plan (the same
    config with the `o0` preset's precision and no torch.compile), whose build seeds with the same
    `trainer.seed` and draws the same data before the model, so its initial weights are the run's,
    on its device and in its memory format, before any cast, fp8 conversion or layer plan. What a
    hand-written loop or a peer starts from, to do the runner's work from the same weights."""
    import copy

    from omegaconf import OmegaConf, read_write

    from runner.run.build import build
    from runner.run.plan import make_plan

    o0 = copy.deepcopy(cfg)
    with read_write(o0):
        OmegaConf.update(o0, "precision", compose(["precision=o0"]).precision, merge=False)
        o0.trainer.compile = False
    return build(make_plan(o0)).model


def interleaved_medians(
    variants: Sequence[str], block: Callable[[str], float], rounds: int, label: str
) -> dict[str, float]:
    """Time `block(variant)` (seconds a step) for each variant: once each to warm up, then
    `rounds` rounds of one block per variant, the order reversed every other round so that drift
    hits them alike; returns each variant's median and prints each round under `label`."""
    import statistics

    for variant in variants:  # warm-up: caches, first steps, files
        block(variant)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for index in range(rounds):
        order = variants if index % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            samples[variant].append(block(variant))
        print(
            f"{label} round {index + 1}/{rounds}: "
            + ", ".join(f"{v} {1e3 * samples[v][-1]:.1f} ms" for v in variants),
            flush=True,
        )
    return {v: statistics.median(samples[v]) for v in variants}


def run_cells(
    name: str,
    title: str,
    args: Any,
    argv: Sequence[str],
    cell: Callable[[str, str], dict],
    overrides: Callable[[str, str], list],
    render: Callable[[dict], str],
    fields: Sequence[str],
    **extra: Any,
) -> int:
    """A timing benchmark over the (model, level) cells of `args`: announce it, time each cell
    (`cell(model, level)` -> its result dict, `status` "ok" or not), then write the Markdown,
    CSV and JSON (`render`, `fields`) with the machine, the load averages, the date, the command
    and each cell's `overrides`, and print the table. Exit status 1 if a cell crashed."""
    load_start = load_average()
    started = time.perf_counter()
    print(
        f"{title} on {args.device}: {', '.join(args.models)} x {', '.join(args.levels)}, "
        f"{args.rounds} rounds of {args.steps}-step blocks; load average {load_start}",
        flush=True,
    )
    results = [cell(model, level) for model in args.models for level in args.levels]
    report = {
        "benchmark": name,
        "device": args.device,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rounds": args.rounds,
        **extra,
        "results": results,
        **provenance(name, argv, args.device, load_start, started),
        "overrides": {f"{m}/{lv}": overrides(m, lv) for m in args.models for lv in args.levels},
    }
    paths = write_results(args.out, render(report), results, fields, report)
    show(render(report), paths)
    return 1 if any(c["status"] != "ok" for c in results) else 0
