"""The divergence guard: consecutive skipped steps, consecutive non-finite losses (counted on the
device, read at the trainer's periodic reads) or a collapsed dynamic loss scale stop a run with a
`DivergenceError` (how and when: README.md beside this file)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from runner.config import TrainerConfig
from runner.config.formats import SHORT_NAMES
from runner.errors import DivergenceError
from runner.precision.level_rules import level_preset

log = logging.getLogger(__name__)


class DivergenceGuard:
    """The streaks of one trainer and the checks that stop it (`trainer.max_bad_steps`,
    `trainer.collapsed_loss_scale`); `engine`'s scalers tell the loss scale."""

    def __init__(self, cfg: TrainerConfig, engine: Any, device: torch.device):
        self.max_bad_steps = cfg.max_bad_steps
        self.collapsed_loss_scale = cfg.collapsed_loss_scale
        self.engine = engine
        # consecutive skipped steps (the engine's verdicts stay on the device) and consecutive
        # non-finite losses up to the last step: both counted on the device (no sync), read at
        # the trainer's periodic reads
        self.skips = torch.zeros((), dtype=torch.int64, device=device)
        self.bad_loss_streak = torch.zeros((), dtype=torch.int64, device=device)
        # training batches whose inputs held inf/NaN (the data itself), counted on the device;
        # `bad_inputs_read`: the count the last periodic read found
        self.bad_inputs = torch.zeros((), dtype=torch.int64, device=device)
        self.bad_inputs_read = 0

    @property
    def skip_streak(self) -> int:
        """The consecutive skipped steps up to the last step (one device read)."""
        return int(self.skips.item())

    @skip_streak.setter
    def skip_streak(self, value: int) -> None:
        self.skips.fill_(int(value))

    def watch_inputs(self, x: torch.Tensor) -> None:
        """Count a training batch whose floating inputs hold inf/NaN (on the device, no sync)."""
        if x.is_floating_point():
            self.bad_inputs.add_(~torch.isfinite(x).all())

    def inputs_read(self, count: int, step: int) -> None:
        """At a periodic read: the count of batches with inf/NaN inputs so far; a warning where
        it grew since the last read (each step that meets one has a NaN loss)."""
        if count > self.bad_inputs_read:
            log.warning(
                "Up to step %d, %s held inf/NaN inputs: %s", step, _batches(count), _DATA_NOT_FINITE
            )
        self.bad_inputs_read = count

    def check_weights(self, finite: bool, epoch: int, step: int) -> None:
        """At an epoch's end (`finite`: whether the model's weights and buffers are): values
        that became inf/NaN stop the run, whatever the streaks (every later step starts from
        them: a short run ended FINISHED with a NaN model, its accuracy chance's; a batch with
        a NaN input whose step the loss scaler skipped still puts it in BatchNorm's running
        statistics)."""
        if finite:
            return
        raise DivergenceError(
            "training diverged: the model's weights or buffers (a BatchNorm's running "
            f"statistics) are inf/NaN after epoch {epoch} (step {step}), and every later step "
            "would start from them; the last checkpoint, if any, is the last good state: "
            f"{self._why()}"
        )

    def after_step(self, loss: torch.Tensor, stepped: bool | torch.Tensor) -> torch.Tensor:
        """Count the step into the streaks (`stepped`: the engine's verdict, a bool or a device
        tensor); returns its loss, detached, in fp32 (no sync)."""
        loss = loss.detach().float()
        # +1 on a non-finite loss, back to 0 on a finite one; stays on the device.
        self.bad_loss_streak.add_(1).mul_(~torch.isfinite(loss))
        if torch.is_tensor(stepped):
            self.skips.add_(1).mul_(~stepped.to(self.skips.device))
        elif stepped:
            self.skips.zero_()
        else:
            self.skips.add_(1)
        return loss

    def check_skips(self, step: int, skips: int | None = None) -> None:
        """At a periodic read (`skips`: the streak it read; None: read it now): stop once
        `max_bad_steps` consecutive steps were skipped (the streak may be longer by the read
        that finds it), or once a dynamic loss scale backed off below
        `trainer.collapsed_loss_scale` (overflows at every scale: the scaled gradients would be
        below fp16's range anyway)."""
        streak = self.skip_streak if skips is None else int(skips)
        if streak == 0:
            return
        scaler = self.engine.scaler
        floor = self.collapsed_loss_scale
        if scaler.dynamic and scaler.scale < floor:
            formats = narrow_formats(self.engine)
            why = "a forward that overflows fp16: " if "fp16" in formats else ""
            raise DivergenceError(
                f"training diverged: the dynamic loss scale collapsed to {scaler.scale:g}, below "
                f"trainer.collapsed_loss_scale={floor:g}, after {streak} consecutive "
                f"overflowing steps up to step {step}: the gradients are inf/NaN "
                f"even when scaled down to nothing ({why}no loss scale helps); "
                f"{advice(self.engine, formats)}"
            )
        if streak < self.max_bad_steps:
            return
        # Failing anyway: one read tells whether the loss itself was non-finite.
        self.check_losses(int(self.bad_loss_streak.item()), step)
        scale = self.engine.loss_scale
        dynamic = self.engine.scaler.dynamic
        formats = narrow_formats(self.engine)
        if not formats and (dynamic or scale <= 1):  # fp32: no 16-bit range to overflow
            cause = f"the gradients are inf/NaN in fp32 (at loss scale {scale:g})"
        elif not formats:
            cause = (
                f"the static loss scale {scale:g} overflows the gradients even in fp32 (an fp32 "
                "run needs none: precision.loss_scale=1)"
            )
        elif dynamic:
            cause = (
                f"the gradients overflow even at loss scale {scale:g}; lower "
                "precision.min_loss_scale, or the model produces inf/NaN gradients in 16 bit"
            )
        else:
            cause = (
                f"the static loss scale {scale:g} overflows the gradients; lower "
                "precision.loss_scale or use precision.loss_scale=dynamic"
            )
        raise DivergenceError(
            f"training diverged: {streak} consecutive steps were skipped (inf/NaN "
            f"gradients) up to step {step} (trainer.max_bad_steps={self.max_bad_steps}): "
            f"{cause}; {advice(self.engine, formats)}; or raise trainer.max_bad_steps to wait "
            "longer"
        )

    def check_losses(self, bad_losses: float, step: int) -> None:
        """Stop once the loss was non-finite `max_bad_steps` times in a row (`bad_losses`: the
        streak as the periodic read found it, which may be longer: the loss is read every
        `trainer.log_every_n_steps` steps). The message counts `max_bad_steps` steps, from the
        first non-finite one."""
        if bad_losses < self.max_bad_steps:
            return
        first = step - int(bad_losses) + 1
        limit = first + self.max_bad_steps - 1
        steps = f"step {first}" if limit == first else f"steps {first} to {limit}"
        read = f"; found at step {step}, when the loss was read" if limit < step else ""
        raise DivergenceError(
            f"training diverged: the loss was inf/NaN for {self.max_bad_steps} consecutive "
            f"{'step' if self.max_bad_steps == 1 else 'steps'}, {steps} "
            f"(trainer.max_bad_steps={self.max_bad_steps}{read}): {self._why()}"
        )

    def _why(self) -> str:
        """Why values are non-finite and what to try: the data, where batches held inf/NaN
        inputs; else by the formats the run computes in."""
        if self.bad_inputs_read:
            return f"{_batches(self.bad_inputs_read)} held inf/NaN inputs: {_DATA_NOT_FINITE}"
        formats = narrow_formats(self.engine)
        return f"{_cause(formats)}; {advice(self.engine, formats)}"

    def state(self) -> dict[str, int]:
        """The streaks, as a checkpoint keeps them (one host read)."""
        skips, bad = torch.stack([self.skips, self.bad_loss_streak]).tolist()
        return {"skip_streak": int(skips), "bad_loss_streak": int(bad)}

    def restore(self, state: dict) -> None:
        self.skips.fill_(int(state["skip_streak"]))
        self.bad_loss_streak.fill_(int(state["bad_loss_streak"]))


_DATA_NOT_FINITE = (
    "the data itself is not finite (a NaN in a sample, a transform that divides by zero); find "
    "them with torch.isfinite(x).all() over the dataset's items, and fix or leave them out"
)


def _batches(count: int) -> str:
    return f"{count} training batch{'' if count == 1 else 'es'}"


def _cause(formats: list[str]) -> str:
    """What produces non-finite values, by the formats the run computes in."""
    if not formats:
        return "the training itself produces non-finite values"
    if "fp16" in formats:
        return (
            f"in {' and '.join(formats)} the model produces non-finite values (a forward that "
            "overflows fp16's range, or the model itself)"
        )
    return (
        f"the model produces non-finite values (in {' and '.join(formats)}, whose range is "
        "fp32's: rather the model itself or its coarser rounding)"
    )


# ---- what to try, by what the run computes in ---------------------------------------------------
def narrow_formats(engine: Any) -> list[str]:
    """The formats narrower than fp32 the run computes in (fp16, bf16, fp8: the level's and any
    layer plan's), fp16 first; empty for an fp32 run (O0, or any level without 16-bit compute)."""
    properties = engine.properties
    found = {SHORT_NAMES[str(d).removeprefix("torch.")] for d in properties.compute_dtypes}
    if properties.fp8_linear not in (None, "None"):
        found.add("fp8")
    plan = getattr(engine, "layer_plan", None)
    if plan is not None:
        found.update(name for name, count in plan.counts().items() if count and name != "fp32")
    return [name for name in ("fp16", "bf16", "fp8") if name in found]


def _lr(engine: Any) -> str:
    """' (now 0.1)': the learning rate of the engine's optimizer, where it has one."""
    optimizer = getattr(engine, "optimizer", None)
    for group in optimizer.param_groups if optimizer is not None else ():
        return f" (now {float(group['lr']):g})"
    return ""


def advice(engine: Any, formats: list[str]) -> str:
    """What to try, 'try ...': at fp32 the learning rate, the initialisation and the data (no
    16-bit type is involved); in fp16 the level (a bf16 preset, the overflowing layers in fp32,
    fp32 master weights at O3; the loss scale's own remedies are the caller's cause); in bf16 or
    fp8 (fp32's range) the learning rate and the level."""
    level = engine.properties.opt_level
    if not formats:
        return (
            f"the run computes in fp32 ({level}), so no 16-bit format is the cause: try a "
            f"lower optimizer.lr{_lr(engine)}, check the model's initialisation (weights of a "
            "sane scale) and the data (inf/NaN values, unnormalised inputs)"
        )
    tries = []
    if "fp16" in formats:
        bf16 = level_preset(level, torch.bfloat16)
        tries.append(f"a bf16 preset ({bf16}: fp32's range, no loss scale)")
        tries.append("the layers that overflow kept in fp32 (precision.layer_plan=auto)")
        if not engine.properties.uses_master_weights and engine.properties.casts_to_half:
            tries.append("fp32 master weights (precision=o2)")
    else:
        tries.append(f"a lower optimizer.lr{_lr(engine)}")
        if "fp8" in formats:
            tries.append("the Linear layers in bf16 (precision.fp8_linear=null)")
        if not engine.properties.uses_master_weights and engine.properties.casts_to_half:
            tries.append(f"fp32 master weights ({level_preset('O2', torch.bfloat16)})")
    tries.append(
        "precision=o0 to tell (if fp32 diverges too: a lower optimizer.lr)"
        if "fp16" in formats
        else "precision=o0 to see whether fp32 trains"
    )
    return f"try {', '.join(tries[:-1])}, or {tries[-1]}"
