"""Where checkpoints live: `<trainer.checkpoint_dir>/<experiment>/<run name>/<run id>/last.pt`,
and which one `resume` names."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

from runner.errors import ConfigError
from runner.files import HeldLock, try_lock

FILENAME = "last.pt"
# a sharded run's checkpoint (runner.run.checkpoint.sharded): a folder of shards and trainer.pt
SHARDED_FOLDER, SHARDED_TRAINER, SHARDED_OLD = "last.dcp", "trainer.pt", ".last.dcp.old"


# a folder name's most characters (ASCII, so bytes): what file systems take (NAME_MAX); a sweep
# job's name holds its swept values (a long data.root, several keys), or a user's mlflow.run_name
NAME_MAX = 255


def _safe(name: str) -> str:
    """A folder name from an experiment or run name (no separators, nothing hidden). A name
    longer than NAME_MAX keeps its start and ends in a digest of the whole (a run of a 300-
    character name failed at its first checkpoint: "File name too long"); two long names that
    begin alike keep folders of their own."""
    safe = re.sub(r"[^A-Za-z0-9._=+-]+", "_", name).strip("._") or "_"
    if len(safe) <= NAME_MAX:
        return safe
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{safe[: NAME_MAX - len(digest) - 1]}-{digest}"


def run_folder(root: str | os.PathLike, experiment: str, run_name: str) -> Path:
    """`<root>/<experiment>/<run name>`: the stable folder of every run of that name."""
    return Path(root).expanduser().resolve() / _safe(experiment) / _safe(run_name)


def path_for(folder: Path, run_id: str) -> Path:
    return folder / _safe(run_id) / FILENAME


RESUMED_LOCK = ".resumed.lock"  # held in a run id's folder by the process resuming that run


def own(folder: Path, run_id: str) -> HeldLock:
    """The lock a process resuming run `run_id` holds on its checkpoint's folder until it ends
    (the kernel releases it however the process ends): a second process resuming the same run
    at the same time is refused here, on any tracker, rather than log into one run and write
    one checkpoint with the first (two resumes a second apart both trained it, each metric
    logged twice). The store's own check (a RUNNING run whose owner lives) covers other hosts."""
    folder.mkdir(parents=True, exist_ok=True)
    held = try_lock(folder / RESUMED_LOCK)
    if held is None:
        raise ConfigError(
            "resume",
            f"the run {run_id} is being resumed by another process now ({folder / RESUMED_LOCK} "
            "is held): two processes would train one run",
            "wait for it to end, or stop it, then resume=auto",
        )
    return held


def is_auto(resume: Optional[str]) -> bool:
    return resume is not None and str(resume).strip().lower() == "auto"


def newest_first(folder: Path) -> list[Path]:
    """Every checkpoint under a run name's folder (one per run id: a `last.pt`, or a sharded
    checkpoint's `trainer.pt`), the most recent first."""
    found = [*folder.glob(f"*/{FILENAME}"), *_sharded(folder)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find(resume: Optional[str], folder: Path) -> Optional[Path]:
    """The checkpoint `resume` names: None for a fresh run; "auto": the most recent `last.pt`
    under the run's folder (None when there is none yet, so the run starts fresh); anything else
    a checkpoint file, or a folder holding one. A missing path is a ConfigError."""
    if resume is None or str(resume).strip() == "":
        return None
    if is_auto(resume):
        found = newest_first(folder)
        return found[0] if found else None
    path = Path(resume).expanduser()
    if path.is_dir():
        inside = [path / FILENAME, path / SHARDED_FOLDER / SHARDED_TRAINER, path / SHARDED_TRAINER]
        path = next((p for p in inside if p.is_file()), inside[0])
    if not path.is_file():
        raise ConfigError(
            "resume",
            _missing(str(resume), Path(resume).expanduser()),
            f"auto, or a checkpoint file ({FILENAME}), a sharded checkpoint's "
            f"folder ({SHARDED_FOLDER}), or the folder holding either",
        )
    return path.resolve()


def _missing(resume: str, path: Path) -> str:
    """Why `resume` names no checkpoint, with the ones a user most likely meant: `resume=true`
    (YAML's boolean, read as 'True') means resume=auto; a folder above a run id's (the root's,
    the experiment's or the run name's, what `ls checkpoints` shows) names the checkpoints in
    the run id folders below it."""
    said = f"no checkpoint at {resume!r}"
    if resume.lower() in ("true", "yes", "on") and not path.exists():
        return f"{said}: to continue this run's newest checkpoint, resume=auto"
    if not path.is_dir():
        return said
    below = [
        found
        for depth in ("*", "*/*", "*/*/*")
        for name in (FILENAME, f"{SHARDED_FOLDER}/{SHARDED_TRAINER}")
        for found in path.glob(f"{depth}/{name}")
    ]
    if not below:
        return f"{said}: neither the folder nor the three levels of folders below it hold one"
    below.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    named = ", ".join(f"resume={_holder(p)}" for p in below[:3])
    if len(below) == 1:
        return f"{said}: the folder holds none of its own, one below it: {named}"
    more = f" (and {len(below) - 3} older)" if len(below) > 3 else ""
    return f"{said}: the folder holds none of its own, {len(below)} below it, newest first: " + (
        named + more
    )


def _holder(found: Path) -> Path:
    """The run id folder of a checkpoint file found below a folder (what `resume=` takes)."""
    return found.parent.parent if found.name == SHARDED_TRAINER else found.parent


def _sharded(folder: Path) -> list[Path]:
    """The `trainer.pt` of each run id's sharded checkpoint: `last.dcp`, or the previous one
    moved aside where a save was cut short between its two renames."""
    out = []
    for entry in folder.glob("*/"):
        for name in (SHARDED_FOLDER, SHARDED_OLD):
            if (entry / name / SHARDED_TRAINER).is_file():
                out.append(entry / name / SHARDED_TRAINER)
                break
    return out
