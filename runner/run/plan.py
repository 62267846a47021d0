"""A run's plan: everything decided from the config before anything is built.

`make_plan(cfg)` checks the whole input (the preset's level, the value rules, the device, the
precision properties and their findings), names the run, finds its checkpoint folder and decides
whether it resumes (and from which checkpoint, checked against the config). It builds nothing,
logs nothing and creates no MLflow run, so a bad config stops here with a `ConfigError` naming the
key. The resulting `RunPlan` is frozen and is what a run, a dry run, a sweep's up-front check of
every job and the benchmarks all work from (`runner.run.build.build(plan)` builds the parts). What
planning computes (the layer rules, the declared input, the model on the meta device, the task,
the sharding decision, the properties) it computes once and carries on the plan: plan.md beside
this file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from runner import files
from runner.config import options
from runner.config.finder import config_dir
from runner.config.precision import run_name_suffixes
from runner.config.validation import validate
from runner.config.values import override_text, with_values
from runner.errors import ConfigError
from runner.precision import Finding, Properties, Resolution, layers, resolve
from runner.precision.checks import DeviceInfo, concrete_device
from runner.precision.layers import LayerPlan, LayerRule
from runner.precision.properties import Context, level_preset, parse_opt_level, strict_finding
from runner.run import batches, checkpoint, cpu_fp16, cuda_graphs
from runner.run.model_checks import (
    Declared,
    MetaModel,
    check_layers,
    check_parts,
    check_strategy,
)
from runner.run.resume import Resume
from runner.tracking.tags import user_tags


@dataclass(frozen=True)
class Measured:
    """What was measured before the run was planned, given to `make_plan` as its input like an
    override: `settings`, the config keys trainer.tune chose (set on the config exactly as the
    command line would set them: runner.run.tune), and `layer_entries`, the entries the layer
    plan's pre-flight chose for `precision.layer_plan=auto` (runner.run.autoplan), with its plan
    file (`auto_plan`: every layer's choice, and why). The plan made with them is the run's one
    plan: its name, params, findings and precision table are those of the config as trained."""

    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    layer_entries: tuple[LayerRule, ...] = ()
    auto_plan: str = ""


@dataclass(frozen=True)
class RunPlan:
    """What one run will be, decided once from its config."""

    cfg: DictConfig  # the composed config (read, never changed, after planning)
    config_tree: Mapping[str, Any]  # `cfg` resolved to plain containers (params, checkpoints)
    device: torch.device  # cpu or cuda; under torchrun each rank takes cuda:LOCAL_RANK of it
    resolution: Resolution  # the resolved precision properties and every finding about them
    run_name: str
    checkpoint_folder: Path  # <checkpoint_dir>/<experiment>/<run name>: this name's runs
    resume: Optional[Resume]  # the checkpoint this run continues from, checked; None: fresh
    specs: Mapping[str, Optional[options.Spec]]  # each option group's spec, looked up once
    task: str = options.CLASSIFICATION  # task=auto resolved (runner.tasks): what a batch is
    # precision per layer (runner.precision.layers): the plan file's entries (with
    # layer_plan=auto, the pre-flight's: Measured.layer_entries), then precision.layers'
    layer_rules: tuple[LayerRule, ...] = ()
    auto_plan: str = ""  # layer_plan=auto: the pre-flight's plan file (Measured.auto_plan)
    meta: Optional[MetaModel] = None  # the model on the meta device, built once on first use
    layer_check: Optional[LayerPlan] = None  # layer_rules on the meta model's layers (a dry run's)
    shards: bool = False  # trainer.strategy=fsdp, checked: FSDP2 shards the model over the ranks

    @property
    def properties(self) -> Properties:
        return self.resolution.properties

    @property
    def declared(self) -> Optional[Declared]:
        """(classes, input shape) the data config declares; None: only the dataset can tell."""
        return self.meta.declared if self.meta is not None else None

    def meta_model(self) -> Optional[torch.nn.Module]:
        """The run's model on the meta device (built now if no check has built it yet); None
        where the data does not declare its input or the model cannot be made there."""
        return self.meta.get() if self.meta is not None else None

    def estimated_steps(self, datasets: Any = None, world_size: int = 1) -> Optional[int]:
        """The run's training steps for each of `world_size` ranks, as its config (or its loaded
        `datasets`) tells them; None where only the data can tell (runner.run.batches)."""
        return batches.estimated_steps(
            self.cfg, self.task, self.specs.get("data"), datasets, world_size
        )

    def flops_per_sample(self) -> Optional[float]:
        """The model's training FLOPs per sample (forward and backward), counted once on the
        meta model (the first time asked: a run's build, a dry run); None where the data does
        not declare its input or the meta device cannot run the model."""
        from runner.tasks import task_for

        if self.meta is None:
            return None
        return self.meta.flops_per_sample(task_for(self.task).input_dtype)

    def in_fp32(self, device: Optional[torch.device] = None) -> RunPlan:
        """The same run in fp32 (O0 on `device`, default the plan's), without a layer plan and
        resuming nothing: what a range pre-flight measures (runner.run.autoplan and
        runner.diagnose)."""
        return dataclasses.replace(
            self,
            resolution=resolve("O0", device=device or self.device),
            resume=None,
            layer_rules=(),
            layer_check=None,
        )


def make_plan(cfg: DictConfig, apart: str = "", measured: Optional[Measured] = None) -> RunPlan:
    """Check everything about `cfg` and decide the run (see the module docstring); raises
    ConfigError naming the key for any bad input, before anything is built. `apart`: what sets
    a sweep job apart from the sweep's other jobs, added to its default name; `measured`: what
    was measured before planning (trainer.tune's settings, the auto layer plan's entries), taken
    as given."""
    measured = measured or Measured()
    if measured.settings:
        cfg = with_values(cfg, measured.settings)
    checked = check_config(cfg, measured.layer_entries)
    run_name = default_run_name(cfg, checked.resolution.properties, apart)
    folder = checkpoint.run_folder(cfg.trainer.checkpoint_dir, cfg.mlflow.experiment_name, run_name)
    problem = files.folder_problem(folder)
    if problem is not None:  # (else found at the first epoch's end, the epoch lost)
        raise ConfigError(
            "trainer.checkpoint_dir",
            f"checkpoints cannot be written under {cfg.trainer.checkpoint_dir}: {problem}",
            "a folder you can write (checkpoints go to "
            "<checkpoint_dir>/<experiment>/<run name>/<run id>/)",
        )
    config_tree = OmegaConf.to_container(cfg, resolve=True)
    resume = Resume.decide(cfg.resume, folder, config_tree)
    return RunPlan(
        cfg,
        config_tree,
        checked.device,
        checked.resolution,
        run_name,
        folder,
        resume,
        checked.specs,
        checked.task,
        checked.layer_rules,
        measured.auto_plan,
        meta=checked.meta,
        layer_check=checked.layer_check,
        shards=checked.shards,
    )


@dataclass(frozen=True)
class Checked:
    """What `check_config` found, each computed once (the `RunPlan` fields of the same names)."""

    device: torch.device
    resolution: Resolution
    specs: Mapping[str, Optional[options.Spec]]
    task: str
    layer_rules: tuple[LayerRule, ...]
    meta: MetaModel
    layer_check: Optional[LayerPlan]
    shards: bool


def check_config(cfg: DictConfig, entries: tuple[LayerRule, ...] = ()) -> Checked:
    """The checks of `make_plan` before the run is named: the preset's level, the value rules,
    the device, the precision properties and the layer rules (the plan file read once, or the
    auto plan's measured `entries`), the parts the config names, the layer plan and the strategy
    against the model (built once on the meta device, where the data declares its input); raises
    ConfigError naming the key."""
    check_opt_level(cfg)
    specs = options.specs_of(cfg)
    validate(cfg, specs)
    user_tags(cfg.mlflow.tags)  # (a list value, a tag the runner writes itself: refused)
    task = resolve_task(cfg, specs)
    device = select_device(cfg.trainer.device)
    if cfg.trainer.sync_batchnorm and device.type != "cuda":
        raise ConfigError(
            "trainer.sync_batchnorm",
            "SyncBatchNorm needs CUDA GPUs (NCCL); it has "
            f"no implementation on {device.type} (Gloo)",
            "false on a CPU",
        )
    resolution, rules = resolve_precision(cfg, device, entries)
    cuda_graphs.check(cfg, resolution.properties, task, device)
    meta = check_parts(cfg, specs, task)
    layer_check = check_layers(rules, meta, resolution.properties)
    shards = check_strategy(cfg, resolution.properties, rules, meta)
    if not cfg.dry_run:  # (a dry run says it instead: runner.run.app.print_dry_run)
        refused = slow_fp16(cfg, resolution.properties, device, meta, specs, task)
        if refused is not None:
            raise refused
    return Checked(device, resolution, specs, task, rules, meta, layer_check, shards)


def slow_fp16(
    cfg: DictConfig,
    properties: Properties,
    device: torch.device,
    meta: Optional[MetaModel],
    specs: Mapping[str, Optional[options.Spec]],
    task: str,
) -> Optional[ConfigError]:
    """An fp16 level on a CPU whose run would take too long (runner.run.cpu_fp16): estimated
    from the meta model's FLOPs and the steps the config tells; None where it may run."""
    if device.type != "cpu" or torch.float16 not in properties.compute_dtypes or meta is None:
        return None
    from runner.tasks import task_for

    flops = meta.flops_per_sample(task_for(task).input_dtype)
    data = specs.get("data")
    steps, samples = (
        batches.estimated_steps(cfg, task, data),
        batches.estimated_samples(cfg, task, data),
    )
    return cpu_fp16.refusal(cfg, properties, device, flops, steps, samples)


# ---- the task ---------------------------------------------------------------------------------
def _option(cfg: DictConfig, group: str) -> str:
    node = cfg[group]
    return (
        f"{group}._target_={node['_target_']}"
        if options.has_target(node)
        else f"{group}={node.get('name')}"
    )


def resolve_task(cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]]) -> str:
    """The run's task: `task.name`, where `auto` is the dataset's (a text dataset is a language
    model's, an image dataset a classifier's; a user's dataset by `_target_` takes the model's,
    else classification). A task the dataset or the model does not serve is refused, naming
    both."""
    chosen = str(OmegaConf.select(cfg, "task.name", default="auto") or "auto")
    data = specs.get("data")
    model = specs.get("model")
    data_task = data.task if data is not None else None
    model_task = model.task if model is not None else None
    if chosen == "auto":
        task = data_task or model_task or options.CLASSIFICATION
    else:
        task = chosen
        if data_task is not None and data_task != task:
            raise ConfigError(
                "task.name",
                f"task={task}, but {_option(cfg, 'data')} is {_TASK_WORDS[data_task].data}",
                f"task=auto or task={data_task} (or another dataset)",
            )
    if model_task is not None and model_task != task:
        raise ConfigError(
            "model.name",
            f"{_option(cfg, 'model')} is {_TASK_WORDS[model_task].model}"
            f", but the run's task is {task} ({_option(cfg, 'data')})",
            f"{_TASK_WORDS[task].models}, or {_TASK_WORDS[model_task].datasets}",
        )
    return task


class _TaskWords(NamedTuple):
    """How a task mismatch names a task's data and models, and what it offers instead."""

    data: str  # what a dataset of the task is
    model: str  # what a model of the task is
    models: str  # the models to pick for data of this task
    datasets: str  # the data to pick for a model of this task


_TASK_WORDS = {
    options.CLASSIFICATION: _TaskWords(
        "a classification dataset",
        "an image classifier",
        "an image classifier (model=tiny, resnet18, vit_tiny, ...)",
        "an image dataset (data=synthetic, cifar10, imagefolder, ...)",
    ),
    options.LANGUAGE_MODEL: _TaskWords(
        "a text (language-model) dataset",
        "a language model",
        "a language model (model=gpt_tiny, gpt, gpt2_small, hf)",
        "text (data=synthetic_text, text, tokens)",
    ),
}


def select_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device", "cuda was requested but no CUDA device is available", "auto, cpu"
        )
    return concrete_device(name)  # "cuda" -> "cuda:0": the device its tensors report


# ---- the precision level -------------------------------------------------------------------------
def preset_options() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "precision").glob("*.yaml"))


_PRESET_NAME = re.compile(r"^o([0-3])(?:_|$)")


def preset_level(preset: Optional[str]) -> Optional[str]:
    """The level a preset's name declares: `o2`, `o2_bf16`, `o2_anything` -> "O2"; None for a
    name outside that convention (a user's own preset), whose level is not checked."""
    match = _PRESET_NAME.match(preset or "")
    return f"O{match.group(1)}" if match else None


def check_opt_level(cfg: DictConfig) -> None:
    """A level is a preset of every property: `precision.opt_level=O2` on top of the o0 preset
    would keep o0's other properties under the name O2. The merged `opt_level` must be the
    preset's own (the one its name declares), however it was changed (command line, experiment
    file, code); else refuse it, naming the preset to choose."""
    node = cfg.precision
    preset = node.preset if not OmegaConf.is_missing(node, "preset") else None
    declared = preset_level(preset)
    if preset is None:
        _check_own_preset(node)
    if declared is None:
        return  # a preset outside the o<N>[_...] convention: nothing to compare with
    if OmegaConf.is_missing(node, "opt_level") or node.opt_level is None:
        level, instead = None, "choose the level with precision=<preset>"
    else:
        level = parse_opt_level(node.opt_level)  # "02" is refused here, with the letter-O hint
        if level == declared:
            return
        dtype = torch.bfloat16 if preset.endswith("_bf16") else None
        instead = f"use {level_preset(level, dtype)} instead"
    raise ConfigError(
        "precision.opt_level",
        f"{level or 'no level'} overrides the level of the precision={preset} preset "
        f"({declared}); a level is a preset of all its properties, so choose it as one: "
        f"{instead}",
        [f"precision={o}" for o in preset_options()],
    )


def _check_own_preset(node: DictConfig) -> None:
    """A precision file of one's own that names a level without taking its properties (no
    `defaults: [o2, _self_]`: every built-in preset sets `preset`, so it is missing) keeps the
    schema's defaults where it says nothing: `opt_level: O2` and a loss scale made an O2 that
    casts nothing and keeps no masters, logged as O2. Refuse a level whose properties the file
    left at the schema's default where the level's differ, naming them and the defaults list."""
    from runner.config.levels import LEVEL_VALUES
    from runner.config.precision import property_for

    if OmegaConf.is_missing(node, "opt_level") or node.opt_level is None:
        return
    level = parse_opt_level(node.opt_level)
    left = [
        f"{name}={override_text(node.get(name))} (the level's: {override_text(value)})"
        for name, value in LEVEL_VALUES[level].items()
        if node.get(name) == property_for(name).default and value != property_for(name).default
    ]
    if left:
        raise ConfigError(
            "precision.opt_level",
            f"{level} is named but its properties are not taken: {', '.join(left)} are the "
            "schema's defaults, so the run would not be the level it is logged as",
            f"a precision file of your own starting 'defaults: [{level.lower()}, _self_]' (the "
            f"preset, or /schema/precision/level/{level}@_here_), then what differs",
        )


def resolve_precision(
    cfg: DictConfig, device: torch.device | DeviceInfo, entries: tuple[LayerRule, ...] = ()
) -> tuple[Resolution, tuple[LayerRule, ...]]:
    """The resolved Apex properties and findings (about the device and the optimizer too), and
    the run's layer rules (`layer_rules`: the plan file read here, once; with layer_plan=auto,
    the pre-flight's `entries`); an error finding (every warning with precision.strict=true)
    stops the run before anything is built."""
    values = OmegaConf.to_container(cfg.precision, resolve=True)
    opt_level = values.pop("opt_level")
    device_info = device if isinstance(device, DeviceInfo) else DeviceInfo.from_torch(device)
    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True) if "optimizer" in cfg else None
    compiled = bool(OmegaConf.select(cfg, "trainer.compile", default=False))
    resolution = resolve(
        opt_level, values, device=device_info, optimizer=optimizer, compiled=compiled
    )
    findings = kernel_findings(cfg, resolution.properties)
    rules = (*entries, *layer_rules(resolution.properties))
    findings += layers.rule_findings(
        resolution.properties,
        rules,
        Context(device=device_info, optimizer=optimizer, compiled=compiled),
    )
    if bool(OmegaConf.select(cfg, "precision.strict", default=False)):
        findings = [strict_finding(f) for f in findings]
    resolution = Resolution(resolution.properties, [*resolution.findings, *findings])
    for finding in resolution.errors:
        raise ConfigError(finding.key, finding.describe())
    return resolution, rules


def default_run_name(
    cfg: DictConfig, properties: Optional[Properties] = None, apart: str = ""
) -> str:
    """`mlflow.run_name`, or `<model>-<level>` (e.g. densenet161-O2; a zoo model's arch,
    vit_b_16-O2; a `_target_` model's class, MyNet-O2) with what sets the run apart
    from the other runs of a sweep: each property's suffix (runner.config.precision: `-bf16`
    where it computes in bfloat16, `-fp8` with fp8 Linear layers instead, `-sr` with stochastic
    rounding), then `-compiled` through torch.compile, then a sweep job's `apart` (its swept
    values, `lr=0.1 seed=2`, or its trial: runner.sweep.expansion.job_label) after a space.
    `properties`: the resolved ones, when the caller has them (else resolved here)."""
    if cfg.mlflow.run_name:
        return cfg.mlflow.run_name
    name = _level_name(cfg, properties)
    return f"{name} {apart}" if apart else name


def _level_name(cfg: DictConfig, properties: Optional[Properties]) -> str:
    """`<model>-<level>` and the suffixes of `default_run_name`."""
    name = f"{options.label(cfg.model)}-{cfg.precision.opt_level}"
    if properties is None:
        values = OmegaConf.to_container(cfg.precision, resolve=True)
        try:
            properties = resolve(values.pop("opt_level"), values).properties
        except ConfigError:  # a failed job is still named; its error says what was wrong
            return name
    name += "".join(f"-{suffix}" for suffix in run_name_suffixes(properties.as_params()))
    if OmegaConf.select(cfg, "trainer.compile", default=False):
        name += "-compiled"
    return name


def kernel_findings(cfg: DictConfig, properties: Properties) -> list[Finding]:
    """What `precision.kernels` does with the other properties: with low-bit optimizer state the
    fused kernels unscale, check and copy the gradients, but the update is torchao's own."""
    kernels = OmegaConf.select(cfg, "precision.kernels", default="auto")
    if kernels == "fused" and properties.low_bit_state:
        return [
            Finding(
                "info",
                "kernels",
                f"precision.kernels=fused with {properties.state_format} optimizer state: the "
                "kernels unscale, check and copy the gradients (and the masters back), but the "
                f"update is torchao's low-bit optimizer's own compiled step, not a fused kernel",
                "",
            )
        ]
    return []


# ---- precision per layer ---------------------------------------------------------------------
def layer_rules(properties: Properties) -> tuple[LayerRule, ...]:
    """The entries of the run's layer plan the config gives: a plan file's
    (`precision.layer_plan`: a path, read and checked here; ConfigError naming the key for a
    missing or malformed file), then `precision.layers`' (a later entry wins). With
    `layer_plan=auto` the pre-flight's entries (runner.run.autoplan) come before these."""
    path = properties.layer_plan
    from_file = layers.load_plan_file(path) if path not in (None, layers.AUTO) else []
    return (*from_file, *layers.config_rules(properties))
