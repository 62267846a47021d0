"""Where a sweep's jobs find their parent run: `SweepParent`, written into the sweep's folder while
the parent is open, read there by each job (in-process, a joblib worker, a SLURM job elsewhere)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.files import write_atomic
from runner.tracking import tags as tag


@dataclass(frozen=True)
class SweepParent:
    """What a job needs to become a child run: the tracker (`tracking.name`), where it keeps runs
    (`Tracker.location`: an MLflow URI, or a folder under tracking=none), the experiment and the
    parent's id."""

    tracker: str
    location: str
    experiment_name: str
    experiment_id: str
    run_id: str
    # the keys whose values differ between the jobs (space-separated), for the jobs' run names
    # (runner.sweep.expansion.job_label); empty when the sweeper decides the jobs as it goes
    varying: str = ""
    # the signal that stopped the sweep (its name), set by the sweep's process when it had one:
    # a job that starts after it does not run (runner.sweep.stop)
    stopped: str = ""

    FILE = ".amp-runner-sweep.json"

    @classmethod
    def load(cls, sweep_dir: str | os.PathLike) -> SweepParent | None:
        """The open parent of the sweep in `sweep_dir`; None when there is none (a single run, a
        dry-run sweep, or a sweep that has ended)."""
        try:
            data = json.loads((Path(sweep_dir) / cls.FILE).read_text())
            return cls(
                **{
                    f.name: str(
                        data[f.name]
                        if f.default is dataclasses.MISSING
                        else data.get(f.name, f.default)
                    )
                    for f in dataclasses.fields(cls)
                }
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, sweep_dir: str | os.PathLike) -> None:
        folder = Path(sweep_dir)
        folder.mkdir(parents=True, exist_ok=True)
        # a job never reads half a file
        write_atomic(folder / self.FILE, json.dumps(dataclasses.asdict(self)), durable=False)

    @classmethod
    def forget(cls, sweep_dir: str | os.PathLike) -> None:
        (Path(sweep_dir) / cls.FILE).unlink(missing_ok=True)

    def open(self) -> Any:
        """The parent's tracker (runner.tracking.base.Tracker), opened in this process."""
        from runner.tracking.trackers import reopen_store

        return reopen_store(self.tracker, self.location, self.experiment_name)

    def children(self, tracker: Any, job_num: int | None = None) -> list[Any]:
        """The child runs of this parent in `tracker`'s store (those of job `job_num` only,
        when given), newest first (RunRecords)."""
        tags = {tag.PARENT_RUN: self.run_id}
        if job_num is not None:
            tags[tag.JOB_NUM] = str(job_num)
        return tracker.runs(tags=tags, newest_first=True)


def job_parent() -> SweepParent | None:
    """The parent run of the Hydra job running in this process: the open parent of its sweep's
    folder; None outside a multirun (or for a dry-run sweep, which opens no parent)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return SweepParent.load(hydra_cfg.sweep.dir)
