"""Where checkpoints live: `<trainer.checkpoint_dir>/<experiment>/<run name>/<run id>/last.pt`,
and which one `resume` names."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from runner.errors import ConfigError

FILENAME = "last.pt"


def _safe(name: str) -> str:
    """A folder name from an experiment or run name (no separators, nothing hidden)."""
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", name).strip("._") or "_"


def run_folder(root: str | os.PathLike, experiment: str, run_name: str) -> Path:
    """`<root>/<experiment>/<run name>`: the stable folder of every run of that name."""
    return Path(root).expanduser().resolve() / _safe(experiment) / _safe(run_name)


def path_for(folder: Path, run_id: str) -> Path:
    return folder / _safe(run_id) / FILENAME


def find(resume: Optional[str], folder: Path) -> Optional[Path]:
    """The checkpoint `resume` names: None for a fresh run; "auto": the most recent `last.pt`
    under the run's folder (None when there is none yet, so the run starts fresh); anything else
    a checkpoint file, or a folder holding one. A missing path is a ConfigError."""
    if resume is None or str(resume).strip() == "":
        return None
    if str(resume).strip().lower() == "auto":
        found = sorted(folder.glob(f"*/{FILENAME}"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if path.is_dir():
        path = path / FILENAME
    if not path.is_file():
        raise ConfigError("resume", f"no checkpoint at {str(resume)!r}",
                          f"auto, or a checkpoint file ({FILENAME}) or its folder")
    return path.resolve()
