"""MLflow's side of `Reader` (runner.tracking.base): runs read back from an MLflow store, as
`RunRecord`s, through the store's retrying client (runner.tracking.store)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
from mlflow.exceptions import MlflowException

from runner.tracking.base import Reader, RunNotFound, RunRecord, StoreUnreadable
from runner.tracking.store import RetryingClient, resolve_tracking_uri, ui_hint

PAGE = 1000  # runs per search request (MLflow's default and most)


def record(run: Any) -> RunRecord:
    """An MLflow `Run` as a RunRecord."""
    info, data = run.info, run.data
    return RunRecord(
        run_id=info.run_id,
        run_name=info.run_name,
        experiment_id=info.experiment_id,
        status=info.status,
        start_time=info.start_time,
        end_time=info.end_time,
        params=dict(data.params),
        tags=dict(data.tags),
        metrics=dict(data.metrics),
    )


def _literal(value: str) -> str | None:
    """`value` as a string literal of MLflow's filter language, which cannot escape quotes: None
    for a value that holds both kinds (such a condition is checked on the runs instead)."""
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    return None


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """MLflow's download without its progress bar (a line a run on the report's console)."""
    key = MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name
    saved = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


class MlflowReader(Reader):
    """Reads the runs of the MLflow store at `location` through `client`."""

    def __init__(self, client: RetryingClient, location: str):
        self.client = client
        self.location = location

    @classmethod
    def open(cls, location: str) -> MlflowReader:
        """A reader of the store at `location`, which has answered (else StoreUnreadable)."""
        uri = resolve_tracking_uri(location)
        client = RetryingClient(uri)
        try:
            client.search_experiments(max_results=1)
        except MlflowException as error:
            raise StoreUnreadable(f"{uri}: {error.message}") from None
        return cls(client, uri)

    def experiment_id(self, name: str) -> str | None:
        experiment = self.client.get_experiment_by_name(name)
        return None if experiment is None else experiment.experiment_id

    def experiment_names(self) -> list[str]:
        return sorted(e.name for e in self.client.search_experiments())

    def run(self, run_id: str) -> RunRecord:
        try:
            return record(self.client.get_run(run_id))
        except MlflowException as error:
            raise RunNotFound(str(error.message)) from None

    def runs(
        self,
        experiment_ids: Sequence[str],
        *,
        tags: Mapping[str, str] | None = None,
        having: Sequence[str] = (),
        newest_first: bool = False,
    ) -> list[RunRecord]:
        clauses = [f"tags.`{key}` != ''" for key in having]
        later = {}  # conditions MLflow's filter cannot say: checked here
        for key, value in (tags or {}).items():
            literal = _literal(str(value))
            if literal is None:
                later[key] = str(value)
            else:
                clauses.append(f"tags.`{key}` = {literal}")
        order = ["attributes.start_time DESC"] if newest_first else None
        found: list[RunRecord] = []
        token = None
        while True:
            page = self.client.search_runs(
                list(experiment_ids),
                filter_string=" and ".join(clauses),
                order_by=order,
                max_results=PAGE,
                page_token=token,
            )
            found.extend(record(r) for r in page)
            token = page.token
            if not token:
                break
        return [r for r in found if all(r.tags.get(k) == v for k, v in later.items())]

    def history(self, run_id: str, metric: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in self.client.get_metric_history(run_id, metric))

    def log_artifacts(self, run_id: str, folder: str | os.PathLike, artifact_path: str) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def artifact_texts(self, run_id: str, folder: str) -> dict[str, str]:
        try:
            if not any(not f.is_dir for f in self.client.list_artifacts(run_id, folder)):
                return {}
            with tempfile.TemporaryDirectory(prefix="amp-report-") as local, _no_progress_bar():
                got = Path(self.client.download_artifacts(run_id, folder, local))
                return {p.name: p.read_text() for p in sorted(got.iterdir()) if p.is_file()}
        except (MlflowException, OSError, UnicodeDecodeError):
            return {}  # (an artifact store away or refusing: the figures that need them are left)

    def delete_run(self, run_id: str) -> None:
        self.client.delete_run(run_id)

    def hint(self, experiment_id: str) -> str:
        return ui_hint(self.location, experiment_id)
