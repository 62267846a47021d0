"""`data=cifar10` / `cifar100`: torchvision's CIFAR sets in their python-pickle format, read without
running what the files name and accepted in any subset written in that format
(`CheckedCIFAR10`, `CheckedCIFAR100`); the plan's check that the files are there
(`check_cifar`) and the builder (`build_cifar`)."""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any, Optional

import numpy as np

from runner.components.data import DataBundle, data_root
from runner.errors import DataError

# Per-channel statistics of the training sets (the values the literature normalises with).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

_SUGGESTION = "set data.download=true (needs network) or use data=synthetic"


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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def missing_cifar_files(cls: type, root: str) -> list[str]:
    names = [name for name, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return [n for n in names if not os.path.isfile(os.path.join(root, cls.base_folder, n))]


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
    root = data_root(cfg)
    if not bool(getattr(cfg, "download", False)):
        name = str(cfg.name)
        _refuse_missing(name, _checked(_CLASS_OF[name]), root, None)


_CLASS_OF = {"cifar10": "CheckedCIFAR10", "cifar100": "CheckedCIFAR100"}


def build_cifar(cfg: Any) -> DataBundle:
    name = str(cfg.name)
    root = data_root(cfg)
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
