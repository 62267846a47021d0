"""The run's checkpointer: one component that owns where a run's checkpoints go and how they are
written and read back, so that the trainer only says when (`save`) and a resumed run only says
from what (`restore`).

It holds the folder (`<checkpoint_dir>/<experiment>/<run name>/<run id>/`: runner.run.checkpoint
has the format), the lock a resumed run keeps on that folder, the full or sharded write (a sharded
run's ranks each write their shards), the metrics flushed to the store before each write (a
process killed after the write has lost none of the metrics the checkpoint covers, and its resume
logs none twice), what is kept when the run stops (`kept`: the line a lost rank or an interrupt
prints), and the restore of a resumed run (its schedule rebuilt for a new epoch budget).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from runner.precision.state import load_optimizer_state
from runner.run import checkpoint, distributed, fsdp, rng
from runner.run.distributed import Comm
from runner.run.parts import Parts
from runner.run.plan import RunPlan

log = logging.getLogger(__name__)


class Checkpointer:
    """The checkpoints of the run of `plan` on this rank (`comm`), of the model and optimizer in
    `parts`. Every rank has one: a rank that writes no file (not rank 0, not sharded) writes
    nothing, but a sharded run's ranks all take part in gathering the state."""

    def __init__(self, plan: RunPlan, comm: Comm, parts: Parts) -> None:
        self.plan, self.comm, self.parts = plan, comm, parts
        # a sharded run's ranks all write (their shards) into rank 0's run's folder
        self.shards = comm.active and plan.shards and plan.cfg.trainer.fsdp_checkpoint == "sharded"
        self.writes = comm.is_main or self.shards  # (this rank writes files)
        self.path: Optional[Path] = None  # the checkpoint file, once the MLflow run is known
        self.tracked: Any = None
        # the last checkpoint of this run: (where, epochs done, batches of the next)
        resume = plan.resume
        self.last: Optional[tuple[str, int, int]] = (
            (str(resume.path), int(resume.state["epoch"]), int(resume.state.get("batch", 0)))
            if resume is not None
            else None
        )

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """While a resumed run trains: its checkpoint folder's lock, held by rank 0 (one process
        a resumed run: checkpoint.own); nothing for a fresh run."""
        resume = self.plan.resume
        if resume is None or not self.comm.is_main:
            yield
            return
        folder = checkpoint.path_for(self.plan.checkpoint_folder, resume.run_id).parent
        with checkpoint.own(folder, resume.run_id):
            yield

    def start(self, tracked: Any) -> None:
        """The tracked run the checkpoints belong to (runner.tracking): its id names their
        folder, and its metrics are delivered before each write."""
        self.tracked = tracked
        run_id = self.comm.from_main(tracked.run_id) if self.shards else tracked.run_id
        if self.writes:
            self.path = checkpoint.path_for(self.plan.checkpoint_folder, run_id)

    def save(self, state: dict) -> Optional[str]:
        """Write the trainer's `state` (runner.run.trainer.Trainer.state) with what the run
        adds (its MLflow run, config and world size); returns where, or None (this rank writes
        no file). A write the disk refuses stops the run with one line (checkpoint.unwritable)."""
        if not self.writes:
            return None
        self.tracked.deliver()  # (the metrics the checkpoint covers reach the store first)
        full = {
            "mlflow_run_id": self.tracked.run_id,
            "config": dict(self.plan.config_tree),
            "world_size": self.comm.world_size,
            **state,
        }
        try:
            if self.shards:  # a collective: every rank writes its shards, rank 0 the rest
                where = checkpoint.sharded.save(
                    self.path.parent, full, self.parts.model, self.parts.optimizer, self.comm
                )
            else:
                checkpoint.save(self.path, full)
                where = self.path
        except Exception as error:  # (a full disk: one line, not a traceback)
            refused = checkpoint.unwritable(self.path, error)
            if refused is None:
                raise
            raise refused from error
        self.last = (str(where), int(state["epoch"]), int(state["batch"]))
        return str(where)

    def kept(self) -> str:
        """What this rank says is kept when the run stops early (a rank gone): the last
        checkpoint and the command that continues from it."""
        if self.last is None:
            return "No checkpoint was written yet." if self.comm.is_main else ""
        where, epochs, batches = self.last
        after = f"epoch {epochs}" + (f" and {batches} batches" if batches else "")
        command = "torchrun command" if distributed.under_torchrun() else "command"
        return (
            f"The checkpoint after {after} is kept ({where}): the same {command} with "
            "resume=auto continues from it."
        )

    def restore(self, trainer: Any) -> None:
        """A resumed run: the checkpoint's state into `trainer` (built for the plan); with a
        new epoch budget, the schedule rebuilt at the step reached (a cosine or one-cycle
        schedule of the old length would turn back up, or refuse to step, past its end)."""
        from runner.components.optim import rebuild_scheduler_at

        resume, cfg = self.plan.resume, self.plan.cfg
        if resume is None:
            return
        changed = resume.budget_changed(cfg.trainer.max_epochs)
        restore_trainer(trainer, resume.state, scheduler=not changed, source=resume.path)
        if changed:
            trainer.scheduler = rebuild_scheduler_at(
                cfg.scheduler,
                trainer.optimizer,
                trainer.train_batches,
                cfg.trainer.max_epochs,
                trainer.global_step,
                cfg.optimizer.lr,
            )
        log.info(
            "Resuming %s from %s: after epoch %d and %d batches of the next (step %d)",
            self.plan.run_name,
            resume.path,
            resume.state["epoch"],
            resume.state["batch"],
            resume.state["global_step"],
        )


# ---- what a checkpoint holds of the trainer ------------------------------------------------------
def layer_plan_state(plan: Any) -> dict:
    """What a checkpoint keeps of the layer plan: every layer's planned format (a resume must
    plan the same) and the entries that made it (a resumed `layer_plan=auto` run takes them
    instead of measuring again)."""
    return {"layers": plan.formats(), "rules": [rule.as_list() for rule in plan.rules]}


def trainer_state(trainer: Any, epochs_done: int, batches_done: int) -> dict:
    """Everything a resumed run needs of `trainer` after `epochs_done` epochs and `batches_done`
    batches of the next (runner.run.checkpoint: the whole checkpoint); a sharded model's state is
    gathered here, a collective (every rank)."""
    if trainer.sharded and trainer.cfg.fsdp_checkpoint == "sharded":
        # the shards go through torch.distributed.checkpoint (the checkpointer, every rank)
        model_state, optimizer_state = {}, dict(checkpoint.sharded.EMPTY_OPTIMIZER)
    elif trainer.sharded:  # the whole state, gathered to rank 0 (a collective: every rank)
        model_state = fsdp.full_model_state(trainer.module)
        optimizer_state = fsdp.full_optimizer_state(trainer.module, trainer.optimizer)
    else:
        model_state, optimizer_state = trainer.module.state_dict(), trainer.optimizer.state_dict()
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "engine": trainer.engine.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "epoch": epochs_done,
        "batch": batches_done,
        "global_step": trainer.global_step,
        # the task's best: a classifier's accuracy, or a language model's loss
        "best_val_acc": trainer.best if trainer.task.maximize else -math.inf,
        "best_val_loss": trainer.best if not trainer.task.maximize else math.inf,
        "history": trainer.history,
        "elapsed_s": trainer.elapsed_before + (time.perf_counter() - trainer.fit_started),
        **trainer.guard.state(),  # skip_streak, bad_loss_streak
        "rng": rng.rng_state(),
        **(
            {"layer_plan": layer_plan_state(trainer.layer_plan)}
            if trainer.layer_plan is not None
            else {}
        ),
    }


def restore_trainer(
    trainer: Any, state: dict, scheduler: bool = True, source: Optional[Path] = None
) -> None:
    """`trainer` continues from a checkpoint's state (the same model, optimizer and engine setup);
    `scheduler=False` leaves the scheduler to the caller (a schedule of another length).
    `source`: the checkpoint file (a sharded checkpoint's shards are read from beside it)."""
    if "sharded" in state:  # the shards into this run's own sharding (a collective)
        checkpoint.sharded.load(source, trainer.module, trainer.optimizer)
    elif trainer.sharded:  # the full state into this rank's shards
        fsdp.load_full_state(trainer.module, trainer.optimizer, state["model"], state["optimizer"])
    else:
        trainer.module.load_state_dict(state["model"])  # O2: re-seeds the fp32 masters exactly
        load_optimizer_state(trainer.optimizer, state["optimizer"])  # in its saved format
    trainer.engine.load_state_dict(state["engine"])
    if scheduler and trainer.scheduler is not None and state["scheduler"] is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.epochs_done = int(state["epoch"])
    trainer.batches_done = int(state["batch"])
    trainer.global_step = int(state["global_step"])
    trainer.best = float(
        state["best_val_acc"] if trainer.task.maximize else state.get("best_val_loss", math.inf)
    )
    trainer.history = list(state["history"])
    trainer.elapsed_before = float(state["elapsed_s"])
    trainer.guard.restore(state)
    trainer.rng_at_start = state["rng"]
