"""The built-in options of the model, data, optimizer and scheduler groups: one `Spec` each.

A spec holds everything about an option in one place: its schema (the dataclass that types the
option's YAML, declared in `runner.config.schema` and stored as `schema/<group>/<kind>`; None for
an option whose extra keys pass through to its builder as arguments), its value rules, and its
builder (a "module:function" path, imported when a run builds it). The name lists
(`MODEL_NAMES`, ...), the schemas Hydra types the options with and the value rules
`runner.config.validation` applies are all derived from `SPECS`: adding a built-in option is one
spec here, its schema if it needs its own, and its YAML file in conf/<group>/.

Beyond the built-in names, a `model`, `data` or `loss` node with a `_target_` is the user's own
callable (`runner.config.targets`), built by the group's `TARGET_SPECS` entry. Torch-free: this
module is imported while Hydra composes.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from runner.config.schema import (
    CLASSIFICATION,
    LANGUAGE_MODEL,
    NORMS,
    AdamConfig,
    CifarConfig,
    CosineConfig,
    GPTConfig,
    ImageFolderConfig,
    ModelConfig,
    OneCycleConfig,
    SchedulerConfig,
    SGDConfig,
    StepLRConfig,
    SyntheticConfig,
    SyntheticTextConfig,
    TextConfig,
    TinyModelConfig,
    TokensConfig,
    VitTinyConfig,
)
from runner.config.values import (
    Rule,
    finite,
    integer_at_least,
    non_negative,
    one_of,
    optional,
    positive,
    unit_interval,
)

# ---- specs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One option: `group`/`name`, its builder ("module:function"), its schema (`kind`: the name
    it is stored under, `schema/<group>/<kind>`; None: untyped, extra keys are the builder's
    arguments), its value rules (keys under the group) and, for data, the number of classes it
    has without loading anything (`classes`: a function of the data node)."""

    group: str
    name: str
    builder: str
    kind: Optional[str] = None
    schema: Optional[type] = None
    rules: tuple[Rule, ...] = ()
    classes: Optional[Callable[[Any], Optional[int]]] = None
    by_name: bool = True  # builds from its name alone (False: needs arch or _target_)
    check: Optional[str] = None  # "module:function(node)": checks before any work (imports)
    # the task a model or dataset serves (runner.tasks): classification or language_model;
    # None: it depends on what the user's callable or zoo model is (not known before building)
    task: Optional[str] = CLASSIFICATION
    # data: its training samples without loading anything (a function of the data node; None:
    # only the loaded dataset can tell, or `num_train` says them)
    train_size: Optional[Callable[[Any], Optional[int]]] = None

    def build(self) -> Callable[..., Any]:
        return _load(self.builder)

    def run_check(self, node: Any) -> None:
        if self.check is not None:
            _load(self.check)(node)


def _load(path: str) -> Callable[..., Any]:
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


_INT_1 = (integer_at_least(1), "an integer >= 1")
CIFAR_TRAIN_SIZE = 50_000  # CIFAR-10's and CIFAR-100's training images (five batches' worth)
_TINY_RULES = (("width", *_INT_1), ("norm", one_of(NORMS), ", ".join(NORMS)))
_VIT_RULES = tuple(
    (k, *_INT_1)
    for k in ("image_size", "patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim")
)
_VOCAB_RULE = ("vocab_size", optional(integer_at_least(2)), "null (the data's) or an integer >= 2")
_GPT_RULES = (
    *((k, *_INT_1) for k in ("n_layer", "n_head", "n_embd", "block_size")),
    _VOCAB_RULE,
    ("dropout", lambda v: finite(v) and 0 <= v < 1, "a number in [0, 1)"),
)
_ZOO_RULES = (("arch", lambda v: isinstance(v, str) and bool(v.strip()), "a model name"),)
_DATA_RULES = (("image_size", lambda v: isinstance(v, int) and v >= 8, "an integer >= 8"),)
_CIFAR_RULES = (
    ("image_size", lambda v: v == 32, "32 (CIFAR images are 32x32)"),
    ("root", lambda v: not os.path.isfile(v), "a folder (it is a file)"),
)
_OPT_RULES = (
    ("lr", positive, "a finite number > 0"),
    ("weight_decay", non_negative, "a finite number >= 0"),
)
_ADAM_RULES = _OPT_RULES + (
    ("eps", positive, "a finite number > 0"),
    (
        "betas",
        lambda v: v is not None and len(v) == 2 and all(unit_interval(b) for b in v),
        "two numbers in [0, 1), e.g. [0.9, 0.999]",
    ),
)


def _torchvision(
    name: str, builder: str = "runner.components.models:build_torchvision_named"
) -> Spec:
    return Spec("model", name, builder, "torchvision", ModelConfig)


def _synthetic_classes(node: Any) -> Optional[int]:
    return int(node.get("num_classes", 10))


def hidden(name: str) -> bool:
    """A hidden file or folder of a dataset, never data: `.ipynb_checkpoints` (Jupyter), `.git`,
    `.DS_Store`, the `._<name>` resource forks macOS writes beside every image copied from it."""
    return name.startswith(".")


def image_classes(split: str) -> list[str]:
    """The class folders of an ImageFolder split (`root/<split>`): its sub-folders, hidden ones
    left out, sorted (a class's index is its place here, as torchvision's ImageFolder says)."""
    with os.scandir(split) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not hidden(e.name))


def _imagefolder_classes(node: Any) -> Optional[int]:
    wanted = node.get("num_classes")
    if wanted is not None:
        return int(wanted)
    train = os.path.join(str(node.get("root", "")), str(node.get("train_dir", "train")))
    if os.path.isdir(train):
        return len(image_classes(train)) or None
    return None


def _vocab(function: str) -> Callable[[Any], Optional[int]]:
    """A text dataset's vocabulary size (its "classes": one per token id), from the text module
    (imported when asked: it reads a tokenizer file at most)."""
    return lambda node: _load(f"runner.components.text:{function}")(node)


def _declared_classes(node: Any) -> Optional[int]:
    wanted = node.get("num_classes")
    return None if wanted is None else int(wanted)


SPECS: tuple[Spec, ...] = (
    # models: tiny CNNs, torchvision architectures by name, a small ViT, and the zoos
    Spec(
        "model", "tiny", "runner.components.models:build_tiny", "tiny", TinyModelConfig, _TINY_RULES
    ),
    *(
        _torchvision(n)
        for n in ("resnet18", "resnet50", "densenet161", "vgg16", "vgg16_bn", "resnext50_32x4d")
    ),
    Spec(
        "model",
        "vit_tiny",
        "runner.components.models:build_vit_tiny",
        "vit_tiny",
        VitTinyConfig,
        _VIT_RULES,
        check="runner.components.models:check_vit_tiny",
    ),
    Spec(
        "model",
        "torchvision",
        "runner.components.models:build_torchvision_zoo",
        rules=_ZOO_RULES,
        by_name=False,
        check="runner.components.models:check_torchvision_zoo",
    ),
    Spec(
        "model",
        "timm",
        "runner.components.models:build_timm",
        rules=_ZOO_RULES,
        by_name=False,
        check="runner.components.models:check_timm",
    ),
    Spec(
        "model",
        "custom",
        "runner.components.models:build_target",
        by_name=False,
        check="runner.components.models:check_target",
        task=None,
    ),
    # language models: the runner's GPT (gpt, gpt_tiny, gpt2_small) and Hugging Face's by type
    *(
        Spec(
            "model",
            name,
            "runner.components.lm_models:build_gpt",
            "gpt",
            GPTConfig,
            _GPT_RULES,
            check="runner.components.lm_models:check_gpt",
            task=LANGUAGE_MODEL,
        )
        for name in ("gpt", "gpt_tiny", "gpt2_small")
    ),
    Spec(
        "model",
        "hf",
        "runner.components.hf_models:build_hf",
        rules=(*_ZOO_RULES, _VOCAB_RULE),
        by_name=False,
        check="runner.components.hf_models:check_hf",
        task=LANGUAGE_MODEL,
    ),
    # data
    Spec(
        "data",
        "synthetic",
        "runner.components.images.synthetic:build_synthetic",
        "synthetic",
        SyntheticConfig,
        _DATA_RULES
        + (
            ("num_train", *_INT_1),
            ("num_val", *_INT_1),
            ("num_classes", integer_at_least(2), "an integer >= 2"),
            ("noise", non_negative, "a finite number >= 0"),
        ),
        classes=_synthetic_classes,
    ),
    Spec(
        "data",
        "cifar10",
        "runner.components.images.cifar:build_cifar",
        "cifar",
        CifarConfig,
        _DATA_RULES + _CIFAR_RULES,
        classes=lambda node: 10,
        check="runner.components.images.cifar:check_cifar",
        train_size=lambda node: CIFAR_TRAIN_SIZE,
    ),
    Spec(
        "data",
        "cifar100",
        "runner.components.images.cifar:build_cifar",
        "cifar",
        CifarConfig,
        _DATA_RULES + _CIFAR_RULES,
        classes=lambda node: 100,
        check="runner.components.images.cifar:check_cifar",
        train_size=lambda node: CIFAR_TRAIN_SIZE,
    ),
    Spec(
        "data",
        "imagefolder",
        "runner.components.images.folders:build_imagefolder",
        "imagefolder",
        ImageFolderConfig,
        _DATA_RULES
        + (
            ("root", os.path.isdir, "an existing folder with train/ and val/ class folders"),
            ("num_classes", optional(integer_at_least(2)), "null or an integer >= 2"),
        ),
        classes=_imagefolder_classes,
        check="runner.components.images.folders:check_imagefolder",
    ),
    Spec(
        "data",
        "custom",
        "runner.components.data:build_target",
        classes=_declared_classes,
        rules=(("num_classes", optional(integer_at_least(1)), "null or an integer >= 1"),),
        by_name=False,
        check="runner.components.data:check_target",
        task=None,
    ),
    # text, for language models: a corpus tokenised once, tokenised files, a synthetic language
    Spec(
        "data",
        "text",
        "runner.components.text:build_text",
        "text",
        TextConfig,
        (
            ("block_size", *_INT_1),
            ("val_fraction", lambda v: finite(v) and 0 < v < 1, "a number in (0, 1)"),
        ),
        classes=_vocab("text_vocab_size"),
        check="runner.components.text:check_text",
        task=LANGUAGE_MODEL,
    ),
    Spec(
        "data",
        "tokens",
        "runner.components.text:build_tokens",
        "tokens",
        TokensConfig,
        (
            ("block_size", *_INT_1),
            ("dtype", one_of(("uint16", "uint32")), "uint16, uint32"),
            (
                "vocab_size",
                optional(integer_at_least(2)),
                "null (from the files) or an integer >= 2",
            ),
        ),
        classes=_vocab("tokens_vocab_size"),
        check="runner.components.text:check_tokens",
        task=LANGUAGE_MODEL,
    ),
    Spec(
        "data",
        "synthetic_text",
        "runner.components.text:build_synthetic_text",
        "synthetic_text",
        SyntheticTextConfig,
        (
            ("block_size", *_INT_1),
            ("vocab_size", integer_at_least(2), "an integer >= 2"),
            ("num_train", integer_at_least(2), "an integer >= 2 (tokens)"),
            ("num_val", integer_at_least(2), "an integer >= 2 (tokens)"),
            ("branching", integer_at_least(1), "an integer >= 1"),
        ),
        classes=lambda node: int(node.get("vocab_size", 64)),
        task=LANGUAGE_MODEL,
    ),
    # optimizers
    Spec(
        "optimizer",
        "sgd",
        "runner.components.optim:build_sgd",
        "sgd",
        SGDConfig,
        _OPT_RULES
        + (
            ("momentum", unit_interval, "a number in [0, 1)"),
            ("dampening", unit_interval, "a number in [0, 1)"),
        ),
    ),
    Spec(
        "optimizer", "adam", "runner.components.optim:build_adam", "adam", AdamConfig, _ADAM_RULES
    ),
    Spec(
        "optimizer", "adamw", "runner.components.optim:build_adamw", "adam", AdamConfig, _ADAM_RULES
    ),
    # schedulers (stepped once per optimizer-step attempt)
    Spec(
        "scheduler", "none", "runner.components.optim:build_no_scheduler", "none", SchedulerConfig
    ),
    Spec(
        "scheduler",
        "cosine",
        "runner.components.optim:build_cosine",
        "cosine",
        CosineConfig,
        (("eta_min", non_negative, "a finite number >= 0"),),
    ),
    Spec(
        "scheduler",
        "step",
        "runner.components.optim:build_step",
        "step",
        StepLRConfig,
        (
            ("step_epochs", *_INT_1),
            ("gamma", lambda v: finite(v) and 0 < v <= 1, "a number in (0, 1]"),
        ),
    ),
    Spec(
        "scheduler",
        "onecycle",
        "runner.components.optim:build_onecycle",
        "onecycle",
        OneCycleConfig,
        (
            ("max_lr", optional(positive), "null or a finite number > 0"),
            ("pct_start", lambda v: finite(v) and 0 < v < 1, "a number in (0, 1)"),
            ("div_factor", positive, "a finite number > 0"),
            ("final_div_factor", positive, "a finite number > 0"),
        ),
    ),
)

GROUPS = ("model", "data", "optimizer", "scheduler")
# the spec that builds a node with a `_target_` (the user's own callable), per group
TARGET_SPECS = {"model": "custom", "data": "custom"}


def names(group: str) -> tuple[str, ...]:
    return tuple(s.name for s in SPECS if s.group == group)


def built_in(group: str) -> tuple[str, ...]:
    """The options that build from their name alone (no arch, no _target_)."""
    return tuple(s.name for s in SPECS if s.group == group and s.by_name)


def schemas() -> dict[str, dict[str, type]]:
    """{group: {kind: schema}} for Hydra's ConfigStore (`schema/<group>/<kind>`)."""
    out: dict[str, dict[str, type]] = {}
    for s in SPECS:
        if s.kind is not None:
            out.setdefault(s.group, {})[s.kind] = s.schema
    return out


def has_target(node: Any) -> bool:
    return hasattr(node, "keys") and "_target_" in node.keys()


def spec_for(group: str, node: Any) -> Optional[Spec]:
    """The spec that builds `node`: the group's target spec for a `_target_` node, else the one
    its `name` names (None: an unknown name)."""
    name = (
        TARGET_SPECS.get(group)
        if has_target(node)
        else (node.get("name") if hasattr(node, "get") else getattr(node, "name", None))
    )
    return next((s for s in SPECS if s.group == group and s.name == name), None)


def specs_of(cfg: Mapping[str, Any]) -> dict[str, Optional[Spec]]:
    """The spec of each option group `cfg` has (None for an unknown name), looked up once: the
    plan keeps them, validation and the builders take them from there."""
    return {group: spec_for(group, cfg[group]) for group in GROUPS if cfg.get(group) is not None}


def label(node: Mapping[str, Any]) -> str:
    """What a model (or dataset) is called in run names and reports: a zoo model's arch
    (vit_b_16), a `_target_`'s class or function (its path's last part, MyNet), else the
    option's name."""
    arch = node.get("arch")
    if arch:
        return str(arch)
    target = node.get("_target_")
    if target:
        return str(target).rsplit(".", 1)[-1]
    return str(node.get("name") or "model")


MODEL_NAMES = names("model")
DATASET_NAMES = names("data")
OPTIMIZER_NAMES = names("optimizer")
SCHEDULER_NAMES = names("scheduler")
BUILT_IN_MODELS = built_in("model")
