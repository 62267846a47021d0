"""Datasets: a `data` config section in, the train and val datasets (a `DataBundle`) out.

Four sources: `synthetic` (generated from a seed, nothing on disk), `cifar10` / `cifar100`
(torchvision's python-pickle format) and `imagefolder` (root/<split>/<class>/<image>).
Anything a user can fix (a wrong root, a missing split, no network for the download) raises
`DataError` whose message names the config key to change, so the CLI can print it without a
traceback. This module is imported only for a real run (the dry run never loads it).

The DataLoaders over them: `runner.components.loaders`.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue
from torch.utils.data import Dataset

from runner.config import options, targets
from runner.config.options import DATASET_NAMES, image_classes
from runner.config.schema import CLASSIFICATION, LANGUAGE_MODEL  # the tasks a dataset serves
from runner.errors import ConfigError, DataError, UnreadableFile

log = logging.getLogger(__name__)

# Per-channel statistics of the training sets (the values the literature normalises with).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_SUGGESTION = "set data.download=true (needs network) or use data=synthetic"


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


# ---- synthetic -----------------------------------------------------------------------------
class SyntheticDataset(Dataset):
    """Learnable images generated per item from (seed, split, index): no disk, no big allocation.

    Each class owns a fixed smooth random pattern (low-resolution noise upsampled bilinearly).
    A sample is that pattern, randomly shifted and scaled in contrast, plus a smooth per-sample
    "clutter" field that belongs to no class, plus white noise of std `noise`. The class is thus
    recoverable (a small CNN gets well above chance within a couple of epochs) but not trivially,
    so accuracy curves mean something when precision levels are compared.

    Every random draw for item i comes from a generator seeded with (seed, split, i), so an item is
    identical in every process and DataLoader worker, whatever order items are fetched in. Train
    and val share the class patterns (seeded with seed alone) but never a sample. Labels are
    balanced: a seeded permutation of 0, 1, ..., C-1, 0, 1, ...
    """

    # Resolution of the random fields before upsampling (smaller = smoother).
    PATTERN_RES = 4
    CLUTTER_RES = 4
    # Relative weights of the parts of an image; the class pattern has unit std per channel.
    CLUTTER_STD = 0.75
    CONTRAST_RANGE = (0.5, 1.5)
    MAX_SHIFT_FRACTION = 1 / 8

    _SPLIT_IDS = {"train": 1, "val": 2}

    def __init__(
        self,
        num_samples: int,
        num_classes: int,
        image_size: int,
        seed: int = 0,
        noise: float = 1.0,
        split: str = "train",
    ):
        if split not in self._SPLIT_IDS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.num_samples = int(num_samples)
        self.num_classes = int(num_classes)
        self.image_size = int(image_size)
        self.seed = int(seed)
        self.noise = float(noise)
        self.split = split
        self.max_shift = max(1, int(self.image_size * self.MAX_SHIFT_FRACTION))
        # The patterns are rendered on a canvas larger than the image; a sample crops at an offset.
        self._canvas = self.image_size + 2 * self.max_shift

        rng = np.random.default_rng([self.seed, 0])
        low = rng.standard_normal((self.num_classes, 3, self.PATTERN_RES, self.PATTERN_RES))
        self._patterns_low = torch.from_numpy(low.astype(np.float32))
        # Labels: balanced and deterministic; the permutation spreads the classes over indices.
        label_rng = np.random.default_rng([self.seed, self._SPLIT_IDS[split], 0])
        labels = np.arange(self.num_samples) % self.num_classes
        self.targets: list[int] = label_rng.permutation(labels).tolist()
        self._patterns: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.num_samples

    def _upsample(self, low: torch.Tensor, size: int) -> torch.Tensor:
        """Bilinear upsampling, normalised to zero mean and unit std per channel."""
        field = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
        field = field - field.mean(dim=(-2, -1), keepdim=True)
        return field / field.std(dim=(-2, -1), keepdim=True).clamp_min(1e-6)

    def _class_pattern(self, label: int) -> torch.Tensor:
        # Rendered once per process (lazily, so workers do it themselves) if it stays small;
        # with many classes at 224 px it is re-rendered per item instead (a few hundred us).
        if self._patterns is None:
            nbytes = self.num_classes * 3 * self._canvas**2 * 4
            if nbytes > 64 * 2**20:
                return self._upsample(self._patterns_low[label : label + 1], self._canvas)[0]
            self._patterns = self._upsample(self._patterns_low, self._canvas)
        return self._patterns[label]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        label = self.targets[index]
        rng = np.random.default_rng([self.seed, self._SPLIT_IDS[self.split], 1, index])
        size, shift = self.image_size, self.max_shift
        dy, dx = rng.integers(0, 2 * shift + 1, size=2)
        contrast = rng.uniform(*self.CONTRAST_RANGE)
        clutter_low = rng.standard_normal((1, 3, self.CLUTTER_RES, self.CLUTTER_RES))
        noise = rng.standard_normal((3, size, size), dtype=np.float32)

        pattern = self._class_pattern(label)[:, dy : dy + size, dx : dx + size]
        clutter = self._upsample(torch.from_numpy(clutter_low.astype(np.float32)), size)[0]
        image = contrast * pattern + self.CLUTTER_STD * clutter
        image = image + self.noise * torch.from_numpy(noise)
        return image.contiguous(), label

    def __repr__(self) -> str:
        return (
            f"SyntheticDataset(split={self.split}, n={self.num_samples}, "
            f"classes={self.num_classes}, size={self.image_size}, seed={self.seed})"
        )


def build_synthetic(cfg: Any) -> DataBundle:
    num_classes = int(getattr(cfg, "num_classes", 10))
    image_size = int(getattr(cfg, "image_size", 32))
    common = dict(
        num_classes=num_classes,
        image_size=image_size,
        seed=int(getattr(cfg, "seed", 0)),
        noise=float(getattr(cfg, "noise", 1.0)),
    )
    train = SyntheticDataset(int(getattr(cfg, "num_train", 10000)), split="train", **common)
    val = SyntheticDataset(int(getattr(cfg, "num_val", 2000)), split="val", **common)
    return DataBundle(train, val, num_classes, image_size, "synthetic")


# ---- CIFAR ---------------------------------------------------------------------------------
# What a CIFAR file may name: numpy's array and dtype and how they rebuild (numpy 1's and 2's
# module names; protocol 5's buffers), and the codec a Python 3 pickle of bytes calls.
_CIFAR_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "scalar"),  # (a label written as a numpy integer)
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _CifarUnpickler(pickle.Unpickler):
    """CIFAR's files are pickles: loaded as pickle does, one may call any function it names (a
    folder from elsewhere runs its code). This one names only what CIFAR's files hold."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CIFAR_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which no CIFAR file holds (only numpy arrays, lists, "
            "numbers and strings): not loaded"
        )


def read_cifar_file(path: str) -> Any:
    """A CIFAR batch or meta file (Python 2 pickles: str as latin-1), code it names never run."""
    with open(path, "rb") as f:
        try:
            return _CifarUnpickler(f, encoding="latin1").load()
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(f"{os.path.basename(path)}: {exc}") from None


def _class_index(label: Any, classes: int) -> bool:
    """Whether `label` is an integer (Python's or numpy's, not a bool) in [0, classes)."""
    integer = isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_))
    return integer and 0 <= label < classes


class _PresenceCheck:
    """Accept any dataset in the real on-disk format, not only the byte-exact original, and read
    it without running what it names.

    torchvision md5s every extracted file (`_check_integrity`, `_load_meta`), so a small dataset
    written in the same format (tests, subsets) is refused as "corrupted"; here the files only have
    to exist. Downloads lose nothing: `download()` still checks the archive's md5 before extracting.
    torchvision unpickles the files as they are; here `read_cifar_file` reads them, and what they
    hold is checked (uint8 images of 3x32x32, one integer label each, within the classes)."""

    def __init__(
        self, root: str, train: bool = True, transform: Any = None, download: bool = False
    ):
        from torchvision.datasets.vision import VisionDataset

        VisionDataset.__init__(self, root, transform=transform)
        self.train = train
        if download:
            self.download()
        entries = [
            read_cifar_file(self._path(name))
            for name, _ in (self.train_list if train else self.test_list)
        ]
        self._load_meta()
        self.data = np.vstack([e["data"] for e in entries]).reshape(-1, 3, 32, 32)
        self.data = self.data.transpose((0, 2, 3, 1))  # (N, H, W, C), as torchvision keeps it
        self.targets = [t for e in entries for t in e.get("labels", e.get("fine_labels", []))]
        self._check_contents()

    def _check_contents(self) -> None:
        if self.data.dtype != np.uint8:
            raise ValueError(f"its images are {self.data.dtype}, not uint8")
        if len(self.targets) != len(self.data):
            raise ValueError(f"{len(self.data)} images but {len(self.targets)} labels")
        bad = [t for t in self.targets if not _class_index(t, len(self.classes))]
        if bad:
            raise ValueError(
                f"{len(bad)} labels are not class indices 0-{len(self.classes) - 1} "
                f"(the first: {bad[0]!r})"
            )
        self.targets = [int(t) for t in self.targets]

    def _path(self, name: str) -> str:
        return os.path.join(self.root, self.base_folder, name)

    def _check_integrity(self) -> bool:
        return not missing_cifar_files(type(self), self.root)

    def _load_meta(self) -> None:
        self.classes = read_cifar_file(self._path(self.meta["filename"]))[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


@functools.cache
def _checked(name: str) -> type:
    """torchvision's CIFAR class with the presence check; torchvision (over a second to import:
    it loads its models, which load torch._dynamo) is imported only by runs that read CIFAR."""
    from torchvision.datasets import CIFAR10, CIFAR100

    base = {"CheckedCIFAR10": CIFAR10, "CheckedCIFAR100": CIFAR100}[name]
    return type(name, (_PresenceCheck, base), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    if name in ("CheckedCIFAR10", "CheckedCIFAR100"):
        return _checked(name)
    if name == "VisibleImageFolder":
        return _image_folder()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def missing_cifar_files(cls: type, root: str) -> list[str]:
    names = [name for name, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return [n for n in names if not os.path.isfile(os.path.join(root, cls.base_folder, n))]


def _check_root(cfg: Any) -> str:
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


def _refuse_missing(name: str, cls: type, root: str, download_error: Optional[str]) -> None:
    """Raise DataError where `root` lacks a file of the CIFAR set `cls` (`download_error`: why
    the download failed, where one was tried), naming the files and what to change."""
    missing = missing_cifar_files(cls, root)
    if not missing:
        return
    folder = os.path.join(root, cls.base_folder)
    if download_error:  # asking for data.download=true again would not help
        why = f"downloading {cls.url} failed ({download_error})"
        fixes = (
            f"point data.root at a folder that already contains {cls.base_folder} "
            f"(copied from a machine with network), or use data=synthetic"
        )
    else:
        why = "data.download is false"
        fixes = (
            f"point data.root at the folder that contains {cls.base_folder}, "
            f"set data.download=true (needs network), or use data=synthetic"
        )
    raise DataError(
        f"{name} not found under data.root={root}: expected {folder} "
        f"(missing: {', '.join(missing)}); {why}. To fix: {fixes}."
    )


def check_cifar(cfg: Any) -> None:
    """The plan's check of a CIFAR set: its files, where they are not to be downloaded, are all
    there before anything is built or tracked (a download is tried when the data is built)."""
    root = _check_root(cfg)
    if not bool(getattr(cfg, "download", False)):
        name = str(cfg.name)
        _refuse_missing(name, _checked(_CLASS_OF[name]), root, None)


_CLASS_OF = {"cifar10": "CheckedCIFAR10", "cifar100": "CheckedCIFAR100"}


def build_cifar(cfg: Any) -> DataBundle:
    name = str(cfg.name)
    root = _check_root(cfg)
    from torchvision import transforms as T

    cls = _checked(_CLASS_OF[name])
    mean, std = (CIFAR10_MEAN, CIFAR10_STD) if name == "cifar10" else (CIFAR100_MEAN, CIFAR100_STD)
    image_size = int(getattr(cfg, "image_size", 32))
    download = bool(getattr(cfg, "download", False))

    resize = [T.Resize(image_size)] if image_size != 32 else []
    tail = resize + [T.ToTensor(), T.Normalize(mean, std)]
    augment = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    train_tf = T.Compose((augment if getattr(cfg, "augment", True) else []) + tail)
    val_tf = T.Compose(list(tail))

    download_error = None
    if download and missing_cifar_files(cls, root):
        try:  # torchvision checks the archive's md5 before extracting
            cls(root, train=True, download=True)
        except Exception as exc:  # URLError/OSError without network, RuntimeError on a bad md5
            download_error = f"{type(exc).__name__}: {exc}"
    _refuse_missing(name, cls, root, download_error)
    try:
        train = cls(root, train=True, transform=train_tf)
        val = cls(root, train=False, transform=val_tf)
    except (OSError, EOFError, KeyError, ValueError, TypeError, pickle.UnpicklingError) as exc:
        raise DataError(
            f"{name} under data.root={root} cannot be read ({type(exc).__name__}: {exc}); "
            f"delete {os.path.join(root, cls.base_folder)} and {_SUGGESTION}."
        ) from exc
    return DataBundle(train, val, len(train.classes), image_size, name)


# ---- ImageFolder ---------------------------------------------------------------------------
_SPLIT_KEYS = {"train_dir": "train", "val_dir": "val"}


def _has_image(folder: str) -> bool:
    """Whether `folder` holds an image ImageFolder would read, at any depth (links followed)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    for _, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not options.hidden(d)]
        if any(_is_image(name, IMG_EXTENSIONS) for name in files):
            return True
    return False


def _is_image(name: str, extensions: tuple[str, ...]) -> bool:
    return not options.hidden(os.path.basename(name)) and name.lower().endswith(extensions)


def check_imagefolder(cfg: Any) -> dict[str, str]:
    """The plan's check of an ImageFolder tree, before anything is built or tracked: the root,
    its train and val folders, their class folders (hidden ones are not classes), the same in
    both, each with an image, and `data.num_classes` where set. Returns the splits' folders by
    key (train_dir, val_dir). Raises DataError (ConfigError for num_classes) naming what to fix."""
    root = _check_root(cfg)
    if not os.path.isdir(root):
        raise DataError(
            f"data.root={root} does not exist (expected {root}/<split>/<class>/<image>)"
        )
    paths, classes = {}, {}
    for key, default in _SPLIT_KEYS.items():
        sub = str(getattr(cfg, key, default))
        path = paths[key] = os.path.join(root, sub)
        if not os.path.isdir(path):
            raise DataError(
                f"data.root={root} has no folder {sub!r} (expected {path}/<class>/<image>); "
                f"fix data.root or data.{key}"
            )
        try:
            classes[key] = image_classes(path)
        except OSError as exc:
            raise DataError(f"data.root={root}: cannot read {path}: {exc}") from exc
        if not classes[key]:
            raise DataError(
                f"data.root={root}: {path} has no class folders (expected {path}/<class>/<image>)"
            )
        empty = [c for c in classes[key] if not _has_image(os.path.join(path, c))]
        if empty:
            from torchvision.datasets.folder import IMG_EXTENSIONS

            raise DataError(
                f"data.root={root}: no image in {len(empty)} class folder(s) of {path}: "
                f"{', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''} (an image is a "
                f"file ending {', '.join(IMG_EXTENSIONS)}; hidden files are left out); add "
                "images or remove the folder"
            )
    train, val = classes["train_dir"], classes["val_dir"]
    if train != val:
        only_train = sorted(set(train) - set(val))
        only_val = sorted(set(val) - set(train))
        raise DataError(
            f"data.root={root}: train and val class folders differ "
            f"(only in train: {only_train or '-'}; only in val: {only_val or '-'})"
        )
    wanted = getattr(cfg, "num_classes", None)
    if wanted is not None and int(wanted) != len(train):
        raise ConfigError(
            "data.num_classes",
            f"is {wanted} but data.root={root} has {len(train)} class folders",
            allowed=f"{len(train)} or null",
        )
    return paths


@functools.cache
def _image_folder() -> type:
    """torchvision's ImageFolder whose classes and images leave hidden files and folders out
    (`runner.config.options.hidden`); torchvision is imported only by runs that read images."""
    from torchvision.datasets import ImageFolder

    def find_classes(self: Any, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = image_classes(directory)
        return classes, {name: index for index, name in enumerate(classes)}

    return type(
        "VisibleImageFolder", (ImageFolder,), {"__module__": __name__, "find_classes": find_classes}
    )


def build_imagefolder(cfg: Any) -> DataBundle:
    paths = check_imagefolder(cfg)
    root = _check_root(cfg)
    from torchvision import transforms as T
    from torchvision.datasets.folder import IMG_EXTENSIONS

    image_size = int(getattr(cfg, "image_size", 224))
    norm = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    resize = [T.Resize(int(image_size * 256 / 224)), T.CenterCrop(image_size)]
    if getattr(cfg, "augment", True):
        train_tf = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()] + norm)
    else:
        train_tf = T.Compose(resize + norm)
    val_tf = T.Compose(resize + norm)

    splits = {}
    for key, tf in (("train_dir", train_tf), ("val_dir", val_tf)):
        path = paths[key]
        try:
            check_folders_once(path, root)
            splits[key] = _image_folder()(
                path,
                transform=tf,
                loader=read_image,
                is_valid_file=functools.partial(_is_image, extensions=IMG_EXTENSIONS),
            )
        except (FileNotFoundError, OSError) as exc:
            raise DataError(
                f"data.root={root}: cannot read {path} as an ImageFolder: {exc}"
            ) from exc
    train, val = splits["train_dir"], splits["val_dir"]
    say_if_one_split(("data.train_dir", paths["train_dir"]), ("data.val_dir", paths["val_dir"]))
    return DataBundle(train, val, len(train.classes), image_size, "imagefolder")


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


def check_folders_once(path: str, root: str) -> None:
    """Every folder under `path` reached once: torchvision's ImageFolder follows links to
    folders, so a link back to a folder above it (a loop) or a second link to one folder would
    count its images many times over (a loop: until the path is too long), silently. Raises
    DataError naming the link."""
    seen: dict[str, str] = {}
    stack = [path]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            raise DataError(
                f"data.root={root}: {seen[real]} and {folder} are one folder, {real} (a link to "
                "a folder read already: a loop, or a second link to it), so its images would "
                "count more than once; remove the link"
            )
        seen[real] = folder
        try:
            with os.scandir(folder) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=True))
        except OSError:
            continue  # (unreadable: ImageFolder says what it cannot read)


def read_image(path: str) -> Any:
    """An ImageFolder's sample as torchvision reads it (PIL, RGB), where a file that is not a
    readable image (corrupted, truncated, empty, not an image, a decompression bomb, gone) stops
    the run naming it (`UnreadableFile`), never a sample made of it nor a traceback from PIL."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # (PIL's UnidentifiedImageError and "image file is truncated" are OSErrors; a broken
        # chunk can be a SyntaxError or a ValueError)
        raise UnreadableFile(
            f"data.root: {path} is not a readable image ({type(exc).__name__}: {exc}); "
            "remove or replace the file"
        ) from None


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
