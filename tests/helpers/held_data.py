"""A dataset that stops a run at a chosen sample, so that a test kills it at a known point of its
training instead of after a guessed sleep (a third of an epoch of half a second overshot the
epoch on a loaded CI machine).

`HELD_DATA` (data=custom, its `_target_` this module's `held_datasets`); with
`AMP_TEST_HOLD_AFTER=N` in a process's environment its training set, at its N-th read in that
process, prints `HELD` (and N) and blocks until the process is killed; with `AMP_TEST_RELEASE`
naming a file as well, it blocks until that file exists and then goes on (a process started
where the file exists already does not stop: a resumed or requeued run trains through), so that
a test acts on a run held at a known step (a signal, a server taken away) and lets it go on.
With `AMP_TEST_BUSY_AT=N` (and `AMP_TEST_BUSY_S`, seconds), its N-th read prints `BUSY` and
then keeps the main thread inside one torch operation for about that long, as one long operation
of a slow step does (a convolution in emulated fp16 on a CPU): Python runs no signal handler
until it returns, then it prints `BUSY_DONE` and goes on. Without the variables it is an ordinary
dataset: the reference run and the resumed ones read the same samples, so histories compare.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

# the overrides that train on it
HELD_DATA = ["data=custom", f"data._target_={__name__}.held_datasets"]
HOLD_AFTER = "AMP_TEST_HOLD_AFTER"
RELEASE = "AMP_TEST_RELEASE"
HELD = "held after training sample"  # what a held process prints
HOLD_AT_MOST_S = 600.0  # a test that never kills it does not leave the process behind forever
BUSY_AT, BUSY_S = "AMP_TEST_BUSY_AT", "AMP_TEST_BUSY_S"
BUSY, BUSY_DONE = "busy in one long operation", "done with the long operation"
# a short run on it: 640 samples, batch 32 (20 steps an epoch), no loader workers, no progress bar
HELD_BATCH = 32
HELD_RUN = [
    "model=tiny",
    *HELD_DATA,
    "+data.num_train=640",
    f"trainer.batch_size={HELD_BATCH}",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
]


def hold_in_step(step: int, release: Path) -> dict[str, str]:
    """The environment that holds a `HELD_RUN` process at the first read of its training step
    `step` until the file `release` exists."""
    return {HOLD_AFTER: str((step - 1) * HELD_BATCH + 1), RELEASE: str(release)}


class HeldSamples(Dataset):
    """`n` 3 x size x size images of `num_classes` classes (a class's own pattern plus noise:
    learnable; the same patterns in every split, the samples drawn with `seed`), each read
    counted in this process."""

    def __init__(
        self,
        n: int,
        size: int,
        num_classes: int,
        seed: int,
        hold_after: int | None,
        release: Path | None = None,
        busy_at: int = 0,
    ):
        patterns = torch.randn(
            num_classes, 3, size, size, generator=torch.Generator().manual_seed(0)
        )
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, num_classes, (n,), generator=generator)
        self.x = patterns[self.y] + torch.randn(n, 3, size, size, generator=generator)
        self.classes = [str(c) for c in range(num_classes)]
        self.hold_after = hold_after
        self.release = release
        self.reads = 0
        self.busy_at = busy_at

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        self.reads += 1
        if self.reads == self.busy_at:
            busy(float(os.environ.get(BUSY_S, "5")))
        if self.reads == self.hold_after and not (self.release and self.release.exists()):
            print(f"{HELD} {self.reads}", flush=True)
            deadline = time.monotonic() + HOLD_AT_MOST_S
            while time.monotonic() < deadline:
                if self.release and self.release.exists():
                    return self.x[index], self.y[index]
                time.sleep(0.05 if self.release else HOLD_AT_MOST_S)
            raise RuntimeError(f"held {HOLD_AT_MOST_S:.0f} s and not killed (or released)")
        return self.x[index], self.y[index]


def busy(seconds: float) -> None:
    """About `seconds` inside one torch operation (a matrix product sized for it on this
    machine): torch lets go of the GIL there, as inside a real step's long convolution, and no
    bytecode runs until it returns, so Python runs no signal handler either; said before and
    after."""
    a = torch.randn(512, 512)
    start = time.perf_counter()
    torch.mm(a, a)
    took = max(time.perf_counter() - start, 1e-5)
    n = min(int(512 * (seconds / took) ** (1 / 3)), 8192)  # (the product's time: n cubed)
    a = torch.randn(n, n)
    print(BUSY, flush=True)
    torch.mm(a, a)
    print(BUSY_DONE, flush=True)


def held_datasets(
    num_train: int = 1536, num_val: int = 64, image_size: int = 16, num_classes: int = 10
):
    """(train, val); the training set holds at the read `AMP_TEST_HOLD_AFTER` names, if set
    (until the file `AMP_TEST_RELEASE` names exists, if that is set)."""
    hold, release = os.environ.get(HOLD_AFTER), os.environ.get(RELEASE)
    return (
        HeldSamples(
            num_train,
            image_size,
            num_classes,
            1,
            int(hold) if hold else None,
            Path(release) if release else None,
            int(os.environ.get(BUSY_AT, "0")),
        ),
        HeldSamples(num_val, image_size, num_classes, 2, None),
    )
