"""runner.components.data: CIFAR and ImageFolder datasets in their real on-disk formats, synthetic
data,
loaders. Everything is written into tmp_path; nothing is downloaded (the download-failure test
points torchvision at a closed port on this machine)."""

from __future__ import annotations

import os
import pickle
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from runner.components.data import DataBundle, build_datasets, build_target
from runner.components.images.cifar import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    CheckedCIFAR10,
)
from runner.components.loaders import build_loaders, shutdown_workers
from runner.components.models import build_model
from runner.config import CifarConfig, ImageFolderConfig, SyntheticConfig, TinyModelConfig, options
from runner.errors import ConfigError, DataError
from tests.helpers.cifar import Py2Str, dump_py2, make_batch, write_cifar10
from tests.helpers.runs import REPO


# ---- writing CIFAR in the real format ------------------------------------------------------
def write_cifar100(root, n_train=12, n_test=5):
    rng = np.random.default_rng(100)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    train = make_batch(rng, n_train, 100, b"fine_labels", b"training batch 1 of 1")
    test = make_batch(rng, n_test, 100, b"fine_labels", b"testing batch 1 of 1")
    for batch in (train, test):
        batch[Py2Str(b"coarse_labels")] = [label // 5 for label in batch[Py2Str(b"fine_labels")]]
    dump_py2(train, folder / "train")
    dump_py2(test, folder / "test")
    dump_py2(
        {
            Py2Str(b"fine_label_names"): [Py2Str(b"class_%02d" % i) for i in range(100)],
            Py2Str(b"coarse_label_names"): [Py2Str(b"super_%02d" % i) for i in range(20)],
        },
        folder / "meta",
    )
    return train, test


def cifar_cfg(name, root, download=False, **kw):
    return OmegaConf.structured(CifarConfig(name=name, root=str(root), download=download, **kw))


def expected_image(row, mean, std):
    """What ToTensor + Normalize must give for one CIFAR row (R, G, B planes of 32x32 bytes)."""
    planes = torch.from_numpy(row.astype(np.float32)).view(3, 32, 32) / 255.0
    return (planes - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


# ---- CIFAR ---------------------------------------------------------------------------------
def test_written_files_are_in_the_original_format(tmp_path):
    write_cifar10(tmp_path)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="bytes")  # how the CIFAR web page reads it
    assert {b"data", b"labels", b"batch_label", b"filenames"} <= set(entry)
    assert entry[b"data"].dtype == np.uint8 and entry[b"data"].shape == (4, 3072)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        assert "data" in pickle.load(f, encoding="latin1")  # how torchvision reads it


def test_cifar10_loads_real_format(tmp_path):
    train_batches, test_batch = write_cifar10(tmp_path)
    bundle = build_datasets(cifar_cfg("cifar10", tmp_path, augment=False))
    assert isinstance(bundle, DataBundle)
    assert (bundle.name, bundle.num_classes, bundle.image_size) == ("cifar10", 10, 32)
    assert len(bundle.train) == 20 and len(bundle.val) == 6
    assert bundle.train.classes[:2] == ["airplane", "automobile"]

    train_rows = np.vstack([b[b"data"] for b in train_batches])
    train_labels = [y for b in train_batches for y in b[b"labels"]]
    for i in (0, 7, 19):  # across batch files
        image, label = bundle.train[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert label == train_labels[i]
        torch.testing.assert_close(image, expected_image(train_rows[i], CIFAR10_MEAN, CIFAR10_STD))
    for i in range(6):
        image, label = bundle.val[i]
        assert label == test_batch[b"labels"][i]
        expected = expected_image(test_batch[b"data"][i], CIFAR10_MEAN, CIFAR10_STD)
        torch.testing.assert_close(image, expected)


def test_cifar10_augmentation_keeps_shape_and_val_is_deterministic(tmp_path):
    _, test_batch = write_cifar10(tmp_path)
    bundle = build_datasets(cifar_cfg("cifar10", tmp_path, augment=True))
    copy = pickle.loads(pickle.dumps(bundle.train))  # what "spawn" DataLoader workers receive
    assert copy.targets == bundle.train.targets
    image, _ = bundle.train[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    expected = expected_image(test_batch[b"data"][0], CIFAR10_MEAN, CIFAR10_STD)
    torch.testing.assert_close(bundle.val[0][0], expected)


def test_cifar100_loads_real_format(tmp_path):
    train, test = write_cifar100(tmp_path)
    bundle = build_datasets(cifar_cfg("cifar100", tmp_path, augment=False))
    assert (bundle.name, bundle.num_classes) == ("cifar100", 100)
    assert len(bundle.train) == 12 and len(bundle.val) == 5
    assert bundle.train.classes[0] == "class_00"
    for split, batch in ((bundle.train, train), (bundle.val, test)):
        for i in range(len(split)):
            image, label = split[i]
            assert label == batch[b"fine_labels"][i]
            expected = expected_image(batch[b"data"][i], CIFAR100_MEAN, CIFAR100_STD)
            torch.testing.assert_close(image, expected)


def test_missing_cifar_names_root_and_alternatives(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(DataError) as info:
        build_datasets(cifar_cfg("cifar10", root))
    message = str(info.value)
    assert "data.root" in message and str(root) in message
    assert "cifar-10-batches-py" in message
    assert "data.download=true" in message and "data=synthetic" in message


def test_troubleshooting_quotes_the_real_missing_cifar_message(tmp_path):
    with pytest.raises(DataError) as info:
        build_datasets(cifar_cfg("cifar10", tmp_path / "nowhere"))
    message = str(info.value)
    head = message[: message.index("data.root=") + len("data.root=")]
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    assert f"**`{head}...`**" in page, head


def test_failed_download_says_so_and_does_not_suggest_downloading(tmp_path, monkeypatch):
    """A real download attempt that fails: torchvision fetches from a closed port on this host
    (port 9, discard, refuses the connection), as it would fail without network."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    url = "http://127.0.0.1:9/cifar-10-python.tar.gz"
    monkeypatch.setattr(CheckedCIFAR10, "url", url)
    root = tmp_path / "data"
    with pytest.raises(DataError) as info:
        build_datasets(cifar_cfg("cifar10", root, download=True))
    message = str(info.value)
    assert f"downloading {url} failed (URLError:" in message
    assert f"data.root={root}" in message and "data=synthetic" in message
    assert "cifar-10-batches-py" in message
    assert "data.download=true" not in message  # it was true: repeating it would not help


class _Opens:
    """A pickle that, loaded as pickle loads it, creates the file it names (any call would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("file", ["data_batch_2", "batches.meta", "test_batch"])
def test_a_cifar_file_that_names_code_is_refused_without_running_it(file, tmp_path):
    """CIFAR's files are pickles: torchvision loads them as they are, so a dataset folder from
    elsewhere ran any call its files named. Only numpy arrays, lists, numbers and strings load."""
    write_cifar10(tmp_path)
    marker = tmp_path / "ran"
    with open(tmp_path / "cifar-10-batches-py" / file, "wb") as f:
        pickle.dump({"data": _Opens(marker), "labels": [], "label_names": _Opens(marker)}, f)
    with pytest.raises(DataError) as refused:
        build_datasets(cifar_cfg("cifar10", tmp_path))
    said = str(refused.value)
    assert f"(UnpicklingError: {file}: it names io.open, which no CIFAR file holds" in said
    assert "cifar-10-batches-py" in said and not marker.exists()


@pytest.mark.parametrize(
    "labels, said",
    [
        ([0, 1, 12, 3], "1 labels are not class indices 0-9 (the first: 12)"),
        ([0, 1, -1, 3], "(the first: -1)"),
        ([0, 1, 2.5, 3], "(the first: 2.5)"),
        ([0, 1, 2], "20 images but 19 labels"),
        ([0, True, 2, 3], "(the first: True)"),
    ],
)
def test_cifar_labels_that_are_no_class_are_refused_before_training(labels, said, tmp_path):
    """A label out of range failed at the step that met it (a CUDA device-side assert on a GPU);
    a missing one shifted every later image's label."""
    write_cifar10(tmp_path)
    batch = make_batch(np.random.default_rng(0), 4, 10, b"labels", b"training batch 1 of 5")
    batch[Py2Str(b"labels")] = labels
    dump_py2(batch, tmp_path / "cifar-10-batches-py" / "data_batch_1")
    with pytest.raises(DataError, match="cannot be read") as refused:
        build_datasets(cifar_cfg("cifar10", tmp_path))
    assert said in str(refused.value)


def test_cifar_written_by_python_3_loads_too(tmp_path):
    """Files pickled by Python 3 and numpy 2 (protocol 5: numpy's buffers) read as the originals."""

    def plain(obj):  # (Python 3's str: keys and names)
        if isinstance(obj, Py2Str):
            return bytes(obj).decode("latin1")
        if isinstance(obj, dict):
            return {plain(k): plain(v) for k, v in obj.items()}
        return [plain(x) for x in obj] if isinstance(obj, list) else obj

    def dump(obj, path):
        with open(path, "wb") as f:
            pickle.dump(plain(obj), f, protocol=5)

    train, _ = write_cifar10(tmp_path, dump=dump)
    first = make_batch(np.random.default_rng(0), 4, 10, b"labels", b"training batch 1 of 5")
    first[Py2Str(b"labels")] = list(np.array(first[Py2Str(b"labels")]))  # (numpy integers)
    dump(first, tmp_path / "cifar-10-batches-py" / "data_batch_1")
    bundle = build_datasets(cifar_cfg("cifar10", tmp_path, augment=False))
    assert len(bundle.train) == 20 and bundle.train.targets[:4] == first[b"labels"]
    assert bundle.train.targets[4:8] == train[1][b"labels"]
    assert all(type(label) is int for label in bundle.train.targets)


def test_incomplete_cifar_lists_missing_files(tmp_path):
    write_cifar10(tmp_path)
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(DataError, match="data_batch_3"):
        build_datasets(cifar_cfg("cifar10", tmp_path))


def test_cifar100_missing_names_its_folder(tmp_path):
    write_cifar10(tmp_path)  # the wrong dataset is there
    with pytest.raises(DataError, match="cifar-100-python"):
        build_datasets(cifar_cfg("cifar100", tmp_path))


def test_root_that_is_a_file(tmp_path):
    path = tmp_path / "data.tar"
    path.write_bytes(b"not a folder")
    with pytest.raises(DataError, match="data.root"):
        build_datasets(cifar_cfg("cifar10", path))


def test_unknown_dataset_name():
    with pytest.raises(ConfigError, match="data.name"):
        build_datasets(OmegaConf.create({"name": "mnist"}))


# ---- data of one's own (data._target_) ----------------------------------------------------------
class _Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.item


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.zeros(3, 4, 4), 0


def loaders_pair():
    data = _Items((torch.zeros(3, 4, 4), 0))
    return torch.utils.data.DataLoader(data), torch.utils.data.DataLoader(data)


def streams_pair():
    return _Stream(), _Stream()


def dicts_pair():
    return _Items({"image": torch.zeros(3, 4, 4), "label": 0}), _Items({"image": 0, "label": 0})


def numpy_pair():
    item = (np.zeros((3, 4, 4), dtype=np.float32), np.int64(0))
    return _Items(item), _Items(item)


def pil_pair():
    item = (Image.new("RGB", (4, 4)), 0)
    return _Items(item), _Items(item)


def triples_pair():
    return _Items((torch.zeros(3, 4, 4), 0, 7)), _Items((torch.zeros(3, 4, 4), 0, 7))


@pytest.mark.parametrize(
    "target,needle",
    [
        ("loaders_pair", "returned a pair of DataLoader: return their datasets"),
        ("streams_pair", "returned a pair of _Stream, iterable datasets: they have no length"),
        ("dicts_pair", "yields a dict (keys image, label), not an (input tensor, target) pair"),
        ("numpy_pair", "yields a pair whose input is a numpy.ndarray (torch.from_numpy(x))"),
        ("pil_pair", "input is a PIL.Image.Image (torchvision.transforms.ToTensor()(x): floats"),
        ("triples_pair", "yields a tuple of 3 items, not an (input tensor, target) pair"),
    ],
)
def test_data_of_ones_own_in_another_shape_is_named_as_it_is(target, needle):
    cfg = OmegaConf.create(
        {"name": "custom", "_target_": f"tests.unit.test_data.{target}", "num_classes": 2}
    )
    with pytest.raises(ConfigError) as bad:
        build_target(cfg)
    assert bad.value.key == "data._target_" and needle in str(bad.value)


# ---- ImageFolder ---------------------------------------------------------------------------
def write_image_folder(root, classes=("cat", "dog", "fish"), per_class=None, size=(40, 30)):
    per_class = per_class or {"train": 3, "val": 2}
    rng = np.random.default_rng(0)
    for split, n in per_class.items():
        for cls in classes:
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def folder_cfg(root, **kw):
    return OmegaConf.structured(ImageFolderConfig(name="imagefolder", root=str(root), **kw))


@pytest.mark.parametrize("augment", [True, False])
def test_imagefolder(tmp_path, augment):
    write_image_folder(tmp_path)
    bundle = build_datasets(folder_cfg(tmp_path, image_size=32, augment=augment))
    assert (bundle.name, bundle.num_classes, bundle.image_size) == ("imagefolder", 3, 32)
    assert bundle.train.classes == ["cat", "dog", "fish"]
    assert len(bundle.train) == 9 and len(bundle.val) == 6
    for split in (bundle.train, bundle.val):
        image, label = split[len(split) - 1]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert label == 2


def test_imagefolder_whose_val_is_its_train_folder_says_so(tmp_path, caplog):
    write_image_folder(tmp_path)
    with caplog.at_level("WARNING", logger="runner.components.data"):
        build_datasets(folder_cfg(tmp_path, image_size=32))
    assert "validation measures the training data" not in caplog.text
    with caplog.at_level("WARNING", logger="runner.components.data"):
        bundle = build_datasets(folder_cfg(tmp_path, image_size=32, val_dir="./train"))
    assert len(bundle.val) == len(bundle.train) == 9
    assert (
        f"data.train_dir and data.val_dir are the same ({tmp_path / 'train'}): validation "
        "measures the training data" in caplog.text
    )


def test_imagefolder_num_classes(tmp_path):
    write_image_folder(tmp_path)
    assert build_datasets(folder_cfg(tmp_path, image_size=32, num_classes=3)).num_classes == 3
    with pytest.raises(ConfigError, match="data.num_classes"):
        build_datasets(folder_cfg(tmp_path, image_size=32, num_classes=5))


def test_imagefolder_missing_val(tmp_path):
    write_image_folder(tmp_path, per_class={"train": 1})
    with pytest.raises(DataError) as info:
        build_datasets(folder_cfg(tmp_path, image_size=32))
    assert "data.root" in str(info.value) and "'val'" in str(info.value)


def test_imagefolder_missing_root(tmp_path):
    with pytest.raises(DataError, match="data.root"):
        build_datasets(folder_cfg(tmp_path / "absent"))


def test_imagefolder_root_not_set():
    with pytest.raises(DataError, match="data.root is not set"):
        build_datasets(OmegaConf.structured(ImageFolderConfig(name="imagefolder")))  # root: ???


@pytest.mark.parametrize(
    "link, target",
    [
        ("train/cat/loop", ".."),  # back to train/: a loop, followed until the path is too long
        ("train/cat/again", "../dog"),  # a second way into dog/: its images counted twice
    ],
)
def test_an_imagefolder_that_reaches_a_folder_twice_is_refused(tmp_path, link, target):
    """torchvision's ImageFolder follows links to folders: a loop made 12 images 492 samples,
    silently. A link to a folder elsewhere (a dataset assembled from links) is fine."""
    write_image_folder(tmp_path / "data")
    write_image_folder(tmp_path / "store", classes=("eel",), per_class={"train": 2, "val": 1})
    for split in ("train", "val"):  # each split's class eel/: a link into the shared store
        (tmp_path / "data" / split / "eel").symlink_to(tmp_path / "store" / split / "eel")
    bundle = build_datasets(folder_cfg(tmp_path / "data", image_size=32))
    assert len(bundle.train) == 9 + 2 and bundle.train.classes == ["cat", "dog", "eel", "fish"]
    (tmp_path / "data" / link).symlink_to(target)
    with pytest.raises(DataError) as refused:
        build_datasets(folder_cfg(tmp_path / "data", image_size=32))
    said = str(refused.value)
    assert f" are one folder, {(tmp_path / 'data' / link).resolve()} " in said
    assert str(tmp_path / "data" / link) in said and said.endswith("; remove the link")


def test_hidden_files_and_folders_are_not_data(tmp_path):
    """What opening a dataset in Jupyter or copying it from a Mac leaves beside the images:
    `.ipynb_checkpoints/` (here with an image in it), `._<name>.png` resource forks (not images,
    with an image's ending) and `.DS_Store`. All are left out: torchvision took the folder for a
    class (a 4th class, or a refusal: "Found no valid file") and a fork for an image."""
    write_image_folder(tmp_path)
    fork = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        "
    for split in ("train", "val"):
        (tmp_path / split / ".ipynb_checkpoints").mkdir()
        shutil.copy(tmp_path / split / "cat" / "0.png", tmp_path / split / ".ipynb_checkpoints")
        for cls in ("cat", "dog", "fish"):
            (tmp_path / split / cls / "._0.png").write_bytes(fork)
            (tmp_path / split / cls / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    bundle = build_datasets(folder_cfg(tmp_path, image_size=32))
    assert bundle.train.classes == ["cat", "dog", "fish"] and bundle.num_classes == 3
    assert len(bundle.train) == 9 and len(bundle.val) == 6
    for split in (bundle.train, bundle.val):
        assert [split[i][1] for i in range(len(split))] == sorted(split.targets)  # all read
    assert options.spec_for("data", folder_cfg(tmp_path)).classes(folder_cfg(tmp_path)) == 3
    # a class whose only "images" are hidden has none: refused, naming it
    (tmp_path / "train" / "eel").mkdir()
    (tmp_path / "train" / "eel" / "._0.png").write_bytes(fork)
    with pytest.raises(DataError, match=r"no image in 1 class folder\(s\) of .*train: eel \("):
        build_datasets(folder_cfg(tmp_path, image_size=32))


def test_imagefolder_class_mismatch(tmp_path):
    write_image_folder(tmp_path, per_class={"train": 1})
    write_image_folder(tmp_path, classes=("cat", "dog"), per_class={"val": 1})
    with pytest.raises(DataError, match="fish"):
        build_datasets(folder_cfg(tmp_path, image_size=32))


@pytest.mark.parametrize(
    "bad",
    ["not an image", "truncated", "empty"],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreadable_image_stops_the_loader_naming_the_file(tmp_path, bad, workers):
    """A corrupted file among the images (not an image, a PNG cut short, an empty file): the
    loader stops with a DataError naming the file and what to do, in one line, whether the
    sample was read in the training process or in a worker (whose error torch rebuilds from a
    message holding the worker's traceback); never a tensor made of it."""
    write_image_folder(tmp_path)
    target = tmp_path / "train" / "dog" / "1.png"
    whole = target.read_bytes()
    target.write_bytes(
        {"not an image": b"garbage", "truncated": whole[: len(whole) // 2]}.get(bad, b"")
    )
    bundle = build_datasets(folder_cfg(tmp_path, image_size=32, augment=False))
    loader = torch.utils.data.DataLoader(
        bundle.train, batch_size=3, num_workers=workers, persistent_workers=workers > 0
    )
    try:
        with pytest.raises(DataError) as info:
            list(loader)
    finally:
        # as a run ends its workers: at once (left to the garbage collector, a failed loader's
        # workers took torch 5 s each to join, in whichever test came next)
        shutdown_workers(loader)
    message = str(info.value)
    assert message.startswith(f"data.root: {target} is not a readable image (")
    assert message.endswith("remove or replace the file") and "\n" not in message
    assert "Traceback" not in message and "Caught" not in message
    first, second = bundle.train[0], bundle.train[1]  # (the good files still read)
    assert first[0].shape == second[0].shape == (3, 32, 32)


# ---- synthetic -----------------------------------------------------------------------------
def synth_cfg(**kw):
    base = dict(name="synthetic", num_train=200, num_val=50, num_classes=10, image_size=32)
    base.update(kw)
    return OmegaConf.structured(SyntheticConfig(**base))


def test_synthetic_shapes_and_bundle():
    bundle = build_datasets(synth_cfg())
    assert (bundle.name, bundle.num_classes, bundle.image_size) == ("synthetic", 10, 32)
    assert len(bundle.train) == 200 and len(bundle.val) == 50
    image, label = bundle.train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert isinstance(label, int) and 0 <= label < 10


def test_synthetic_224_is_lazy():
    bundle = build_datasets(synth_cfg(image_size=224, num_train=100_000))
    for i in (0, 99_999):
        image, _ = bundle.train[i]
        assert image.shape == (3, 224, 224) and image.dtype == torch.float32


def test_synthetic_is_deterministic_per_seed_and_index():
    a, b = build_datasets(synth_cfg(seed=3)), build_datasets(synth_cfg(seed=3))
    later = b.train[17]  # fetched out of order: items must not depend on what came before
    for i in (0, 1, 17):
        assert torch.equal(a.train[i][0], b.train[i][0]) and a.train[i][1] == b.train[i][1]
    assert torch.equal(later[0], a.train[17][0])
    assert torch.equal(a.val[5][0], b.val[5][0])

    other = build_datasets(synth_cfg(seed=4))
    assert not torch.equal(a.train[0][0], other.train[0][0])
    assert a.train.targets != other.train.targets
    assert not torch.equal(a.train[0][0], a.val[0][0])  # train and val are different samples


def test_synthetic_same_items_in_worker_processes():
    bundle = build_datasets(synth_cfg(num_val=24))
    _, in_process = build_loaders(bundle, batch_size=8, num_workers=0, device_type="cpu", seed=0)
    _, in_workers = build_loaders(bundle, batch_size=8, num_workers=2, device_type="cpu", seed=0)
    for (x0, y0), (x1, y1) in zip(in_process, in_workers):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_a_batch_larger_than_the_training_set_is_said(caplog):
    """trainer.batch_size=128 on 40 samples trained one step an epoch without a word."""
    bundle = build_datasets(synth_cfg(num_train=40, num_val=8))
    with caplog.at_level("WARNING", logger="runner.components.loaders"):
        train, _ = build_loaders(bundle, batch_size=128, num_workers=0, device_type="cpu", seed=0)
        build_loaders(bundle, batch_size=40, num_workers=0, device_type="cpu", seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.batch_size=128 is more than the 40 training samples: each epoch is one step, "
        "of 40 samples"
    ]
    assert len(train) == 1


def test_synthetic_labels_are_balanced():
    bundle = build_datasets(synth_cfg(num_train=1000, num_val=95))
    assert Counter(bundle.train.targets) == {c: 100 for c in range(10)}
    counts = Counter(bundle.val[i][1] for i in range(len(bundle.val)))
    assert sorted(counts) == list(range(10)) and max(counts.values()) - min(counts.values()) <= 1
    assert bundle.train.targets[:10] != list(range(10))  # shuffled, not 0, 1, 2, ...


@pytest.fixture
def one_thread():
    """A tiny model gains nothing from intra-op threads, and on a busy 2-core machine their
    barriers can make it 10x slower; one thread keeps the test at about a second."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_synthetic_is_learnable_by_the_tiny_model(one_thread):
    torch.manual_seed(0)
    bundle = build_datasets(synth_cfg(image_size=16, num_train=3000, num_val=500))
    train, val = build_loaders(bundle, batch_size=64, num_workers=0, device_type="cpu", seed=0)
    model = build_model(OmegaConf.structured(TinyModelConfig(name="tiny")), 10, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    while len(losses) < 150:  # about 3 epochs
        for x, y in train:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == 150:
                break
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in val:
            correct += (model(x).argmax(1) == y).sum().item()
    accuracy = correct / len(bundle.val)
    assert accuracy > 0.5, accuracy  # chance is 0.1; about 0.85 is typical
    assert sum(losses[:10]) / 10 > 1.8  # not solved in the first few steps


# ---- loaders -------------------------------------------------------------------------------
def test_build_loaders_batches_and_flags():
    bundle = build_datasets(synth_cfg(num_train=20, num_val=10))
    train, val = build_loaders(bundle, batch_size=8, num_workers=0, device_type="cpu", seed=0)
    sizes = [x.shape[0] for x, _ in train]
    assert sizes == [8, 8, 4]  # drop_last=False
    x, y = next(iter(val))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (8,) and y.dtype == torch.int64
    assert torch.equal(y, torch.tensor(bundle.val.targets[:8]))  # val is not shuffled
    assert not train.pin_memory and not train.persistent_workers

    cuda_train, cuda_val = build_loaders(
        bundle, batch_size=8, num_workers=2, device_type="cuda", seed=0
    )
    assert cuda_train.pin_memory and cuda_val.pin_memory
    assert cuda_train.persistent_workers and cuda_train.num_workers == 2


def test_seeded_shuffle_is_reproducible():
    bundle = build_datasets(synth_cfg(num_train=64, num_val=8))

    def labels(seed):
        train, _ = build_loaders(bundle, batch_size=16, num_workers=0, device_type="cpu", seed=seed)
        return [torch.cat([y for _, y in train]).tolist() for _epoch in range(2)]

    first = labels(1)
    assert first == labels(1)
    assert first != labels(2)
    assert first[0] != bundle.train.targets  # shuffled
    assert sorted(first[0]) == sorted(bundle.train.targets)
