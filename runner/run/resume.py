"""Resuming a run: which checkpoint it continues, whether that fits the config, what it changes.

`Resume.decide` is part of planning a run (runner.run.plan): `resume=auto` takes the most recent
checkpoint of the same experiment and run name (none yet: a fresh run), `resume=PATH` a given
one; the checkpoint must have been written with the same config, except a different
`trainer.max_epochs` (not below the epochs it already trained). What a resumed run changes in its
record is said here (the tags it adds to its MLflow run); its trainer's restore is the
checkpointer's (runner.run.checkpointer).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from runner.run import checkpoint
from runner.tracking import tags as tag

log = logging.getLogger(__name__)


def _own(folder: Path, config: Mapping[str, Any]) -> Optional[tuple[Path, Mapping[str, Any]]]:
    """resume=auto: (path, state) of the most recent checkpoint under the run name's folder that
    is this name's, None where there is none. Names that differ only where a folder name cannot
    follow them (`my run`, `my_run`) share a folder: a checkpoint whose `mlflow.run_name` is
    another name given is passed over (it was refused as a changed config, so `my_run` could
    not start), and its run stays its own. Where either name is the default (null), the
    checkpoint is taken, and a different config refused naming the difference, as before."""
    name = config.get("mlflow", {}).get("run_name")
    for path in checkpoint.folders.newest_first(folder):
        state = checkpoint.load(path)
        theirs = state.get("config", {}).get("mlflow", {}).get("run_name")
        if theirs == name or theirs is None or name is None:
            return path, state
        log.info(
            "resume=auto: passed over %s, the checkpoint of the run named %r (its folder's name is "
            "this run's too)",
            path,
            theirs,
        )
    return None


@dataclass(frozen=True)
class Resume:
    """A checkpoint this run continues from, already checked against the run's config."""

    path: Path
    state: Mapping[str, Any]

    @classmethod
    def decide(
        cls, resume: Optional[str], folder: Path, config: Mapping[str, Any]
    ) -> Optional[Resume]:
        """The checkpoint `resume` (the config's value) names under the run's `folder`, loaded
        and checked against `config` (the resolved config tree); None for a fresh run. Raises
        ConfigError for a missing path, an unreadable file or a config that differs."""
        if checkpoint.folders.is_auto(resume):
            found = _own(folder, config)
            if found is None:
                return None
            path, state = found
        else:
            path = checkpoint.find(resume, folder)
            if path is None:
                return None
            state = checkpoint.load(path)
        checkpoint.check_resumable(state, config, path)
        return cls(path, state)

    @property
    def run_id(self) -> str:
        """The MLflow run the checkpointed run logged into (the resumed run goes on in it)."""
        return self.state["mlflow_run_id"]

    @property
    def saved_max_epochs(self) -> int:
        return int(self.state["config"]["trainer"]["max_epochs"])

    def finished(self, max_epochs: int) -> bool:
        """Whether the checkpointed run has already trained `max_epochs` epochs (its last
        checkpoint is that of the end of its last epoch): a resume has nothing to do."""
        return int(self.state["epoch"]) >= int(max_epochs) and int(self.state["batch"]) == 0

    def finished_message(self) -> str:
        return (
            f"already trained {int(self.state['epoch'])} epochs (checkpoint {self.path}); "
            "raise trainer.max_epochs to train more. Nothing was changed."
        )

    @property
    def best_val_acc(self) -> Optional[float]:
        value = float(self.state["best_val_acc"])
        return None if value == float("-inf") else value

    def best(self) -> Optional[float]:
        """The checkpointed run's objective: its best accuracy (a classifier), or its best loss
        (a language model: its checkpoint holds a finite best_val_loss and no accuracy)."""
        if self.best_val_acc is not None:
            return self.best_val_acc
        value = float(self.state.get("best_val_loss", float("inf")))
        return None if value == float("inf") else value

    def budget_changed(self, max_epochs: int) -> bool:
        return self.saved_max_epochs != int(max_epochs)

    def position(self) -> str:
        """Where it continues: "epoch 3, batch 7"."""
        return f"epoch {self.state['epoch']}, batch {self.state['batch']}"

    def tags(self, max_epochs: int) -> dict[str, str]:
        """What the resumed MLflow run gains: where it resumed from, and a changed epoch budget
        (params are immutable, so the new value goes into a tag)."""
        out = {tag.RESUMED_FROM: str(self.path)}
        if self.budget_changed(max_epochs):
            out[tag.MAX_EPOCHS] = str(max_epochs)
        return out

    def check_fits(self, parts: Any, world_size: int) -> None:
        """The checkpoint's contents must fit what this run built (`runner.run.app.Parts`): model
        keys, shapes and dtypes, the optimizer's kind and params, the loss scalers, the
        scheduler's kind, the world size; a ConfigError names each difference. Called before the
        MLflow run is reopened."""
        from runner.errors import ConfigError
        from runner.run.fsdp import is_sharded

        if "sharded" in self.state:  # its tensors are in the shards: checked through the index
            if not is_sharded(parts.model):
                raise ConfigError(
                    "resume",
                    f"{self.path} is a sharded checkpoint "
                    "(trainer.strategy=fsdp); this run is not sharded",
                    "trainer.strategy=fsdp under torchrun",
                )
            differences = checkpoint.sharded.shape_differences(self.path.parent, parts.model)
            if differences:
                raise ConfigError(
                    "resume",
                    f"the checkpoint {self.path.parent} does not fit "
                    f"this run's model in {len(differences)} key(s): " + "; ".join(differences[:8]),
                    checkpoint.contents.ALLOWED,
                )
        checkpoint.check_structure(
            self.state,
            model=parts.model,
            optimizer=parts.optimizer,
            engine=parts.engine,
            scheduler=parts.scheduler,
            world_size=world_size,
            path=self.path,
            reshardable=is_sharded(parts.model),
            tensors="sharded" not in self.state,
        )
