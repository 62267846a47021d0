"""Datasets: a `data` config section in, the train and val datasets (a `DataBundle`) out.

The sources, each the builder of its config option (`runner.config.options.SPECS`): images
(`runner.components.images`: synthetic, CIFAR, ImageFolder), text (`runner.components.text`) and
the user's own by `data._target_` (here). This module holds what they share (`DataBundle`, the
root key, the warning where train and val are one) and the entry points the plan and the build
call (`declared_input`, `build_datasets`). Anything a user can fix raises `DataError` (or
`ConfigError`) whose message names the config key to change, so the CLI can print it without a
traceback. This module is imported only for a real run (the dry run never loads it).

The DataLoaders over them: `runner.components.loaders`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue
from torch.utils.data import Dataset

from runner.config import options, targets
from runner.config.options import DATASET_NAMES
from runner.config.schema import CLASSIFICATION, LANGUAGE_MODEL  # the tasks a dataset serves
from runner.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass
class DataBundle:
    """Both splits plus what the model builder needs to know about them.

    For images (`task` "classification"): `num_classes` classes, inputs of `image_size` pixels.
    For text (`task` "language_model"): `num_classes` is the vocabulary size (token ids 0 ..
    num_classes - 1), each item is (x, y), two int64 tensors of `block_size` tokens with y = x
    shifted by one token, and `image_size` is `block_size` (the input's length)."""

    train: Dataset
    val: Dataset
    num_classes: int
    image_size: int
    name: str
    task: str = CLASSIFICATION
    block_size: Optional[int] = None


# ---- what the sources share -------------------------------------------------------------------
def data_root(cfg: Any) -> str:
    """`data.root` as an absolute path (`~` expanded), a DataError where it is not set or is a
    file: the image sources on disk (CIFAR, ImageFolder) read it alike."""
    try:
        root = getattr(cfg, "root", None)
    except MissingMandatoryValue:  # `root: ???` in imagefolder.yaml
        root = None
    if root is None or str(root) in ("", "???"):
        raise DataError(
            "data.root is not set: pass data.root=/path/to/dataset, or use data=synthetic"
        )
    root = os.path.abspath(os.path.expanduser(str(root)))
    if os.path.exists(root) and not os.path.isdir(root):
        raise DataError(f"data.root={root} is a file, not a directory")
    return root


def say_if_one_split(train: tuple[str, str], val: tuple[str, str]) -> None:
    """Warn where the training and the validation data are one file or folder ((key, path)
    each): the validation figures then measure the training data (an overfitting check may mean
    it; a run comparing levels does not)."""
    (train_key, train_path), (val_key, val_path) = train, val
    if os.path.realpath(train_path) == os.path.realpath(val_path):
        log.warning(
            "%s and %s are the same (%s): validation measures the training data, so "
            "best_val_* says how well the model fits it, not how it generalises",
            train_key,
            val_key,
            os.path.realpath(train_path),
        )


# ---- the user's own: data._target_ -------------------------------------------------------------
TARGET_KEYS = ("name", "num_classes")  # the runner's keys of a `_target_` dataset, not arguments


def _target_extra(cfg: Any, target: Any) -> dict[str, Any]:
    """The number of classes goes to the callable too when it takes `num_classes` and it is set."""
    wanted = cfg.get("num_classes")
    return (
        {"num_classes": int(wanted)}
        if wanted is not None and targets.accepts(target, "num_classes")
        else {}
    )


def check_target(cfg: Any) -> None:
    target = (
        targets.resolve("data._target_", cfg["_target_"])
        if not OmegaConf.is_missing(cfg, "_target_")
        else None
    )
    targets.check("data", cfg, TARGET_KEYS, _target_extra(cfg, target) if target else {})


def build_target(cfg: Any) -> DataBundle:
    """`data._target_(**args)` -> (train, val); the classes are `data.num_classes` or
    len(train.classes), the image size the last dimension of the first training input."""
    path = cfg["_target_"]
    target = targets.resolve("data._target_", path)
    pair = targets.call("data", cfg, TARGET_KEYS, _target_extra(cfg, target))
    if not (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in pair)
    ):
        raise ConfigError(
            "data._target_",
            f"{path} returned {_returned(pair)}",
            "a (train, val) pair of map-style datasets (torch.utils.data.Dataset: __len__ and "
            "__getitem__)",
        )
    train, val = pair
    if len(train) == 0 or len(val) == 0:
        raise ConfigError(
            "data._target_",
            f"{path} returned an empty {'training' if len(train) == 0 else 'validation'} set",
        )
    num_classes = cfg.get("num_classes")
    if num_classes is None:
        classes = getattr(train, "classes", None)
        if classes is None:
            raise ConfigError(
                "data.num_classes",
                f"is null and the training set {path} returned has no .classes to count",
                "the number of classes, e.g. "
                "+data.num_classes=10 (or data.num_classes=10 with data=custom)",
            )
        num_classes = len(classes)
    sample = train[0]
    if not (
        isinstance(sample, (tuple, list))
        and len(sample) == 2
        and isinstance(sample[0], torch.Tensor)
    ):
        raise ConfigError(
            "data._target_",
            f"the training set of {path} yields {_yielded(sample)}, not an (input tensor, "
            "target) pair",
            "__getitem__ returning (x, y), x a torch.Tensor",
        )
    name = str(cfg.get("name") or path.rsplit(".", 1)[-1])
    return DataBundle(train, val, int(num_classes), int(sample[0].shape[-1]), name)


def _returned(pair: Any) -> str:
    """What a data `_target_` returned instead of two map-style datasets, in a reader's terms."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        size = f" of {len(pair)}" if isinstance(pair, (tuple, list)) else ""
        return f"a {type(pair).__name__}{size}, not a (train, val) pair"
    kinds = " and ".join(dict.fromkeys(type(d).__name__ for d in pair))
    if any(isinstance(d, torch.utils.data.DataLoader) for d in pair):
        return (
            f"a pair of {kinds}: return their datasets (the runner makes the loaders, from "
            "trainer.batch_size and trainer.num_workers)"
        )
    if any(isinstance(d, torch.utils.data.IterableDataset) for d in pair):
        return (
            f"a pair of {kinds}, iterable datasets: they have no length and no indexing, which "
            "the runner shuffles, shards and counts its steps by"
        )
    return f"a pair of {kinds}, without __len__ or __getitem__"


_TO_TENSOR = {  # how an input of these packages becomes a tensor, by the package's name
    "numpy": " (torch.from_numpy(x))",
    "PIL": " (torchvision.transforms.ToTensor()(x): floats in [0, 1], channels first)",
}


def _yielded(sample: Any) -> str:
    """What a dataset's item is, where it is not an (input tensor, target) pair."""
    if isinstance(sample, dict):
        return f"a dict (keys {', '.join(map(str, list(sample)[:6]))})"
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        what = type(sample[0])
        hint = _TO_TENSOR.get(what.__module__.partition(".")[0], "")
        return f"a pair whose input is a {what.__module__}.{what.__name__}{hint}"
    if isinstance(sample, (tuple, list)):
        return f"a {type(sample).__name__} of {len(sample)} items"
    return f"a {type(sample).__name__}"


# ---- entry points --------------------------------------------------------------------------
def declared_num_classes(cfg: Any, spec: Optional[options.Spec] = None) -> Optional[int]:
    """The number of classes the `data` config implies without loading anything (a dry run
    sizes the model's head with it): None where only the dataset itself can tell. `spec`: the
    option's, where the caller has it (else looked up)."""
    spec = spec or options.spec_for("data", cfg)
    return spec.classes(cfg) if spec is not None and spec.classes is not None else None


def declared_input(
    cfg: Any, spec: Optional[options.Spec] = None
) -> Optional[tuple[int, tuple[int, ...]]]:
    """(classes, input shape) the `data` config implies without loading anything: a built-in
    option's (3-channel images of data.image_size; for text, the vocabulary size and sequences
    of data.block_size tokens); None where only the dataset can tell."""
    spec = spec or options.spec_for("data", cfg)
    num_classes = declared_num_classes(cfg, spec)
    if spec is None or not spec.by_name or num_classes is None:
        return None
    if spec.task == LANGUAGE_MODEL:  # token ids: (block_size,)
        return num_classes, (int(cfg.block_size),)
    size = int(cfg.image_size)
    return num_classes, (3, size, size)


def build_datasets(cfg: Any, spec: Optional[options.Spec] = None) -> DataBundle:
    """Build the train and val datasets described by the `data` config section (its option's
    builder, `runner.config.options.SPECS`; `spec`: the option's, where the caller has it)."""
    spec = spec or options.spec_for("data", cfg)
    if spec is None:
        name = getattr(cfg, "name", None)
        raise ConfigError("data.name", f"unknown dataset {name!r}", allowed=DATASET_NAMES)
    return spec.build()(cfg)
