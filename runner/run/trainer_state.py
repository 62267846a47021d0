"""A trainer's checkpoint state: what a checkpoint holds (`state`), how a trainer continues from
it (`restore`), and the save that never replaces a good checkpoint with non-finite weights
(README.md beside this file; the file format: `runner.run.checkpoint`)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch

from runner.config import TrainerConfig
from runner.precision.state import load_optimizer_state
from runner.run import checkpoint, fsdp, rng
from runner.run.distributed import Comm
from runner.run.divergence import DivergenceGuard

log = logging.getLogger("runner.run.trainer")  # the Trainer's own (this is part of its class)


def layer_plan_state(plan) -> dict:
    """What a checkpoint keeps of the layer plan: every layer's planned format (a resume must
    plan the same) and the entries that made it (a resumed `layer_plan=auto` run takes them
    instead of measuring again)."""
    return {"layers": plan.formats(), "rules": [rule.as_list() for rule in plan.rules]}


class CheckpointState:
    """The checkpoint half of `runner.run.trainer.Trainer`: reads and sets its parts (module,
    optimizer, engine, scheduler), its progress (epochs and batches done, global step, best,
    history, elapsed time, the RNG to restore) and its divergence guard's streaks."""

    cfg: TrainerConfig
    context: Any  # runner.run.trainer.RunContext: its checkpointer writes the state
    comm: Comm
    device: torch.device
    module: torch.nn.Module
    sharded: bool
    optimizer: torch.optim.Optimizer
    engine: Any
    scheduler: Any
    task: Any
    layer_plan: Any  # runner.precision.layers.LayerPlan, or None
    guard: DivergenceGuard
    epochs_done: int
    batches_done: int
    global_step: int
    best: float
    history: list[dict[str, float]]
    elapsed_before: float
    _started: float
    _rng_at_start: Optional[dict]

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
            **self.guard.state(),  # skip_streak, bad_loss_streak
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
        self.guard.restore(state)
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
        """The state to the checkpointer after `epochs_done` epochs and `batches_done` batches
        of the next (every rank of a sharded run takes part); where it went, or None."""
        checkpointer = self.context.checkpointer  # None: this rank writes none
        if checkpointer is None and not self.sharded:
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
        if checkpointer is None:
            return None
        where = checkpointer(state)
        log.info("Checkpoint: %s (after %s)", where, after)
        return where
