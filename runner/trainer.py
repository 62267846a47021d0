"""The training loop: train, then validate, each epoch; measures what the MLflow contract names.

The hot path of a step holds no MLflow call and no host sync beyond the engine's single found-inf
read: losses accumulate on the device and are read every `log_every_n_steps` steps.

Divergence guard: `trainer.max_bad_steps` consecutive skipped steps, or consecutive non-finite
losses, stop the run with a `DivergenceError`. Skips are known on the host for free (the engine's
step returns False), so they are caught at the step they reach the limit. Non-finite losses are
counted on the device (a counter reset by every finite loss, no sync) and the counter is read
together with the loss at the periodic reads (every `log_every_n_steps` steps and at the end of an
epoch), so that detection can lag by up to `log_every_n_steps` steps.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from runner.errors import DivergenceError
from runner.probes import MemoryProbe, Stopwatch

log = logging.getLogger(__name__)

MetricsSink = Callable[[Mapping[str, float], int], None]

# PyTorch warns when a scheduler steps before the optimizer ever did; a skipped first step (an
# overflow at the initial loss scale) is expected, and the schedule must still advance.
_SCHEDULER_ORDER_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


@dataclass
class FitResult:
    best_val_acc: float
    train_time_s: float
    epochs: list[dict[str, float]] = field(default_factory=list)


def limit_batches(n_batches: int, limit: int | None) -> int:
    """Batches per epoch after `trainer.limit_*_batches` (None: all)."""
    return n_batches if limit is None else min(n_batches, limit)


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        engine,
        train_loader,
        val_loader,
        device: torch.device,
        cfg,
        on_metrics: MetricsSink,
        memory: MemoryProbe,
    ):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.engine = engine
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.device = device
        self.cfg = cfg
        self.on_metrics = on_metrics
        self.memory = memory
        self.criterion = nn.CrossEntropyLoss()
        self.train_batches = limit_batches(len(train_loader), cfg.limit_train_batches)
        self.val_batches = limit_batches(len(val_loader), cfg.limit_val_batches)
        self.global_step = 0
        self.clock = Stopwatch(device)
        self.max_bad_steps = int(getattr(cfg, "max_bad_steps", 50))
        self.skip_streak = 0  # consecutive skipped steps (host-side: engine.step says so)
        # consecutive non-finite losses up to the last step, kept on the device (no sync)
        self.bad_loss_streak = torch.zeros((), dtype=torch.int64, device=device)

    # ---- one step ---------------------------------------------------------------------------
    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def _step_scheduler(self, stepped: bool) -> None:
        if self.scheduler is None:
            return
        if stepped:
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SCHEDULER_ORDER_WARNING)
            self.scheduler.step()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.engine.autocast():
            loss = self.criterion(self.model(x), y)
        self.engine.backward(loss)
        if self.cfg.grad_clip_norm:
            self.engine.clip_grad_norm_(self.cfg.grad_clip_norm, self.optimizer)
        stepped = self.engine.step(self.optimizer)
        self._step_scheduler(stepped)
        self.engine.zero_grad(self.optimizer)
        loss = loss.detach().float()
        # +1 on a non-finite loss, back to 0 on a finite one; stays on the device.
        self.bad_loss_streak.add_(1).mul_(~torch.isfinite(loss))
        self.skip_streak = 0 if stepped else self.skip_streak + 1
        return loss

    # ---- divergence guard ----------------------------------------------------------------------
    def _check_skips(self) -> None:
        """Host-side, free: stop once `max_bad_steps` consecutive steps were skipped."""
        if self.skip_streak < self.max_bad_steps:
            return
        # Failing anyway: one read tells whether the loss itself was non-finite.
        bad_losses = int(self.bad_loss_streak.item())
        if bad_losses >= self.max_bad_steps:
            self._raise_bad_loss(bad_losses)
        scale = self.engine.loss_scale
        dynamic = self.engine.scalers[0].dynamic
        cause = (f"the gradients overflow even at loss scale {scale:g}; lower "
                 "precision.min_loss_scale, or the model produces inf/NaN gradients in 16 bit"
                 if dynamic else
                 f"the static loss scale {scale:g} overflows the gradients; lower "
                 "precision.loss_scale or use precision.loss_scale=dynamic")
        raise DivergenceError(
            f"training diverged: {self.skip_streak} consecutive steps were skipped (inf/NaN "
            f"gradients) up to step {self.global_step}: {cause}; try precision=o2 or a bf16 preset "
            f"(precision=o2_bf16), or raise trainer.max_bad_steps={self.max_bad_steps} to wait "
            "longer")

    def _raise_bad_loss(self, bad_losses: int) -> None:
        raise DivergenceError(
            f"training diverged: the loss was inf/NaN for {bad_losses} consecutive steps up to "
            f"step {self.global_step} (trainer.max_bad_steps={self.max_bad_steps}): the model "
            "produces non-finite values even at the smallest loss scale, or pure fp16 "
            "overflowed; try precision=o2 or a bf16 preset (precision=o2_bf16), or a lower "
            "optimizer.lr")

    # ---- epochs -----------------------------------------------------------------------------
    def _log_train_loss(self, window: torch.Tensor, count: int, bar) -> None:
        # The periodic host read: the mean loss and the non-finite-loss streak in one transfer.
        value, bad_losses = torch.stack(
            [window / count, self.bad_loss_streak.to(window.dtype)]).tolist()
        if bad_losses >= self.max_bad_steps:
            self._raise_bad_loss(int(bad_losses))
        lr = self.optimizer.param_groups[0]["lr"]
        self.on_metrics({"train_loss": value, "lr": lr}, self.global_step)
        bar.set_postfix(loss=f"{value:.4f}", scale=f"{self.engine.loss_scale:g}", refresh=False)

    def train_epoch(self, epoch: int) -> tuple[float, int]:
        """Returns (seconds, samples) for one pass over the training batches."""
        self.model.train()
        window = torch.zeros((), device=self.device)
        count = samples = 0
        bar = tqdm(
            total=self.train_batches,
            desc=f"epoch {epoch}/{self.cfg.max_epochs}",
            unit="batch",
            disable=not self.cfg.progress_bar,
            dynamic_ncols=True,
        )
        self.clock.start()
        with bar:
            for index, (x, y) in enumerate(self.train_loader):
                if index >= self.train_batches:
                    break
                x, y = self._to_device(x, y)
                window += self.train_step(x, y)
                count += 1
                samples += y.shape[0]
                self.global_step += 1
                self._check_skips()
                if self.global_step % self.cfg.log_every_n_steps == 0:
                    self._log_train_loss(window, count, bar)
                    window.zero_()
                    count = 0
                bar.update()
            if count:  # short epochs still report their loss
                self._log_train_loss(window, count, bar)
        return self.clock.stop(), samples

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Returns (mean loss, accuracy) over the validation batches."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        seen = 0
        for index, (x, y) in enumerate(self.val_loader):
            if index >= self.val_batches:
                break
            x, y = self._to_device(x, y)
            with self.engine.autocast():
                logits = self.model(x)
            loss_sum += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
            correct += (logits.argmax(dim=1) == y).sum()
            seen += y.shape[0]
        if seen == 0:
            return math.nan, math.nan
        return loss_sum.item() / seen, correct.item() / seen

    def fit(self) -> FitResult:
        best = -math.inf
        history: list[dict[str, float]] = []
        started = time.perf_counter()
        for epoch in range(1, self.cfg.max_epochs + 1):
            seconds, samples = self.train_epoch(epoch)
            val_loss, val_acc = self.evaluate()
            metrics = {
                "val_loss": val_loss,
                "val_acc": val_acc,
                "epoch_time_s": seconds,
                "samples_per_s": samples / seconds if seconds > 0 else math.nan,
                "peak_mem_mb": self.memory.peak_mb(),
                "loss_scale": self.engine.loss_scale,
                "skipped_steps": float(self.engine.skipped_steps),
            }
            self.on_metrics(metrics, epoch)
            history.append(metrics)
            if not math.isnan(val_acc):
                best = max(best, val_acc)
            log.info(
                "epoch %d/%d: val_acc %.4f  val_loss %.4f  %.1f s  %.0f samples/s  "
                "peak mem %.0f MB  loss scale %g  skipped %d",
                epoch,
                self.cfg.max_epochs,
                val_acc,
                val_loss,
                seconds,
                metrics["samples_per_s"],
                metrics["peak_mem_mb"],
                metrics["loss_scale"],
                self.engine.skipped_steps,
            )
        train_time = time.perf_counter() - started
        best_val_acc = best if best != -math.inf else math.nan
        self.on_metrics({"best_val_acc": best_val_acc, "train_time_s": train_time}, self.cfg.max_epochs)
        return FitResult(best_val_acc=best_val_acc, train_time_s=train_time, epochs=history)
