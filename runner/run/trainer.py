"""The training loop: train, then validate, each epoch; measures what the MLflow contract names.

The hot path of a step holds no MLflow call and no host sync beyond the engine's single found-inf
read: losses accumulate on the device and are read every `log_every_n_steps` steps.

Divergence guard: `trainer.max_bad_steps` consecutive skipped steps, or consecutive non-finite
losses, stop the run with a `DivergenceError`. Skips are known on the host for free (the engine's
step returns False), so they are caught at the step they reach the limit. Non-finite losses are
counted on the device (a counter reset by every finite loss, no sync) and the counter is read
together with the loss at the periodic reads (every `log_every_n_steps` steps and at the end of an
epoch), so that detection can lag by up to `log_every_n_steps` steps. A dynamic loss scale that
falls below `trainer.collapsed_loss_scale` while steps keep overflowing also stops the run.

Checkpoints and interrupts: after every `trainer.checkpoint_every_n_epochs` epochs, and when a
SIGINT/SIGTERM asks the run to stop (after the step in progress), the checkpointer gets the whole
state (runner.run.checkpoint). A resumed run continues at the epoch and batch it stopped at: the
training order of an epoch depends only on the seed and the epoch (runner.components.data's
EpochSampler),
so the batches an interrupted epoch already trained on are skipped, not repeated.

Under torchrun (runner.run.distributed) every rank runs this loop on its shard; the metrics are
reduced across ranks at the periodic reads (loss mean, non-finite streak and stop requests),
after validation (loss and accuracy sums) and per epoch (samples, peak memory), and only rank 0's
sink logs them.

Memory by kind (runner.measure.memory): the first training step of a session runs under an
activation
meter (the bytes autograd saves for backward) and, after its optimizer step, the weights, masters,
gradients and optimizer state are counted from the tensors; a step that was skipped (no optimizer
state yet) is counted again at the next step, until one steps. The `mem_*_mb` metrics go out with
the epoch's metrics; on a CPU the total is also `peak_mem_mb` (runner.measure.probes), and the
process's
resident-memory growth is `rss_growth_mb`. Neither reads the device: no sync.

Range diagnostics (runner.measure.diagnostics), with `trainer.diagnose_every_n_steps` = n > 0:
steps 1,
1 + n, 1 + 2n, ... run with a probe's hooks on the model's layers, installed before the forward
and removed after the backward (other steps carry no hook; with n = 0 none is ever made). The
probe is read once per diagnosed step (one host sync) and its `diag_*` metrics logged at that
step; `diagnostics/layers.csv`, `exponents.csv` and `grad_exponents.png` go to the artifact sink
after each epoch that diagnosed a step.

What ran where (runner.measure.audit): the run's first step (with `trainer.compile`, an eager
forward and backward of the first batch before the first epoch, undone; not again in a resumed
session, whose plan its checkpoint's was checked against) and every diagnosed step
carry the layer audit's forward hooks, which record each layer's dtypes (no device read); they are
compared with the engine's layer plan (runner.precision.layers): `layers_off_plan` and the layers
per format as metrics, `layers/layers_ran.csv` and its figure, a warning per layer that ran off
plan, an error with precision.strict.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf
from torch import nn
from tqdm.auto import tqdm

from runner.config import TrainerConfig
from runner.errors import DivergenceError, LayerPlanError
from runner.measure import audit as layer_audit
from runner.measure import diagnostics as diag
from runner.measure import memory as mem
from runner.measure.probes import MemoryProbe, Stopwatch
from runner.precision.state import load_optimizer_state
from runner.run import checkpoint, fsdp, rng
from runner.run.distributed import Comm, unwrap
from runner.run.interrupts import RunInterrupted, StopRequest
from runner.tasks import Classification, Task
from runner.tracking import metrics as m

log = logging.getLogger(__name__)

MetricsSink = Callable[[Mapping[str, float], int], None]

# PyTorch warns when a scheduler steps before the optimizer ever did; a skipped first step (an
# overflow at the initial loss scale) is expected, and the schedule must still advance.
_SCHEDULER_ORDER_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


@dataclass
class FitResult:
    best_val_acc: float  # a classifier's (nan for a language model)
    train_time_s: float
    epochs: list[dict[str, float]] = field(default_factory=list)
    best_val_loss: float = math.nan  # a language model's (nan for a classifier)
    objective: str = m.BEST_VAL_ACC  # the task's: what `best` is, and a sweep optimises

    @property
    def best(self) -> float:
        """The task's objective: best_val_acc (maximised) or best_val_loss (minimised)."""
        return self.best_val_loss if self.objective == m.BEST_VAL_LOSS else self.best_val_acc


def limit_batches(n_batches: int, limit: int | None) -> int:
    """Batches per epoch after `trainer.limit_*_batches` (None: all)."""
    return n_batches if limit is None else min(n_batches, limit)


Checkpointer = Callable[[dict], str]  # writes a checkpoint state, returns where


@dataclass
class RunContext:
    """Where the trainer's results go and what it answers to, in one object: the metrics sink
    (e.g. Run.log_metrics, runner.tracking.base), the process group, the checkpoint writer
    (None: this rank writes none), the stop request (SIGINT/SIGTERM), and the sink for the files
    it writes (the diagnostics; e.g. Run.log_file), written under `artifact_dir` (None: a
    temporary folder)."""

    on_metrics: MetricsSink
    comm: Comm = field(default_factory=Comm)
    checkpointer: Optional[Checkpointer] = None
    stop: Optional[StopRequest] = None
    on_artifact: Optional[diag.ArtifactSink] = None
    artifact_dir: Optional[Path] = None
    layers_dir: Optional[Path] = None  # the audit's files (layers_ran.csv); None: a temporary one


def trainer_config(node) -> TrainerConfig:
    """The typed trainer settings from the composed `trainer` node (or a TrainerConfig): the
    schema's defaults are the only ones."""
    if isinstance(node, TrainerConfig):
        return node
    return TrainerConfig(**OmegaConf.to_container(node, resolve=True))


def layer_plan_state(plan) -> dict:
    """What a checkpoint keeps of the layer plan: every layer's planned format (a resume must
    plan the same) and the entries that made it (a resumed `layer_plan=auto` run takes them
    instead of measuring again)."""
    return {"layers": plan.formats(), "rules": [rule.as_list() for rule in plan.rules]}


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
        cfg: TrainerConfig,
        memory: MemoryProbe,
        context: RunContext,
        criterion: nn.Module | None = None,
        task: Task | None = None,
    ):
        """`cfg`: the trainer settings (a TrainerConfig, or the composed `trainer` node);
        `context`: where results go (RunContext); `task`: what a batch is, the loss and the
        metrics (runner.tasks; default: classification)."""
        self.model = model  # possibly DistributedDataParallel: the forward of training
        self.module = unwrap(model)  # the model itself: evaluation, checkpoints
        self.sharded = fsdp.is_sharded(self.module)  # FSDP2 (runner.run.fsdp)
        self.context = context
        self.comm = context.comm
        self.checkpointer = context.checkpointer  # None: this rank writes none
        self.stop = context.stop
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.engine = engine
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.device = device
        self.cfg = cfg = trainer_config(cfg)
        self.on_metrics = context.on_metrics
        self.memory = memory
        # the loss (runner.components.losses.build_loss: the `loss` group); cross-entropy by default
        self.criterion = criterion if criterion is not None else nn.CrossEntropyLoss()
        self.task = task if task is not None else Classification()
        self.train_batches = limit_batches(len(train_loader), cfg.limit_train_batches)
        self.val_batches = limit_batches(len(val_loader), cfg.limit_val_batches)
        self.global_step = 0
        self.clock = Stopwatch(device)
        self.max_bad_steps = cfg.max_bad_steps
        self.skip_streak = 0  # consecutive skipped steps (host-side: engine.step says so)
        # consecutive non-finite losses up to the last step, kept on the device (no sync)
        self.bad_loss_streak = torch.zeros((), dtype=torch.int64, device=device)
        # where training starts (a resumed run: after `epochs_done` epochs and `batches_done`
        # batches of the next one), what it has seen so far, and the RNG to restore at the start
        self.epochs_done = 0
        self.batches_done = 0
        self.best = self.task.worst  # the task's objective so far (accuracy, or loss)
        self.history: list[dict[str, float]] = []
        self.elapsed_before = 0.0  # training seconds of earlier sessions of this run
        self._rng_at_start: dict | None = None
        # memory by kind: measured on the first step of the session that steps (see the docstring)
        self.memory_parts: Optional[mem.MemoryByKind] = None
        self._memory_final = False
        self._memory_logged = False
        # what ran where (runner.measure.audit): each layer's dtypes on the run's first step and
        # on diagnosed steps, against the engine's layer plan
        self.layer_plan = getattr(engine, "layer_plan", None)
        self._audited = False  # the first step's audit is done
        self._audit_files = False  # layers_ran.csv was started by this trainer
        self._audit_last = None  # (rows, step) of an audit not drawn and logged yet
        self._off_plan_told: set[str] = set()
        every = cfg.diagnose_every_n_steps
        self.diagnostics: Optional[diag.RunDiagnostics] = None
        if every > 0:
            formats = diag.run_formats(engine.properties.compute_dtypes)
            self.diagnostics = diag.RunDiagnostics(
                every, formats, context.artifact_dir, context.on_artifact
            )

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
        step = self.global_step + 1
        probe = (
            self.diagnostics.probe(self.module)
            if self.diagnostics is not None and self.diagnostics.due(step)
            else None
        )
        meter = (
            None
            if self._memory_final
            else mem.ActivationMeter(
                mem.model_state_tensors(self.module, self.engine, self.optimizer)
            )
        )
        # the run's first step (a resumed session's plan was checked against its checkpoint)
        first = step == 1 and not (self._audited or self.cfg.compile)
        audit = self._audit() if probe is not None or first else None
        with contextlib.ExitStack() as around:  # the meter's, probe's, audit's hooks: this step
            if meter is not None:
                around.enter_context(meter)
            if probe is not None:
                around.enter_context(probe)
            if audit is not None:
                around.enter_context(audit)
            with self.engine.autocast():
                loss = self.task.loss(self.criterion, self.model(x), y)
            self.engine.backward(loss)
            if probe is not None:
                probe.observe_weight_grads()  # as stored: scaled by the loss scale
            if audit is not None:
                audit.observe_grads()
        if audit is not None:
            self._record_audit(audit, step)
        if probe is not None:
            records = self.diagnostics.collect(probe, step, self.engine.loss_scale)
            self.on_metrics(self.diagnostics.metrics(records), step)
        if self.cfg.grad_clip_norm:
            self.engine.clip_grad_norm_(self.cfg.grad_clip_norm, self.optimizer)
        stepped = self.engine.step(self.optimizer)
        if meter is not None:
            self._measure_memory(meter.bytes, stepped)
        self._step_scheduler(stepped)
        self.engine.zero_grad(self.optimizer)
        loss = loss.detach().float()
        # +1 on a non-finite loss, back to 0 on a finite one; stays on the device.
        self.bad_loss_streak.add_(1).mul_(~torch.isfinite(loss))
        self.skip_streak = 0 if stepped else self.skip_streak + 1
        return loss

    # ---- what ran where -----------------------------------------------------------------------
    def _audit(self) -> Optional[layer_audit.DtypeAudit]:
        """A dtype audit of the plan's layers (None without a plan: an engine made elsewhere)."""
        if self.layer_plan is None:
            return None
        return layer_audit.DtypeAudit(
            [(layer.name, self.module.get_submodule(layer.name)) for layer in self.layer_plan]
        )

    def audit_eager(self) -> None:
        """With `trainer.compile`: the audit of one eager forward and backward of the first batch
        (hooks inside the compiled graph would recompile it), after which the gradients, the
        buffers and every random generator are put back, as after the compile warm-up. The
        dtypes are the compiled step's: torch.compile keeps each op's dtype."""
        audit = self._audit()
        if audit is None:
            return
        snapshot = self._snapshot()
        try:
            self.model.train()
            x, y = next(iter(self.train_loader))
            x, y = self._to_device(x, y)
            call = getattr(self.module, "_call_impl", self.module)  # eager, compiled or not
            with audit:
                with self.engine.autocast():
                    loss = self.task.loss(self.criterion, call(x), y)
                self.engine.backward(loss)
                audit.observe_grads()
            self.engine.zero_grad(self.optimizer)
        finally:
            self._restore_snapshot(snapshot)
        self._record_audit(audit, self.global_step + 1)

    def _layers_folder(self) -> Path:
        folder = self.context.layers_dir
        if folder is None:
            import tempfile

            folder = self.context.layers_dir = Path(tempfile.mkdtemp(prefix="amp-runner-layers-"))
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _record_audit(self, audit: layer_audit.DtypeAudit, step: int) -> None:
        """Compare the audited step with the plan: `layers_off_plan` and the count of layers per
        observed format as metrics, a row per layer appended to `layers/layers_ran.csv` (and,
        for the session's first audit, its figure and both files logged now; later audits' at
        the end of their epoch), a warning naming each layer that ran off plan (the first time it
        does), an error in strict mode."""
        first = not self._audit_files
        self._audited = True
        rows = self.layer_plan.compare(audit.read())
        off = [r for r in rows if r["off_plan"]]
        metrics = {m.LAYERS_OFF_PLAN: float(len(off))}
        metrics.update({f"{m.LAYERS_IN}{k}": float(v) for k, v in layer_audit.counts(rows).items()})
        self.on_metrics(metrics, step)
        if self.comm.is_main:
            layer_audit.write_csv(
                self._layers_folder() / layer_audit.LAYERS_RAN_CSV,
                rows,
                step,
                append=self._audit_files,
            )
            self._audit_files = True
            self._audit_last = (rows, step)
            if first:  # the figure now; later audits' at the end of their epoch
                self.write_audit()
        new = [r for r in off if r["layer"] not in self._off_plan_told]
        self._off_plan_told.update(r["layer"] for r in new)
        if new:
            text = layer_audit.summary(new)
            if self.layer_plan.strict:
                raise LayerPlanError(
                    f"{len(new)} layer(s) ran off plan at step {step} (precision.strict=true):\n"
                    f"{text}"
                )
            log.warning(
                "What ran where, step %d: %d layer(s) ran off plan:\n%s", step, len(new), text
            )
        elif first:
            log.info(
                "What ran where, step %d: every layer ran as planned (%s)",
                step,
                ", ".join(f"{v} {k}" for k, v in layer_audit.counts(rows).items() if v),
            )

    def write_audit(self) -> None:
        """The figure of the latest audited step, then `layers_ran.csv` and the figure to the
        artifact sink (under `layers/`); nothing when no step was audited since the last call."""
        if self._audit_last is None:
            return
        rows, step = self._audit_last
        self._audit_last = None
        folder = self._layers_folder()
        figure = layer_audit.plot(
            folder / layer_audit.LAYERS_RAN_PNG, rows, f"What ran where at step {step}"
        )
        if self.context.on_artifact is not None:
            for path in (folder / layer_audit.LAYERS_RAN_CSV, figure):
                self.context.on_artifact(path, layer_audit.ARTIFACT_DIR)

    def _measure_memory(self, activations: int, stepped: bool) -> None:
        """Memory by kind after the optimizer step, before zero_grad (the gradients still held);
        final once a step was taken (a skipped one has no optimizer state yet)."""
        self.memory_parts = mem.measure(self.module, self.optimizer, self.engine, activations)
        self.memory.record_tensors(self.memory_parts.total / mem.MB)
        self._memory_final = stepped
        self._memory_logged = False

    def _memory_metrics(self) -> dict[str, float]:
        """The `mem_*_mb` figures once per measurement, and `rss_growth_mb` on a CPU."""
        out: dict[str, float] = {}
        if self.memory_parts is not None and not self._memory_logged:
            out.update(self.memory_parts.metrics())
            if self.sharded:  # what one unit's all-gather holds besides the shards
                out[m.MEM_ALLGATHER_MB] = fsdp.allgather_bytes(self.module) / mem.MB
            self._memory_logged = self._memory_final
        rss = self.memory.rss_growth_mb()
        if rss is not None:
            out[m.RSS_GROWTH_MB] = rss
        return out

    # ---- divergence guard ----------------------------------------------------------------------
    def _check_skips(self) -> None:
        """Host-side, free: stop once `max_bad_steps` consecutive steps were skipped, or once a
        dynamic loss scale backed off below `trainer.collapsed_loss_scale` (overflows at every
        scale: the scaled gradients would be below fp16's range anyway)."""
        if self.skip_streak == 0:
            return
        scaler = self.engine.scalers[0]
        floor = self.cfg.collapsed_loss_scale
        if scaler.dynamic and scaler.scale < floor:
            raise DivergenceError(
                f"training diverged: the dynamic loss scale collapsed to {scaler.scale:g}, below "
                f"trainer.collapsed_loss_scale={floor:g}, after {self.skip_streak} consecutive "
                f"overflowing steps up to step {self.global_step}: the gradients are inf/NaN "
                "even when scaled down to nothing (a forward that overflows fp16: no loss scale "
                "helps); try a bf16 preset (precision=o2_bf16), keep the layers that overflow in "
                "fp32 (precision.layer_plan=auto plans them), or a lower optimizer.lr"
            )
        if self.skip_streak < self.max_bad_steps:
            return
        # Failing anyway: one read tells whether the loss itself was non-finite.
        bad_losses = int(self.bad_loss_streak.item())
        if bad_losses >= self.max_bad_steps:
            self._raise_bad_loss(bad_losses)
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
            f"gradients) up to step {self.global_step}: {cause}; try precision=o2 or a bf16 preset "
            f"(precision=o2_bf16), or raise trainer.max_bad_steps={self.max_bad_steps} to wait "
            "longer"
        )

    def _raise_bad_loss(self, bad_losses: int) -> None:
        raise DivergenceError(
            f"training diverged: the loss was inf/NaN for {bad_losses} consecutive steps up to "
            f"step {self.global_step} (trainer.max_bad_steps={self.max_bad_steps}): the model "
            "produces non-finite values even at the smallest loss scale, or pure fp16 "
            "overflowed; try precision=o2 or a bf16 preset (precision=o2_bf16), or a lower "
            "optimizer.lr"
        )

    # ---- epochs -----------------------------------------------------------------------------
    def _stop_flag(self) -> torch.Tensor:
        return torch.tensor(
            float(self.stop is not None and self.stop.requested), device=self.device
        )

    def _log_train_loss(self, window: torch.Tensor, count: int, bar) -> bool:
        """The periodic host read: the mean loss (over the ranks), the non-finite-loss streak and
        the stop request (their maxima over the ranks, so that all ranks act alike), in one
        transfer. Returns whether the run is asked to stop."""
        mean = self.comm.sum_(window / count) / self.comm.world_size
        flags = self.comm.max_(
            torch.stack([self.bad_loss_streak.to(window.dtype), self._stop_flag().to(window.dtype)])
        )
        value, bad_losses, stop = torch.cat([mean.reshape(1), flags]).tolist()
        if bad_losses >= self.max_bad_steps:
            self._raise_bad_loss(int(bad_losses))
        lr = float(self.optimizer.param_groups[0]["lr"])  # (a tensor in torchao's optimizers)
        self.on_metrics({m.TRAIN_LOSS: value, m.LR: lr}, self.global_step)
        bar.set_postfix(loss=f"{value:.4f}", scale=f"{self.engine.loss_scale:g}", refresh=False)
        return stop > 0

    def _stop_requested_now(self) -> bool:
        """Between periodic reads: a single process acts on a signal at the next step; ranks of
        a distributed run agree at the periodic reads instead (a collective per step would cost)."""
        return not self.comm.active and self.stop is not None and self.stop.requested

    # ---- checkpoints ----------------------------------------------------------------------------
    def state(self, epochs_done: int, batches_done: int) -> dict:
        """Everything a resumed run needs (see runner.run.checkpoint)."""
        if self.sharded and self.cfg.fsdp_checkpoint == "sharded":
            # the shards go through torch.distributed.checkpoint (the checkpointer, every rank)
            model_state, optimizer_state = {}, dict(checkpoint.sharded.EMPTY_OPTIMIZER)
        elif self.sharded:  # the whole state, gathered to rank 0 (a collective: every rank)
            model_state = fsdp.full_model_state(self.module)
            optimizer_state = fsdp.full_optimizer_state(self.module, self.optimizer)
        else:
            model_state, optimizer_state = self.module.state_dict(), self.optimizer.state_dict()
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "engine": self.engine.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "epoch": epochs_done,
            "batch": batches_done,
            "global_step": self.global_step,
            # the task's best: a classifier's accuracy, or a language model's loss
            "best_val_acc": self.best if self.task.maximize else -math.inf,
            "best_val_loss": self.best if not self.task.maximize else math.inf,
            "history": self.history,
            "elapsed_s": self.elapsed_before + (time.perf_counter() - self._started),
            "skip_streak": self.skip_streak,
            "bad_loss_streak": int(self.bad_loss_streak.item()),
            "rng": rng.rng_state(),
            **(
                {"layer_plan": layer_plan_state(self.layer_plan)}
                if self.layer_plan is not None
                else {}
            ),
        }

    def restore(self, state: dict, scheduler: bool = True, source: Optional[Path] = None) -> None:
        """Continue from a checkpoint's state (the same model, optimizer and engine setup);
        `scheduler=False` leaves the scheduler to the caller (a schedule of another length).
        `source`: the checkpoint file (a sharded checkpoint's shards are read from beside it)."""
        if "sharded" in state:  # the shards into this run's own sharding (a collective)
            checkpoint.sharded.load(source, self.module, self.optimizer)
        elif self.sharded:  # the full state into this rank's shards
            fsdp.load_full_state(self.module, self.optimizer, state["model"], state["optimizer"])
        else:
            self.module.load_state_dict(state["model"])  # O2: re-seeds the fp32 masters exactly
            load_optimizer_state(self.optimizer, state["optimizer"])  # in its saved format
        self.engine.load_state_dict(state["engine"])
        if scheduler and self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epochs_done = int(state["epoch"])
        self.batches_done = int(state["batch"])
        self.global_step = int(state["global_step"])
        self.best = float(
            state["best_val_acc"] if self.task.maximize else state.get("best_val_loss", math.inf)
        )
        self.history = list(state["history"])
        self.elapsed_before = float(state["elapsed_s"])
        self.skip_streak = int(state["skip_streak"])
        self.bad_loss_streak.fill_(int(state["bad_loss_streak"]))
        self._rng_at_start = state["rng"]

    def _healthy(self) -> bool:
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
        if self.checkpointer is None and not self.sharded:
            return None  # (a sharded run's ranks all gather the state rank 0 writes)
        after = f"epoch {epochs_done}" + (f" and {batches_done} batches" if batches_done else "")
        if not self._healthy():
            log.warning(
                "No checkpoint written after %s: the model's weights are inf/NaN (the run "
                "is diverging); the last checkpoint, if any, is the last good state",
                after,
            )
            return None
        state = self.state(epochs_done, batches_done)
        if self.checkpointer is None:
            return None
        where = self.checkpointer(state)
        log.info("Checkpoint: %s (after %s)", where, after)
        return where

    def _interrupted(self, epochs_done: int, batches_done: int) -> RunInterrupted:
        where = self._save(epochs_done, batches_done)
        # the signal this rank got, or (another rank's request) SIGTERM, what torchrun forwards
        signum = self.stop.signum if self.stop is not None and self.stop.signum else signal.SIGTERM
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
        bar = tqdm(
            total=self.train_batches,
            initial=skip,
            desc=f"epoch {epoch}/{self.cfg.max_epochs}",
            unit="batch",
            disable=not self.cfg.progress_bar or not self.comm.is_main,
            dynamic_ncols=True,
        )
        self.clock.start()
        with bar:
            for index, (x, y) in enumerate(self.train_loader, start=skip):
                if index >= self.train_batches:
                    break
                x, y = self._to_device(x, y)
                window += self.train_step(x, y)
                count += 1
                samples += y.shape[0]
                items += self.task.items(y)
                self.global_step += 1
                self._check_skips()
                stop = False
                if self.global_step % self.cfg.log_every_n_steps == 0:
                    stop = self._log_train_loss(window, count, bar)
                    window.zero_()
                    count = 0
                bar.update()
                if (stop or self._stop_requested_now()) and index + 1 < self.train_batches:
                    raise self._interrupted(epoch - 1, index + 1)
            if count:  # short epochs still report their loss
                self._log_train_loss(window, count, bar)
        seconds = self.clock.stop()
        totals = self.comm.sum_(torch.tensor([float(samples), float(items)], device=self.device))
        samples_total, items_total = totals.tolist()
        return seconds, int(samples_total), int(items_total)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Returns (mean loss, accuracy) over the validation batches of all ranks (each rank
        evaluates its own share with the model itself: no collective inside the loop): per
        sample for a classifier, per token for a language model (runner.tasks)."""
        self.module.eval()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.float64)
        seen = 0
        last = None
        batches = min(len(self.val_loader), self.val_batches)
        # a sharded model's forward is a collective: every rank runs as many as the one with
        # the most batches (decided before the first forward)
        most = (
            int(self.comm.max_(torch.tensor(float(batches), device=self.device)).item())
            if self.sharded
            else batches
        )
        for index, (x, y) in enumerate(self.val_loader):
            if index >= self.val_batches:
                break
            x, y = self._to_device(x, y)
            last = x
            with self.engine.autocast():
                logits = self.module(x)
            # the training criterion, as a sum over the items (it returns their mean)
            sums = self.task.eval_sums(self.criterion, logits, y)
            loss_sum += sums.loss_sum
            correct += sums.correct
            seen += sums.count
        for _ in range(most - batches):  # (sharded: this rank's share is a batch short)
            self._forward_in_step(last)
        totals = self.comm.sum_(
            torch.stack(
                [
                    loss_sum,
                    correct,
                    torch.tensor(float(seen), device=self.device, dtype=torch.float64),
                ]
            )
        )
        loss_total, correct_total, seen_total = totals.tolist()
        if seen_total == 0:
            return math.nan, math.nan
        return loss_total / seen_total, correct_total / seen_total

    def _forward_in_step(self, last: Optional[torch.Tensor]) -> None:
        """A forward counted nowhere, on this rank's last validation batch (or a training batch
        where it had none): a sharded model's forward is a collective (each unit gathers its
        parameters from all ranks), and the ranks' validation shares differ by a sample."""
        if last is None:
            last, _ = self._to_device(*next(iter(self.train_loader)))
        with self.engine.autocast():
            self.module(last)

    # ---- torch.compile -----------------------------------------------------------------------
    def _first_batch_shapes(self) -> list[int]:
        """The batch sizes this rank's training loop meets: the full one, and a smaller last
        batch where the data does not divide evenly."""
        size = self.train_loader.batch_size or 1
        sampler = getattr(self.train_loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "__len__"):  # (this rank's share, whole)
            count = len(sampler) + int(getattr(sampler, "skip", 0))
        else:
            count = len(self.train_loader.dataset)
        sizes = [min(size, count)]
        last = count % size
        full_batches = count // size
        if last and full_batches < self.train_batches:  # the partial batch is reached
            sizes.append(last)
        return sizes

    @torch.no_grad()
    def _snapshot(self) -> tuple[list[torch.Tensor], dict]:
        return [b.detach().clone() for b in self.module.buffers()], rng.rng_state()

    @torch.no_grad()
    def _restore_snapshot(self, snapshot: tuple[list[torch.Tensor], dict]) -> None:
        buffers, state = snapshot
        for b, saved in zip(self.module.buffers(), buffers):
            b.copy_(saved)
        rng.restore_rng(state)

    def compile_warmup(self) -> float:
        """With `trainer.compile`, compile the training forward and backward before the clock
        of the first epoch starts: one forward and backward per batch shape the loop will meet,
        on the first training batch, after which the gradients, the model's buffers (BatchNorm
        statistics) and every random generator are put back as they were, so the run trains
        exactly as if nothing had happened. Returns the seconds it took (`compile_time_s`); the
        validation forward compiles at the first validation (outside `epoch_time_s`)."""
        snapshot = self._snapshot()
        try:
            self.model.train()
            x, y = next(iter(self.train_loader))
            x, y = self._to_device(x, y)
            self.clock.start()  # (the batch is fetched: only compiling is timed)
            for size in self._first_batch_shapes():
                with self.engine.autocast():
                    loss = self.task.loss(self.criterion, self.model(x[:size]), y[:size])
                self.engine.backward(loss)
                self.engine.zero_grad(self.optimizer)
            seconds = self.clock.stop()
        finally:
            self._restore_snapshot(snapshot)
        return seconds

    def fit(self) -> FitResult:
        self._started = time.perf_counter()
        if self._rng_at_start is not None:  # a resumed run draws what the uninterrupted one would
            rng.restore_rng(self._rng_at_start)
        if self.cfg.compile:
            seconds = self.compile_warmup()
            log.info(
                "torch.compile: the training step compiled in %.1f s (compile_time_s, not "
                "counted in epoch_time_s)",
                seconds,
            )
            self.on_metrics({m.COMPILE_TIME_S: seconds}, self.global_step)
            if self.global_step == 0:
                self.audit_eager()
        every = self.cfg.checkpoint_every_n_epochs
        for epoch in range(self.epochs_done + 1, self.cfg.max_epochs + 1):
            skip, self.batches_done = self.batches_done, 0
            seconds, samples, items = self.train_epoch(epoch, skip)
            val_loss, val_acc = self.evaluate()
            peak = self.comm.max_(torch.tensor(self.memory.peak_mb(), device=self.device)).item()
            metrics = {
                **self.task.epoch_metrics(val_loss, val_acc, seconds, samples, items),
                m.PEAK_MEM_MB: peak,
                m.LOSS_SCALE: self.engine.loss_scale,
                m.SKIPPED_STEPS: float(self.engine.skipped_steps),
                **self._memory_metrics(),
            }
            self.on_metrics(metrics, epoch)
            if self.diagnostics is not None:
                self.diagnostics.write()
            self.write_audit()
            self.history.append(metrics)
            value = val_acc if self.task.maximize else val_loss
            if self.task.better(value, self.best):
                self.best = value
            log.info(
                "epoch %d/%d: %s  peak mem %.0f MB  loss scale %g  skipped %d",
                epoch,
                self.cfg.max_epochs,
                self.task.epoch_summary(metrics),
                metrics[m.PEAK_MEM_MB],
                metrics[m.LOSS_SCALE],
                self.engine.skipped_steps,
            )
            last = epoch == self.cfg.max_epochs
            stop = bool(self.comm.max_(self._stop_flag()).item())
            if stop and not last:
                raise self._interrupted(epoch, 0)
            if every and (epoch % every == 0 or last):
                self._save(epoch, 0)
        train_time = self.elapsed_before + time.perf_counter() - self._started
        best = self.best if not math.isinf(self.best) else math.nan
        self.on_metrics(
            {self.task.objective: best, m.TRAIN_TIME_S: train_time}, self.cfg.max_epochs
        )
        if self.task.maximize:
            return FitResult(best_val_acc=best, train_time_s=train_time, epochs=self.history)
        return FitResult(
            best_val_acc=math.nan,
            train_time_s=train_time,
            epochs=self.history,
            best_val_loss=best,
            objective=self.task.objective,
        )
