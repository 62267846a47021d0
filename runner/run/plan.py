"""A run's plan: everything decided from the config before anything is built.

`make_plan(cfg)` checks the whole input (the preset's level, the value rules, the device, the
precision properties and their findings), names the run, finds its checkpoint folder and decides
whether it resumes (and from which checkpoint, checked against the config). It builds nothing,
logs nothing and creates no MLflow run, so a bad config stops here with a `ConfigError` naming the
key. The resulting `RunPlan` is frozen and is what a run, a dry run, a sweep's up-front check of
every job and the benchmarks all work from (`runner.run.app.build(plan)` builds the parts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from runner.config import options, targets
from runner.config.finder import config_dir
from runner.config.precision import run_name_suffixes
from runner.config.validation import validate
from runner.errors import ConfigError
from runner.precision import Finding, Properties, Resolution, layers, resolve
from runner.precision.checks import DeviceInfo, concrete_device
from runner.precision.layers import LayerRule
from runner.precision.properties import Context, level_preset, parse_opt_level, strict_finding
from runner.run import checkpoint
from runner.run.resume import Resume


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
    # precision per layer (runner.precision.layers): the plan file's entries, then
    # precision.layers' (with layer_plan=auto, the pre-flight's replace the file's at run time)
    layer_rules: tuple[LayerRule, ...] = ()
    auto_plan: str = ""  # layer_plan=auto: the pre-flight's plan file (every layer's choice)

    @property
    def properties(self) -> Properties:
        return self.resolution.properties


def make_plan(cfg: DictConfig) -> RunPlan:
    """Check everything about `cfg` and decide the run (see the module docstring); raises
    ConfigError naming the key for any bad input, before anything is built."""
    device, resolution, specs = check_config(cfg)
    run_name = default_run_name(cfg, resolution.properties)
    folder = checkpoint.run_folder(cfg.trainer.checkpoint_dir, cfg.mlflow.experiment_name, run_name)
    config_tree = OmegaConf.to_container(cfg, resolve=True)
    resume = Resume.decide(cfg.resume, folder, config_tree)
    return RunPlan(
        cfg,
        config_tree,
        device,
        resolution,
        run_name,
        folder,
        resume,
        specs,
        resolve_task(cfg, specs),
        layer_rules(resolution.properties),
    )


def check_config(
    cfg: DictConfig,
) -> tuple[torch.device, Resolution, dict[str, Optional[options.Spec]]]:
    """The checks of `make_plan` that need no file: the preset's level, the value rules, the
    device, the precision properties and the parts the config names; raises ConfigError naming
    the key. Returns the device, the resolution and each option group's spec."""
    check_opt_level(cfg)
    specs = options.specs_of(cfg)
    validate(cfg, specs)
    task = resolve_task(cfg, specs)
    device = select_device(cfg.trainer.device)
    if cfg.trainer.sync_batchnorm and device.type != "cuda":
        raise ConfigError(
            "trainer.sync_batchnorm",
            "SyncBatchNorm needs CUDA GPUs (NCCL); it has "
            f"no implementation on {device.type} (Gloo)",
            "false on a CPU",
        )
    resolution = resolve_precision(cfg, device)
    check_parts(cfg, specs, task)
    check_layers(cfg, specs, resolution.properties, task)
    check_strategy(cfg, specs, resolution.properties, task)
    return device, resolution, specs


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
                f"task={task}, but {_option(cfg, 'data')} is {_DATA_KINDS[data_task]}",
                f"task=auto or task={data_task} (or another dataset)",
            )
    if model_task is not None and model_task != task:
        raise ConfigError(
            "model.name",
            f"{_option(cfg, 'model')} is {_MODEL_KINDS[model_task]}"
            f", but the run's task is {task} ({_option(cfg, 'data')})",
            "a model of the data's task (language models: gpt, gpt_tiny, "
            "gpt2_small, hf; image classifiers: tiny, resnet18, vit_tiny, ...)",
        )
    return task


_DATA_KINDS = {
    options.CLASSIFICATION: "a classification dataset",
    options.LANGUAGE_MODEL: "a text (language-model) dataset",
}
_MODEL_KINDS = {
    options.CLASSIFICATION: "an image classifier",
    options.LANGUAGE_MODEL: "a language model",
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


def resolve_precision(cfg: DictConfig, device: torch.device | DeviceInfo) -> Resolution:
    """The resolved Apex properties and findings (about the device and the optimizer too); an error
    finding (every warning with precision.strict=true) stops the run before anything is built."""
    values = OmegaConf.to_container(cfg.precision, resolve=True)
    opt_level = values.pop("opt_level")
    device_info = device if isinstance(device, DeviceInfo) else DeviceInfo.from_torch(device)
    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True) if "optimizer" in cfg else None
    compiled = bool(OmegaConf.select(cfg, "trainer.compile", default=False))
    resolution = resolve(
        opt_level, values, device=device_info, optimizer=optimizer, compiled=compiled
    )
    check_plan_settings(cfg)
    findings = kernel_findings(cfg, resolution.properties)
    findings += layers.rule_findings(
        resolution.properties,
        layer_rules(resolution.properties),
        Context(device=device_info, optimizer=optimizer, compiled=compiled),
    )
    if bool(OmegaConf.select(cfg, "precision.strict", default=False)):
        findings = [strict_finding(f) for f in findings]
    resolution = Resolution(resolution.properties, [*resolution.findings, *findings])
    for finding in resolution.errors:
        hint = f" Hint: {finding.hint}" if finding.hint else ""
        raise ConfigError(finding.key, finding.message + hint)
    return resolution


def default_run_name(cfg: DictConfig, properties: Optional[Properties] = None) -> str:
    """`mlflow.run_name`, or `<model>-<level>` (e.g. densenet161-O2; a zoo model's arch,
    vit_b_16-O2; a `_target_` model's class, MyNet-O2) with what sets the run apart
    from the other runs of a sweep: each property's suffix (runner.config.precision: `-bf16`
    where it computes in bfloat16, `-fp8` with fp8 Linear layers instead, `-sr` with stochastic
    rounding), then `-compiled` through torch.compile.
    `properties`: the resolved ones, when the caller has them (else resolved here)."""
    if cfg.mlflow.run_name:
        return cfg.mlflow.run_name
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


# ---- the model, the data and the loss ----------------------------------------------------------
def check_parts(
    cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]], task: str = options.CLASSIFICATION
) -> None:
    """What the model, data and loss configs name, before anything is built: a zoo's model name,
    the user's `_target_`s (imported, arguments bound to their signatures), a text corpus and
    its tokenizer, and the model's output against the data's classes or vocabulary (built on the
    meta device, one forward of the task's input: float images or integer token ids), so that a
    dry run and a sweep's up-front check find them too. Raises ConfigError naming the key."""
    from runner.components.data import declared_input
    from runner.components.models import check_output
    from runner.tasks import task_for

    for group in ("model", "data"):
        if specs.get(group) is not None:
            specs[group].run_check(cfg[group])
    if "loss" in cfg:
        targets.check("loss", cfg.loss)
    declared = declared_input(cfg.data, specs.get("data"))
    if task == options.LANGUAGE_MODEL:
        check_context(cfg)
        if declared is not None:
            check_vocabulary(cfg, declared[0])
    if declared is not None:
        check_output(cfg.model, *declared, task=task_for(task))


def check_vocabulary(cfg: DictConfig, vocab_size: int) -> None:
    """Every token id of the data (0 .. vocab_size - 1) must have a row in the model's embedding:
    a declared `model.vocab_size` below the data's vocabulary is refused."""
    declared = cfg.model.get("vocab_size") if hasattr(cfg.model, "get") else None
    if declared is not None and int(declared) < int(vocab_size):
        raise ConfigError(
            "model.vocab_size",
            f"{declared}, but the data's token ids go up to "
            f"{int(vocab_size) - 1} (a vocabulary of {vocab_size})",
            f"null (the data's) or an integer >= {vocab_size}",
        )


def check_context(cfg: DictConfig) -> None:
    """A language model's context must hold the data's sequences: `data.block_size` against the
    model's `block_size` (the runner's GPT) or its position table (a Hugging Face model's
    `max_position_embeddings` / `n_positions`, where the config sets it)."""
    block = cfg.data.get("block_size") if hasattr(cfg.data, "get") else None
    if block is None:
        return
    for key in ("block_size", "max_position_embeddings", "n_positions"):
        context = cfg.model.get(key) if hasattr(cfg.model, "get") else None
        if context is not None and int(block) > int(context):
            raise ConfigError(
                "data.block_size",
                f"{block} tokens per sequence, but the model's "
                f"context holds {context} (model.{key})",
                f"at most {context}, or a model with a longer context",
            )


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
    """The entries of the run's layer plan: a plan file's (`precision.layer_plan`: a path, read
    and checked here; ConfigError naming the key for a missing or malformed file), then
    `precision.layers`' (a later entry wins). With `layer_plan=auto` only `precision.layers`' are
    known before the pre-flight (runner.run.autoplan) has measured."""
    path = properties.layer_plan
    from_file = layers.load_plan_file(path) if path not in (None, layers.AUTO) else []
    return (*from_file, *layers.config_rules(properties))


_PLAN_SETTINGS = (
    ("layer_plan_steps", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    ("layer_plan_max_underflow", lambda v: 0 <= v < 1, "a share in [0, 1)"),
    ("layer_plan_max_overflow", lambda v: 0 <= v < 1, "a share in [0, 1)"),
)


def check_plan_settings(cfg: DictConfig) -> None:
    """The auto plan's settings: its pre-flight's steps and the shares a format may lose."""
    for key, ok, allowed in _PLAN_SETTINGS:
        value = OmegaConf.select(cfg, f"precision.{key}")
        if value is None or isinstance(value, bool) or not ok(value):
            raise ConfigError(f"precision.{key}", f"got {value!r}", allowed)


def check_layers(
    cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]], properties: Properties, task: str
) -> Optional[layers.LayerPlan]:
    """The layer plan against the model's module names, before anything is built: the model is
    made on the meta device (shapes, no memory) and each entry matched (ConfigError naming the
    entry's key for a glob that matches no module, fp8 on a layer that cannot run it, ...).
    Returns the plan, or None when there is no entry or the model cannot be made without its
    data (a user's dataset: the build checks it then, still before training)."""
    rules = layer_rules(properties)
    if not rules:
        return None
    model = meta_model(cfg, specs, task)
    if model is None:
        return None
    return layers.assign(model, rules, properties)


def meta_model(
    cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]], task: str
) -> Optional[torch.nn.Module]:
    """The run's model on the meta device, where its input is declared (None otherwise, or
    where the model cannot be made there)."""
    from runner.components.data import declared_input
    from runner.components.models import build_model

    declared = declared_input(cfg.data, specs.get("data"))
    if declared is None:
        return None
    num_classes, shape = declared
    try:
        with torch.device("meta"):
            return build_model(cfg.model, num_classes, shape[-1], specs.get("model"))
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001  (check_parts has already said what fails; the build will)
        return None


# ---- the strategy under torchrun -------------------------------------------------------------
def check_strategy(
    cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]], properties: Properties, task: str
) -> None:
    """`trainer.strategy=fsdp` (runner.run.fsdp): a process group to shard over (torchrun), the
    settings a sharded run takes, and `trainer.fsdp_wrap` against the model's modules (on the
    meta device, where the data declares its shape)."""
    if OmegaConf.select(cfg, "trainer.strategy", default="ddp") != "fsdp":
        return
    from runner.run import distributed, fsdp

    if not distributed.will_join_a_group():
        raise ConfigError(
            fsdp.STRATEGY_KEY,
            "fsdp shards the model over the processes of "
            "torchrun's group, and this run is a single process without one",
            "trainer.strategy=ddp for one process, or start it with torchrun "
            "--nproc_per_node=N -m runner ... (N=1 too)",
        )
    for key, why, fix in fsdp.refusals(cfg, properties, layer_rules(properties)):
        raise ConfigError(key, f"{why} (trainer.strategy=fsdp)", fix)
    model = meta_model(cfg, specs, task)
    if model is not None:
        fsdp.units_for(model, OmegaConf.select(cfg, "trainer.fsdp_wrap"))
