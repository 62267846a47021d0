"""An ImageFolder tree written in its real on-disk format: root/<split>/<class>/<i>.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_image_folder(
    root: Path, classes=("a", "b"), per_class=None, size: int = 48, seed: int = 0
) -> Path:
    """PNG files of random pixels, `per_class` ({split: images per class}) in each class
    folder; `root`, for data.root."""
    per_class = per_class or {"train": 16, "val": 4}
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root
