"""What a run records about itself besides its metrics: its config as flat params, the code's
commit, the command as the user typed it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runner import shell


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} for MLflow params."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


def git_commit(directory: str | os.PathLike) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


_typed_argv: list[str] = []  # sys.argv before the entry point put its overrides together


def keep_typed(argv: Sequence[str]) -> None:
    """`argv` as typed, for `typed_command`: the entry point reorders sys.argv for Hydra's parser
    (runner.__main__.overrides_together)."""
    _typed_argv[:] = argv


def typed_command(argv: Sequence[str] | None = None) -> str:
    """The command line as the user typed it (the `command` tag): `python -m runner ARGS` when
    Python ran a package as a module (its argv[0] is then the path of the package's
    `__main__.py`; the interpreter as it was named, the module from `__main__`'s spec), else
    the script's name and its arguments (`amp-runner ARGS`). `argv`: sys.argv as typed."""
    if argv is None:  # (the typed order, where it is that of these arguments)
        argv = _typed_argv if sorted(_typed_argv) == sorted(sys.argv) else sys.argv
    argv = list(argv)
    if not argv:
        return ""
    first = Path(argv[0])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if first.name == "__main__.py" and spec is not None:
        module = spec.name.removesuffix(".__main__")
        interpreter = (getattr(sys, "orig_argv", None) or [sys.executable])[0]
        return shell.join([Path(interpreter).name, "-m", module, *argv[1:]])
    return shell.join([first.name, *argv[1:]])
