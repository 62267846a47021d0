"""The divergence guard: consecutive skipped steps, consecutive non-finite losses (counted on the
device, read at the trainer's periodic reads) or a collapsed dynamic loss scale stop a run with a
`DivergenceError` (how and when: README.md beside this file)."""

from __future__ import annotations

from typing import Any

import torch

from runner.config import TrainerConfig
from runner.errors import DivergenceError


class DivergenceGuard:
    """The streaks of one trainer and the checks that stop it (`trainer.max_bad_steps`,
    `trainer.collapsed_loss_scale`); `engine`'s scalers tell the loss scale."""

    def __init__(self, cfg: TrainerConfig, engine: Any, device: torch.device):
        self.max_bad_steps = cfg.max_bad_steps
        self.collapsed_loss_scale = cfg.collapsed_loss_scale
        self.engine = engine
        self.skip_streak = 0  # consecutive skipped steps (host-side: engine.step says so)
        # consecutive non-finite losses up to the last step, kept on the device (no sync)
        self.bad_loss_streak = torch.zeros((), dtype=torch.int64, device=device)

    def after_step(self, loss: torch.Tensor, stepped: bool) -> torch.Tensor:
        """Count the step into the streaks; returns its loss, detached, in fp32 (no sync)."""
        loss = loss.detach().float()
        # +1 on a non-finite loss, back to 0 on a finite one; stays on the device.
        self.bad_loss_streak.add_(1).mul_(~torch.isfinite(loss))
        self.skip_streak = 0 if stepped else self.skip_streak + 1
        return loss

    def check_skips(self, step: int) -> None:
        """Host-side, free: stop once `max_bad_steps` consecutive steps were skipped, or once a
        dynamic loss scale backed off below `trainer.collapsed_loss_scale` (overflows at every
        scale: the scaled gradients would be below fp16's range anyway)."""
        if self.skip_streak == 0:
            return
        scaler = self.engine.scalers[0]
        floor = self.collapsed_loss_scale
        if scaler.dynamic and scaler.scale < floor:
            raise DivergenceError(
                f"training diverged: the dynamic loss scale collapsed to {scaler.scale:g}, below "
                f"trainer.collapsed_loss_scale={floor:g}, after {self.skip_streak} consecutive "
                f"overflowing steps up to step {step}: the gradients are inf/NaN "
                "even when scaled down to nothing (a forward that overflows fp16: no loss scale "
                "helps); try a bf16 preset (precision=o2_bf16), keep the layers that overflow in "
                "fp32 (precision.layer_plan=auto plans them), or a lower optimizer.lr"
            )
        if self.skip_streak < self.max_bad_steps:
            return
        # Failing anyway: one read tells whether the loss itself was non-finite.
        self.check_losses(int(self.bad_loss_streak.item()), step)
        scale = self.engine.loss_scale
        dynamic = self.engine.scalers[0].dynamic
        cause = (
            f"the gradients overflow even at loss scale {scale:g}; lower "
            "precision.min_loss_scale, or the model produces inf/NaN gradients in 16 bit"
            if dynamic
            else f"the static loss scale {scale:g} overflows the gradients; lower "
            "precision.loss_scale or use precision.loss_scale=dynamic"
        )
        raise DivergenceError(
            f"training diverged: {self.skip_streak} consecutive steps were skipped (inf/NaN "
            f"gradients) up to step {step}: {cause}; try precision=o2 or a bf16 preset "
            f"(precision=o2_bf16), or raise trainer.max_bad_steps={self.max_bad_steps} to wait "
            "longer"
        )

    def check_losses(self, bad_losses: float, step: int) -> None:
        """Stop once the loss was non-finite `max_bad_steps` times in a row (`bad_losses`: the
        streak as the periodic read found it)."""
        if bad_losses < self.max_bad_steps:
            return
        raise DivergenceError(
            f"training diverged: the loss was inf/NaN for {int(bad_losses)} consecutive steps up "
            f"to step {step} (trainer.max_bad_steps={self.max_bad_steps}): the model "
            "produces non-finite values even at the smallest loss scale, or pure fp16 "
            "overflowed; try precision=o2 or a bf16 preset (precision=o2_bf16), or a lower "
            "optimizer.lr"
        )

    def state(self) -> dict[str, int]:
        """The streaks, as a checkpoint keeps them (one host read)."""
        return {
            "skip_streak": self.skip_streak,
            "bad_loss_streak": int(self.bad_loss_streak.item()),
        }

    def restore(self, state: dict) -> None:
        self.skip_streak = int(state["skip_streak"])
        self.bad_loss_streak.fill_(int(state["bad_loss_streak"]))
