"""CIFAR written in its real on-disk format: Python 2 pickles, as the original archive holds them
(no download)."""

from __future__ import annotations

import pickle
import struct

import numpy as np


# ---- writing CIFAR in the real format ------------------------------------------------------
class Py2Str(bytes):
    """A Python 2 `str`: the type of every key and label name in the original CIFAR pickles."""


class Py2Pickler(pickle._Pickler):
    """Writes Py2Str as (SHORT_)BINSTRING, the opcode Python 2 used for str, so the files read
    exactly like the originals: str keys with encoding="latin1" (torchvision), bytes keys with
    encoding="bytes" (the b"data" of the CIFAR web page)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + bytes(obj))
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + bytes(obj))
        self.memoize(obj)

    dispatch[Py2Str] = save_py2str


def dump_py2(obj, path):
    with open(path, "wb") as f:
        Py2Pickler(f, protocol=2).dump(obj)


def make_batch(rng, n, num_classes, label_key, batch_label):
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = [int(x) for x in rng.integers(0, num_classes, size=n)]
    return {
        Py2Str(b"batch_label"): Py2Str(batch_label),
        Py2Str(label_key): labels,
        Py2Str(b"data"): data,
        Py2Str(b"filenames"): [Py2Str(b"img_%d.png" % i) for i in range(n)],
    }


def write_cifar10(root, n_per_batch=4, n_test=6, dump=dump_py2):
    rng = np.random.default_rng(10)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train = [
        make_batch(rng, n_per_batch, 10, b"labels", b"training batch %d of 5" % i)
        for i in range(1, 6)
    ]
    for i, batch in enumerate(train, start=1):
        dump(batch, folder / f"data_batch_{i}")
    test = make_batch(rng, n_test, 10, b"labels", b"testing batch 1 of 1")
    dump(test, folder / "test_batch")
    names = [
        Py2Str(n)
        for n in (
            b"airplane",
            b"automobile",
            b"bird",
            b"cat",
            b"deer",
            b"dog",
            b"frog",
            b"horse",
            b"ship",
            b"truck",
        )
    ]
    dump(
        {
            Py2Str(b"label_names"): names,
            Py2Str(b"num_cases_per_batch"): n_per_batch,
            Py2Str(b"num_vis"): 3072,
        },
        folder / "batches.meta",
    )
    return train, test
