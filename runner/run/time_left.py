"""How long a run has left, said at the end of each epoch's line ("about 42 min left, until
14:05"): the epochs still to train at the pace of the last one, its training, its validation and
its share of the last checkpoint's write (one every `trainer.checkpoint_every_n_epochs`). The
last epoch is the best guess of the next: the first one's warm-up (cuDNN's autotuning, the
loader's start) is not repeated, and a run resumed in the middle of an epoch has its part scaled
up to a whole one. A guess, said as one: rounded, and only where an epoch gave a pace."""

from __future__ import annotations

import math
import time
from typing import Optional

SAID_IN_SECONDS = 90.0  # a time under a minute and a half is said in seconds (and with no clock)


def epoch_seconds(
    train_s: float, val_s: float, save_s: float, batches_trained: int, batches: int
) -> float:
    """One whole epoch's seconds, from an epoch that trained `batches_trained` of its `batches`
    (fewer: resumed in its middle; its training time is scaled up to all of them)."""
    if batches_trained <= 0:
        return math.nan
    return train_s * batches / batches_trained + val_s + save_s


def duration(seconds: float) -> str:
    """Seconds as a person says them: "40 s", "12 min", "3 h 05 min", "2 d 4 h"."""
    seconds = max(0.0, seconds)
    if seconds < SAID_IN_SECONDS:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days} d {hours} h"


def took(seconds: float) -> str:
    """How long something took, as the run's last line says it: "10.4 s" under a minute and a
    half, then as `duration` ("3 h 05 min", not "11100.0 s")."""
    return f"{seconds:.1f} s" if seconds < SAID_IN_SECONDS else duration(seconds)


def time_left(per_epoch_s: float, epochs_left: int, now: Optional[float] = None) -> str:
    """The epoch line's last words: "  about 42 min left, until 14:05" (a date before the time
    where the end is on another day; no clock under a minute and a half: "  about 40 s left"),
    or "" where nothing is left or no pace is known."""
    if epochs_left <= 0 or not math.isfinite(per_epoch_s) or per_epoch_s <= 0:
        return ""
    now = time.time() if now is None else now
    seconds = per_epoch_s * epochs_left
    if seconds < SAID_IN_SECONDS:
        return f"  about {duration(seconds)} left"
    end = time.localtime(now + seconds)
    same_day = time.localtime(now)[:3] == end[:3]
    until = time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", end)
    return f"  about {duration(seconds)} left, until {until}"
