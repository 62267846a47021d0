"""Load a benchmark script (benchmarks/<name>.py, not a package) as a module for its smoke test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(
        f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def own_tempdir(tmp_path: Path, monkeypatch) -> Path:
    """A temporary folder of the test's own for the benchmark's `tempfile` calls (its scratch
    folders land there, not in /tmp), so that a test can check they were removed, whatever else
    runs beside it."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
