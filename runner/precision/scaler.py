"""Loss scaling: a fixed scale, or Apex's dynamic scale that backs off on overflow and grows back.

A dynamic scale lives on the device, beside the gradients: its state (the scale, the clean steps
since its last change, the hysteresis counter) is one float64 tensor that `update` changes from a
device-side overflow flag (one call of the kernels' `update_scale` where the engine has them, else
a dozen small tensor ops), so a training step never waits for the host. The
fp32 scale the loss is multiplied by and its inverse that unscales the gradients are device
tensors that follow it. The host reads the state only when asked (`scale`, `state_dict`, the
trainer's logging steps), once per change. A static scale is a host float (it never changes); one
of exactly 1.0 needs no pass over the gradients at all (`needs_check` is False).

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
        self._device = torch.device("cpu")
        # [scale, clean steps since the last change of scale (Apex's `unskipped`), overflows
        # still tolerated before a back-off], exact in float64, on the device
        self._state = torch.tensor([float(start), 0.0, float(self.hysteresis)], dtype=torch.float64)
        # the state as last read (None: changed on the device since)
        self._host: Optional[list[float]] = [float(start), 0.0, float(self.hysteresis)]
        self._scale32 = torch.empty((), dtype=torch.float32)  # what the loss is multiplied by
        self._inv32 = torch.empty(1, dtype=torch.float32)  # 1/scale, what unscales the gradients
        # compiled kernels (runner.csrc, set by the engine) whose `update_scale` runs `update` as
        # one op on the state's device; None: torch's ops (a dozen small ones)
        self.kernels: Any = None
        self._derive()

    def to(self, device: torch.device | str) -> LossScaler:
        """Keep the state (and the scale tensors) on `device`; returns self."""
        self._device = torch.device(device)
        self._state = self._state.to(self._device)
        self._scale32 = self._scale32.to(self._device)
        self._inv32 = self._inv32.to(self._device)
        self._derive()
        return self

    @torch.no_grad()
    def _derive(self) -> None:
        """The fp32 scale and inverse scale tensors from the state, in place (their holders keep
        them): the scale rounded to fp32, and 1/scale computed in float64 then rounded, as a
        Python float's `1.0 / scale` would be."""
        self._scale32.copy_(self._state[0])
        self._inv32.copy_(torch.reciprocal(self._state[0:1]))

    def _read(self) -> list[float]:
        """The state on the host: a static scale's as it is, a dynamic one's read from the
        device each time (a step replayed from a CUDA graph changes it without Python)."""
        if self._host is None or self.dynamic:
            self._host = self._state.tolist()
        return self._host

    @torch.no_grad()
    def _write(self, scale: float, unskipped: int, hysteresis_left: int) -> None:
        values = [float(scale), float(unskipped), float(hysteresis_left)]
        self._state.copy_(torch.tensor(values, dtype=torch.float64))
        self._host = values
        self._derive()

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
        """The current scale (a dynamic one read from the device)."""
        return self._read()[0]

    @scale.setter
    def scale(self, value: float) -> None:
        _, unskipped, left = self._read()
        self._write(float(value), int(unskipped), int(left))

    # Apex's attribute names (scripts set `loss_scalers[0]._loss_scale`, the facade forwards)
    _scale = scale

    @property
    def _unskipped(self) -> int:
        return int(self._read()[1])

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        scale, _, left = self._read()
        self._write(scale, int(value), int(left))

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim fp32 device tensor (follows every update in place)."""
        return self._scale32

    @property
    def inv_scale_tensor(self) -> torch.Tensor:
        """1/scale as a one-element fp32 device tensor (follows every update in place)."""
        return self._inv32

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss.float() * scale`: a dynamic scale's device tensor (no host read), a static
        scale's float; no multiply at all for a static scale of exactly 1."""
        loss = loss.float()
        if self.dynamic:
            return loss * self._scale32.to(loss.device)
        scale = self.scale
        return loss * scale if scale != 1.0 else loss

    @property
    def needs_check(self) -> bool:
        """Whether gradients must be unscaled and checked: dynamic, or a static scale != 1."""
        return self.dynamic or self.scale != 1.0

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
                inv[device] = self._inv32.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv[device])
        flags = list(found.values())
        first = flags[0]
        for other in flags[1:]:
            first = first + other.to(first.device, non_blocking=True)
        return first

    @torch.no_grad()
    def update(
        self, found_inf: Union[bool, torch.Tensor], when: Optional[torch.Tensor] = None
    ) -> None:
        """After a step attempt: dynamic scales back off on overflow (once the hysteresis counter
        is spent) and grow after `growth_interval` clean steps; static scales never change.

        `found_inf` is the verdict: a bool, or a device flag (non-zero: overflow) read by the
        tensor ops that update the state on the device, with no host read. `when` (a bool
        tensor): the update happens only where it is true, else the state stays."""
        if not self.dynamic:
            return
        if self._update_in_one_op(found_inf, when):
            return
        state = self._state
        if isinstance(found_inf, torch.Tensor):
            found = found_inf.to(state.device).reshape(()) != 0
        else:
            found = torch.full((), bool(found_inf), dtype=torch.bool, device=state.device)
        scale, unskipped, left = state[0], state[1], state[2]
        left = torch.where(found, (left - 1).clamp(min=0), left)
        back = found & (left == 0)
        unskipped = torch.where(found, torch.zeros_like(unskipped), unskipped + 1)
        grow = ~found & (unskipped >= self.growth_interval)
        backed = scale * self.backoff_factor
        if self.min_loss_scale is not None:
            backed = backed.clamp(min=self.min_loss_scale)
        grown = (scale * self.growth_factor).clamp(max=self.max_loss_scale)
        scale = torch.where(back, backed, torch.where(grow, grown, scale))
        unskipped = torch.where(grow, torch.zeros_like(unskipped), unskipped)
        left = torch.where(grow, torch.full_like(left, self.hysteresis), left)
        new = torch.stack([scale, unskipped, left])
        if when is not None:
            new = torch.where(when.to(state.device).reshape(()), new, state)
        state.copy_(new)
        self._host = None
        self._derive()

    def _update_in_one_op(
        self, found_inf: Union[bool, torch.Tensor], when: Optional[torch.Tensor]
    ) -> bool:
        """`update` by the kernels' `update_scale` (the same float64 arithmetic, one launch on
        CUDA instead of a dozen), where they serve the state's device; False: not done."""
        kernels = self.kernels
        if kernels is None or kernels.device_type != self._device.type:
            return False
        device = self._state.device
        flag = None
        if isinstance(found_inf, torch.Tensor):
            flag = found_inf
            if flag.dtype != torch.float32 or flag.device != device:
                flag = flag.to(device=device, dtype=torch.float32)
            if flag.numel() != 1:
                return False
        if when is not None and (when.dtype != torch.bool or when.device != device):
            when = when.to(device=device, dtype=torch.bool)
        kernels.ops.update_scale(
            self._state,
            self._scale32,
            self._inv32,
            flag,
            bool(found_inf) if flag is None else False,
            when,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.min_loss_scale is not None,
            self.min_loss_scale or 0.0,
            self.max_loss_scale,
            self.hysteresis,
        )
        self._host = None
        return True

    @property
    def hysteresis_left(self) -> int:
        """Overflows still tolerated before the next back-off (0: every overflow backs off)."""
        return int(self._read()[2])

    def state_dict(self) -> dict[str, Any]:
        # Apex's keys, so checkpoints read the same either way, plus the hysteresis counter.
        scale, unskipped, left = self._read()
        return {
            "loss_scale": scale,
            "unskipped": int(unskipped),
            "hysteresis_tracker": int(left),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._write(
            float(state["loss_scale"]),
            int(state.get("unskipped", 0)),
            int(state.get("hysteresis_tracker", self.hysteresis)),
        )

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g})"


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
