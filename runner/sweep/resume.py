"""`resume=auto` on a sweep: the sweep run before in the same folder, found by its parent's tags
and refused where its overrides differ (`earlier_sweep`), and each job of it kept, resumed from
its checkpoint or started again (`resume_job`)."""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner import shell
from runner.errors import ConfigError
from runner.sweep.parent import SweepParent
from runner.tracking import tags as tag

log = logging.getLogger(__name__)


def resuming(config: DictConfig) -> bool:
    """Whether the config says `resume=auto` (decided per job, at its start, in a sweep)."""
    return str(OmegaConf.select(config, "resume") or "").strip().lower() == "auto"


def _sweep_tokens(overrides: Sequence[str]) -> set[str]:
    """The overrides that define a sweep (what `resume` is set to does not)."""
    return {o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith("resume")}


def overrides_tag(overrides: Sequence[str]) -> str:
    """A sweep's overrides as its parent's `sweep.overrides` tag: a command line's words, each
    quoted as the shell needs (`"data.root='/data/my set'"` stays one override)."""
    return shell.join(overrides)


def _tagged_overrides(text: str, now: Sequence[str]) -> set[str]:
    """The overrides of a `sweep.overrides` tag, as `_sweep_tokens` of them. A tag written before
    its words were quoted (joined with spaces: an override with a space in it split in two) reads
    as `now` where it is `now` so joined."""
    if set(text.split()) == set(" ".join(now).split()):
        return _sweep_tokens(now)
    try:
        return _sweep_tokens(shlex.split(text))
    except ValueError:  # (an unbalanced quote: an old tag's words)
        return _sweep_tokens(text.split())


def earlier_sweep(tracker: Any, sweep_dir: Path, overrides: Sequence[str]) -> Any:
    """The parent run of the sweep run before in `sweep_dir` (the newest, if several), or None;
    a ConfigError when its overrides differ from `overrides` (naming what differs), since its
    finished jobs would not be this sweep's."""
    folder = str(Path(sweep_dir).resolve())
    runs = tracker.runs(tags={tag.SWEEP_DIR: folder}, newest_first=True)
    if not runs:
        return None
    parent = runs[0]
    before = _tagged_overrides(parent.tags.get(tag.SWEEP_OVERRIDES, ""), overrides)
    now = _sweep_tokens(overrides)
    if before != now:
        differs = [f"-{o}" for o in sorted(before - now)] + [f"+{o}" for o in sorted(now - before)]
        raise ConfigError(
            "resume",
            f"the sweep in {folder} (parent run {parent.run_id}) "
            f"was run with other overrides: {shell.join(differs)} (- then, + now); "
            "its finished jobs would not be this sweep's",
            f"the same overrides as then ({shell.join(sorted(before))}) with "
            "resume=auto, or another hydra.sweep.dir for a new sweep",
        )
    return parent


def resume_job(
    cfg: DictConfig, parent: SweepParent, job_num: int, requeue: bool = False
) -> tuple[float | None, DictConfig]:
    """A job of a resumed sweep (`resume=auto`): (its objective, when its earlier run finished
    and is kept; else None, and the config to run it with). An earlier run that did not finish
    resumes from its checkpoint in the same run; one without a checkpoint is deleted and the job
    starts afresh (so the tree holds one child per job); a job that never ran starts afresh (not
    from another sweep's run of the same name). With `requeue`, a job of submitit's, which ran
    before in this sweep when submitit requeued it (its time limit, a preemption): it continues
    its run the same way, and a job that never ran keeps its config as given."""
    from runner.run import checkpoint
    from runner.tracking.base import FINISHED

    tracker = parent.open()
    runs = parent.children(tracker, job_num)
    earlier = runs[0] if runs else None  # this job's child run from an earlier session
    if earlier is None and requeue:
        return None, cfg
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.resume = None
    if earlier is None:
        return None, cfg
    if earlier.status == FINISHED:
        metrics = earlier.metrics
        best = metrics.get("best_val_acc", metrics.get("best_val_loss"))
        log.info(
            "Sweep job #%d finished in an earlier session (run %s): kept, not run again",
            job_num,
            earlier.run_id,
        )
        return (math.nan if best is None else float(best)), cfg
    path = (
        checkpoint.run_folder(
            cfg.trainer.checkpoint_dir, cfg.mlflow.experiment_name, earlier.run_name
        )
        / earlier.run_id
        / checkpoint.FILENAME
    )
    if path.is_file():
        log.info(
            "Sweep job #%d resumes its run %s (%s) from %s",
            job_num,
            earlier.run_id,
            earlier.status,
            path,
        )
        cfg.resume = str(path)
    else:
        log.info(
            "Sweep job #%d: its run %s (%s) left no checkpoint: it starts again",
            job_num,
            earlier.run_id,
            earlier.status,
        )
        tracker.reader.delete_run(earlier.run_id)
    return None, cfg
