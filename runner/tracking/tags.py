"""Every MLflow tag name the runner writes or reads, in one place.

Tags are the runner's contract with the MLflow UI, `runner.report`, `runner.tracking.replay` and any
script a user writes against the store; a name used in two modules is defined here once.
"""

from __future__ import annotations

# ---- MLflow's own ---------------------------------------------------------------------------
PARENT_RUN = "mlflow.parentRunId"  # what the MLflow UI nests a sweep's child runs by
# MLflow 3.x opens GenAI experiments on an overview page; this kind shows the training-runs view
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")

# ---- every run ------------------------------------------------------------------------------
ERROR = "error"  # why a run ended FAILED or KILLED
OPT_LEVEL = "opt_level"
MODEL = "model"  # what the run name calls the model: a zoo's arch, a _target_'s class, a name
MODEL_CLASS = "model.class"  # the built model's class, module-qualified (my_pkg.nets.MyNet)
OVERRIDES = "overrides"  # the command-line overrides of the job
COMMAND = "command"  # the whole command line
PEAK_MEM_KIND = "peak_mem_kind"  # what peak_mem_mb measures on this device
FINDINGS = "precision.findings"  # "0 error, 2 warning, 1 info"
FINDINGS_LIST = "precision.findings_list"  # "warning precision.master_weights; info model"
GIT_COMMIT = "git_commit"
LAYER_PLAN_HASH = "precision.layer_plan_hash"  # every layer's planned format, hashed

# ---- liveness (runner.tracking.liveness): who runs a RUNNING run, and its last sign of life ------
HOST = "runner.host"
PID = "runner.pid"
PID_START = "runner.pid_start"  # the process's start time, clock ticks since boot (Linux)
PID_SPACE = "runner.pid_space"  # "<boot id>:<PID namespace>": where the pid is that process
HEARTBEAT = "runner.heartbeat"  # ISO 8601 UTC time of the last heartbeat (mlflow.heartbeat_s)
OOM_KILLS = "runner.oom_kills"  # the machine's count of OOM-killed processes at that heartbeat
# the job log this session writes, for a reaper to attach (runner.tracking.job_log)
LOG_FILE = "runner.log_file"  # its absolute path
LOG_FROM = "runner.log_from"  # the byte this session's lines begin at
LOG_HEAD = "runner.log_head"  # a digest of its first line: a file replaced since is not attached

# ---- a resumed run ----------------------------------------------------------------------------
RESUME_COUNT = "resume.count"
RESUMED_FROM = "resumed_from"
MAX_EPOCHS = "trainer.max_epochs"  # a changed epoch budget (params cannot change)

# ---- sweeps ---------------------------------------------------------------------------------
DIAGNOSE = "diagnose"  # "true" on a range pre-flight's run (python -m runner.diagnose)
DIAGNOSE_TARGET = "diagnose.target_preset"  # the preset the pre-flight was asked about
DIAGNOSE_RECOMMENDED = "diagnose.recommended_preset"
DIAGNOSE_KEEP_FP32 = "diagnose.keep_fp32"  # the layers to keep in fp32 ("none")

SWEEP_DIR = "sweep.dir"
SWEEP_OVERRIDES = "sweep.overrides"
SWEEP_LAUNCHER = "sweep.launcher"
FAILED_JOBS = "sweep.failed_jobs"
JOB_NUM = "sweep.job_num"

# ---- the offline store of a run whose tracking server went away (runner.tracking.replay) ---------
REPLAY_TARGET_RUN = "replay.target_run_id"  # the server run the offline run belongs to
REPLAY_TARGET_URI = "replay.target_uri"
REPLAY_STATUS = "replay.status"  # the status the server run ends with
REPLAY_DONE = "replay.done"  # set once delivered (replaying twice sends nothing twice)
