"""Models for the layer-plan tests (by `_target_`): one layer that overflows fp16."""

from __future__ import annotations

import torch
from torch import nn


class HotMLP(nn.Module):
    """An MLP over flattened images whose `hot` layer's outputs exceed fp16's max (65504): its
    weights are scaled up 300000x after init (the largest, 37500, still an fp16 number), and a
    LayerNorm brings the values back. Uniform fp16
    (O2) turns `hot`'s output into inf and every step overflows; keeping `hot` and `norm` (whose
    inputs are `hot`'s outputs) in fp32 trains."""

    def __init__(
        self, num_classes: int = 10, image_size: int = 8, width: int = 64, gain: float = 300000.0
    ):
        super().__init__()
        self.stem = nn.Linear(3 * image_size * image_size, width)
        self.hot = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)
        with torch.no_grad():
            self.hot.weight.mul_(gain)
            self.hot.bias.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x.flatten(1)))
        return self.head(self.norm(self.hot(x)))
