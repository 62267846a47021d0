"""What a sweep checks before its first job runs, so that a mistake stops it at once: every job's
config (`preflight`), the optimising sweeper's direction (`check_direction`), the launcher's keys
(`check_launcher`), and that the jobs share their parent's store (`same_store`, checked again as
each job starts); and the dry run of a sweep whose jobs are drawn as it goes (`dry_run_drawn`)."""

from __future__ import annotations

from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config import mistakes
from runner.errors import ConfigError, RunnerError
from runner.sweep.expansion import sweep_jobs, sweep_overrides
from runner.sweep.resume import resuming


def preflight(config: DictConfig, config_name: str | None, tracking_uri: str) -> int | None:
    """Check every job's config before any job runs (ConfigError names the job and the key);
    returns the number of jobs, or None when the sweeper decides them as it goes."""
    from hydra import compose

    from runner.run.plan import make_plan
    from runner.tracking.trackers import kind

    jobs = sweep_jobs(config)
    if jobs is None:
        return None
    for number, overrides in enumerate(jobs):
        try:
            cfg = compose(config_name=config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:  # a typo'd key or option
            explained = mistakes.explain(error, overrides)  # as a single run says it
            job = f"sweep job #{number} ({' '.join(overrides)})"
            raise RunnerError(f"{job}: {explained}") from error
        if resuming(cfg):  # in a sweep, resume=auto is decided per job, at its start
            OmegaConf.set_struct(cfg, False)
            cfg.resume = None
        try:
            mistakes.check_one_option(overrides)
            make_plan(cfg)
            same_store(cfg, kind(config), tracking_uri, config.mlflow.experiment_name)
        except ConfigError as error:
            raise ConfigError(
                error.key,
                f"{error.problem} (in sweep job #{number}: {' '.join(overrides)})",
                error.allowed,
            ) from error
    return len(jobs)


SUBMITIT_LAUNCHERS = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."


OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def check_direction(config: DictConfig) -> None:
    """Optuna minimises unless told otherwise (`hydra.sweeper.direction`, default minimize), and
    a classifier's objective is its best accuracy: a study left at the default searched for the
    worst settings, all night, without a word. A ConfigError where the direction is the
    opposite of the task's (a classifier maximises `best_val_acc`, a language model minimises
    `best_val_loss`), before anything starts; a multi-objective direction is Optuna's to refuse
    (a run returns one value)."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != OPTUNA_SWEEPER:
        return
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default="minimize")
    if isinstance(direction, ListConfig):
        if len(direction) != 1:
            return
        direction = direction[0]
    given = str(getattr(direction, "name", direction)).lower()
    from runner.config import options
    from runner.run.plan import resolve_task
    from runner.tasks import task_for

    try:
        task = task_for(resolve_task(config, options.specs_of(config)))
    except ConfigError:
        return  # (the job's own check says what is wrong)
    wanted = "maximize" if task.maximize else "minimize"
    if given != wanted:
        whose = "a classifier's" if task.maximize else "a language model's"
        raise ConfigError(
            "hydra.sweeper.direction",
            f"{given} would have Optuna search for the "
            f"{'lowest' if task.maximize else 'highest'} {task.objective}, {whose} objective "
            f"({'higher' if task.maximize else 'lower'} is better): add "
            f"hydra.sweeper.direction={wanted}",
            wanted,
        )


def dry_run_drawn(config: DictConfig) -> None:
    """A dry run under a sweeper that draws its jobs as it goes (Optuna's): its jobs are not
    known before they run, and each returned no objective, so the study failed on every trial
    and ended in a traceback (a study in `hydra.sweeper.storage` kept the failed trials). Shows
    the config every job starts from (checked, as a single dry run shows it) and what the
    sweeper varies, and ends the command (exit 0) before any study exists."""
    from runner.run.app import print_dry_run
    from runner.run.plan import make_plan

    cfg = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
    print_dry_run(make_plan(cfg))
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_") or "").rsplit(".", 1)[-1]
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    varied = [f"{key}={value}" for key, value in params.items()] + sweep_overrides(config)
    trials = OmegaConf.select(config, "hydra.sweeper.n_trials", default=None)
    drawn = " ".join(varied) if varied else "values"
    print(
        f"Dry run of a sweep{' by ' + sweeper if sweeper else ''}"
        + (f" ({trials} trials)" if trials is not None else "")
        + f", whose jobs are drawn as it runs: above is the config each job starts from; the "
        f"sweeper draws each job's {drawn}. Nothing was run and no study was made."
    )
    raise SystemExit(0)


def check_launcher(config: DictConfig) -> None:
    """submitit's launchers (`hydra/launcher=slurm`, `submitit_local`) take any key and hand it
    to submitit only as they launch, after the sweep's parent run is open: a key submitit does
    not know (`+hydra.launcher.signal_delay_s=45` under submitit_local, where only SLURM has it)
    ended in submitit's NameError traceback; SLURM's launcher on a machine without SLURM, in
    its RuntimeError traceback. A ConfigError naming the key, before anything starts, where
    submitit would refuse it."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    if not target.startswith(SUBMITIT_LAUNCHERS):
        return
    from hydra.utils import get_class
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit import AutoExecutor
    from submitit.core.plugins import get_executors

    executor = getattr(get_class(target), "_EXECUTOR", None)
    executors = get_executors()
    if executor not in executors:
        return  # (Hydra's abstract base launcher: submitit says what it thinks of it)
    # what Hydra's launcher hands over as it is (its own keys, the shared queue keys) and what
    # it hands over as `<executor>_<key>`, which submitit checks against the executor's own keys
    allowed = {"_target_", "submitit_folder", "max_num_timeout"}
    allowed |= set(OmegaConf.structured(BaseQueueConf).keys())
    allowed |= AutoExecutor._valid_parameters() | executors[executor]._valid_parameters()
    unknown = [key for key in config.hydra.launcher if key not in allowed]
    if unknown:
        raise ConfigError(
            f"hydra.launcher.{unknown[0]}",
            f"submitit's {executor!r} executor has no such parameter",
            sorted(allowed - {"_target_"}),
        )
    if executors[executor].affinity() < 0:  # (SLURM's, where no srun is on the PATH)
        raise ConfigError(
            "hydra/launcher",
            f"submitit's {executor!r} executor cannot run on this machine (its command, srun, "
            "is not on the PATH: a SLURM sweep is started on the cluster's login node)",
            "here: hydra/launcher=submitit_local (a process a job), parallel (a job a GPU) or "
            "joblib",
        )


def same_store(cfg: DictConfig, tracker: str, tracking_uri: str, experiment_name: str) -> None:
    """A child run must live beside its parent: the tracker (`tracking.name`), the store (an
    MLflow parent's `tracking_uri`) and the experiment cannot vary in a sweep."""
    from runner.tracking.base import MLFLOW
    from runner.tracking.trackers import kind

    if kind(cfg) != tracker:
        raise ConfigError(
            "tracking.name",
            f"a sweep's jobs are recorded by their parent run's tracker {tracker!r}, "
            f"got {kind(cfg)!r}; it cannot be swept",
            "one value for the whole sweep",
        )
    if tracker == MLFLOW and resolved(cfg.mlflow.tracking_uri) != tracking_uri:
        raise ConfigError(
            "mlflow.tracking_uri",
            f"a sweep's jobs log to their parent run's store "
            f"{tracking_uri!r}, got {cfg.mlflow.tracking_uri!r}; it cannot be swept",
            "one value for the whole sweep",
        )
    if cfg.mlflow.experiment_name != experiment_name:
        raise ConfigError(
            "mlflow.experiment_name",
            f"a sweep's jobs log to their parent run's "
            f"experiment {experiment_name!r}, got {cfg.mlflow.experiment_name!r}; it "
            "cannot be swept",
            "one value for the whole sweep",
        )


def resolved(tracking_uri: str) -> str:
    """An MLflow URI as its tracker keeps it (a relative SQLite path made absolute)."""
    from runner.tracking.store import resolve_tracking_uri

    return resolve_tracking_uri(tracking_uri)
