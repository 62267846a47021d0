"""What a run records: the MLflow run's params and tags (`run_record`, a pure function of the plan,
the parts and how the run was launched), its datasets, and the artifacts it starts with
(`record_start`: the config, the overrides, the precision table and findings, the fp8 layers, the
layer plan, trainer.tune's decision); where its tracker keeps files (`run_folder`), and what an
out-of-memory message says of its sizes (`sizes`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch.nn.modules.batchnorm import _BatchNorm

import runner
from runner import metrics as m
from runner import shell
from runner.config import options
from runner.errors import ConfigError
from runner.measure import audit as layer_audit
from runner.precision import Resolution
from runner.precision.checks import DeviceInfo
from runner.run.parts import Parts
from runner.run.plan import RunPlan
from runner.tracking import job_log
from runner.tracking import tags as tag
from runner.tracking.varying import GLOBAL_BATCH


@dataclass(frozen=True)
class Launch:
    """How this run was started: the command-line overrides, what sets a sweep job apart from
    the sweep's other jobs (`apart`: its swept values, added to its default name), Hydra's output
    folder, extra tags (a sweep job's parent run), the log file Hydra writes there (`run_log`,
    attached to the run; `<hydra.job.name>.log`, runner.log by default; None: a run started from
    Python) and where this launch's lines in it start (`log_from`, in bytes: a folder the user
    names, run in again, appends to the log of the runs before)."""

    overrides: tuple[str, ...] = ()
    apart: str = ""
    output_dir: Optional[Path] = None
    extra_tags: Mapping[str, str] = field(default_factory=dict)
    run_log: Optional[Path] = None
    log_from: int = 0


def environment_tags(device: torch.device) -> dict[str, str]:
    """Versions, the device and the code's commit: what the run ran on."""
    from runner.tracking.record import git_commit

    tags = {
        tag.RUNNER_VERSION: runner.__version__,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda),
        "device": device.type,
        tag.DEVICE_NAME: DeviceInfo.from_torch(device).name,
        "num_threads": str(torch.get_num_threads()),
    }
    commit = git_commit(Path(runner.__file__).parent) or git_commit(os.getcwd())
    if commit:
        tags[tag.GIT_COMMIT] = commit
    return tags


def config_params(plan: RunPlan) -> dict[str, str]:
    """The params every run of `plan` logs first: the resolved config flattened, and every
    resolved precision property (`precision.<name>`). Where the run is recorded (`tracking`) is
    said by the record itself, not by a param."""
    from runner.tracking.record import flatten

    params = {
        k: v
        for k, v in flatten(plan.config_tree).items()
        if not k.startswith(("precision.layers.", "tracking."))
    }  # (globs are no param names: one param)
    params["task.name"] = plan.task  # task=auto resolved: classification or language_model
    params.update({f"precision.{k}": v for k, v in plan.properties.as_params().items()})
    return params


def dataset_record(plan: RunPlan, parts: Parts) -> list[dict[str, str]]:
    """What `Run.log_datasets` logs: the training and validation splits, named by the
    data option (`cfg.data.name`, or its `_target_`), with a digest of the resolved data config
    and the split's size (the same data settings give the same digest in every run), and the
    config itself as the source."""
    data = OmegaConf.to_container(plan.cfg.data, resolve=True)
    name = str(data.get("name") or data.get("_target_") or "data")
    source = json.dumps(data, sort_keys=True, default=str)
    out = []
    for split, dataset, context in (
        ("train", parts.bundle.train, "training"),
        ("val", parts.bundle.val, "evaluation"),
    ):
        size = len(dataset)
        digest = hashlib.sha256(f"{source}|{split}|{size}".encode()).hexdigest()[:16]
        out.append(
            {
                "name": f"{name}/{split}",
                "digest": digest,
                "source_type": "runner_config",
                "source": source,
                "context": context,
                "profile": json.dumps({"num_rows": size, "num_classes": parts.bundle.num_classes}),
            }
        )
    return out


def run_record(
    plan: RunPlan,
    parts: Parts,
    resolution: Resolution,
    *,
    world_size: int,
    launch: Launch,
    environment: Mapping[str, str],
    kernels: str,
    command: str,
    log_head: Optional[str] = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """(params, tags) of the MLflow run: the resolved config flattened, every resolved precision
    property, what was built; the environment, the findings (`resolution`: the plan's and the
    build's), how it was launched (`log_head`: runner.tracking.job_log.head of its log), the
    user's own tags, and what a resume changes. Pure: the same inputs give the same record."""
    cfg = plan.cfg
    params = config_params(plan)
    params["task.name"] = parts.task.name  # a user's dataset can tell it only once loaded
    params["precision.kernels"] = kernels  # the backend in use: cuda | cpp | torch
    if parts.engine.fp8 is not None:  # how many Linear layers run in fp8 (listed in fp8_layers.txt)
        params["precision.fp8_layers"] = str(len(parts.engine.fp8.converted))
    params["data.num_classes"] = str(parts.bundle.num_classes)
    params["data.train_size"] = str(len(parts.bundle.train))
    params["data.val_size"] = str(len(parts.bundle.val))
    params["model.num_parameters"] = str(sum(p.numel() for p in parts.model.parameters()))
    params[m.BATCHNORM_LAYERS] = str(sum(isinstance(x, _BatchNorm) for x in parts.model.modules()))
    if parts.flops_per_sample is not None:  # counted in planning (runner.measure.flops)
        params[m.FLOPS_PER_SAMPLE] = str(round(parts.flops_per_sample))
    params["distributed.world_size"] = str(world_size)
    params[GLOBAL_BATCH] = str(
        cfg.trainer.batch_size * world_size * cfg.trainer.accumulate_grad_batches
    )
    tags = dict(environment)
    tags.update(
        {
            tag.OPT_LEVEL: plan.properties.opt_level,
            tag.MODEL: options.label(cfg.model),
            tag.MODEL_CLASS: f"{type(parts.model).__module__}.{type(parts.model).__qualname__}",
            tag.OVERRIDES: shell.join(launch.overrides),
            tag.PEAK_MEM_KIND: parts.memory.kind,
            tag.FINDINGS: resolution.summary(),
            tag.FINDINGS_LIST: resolution.compact() or "none",
            tag.COMMAND: command,  # as typed (runner.tracking.record.typed_command)
        }
    )
    if parts.engine.layer_plan is not None:  # runs planned alike share it (runner.precision.layers)
        tags[tag.LAYER_PLAN_HASH] = parts.engine.layer_plan.digest()
    tags.update(tag.user_tags(cfg.mlflow.tags))
    tags.update(launch.extra_tags)
    # where this session's log is, for a reaper to attach should the process die (`log_head`,
    # the digest of its first line: the file a reaper finds is still this session's)
    tags.update(job_log.tags(launch.run_log, launch.log_from, log_head))
    if plan.resume is not None:
        tags.update(plan.resume.tags(cfg.trainer.max_epochs))
    return params, tags


def sizes(plan: RunPlan, trainer: Any = None) -> str:
    """What an out-of-memory message says of the run's sizes: the model, the level, the batch
    and (`trainer`: the run's) how far it got."""
    cfg = plan.cfg
    text = (
        f"{options.label(cfg.model)} at {plan.properties.opt_level}, "
        f"trainer.batch_size={cfg.trainer.batch_size}"
    )
    if cfg.trainer.accumulate_grad_batches > 1:  # (the batch in memory is still one of them)
        text += f" (x trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches})"
    if "block_size" in cfg.data:
        text += f", data.block_size={cfg.data.block_size}"
    if trainer is not None:
        done = trainer.global_step
        text += (
            f", after {done} training step{'' if done == 1 else 's'}" if done else ", at the start"
        )
    return text


def log_layer_plan(tracked, plan: RunPlan, parts: Parts) -> None:
    """The layer plan as artifacts under `layers/`: the table of every layer (planned format and
    why) and, where entries decide layers, the plan file that reproduces them."""
    layer_plan = parts.engine.layer_plan
    if layer_plan is None:
        return
    tracked.log_text(layer_plan.table() + "\n", f"layers/{layer_audit.PLAN_TXT}")
    if plan.layer_rules:
        header = [
            f"amp-runner layer plan of {plan.run_name} (precision={plan.cfg.precision.preset}"
            f", {plan.properties.opt_level}), digest {layer_plan.digest()}"
        ]
        tracked.log_text(layer_plan.yaml(header), f"layers/{layer_audit.PLAN_YAML}")
    if plan.auto_plan:  # the pre-flight's choice for every layer, and why
        tracked.log_text(plan.auto_plan, f"layers/{layer_audit.AUTO_PLAN_YAML}")


def run_folder(plan: RunPlan, launch: Launch) -> Path:
    """The run's own folder, where its tracker keeps files (an MLflow run's offline store of what
    the store could not take, runner.tracking.replay; the record of a run under tracking=none):
    Hydra's output folder, else the run's checkpoint folder."""
    return launch.output_dir if launch.output_dir is not None else plan.checkpoint_folder


def own_folder(tracker, plan: RunPlan, launch: Launch):
    """`tracker`, once the run's folder is checked to be free for this run's record (a ConfigError
    naming the setting of that folder where it holds another run's: Tracker.folder_taken)."""
    folder = run_folder(plan, launch)
    taken = tracker.folder_taken(folder, plan.resume.run_id if plan.resume is not None else None)
    if taken is None:
        return tracker
    if launch.output_dir is None:  # (a run started from Python: its checkpoint folder)
        key = "trainer.checkpoint_dir"
    else:
        key = "hydra.sweep.dir" if tag.PARENT_RUN in launch.extra_tags else "hydra.run.dir"
    raise ConfigError(
        key,
        taken,
        "a folder of its own for this run (Hydra's default, named by the time); to continue "
        "that run, its own command with resume=auto",
    )


def record_start(
    tracked: Any,
    plan: RunPlan,
    parts: Parts,
    resolution: Resolution,
    launch: Launch,
    tuning: Any = None,
) -> None:
    """What a new run records once its tracked run exists (rank 0): its datasets, the resolved
    config, the overrides, the precision table with every finding, the fp8 layers, the layer
    plan and trainer.tune's decision (`tuning`: tune.md and tune_time_s)."""
    tracked.log_datasets(dataset_record(plan, parts))
    tracked.log_text(OmegaConf.to_yaml(plan.cfg, resolve=True), "config.yaml")
    tracked.log_text(OmegaConf.to_yaml(OmegaConf.create(list(launch.overrides))), "overrides.yaml")
    tracked.log_text(
        plan.properties.table() + "\n\n" + resolution.findings_table(), "precision.txt"
    )
    if parts.engine.fp8 is not None:
        tracked.log_text(parts.engine.fp8.listing(), "fp8_layers.txt")
    log_layer_plan(tracked, plan, parts)
    if tuning is not None:
        tuning.log_to(tracked)
