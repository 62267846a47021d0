"""Reading a checkpoint back: one file or a sharded run's, checked before anything is used."""

from __future__ import annotations

from pathlib import Path

from runner.run.checkpoint import format as _format
from runner.run.checkpoint import sharded


def load(path):
    """The checkpoint at `path` (`format.load`: integrity, safety, contents); a sharded
    checkpoint's `trainer.pt` also has every shard file it lists verified (`sharded.verify`)."""
    state = _format.load(path)
    if "sharded" in state:
        sharded.verify(Path(path), state["sharded"]["files"])
    return state
