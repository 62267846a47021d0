"""The launchers a sweep runs on, as its callback meets them: those whose jobs run in processes
of their own on this machine (`LOCAL_PROCESS_LAUNCHERS`: a Ctrl-C reaches them all), their
settings fitted to the sweep before Hydra makes them (`fit_launcher`), and the warning where
parallel jobs share a device (`warn_shared_device`)."""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from runner.sweep import stop
from runner.sweep.gpus import gpu_count

log = logging.getLogger(__name__)

JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SUBMITIT_LOCAL_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
# the launchers whose jobs run in processes of their own on this machine, in the sweep's process
# group: a Ctrl-C reaches them all (runner.sweep.stop)
LOCAL_PROCESS_LAUNCHERS = (JOBLIB_LAUNCHER, SUBMITIT_LOCAL_LAUNCHER)


def fit_launcher(config: DictConfig, jobs: int | None) -> str:
    """The launcher's class path, its settings fitted to the sweep before Hydra makes it from
    this config: joblib's workers capped at the jobs (`stop.cap_workers`), submitit_local's job
    controllers made deaf to Ctrl-C (`stop.submitit_setup`)."""
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    if launcher == JOBLIB_LAUNCHER:
        cap = stop.cap_workers(OmegaConf.select(config, "hydra.launcher.n_jobs"), jobs)
        if cap is not None:  # (the launcher is made from this config after this call)
            with read_write(config.hydra.launcher), open_dict(config.hydra.launcher):
                config.hydra.launcher.n_jobs = cap
    elif launcher == SUBMITIT_LOCAL_LAUNCHER:  # its job controllers: deaf to Ctrl-C
        setup = stop.submitit_setup(OmegaConf.select(config, "hydra.launcher.setup"))
        with read_write(config.hydra.launcher), open_dict(config.hydra.launcher):
            config.hydra.launcher.setup = setup
    return launcher


def warn_shared_device(config: DictConfig, launcher: str) -> None:
    """Parallel jobs on one device spoil each other's timings and memory figures."""
    if launcher == SUBMITIT_LOCAL_LAUNCHER:
        devices = max(1, gpu_count())
        log.warning(
            "submitit's local launcher starts the sweep's jobs at once, on this machine's %d "
            "device(s): jobs that share a device spoil each other's timings and peak memory. "
            "hydra/launcher=parallel runs one job per GPU (one at a time on a CPU); "
            "hydra/launcher=slurm spreads them over a cluster.",
            devices,
        )
        return
    if launcher != JOBLIB_LAUNCHER:
        return
    n_jobs = OmegaConf.select(config, "hydra.launcher.n_jobs")
    devices = max(1, gpu_count())
    if n_jobs is not None and (n_jobs < 0 or n_jobs > devices):
        log.warning(
            "hydra.launcher.n_jobs=%s runs more jobs at once than there are devices (%d): "
            "their timings and peak memory are not comparable. hydra/launcher=parallel runs "
            "one job per GPU (one at a time on a CPU).",
            n_jobs,
            devices,
        )
