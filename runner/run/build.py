"""Build a run's parts from its plan: data, model, optimizer, precision engine, scheduler, loss.

Nothing here decides or checks the config again (the plan did: `runner.run.plan`): the option
specs, the task, the layer rules, the declared input and the sharding decision come from the plan,
and no model is built on the meta device here. The one check left for building is the model's
output against a dataset whose shape only the loaded data tells (`components.models.check_output`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import default_collate

from runner import csrc
from runner.components.data import build_datasets, declared_num_classes
from runner.components.lm_models import sees_ahead
from runner.components.loaders import build_loaders
from runner.components.losses import build_loss, check_criterion
from runner.components.models import build_model, check_output
from runner.components.optim import build_optimizer, build_scheduler
from runner.config import options
from runner.config.options import LANGUAGE_MODEL
from runner.errors import ConfigError, DataError
from runner.measure.probes import MemoryProbe
from runner.precision import AmpEngine, Finding, Properties
from runner.precision.checks import DeviceInfo, state_findings, tensor_core_findings
from runner.precision.state import build_low_bit
from runner.run import cuda_graphs, distributed, fsdp
from runner.run.batches import limit_batches, optimizer_steps
from runner.run.distributed import Comm
from runner.run.model_checks import MetaModel
from runner.run.parts import Parts
from runner.run.plan import RunPlan
from runner.tasks import Task, task_for
from runner.tasks.base import class_indices, target_problem

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def build(
    plan: RunPlan,
    device: Optional[torch.device] = None,
    comm: Optional[Comm] = None,
    *,
    datasets: Any = None,
    wait_for_kernels: bool = True,
) -> Parts:
    """Data, model, optimizer, engine and scheduler as `plan` says, on `device` (default: the
    plan's; a torchrun rank passes its own GPU). Seeds first, so every rank of a distributed run
    builds the same initial weights. `datasets`: the run's, where they were loaded before (for
    trainer.tune to count the run's steps: runner.run.app). Without `wait_for_kernels`, kernels
    not built yet are built in the background while this run uses torch's ops (`csrc.load`):
    for a single run, not for the jobs of a sweep or the ranks of a distributed run, which must
    all step the same way."""
    cfg = plan.cfg
    device = device or plan.device
    comm = comm or Comm()
    shards = sharded(plan, comm)
    seed_everything(cfg.trainer.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.trainer.cudnn_benchmark
    # a missing dataset stops here, before any run exists
    bundle = datasets if datasets is not None else build_datasets(cfg.data, plan.specs.get("data"))
    train_loader, val_loader = build_loaders(
        bundle,
        cfg.trainer.batch_size,
        cfg.trainer.num_workers,
        device.type,
        cfg.trainer.seed,
        rank=comm.rank,
        world_size=comm.world_size,
        pin_memory=cfg.trainer.pin_memory,
    )
    # built or loaded now, so not counted below (a sharded run steps with torch's ops)
    kernels = csrc.load(device, "torch" if shards else cfg.precision.kernels, wait=wait_for_kernels)
    task, flops = checked_task(plan, bundle)
    # peak_mem_mb counts the training state (model, optimizer, activations), as on a GPU, where
    # the data and the tracking store live in host memory: on a CPU the baseline is taken after
    # the datasets, the store and the kernels are in memory
    memory = MemoryProbe(device)
    memory.reset()
    model = built_model(plan, bundle, task, device)
    findings = shape_findings(cfg, plan.properties, DeviceInfo.from_torch(device), model)
    findings += state_findings(model, plan.properties)
    if shards:
        model, optimizer, engine = sharded_parts(plan, model, device, comm)
    else:
        optimizer = built_optimizer(plan, model)
        engine = precision_engine(plan, device, comm, "torch" if kernels is None else None)
        # the layer plan (a glob matching no module: ConfigError, before any run exists), cast
        # and masters, before any DDP wrap
        model, optimizer = engine.prepare(model, optimizer)
    engine.layer_plan.strict = bool(cfg.precision.strict)
    if engine.fp8 is not None:
        findings += engine.fp8.findings()
    if cfg.trainer.compile:  # in place: the module and its state-dict keys stay as they are
        # a run starts with torch.compile's caches empty: the jobs of a sweep in one process
        # would otherwise fill its per-function recompile limit and run the later ones eager
        torch._dynamo.reset()
        model.compile(**compile_arguments(cuda_graphs.compile_mode(cfg), engine.fp8))
    batches = limit_batches(len(train_loader), cfg.trainer.limit_train_batches)
    scheduler = build_scheduler(
        cfg.scheduler,
        optimizer,
        optimizer_steps(batches, cfg.trainer.accumulate_grad_batches),
        cfg.trainer.max_epochs,
        plan.specs.get("scheduler"),
    )
    criterion = checked_criterion(plan, bundle, task).to(device)
    parts = (bundle, train_loader, val_loader, model, optimizer, engine, scheduler, memory)
    return Parts(*parts, findings, criterion, task, flops)


def checked_task(plan: RunPlan, bundle: Any) -> tuple[Task, Optional[float]]:
    """The run's task and the model's training FLOPs per sample (None: not countable). Where
    only the loaded dataset can tell its shape (and, with task=auto, its task), the model's
    output is checked now, on a meta model of the data's input, which then counts the FLOPs;
    else planning did, on its own meta model."""
    task = task_for(plan.task)
    if plan.declared is None:
        sample = bundle.train[0][0]
        task = task_for(infer_task(plan, sample))
        cfg = plan.cfg
        meta = MetaModel(
            cfg.model, plan.specs.get("model"), (bundle.num_classes, tuple(sample.shape))
        )
        check_output(cfg.model, *meta.declared, task=task, build=meta.build)
        flops = meta.flops_per_sample(task.input_dtype)
    else:
        flops = plan.flops_per_sample()  # (on the meta device: before the memory baseline)
    if flops is None:
        log.info(
            "FLOPs per sample not counted (the meta device cannot run the model): no tflops or "
            "mfu for this run"
        )
    return task, flops


def built_model(plan: RunPlan, bundle: Any, task: Task, device: torch.device) -> torch.nn.Module:
    """The model on `device`, checked to see only backwards where it is a language model, with
    SyncBatchNorm and the channels-last layout where the run asks for them (before the cast:
    keep_batchnorm_fp32 still applies)."""
    cfg = plan.cfg
    model = build_model(
        cfg.model, bundle.num_classes, bundle.image_size, plan.specs.get("model")
    ).to(device)
    if task.name == LANGUAGE_MODEL and sees_ahead(
        model, bundle.num_classes, bundle.block_size or bundle.image_size
    ):
        raise ConfigError(
            "model",
            f"{options.label(cfg.model)} sees the tokens it predicts: its outputs at earlier "
            "positions change with a later token, so next-token training would teach it to "
            "copy; a language model attends backwards only",
            "a causal model (a causal mask in its attention; model=hf encoders: "
            "model.is_decoder=true)",
        )
    if cfg.trainer.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def built_optimizer(plan: RunPlan, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The config's optimizer over `model`'s parameters: torchao's low-bit Adam/AdamW where the
    level keeps low-bit state (the plan checked which), else the optimizer group's."""
    cfg, properties = plan.cfg, plan.properties
    if not properties.low_bit_state:
        return build_optimizer(cfg.optimizer, model.parameters(), plan.specs.get("optimizer"))
    optimizer = build_low_bit(
        cfg.optimizer,
        list(model.parameters()),
        properties.state_format,
        stochastic_rounding=properties.stochastic_rounding,
    )
    log.info(
        "Optimizer: torchao's %s with %s state; its update is compiled per parameter shape on "
        "the first step (cached on disk for later runs)",
        type(optimizer).__name__,
        properties.state_format,
    )
    return optimizer


def precision_engine(
    plan: RunPlan, device: torch.device, comm: Comm, kernels: Optional[str], shards: bool = False
) -> AmpEngine:
    """The run's precision engine (runner.precision): its properties and layer rules, the
    overflow flag summed over the ranks, the seed of stochastic rounding. `kernels`: the
    backend to step with (None: precision.kernels; "torch" where the kernels are not built);
    `shards`: the model is sharded with FSDP2 after its cast."""
    cfg = plan.cfg
    return AmpEngine(
        plan.properties,
        device,
        kernels=kernels or cfg.precision.kernels,
        flag_reducer=distributed.flag_reducer(comm),
        seed=cfg.trainer.seed,
        layer_rules=plan.layer_rules,
        sharded=shards,
    )


def sharded_parts(
    plan: RunPlan, model: torch.nn.Module, device: torch.device, comm: Comm
) -> tuple[torch.nn.Module, torch.optim.Optimizer, AmpEngine]:
    """FSDP2 (trainer.strategy=fsdp under torchrun): the model cast, then sharded over the
    ranks, then the optimizer over the shards (a sharded run steps with torch's ops)."""
    engine = precision_engine(plan, device, comm, "torch", shards=True)
    engine.cast(model)
    units = fsdp.shard(model, plan.properties, plan.cfg.trainer.fsdp_wrap)
    log.info(
        "FSDP2: %d units sharded over %d ranks (%s), then the model",
        len(units),
        comm.world_size,
        ", ".join(units[:8]) + (" ..." if len(units) > 8 else ""),
    )
    optimizer = build_optimizer(plan.cfg.optimizer, model.parameters(), plan.specs.get("optimizer"))
    engine.add_optimizer(optimizer, [model])
    return model, optimizer, engine


def checked_criterion(plan: RunPlan, bundle: Any, task: Task) -> torch.nn.Module:
    """The loss. With data of one's own (whose shape planning could not know): the criterion
    checked against the task and the classes, and the first target, as a batch of one, checked
    as the training loop checks every batch, before any run exists."""
    cfg = plan.cfg
    criterion = build_loss(cfg)
    if plan.declared is not None:  # (planning checked them)
        return criterion
    if "loss" in cfg:
        check_criterion(criterion, str(cfg.loss._target_), task, bundle.num_classes)
    target = bundle.train[0][1]
    indices = class_indices(criterion, bundle.num_classes)
    problem = target_problem(default_collate([target]), indices, task.target_dims)
    if problem is not None:
        raise DataError(problem)
    return criterion


def compile_arguments(mode: str, fp8: Any = None) -> dict[str, Any]:
    """torch.compile's arguments for the model: its `mode`, or, where the fp8 layers need
    inductor settings of their own (`fp8.inductor_options()`), the mode's settings with those
    (torch.compile takes a mode or options, not both; options apply to this model's forward and
    backward graphs only, not to the process, so the next job of a sweep is not changed)."""
    extra = fp8.inductor_options() if fp8 is not None else {}
    if not extra:
        return {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode), **extra}}


def sharded(plan: RunPlan, comm: Comm) -> bool:
    """Whether this run shards its model with FSDP2 (trainer.strategy=fsdp under torchrun: the
    plan's decision, in a process group)."""
    return comm.active and plan.shards


def infer_task(plan: RunPlan, sample: torch.Tensor) -> str:
    """The task of a run whose dataset is the user's own: the plan's, except that with
    `task=auto` a dataset whose inputs are sequences of integer token ids is a language model's
    (the plan could not tell before the data existed)."""
    auto = OmegaConf.select(plan.cfg, "task.name", default="auto") == "auto"
    data = plan.specs.get("data")
    if (
        auto
        and (data is None or data.task is None)
        and isinstance(sample, torch.Tensor)
        and sample.dim() == 1
        and not sample.is_floating_point()
        and plan.task != LANGUAGE_MODEL
    ):
        log.info(
            "task=auto: the dataset yields sequences of integer token ids, so the run is a "
            "language model's (task=language_model)"
        )
        return LANGUAGE_MODEL
    return plan.task


def shape_findings(
    cfg: DictConfig,
    properties: Properties,
    device_info: DeviceInfo,
    model: torch.nn.Module | Callable[[], Optional[torch.nn.Module]] | None = None,
) -> list[Finding]:
    """The Tensor Core findings about the model's layer sizes and the batch size (16-bit on a
    CUDA GPU only). `model`: the built one, or a function giving it on the meta device (a dry
    run's plan: `RunPlan.meta_model`, asked only where these findings need it); where there is
    none, the model is built here on PyTorch's meta device: its shapes, no memory, no data."""
    if device_info.type != "cuda" or not properties.compute_dtypes:
        return []
    if model is not None and not isinstance(model, torch.nn.Module):
        model = model()
    if model is None:
        num_classes = declared_num_classes(cfg.data)
        if num_classes is None:
            return []
        with torch.device("meta"):
            model = build_model(cfg.model, num_classes, cfg.data.image_size)
    return tensor_core_findings(model, cfg.trainer.batch_size, properties, device_info)
