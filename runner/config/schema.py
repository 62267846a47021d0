"""The typed schema of every config group: the dataclasses Hydra merges each YAML option into.

A typo'd key, a wrong type or an unknown group choice stops a run at compose time, before torch,
data or models are imported. The model, data, optimizer and scheduler options are typed by their
option's own dataclass (named by its spec in `runner.config.options`); the precision node is
derived from the property table (`runner.config.precision`); the trainer's, the task's, MLflow's
and the tracker's nodes and the root (`RunConfig`) are declared here. Each default is stated once,
in its dataclass: a group's YAML file in conf/ sets only what differs from its schema (a test
fails on a restated default), so the comments here are where a setting is explained.
`runner.config.store` registers them in Hydra's ConfigStore. Torch-free: it runs on every
invocation, dry runs included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from runner.config.precision import precision_schema

# The tasks (runner.tasks implements each: what a batch is, the loss, the metrics); the task
# group's options (conf/task/) are these and auto, the dataset's own.
CLASSIFICATION, LANGUAGE_MODEL = "classification", "language_model"
TASKS = (CLASSIFICATION, LANGUAGE_MODEL)
AUTO_TASK = "auto"
TASK_CHOICES = (AUTO_TASK, *TASKS)
# The MLflow experiment a run goes to unless mlflow.experiment_name says another.
DEFAULT_EXPERIMENT = "amp-runner"

DEVICES = ("auto", "cpu", "cuda")
# torch.compile's modes (max-autotune-no-cudagraphs: what trainer.tune tries on a GPU)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# trainer.tune (runner.run.tune): auto (where the run is long enough to repay it), on, off, refresh
# (on, ignoring the cache of earlier decisions)
TUNE_CHOICES = ("auto", "on", "off", "refresh")
# the settings trainer.tune may choose, where the user gave none: none of them changes the math
TUNABLE = (
    "trainer.channels_last",
    "trainer.cudnn_benchmark",
    "trainer.compile",
    "trainer.compile_mode",
    "precision.kernels",
    "trainer.num_workers",
    "trainer.pin_memory",
    "trainer.cuda_graphs",
)
# trainer.cuda_graphs: false (eager), optimizer (the optimizer step replayed; true says it too) or
# step (the whole training step replayed: runner.run.whole_step)
CUDA_GRAPHS = ("false", "optimizer", "step")
# What `precision.kernels` accepts (runner.csrc): auto (the device's kernels, torch's ops if they
# cannot be built), fused (the device's kernels or an error), torch (never build; torch's own ops).
KERNEL_CHOICES = ("auto", "fused", "torch")
STRATEGIES = ("ddp", "fsdp")  # trainer.strategy under torchrun
FSDP_CHECKPOINTS = ("sharded", "full")  # trainer.fsdp_checkpoint


# ---- the options of the model, data, optimizer and scheduler groups (runner.config.options) ----
@dataclass
class ModelConfig:
    name: str = MISSING
    # Replace the ImageNet stem (7x7/2 conv + max-pool) with a 3x3/1 conv for 32x32 inputs.
    # null = automatic: on for images of at most 64 pixels.
    small_input: Optional[bool] = None


NORMS = ("batch", "group")


@dataclass
class TinyModelConfig(ModelConfig):
    width: int = 16
    norm: str = "batch"  # batch | group (GroupNorm: no batch statistics, e.g. for DDP tests)


@dataclass
class VitTinyConfig:
    """torchvision's VisionTransformer, small: 32-px images in 8x8 patches of 4 px."""

    name: str = MISSING
    image_size: int = 32  # must equal the data's image size (vit_tiny.yaml interpolates it)
    patch_size: int = 4
    num_layers: int = 4
    num_heads: int = 4
    hidden_dim: int = 128  # a multiple of num_heads (and of 16: Tensor Core friendly)
    mlp_dim: int = 256


@dataclass
class DataConfig:
    name: str = MISSING
    image_size: int = 32


@dataclass
class CifarConfig(DataConfig):
    root: str = "data"
    download: bool = True  # into root on first use, where the files are not there
    augment: bool = True  # random crop (pad 4) + horizontal flip on the training set


@dataclass
class ImageFolderConfig(DataConfig):
    root: str = MISSING
    train_dir: str = "train"
    val_dir: str = "val"
    num_classes: Optional[int] = None  # null = the number of class folders found
    augment: bool = True  # random resized crop + horizontal flip on the training set
    image_size: int = 224


@dataclass
class SyntheticConfig(DataConfig):
    num_train: int = 10000
    num_val: int = 2000
    num_classes: int = 10
    seed: int = 0
    noise: float = 1.0  # std of the per-image noise added to the class pattern


@dataclass
class GPTConfig:
    """The runner's decoder-only transformer (runner.components.lm_models.GPT)."""

    name: str = MISSING
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64  # a multiple of n_head (and of 16: Tensor Core and fp8 friendly)
    block_size: int = 256  # the context length; the YAML files take the data's
    vocab_size: Optional[int] = None  # null = the data's vocabulary
    dropout: float = 0.0
    tie_weights: bool = False  # the head shares the token embedding's weights
    bias: bool = True  # biases in the Linear layers and LayerNorms


@dataclass
class TextConfig:
    """Text files tokenised once into a cached flat token file (runner.components.text)."""

    name: str = MISSING
    path: str = MISSING  # a text file, or a folder of them
    glob: str = "**/*.txt"  # in a folder: the files to read (recursive, sorted)
    # in a folder: relative paths to leave out, shell patterns ("*" crosses folders), e.g.
    # ["site-packages/*"]
    exclude: list[str] = field(default_factory=list)
    tokenizer: Optional[str] = None  # null = UTF-8 bytes (vocabulary 256); else a tokenizer.json
    block_size: int = 256  # tokens per training sequence
    val_fraction: float = 0.1  # the held-out tail of the token stream
    cache_dir: Optional[str] = None  # null = $AMP_RUNNER_TOKEN_CACHE or ~/.cache/amp-runner/tokens


@dataclass
class TokensConfig:
    """Already tokenised corpora: flat .bin files in nanoGPT's layout (no header)."""

    name: str = MISSING
    train: str = MISSING
    val: str = MISSING
    dtype: str = "uint16"  # uint16 | uint32
    vocab_size: Optional[int] = None  # null = the largest token id in the files + 1
    block_size: int = 256


@dataclass
class SyntheticTextConfig:
    """A seeded, learnable synthetic language (no disk): tests and benchmarks."""

    name: str = MISSING
    vocab_size: int = 64
    num_train: int = 200000  # training tokens
    num_val: int = 20000  # validation tokens
    block_size: int = 64
    seed: int = 0
    branching: int = 4  # the possible next tokens of each context


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 0.1
    weight_decay: float = 0.0


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig(OptimizerConfig):
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    amsgrad: bool = False


@dataclass
class SchedulerConfig:
    name: str = MISSING


@dataclass
class CosineConfig(SchedulerConfig):
    eta_min: float = 0.0


@dataclass
class StepLRConfig(SchedulerConfig):
    step_epochs: int = 30
    gamma: float = 0.1


@dataclass
class OneCycleConfig(SchedulerConfig):
    max_lr: Optional[float] = None  # null = the optimizer's lr
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4


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
    # the loaders' batches in pinned (page-locked) host memory, for faster copies to a GPU; null:
    # on CUDA (a CPU run never pins)
    pin_memory: Optional[bool] = None
    channels_last: bool = False
    cudnn_benchmark: bool = True
    grad_clip_norm: Optional[float] = None  # max L2 norm of the unscaled fp32 gradients
    # gradient accumulation: one optimizer step per this many batches, their gradients summed
    # (in fp32 at levels whose gradients are 16-bit); the effective batch is batch_size times it
    # (docs/accumulation.md)
    accumulate_grad_batches: int = 1
    # at most this many batches an epoch (an integer), or this share of them (a number in (0, 1],
    # as Lightning's: 0.25 = a quarter of the epoch, at least one batch); typed Any, since
    # OmegaConf 2.3 fails on a Union field inside a merged structured config (its rule checks it)
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    log_every_n_steps: int = 50
    # the first steps of each session (a resumed run starts a new one) left out of the steady
    # samples_per_s, with any step that compiled (runner.measure.timing)
    warmup_steps: int = 3
    progress_bar: bool = True
    # stop after this many consecutive skipped steps or non-finite losses (divergence guard)
    max_bad_steps: int = 50
    # ... or once a dynamic loss scale falls below this while steps overflow (2^-14)
    collapsed_loss_scale: float = 6.103515625e-05
    # checkpoints: <checkpoint_dir>/<experiment>/<run name>/<run id>/last.pt (launch directory)
    checkpoint_dir: str = "checkpoints"
    checkpoint_every_n_epochs: int = 1  # 0: only when interrupted
    sync_batchnorm: bool = False  # SyncBatchNorm under torchrun (GPUs with NCCL only)
    # the model's forward (and backward) through torch.compile (the engine's step stays eager)
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode: one of COMPILE_MODES
    # CUDA graphs, one CUDA GPU only (runner.run.cuda_graphs): false; optimizer (or true): the
    # optimizer step captured and replayed (with compile: forward and backward too, compile_mode
    # default -> reduce-overhead); step: the whole training step (forward, backward, clip, step)
    # captured once and replayed. Typed Any: Hydra gives true/false as bools and step as a string,
    # and OmegaConf 2.3 fails on a Union field inside a merged structured config (its rule checks)
    cuda_graphs: Any = False
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
    # measure the settings left at their defaults on this run's model, batch, device and level
    # before training, and train with the fastest (runner.run.tune, docs/tuning.md): auto | on |
    # off | refresh
    tune: str = "auto"
    # the seconds tuning may take; null: from the run's estimated time, at most 120 (auto: 5% of
    # it; on and refresh: a quarter, at least 15)
    tune_budget_s: Optional[float] = None
    # an fp16 level on a CPU (emulated, ~100x slower than bfloat16) whose run is estimated to take
    # over an hour is refused in planning (runner.run.cpu_fp16); true runs it anyway
    allow_slow_fp16: bool = False


@dataclass
class TaskConfig:
    # auto: the dataset's task; classification | language_model (runner.tasks)
    name: str = AUTO_TASK


@dataclass
class MlflowConfig:
    # any MLflow URI; a relative SQLite path is relative to the directory the user launched from
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment_name: str = DEFAULT_EXPERIMENT
    run_name: Optional[str] = None  # null = "<model>-<opt_level>", e.g. densenet161-O2
    sweep_name: Optional[str] = None  # a sweep's parent run; null = "sweep <swept overrides>"
    # the user's own tags; nested keys are a dotted name (runner.tracking.tags.user_tags)
    tags: dict[str, Any] = field(default_factory=dict)
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
    # model and data are typed by their option's own schema (runner.config.options); an option
    # with a `_target_` (the user's callable) is untyped: its keys are the callable's arguments
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


def tunable_defaults() -> dict[str, Any]:
    """Each TUNABLE key's default, read from the schemas that declare them."""
    from dataclasses import fields

    from runner.config.precision import _TRAILING_KEYS

    known = {f"trainer.{f.name}": f.default for f in fields(TrainerConfig)}
    known.update({f"precision.{name}": default for name, _, default in _TRAILING_KEYS})
    return {key: known[key] for key in TUNABLE}
