"""Loss scaling: a fixed scale, or Apex's dynamic scale that backs off on overflow and grows back.

The scale lives on the host as a Python float: the engine reads the non-finite flag once per step
anyway, so updating the scale in Python costs no extra device sync, and multiplying the loss by a
Python float launches no host-to-device copy of its own. A static scale of exactly 1.0 needs no
pass over the gradients at all (`needs_check` is False).

Hysteresis (DeepSpeed's and Megatron-LM's `hysteresis`, with DeepSpeed's default
`consecutive_hysteresis=False`): a counter starts at `hysteresis` and every overflow decrements it;
the scale backs off only when the counter has reached 0, and then on every further overflow, until
the scale next grows (after `growth_interval` clean steps), which refills the counter. So
`hysteresis=2` tolerates one overflow per growth period without lowering the scale. An overflowing
step is always skipped, whatever the counter says. `hysteresis=1` (the default) is Apex's scaler:
every overflow backs off.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from runner.config.levels import SCALER_DEFAULTS
from runner.precision.state import local_shard

LossScaleSpec = Union[float, str]


class LossScaler:
    """One loss's scale. `loss_scale` is "dynamic" or a positive float (static)."""

    def __init__(
        self,
        loss_scale: LossScaleSpec = "dynamic",
        init_scale: float = SCALER_DEFAULTS["init_scale"],
        growth_factor: float = SCALER_DEFAULTS["growth_factor"],
        backoff_factor: float = SCALER_DEFAULTS["backoff_factor"],
        growth_interval: int = SCALER_DEFAULTS["growth_interval"],
        min_loss_scale: Optional[float] = SCALER_DEFAULTS["min_loss_scale"],
        max_loss_scale: float = SCALER_DEFAULTS["max_loss_scale"],
        hysteresis: int = SCALER_DEFAULTS["hysteresis"],
    ):
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic:
            loss_scale = float(loss_scale)
            if not math.isfinite(loss_scale) or loss_scale <= 0:
                raise ValueError(
                    f"loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}"
                )
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1:
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        if int(hysteresis) != hysteresis or hysteresis < 1:
            raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis!r}")
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        start = min(float(init_scale), self.max_loss_scale) if self.dynamic else loss_scale
        if self.dynamic and self.min_loss_scale is not None:
            start = max(start, self.min_loss_scale)
        self._scale: float = float(start)
        self._unskipped = 0  # clean steps since the last change of scale (Apex's name)
        self._hysteresis_left = self.hysteresis  # overflows still tolerated before a back-off

    @classmethod
    def from_properties(cls, properties: Any, **overrides: Any) -> LossScaler:
        """The scaler resolved `Properties` describe: `loss_scale` and every dynamic-scaling knob
        (init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_loss_scale,
        max_loss_scale). Keyword `overrides` replace single knobs (e.g. Apex's
        `amp.initialize(min_loss_scale=...)`)."""
        kwargs: dict[str, Any] = {
            name: getattr(properties, name) for name in SCALER_DEFAULTS if hasattr(properties, name)
        }
        kwargs.update(overrides)
        return cls(properties.loss_scale, **kwargs)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def needs_check(self) -> bool:
        """Whether gradients must be unscaled and checked: dynamic, or a static scale != 1."""
        return self.dynamic or self._scale != 1.0

    def unscale_(self, grads: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """Divide `grads` by the scale in place and flag non-finite values.

        Returns a one-element float tensor (non-zero: some gradient was inf/NaN) on the device of
        the first gradient, without a host sync; None when there is nothing to do (no gradients,
        or a static scale of 1.0, which needs no pass at all).
        """
        if not self.needs_check or not grads:
            return None
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            if g.is_sparse:
                g = g._values()  # scaling is linear: the stored values can be unscaled as they are
            else:  # a DTensor (a sharded run): this rank's shard; a plain tensor as it is
                g = local_shard(g)
            groups[(g.device, g.dtype)].append(g)
        found: dict[torch.device, torch.Tensor] = {}
        inv: dict[torch.device, torch.Tensor] = {}
        for (device, _), tensors in groups.items():
            if device not in found:
                found[device] = torch.zeros(1, dtype=torch.float32, device=device)
                inv[device] = torch.full(
                    (1,), 1.0 / self._scale, dtype=torch.float32, device=device
                )
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv[device])
        flags = list(found.values())
        first = flags[0]
        for other in flags[1:]:
            first = first + other.to(first.device, non_blocking=True)
        return first

    def update(self, found_inf: bool) -> None:
        """After a step attempt: dynamic scales back off on overflow (once the hysteresis counter
        is spent) and grow after `growth_interval` clean steps; static scales never change."""
        if not self.dynamic:
            return
        if found_inf:
            self._unskipped = 0
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)
            if self._hysteresis_left == 0:
                self._scale *= self.backoff_factor
                if self.min_loss_scale is not None:
                    self._scale = max(self._scale, self.min_loss_scale)
            return
        self._unskipped += 1
        if self._unskipped >= self.growth_interval:
            self._scale = min(self._scale * self.growth_factor, self.max_loss_scale)
            self._unskipped = 0
            self._hysteresis_left = self.hysteresis

    @property
    def hysteresis_left(self) -> int:
        """Overflows still tolerated before the next back-off (0: every overflow backs off)."""
        return self._hysteresis_left

    def state_dict(self) -> dict[str, Any]:
        # Apex's keys, so checkpoints read the same either way, plus the hysteresis counter.
        return {
            "loss_scale": self._scale,
            "unskipped": self._unskipped,
            "hysteresis_tracker": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["loss_scale"])
        self._unskipped = int(state.get("unskipped", 0))
        self._hysteresis_left = int(state.get("hysteresis_tracker", self.hysteresis))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self._scale:g})"


def state_dict_problems(state: Any, name: str = "loss_scaler") -> list[str]:
    """What is wrong with one scaler's state dict in the layout `state_dict` writes (Apex's, plus
    the hysteresis counter); `name` is what the caller calls it (e.g. `engine.loss_scaler0`).
    `loss_scale` a finite number > 0 and `unskipped` an integer >= 0 (both required, as in
    Apex), `hysteresis_tracker` an integer >= 0 (optional), nothing else. Each problem names its
    key; none: `LossScaler.load_state_dict` takes the dict as it is."""
    if not isinstance(state, Mapping):
        return [
            f"{name}: a dict of loss_scale and unskipped belongs here, not a {type(state).__name__}"
        ]
    problems = [
        f"{name}.{key}: unknown key (allowed: {', '.join(_STATE_KEYS)})"
        for key in state
        if key not in _STATE_KEYS
    ]
    scale = state.get("loss_scale")
    if "loss_scale" not in state:
        problems.append(f"{name}.loss_scale: missing")
    elif not _is_real(scale) or not math.isfinite(scale) or scale <= 0:
        problems.append(f"{name}.loss_scale: {scale!r} is not a finite number > 0")
    for key in ("unskipped", "hysteresis_tracker"):
        if key not in state:
            if key == "unskipped":
                problems.append(f"{name}.unskipped: missing")
            continue
        value = state[key]
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            problems.append(f"{name}.{key}: {value!r} is not an integer >= 0")
    return problems


_STATE_KEYS = ("loss_scale", "unskipped", "hysteresis_tracker")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
