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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from runner.config import COMPILE_MODES, KERNEL_CHOICES, TUNABLE
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
        if data.get("format") != FORMAT or not _rows_ok(rows):
            raise ValueError("not the rows of a tuning")
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("trainer.tune: ignoring the unreadable cache file %s (%s)", path, error)
        return None
    return rows


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


# each tunable key's values a row may hold: a cache file is input like any other (a shared
# cache folder, a damaged file): a row that set precision.kernels=evil was applied, and the run
# ended in an unexpected error; an unknown key is never a setting
SETTING_OK: dict[str, Callable[[Any], bool]] = {
    "trainer.channels_last": _is_bool,
    "trainer.cudnn_benchmark": _is_bool,
    "trainer.compile": _is_bool,
    "trainer.compile_mode": lambda v: isinstance(v, str) and v in COMPILE_MODES,
    "precision.kernels": lambda v: isinstance(v, str) and v in KERNEL_CHOICES,
    "trainer.num_workers": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "trainer.pin_memory": lambda v: v is None or isinstance(v, bool),
}
assert set(SETTING_OK) == set(TUNABLE)


def _settings_ok(settings: Any) -> bool:
    return isinstance(settings, dict) and all(
        key in SETTING_OK and SETTING_OK[key](value) for key, value in settings.items()
    )


def _rows_ok(rows: Any) -> bool:
    return isinstance(rows, list) and all(
        isinstance(r, dict)
        and _settings_ok(r.get("settings"))
        and isinstance(r.get("steady_ms"), (int, float, type(None)))
        and isinstance(r.get("compile_s"), (int, float))
        and isinstance(r.get("loss"), (int, float, type(None)))
        for r in rows
    )


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
