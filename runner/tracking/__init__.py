"""Where runs are recorded, and read back: the runner's only door to MLflow.

- `base`: the seam. `Tracker` (a store and experiment: start, reopen, reap runs), `Run` (params,
  tags, metrics, artifacts, inputs, the end with a status), `Reader` and `RunRecord` (runs read
  back); `trackers.open_tracker` picks the implementation by `tracking.name`.
- MLflow, the default (`tracking=mlflow`): `mlflow_tracker`, `mlflow_run`, `mlflow_reader`, over
  `store` (the store's lock, retries on "database is locked", start-up errors), `liveness` (who
  runs a RUNNING run, and reaping the dead), `system` (system metrics), `replay` (the offline
  store of a run whose server went away).
- `json_file` (`tracking=none`): the console and a JSON file in the run's folder, no store.
- Names every tracker writes: `tags`, `metrics`; what a run records besides them: `record`.
"""
