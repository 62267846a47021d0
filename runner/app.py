"""One run, start to finish: validate, resolve precision, build, train, log, clean up.

Everything that can be wrong with the input is checked before the MLflow run exists, so a bad
config never leaves a RUNNING run behind; once the run exists it always ends FINISHED, FAILED or
KILLED, with its config, precision table and log attached.
"""
from __future__ import annotations

import logging
import os
import platform
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

import runner
from runner import checkpoint, csrc, distributed
from runner.distributed import Comm
from runner.errors import ConfigError
from runner.interrupts import StopRequest
from runner.paths import config_dir
from runner.precision import AmpEngine, Resolution, resolve
from runner.precision.checks import DeviceInfo, tensor_core_findings
from runner.precision.properties import level_preset, parse_opt_level
from runner.validation import validate

log = logging.getLogger(__name__)


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device", "cuda was requested but no CUDA device is available", "auto, cpu"
        )
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def preset_options() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "precision").glob("*.yaml"))


def check_opt_level(cfg: DictConfig) -> None:
    """A level is a preset of every property: `precision.opt_level=O2` on top of the o0 preset
    would keep o0's other properties under the name O2. The merged `opt_level` must be the
    preset's own, however it was changed (command line, experiment file, code); else refuse it,
    naming the preset to choose."""
    node = cfg.precision
    preset = node.preset if not OmegaConf.is_missing(node, "preset") else None
    preset_file = config_dir() / "precision" / f"{preset}.yaml"
    if preset is None or not preset_file.is_file():
        return  # a preset from another config search path: nothing to compare with
    preset_level = str(OmegaConf.load(preset_file).opt_level)
    if OmegaConf.is_missing(node, "opt_level") or node.opt_level is None:
        level, instead = None, "choose the level with precision=<preset>"
    else:
        level = parse_opt_level(node.opt_level)  # "02" is refused here, with the letter-O hint
        if level == preset_level:
            return
        dtype = torch.bfloat16 if preset.endswith("_bf16") else None
        instead = f"use {level_preset(level, dtype)} instead"
    raise ConfigError(
        "precision.opt_level",
        f"{level or 'no level'} overrides the level of the precision={preset} preset "
        f"({preset_level}); a level is a preset of all its properties, so choose it as one: "
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
    resolution = resolve(opt_level, values, device=device_info, optimizer=optimizer)
    for finding in resolution.errors:
        hint = f" Hint: {finding.hint}" if finding.hint else ""
        raise ConfigError(finding.key, finding.message + hint)
    return resolution


def environment_tags(device: torch.device) -> dict[str, str]:
    from runner.tracking import git_commit

    tags = {
        "runner_version": runner.__version__,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda),
        "device": device.type,
        "device_name": DeviceInfo.from_torch(device).name,
        "num_threads": str(torch.get_num_threads()),
    }
    commit = git_commit(Path(runner.__file__).parent) or git_commit(os.getcwd())
    if commit:
        tags["git_commit"] = commit
    return tags


def check_config(cfg: DictConfig) -> tuple[torch.device, Resolution]:
    """Everything that can be wrong with the input, checked without building anything: raises
    ConfigError naming the key. A sweep runs it on every job's config before the first job."""
    check_opt_level(cfg)
    validate(cfg)
    device = select_device(cfg.trainer.device)
    if cfg.trainer.sync_batchnorm and device.type != "cuda":
        raise ConfigError("trainer.sync_batchnorm", "SyncBatchNorm needs CUDA GPUs (NCCL); it has "
                          f"no implementation on {device.type} (Gloo)", "false on a CPU")
    return device, resolve_precision(cfg, device)


def default_run_name(cfg: DictConfig, properties=None) -> str:
    """`mlflow.run_name`, or `<model>-<level>` (e.g. densenet161-O2), with `-bf16` where the run
    computes in bfloat16, so that o2 and o2_bf16 runs of one sweep are told apart. `properties`:
    the resolved ones, when the caller has them (else resolved here)."""
    if cfg.mlflow.run_name:
        return cfg.mlflow.run_name
    name = f"{cfg.model.name}-{cfg.precision.opt_level}"
    if properties is None:
        values = OmegaConf.to_container(cfg.precision, resolve=True)
        try:
            properties = resolve(values.pop("opt_level"), values).properties
        except ConfigError:  # a failed job is still named; its error says what was wrong
            return name
    return f"{name}-bf16" if torch.bfloat16 in properties.compute_dtypes else name


def shape_findings(cfg: DictConfig, properties, device_info: DeviceInfo,
                   model: torch.nn.Module | None = None) -> list:
    """The Tensor Core findings about the model's layer sizes and the batch size (16-bit on a
    CUDA GPU only). Without `model` (a dry run) the model is built on PyTorch's meta device:
    its shapes, no memory, no data."""
    if device_info.type != "cuda" or not properties.compute_dtypes:
        return []
    if model is None:
        from runner.data import declared_num_classes
        from runner.models import build_model

        num_classes = declared_num_classes(cfg.data)
        if num_classes is None:
            return []
        with torch.device("meta"):
            model = build_model(cfg.model, num_classes, cfg.data.image_size)
    return tensor_core_findings(model, cfg.trainer.batch_size, properties, device_info)


@dataclass
class Parts:
    """What a run trains with, built from the config as `run` builds it (benchmarks reuse it)."""

    bundle: Any
    train_loader: Any
    val_loader: Any
    model: torch.nn.Module  # the model itself (prepared by the engine; not DDP-wrapped)
    optimizer: torch.optim.Optimizer
    engine: AmpEngine
    scheduler: Any
    memory: Any  # runner.probes.MemoryProbe, reset before the model was built


def build(cfg: DictConfig, device: torch.device, resolution: Resolution,
          comm: Comm | None = None,
          on_model: Callable[[torch.nn.Module], None] | None = None) -> Parts:
    """Data, model, optimizer, engine and scheduler for `cfg` (valid: see check_config).
    Seeds first, so every rank of a distributed run builds the same initial weights.
    `on_model` sees the freshly built model before the engine casts it (a benchmark keeps an
    fp32 copy of the same weights this way)."""
    from runner.data import build_datasets, build_loaders
    from runner.models import build_model
    from runner.optim import build_optimizer, build_scheduler
    from runner.probes import MemoryProbe
    from runner.trainer import limit_batches

    comm = comm or Comm()
    properties = resolution.properties
    seed_everything(cfg.trainer.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.trainer.cudnn_benchmark
    bundle = build_datasets(cfg.data)  # a missing dataset stops here, before any run exists
    train_loader, val_loader = build_loaders(
        bundle, cfg.trainer.batch_size, cfg.trainer.num_workers, device.type, cfg.trainer.seed,
        rank=comm.rank, world_size=comm.world_size)
    csrc.load(device, cfg.precision.kernels)  # built or loaded now, so not counted below
    # peak_mem_mb counts the training state (model, optimizer, activations), as on a GPU, where
    # the data and the tracking store live in host memory: on a CPU the baseline is taken after
    # the datasets, the store and the kernels are in memory
    memory = MemoryProbe(device)
    memory.reset()
    model = build_model(cfg.model, bundle.num_classes, bundle.image_size).to(device)
    if cfg.trainer.sync_batchnorm:  # before the cast: keep_batchnorm_fp32 still applies
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if on_model is not None:
        on_model(model)
    findings = shape_findings(cfg, properties, DeviceInfo.from_torch(device), model)
    if findings:  # info only: never stops the run
        resolution.findings.extend(findings)
        log.info("Precision findings about the model:\n%s",
                 Resolution(properties, findings).findings_table())
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    engine = AmpEngine(properties, device, kernels=cfg.precision.kernels,
                       flag_reducer=distributed.flag_reducer(comm))
    model, optimizer = engine.prepare(model, optimizer)  # cast and masters before any DDP wrap
    steps_per_epoch = limit_batches(len(train_loader), cfg.trainer.limit_train_batches)
    scheduler = build_scheduler(cfg.scheduler, optimizer, steps_per_epoch, cfg.trainer.max_epochs)
    return Parts(bundle, train_loader, val_loader, model, optimizer, engine, scheduler, memory)


def run(
    cfg: DictConfig,
    *,
    overrides: Sequence[str] = (),
    output_dir: str | os.PathLike | None = None,
    extra_tags: Mapping[str, str] | None = None,
) -> float | None:
    """Train once as `cfg` says; returns the best validation accuracy (None for a dry run).
    `extra_tags` are added to the run's own (a sweep job passes its parent run's id this way).
    Under torchrun this is one rank of a DistributedDataParallel run (see runner.distributed)."""
    device, resolution = check_config(cfg)
    properties = resolution.properties
    run_name = default_run_name(cfg, properties)
    folder = checkpoint.run_folder(cfg.trainer.checkpoint_dir, cfg.mlflow.experiment_name,
                                   run_name)
    config_tree = OmegaConf.to_container(cfg, resolve=True)
    resume_path = checkpoint.find(cfg.resume, folder)  # a missing path: ConfigError, here
    state = checkpoint.load(resume_path) if resume_path is not None else None
    if state is not None:
        checkpoint.check_resumable(state, config_tree, resume_path)

    if cfg.dry_run:
        resolution.findings.extend(
            shape_findings(cfg, properties, DeviceInfo.from_torch(device)))
        print(OmegaConf.to_yaml(cfg, resolve=True))
        print(properties.table())
        print(resolution.findings_table())
        if resume_path is not None:
            print(f"Would resume from {resume_path} (epoch {state['epoch']}, batch "
                  f"{state['batch']})")
        return None
    log.info("Precision (Apex %s, resolved):\n%s", properties.opt_level, properties.table())
    if resolution.findings:
        log.warning("Precision findings:\n%s", resolution.findings_table())
    else:
        log.info("%s", resolution.findings_table())

    comm, rank_device = distributed.setup(cfg.trainer.device)
    if not comm.is_main:  # one console story: rank 0's (the others still say what goes wrong)
        logging.getLogger("runner").setLevel(logging.WARNING)
    try:
        return _train(cfg, config_tree, rank_device or device, resolution, comm, run_name,
                      folder, state, resume_path, overrides, output_dir, extra_tags or {})
    finally:
        comm.close()


def _train(cfg: DictConfig, config_tree: dict, device: torch.device, resolution: Resolution,
           comm: Comm, run_name: str, folder: Path, state: dict | None,
           resume_path: Path | None, overrides: Sequence[str],
           output_dir: str | os.PathLike | None, extra_tags: Mapping[str, str]) -> float:
    """`run`'s second half: build, track (rank 0), train; `config_tree` is `cfg` resolved."""
    from runner.optim import rebuild_scheduler_at
    from runner.tracking import Tracker, flatten, null_run
    from runner.trainer import Trainer

    properties = resolution.properties
    # only rank 0 talks to the store; its failure (an unreachable server) stops every rank
    tracker = comm.on_main(lambda: Tracker(cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name))
    parts = build(cfg, device, resolution, comm)
    model = parts.model
    if comm.active:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    kernels = csrc.name_of(parts.engine.kernels)
    log.info("Kernels: %s (precision.kernels=%s)", kernels, cfg.precision.kernels)

    params = flatten(config_tree)
    params.update({f"precision.{k}": v for k, v in properties.as_params().items()})
    params["precision.kernels"] = kernels  # the backend in use: cuda | cpp | torch
    params["data.num_classes"] = str(parts.bundle.num_classes)
    params["data.train_size"] = str(len(parts.bundle.train))
    params["data.val_size"] = str(len(parts.bundle.val))
    params["model.num_parameters"] = str(sum(p.numel() for p in parts.model.parameters()))
    params["distributed.world_size"] = str(comm.world_size)
    params["trainer.global_batch_size"] = str(cfg.trainer.batch_size * comm.world_size)
    tags = environment_tags(device)
    tags.update(
        {
            "opt_level": properties.opt_level,
            "overrides": " ".join(overrides),
            "peak_mem_kind": parts.memory.kind,
            "precision.findings": resolution.summary(),
            "precision.findings_list": resolution.compact() or "none",
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
    )
    tags.update({str(k): str(v) for k, v in cfg.mlflow.tags.items()})
    tags.update(extra_tags)
    if state is not None:
        tags["resumed_from"] = str(resume_path)
        if state["config"]["trainer"]["max_epochs"] != cfg.trainer.max_epochs:  # params are
            tags["trainer.max_epochs"] = str(cfg.trainer.max_epochs)  # immutable: the new value

    with StopRequest() as stop:
        # metrics the store cannot take by the end go to a local store here (runner.replay)
        offline_dir = Path(output_dir) if output_dir is not None else folder
        tracked_run = (tracker.start_run(run_name, params, tags,
                                         resume_run_id=state["mlflow_run_id"] if state else None,
                                         offline_dir=offline_dir / "mlflow-offline")
                       if comm.is_main else null_run())
        with tracked_run as tracked:
            if comm.is_main:
                log.info("MLflow run %r (%s) in %s", run_name, tracked.run_id,
                         tracker.tracking_uri)
                if state is None:
                    tracked.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
                    tracked.log_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))),
                                     "overrides.yaml")
                    tracked.log_text(properties.table() + "\n\n" + resolution.findings_table(),
                                     "precision.txt")
            path = checkpoint.path_for(folder, tracked.run_id) if comm.is_main else None
            static = {"mlflow_run_id": tracked.run_id, "config": config_tree,
                      "world_size": comm.world_size}

            def save(trainer_state: dict) -> str:
                checkpoint.save(path, {**static, **trainer_state})
                return str(path)

            trainer = Trainer(
                model=model,
                optimizer=parts.optimizer,
                scheduler=parts.scheduler,
                engine=parts.engine,
                train_loader=parts.train_loader,
                val_loader=parts.val_loader,
                device=device,
                cfg=cfg.trainer,
                on_metrics=tracked.log_metrics,
                memory=parts.memory,
                comm=comm,
                checkpointer=save if comm.is_main else None,
                stop=stop,
            )
            if state is not None:
                old_budget = state["config"]["trainer"]["max_epochs"]
                trainer.restore(state, scheduler=old_budget == cfg.trainer.max_epochs)
                if old_budget != cfg.trainer.max_epochs:  # the schedule of the new length
                    trainer.scheduler = rebuild_scheduler_at(
                        cfg.scheduler, parts.optimizer, trainer.train_batches,
                        cfg.trainer.max_epochs, trainer.global_step, cfg.optimizer.lr)
                log.info("Resuming %s from %s: after epoch %d and %d batches of the next "
                         "(step %d)", run_name, resume_path, state["epoch"], state["batch"],
                         state["global_step"])
            try:
                result = trainer.fit()
            finally:
                if output_dir is not None:
                    tracked.log_file(Path(output_dir) / "runner.log", "logs")
    if comm.is_main:
        log.info("Finished %s: best val_acc %.4f in %.1f s.\n%s", run_name, result.best_val_acc,
                 result.train_time_s, tracker.hint())
    return result.best_val_acc
