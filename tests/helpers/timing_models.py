"""A model and datasets with known costs (by `_target_`), for the step timer's end-to-end tests: a
classifier whose first training step sleeps, a dataset that sleeps for every sample."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset

# when each training forward of a SleepyFirstStep began (perf_counter), in this process
FORWARD_STARTS: list[float] = []


class SleepyFirstStep(nn.Module):
    """A linear classifier over flattened images whose first training forward sleeps `first_s`
    and every later one `later_s` (a first step's autotuning, then a steady step); the meta
    device's forwards (planning) and evaluation do not sleep."""

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 8,
        first_s: float = 3.0,
        later_s: float = 0.05,
    ):
        super().__init__()
        self.fc = nn.Linear(3 * image_size * image_size, num_classes)
        self.first_s, self.later_s = first_s, later_s
        FORWARD_STARTS.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.device.type != "meta":
            FORWARD_STARTS.append(time.perf_counter())
            time.sleep(self.first_s if len(FORWARD_STARTS) == 1 else self.later_s)
        return self.fc(x.flatten(1))


class SleepySamples(Dataset):
    """`n` random 3x8x8 images of 10 classes, each taking `sleep_s` to load."""

    def __init__(self, n: int, sleep_s: float):
        generator = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 3, 8, 8, generator=generator)
        self.y = torch.randint(0, 10, (n,), generator=generator)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        time.sleep(self.sleep_s)
        return self.x[index], self.y[index]


def sleepy_datasets(num_train: int = 160, num_val: int = 16, sleep_s: float = 0.004):
    """(train, val): a training set whose samples load slowly, a quick validation set."""
    return SleepySamples(num_train, sleep_s), SleepySamples(num_val, 0.0)
