"""`tracking=none`: a run recorded on the console and in a JSON file in its own folder, with no
store at all (no MLflow database, no `mlruns/`; MLflow is not even imported).

A run's record is `<run folder>/tracking.json` (the run folder: Hydra's output folder, where
`runner.log` is; a sweep's parent: the sweep's folder), and its artifacts are copied under
`<run folder>/artifacts/` at the paths an MLflow run would give them. The record holds:

    {"tracker": "none", "run_id", "run_name", "experiment", "status" (RUNNING, FINISHED, FAILED,
     KILLED), "start_time", "end_time" (ms since the epoch), "params", "tags" (the `error` tag:
     why a run did not finish), "metrics": {name: [[step, value, time ms], ...]},
     "artifacts": [path, ...], "datasets": [...]}

It is written when the run starts, when params or tags change, before a checkpoint, at least
every `WRITE_EVERY_S` seconds while metrics arrive, and when the run ends; each write replaces the
file whole (a reader never sees half of it). Metrics are also logged to the console.

The records under a folder are a tiny store of their own (`JsonReader`): a sweep finds its jobs'
runs (tagged with the parent's id, as under MLflow) in the job folders under the sweep's folder,
and a resumed sweep job finds its earlier run in its folder, and the report reads a sweep's
records (`python -m runner.report --sweep <its folder>`). Nothing is reaped (no other process
shares these records).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.files import write_atomic
from runner.tracking import tags as tag
from runner.tracking.base import RUNNING, Reader, Run, RunNotFound, RunRecord, Tracker

log = logging.getLogger(__name__)

FILE = "tracking.json"  # a run's record, in its folder
ARTIFACTS = "artifacts"  # its artifacts' folder, beside the record
WRITE_EVERY_S = 10.0  # while metrics arrive, the record is rewritten at most this often


def is_record_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a run's record (a run or a sweep under tracking=none)."""
    return (Path(folder) / FILE).is_file()


def _now_ms() -> int:
    return int(time.time() * 1000)


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """`record` as `path`, replaced whole (written beside it, then moved over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1, default=str), durable=False)


def read_record(path: Path) -> dict[str, Any] | None:
    """The record at `path`; None for a file that is not a run's record."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "run_id" in record else None


def as_run_record(record: Mapping[str, Any]) -> RunRecord:
    latest = {
        name: max(points, key=lambda p: (p[0], p[2]))[1]
        for name, points in record.get("metrics", {}).items()
        if points
    }
    return RunRecord(
        run_id=record["run_id"],
        run_name=record.get("run_name", ""),
        experiment_id=record.get("experiment", ""),
        status=record.get("status", RUNNING),
        start_time=record.get("start_time"),
        end_time=record.get("end_time"),
        params=dict(record.get("params", {})),
        tags=dict(record.get("tags", {})),
        metrics=latest,
    )


class JsonRun(Run):
    """One run in progress, recorded in `folder/tracking.json` (see the module)."""

    def __init__(self, folder: Path, record: dict[str, Any]):
        self.folder = Path(folder)
        self.path = self.folder / FILE
        self.record = record
        self.run_id = record["run_id"]
        self._lock = threading.Lock()
        self._written = 0.0
        self._refused: str | None = None  # why the disk does not take the record, while so
        with self._lock:  # (a run that cannot write its record at the start does not start)
            write_record(self.path, self.record)
            self._written = time.monotonic()

    def _write(self) -> bool:
        """The record written; False where the disk refuses it (full, say): it stays in memory,
        told once, and the next write tries again (training goes on, as under a store that does
        not answer)."""
        with self._lock:
            self._written = time.monotonic()
            try:
                write_record(self.path, self.record)
            except OSError as error:
                if self._refused is None:
                    log.warning(
                        "Cannot write the run's record %s (%s): it is kept in memory and "
                        "written again with the next metrics; training goes on",
                        self.path,
                        error.strerror or error,
                    )
                self._refused = str(error.strerror or error)
                return False
            if self._refused is not None:
                log.warning("The run's record %s is written again", self.path)
                self._refused = None
            return True

    def log_params(self, params: Mapping[str, str]) -> None:
        self.record["params"].update({str(k): str(v) for k, v in params.items()})
        self._write()

    def set_tag(self, key: str, value: Any) -> None:
        self.record["tags"][str(key)] = str(value)
        self._write()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now = _now_ms()
        with self._lock:
            for name, value in metrics.items():
                self.record["metrics"].setdefault(name, []).append([int(step), float(value), now])
        log.info("step %d: %s", step, "  ".join(f"{k} {float(v):.6g}" for k, v in metrics.items()))
        if time.monotonic() - self._written >= WRITE_EVERY_S:
            self._write()

    def _artifact(self, artifact_file: str) -> Path:
        with self._lock:
            if artifact_file not in self.record["artifacts"]:
                self.record["artifacts"].append(artifact_file)
        target = self.folder / ARTIFACTS / artifact_file
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def log_text(self, text: str, artifact_file: str) -> None:
        try:
            self._artifact(artifact_file).write_text(text)
        except OSError as error:
            self._lost(artifact_file, error)

    def log_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        source = Path(path)
        if not source.is_file():
            return
        name = f"{artifact_path}/{source.name}" if artifact_path else source.name
        try:
            shutil.copyfile(source, self._artifact(name))
        except OSError as error:
            self._lost(name, error)

    def _lost(self, artifact_file: str, error: OSError) -> None:
        """An artifact the disk refuses (full, say) is told, and the run goes on: as under a
        store that does not take it, it is not worth the training."""
        log.warning(
            "Could not keep the artifact %s in %s (%s)",
            artifact_file,
            self.folder / ARTIFACTS,
            error.strerror or error,
        )

    def log_datasets(self, datasets: Sequence[Mapping[str, Any]]) -> None:
        self.record["datasets"] = [dict(d) for d in datasets]
        self._write()

    def deliver(self, timeout: float = 10.0) -> bool:
        return self._write()

    def end(self, status: str, error: str | None = None) -> None:
        if error:
            self.record["tags"][tag.ERROR] = error
        self.record["status"] = status
        self.record["end_time"] = _now_ms()
        if not self._write():
            raise RunnerError(
                f"tracking=none: cannot write the run's record {self.path} ({self._refused}): "
                f"it is left as last written, without its final status {status} and what the "
                "run logged since"
            )


class JsonReader(Reader):
    """The records (`tracking.json`) in `root` and the folders below it."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)

    def paths(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob(FILE)):
            record = read_record(path)
            if record is not None:
                yield path, record

    def find(self, run_id: str) -> tuple[Path, dict[str, Any]]:
        for path, record in self.paths():
            if record["run_id"] == run_id:
                return path, record
        raise RunNotFound(f"Run '{run_id}' not found in the records under {self.root}")

    def experiment_id(self, name: str) -> str | None:
        return name if any(r.get("experiment") == name for _, r in self.paths()) else None

    def experiment_names(self) -> list[str]:
        return sorted({str(r.get("experiment")) for _, r in self.paths() if r.get("experiment")})

    def run(self, run_id: str) -> RunRecord:
        return as_run_record(self.find(run_id)[1])

    def runs(
        self,
        experiment_ids: Sequence[str],
        *,
        tags: Mapping[str, str] | None = None,
        having: Sequence[str] = (),
        newest_first: bool = False,
    ) -> list[RunRecord]:
        found = [
            as_run_record(r)
            for _, r in self.paths()
            if r.get("experiment") in experiment_ids
            and all(r["tags"].get(k) == str(v) for k, v in (tags or {}).items())
            and all(r["tags"].get(k) for k in having)
        ]
        return sorted(found, key=lambda r: r.start_time or 0, reverse=newest_first)

    def history(self, run_id: str, metric: str) -> list[tuple[int, float]]:
        points = self.find(run_id)[1].get("metrics", {}).get(metric, [])
        return sorted((int(step), float(value)) for step, value, *_ in points)

    def log_artifacts(self, run_id: str, folder: str | os.PathLike, artifact_path: str) -> None:
        path, record = self.find(run_id)
        for source in sorted(Path(folder).rglob("*")):
            if source.is_file():
                name = f"{artifact_path}/{source.relative_to(folder).as_posix()}"
                target = path.parent / ARTIFACTS / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
                if name not in record["artifacts"]:
                    record["artifacts"].append(name)
        write_record(path, record)

    def artifact_texts(self, run_id: str, folder: str) -> dict[str, str]:
        path, record = self.find(run_id)
        prefix = folder.strip("/") + "/"
        texts = {}
        for name in record.get("artifacts", []):
            rest = name[len(prefix) :] if name.startswith(prefix) else ""
            if rest and "/" not in rest:
                try:
                    texts[rest] = (path.parent / ARTIFACTS / name).read_text()
                except (OSError, UnicodeDecodeError):
                    continue  # (a file the disk lost: its figure is left out)
        return texts

    def delete_run(self, run_id: str) -> None:
        self.find(run_id)[0].unlink()

    def hint(self, experiment_id: str) -> str:
        return f"See the records (tracking=none): {FILE} under {self.root}"


class JsonTracker(Tracker):
    """`tracking=none`: runs recorded as JSON files under `root` (see the module)."""

    label = "tracking=none"

    def __init__(self, root: str | os.PathLike, experiment_name: str):
        self.root = Path(root)
        self.location = str(self.root)
        self.experiment_name = self.experiment_id = experiment_name
        self.reader = JsonReader(self.root)

    def _record(self, run_id: str, run_name: str, tags: Mapping[str, str]) -> dict[str, Any]:
        return {
            "tracker": "none",
            "run_id": run_id,
            "run_name": run_name,
            "experiment": self.experiment_name,
            "status": RUNNING,
            "start_time": _now_ms(),
            "end_time": None,
            "params": {},
            "tags": {str(k): str(v) for k, v in tags.items()},
            "metrics": {},
            "artifacts": [],
            "datasets": [],
        }

    def create_run(
        self, run_name: str, tags: Mapping[str, str], folder: str | os.PathLike | None = None
    ) -> JsonRun:
        record = self._record(uuid.uuid4().hex, run_name, tags)
        return JsonRun(Path(folder) if folder is not None else self.root, record)

    def reopen_run(
        self,
        run_id: str,
        tags: Mapping[str, str],
        folder: str | os.PathLike | None = None,
        run_name: str = "",
    ) -> JsonRun:
        """The run's record found under `root` goes on (in `folder`, a resumed run's own folder,
        with everything it held); a run whose record is not there (an earlier session wrote it in
        another output folder) starts a record of its own under the same id."""
        try:
            _, record = self.reader.find(run_id)
        except RunNotFound:
            record = self._record(run_id, run_name, {})
        record["status"], record["end_time"] = RUNNING, None
        record["tags"].pop(tag.ERROR, None)  # why the last session ended: not true of a running run
        count = int(record["tags"].get(tag.RESUME_COUNT, "0")) + 1
        record["tags"].update({str(k): str(v) for k, v in tags.items()})
        record["tags"][tag.RESUME_COUNT] = str(count)
        resumed = JsonRun(Path(folder) if folder is not None else self.root, record)
        resumed.resumes = count
        return resumed

    def folder_taken(self, folder: str | os.PathLike, run_id: str | None) -> str | None:
        """A folder holds one run's record: another run's there would be replaced, and with it
        that run's only record (a folder named outright, used again: `hydra.run.dir=out`)."""
        record = read_record(Path(folder) / FILE)
        if record is None or record["run_id"] == run_id:
            return None
        return (
            f"{folder} holds the record of the run {record.get('run_name', '')!r} "
            f"({record['run_id']}, {record.get('status', '?')}), which this run's would "
            "replace (tracking=none keeps one run a folder)"
        )

    def hint(self) -> str:
        path = self.root / FILE
        if path.is_file():
            return f"See the run's record: {path}"
        return self.reader.hint(self.experiment_id)
