"""The training loop: train, then validate, each epoch; measures what the MLflow contract names.

A step is forward, backward, clip, step, schedule, zero_grad (with `trainer.accumulate_grad_batches`
k, forward and backward over k batches before the step), watched by `runner.measure`'s
instruments (entered once per step); the hot path holds no MLflow call and no host sync beyond
the engine's found-inf read: losses accumulate on the device and are read every
`log_every_n_steps` steps. The trainer's other jobs have their own modules: the divergence guard
(`divergence`), the checkpoints (`checkpointer`), the compile warm-up (`compile_warmup`).
README.md beside this file tells the whole story.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch import nn
from tqdm.auto import tqdm

from runner import metrics as m
from runner.config import TrainerConfig
from runner.errors import DataError
from runner.measure.instruments import Watch
from runner.measure.memory import MemoryInstrument
from runner.measure.probes import Stopwatch
from runner.run import cuda_graphs, fsdp, rng, time_left, watch, whole_step
from runner.run.batches import limit_batches
from runner.run.checkpointer import trainer_state
from runner.run.compile_warmup import audit_eager, compile_warmup
from runner.run.context import FitResult, RunContext
from runner.run.distributed import unwrap
from runner.run.divergence import DivergenceGuard
from runner.run.interrupts import RunInterrupted
from runner.run.parts import Parts
from runner.run.validation import evaluate
from runner.tasks.base import class_indices, target_problem

log = logging.getLogger(__name__)

NON_TERMINAL_BAR_S = 30.0  # a progress bar written to a file or pipe: a line at most this often


def bar_interval_s() -> float:
    """How often the progress bar redraws: tqdm's 0.1 s on a terminal; written to a file or a
    pipe (a SLURM job's output, `| tee`), where every redraw stays as a line, every
    NON_TERMINAL_BAR_S seconds (a fast GPU epoch at 0.1 s wrote ~3.6 MB of them an hour)."""
    stream = sys.stderr
    try:
        return 0.1 if stream is not None and stream.isatty() else NON_TERMINAL_BAR_S
    except (AttributeError, ValueError):  # (a replaced or closed stream)
        return NON_TERMINAL_BAR_S


# PyTorch warns when a scheduler steps before the optimizer ever did; a skipped first step (an
# overflow at the initial loss scale) is expected, and the schedule must still advance.
_SCHEDULER_ORDER_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


def trainer_config(node) -> TrainerConfig:
    """The typed trainer settings from the composed `trainer` node (or a TrainerConfig): the
    schema's defaults are the only ones."""
    if isinstance(node, TrainerConfig):
        return node
    return TrainerConfig(**OmegaConf.to_container(node, resolve=True))


class Trainer:
    """Trains `parts` as `cfg` (the config's `trainer` node, or its TrainerConfig) says on
    `device`, its results sent where `context` says (None: metrics and files nowhere, no
    checkpoints). `model`: the model to train through (e.g. DDP-wrapped; default: the parts')."""

    def __init__(
        self,
        cfg: TrainerConfig | Any,
        parts: Parts,
        context: Optional[RunContext] = None,
        *,
        device: torch.device,
        model: Optional[nn.Module] = None,
    ):
        self.cfg = cfg = trainer_config(cfg)
        self.device = device
        self.context = context if context is not None else RunContext()
        self.comm = self.context.comm
        # the model trained through, and the model itself (evaluation, checkpoints; FSDP2 or not)
        self.model = model if model is not None else parts.model
        self.module = unwrap(self.model)
        self.sharded = fsdp.is_sharded(self.module)
        # what a step uses: the precision engine, the optimizer and its schedule, task and loss
        self.engine, self.optimizer, self.scheduler = parts.engine, parts.optimizer, parts.scheduler
        self.task, self.criterion = parts.task, parts.criterion
        # what a batch's targets may be (class indices of the model's outputs), read on the host
        self.indices = class_indices(self.criterion, getattr(parts.bundle, "num_classes", None))
        # the data, and the batches per epoch after trainer.limit_*_batches
        self.train_loader, self.val_loader = parts.train_loader, parts.val_loader
        self.train_batches = limit_batches(len(self.train_loader), cfg.limit_train_batches)
        self.val_batches = limit_batches(len(self.val_loader), cfg.limit_val_batches)
        # gradient accumulation: 16-bit gradients are unscaled into fp32 after each batch of a
        # step but its last (summed there, not in the half type), so each batch's are reduced
        # over the ranks; fp32 ones add up in place, reduced once, at the step's last batch
        self.half_grads = any(
            p.dtype not in (torch.float32, torch.float64)
            for p in self.module.parameters()
            if p.requires_grad
        )
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        self.defer_sync = ddp and not self.half_grads
        # progress: where training starts (a resumed run's: restore()), the best, the epochs'
        self.epochs_done = self.batches_done = self.global_step = 0
        self.best = self.task.worst
        self.history: list[dict[str, float]] = []
        self.elapsed_before = 0.0  # training seconds of earlier sessions of this run
        self.fit_started = time.perf_counter()  # (fit's own start, once it starts)
        self.rng_at_start: Optional[dict] = None  # a resumed run's RNG at the start
        # the epoch clock (device-synchronised) and the peak-memory probe
        self.clock, self.memory = Stopwatch(device), parts.memory
        # the divergence guard: skipped steps, non-finite losses, a collapsed loss scale
        self.guard = DivergenceGuard(cfg, self.engine, device)
        # what watches a step: its time, memory by kind, the range probe, the layer audit
        self.layer_plan = getattr(self.engine, "layer_plan", None)
        self.flops_per_sample = parts.flops_per_sample  # counted in planning (None: unknown)
        self.instruments = watch.instruments(self, watch.diagnostics(self), audit=True)
        # trainer.cuda_graphs: the clip and step (optimizer), the whole step (step), replayed
        self.step_graph = cuda_graphs.step_graph(cfg, self.engine, self.optimizer, self.module)
        self.whole_step = whole_step.whole_step(self)

    # ---- one step ---------------------------------------------------------------------------
    def train_step(
        self, x: torch.Tensor, y: torch.Tensor, *more: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """One training step on the batch (x, y), and with gradient accumulation the step's
        `more` batches, each loss divided by their count so that the gradients are those of
        their mean; watched by the instruments due at it (which observe the first batch's
        forward and backward). Returns the loss (the mean over the batches; fp32, detached, on
        the device). With `trainer.cuda_graphs=optimizer` the clip and step are replayed
        (runner.run.cuda_graphs); with `step` the whole step, where runner.run.whole_step can."""
        with self.instruments.step(self.global_step + 1) as watch:
            graph = self.whole_step
            taken = graph(x, y, watch) if graph is not None and not more else None
            if taken is None:
                loss, stepped = self._eager_step(((x, y), *more), watch)
            else:
                loss, stepped = taken
                watch.after_backward()
            watch.after_step(stepped)
            self._step_scheduler(stepped)
            if taken is None:  # (a graph's gradients are its own: refilled by each replay)
                self.engine.zero_grad(self.optimizer)
        return self.guard.after_step(loss, stepped)

    def _eager_step(
        self, batches: tuple[tuple[torch.Tensor, torch.Tensor], ...], watch: Watch
    ) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """Forward and backward over the step's batches (accumulating: several, each loss a
        share of their mean), then clip and step: (the loss, the engine's verdict)."""
        losses = []
        for x, y in batches:
            with self._accumulating(len(losses), len(batches), watch):
                with self.engine.autocast():
                    loss = self.task.loss(self.criterion, self.model(x), y)
                self.engine.backward(loss / len(batches) if len(batches) > 1 else loss)
            losses.append(loss.detach().float())
        if self.step_graph is not None:  # clip and step, replayed (runner.run.cuda_graphs)
            stepped = self.step_graph()
        else:
            if self.cfg.grad_clip_norm:
                self.engine.clip_grad_norm_(self.cfg.grad_clip_norm, self.optimizer)
            stepped = self.engine.step(self.optimizer, wait=False)  # (a device verdict)
        return (torch.stack(losses).mean() if len(losses) > 1 else losses[0]), stepped

    @contextlib.contextmanager
    def _accumulating(self, index: int, count: int, watch: Watch) -> Iterator[None]:
        """Around the forward and backward of batch `index` of a step's `count`: the instruments
        observe the first (its hooks removed after its backward); before the last, the gradients
        are kept from DDP's all-reduce where they add up in place (fp32: reduced once, with the
        last), or else unscaled into the fp32 sum the engine keeps (16-bit gradients)."""
        last = index + 1 == count
        with self.model.no_sync() if self.defer_sync and not last else contextlib.nullcontext():
            yield
        if index == 0:
            watch.after_backward()
        if not last and self.half_grads:
            self.engine.unscale_(self.optimizer)

    def to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch (x, y) on the trainer's device as a step takes it (its targets checked first:
        DataError; channels_last images where the run asks for it)."""
        problem = target_problem(y, self.indices, self.task.target_dims)
        if problem is not None:
            raise DataError(problem)
        x = x.to(self.device, non_blocking=True)
        if self.cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def _step_scheduler(self, stepped: bool | torch.Tensor) -> None:
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            if stepped is not True:  # (a device verdict is not read: muted either way)
                warnings.filterwarnings("ignore", message=_SCHEDULER_ORDER_WARNING)
            self.scheduler.step()

    # ---- epochs -----------------------------------------------------------------------------
    def _stop_flag(self) -> torch.Tensor:
        stop = self.context.stop
        return torch.tensor(float(stop is not None and stop.requested), device=self.device)

    def _lr(self) -> float | torch.Tensor:
        """The first parameter group's learning rate now: read before a logging step, it is the
        rate that step trains with (the schedule moves on after the step). A tensor in torchao's
        optimizers, which a scheduler fills in place: copied on its device, not read (a sync)."""
        lr = self.optimizer.param_groups[0]["lr"]
        return lr.detach().clone() if torch.is_tensor(lr) else float(lr)

    def _log_train_loss(
        self, window: torch.Tensor, count: int, bar, lr: float | torch.Tensor | None = None
    ) -> bool:
        """The periodic host read: the mean loss (over the ranks), the non-finite-loss and
        skipped-step streaks and the stop request (their maxima over the ranks, so that all ranks
        act alike), in one transfer; the divergence guard checks them here; `lr` is the logging
        step's own rate (`_lr` before it). The first read logs the memory by kind of the step
        measured (once). Returns whether the run is asked to stop."""
        mean = self.comm.sum_(window / count) / self.comm.world_size
        guard = self.guard
        read = (guard.bad_loss_streak, guard.skips, self._stop_flag(), guard.bad_inputs)
        flags = self.comm.max_(torch.stack([t.to(window.dtype) for t in read]))
        value, bad_losses, skips, stop, bad_inputs = torch.cat([mean.reshape(1), flags]).tolist()
        guard.inputs_read(int(bad_inputs), self.global_step)
        guard.check_skips(self.global_step, int(skips))
        guard.check_losses(bad_losses, self.global_step)
        lr = float(self._lr() if lr is None else lr)
        memory = self.instruments.find(MemoryInstrument)  # (memory by kind: once measured)
        measured = memory.epoch_metrics() if memory is not None else {}
        self.context.on_metrics({m.TRAIN_LOSS: value, m.LR: lr, **measured}, self.global_step)
        bar.set_postfix(loss=f"{value:.4f}", scale=f"{self.engine.loss_scale:g}", refresh=False)
        return stop > 0

    def _reads_at(self, step: int) -> bool:
        """Whether the periodic host read follows step `step`: every `log_every_n_steps`
        steps, and after the first step, so that a run stopped or killed early (a slow step on
        a CPU, a dead node) has its loss and memory by kind from its first step on."""
        return step % self.cfg.log_every_n_steps == 0 or step == 1

    def _stop_requested_now(self) -> bool:
        """Between periodic reads: a single process acts on a signal at the next step; ranks of
        a distributed run agree at the periodic reads instead (a collective per step would cost)."""
        stop = self.context.stop
        return not self.comm.active and stop is not None and stop.requested

    def _interrupted(self, epochs_done: int, batches_done: int) -> RunInterrupted:
        where = self._save(epochs_done, batches_done)
        # the signal this rank got, or (another rank's request) SIGTERM, what torchrun forwards
        stop = self.context.stop
        signum = stop.signum if stop is not None and stop.signum else signal.SIGTERM
        return RunInterrupted(int(signum), where)

    def train_epoch(self, epoch: int, skip: int = 0) -> tuple[float, int, int]:
        """Returns (seconds, samples, items over all ranks) for one pass over the training
        batches, starting after the first `skip` (an interrupted epoch, resumed); items are the
        task's predictions (samples, or a language model's tokens)."""
        self.model.train()
        sampler = getattr(self.train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):  # the epoch's order, minus what was already trained
            sampler.set_epoch(epoch)
            sampler.skip = skip * (self.train_loader.batch_size or 1)
        window = torch.zeros((), device=self.device)
        count = samples = items = 0
        lr = None
        bar = tqdm(
            total=self.train_batches,
            initial=skip,
            desc=f"epoch {epoch}/{self.cfg.max_epochs}",
            unit="batch",
            disable=not self.cfg.progress_bar or not self.comm.is_main,
            dynamic_ncols=True,
            mininterval=bar_interval_s(),
        )
        self.clock.start()
        self.instruments.start_epoch(epoch)
        with bar:
            for done, group in self._step_batches(skip):
                batches = [self.to_device(x, y) for x, y in group]
                for x, _ in batches:
                    self.guard.watch_inputs(x)  # (inf/NaN in the data: counted on the device)
                if self._reads_at(self.global_step + 1) or done == self.train_batches:
                    lr = self._lr()  # a logging step's own rate, before the schedule moves on
                window += self.train_step(*batches[0], *batches[1:])
                count += 1
                n = sum(y.shape[0] for _, y in batches)
                k = sum(self.task.items(y) for _, y in batches)
                samples, items = samples + n, items + k
                self.global_step += 1
                self.instruments.counted(self.global_step, n, k)
                stop = False
                if self._reads_at(self.global_step):
                    stop = self._log_train_loss(window, count, bar, lr)
                    window.zero_()
                    count = 0
                bar.update(len(batches))
                if (stop or self._stop_requested_now()) and done < self.train_batches:
                    if count:  # (a single process stops between reads: their loss is kept)
                        self._log_train_loss(window, count, bar)
                    # what the epoch measured so far (its step times), kept with the run
                    self.context.on_metrics(self.instruments.epoch_metrics(), epoch)
                    raise self._interrupted(epoch - 1, done)
            if count:  # short epochs still report their loss
                self._log_train_loss(window, count, bar, lr)
        self.instruments.steps_done()
        seconds = self.clock.stop()
        totals = self.comm.sum_(torch.tensor([float(samples), float(items)], device=self.device))
        samples_total, items_total = totals.tolist()
        return seconds, int(samples_total), int(items_total)

    def _step_batches(self, skip: int) -> Iterator[tuple[int, list]]:
        """The epoch's training batches after the first `skip`, in the groups a step trains on
        (`trainer.accumulate_grad_batches` batches, counted from the epoch's first; the last may
        be fewer), each with the count of the epoch's batches done after it (an interrupt
        between steps saves it, so a resumed run starts at a group's first batch)."""
        every, group, done = self.cfg.accumulate_grad_batches, [], skip
        for done, batch in enumerate(self.train_loader, start=skip + 1):
            if done > self.train_batches:
                return
            group.append(batch)
            if done % every == 0 or done == self.train_batches:
                yield done, group
                group = []
        if group:  # (a loader that ran out before the batches it counted)
            yield done, group

    def fit(self) -> FitResult:
        """Train the epochs left (a resumed run's, from where it stopped), each validated,
        measured, logged and checkpointed; then the task's best and the run's training time."""
        self._start()
        save_s = 0.0  # an epoch's share of the last checkpoint's write, part of its pace
        for epoch in range(self.epochs_done + 1, self.cfg.max_epochs + 1):
            save_s = self._epoch(epoch, save_s)
        return self._finish()

    def _start(self) -> None:
        """Before the first epoch: the clock, a resumed run's random state, the compile warm-up
        (and a compiled run's eager layer audit)."""
        self.fit_started = time.perf_counter()
        accumulate = self.cfg.accumulate_grad_batches
        if accumulate > self.train_batches and self.comm.is_main:  # (said by the run alone)
            log.warning(
                "trainer.accumulate_grad_batches=%d is more than an epoch's %d batches: each "
                "epoch is one step, of %d",
                accumulate,
                self.train_batches,
                self.train_batches,
            )
        if self.rng_at_start is not None:  # a resumed run draws what the uninterrupted one would
            rng.restore_rng(self.rng_at_start)
        if self.cfg.compile:
            seconds = compile_warmup(self)
            log.info(
                "torch.compile: the training step compiled in %.1f s (compile_time_s, not "
                "counted in epoch_time_s)",
                seconds,
            )
            self.context.on_metrics({m.COMPILE_TIME_S: seconds}, self.global_step)
            if self.global_step == 0:
                audit_eager(self)

    def _epoch(self, epoch: int, save_s: float) -> float:
        """Epoch `epoch`: train, validate, log its metrics and line, check the weights, stop if
        asked, checkpoint when due. Returns its share of the checkpoint's write time (`save_s`:
        the last one's, part of the pace the time left is told at)."""
        skip, self.batches_done = self.batches_done, 0
        seconds, samples, items = self.train_epoch(epoch, skip)
        trained = time.perf_counter()
        val_loss, val_acc = evaluate(self)
        metrics = self._epoch_metrics(val_loss, val_acc, seconds, samples, items)
        self.context.on_metrics(metrics, epoch)
        self.instruments.end_epoch()  # the diagnostics' and the audit's files
        self.history.append(metrics)
        value = val_acc if self.task.maximize else val_loss
        if self.task.better(value, self.best):
            self.best = value
        pace = time_left.epoch_seconds(
            seconds,  # (the epoch's training, wall-clock)
            time.perf_counter() - trained,
            save_s,
            self.train_batches - skip,
            self.train_batches,
        )
        log.info(
            "epoch %d/%d: %s  peak mem %.0f MB  loss scale %g  skipped %d%s",
            epoch,
            self.cfg.max_epochs,
            self.task.epoch_summary(metrics),
            metrics[m.PEAK_MEM_MB],
            metrics[m.LOSS_SCALE],
            self.engine.skipped_steps,
            time_left.time_left(pace, self.cfg.max_epochs - epoch),
        )
        self.guard.check_weights(self.weights_finite(), epoch, self.global_step)
        last = epoch == self.cfg.max_epochs
        if bool(self.comm.max_(self._stop_flag()).item()) and not last:
            raise self._interrupted(epoch, 0)
        every = self.cfg.checkpoint_every_n_epochs
        if every and (epoch % every == 0 or last):
            saving = time.perf_counter()
            self._save(epoch, 0)
            save_s = (time.perf_counter() - saving) / every  # (an epoch's share of it)
        return save_s

    def _epoch_metrics(
        self, val_loss: float, val_acc: float, seconds: float, samples: int, items: int
    ) -> dict[str, float]:
        """An epoch's metrics: the task's (validation, throughput), peak memory over the ranks,
        the loss scale and skipped steps, the instruments' (memory by kind), the RSS growth."""
        peak = self.comm.max_(torch.tensor(self.memory.peak_mb(), device=self.device)).item()
        return {
            **self.task.epoch_metrics(val_loss, val_acc, seconds, samples, items),
            m.PEAK_MEM_MB: peak,
            m.LOSS_SCALE: self.engine.loss_scale,
            m.SKIPPED_STEPS: float(self.engine.skipped_steps),
            **self.instruments.epoch_metrics(),  # memory by kind, once per measurement
            # on a CPU: `rss_growth_mb`, the process's resident-memory growth
            **({} if (rss := self.memory.rss_growth_mb()) is None else {m.RSS_GROWTH_MB: rss}),
        }

    def _finish(self) -> FitResult:
        """After the last epoch: the task's best and the training time logged, and returned
        with the epochs' history (their rates: the task's run_speed says them)."""
        graphs = self.step_graph or self.whole_step
        if graphs is not None:
            log.info(graphs.summary())
        train_time = self.elapsed_before + time.perf_counter() - self.fit_started
        best = self.best if not math.isinf(self.best) else math.nan
        self.context.on_metrics(
            {self.task.objective: best, m.TRAIN_TIME_S: train_time}, self.cfg.max_epochs
        )
        return FitResult(
            best_val_acc=best if self.task.maximize else math.nan,
            train_time_s=train_time,
            epochs=self.history,
            best_val_loss=math.nan if self.task.maximize else best,
            objective=self.task.objective,
        )

    # ---- checkpoints ------------------------------------------------------------------------
    def weights_finite(self) -> bool:
        """Whether every floating parameter and buffer of the model is finite (one host read).
        A non-finite loss reaches the weights before the divergence guard's next read (O0 and
        the bf16 presets skip no step), and such weights must never replace the last good
        checkpoint."""
        tensors = [
            fsdp.local(t.detach())
            for t in (*self.module.parameters(), *self.module.buffers())
            if t.is_floating_point() and t.numel()
        ]
        finite = (
            torch.stack([torch.isfinite(t).all() for t in tensors if t.numel()]).all()
            if tensors
            else torch.tensor(True)
        )
        if self.sharded:  # every rank's shards: one verdict for all (all take part in the save)
            finite = (
                self.comm.max_((~finite).to(torch.float32, copy=True).to(self.device).reshape(1))
                == 0
            )
        return bool(finite.all().item())

    def _save(self, epochs_done: int, batches_done: int) -> str | None:
        """The state to the checkpoints after `epochs_done` epochs and `batches_done` batches of
        the next (every rank of a sharded run takes part); where it went, or None."""
        checkpoints = self.context.checkpointer
        writes = checkpoints is not None and checkpoints.writes
        if not writes and not self.sharded:
            return None  # (a sharded run's ranks all gather the state rank 0 writes)
        after = f"epoch {epochs_done}" + (f" and {batches_done} batches" if batches_done else "")
        if not self.weights_finite():
            log.warning(
                "No checkpoint written after %s: the model's weights are inf/NaN (the run "
                "is diverging); the last checkpoint, if any, is the last good state",
                after,
            )
            return None
        state = trainer_state(self, epochs_done, batches_done)
        if not writes:
            return None
        where = checkpoints.save(state)
        log.info("Checkpoint: %s (after %s)", where, after)
        return where
