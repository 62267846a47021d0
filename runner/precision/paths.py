"""Execution paths: how the engine's gradient work runs for one optimizer, on torch's ops or on the
compiled kernels (`runner.csrc`). The engine picks one per optimizer when it is prepared
(`choose`) and decides only *when* each piece runs; the path decides *how*.

Every path has the same small interface:

* `unscale(optimizer, masters, scaler, multiplier)`: make the stepped `.grad` true values (copy
  the model's 16-bit gradients into the fp32 masters, divide by the scale, flag non-finite
  values); returns the device-side flag, or None when nothing was checked.
* `plan(optimizer, masters, scaler)`: a `ScaledStep`, the step run straight from the model's
  *scaled* gradients with no unscaled copies, where the path can; None means the engine unscales
  into `.grad` first and clips with torch's `clip_grad_norm_`. A path that plans also implements
  `check(step)` (a read-only non-finite flag of the scaled gradients) and `clip(step, max_norm)`
  (the total norm, with the clipping coefficient folded into the step's multiplier).
* `apply(optimizer, masters, step, step_fn, args, kwargs)`: the update (the planned `step`, or
  the optimizer's own on unscaled `.grad`), then `copy_back(masters)`: masters -> model.

`TorchPath` runs on torch's ops and plans nothing. `FusedPath` runs the kernels and falls back to
torch's ops for the parts of one step the kernels cannot take (an optimizer or param group they
do not implement, sparse gradients, a device-side step counter: `fused.plan` says None), so that
choice never leaves the path. `RoundingPath` (the `stochastic_rounding` property) updates bf16
weights without masters and stores them rounded stochastically: the kernels' `*_step_sr` for
SGD/Adam/AdamW, `rounding.sr_step` around the optimizer's own step for anything else (a torchao
low-bit optimizer built to round bf16 weights itself steps on its own).

The optimizer's state format (`runner.precision.state`): every path keeps float state in the
`state_dtype` it is given; the kernels take fp32 or bf16 state (of fp32 params, or of
stochastically rounded bf16 params), torch's ops (`state.float_state_step`) any other mix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from runner.csrc import Kernels
from runner.precision import device_skip, fused, rounding, state
from runner.precision.master import MasterWeights
from runner.precision.scaler import LossScaler

_log = logging.getLogger(__name__)


class ScaleTensors:
    """Scales as one-element fp32 device tensors, cached: the kernels take scales as device
    tensors, and the scale changes rarely."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cache: dict[float, torch.Tensor] = {}

    def __call__(self, value: float) -> torch.Tensor:
        t = self._cache.get(value)
        if t is None:
            if len(self._cache) > 16:
                self._cache.clear()
            t = self._cache[value] = torch.full(
                (1,), value, dtype=torch.float32, device=self.device
            )
        return t


def new_flag(device: torch.device) -> torch.Tensor:
    """A cleared device-side found-inf flag for a kernel to raise (read once, at the step)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def skip_on_host(found_inf: torch.Tensor) -> bool:
    """Whether a device flag is set, read on the host: for an update only the host can skip
    (the optimizer's own step), the one read such a step costs."""
    return bool(found_inf.item())


def stepped_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """What the optimizer steps: the fp32 masters under master weights, else the model's."""
    for group in optimizer.param_groups:
        yield from group["params"]


@dataclass
class ScaledStep:
    """A step planned straight from the model's scaled gradients: the fused work per group, the
    scaler of those gradients, and (once `clip` fixed it) the gradient multiplier, the inverse
    scale times the clipping coefficient. Without a multiplier the step applies 1/scale."""

    plans: list[fused.GroupPlan]
    scaler: LossScaler
    multiplier: Optional[torch.Tensor] = None


class ExecutionPath:
    """The interface (see the module docstring); `TorchPath` is the one every path can fall
    back to."""

    name = "abstract"

    def unscale(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Optional[MasterWeights],
        scaler: Optional[LossScaler],
        multiplier: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def plan(
        self, optimizer: torch.optim.Optimizer, masters: Optional[MasterWeights], scaler: LossScaler
    ) -> Optional[ScaledStep]:
        return None

    def check(self, step: ScaledStep) -> Optional[torch.Tensor]:
        raise NotImplementedError(f"the {self.name} path plans no scaled step to check")

    def clip(
        self, step: ScaledStep, max_norm: float
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError(f"the {self.name} path plans no scaled step to clip")

    def apply(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Optional[MasterWeights],
        step: Optional[ScaledStep],
        step_fn: Optional[Callable[..., Any]],
        args: tuple,
        kwargs: dict,
        found_inf: Optional[torch.Tensor] = None,
    ) -> None:
        raise NotImplementedError

    def copy_back(self, masters: MasterWeights) -> None:
        raise NotImplementedError


class TorchPath(ExecutionPath):
    """torch's own ops: a copy into the masters, `_amp_foreach_non_finite_check_and_unscale_`,
    the optimizer's own `step`, a `_foreach_copy_` back into the model."""

    name = "torch"
    # the type the optimizer's state is kept in (None: the stepped params' own, as torch keeps
    # it); where it is not the params', the step runs through `state.float_state_step`
    state_dtype: Optional[torch.dtype] = None

    def unscale(self, optimizer, masters, scaler, multiplier=None):
        # (a multiplier comes only with a planned step, which only a planning path makes)
        if masters is not None:
            masters.copy_grads_to_master()
        if scaler is None or not scaler.needs_check:
            return None
        return scaler.unscale_([p.grad for p in stepped_params(optimizer) if p.grad is not None])

    def apply(self, optimizer, masters, step, step_fn, args, kwargs, found_inf=None):
        fp32_step = state.needs_fp32_step(optimizer, self.state_dtype)

        def run() -> None:
            if fp32_step:
                if args or kwargs:
                    raise RuntimeError(
                        f"an optimizer whose state is kept in {self.state_dtype} runs its step "
                        "on fp32 copies and takes no closure or arguments"
                    )
                state.float_state_step(optimizer, self.state_dtype, step_fn)
            else:
                (step_fn or optimizer.step)(*args, **kwargs)

        if found_inf is not None:
            if not fp32_step and getattr(optimizer, "_step_supports_amp_scaling", False):
                # torch's fused optimizers skip on the device flag themselves (as GradScaler
                # hands it to them); copying the unchanged masters back changes nothing
                self._step_with_flag(optimizer, found_inf, step_fn, args, kwargs)
                if masters is not None:
                    self.copy_back(masters)
                return
            # any other step is taken and undone on the device where the flag is set
            # (`device_skip`), unless only the host can tell: then the flag is read here
            why = device_skip.prepare(optimizer, found_inf.device, (*args, *kwargs))
            if why is None:
                why = device_skip.guarded_step(optimizer, found_inf, run)
                if why not in (None, device_skip.NEW_STATE):  # (new state: once, at the start)
                    self._say_host_read(optimizer, why)
                if masters is not None:  # (a skipped step's masters are as they were)
                    self.copy_back(masters)
                return
            self._say_host_read(optimizer, why)
            if skip_on_host(found_inf):
                return
        run()
        if masters is not None:
            self.copy_back(masters)

    def _say_host_read(self, optimizer: torch.optim.Optimizer, why: str) -> None:
        """Once per optimizer: its step reads the overflow flag on the host, and why."""
        said = self.__dict__.setdefault("_said", set())
        if id(optimizer) not in said:
            said.add(id(optimizer))
            _log.info(
                "%s steps itself and its update reads the overflow flag on the host at every "
                "step (%s); the runner's kernels (precision.kernels=auto) or a fused torch "
                "optimizer skip on the device",
                type(optimizer).__name__,
                why,
            )

    def copy_back(self, masters):
        masters.copy_master_to_model()

    @staticmethod
    def _step_with_flag(optimizer, found_inf, step_fn, args, kwargs) -> None:
        """The optimizer's own step with `found_inf` set where torch's fused step reads it."""
        had = optimizer.__dict__.get("found_inf")
        optimizer.found_inf = found_inf.reshape(())  # (0-dim, as its step counters)
        try:
            (step_fn or optimizer.step)(*args, **kwargs)
        finally:
            if had is None:
                del optimizer.found_inf
            else:
                optimizer.found_inf = had


class FusedPath(TorchPath):
    """The compiled kernels: one pass copies, unscales and checks; a step nobody unscaled runs
    from the scaled model gradients (`plan`); the update also writes the 16-bit model copy.
    Whatever the kernels cannot take this step runs on `TorchPath`'s ops instead."""

    name = "fused"

    def __init__(self, kernels: Kernels, device: torch.device, scales: ScaleTensors):
        self.kernels = kernels
        self.device = device
        self.scales = scales
        # the fused step's lists, prepared once per optimizer: from the model's scaled gradients
        # (`plan`), and from the unscaled `.grad` of the stepped params (`apply`)
        self.scaled_layout = fused.Layout()
        self.unscaled_layout = fused.Layout()

    def unscale(self, optimizer, masters, scaler, multiplier=None):
        """One kernel pass: the model's 16-bit grads into the masters' fp32 `.grad`, the model's
        own fp32 grads in place, all times the multiplier (1/scale unless given), non-finite
        values flagged where the scale needs a check."""
        check = scaler is not None and scaler.needs_check
        if masters is None and not check and multiplier is None:
            return None  # nothing to copy, scale or check
        src, dst = masters.attach_grad_buffers() if masters is not None else ([], [])
        if check or multiplier is not None:
            mirrored = masters.model_of() if masters is not None else {}
            own = [
                p.grad
                for p in stepped_params(optimizer)
                if p.grad is not None and id(p) not in mirrored
            ]
            src, dst = src + own, dst + own
        if not fused.kernel_compatible(src, dst, self.device):
            return super().unscale(optimizer, masters, scaler)
        if multiplier is None:
            multiplier = scaler.inv_scale_tensor if check else self.scales(1.0)
        if check:
            flag = new_flag(self.device)
            self.kernels.ops.unscale_check(src, dst, multiplier, flag)
            return flag
        if src:
            self.kernels.ops.copy_scale(src, dst, multiplier)
        return None

    def plan(self, optimizer, masters, scaler):
        """The fused step from the scaled model gradients, where there is precision work to fuse
        (masters, or a check) and the kernels take every group and tensor this step."""
        if masters is None and not scaler.needs_check:
            return None
        plans = self.scaled_layout.plan(
            optimizer, self.device, masters, scaled=True, state_dtype=self.state_dtype
        )
        return None if plans is None else ScaledStep(plans, scaler)

    def check(self, step):
        """A read-only pass flagging non-finite scaled gradients; None when the scale needs no
        check."""
        if not step.scaler.needs_check:
            return None
        flag = new_flag(self.device)
        self.kernels.ops.check_finite(fused.gradients(step.plans), flag)
        return flag

    def clip(self, step, max_norm):
        """The total 2-norm of the unscaled gradients, read from the scaled ones (a pass that
        also flags non-finite values); the clipping coefficient joins the inverse scale in the
        step's multiplier, the gradients are not rewritten."""
        inv = step.scaler.inv_scale_tensor
        flag = new_flag(self.device)
        total, _ = self.kernels.ops.l2norm(fused.gradients(step.plans), inv, flag)
        step.multiplier = inv * torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total, (flag if step.scaler.needs_check else None)

    def apply(self, optimizer, masters, step, step_fn, args, kwargs, found_inf=None):
        """The planned step; else, on unscaled `.grad` with masters, one fused update that also
        writes the model copy; else the optimizer's own step and the copy back. The kernels
        skip on `found_inf` on the device; the optimizer's own step reads it on the host."""
        if step is not None:
            multiplier = step.multiplier
            if multiplier is None:
                multiplier = step.scaler.inv_scale_tensor
            fused.apply(
                self.kernels,
                optimizer,
                step.plans,
                multiplier,
                state_dtype=self.state_dtype,
                found_inf=found_inf,
            )
            return
        if masters is not None and not args and not kwargs:
            plans = self.unscaled_layout.plan(
                optimizer, self.device, masters, scaled=False, state_dtype=self.state_dtype
            )
            if plans is not None:
                fused.apply(
                    self.kernels,
                    optimizer,
                    plans,
                    self.scales(1.0),
                    state_dtype=self.state_dtype,
                    found_inf=found_inf,
                )
                return
        super().apply(optimizer, masters, None, step_fn, args, kwargs, found_inf)

    def copy_back(self, masters):
        """Masters (fp32) -> the model's 16-bit parameters, rounded, in one kernel pass."""
        if fused.kernel_compatible(masters.masters, masters.model_params, self.device):
            self.kernels.ops.copy_scale(masters.masters, masters.model_params, self.scales(1.0))
        else:
            super().copy_back(masters)


class RoundingClock:
    """The random key of stochastically rounded steps: the run's seed and a count of the steps
    taken (every rounded step of every optimizer draws a new number), checkpointed with the
    engine's state so that a resumed run rounds exactly as the uninterrupted one would."""

    def __init__(self, seed: int):
        self.seed = int(seed) % 2**64
        self.steps = 0

    def next(self) -> int:
        number = self.steps
        self.steps += 1
        return number


class RoundingPath(ExecutionPath):
    """bf16 weights without fp32 masters, each update computed in fp32 and stored rounded up or
    down at random in proportion to the distance (unbiased: updates smaller than bf16's spacing
    are not lost on average). Unscaling and checking go through `base` (the kernels' or torch's);
    the update runs the kernels' `sgd_step_sr`/`adam_step_sr` where they take the step (SGD,
    Adam, AdamW on bf16 params), else `rounding.sr_step` around the optimizer's own step."""

    name = "stochastic_rounding"

    def __init__(
        self, base: TorchPath, clock: RoundingClock, device: torch.device, scales: ScaleTensors
    ):
        self.base = base
        self.clock = clock
        self.device = device
        self.scales = scales

    def unscale(self, optimizer, masters, scaler, multiplier=None):
        return self.base.unscale(optimizer, masters, scaler, multiplier)

    def apply(self, optimizer, masters, step, step_fn, args, kwargs, found_inf=None):
        if args or kwargs:
            raise RuntimeError(
                "stochastic rounding runs the optimizer's step itself and takes "
                "no closure or arguments (as Apex's optimizer.step)"
            )
        kernels = getattr(self.base, "kernels", None)
        if found_inf is not None and (kernels is None or state.rounds_itself(optimizer)):
            if skip_on_host(found_inf):  # (the kernels skip on the device flag themselves)
                return
            found_inf = None
        key = fused.Rounding(self.clock.seed, self.clock.next(), rounding.tensor_ids(optimizer))
        if state.rounds_itself(optimizer):  # torchao's low-bit optimizer, its own rounding
            (step_fn or optimizer.step)()
            return
        state_dtype = self.base.state_dtype
        if kernels is not None:
            plans = fused.plan(
                optimizer,
                self.device,
                lambda p: p.grad,
                lambda p: None,
                param_dtype=torch.bfloat16,
                state_dtype=state_dtype,
            )
            if plans is not None:
                fused.apply(
                    kernels, optimizer, plans, self.scales(1.0), key, state_dtype, found_inf
                )
                return
            if found_inf is not None and skip_on_host(found_inf):
                return
        rounding.sr_step(optimizer, key.seed, key.step, step_fn=step_fn, state_dtype=state_dtype)

    def copy_back(self, masters):
        raise RuntimeError("stochastic rounding keeps no master weights to copy back")


def choose(
    kernels: Optional[Kernels],
    device: torch.device,
    scales: ScaleTensors,
    clock: Optional[RoundingClock] = None,
    state_dtype: Optional[torch.dtype] = None,
) -> ExecutionPath:
    """An optimizer's path: the kernels' wherever they are loaded (their copy, unscale and
    copy-back serve every optimizer; the fused update itself is planned per step, and falls back
    to the optimizer's own step for one the kernels do not implement), else torch's ops; with a
    rounding `clock` (stochastic rounding), the rounding path over either. `state_dtype`: the
    float type the optimizer's state is kept in (None: the params' own, or a low-bit
    optimizer's own format)."""
    base = TorchPath() if kernels is None else FusedPath(kernels, device, scales)
    base.state_dtype = state_dtype
    if clock is not None:
        return RoundingPath(base, clock, device, scales)
    return base
