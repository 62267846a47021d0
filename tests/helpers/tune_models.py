"""Models for the tuning tests (by `_target_`)."""

from __future__ import annotations

import torch
from torch import nn


class LayoutBug(nn.Module):
    """A small CNN with a layout bug: it reads its input's memory as if it were contiguous
    (as_strided with the contiguous strides), so a channels_last input is scrambled and its
    loss differs from the contiguous one's."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.as_strided(x.shape, x.contiguous().stride())
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


class LayoutHog(nn.Module):
    """A small CNN that, given a channels_last input, asks the allocator for more memory than
    any machine has (as a layout that a model's kernels handle with a huge workspace would):
    the CPU allocator refuses, as it refuses a real request beyond the machine."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            torch.empty(2**62, dtype=torch.uint8)  # refused: no machine has 4 EiB
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))
