"""`data=imagefolder`: an ImageFolder tree, root/<split>/<class>/<image>: the plan's check of the
tree (`check_imagefolder`), torchvision's ImageFolder with hidden files and folders left out
(`VisibleImageFolder`), each folder read once (`check_folders_once`) and each image read or
refused by name (`read_image`), and the builder (`build_imagefolder`)."""

from __future__ import annotations

import functools
import os
from typing import Any

from runner.components.data import DataBundle, data_root, say_if_one_split
from runner.config import options
from runner.config.options import image_classes
from runner.errors import ConfigError, DataError, UnreadableFile

# ImageNet's per-channel statistics (the values the literature normalises with).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
    root = data_root(cfg)
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
    root = data_root(cfg)
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


def __getattr__(name: str) -> Any:
    if name == "VisibleImageFolder":
        return _image_folder()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
