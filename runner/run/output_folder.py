"""A folder of its own for each launch. Hydra names a run's folder and a sweep's by the second it
starts (`outputs/DATE/TIME`, `multirun/DATE/TIME`): runs or sweeps started in the same second
(a script's loop, a job array on a shared disk) shared one. Their logs went into one
`runner.log`, attached to each run's record, and two sweeps' jobs found one parent: two sweeps
of two jobs started together ended as a parent with three children and one with one.

So a folder named by the time (its setting holds `${now:...}`, as Hydra's defaults do) is
claimed as the launch starts (`OutputFolder`): created where it does not exist yet, else the
next free `<name>-1`, `<name>-2`, ... The ranks of one torchrun launch share theirs, as before.
A folder the user names outright is theirs to reuse (a sweep's `resume=auto` does); a sweep
holds a lock on its folder while it runs (runner.sweep.callback), so that a second one there
stops before it starts."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from runner import shell
from runner.errors import ConfigError

log = logging.getLogger(__name__)

TIMED = "${now:"  # a folder setting that names the folder by the time of the start
MAX_SUFFIX = 10_000


class OutputFolder(Callback):
    """Hydra callback: a run's folder (`hydra.run.dir`), claimed for it when named by the time
    (see the module's docstring), before Hydra writes into it. A sweep's is claimed by the
    sweep's own callback once its jobs are checked (`claim_sweep`): a sweep refused for bad
    input leaves no folder behind."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.errors import RunnerError

        try:
            check_output_folder(config, "run")
        except RunnerError as error:
            log.error("%s", error)
            raise SystemExit(2) from error
        claim(config, "run")


def check_output_folder(config: DictConfig, mode: str) -> None:
    """`hydra.<mode>.dir` (mode: run or sweep) that cannot be made or written (a file in the way,
    no rights, a read-only launch folder) refused before anything starts, a sweep before its
    jobs are checked (a ConfigError); `check_working_dir` too."""
    from runner.files import folder_problem

    check_working_dir(config)
    folder = OmegaConf.select(config, f"hydra.{mode}.dir")
    if folder and str(folder).startswith("~"):
        home = os.path.expanduser(str(folder))
        raise ConfigError(
            f"hydra.{mode}.dir",
            f"{folder} starts with '~', which Hydra does not expand: it would make a folder "
            "named '~' in the launch folder (which `rm -r ~` does not remove: it removes your "
            "home)",
            f"the full path, e.g. {shell.override(f'hydra.{mode}.dir', home)}"
            if home != str(folder)
            else "the full path",
        )
    problem = folder_problem(str(folder)) if folder else None
    if problem is not None:
        raise cannot_create(mode, folder, problem)


def cannot_create(mode: str, folder: Any, problem: str) -> ConfigError:
    """`hydra.<mode>.dir`'s output folder that cannot be made, as a ConfigError: what the check
    above finds, or (its OSError's `problem`) what only the attempt does (/proc, a full disk)."""
    return ConfigError(
        f"hydra.{mode}.dir",
        f"the output folder {folder} cannot be made: {problem}",
        "a folder you can write (or launch from one: the default is relative to it)",
    )


def check_working_dir(config: DictConfig) -> None:
    """`hydra.job.chdir=true` refused before anything starts (a ConfigError): the runner reads
    its relative paths (the MLflow store, the data, the checkpoints) from the folder the user
    launched from, as its docs say. Hydra changed into each job's output folder first, so each
    job of a sweep opened a store of its own there (the sweep's parent, in the launch folder,
    ended with no child and "Sweep finished: 0 jobs") and would fetch its dataset again."""
    from runner.errors import ConfigError

    if OmegaConf.select(config, "hydra.job.chdir") is True:
        raise ConfigError(
            "hydra.job.chdir",
            "true is not supported: the runner reads its relative paths (mlflow.tracking_uri, "
            "data.root, trainer.checkpoint_dir, ...) from the folder you launch from; a job "
            "run in its own output folder would open an MLflow store of its own there",
            "false, Hydra's default: each run's log is in its output folder all the same",
        )


def claim_sweep(config: DictConfig) -> None:
    """`hydra.sweep.dir` claimed for this sweep when named by the time (`claim`); the jobs'
    configs, composed again from the overrides, are told the folder it took."""
    moved = claim(config, "sweep")
    if moved is not None:
        with read_write(config.hydra.overrides), open_dict(config.hydra.overrides):
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={shell.hydra_value(moved)}")


def claim(config: DictConfig, mode: str) -> Optional[str]:
    """Claims `hydra.<mode>.dir` for this launch when it is named by the time; returns the
    folder when it had to take another name than the one Hydra gave, else None."""
    node = OmegaConf.select(config, f"hydra.{mode}")
    if node is None or TIMED not in str(OmegaConf.to_container(node, resolve=False).get("dir")):
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None  # the ranks of one torchrun launch: one run, one folder
    named = Path(str(node.dir))
    named.parent.mkdir(parents=True, exist_ok=True)
    for suffix in range(MAX_SUFFIX):
        folder = named if suffix == 0 else named.with_name(f"{named.name}-{suffix}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        if suffix == 0:
            return None
        log.info("%s is taken (a launch in the same second): this one uses %s", named, folder)
        with read_write(node), open_dict(node):
            node.dir = str(folder)
        return str(folder)
    return None  # (ten thousand launches in one second: Hydra's folder, shared, as before)
