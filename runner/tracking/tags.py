"""Every MLflow tag name the runner writes or reads, in one place.

Tags are the runner's contract with the MLflow UI, `runner.report`, `runner.tracking.replay` and any
script a user writes against the store; a name used in two modules is defined here once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runner.errors import ConfigError

# ---- MLflow's own ---------------------------------------------------------------------------
PARENT_RUN = "mlflow.parentRunId"  # what the MLflow UI nests a sweep's child runs by
RUN_NAME = "mlflow.runName"  # the run's name, as MLflow keeps it (set as the name, not a tag)
# MLflow 3.x opens GenAI experiments on an overview page; this kind shows the training-runs view
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")

# ---- every run ------------------------------------------------------------------------------
ERROR = "error"  # why a run ended FAILED or KILLED
OPT_LEVEL = "opt_level"
MODEL = "model"  # what the run name calls the model: a zoo's arch, a _target_'s class, a name
MODEL_CLASS = "model.class"  # the built model's class, module-qualified (my_pkg.nets.MyNet)
OVERRIDES = "overrides"  # the command-line overrides of the job
COMMAND = "command"  # the whole command line
DEVICE_NAME = "device_name"  # the GPU or CPU a run trained on ("NVIDIA H200", "AMD EPYC")
PEAK_MEM_KIND = "peak_mem_kind"  # what peak_mem_mb measures on this device
FINDINGS = "precision.findings"  # "0 error, 2 warning, 1 info"
FINDINGS_LIST = "precision.findings_list"  # "warning precision.master_weights; info model"
GIT_COMMIT = "git_commit"
RUNNER_VERSION = "runner_version"
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


# ---- the user's own (mlflow.tags) ---------------------------------------------------------------
# what `mlflow.tags` may not name: the tags above (the report, the liveness checks, a sweep's tree
# and a resume read them), every `runner.` tag, and MLflow's own that the runner sets (its
# other `mlflow.` tags, e.g. mlflow.note.content, the run's description, are the user's to set)
OWN = frozenset(
    value
    for name, value in dict(globals()).items()
    if name.isupper() and isinstance(value, str) and name != "OWN"
)
OWN_PREFIXES = ("runner.", "sweep.", "replay.")


def user_tags(tags: Any) -> dict[str, str]:
    """`mlflow.tags` as MLflow tags: nested keys joined by dots (`+mlflow.tags.mlflow.note.
    content=...`: Hydra reads each dot of a key as a level, and the tag was refused as "Cannot
    convert 'dict' to string"), each value a string. ConfigError for a value that is a list,
    and for a name the runner writes itself (its run would say what the user wrote there: a
    model the report groups by, a pid the liveness check reads)."""
    out: dict[str, str] = {}

    def walk(node: Mapping, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, f"{name}.")
                continue
            if isinstance(value, Sequence) and not isinstance(value, str):
                listed = f"[{', '.join(str(v) for v in value)}]"
                raise ConfigError(
                    f"mlflow.tags.{name}",
                    f"got a list {listed}: a tag's value is one string",
                    f"a string; brackets in quotes: '+mlflow.tags.{name}=\"{listed}\"'",
                )
            if name in OWN or name.startswith(OWN_PREFIXES):
                raise ConfigError(
                    f"mlflow.tags.{name}",
                    "is a tag the runner writes itself (the report, resumes and the liveness "
                    "checks read the runner's tags), so it cannot be set",
                    "another name (not one of the runner's tags, nor one beginning "
                    + ", ".join(OWN_PREFIXES)
                    + ")",
                )
            out[name] = "null" if value is None else str(value)

    walk(tags if isinstance(tags, Mapping) else {}, "")
    return out
