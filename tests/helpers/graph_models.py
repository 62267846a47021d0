"""A model for the whole-step CUDA graph tests (by `_target_`): what a replayed training step must
change as the eager step does, beside the weights and the optimizer state."""

from __future__ import annotations

import torch
from torch import nn


class DropoutCNN(nn.Module):
    """Two conv-BatchNorm-ReLU blocks, dropout on the feature maps and before the head, a linear
    head: BatchNorm's running statistics and batch counter move at every training step, and
    dropout draws new random masks at every step (from the default CUDA generator)."""

    def __init__(self, num_classes: int = 10, width: int = 16, p: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.Dropout2d(p),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(p),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
