"""`data=synthetic`: learnable images generated per item from a seed (`SyntheticDataset`), no
disk and no download, for tests, demos and benchmarks."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from runner.components.data import DataBundle


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
