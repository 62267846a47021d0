"""`trainer.cuda_graphs=step`: the whole training step captured once in a CUDA graph and replayed,
so that a step costs the host one launch instead of one per kernel.

Replaying the optimizer step alone (`trainer.cuda_graphs=optimizer`, runner.run.cuda_graphs) pays
nothing where the host bounds the step: the forward's and backward's launches remain, thousands
a step on DenseNet-161, and a level that cuts the device's work shows none of it. Here the graph
holds what the trainer's eager step does (torch's "whole-network capture", Megatron-Core's
full-iteration graph): the batch copied into the graph's own input tensors, the forward under the
engine's autocast with its cache off (cast copies made during a capture must not outlive it), the
loss, the engine's backward of the scaled loss, the clip, and the engine's step on the device
(`engine.step(wait=False)`: the overflow check, the update or its skip, the loss scale's update
and the skipped-step count, all on the device, no host read), the learning rate read from the
device (`runner.precision.rates`, set from the group's number before each replay). What each
replay changes on the device is what the eager step changes: the weights and the optimizer
state in place, BatchNorm's running statistics (in-place updates the graph records), dropout's
random numbers (the default CUDA generator is graph-safe: each replay draws at the offset the
eager step would have, and moves it on as much). The gradients are made by the captured backward
(set to None first, so they are allocated in the graph's memory pool) and refilled in place at
every replay: no zeroing pass.

As torch's CUDA graphs notes ask, the first `WARMUP_STEPS` steps run eagerly on a side stream
(the last under torch's sync debug mode, which refuses a host read the capture could not hold),
the capture follows on that stream, and every later step is a replay. Steps the graph cannot
take run eagerly beside it, through the trainer's own step: a batch of another shape (the
epoch's last, partial batch), a step an instrument that hooks the forward watches (memory by
kind). Validation is eager. The loss and the verdict come back as device tensors, which the
trainer accumulates and the divergence guard counts as ever. A new value of a number the step
reads as a constant (the rate where torch's own optimizer steps) captures the step again.
Planning refuses what cannot hold before anything is built (`cuda_graphs.refusals`).

README.md beside this file (CUDA graphs) and docs/precision.md tell the story.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from runner.errors import ConfigError
from runner.precision import rates
from runner.run import cuda_graphs

log = logging.getLogger(__name__)

WARMUP_STEPS = cuda_graphs.WARMUP_STEPS  # eager steps on the side stream before the capture

Outputs = tuple[torch.Tensor, Any]  # (the step's loss, fp32 on the device; its verdict)


def _layout(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.stride(), t.device)


class WholeStepGraph:
    """The training step of a run with `trainer.cuda_graphs=step`, called by the trainer with the
    step's batch (x, y) on the device and its watch: returns (loss, verdict) where the graph (or
    its eager warm-up) took the step, None where the trainer must take it eagerly. `batch_size`:
    the full batch, the one shape captured. `clip_norm`: `trainer.grad_clip_norm`."""

    def __init__(
        self,
        engine: Any,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        task: Any,
        criterion: Any,
        batch_size: int,
        clip_norm: Optional[float] = None,
    ):
        self.engine, self.optimizer, self.model = engine, optimizer, model
        self.task, self.criterion = task, criterion
        self.batch_size, self.clip_norm = batch_size, clip_norm
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: tuple[torch.Tensor, ...] = ()  # the graph's own (x, y)
        self.outputs: Optional[Outputs] = None  # what the graph writes at each replay
        self.grads: list[torch.Tensor] = []  # the captured backward's gradients (its pool's)
        self.numbers: tuple = ()  # the step's host numbers the capture holds
        self.eager_steps = self.captures = self.replays = self.beside = 0
        self.capture_s = 0.0  # the captures' seconds (synchronising, recording, instantiating)
        self._live = False  # the captured step read the learning rates from the device
        self._side: Optional[torch.cuda.Stream] = None  # the warm-up's and capture's stream
        # the learning rates on the device, read by the kernels (the eager steps make them)
        self.rates = rates.live_rates(optimizer)

    # ---- the step, as the eager trainer takes it --------------------------------------------
    def _step(self, x: torch.Tensor, y: torch.Tensor) -> Outputs:
        with self.engine.autocast(cache_enabled=False):
            loss = self.task.loss(self.criterion, self.model(x), y)
        self.engine.backward(loss)
        if self.clip_norm:
            self.engine.clip_grad_norm_(self.clip_norm, self.optimizer)
        # the verdict left on the device (a bool tensor, True when stepped; True: no check)
        return loss.detach().float(), self.engine.step(self.optimizer, wait=False)

    # ---- the trainer's call -----------------------------------------------------------------
    def __call__(self, x: torch.Tensor, y: torch.Tensor, watch: Any) -> Optional[Outputs]:
        if not self.takes(x, y, watch):
            self.beside += 1
            return None
        if self.eager_steps < WARMUP_STEPS:
            return self._warm_up(x, y)
        self.rates.refresh()  # (eagerly, before the graph reads them)
        live = self.rates.covers()
        if self._live and not live:  # new param groups: their rates made by an eager step
            return self._warm_up(x, y)
        numbers = cuda_graphs._numbers(self.optimizer, live=live)
        if self.graph is None or numbers != self.numbers:
            self._capture(x, y, numbers)
            self._live = live
        else:
            self._feed(x, y)
        self.graph.replay()
        self.replays += 1
        # tensors of this step's own: the graph's outputs are rewritten by the next replay
        loss, stepped = self.outputs
        return loss.clone(), stepped.clone() if torch.is_tensor(stepped) else stepped

    def takes(self, x: torch.Tensor, y: torch.Tensor, watch: Any) -> bool:
        """Whether the graph (or its warm-up) may take this step: every instrument due at it
        hooks nothing of the step (an every-step or a `replayable` one), and the batch is a
        full one, laid out as the captured one where there is a graph."""
        if not all(i.every_step or i.replayable for i in watch.instruments):
            return False
        if self.graph is None:
            return x.shape[0] == self.batch_size and y.shape[0] == self.batch_size
        return _layout(x) == _layout(self.inputs[0]) and _layout(y) == _layout(self.inputs[1])

    def _stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def _warm_up(self, x: torch.Tensor, y: torch.Tensor) -> Outputs:
        """One eager step on the side stream (its lazy set-up, cuDNN's and cuBLAS's, made on the
        stream the capture uses); the last one under torch's sync debug mode."""
        side, main = self._stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            last = self.eager_steps == WARMUP_STEPS - 1
            outputs = self._checked(x, y) if last else self._step(x, y)
        main.wait_stream(side)
        self.engine.zero_grad(self.optimizer)
        self.eager_steps += 1
        return outputs

    def _checked(self, x: torch.Tensor, y: torch.Tensor) -> Outputs:
        """The step under torch's sync debug mode: a host read (`.item()`, a copy to the host, a
        tensor made from a Python list) is refused before a capture would record the step
        without it."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self._step(x, y)
        except RuntimeError as error:
            if "synchroniz" not in str(error):
                raise
            raise ConfigError(
                cuda_graphs.KEY,
                "step, but the training step reads a device value on the host (the model's "
                "forward, the loss or the engine's step at precision.opt_level="
                f"{self.engine.properties.opt_level}), and a CUDA graph cannot hold a host "
                f"read; torch said: {error}",
                "false or optimizer for this model and level",
            ) from None
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def _feed(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """This step's batch into the graph's input tensors (whose addresses it holds)."""
        self.inputs[0].copy_(x)
        self.inputs[1].copy_(y)

    def _capture(self, x: torch.Tensor, y: torch.Tensor, numbers: tuple) -> None:
        """Capture the step (again where a number it holds changed), on the batch (x, y): the
        capture runs the step's Python once and records its kernels without running them, the
        replay that follows takes this step. The gradients are None before it (the captured
        backward makes them in the graph's pool) and after it (the engine's round is over: an
        eager step beside the graph makes its own)."""
        host = cuda_graphs._host_state(self.optimizer)
        if host is not None:
            raise ConfigError(
                cuda_graphs.KEY,
                f"step, but {host} is changed by each step on the host, and a replayed step "
                "would leave it as captured",
                "false with this optimizer and level",
            )
        if self.graph is None:
            self.inputs = (x.clone(), y.clone())  # (laid out as the batch: its strides kept)
        else:
            self._feed(x, y)
        self.engine.zero_grad(self.optimizer)
        started = time.perf_counter()
        pool = self.graph.pool() if self.graph is not None else None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(
                graph, pool=pool, stream=self._stream(), capture_error_mode="thread_local"
            ):
                outputs = self._step(*self.inputs)
        except RuntimeError as error:
            if "captur" not in str(error):
                raise
            raise ConfigError(
                cuda_graphs.KEY,
                "step, but the training step cannot be captured at this level "
                f"(precision.opt_level={self.engine.properties.opt_level}); torch said: {error}",
                "false or optimizer for this model and level",
            ) from None
        self.grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.engine.zero_grad(self.optimizer)
        again = self.graph is not None
        self.graph, self.outputs, self.numbers = graph, outputs, numbers
        self.captures += 1
        self.capture_s += time.perf_counter() - started
        if again:
            log.info("cuda_graphs: the step's hyperparameters changed: the step captured again")

    def summary(self) -> str:
        return (
            f"cuda_graphs: {self.eager_steps} eager warm-up steps, the whole step captured "
            f"{self.captures} time(s) in {self.capture_s:.1f} s and replayed {self.replays} "
            f"times, {self.beside} steps eager beside it (another batch shape, or watched)"
        )


def whole_step(trainer: Any) -> Optional[WholeStepGraph]:
    """The trainer's WholeStepGraph with `trainer.cuda_graphs=step` (None otherwise); the full
    batch is its training loader's."""
    cfg = trainer.cfg
    if cuda_graphs.mode(cfg.cuda_graphs) != cuda_graphs.STEP:
        return None
    size = getattr(trainer.train_loader, "batch_size", None) or cfg.batch_size
    return WholeStepGraph(
        trainer.engine,
        trainer.optimizer,
        trainer.model,
        trainer.task,
        trainer.criterion,
        size,
        cfg.grad_clip_norm,
    )
