"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Hydra merges each YAML option into these dataclasses, so a typo'd key, a wrong type or an unknown
group choice stops the run at compose time, before torch, data or models are imported. Value rules
that types cannot express (positive lr, known model names, ...) live with each option's spec in
`runner.config.options` and are applied by `runner.config.validation`.
This module must stay free of heavy imports: it runs on every invocation, dry runs included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from runner.config.levels import LEVEL_VALUES
from runner.config.options import (  # noqa: F401  (the option schemas and names, re-exported)
    BUILT_IN_MODELS,
    DATASET_NAMES,
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    TASK_CHOICES,
    AdamConfig,
    CifarConfig,
    CosineConfig,
    DataConfig,
    GPTConfig,
    ImageFolderConfig,
    ModelConfig,
    OneCycleConfig,
    OptimizerConfig,
    SchedulerConfig,
    SGDConfig,
    StepLRConfig,
    SyntheticConfig,
    SyntheticTextConfig,
    TextConfig,
    TinyModelConfig,
    TokensConfig,
    VitTinyConfig,
    schemas,
)
from runner.config.precision import precision_schema

DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes
# What `precision.kernels` accepts (runner.csrc): auto (the device's kernels, torch's ops if they
# cannot be built), fused (the device's kernels or an error), torch (never build; torch's own ops).
KERNEL_CHOICES = ("auto", "fused", "torch")
STRATEGIES = ("ddp", "fsdp")  # trainer.strategy under torchrun
FSDP_CHECKPOINTS = ("sharded", "full")  # trainer.fsdp_checkpoint


# ---- precision: the schema of the precision group, derived from the property table -----------
PrecisionConfig = precision_schema()


# ---- trainer and tracking ------------------------------------------------------------------
@dataclass
class TrainerConfig:
    max_epochs: int = 10
    batch_size: int = 128
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 42
    num_workers: int = 2
    channels_last: bool = False
    cudnn_benchmark: bool = True
    grad_clip_norm: Optional[float] = None  # max L2 norm of the unscaled fp32 gradients
    limit_train_batches: Optional[int] = None
    limit_val_batches: Optional[int] = None
    log_every_n_steps: int = 50
    progress_bar: bool = True
    # stop after this many consecutive skipped steps or non-finite losses (divergence guard)
    max_bad_steps: int = 50
    # ... or once a dynamic loss scale falls below this while steps overflow (2^-14)
    collapsed_loss_scale: float = 6.103515625e-05
    # checkpoints: <checkpoint_dir>/<experiment>/<run name>/<run id>/last.pt (launch directory)
    checkpoint_dir: str = "checkpoints"
    checkpoint_every_n_epochs: int = 1  # 0: only when interrupted
    sync_batchnorm: bool = False  # SyncBatchNorm under torchrun (GPUs with NCCL only)
    compile: bool = False  # the model's forward (and backward) through torch.compile
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune
    # range diagnostics (runner.measure.diagnostics) on steps 1, 1+n, 1+2n, ...; 0 = off (no hooks
    # at all)
    diagnose_every_n_steps: int = 0
    # under torchrun: ddp (every rank holds the whole model) or fsdp (FSDP2: parameters, gradients
    # and optimizer state sharded over the ranks; runner.run.fsdp)
    strategy: str = "ddp"
    # fsdp: the modules sharded as units (class names, or module-name globs whose * stays within
    # one name: blocks.*); null: the model's repeated blocks (runner.run.fsdp.default_units)
    fsdp_wrap: Optional[list[str]] = None
    # fsdp: sharded (each rank writes its shards: torch.distributed.checkpoint) or full (the
    # whole state gathered to rank 0, one file)
    fsdp_checkpoint: str = "sharded"


@dataclass
class TaskConfig:
    # auto: the dataset's task; classification | language_model (runner.tasks)
    name: str = "auto"


@dataclass
class MlflowConfig:
    tracking_uri: str = (
        "sqlite:///mlflow.db"  # relative paths: the directory the user launched from
    )
    experiment_name: str = "amp-runner"
    run_name: Optional[str] = None  # null = "<model>-<opt_level>", e.g. densenet161-O2
    sweep_name: Optional[str] = None  # a sweep's parent run; null = "sweep <swept overrides>"
    tags: dict[str, str] = field(default_factory=dict)
    # liveness (runner.tracking.liveness): a run's heartbeat period, and how old the heartbeat of a
    # RUNNING run on another host must be for a starting run to end it as KILLED
    heartbeat_s: float = 60.0
    stale_after_s: float = 600.0
    # seconds between samples of the system metrics (system/..., MLflow's monitors); 0: off
    system_metrics_s: float = 10.0


@dataclass
class TrackingConfig:
    # where runs are recorded (runner.tracking): mlflow (the store of the `mlflow` group) or none
    # (the console and <run folder>/tracking.json, no store)
    name: str = "mlflow"


TRACKERS = ("mlflow", "none")  # tracking.name's values (conf/tracking/)


@dataclass
class RunConfig:
    # model and data are typed by their option's own schema (runner.config.options); an option with
    # a
    # `_target_` (the user's callable) is untyped: its keys are the callable's arguments
    model: Any = MISSING
    data: Any = MISSING
    loss: Any = MISSING  # a criterion by `_target_` (conf/loss/cross_entropy.yaml by default)
    task: TaskConfig = field(default_factory=TaskConfig)  # what a batch is, the loss, metrics
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING
    mlflow: MlflowConfig = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    dry_run: bool = False
    resume: Optional[str] = None  # auto (the latest checkpoint of this run name) or a path
    # Free-form settings of an experiment config (experiments/), e.g. a batch size per level that
    # `trainer.batch_size: ${experiment.batch_size.${precision.opt_level}}` picks; logged as params.
    experiment: dict[str, Any] = field(default_factory=dict)


SCHEMAS: dict[str, dict[str, type]] = {
    **schemas(),  # model, data, optimizer and scheduler: from the option specs
    "precision": {"apex": PrecisionConfig},
    "trainer": {"default": TrainerConfig},
    "task": {"default": TaskConfig},
    "mlflow": {"default": MlflowConfig},
    "tracking": {"default": TrackingConfig},
}


def _by_reference(cls: type, name: str) -> type:
    """A schema made at run time, reachable as `runner.config.<name>`: pickled by reference (a
    sweep launcher that sends the config store to its workers, joblib's or submitit's, pickles
    the class by name), not by value, which would copy dataclasses' MISSING sentinel of a
    field with a default factory (precision.layers) and lose its default there."""
    cls.__module__, cls.__qualname__, cls.__name__ = __name__, name, name
    globals()[name] = cls
    return cls


def register_configs() -> None:
    """Store the schemas: `base_run` types the root, `schema/<group>/<kind>` types each option,
    `schema/precision/level/<level>` holds each Apex level's properties.

    Option files pull their schema with `- /schema/<group>/<kind>@_here_` in their defaults list,
    which keeps the schemas out of the group's list of choices.
    The precision node is derived from the property table (runner.config.precision) each time,
    so a property added to the table is typed everywhere once the schemas are stored again.
    """
    precision = _by_reference(precision_schema(), "PrecisionConfig")
    root = _by_reference(
        dataclasses.make_dataclass(  # RunConfig, its precision typed by today's table
            "RunConfig", [("precision", precision, field(default=MISSING))], bases=(RunConfig,)
        ),
        "TypedRunConfig",
    )
    cs = ConfigStore.instance()
    cs.store(name="base_run", node=root)
    for group, kinds in {**SCHEMAS, "precision": {"apex": precision}}.items():
        for kind, node in kinds.items():
            cs.store(group=f"schema/{group}", name=kind, node=node)
    # a precision preset pulls its level's properties with `- /schema/precision/level/O2@_here_`
    # and states only what differs (the level table is defined once, in runner.config.levels)
    for level, values in LEVEL_VALUES.items():
        cs.store(group="schema/precision/level", name=level, node={"opt_level": level, **values})


register_configs()
