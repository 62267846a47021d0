"""`trainer.tune`'s cache: the measurements of earlier tunings, one JSON file per configuration.

A configuration is keyed by what its step time depends on: the model's config, the batch (size and
the data's input), the precision level's resolved properties, the optimizer, the device's name,
torch's version and which settings were left to tune (`key`). The file holds the measured rows
(runner.run.tune_measure.Row) and is written atomically (runner.files); a file that does not read
back as such rows (each setting a tunable key with a value it may take) is ignored with a
warning, and measured again. The folder is `$AMP_RUNNER_TUNE_CACHE`, else
`$XDG_CACHE_HOME/amp-runner/tune` (`~/.cache/amp-runner/tune`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from runner.config import TUNABLE, validation
from runner.files import HeldLock, file_lock, write_atomic

log = logging.getLogger(__name__)

FORMAT = 1  # the file's layout; a file of another is measured again


def folder() -> Path:
    """Where decisions are kept (the tests point `AMP_RUNNER_TUNE_CACHE` at a temporary one)."""
    given = os.environ.get("AMP_RUNNER_TUNE_CACHE")
    if given:
        return Path(given)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "amp-runner" / "tune"


def key(facts: Mapping[str, Any]) -> str:
    """A configuration's key: the digest of `facts` (plain values), with torch's version."""
    text = json.dumps({**facts, "torch": torch.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _path(digest: str) -> Path:
    return folder() / f"{digest}.json"


def lock(digest: str) -> HeldLock:
    """The configuration's lock, held while it is tuned: a sweep's parallel jobs of the same
    configuration wait for the first one's decision instead of measuring it again."""
    path = _path(digest).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    return file_lock(
        path, on_wait=lambda: log.info("trainer.tune: waiting for another run tuning the same")
    )


def read(digest: str) -> Optional[list[dict[str, Any]]]:
    """The rows kept for `digest`, or None (none kept; a file that is not what this module
    writes is ignored with a warning, never trusted)."""
    path = _path(digest)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        rows = data["rows"]
        problem = "another format" if data.get("format") != FORMAT else _rows_problem(rows)
        if problem is not None:
            raise ValueError(f"not the rows of a tuning: {problem}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("trainer.tune: ignoring the unreadable cache file %s (%s)", path, error)
        return None
    return rows


def setting_problem(key: str, value: Any) -> Optional[str]:
    """Why a row may not set `key` to `value`: only a tunable key, to a value the run's config
    may hold there (its type and rule: `validation.setting_problem`); None where it may."""
    if key not in TUNABLE:
        return f"{key} is not a tunable key"
    return validation.setting_problem(key, value)


def _rows_problem(rows: Any) -> Optional[str]:
    """Why `rows` are not the rows of a tuning (each setting checked), or None."""
    if not isinstance(rows, list):
        return "not a list of rows"
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("settings"), dict):
            return "a row without its settings"
        if not (
            isinstance(row.get("steady_ms"), (int, float, type(None)))
            and isinstance(row.get("compile_s"), (int, float))
            and isinstance(row.get("loss"), (int, float, type(None)))
        ):
            return "a row without its measurements"
        for key, value in row["settings"].items():
            problem = setting_problem(key, value)
            if problem is not None:
                return f"a row's setting {problem}"
    return None


def write(digest: str, rows: Sequence[Mapping[str, Any]], facts: Mapping[str, Any]) -> None:
    """Keep `rows` for `digest` (with the facts they were measured for, to read)."""
    path = _path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(
        {"format": FORMAT, "facts": facts, "torch": torch.__version__, "rows": list(rows)},
        indent=1,
        sort_keys=True,
        default=str,
    )
    write_atomic(path, text + "\n")
