"""What the benchmarks' smoke tests share beside the scripts themselves (imported as modules of the
`benchmarks` package: `from benchmarks import levels`)."""

from __future__ import annotations

from pathlib import Path


def own_tempdir(tmp_path: Path, monkeypatch) -> Path:
    """A temporary folder of the test's own for the benchmark's `tempfile` calls (its scratch
    folders land there, not in /tmp), so that a test can check they were removed, whatever else
    runs beside it."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
