"""A Hydra multirun as one parent run, with every job of the sweep as its child run.

Hydra calls `MlflowSweepCallback` (`callback`, registered under `hydra.callbacks` in
conf/config.yaml) in the launching process when a sweep starts and ends, and in the job's own
process around each job; the joblib launcher pickles the callback, parent run id included, into
its worker processes.

- Sweep start: every job's config is checked (basic sweeper: `preflight.preflight`), then the store,
  the experiment and the parent run are created, all before the first job, so a bad value stops
  the sweep at once and parallel jobs never race to create the SQLite schema.
- Each job: a child run (tagged `mlflow.parentRunId`, which the MLflow UI nests by). The job finds
  its parent in the sweep's folder (`parent.SweepParent`, written there while the parent is open),
  so it works the same for in-process jobs, joblib worker processes and SLURM jobs on other nodes.
  A failing job is recorded FAILED and, under Hydra's basic sweeper, returns NaN instead of
  raising, because Hydra 1.3's basic sweeper re-raises the first failure, stops the sweep and skips
  the end-of-sweep callback; under any other sweeper (Optuna) it raises, so the sweeper counts a
  failed trial (a NaN objective crashes Optuna's study) (`jobs.run_job`).
- `resume=auto` on a sweep continues the sweep run before in the same folder (refused when its
  overrides differ): the same parent run, each job's earlier child kept (FINISHED), resumed from
  its checkpoint (KILLED, FAILED) or replaced (no checkpoint) (`resume`).
- Sweep end: the parent ends FINISHED with the number of failed children; the process exits 1 if
  any job failed. Ctrl-C or a crash of the sweep machinery ends the parent KILLED or FAILED
  (`callback.LaunchScope`, held by the CLI). With jobs in processes of their own (joblib,
  submitit_local), Ctrl-C stops every running job after its step with a checkpoint and starts no
  further job (`stop`).
- One GPU per job with the joblib launcher (`gpus`).

The runs go through the tracking seam (runner.tracking.base): under `tracking=none` the parent is a
record in the sweep's folder (`<sweep dir>/tracking.json`) and each job's run a record in the
job's folder, tagged with the parent's id as under MLflow.

Only light imports at module level, and nothing happens on import: Hydra instantiates the callback
for single runs too; the CLI registers the config resolver (`gpus.register_resolvers`).
"""
