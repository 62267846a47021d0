"""One run, start to finish: plan, build, record, train, clean up.

A run is three steps. `runner.run.plan.make_plan(cfg)` checks everything that can be wrong with the
input and decides the run (device, precision properties and findings, name, checkpoint folder,
resume) before anything exists, so a bad config never leaves a RUNNING run behind.
`build(plan)` builds the data, model, optimizer, precision engine and scheduler, returning them
with its own findings (the model's Tensor Core shapes). `run_record(...)`, a pure function, gives
the MLflow params and tags of the run. Once the MLflow run exists it always ends FINISHED, FAILED
or KILLED, with its config, precision table and log attached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch.nn.modules.batchnorm import _BatchNorm

import runner
from runner import csrc, shell
from runner.config import mistakes, options
from runner.errors import ConfigError
from runner.measure import audit as layer_audit
from runner.precision import Resolution, layers
from runner.precision.checks import DeviceInfo, state_findings
from runner.run import checkpoint, distributed, failure, out_of_memory, time_left, tune
from runner.run.build import Parts, build, shape_findings, sharded  # noqa: F401  (Parts: the run's parts)
from runner.run.distributed import Comm
from runner.run.interrupts import StopRequest
from runner.run.plan import RunPlan, make_plan
from runner.tracking import job_log
from runner.tracking import metrics as m
from runner.tracking import tags as tag
from runner.tracking.varying import GLOBAL_BATCH

log = logging.getLogger(__name__)


# ---- what the MLflow run records -----------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """How this run was started: the command-line overrides, Hydra's output folder, extra tags
    (a sweep job's parent run), the log file Hydra writes there (`run_log`, attached to the run;
    `<hydra.job.name>.log`, runner.log by default; None: a run started from Python) and where
    this launch's lines in it start (`log_from`, in bytes: a folder the user names, run in
    again, appends to the log of the runs before), and a digest of its first line (`log_head`:
    runner.tracking.job_log)."""

    overrides: tuple[str, ...] = ()
    output_dir: Optional[Path] = None
    extra_tags: Mapping[str, str] = field(default_factory=dict)
    run_log: Optional[Path] = None
    log_from: int = 0
    log_head: Optional[str] = None


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
) -> tuple[dict[str, str], dict[str, str]]:
    """(params, tags) of the MLflow run: the resolved config flattened, every resolved precision
    property, what was built; the environment, the findings (`resolution`: the plan's and the
    build's), how it was launched, the user's own tags, and what a resume changes. Pure: the
    same inputs give the same record."""
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
    # where this session's log is, for a reaper to attach should the process die
    tags.update(job_log.tags(launch.run_log, launch.log_from, launch.log_head))
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


# ---- a run ---------------------------------------------------------------------------------------
def print_dry_run(plan: RunPlan) -> None:
    """What `dry_run=true` shows: the config, the properties, every finding (the model's Tensor
    Core shapes and, with low-bit optimizer state, the parameters that keep plain state, from a
    model built on the meta device), the layer plan and the resume decision."""
    device = DeviceInfo.from_torch(plan.device)
    findings = shape_findings(plan.cfg, plan.properties, device, plan.meta_model)
    if plan.properties.low_bit_state:
        model = plan.meta_model()
        if model is not None:
            findings += state_findings(model, plan.properties)
    print(OmegaConf.to_yaml(plan.cfg, resolve=True))
    print(
        f"Task: {plan.task}"
        + (
            " (task=auto: the dataset's)"
            if OmegaConf.select(plan.cfg, "task.name") == "auto"
            else ""
        )
    )
    print(plan.properties.table())
    print(Resolution(plan.properties, [*plan.resolution.findings, *findings]).findings_table())
    if plan.properties.layer_plan == layers.AUTO:
        print(
            f"Layer plan: auto, measured before training by a pre-flight of "
            f"{plan.cfg.precision.layer_plan_steps} fp32 steps (runner.run.autoplan)"
            + ("; then precision.layers on top" if plan.properties.layers else "")
        )
    elif plan.layer_rules:
        print(
            "Layer plan:\n"
            + (
                plan.layer_check.table()
                if plan.layer_check is not None
                else "(checked against the model once its data is loaded)"
            )
        )
    if plan.resume is not None and plan.resume.finished(plan.cfg.trainer.max_epochs):
        print(f"Would do nothing: {plan.run_name} {plan.resume.finished_message()}")
    elif plan.resume is not None:
        print(f"Would resume from {plan.resume.path} ({plan.resume.position()})")


def run(
    cfg,
    *,
    overrides: Sequence[str] = (),
    output_dir: str | os.PathLike | None = None,
    extra_tags: Mapping[str, str] | None = None,
    apart: str = "",
) -> float | None:
    """Train once as `cfg` says; returns the task's objective (runner.tasks): a classifier's
    best validation accuracy, a language model's best validation loss (None for a dry run).
    `extra_tags` are added to the run's own (a sweep job passes its parent run's id this way),
    `apart` to its default name (a sweep job's swept values: runner.run.plan.default_run_name).
    Under torchrun this is one rank of a DistributedDataParallel run (see
    runner.run.distributed)."""
    distributed.set_other_ranks_apart()  # (torchrun: rank 0 tells the run, the others errors)
    mistakes.check_one_option(overrides)
    job_log.bear_write_errors()  # (a full disk: one line, not a traceback a line logged)
    run_log = job_log.find(output_dir)
    log_from = job_log.size(run_log)
    plan = make_plan(cfg, apart)
    if cfg.dry_run:
        print_dry_run(plan)
        return None
    if plan.resume is not None and plan.resume.finished(cfg.trainer.max_epochs):
        # resume=auto of a run that met its epoch budget: its MLflow run stays as it ended
        log.info("%s %s", plan.run_name, plan.resume.finished_message())
        return plan.resume.best()
    properties = plan.properties
    log.info("Precision (Apex %s, resolved):\n%s", properties.opt_level, properties.table())
    if plan.resolution.findings:  # (a warning where one of them is; notes alone are info)
        said = log.warning if plan.resolution.warnings or plan.resolution.errors else log.info
        said("Precision findings:\n%s", plan.resolution.findings_table())
    else:
        log.info("%s", plan.resolution.findings_table())

    launch = Launch(
        tuple(overrides),
        Path(output_dir) if output_dir is not None else None,
        dict(extra_tags or {}),
        run_log,
        log_from,
        job_log.head(run_log, log_from),  # (the precision table's first line, logged above)
    )
    comm, device = distributed.setup(plan.device)
    try:
        with distributed.peers_told(comm):  # (a rank gone: one line, not gloo's traceback)
            return train(plan, comm, device, launch)
    finally:
        comm.close()


def train(plan: RunPlan, comm: Comm, device: torch.device, launch: Launch) -> float:
    """`run`'s second half on this rank's `device`: build, record and track (rank 0), train."""
    from runner.tracking.trackers import open_tracker

    cfg = plan.cfg
    # only rank 0 talks to the store; its failure (an unreachable server) stops every rank
    tracker = comm.on_main(
        lambda: own_folder(open_tracker(cfg, run_folder(plan, launch)), plan, launch)
    )
    if comm.is_main:  # the experiment's RUNNING runs whose process is gone end KILLED
        tracker.reap(own_log=(launch.run_log, launch.log_from) if launch.run_log else None)

    def prepared() -> tuple[RunPlan, Optional[tune.Tuning], Parts]:
        ready = plan
        if ready.properties.layer_plan == layers.AUTO:  # the pre-flight plans each layer's format
            from runner.run import autoplan

            ready = autoplan.planned(ready, comm, device, launch.output_dir)
        # trainer.tune: the settings left at their defaults, measured on copies (runner.run.tune)
        ready, tuning = tune.tuned(ready, comm, device, launch.overrides)
        # a single run does not wait for a first build of the kernels (torch's ops this once); a
        # sweep's jobs and a distributed run's ranks wait, so that they all step the same way
        wait = comm.active or tag.PARENT_RUN in launch.extra_tags
        return ready, tuning, build(ready, device, comm, wait_for_kernels=wait)

    # a model too large for the device is said in one line, before its MLflow run exists
    plan, tuning, parts = out_of_memory.guarded(
        prepared, device, plan.properties.opt_level, lambda: sizes(plan)
    )
    try:
        return train_parts(plan, comm, device, launch, tracker, parts, tuning)
    finally:
        # the loaders' worker processes end with the run, whatever may still hold the loaders
        # (a reference cycle, an exception's traceback): see components.loaders.shutdown_workers
        parts.close()


def train_parts(
    plan: RunPlan,
    comm: Comm,
    device: torch.device,
    launch: Launch,
    tracker,
    parts: Parts,
    tuning: Optional[tune.Tuning] = None,
) -> float:
    """`train` once the parts are built: record, track (rank 0) and fit. `tuning`: what
    trainer.tune decided (logged with the run's params, tune.md and tune_time_s)."""
    from runner.run.trainer import RunContext, Trainer, trainer_config
    from runner.tracking.base import null_run
    from runner.tracking.record import typed_command

    cfg = plan.cfg
    if plan.resume is not None:  # the checkpoint must fit what was built, before its run reopens
        plan.resume.check_fits(parts, comm.world_size)
    resolution = Resolution(plan.properties, [*plan.resolution.findings, *parts.findings])
    if parts.findings:  # info only: never stops the run
        log.info(
            "Precision findings about the model:\n%s",
            Resolution(plan.properties, parts.findings).findings_table(),
        )
    model = parts.model
    if comm.active and not sharded(plan, comm):  # (a sharded model is FSDP2's already)
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    kernels = csrc.name_of(parts.engine.kernels)
    log.info("Kernels: %s (precision.kernels=%s)", kernels, cfg.precision.kernels)
    params, tags = run_record(
        plan,
        parts,
        resolution,
        world_size=comm.world_size,
        launch=launch,
        environment=environment_tags(device),
        kernels=kernels,
        command=typed_command(),
    )
    if tuning is not None and plan.resume is None:
        params.update(tuning.params())

    with StopRequest() as stop, contextlib.ExitStack() as owned:
        resume = plan.resume
        if resume is not None and comm.is_main:  # (one process a resumed run: its lock)
            writes = checkpoint.path_for(plan.checkpoint_folder, resume.run_id).parent
            owned.enter_context(checkpoint.own(writes, resume.run_id))
        tracked_run = (
            tracker.start_run(
                plan.run_name,
                params,
                tags,
                resume_run_id=resume.run_id if resume else None,
                folder=run_folder(plan, launch),
            )
            if comm.is_main
            else null_run()
        )
        written: dict[str, Any] = {}  # the last checkpoint of this run: where, after what
        if resume is not None:
            written.update(where=resume.path, epoch=resume.state["epoch"])
            written.update(batch=resume.state.get("batch", 0))

        def kept() -> str:  # (a rank gone: what this one keeps)
            if not written:
                return "No checkpoint was written yet." if comm.is_main else ""
            batches = written["batch"]
            after = f"epoch {written['epoch']}" + (f" and {batches} batches" if batches else "")
            command = "torchrun command" if distributed.under_torchrun() else "command"
            return (
                f"The checkpoint after {after} is kept ({written['where']}): the same {command} "
                "with resume=auto continues from it."
            )

        with (
            tracked_run as tracked,
            failure.kept_in(tracked, launch.run_log, launch.log_from),
            distributed.peers_told(comm, kept),
        ):
            if comm.is_main:
                log.info(
                    "%s run %r (%s) in %s",
                    tracker.label,
                    plan.run_name,
                    tracked.run_id,
                    tracker.location,
                )
                if cfg.mlflow.system_metrics_s > 0:
                    tracked.sample_system(cfg.mlflow.system_metrics_s, resumed=resume is not None)
                if resume is None:
                    tracked.log_datasets(dataset_record(plan, parts))
                    tracked.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
                    tracked.log_text(
                        OmegaConf.to_yaml(OmegaConf.create(list(launch.overrides))),
                        "overrides.yaml",
                    )
                    tracked.log_text(
                        plan.properties.table() + "\n\n" + resolution.findings_table(),
                        "precision.txt",
                    )
                    if parts.engine.fp8 is not None:
                        tracked.log_text(parts.engine.fp8.listing(), "fp8_layers.txt")
                    log_layer_plan(tracked, plan, parts)
                    if tuning is not None:
                        tuning.log_to(tracked)
            # a sharded run's ranks all write (their shards) into rank 0's run's folder
            shards = sharded(plan, comm) and cfg.trainer.fsdp_checkpoint == "sharded"
            run_id = comm.from_main(tracked.run_id) if shards else tracked.run_id
            path = (
                checkpoint.path_for(plan.checkpoint_folder, run_id)
                if comm.is_main or shards
                else None
            )
            static = {
                "mlflow_run_id": tracked.run_id,
                "config": dict(plan.config_tree),
                "world_size": comm.world_size,
            }

            def save(trainer_state: dict) -> str:
                # the metrics the checkpoint covers reach the store first: a process killed
                # after the write has lost none of them, and its resume logs none of them again
                tracked.deliver()
                try:
                    if shards:  # a collective: every rank writes its shards, rank 0 the rest
                        where = checkpoint.sharded.save(
                            path.parent,
                            {**static, **trainer_state},
                            parts.model,
                            parts.optimizer,
                            comm,
                        )
                    else:
                        checkpoint.save(path, {**static, **trainer_state})
                        where = path
                except Exception as error:  # (a full disk: one line, not a traceback)
                    refused = checkpoint.unwritable(path, error)
                    if refused is None:
                        raise
                    raise refused from error
                written.update(
                    where=where, epoch=trainer_state["epoch"], batch=trainer_state["batch"]
                )
                return str(where)

            files = launch.output_dir
            if files is None:  # (started without Hydra's output folder: the diagnostics' and
                # the layer audit's files in a temporary one, removed once the run has ended and
                # its store, or the offline store, took them)
                files = Path(owned.enter_context(tempfile.TemporaryDirectory(prefix="amp-run-")))
            trainer = Trainer(
                trainer_config(cfg.trainer),
                parts,
                device=device,
                model=model,
                context=RunContext(
                    on_metrics=tracked.log_metrics,
                    comm=comm,
                    checkpointer=save if comm.is_main or shards else None,
                    stop=stop,
                    on_artifact=tracked.log_file if comm.is_main else None,
                    artifact_dir=files / "diagnostics",
                    layers_dir=files / "layers",
                ),
            )
            if resume is not None:
                resume.restore(trainer, cfg, plan.run_name)
            # running out of memory: one line, the run FAILED with it (runner.run.out_of_memory)
            result = out_of_memory.guarded(
                trainer.fit, device, plan.properties.opt_level, lambda: sizes(plan, trainer)
            )
    if comm.is_main:
        unit = "tokens" if parts.task.items_metric else "samples"
        log.info(
            "Finished %s: %s %.4f in %s%s.\n%s",
            plan.run_name,
            result.objective.replace("_", " ", 1),
            result.best,
            time_left.took(result.train_time_s),
            f", {result.throughput:.0f} {unit}/s steady"
            if math.isfinite(result.throughput)
            else " (no steady step: see the warm-up above)",
            tracker.hint(),
        )
    return result.best
