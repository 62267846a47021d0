"""The jobs of a sweep: what they are (the basic sweeper's expansion), checked before the first
runs, and each one run as a child run of the sweep's parent (`run_job`), resumed with the sweep
(`resume=auto`)."""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner import shell
from runner.config import mistakes
from runner.errors import ConfigError, RunnerError
from runner.sweep.parent import SweepParent
from runner.tracking import tags as tag
from runner.tracking.varying import baseline_keys, display_names, distance, params_of

log = logging.getLogger(__name__)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's overrides, expanded as Hydra's basic sweeper will (`hydra.sweeper.params`, then
    the command line); None for another sweeper (Optuna, ...), whose jobs are known only later."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sweep_overrides(config: DictConfig) -> list[str]:
    """The overrides that make this a sweep (`precision=o0,o1`, `+experiment=...`), for naming."""
    arguments = list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [
        text
        for text, o in zip(arguments, parsed)
        if o.is_sweep_override() or o.get_key_element().lstrip("+~") == "experiment"
    ]


def unswept(hydra_config: DictConfig, cfg: DictConfig, command: str) -> str | None:
    """What to say where the config defines a sweep (`hydra.sweeper.params`: an experiment
    file's) but the command has no `-m`: Hydra then runs one job with the config's own values,
    silently (`+experiment=gpt_precisions` trained O0 alone). None where it defines none.
    `command`: the command line with `-m` added, to paste."""
    from hydra.types import RunMode

    params = OmegaConf.select(hydra_config, "sweeper.params") or {}
    if not params or hydra_config.mode != RunMode.RUN:  # (a job of a sweep: -m was given)
        return None
    choices = OmegaConf.select(hydra_config, "runtime.choices") or {}
    swept, runs = [], []
    for key, values in params.items():
        swept.append(f"{key} over {values}")
        name = str(key).lstrip("+~")
        value = choices[name] if name in choices else OmegaConf.select(cfg, name, default=None)
        if value is None and str(key).startswith("+"):  # (a group or key the sweep adds)
            runs.append(f"without {key}")
        else:
            runs.append(f"{name}={'null' if value is None else value}")
    jobs = sweep_jobs(OmegaConf.create({"hydra": hydra_config}))
    count = f" ({len(jobs)} jobs)" if jobs else ""
    return (
        f"The config defines a sweep{count}: {'; '.join(swept)} (hydra.sweeper.params), but "
        f"without -m Hydra runs one job, {', '.join(runs)}. To run the sweep: {command}"
    )


# the keys a run's name tells already (`<model>-<level>`): not repeated after it
NAMED_KEYS = ("model", "model._target_", "model.arch", "model.name", "precision")


def varying_keys(config: DictConfig) -> list[str]:
    """The keys (as the overrides spell them, without `+` or `~`) whose values differ between the
    jobs of the basic sweeper's expansion, in the order they are given, but those a run's name
    tells already (the model and the precision preset); [] for another sweeper (Optuna), whose
    jobs are known only as they run."""
    jobs = sweep_jobs(config) or []
    values: dict[str, list[str | None]] = {}
    for number, job in enumerate(jobs):
        for key, value in _assignments(job).items():
            values.setdefault(key, [None] * len(jobs))[number] = value
    return [k for k, v in values.items() if len(set(v)) > 1 and k not in NAMED_KEYS]


def _assignments(overrides: Sequence[str]) -> dict[str, str]:
    """{key: value} of `key=value` overrides (`+` and `~` dropped; the last of a key wins)."""
    out: dict[str, str] = {}
    for text in overrides:
        key, sign, value = text.partition("=")
        if sign:
            out[key.lstrip("+~")] = value
    return out


def job_label(
    overrides: Sequence[str], varying: Sequence[str], job_num: int, sweeper: str = BASIC_SWEEPER
) -> str:
    """What tells a sweep job's run apart from the other jobs' (added to its `<model>-<level>`
    name): the job's values of the `varying` keys, `lr=0.1 seed=2` (each key by its last part
    where no other varying key shares it, else in full); under another sweeper than the basic
    one (Optuna), whose values are drawn as it goes, the trial's number, `trial 3`."""
    if sweeper and sweeper != BASIC_SWEEPER:
        return f"trial {job_num}"
    last = [key.rsplit(".", 1)[-1] for key in varying]
    given = _assignments(overrides)
    return " ".join(
        f"{short if last.count(short) == 1 else key}={given[key]}"
        for key, short in zip(varying, last)
        if key in given
    )


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
        if _resuming(cfg):  # in a sweep, resume=auto is decided per job, at its start
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


def _resuming(config: DictConfig) -> bool:
    return str(OmegaConf.select(config, "resume") or "").strip().lower() == "auto"


def _sweep_tokens(overrides: Sequence[str]) -> set[str]:
    """The overrides that define a sweep (what `resume` is set to does not)."""
    return {o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith("resume")}


def overrides_tag(overrides: Sequence[str]) -> str:
    """A sweep's overrides as its parent's `sweep.overrides` tag: a command line's words, each
    quoted as the shell needs (`"data.root='/data/my set'"` stays one override)."""
    return shell.join(overrides)


def _tagged_overrides(text: str, now: Sequence[str]) -> set[str]:
    """The overrides of a `sweep.overrides` tag, as `_sweep_tokens` of them. A tag written before
    its words were quoted (joined with spaces: an override with a space in it split in two) reads
    as `now` where it is `now` so joined."""
    if set(text.split()) == set(" ".join(now).split()):
        return _sweep_tokens(now)
    try:
        return _sweep_tokens(shlex.split(text))
    except ValueError:  # (an unbalanced quote: an old tag's words)
        return _sweep_tokens(text.split())


def earlier_sweep(tracker: Any, sweep_dir: Path, overrides: Sequence[str]) -> Any:
    """The parent run of the sweep run before in `sweep_dir` (the newest, if several), or None;
    a ConfigError when its overrides differ from `overrides` (naming what differs), since its
    finished jobs would not be this sweep's."""
    folder = str(Path(sweep_dir).resolve())
    runs = tracker.runs(tags={tag.SWEEP_DIR: folder}, newest_first=True)
    if not runs:
        return None
    parent = runs[0]
    before = _tagged_overrides(parent.tags.get(tag.SWEEP_OVERRIDES, ""), overrides)
    now = _sweep_tokens(overrides)
    if before != now:
        differs = [f"-{o}" for o in sorted(before - now)] + [f"+{o}" for o in sorted(now - before)]
        raise ConfigError(
            "resume",
            f"the sweep in {folder} (parent run {parent.run_id}) "
            f"was run with other overrides: {shell.join(differs)} (- then, + now); "
            "its finished jobs would not be this sweep's",
            f"the same overrides as then ({shell.join(sorted(before))}) with "
            "resume=auto, or another hydra.sweep.dir for a new sweep",
        )
    return parent


class SweepJobFailed(RuntimeError):
    """A sweep job failed (already recorded as a FAILED child run): what a sweeper other than
    Hydra's basic one receives as the job's error."""


def run_job(
    cfg: DictConfig,
    parent: SweepParent,
    *,
    overrides: Sequence[str],
    output_dir: str,
    job_num: int,
    sweeper: str = BASIC_SWEEPER,
) -> float:
    """One sweep job as a child run. A failure is logged and recorded as a FAILED child (also when
    it happened before the run existed). Under Hydra's basic sweeper it is then returned as NaN, so
    the sweep goes on (that sweeper stops at the first job that raises and skips the end-of-sweep
    callback). Under any other `sweeper` (Optuna's) it raises `SweepJobFailed`: the sweeper sees a
    failed job (Optuna tells the trial FAIL and counts it against
    `hydra.sweeper.max_failure_rate`), where a NaN objective would crash Optuna's study; a job
    that finishes without a finite objective raises there too.

    In a process apart from the sweep's (a joblib worker, a submitit job: runner.sweep.stop), a
    job that starts after the sweep was stopped does not run, and one that a signal stopped (its
    run KILLED, with its checkpoint) is a failed job (NaN, or `SweepJobFailed`) rather than an
    interruption (joblib would end the other jobs' processes at once, submitit would find no
    result); the sweep's process ends the sweep."""
    from runner.run.app import run
    from runner.run.interrupts import RunInterrupted, preemption_signal, submitit_job
    from runner.run.plan import default_run_name
    from runner.sweep import stop

    tags = {tag.PARENT_RUN: parent.run_id, tag.JOB_NUM: str(job_num)}
    raises = bool(sweeper) and sweeper != BASIC_SWEEPER
    apart = job_label(overrides, parent.varying.split(), job_num, sweeper)
    if parent.stopped:
        return _not_run(
            f"job #{job_num} not started: the sweep was stopped ({parent.stopped})", raises
        )
    try:
        same_store(cfg, parent.tracker, parent.location, parent.experiment_name)
        requeue = not _resuming(cfg) and submitit_job()
        if _resuming(cfg) or requeue:
            done, cfg = _resume_job(cfg, parent, job_num, requeue=requeue)
            if done is not None:
                return done
        best = run(cfg, overrides=overrides, output_dir=output_dir, extra_tags=tags, apart=apart)
    except RunInterrupted as interrupted:
        if not stop.in_worker():
            raise  # the sweep's own process: the sweep stops here
        if interrupted.signum == preemption_signal():
            stop.requeue(interrupted.signum)  # (exits, when submitit requeues the job)
        return _not_run(f"job #{job_num} stopped: {interrupted}", raises)
    except Exception as error:  # noqa: BLE001  (recorded and counted; the sweep goes on)
        if isinstance(error, RunnerError):
            log.error("Sweep job #%d failed: %s", job_num, error)
        else:
            from runner.run import failure

            failure.keep(error)  # (once: a run that existed has kept it already)
            log.error(
                "Sweep job #%d failed with an unexpected error.\n%s", job_num, failure.told(error)
            )
        try:
            tracker = parent.open()
            if not parent.children(tracker, job_num):
                tracker.record_failure(default_run_name(cfg, apart=apart), tags, error, output_dir)
        except Exception:  # noqa: BLE001  (the store itself is failing: the log says so)
            log.exception("Could not record sweep job #%d's failure in MLflow", job_num)
        if raises:
            raise SweepJobFailed(
                f"sweep job #{job_num} failed: {type(error).__name__}: {error}"
            ) from error
        return math.nan
    if best is None or not math.isfinite(best):
        if raises:
            raise SweepJobFailed(
                f"sweep job #{job_num} finished without a finite objective "
                f"({best}): an optimising sweeper cannot use it"
            )
        return math.nan
    return best


def _not_run(what: str, raises: bool) -> float:
    """A job that a signal kept from its end: said, then NaN or (`raises`) `SweepJobFailed`."""
    log.warning("Sweep %s", what)
    if raises:
        raise SweepJobFailed(f"sweep {what}")
    return math.nan


def _resume_job(
    cfg: DictConfig, parent: SweepParent, job_num: int, requeue: bool = False
) -> tuple[float | None, DictConfig]:
    """A job of a resumed sweep (`resume=auto`): (its objective, when its earlier run finished
    and is kept; else None, and the config to run it with). An earlier run that did not finish
    resumes from its checkpoint in the same run; one without a checkpoint is deleted and the job
    starts afresh (so the tree holds one child per job); a job that never ran starts afresh (not
    from another sweep's run of the same name). With `requeue`, a job of submitit's, which ran
    before in this sweep when submitit requeued it (its time limit, a preemption): it continues
    its run the same way, and a job that never ran keeps its config as given."""
    from runner.run import checkpoint
    from runner.tracking.base import FINISHED

    tracker = parent.open()
    runs = parent.children(tracker, job_num)
    earlier = runs[0] if runs else None  # this job's child run from an earlier session
    if earlier is None and requeue:
        return None, cfg
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.resume = None
    if earlier is None:
        return None, cfg
    if earlier.status == FINISHED:
        metrics = earlier.metrics
        best = metrics.get("best_val_acc", metrics.get("best_val_loss"))
        log.info(
            "Sweep job #%d finished in an earlier session (run %s): kept, not run again",
            job_num,
            earlier.run_id,
        )
        return (math.nan if best is None else float(best)), cfg
    path = (
        checkpoint.run_folder(
            cfg.trainer.checkpoint_dir, cfg.mlflow.experiment_name, earlier.run_name
        )
        / earlier.run_id
        / checkpoint.FILENAME
    )
    if path.is_file():
        log.info(
            "Sweep job #%d resumes its run %s (%s) from %s",
            job_num,
            earlier.run_id,
            earlier.status,
            path,
        )
        cfg.resume = str(path)
    else:
        log.info(
            "Sweep job #%d: its run %s (%s) left no checkpoint: it starts again",
            job_num,
            earlier.run_id,
            earlier.status,
        )
        tracker.reader.delete_run(earlier.run_id)
    return None, cfg


def speed_summary(
    children: Sequence[Any], history: Callable[[str, str], Sequence[tuple[int, float]]]
) -> str:
    """The sweep's jobs side by side at the speed that compares, one line each in job order: each
    finished job's steady throughput (`tokens_per_s` for a language model, else `samples_per_s`:
    runner.measure.timing), the mean over its epochs that logged one, as its "Finished" line and the
    report give it, and its ratio to its baseline, named: the O0 job of the same model and the same
    values of what else the sweep varies, seeds apart (the nearest of them: `varying.distance`), as
    the report compares (`runner.tracking.varying`; else that group's first job, else the sweep's).
    It was the sweep's first job for all, so `-m precision=o2,o0` called O0 the slower one, where
    the report gives O2 against O0; and an lr's O2 was compared with another lr's O0. `history`: a
    metric's (step, value) points of a run (runner.tracking.base.Reader.history)."""
    from runner.measure.timing import SAMPLES_PER_S, TOKENS_PER_S
    from runner.tracking.base import FINISHED

    lines, rated = [], []
    for child in sorted(children, key=lambda c: int(c.tags.get(tag.JOB_NUM, 0))):
        if child.status != FINISHED:
            continue
        metric = TOKENS_PER_S if TOKENS_PER_S in child.metrics else SAMPLES_PER_S
        rates = [v for _, v in history(child.run_id, metric) if math.isfinite(v)]
        if not rates:
            lines.append((child, None, ""))
            continue
        rate = sum(rates) / len(rates)
        rated.append((child, rate))
        lines.append((child, rate, metric.removesuffix("_per_s")))

    keys = baseline_keys([c for c, _ in rated])
    names = display_names([c for c, _, _ in lines])  # (ids where names repeat: two machines)

    def group(child: Any) -> tuple:
        model = child.tags.get(tag.MODEL) or child.params.get("model.name")
        params = params_of(child)
        return (model, *(params.get(k) for k in keys))

    groups = {c.run_id: group(c) for c, _ in rated}  # (once a job: baseline compares them all)

    def baseline(child: Any) -> tuple[Any, float]:
        same = [(c, r) for c, r in rated if groups[c.run_id] == groups[child.run_id]]
        o0 = [(c, r) for c, r in same if c.params.get("precision.opt_level") == "O0"]
        o0.sort(key=lambda cr: distance(cr[0].params, child.params))
        return (o0 or same or rated)[0]

    out = []
    for child, rate, unit in lines:
        if rate is None:
            out.append(f"  {names[child.run_id]}: no steady throughput (every step was warm-up)")
            continue
        base, base_rate = baseline(child)
        out.append(
            f"  {names[child.run_id]}: {rate:,.0f} {unit}/s steady ({rate / base_rate:.2f}x "
            f"{names[base.run_id]})"
        )
    return "".join(line + "\n" for line in out)
