"""Configuration: everything Hydra composes and checks before torch, data or models are imported.

- `schema`: the typed nodes of every group (TrainerConfig, MlflowConfig, the options' dataclasses,
  RunConfig), each default declared once, and the words they use (task names, the default
  experiment);
- `precision`: the precision property table, from which the precision node, its parsers, params
  and run-name suffixes derive; `levels`: Apex's levels and the loss scaler's defaults;
  `formats`: the names of number formats (dtype names, aliases, short names);
- `options`: one spec per built-in model, data, optimizer and scheduler option (builder, rules);
  `targets`: a user's own callables by `_target_`; `values` and `validation`: the value rules;
- `store`: the schemas registered in Hydra's ConfigStore (done on import); `finder`: where conf/ is.
- `mistakes`: a config that does not compose, told in one line with the nearest right spellings
  (the CLI's and a sweep's pre-flight).

Never imports torch (a test holds it so): a dry run, `--help` and a bad value stop here cheaply.
The names callers import from `runner.config` are re-exported below.
"""

from runner.config.options import (
    BUILT_IN_MODELS,
    DATASET_NAMES,
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
)
from runner.config.schema import (
    COMPILE_MODES,
    CUDA_GRAPHS,
    DEVICES,
    FSDP_CHECKPOINTS,
    KERNEL_CHOICES,
    STRATEGIES,
    TASK_CHOICES,
    TRACKERS,
    TUNABLE,
    TUNE_CHOICES,
    AdamConfig,
    CifarConfig,
    CosineConfig,
    DataConfig,
    GPTConfig,
    ImageFolderConfig,
    MlflowConfig,
    ModelConfig,
    OneCycleConfig,
    OptimizerConfig,
    RunConfig,
    SchedulerConfig,
    SGDConfig,
    StepLRConfig,
    SyntheticConfig,
    SyntheticTextConfig,
    TaskConfig,
    TextConfig,
    TinyModelConfig,
    TokensConfig,
    TrackingConfig,
    TrainerConfig,
    VitTinyConfig,
    tunable_defaults,
)
from runner.config.store import SCHEMAS, PrecisionConfig, register_configs

__all__ = [
    "BUILT_IN_MODELS",
    "COMPILE_MODES",
    "CUDA_GRAPHS",
    "DATASET_NAMES",
    "DEVICES",
    "FSDP_CHECKPOINTS",
    "KERNEL_CHOICES",
    "MODEL_NAMES",
    "OPTIMIZER_NAMES",
    "SCHEDULER_NAMES",
    "SCHEMAS",
    "STRATEGIES",
    "TASK_CHOICES",
    "TRACKERS",
    "TUNABLE",
    "TUNE_CHOICES",
    "AdamConfig",
    "CifarConfig",
    "CosineConfig",
    "DataConfig",
    "GPTConfig",
    "ImageFolderConfig",
    "MlflowConfig",
    "ModelConfig",
    "OneCycleConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "SchedulerConfig",
    "SGDConfig",
    "StepLRConfig",
    "SyntheticConfig",
    "SyntheticTextConfig",
    "TaskConfig",
    "TextConfig",
    "TinyModelConfig",
    "TokensConfig",
    "TrackingConfig",
    "TrainerConfig",
    "VitTinyConfig",
    "tunable_defaults",
    "register_configs",
]
