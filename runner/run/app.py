"""One run, start to finish: plan -> tracker -> trainer -> fit.

`run(cfg)` reads top-down. The config as given is planned first (`make_plan`: every check, before
anything exists, so a bad config leaves no run behind; `dry_run=true` prints this plan). Then, on
each rank: the tracker (rank 0 talks to the store), what is measured before the run's own plan
(the auto layer plan's pre-flight, trainer.tune: runner.run.measured) and that plan, made once
with it; the parts built from it (runner.run.build); the MLflow run started with what it records
(runner.run.recorded); and the trainer's fit, its checkpointer (runner.run.checkpointer) writing
as it goes. Once the MLflow run exists it always ends FINISHED, FAILED or KILLED, with its config,
precision table and log attached.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner import csrc
from runner.config import mistakes
from runner.metrics import SAMPLES_PER_S
from runner.precision import Resolution, layers
from runner.precision.checks import DeviceInfo, state_findings
from runner.run import distributed, failure, out_of_memory, time_left, tune, watch
from runner.run.build import build, shape_findings, sharded
from runner.run.checkpointer import Checkpointer
from runner.run.context import RunContext
from runner.run.distributed import Comm
from runner.run.interrupts import StoppedAtOnce, StopRequest
from runner.run.measured import measured_plan
from runner.run.parts import Parts
from runner.run.plan import RunPlan, make_plan, slow_fp16
from runner.run.recorded import (
    Launch,
    environment_tags,
    own_folder,
    record_start,
    run_folder,
    run_record,
    sizes,
)
from runner.run.trainer import Trainer
from runner.run.tune_decision import Tuning
from runner.tracking import job_log
from runner.tracking import tags as tag

log = logging.getLogger(__name__)


def run(
    cfg,
    *,
    overrides: Sequence[str] = (),
    output_dir: str | os.PathLike | None = None,
    extra_tags: Mapping[str, str] | None = None,
    apart: str = "",
) -> float | None:
    """Train once as `cfg` says; returns the task's objective (runner.tasks): a classifier's
    best validation accuracy, a language model's best validation loss (None for a dry run).
    `extra_tags` are added to the run's own (a sweep job passes its parent run's id this way),
    `apart` to its default name (a sweep job's swept values: runner.run.plan.default_run_name).
    Under torchrun this is one rank of a DistributedDataParallel run (see
    runner.run.distributed)."""
    distributed.rank_zero_logging()  # (torchrun: rank 0 tells the run, the others errors)
    mistakes.check_one_option(overrides)
    job_log.tolerate_write_errors()  # (a full disk: one line, not a traceback a line logged)
    run_log = job_log.find(output_dir)
    launch = Launch(
        tuple(overrides),
        apart,
        Path(output_dir) if output_dir is not None else None,
        dict(extra_tags or {}),
        run_log,
        job_log.size(run_log),
    )
    given = make_plan(cfg, apart)  # the config as given, checked: bad input stops here
    if cfg.dry_run:
        print_dry_run(given)
        return None
    if finished(given):
        return given.resume.best()
    comm, device = distributed.setup(given.device)
    try:
        with distributed.catch_lost_peers(comm):  # (a rank gone: one line, not gloo's traceback)
            return train(given, comm, device, launch)
    finally:
        comm.close()


def finished(plan: RunPlan) -> bool:
    """Whether `plan` resumes a run that met its epoch budget: said, and its MLflow run stays as
    it ended (resume=auto run again)."""
    if plan.resume is None or not plan.resume.finished(plan.cfg.trainer.max_epochs):
        return False
    log.info("%s %s", plan.run_name, plan.resume.finished_message())
    return True


def train(given: RunPlan, comm: Comm, device: torch.device, launch: Launch) -> float:
    """`run`'s second half on this rank's `device`: the tracker (rank 0: an unreachable store
    stops every rank), the run's plan and parts (`prepare`), then `fit`."""
    tracker = comm.on_main(partial(open_tracker, given, launch))
    if comm.is_main:  # the experiment's RUNNING runs whose process is gone end KILLED
        tracker.reap(own_log=(launch.run_log, launch.log_from) if launch.run_log else None)
    # a model too large for the device is said in one line, before its MLflow run exists
    plan, tuning, parts = out_of_memory.guarded(
        partial(prepare, given, comm, device, launch),
        device,
        given.properties.opt_level,
        partial(sizes, given),
    )
    if parts is None:
        return plan.resume.best()
    try:
        return fit(plan, comm, device, launch, tracker, parts, tuning)
    finally:
        # the loaders' worker processes end with the run, whatever may still hold the loaders
        # (a reference cycle, an exception's traceback): see components.loaders.shutdown_workers
        parts.close()


def open_tracker(plan: RunPlan, launch: Launch) -> Any:
    """The run's tracker (runner.tracking), once its folder is checked to be free for it."""
    from runner.tracking.trackers import open_tracker as opened

    return own_folder(opened(plan.cfg, run_folder(plan, launch)), plan, launch)


def prepare(
    given: RunPlan, comm: Comm, device: torch.device, launch: Launch
) -> tuple[RunPlan, Optional[Tuning], Optional[Parts]]:
    """The run's plan, made once with what is measured before it (runner.run.measured), and its
    parts built from it (None: a resumed run that had nothing left to train, found once the
    measured settings named it)."""
    datasets = None
    if tune.counts_on_data(given, comm):  # (loaded once: tuning counts the steps, build trains)
        from runner.components.data import build_datasets

        datasets = build_datasets(given.cfg.data, given.specs.get("data"))
    plan, tuning = measured_plan(given, comm, device, launch, datasets)
    if plan is not given and finished(plan):
        return plan, tuning, None
    log_precision(plan)
    # a single run does not wait for a first build of the kernels (torch's ops this once); a
    # sweep's jobs and a distributed run's ranks wait, so that they all step the same way
    wait = comm.active or tag.PARENT_RUN in launch.extra_tags
    return plan, tuning, build(plan, device, comm, datasets=datasets, wait_for_kernels=wait)


def log_precision(plan: RunPlan) -> None:
    """The resolved precision table and the plan's findings (a warning where one of them is;
    notes alone are info)."""
    properties = plan.properties
    log.info("Precision (Apex %s, resolved):\n%s", properties.opt_level, properties.table())
    if plan.resolution.findings:
        said = log.warning if plan.resolution.warnings or plan.resolution.errors else log.info
        said("Precision findings:\n%s", plan.resolution.findings_table())
    else:
        log.info("%s", plan.resolution.findings_table())


def fit(
    plan: RunPlan,
    comm: Comm,
    device: torch.device,
    launch: Launch,
    tracker: Any,
    parts: Parts,
    tuning: Optional[Tuning] = None,
) -> float:
    """Record, track (rank 0) and train the run of `plan` on its built `parts`: its MLflow run
    exists from here on and ends FINISHED, FAILED or KILLED. `tuning`: what trainer.tune
    decided (its params, tune.md and tune_time_s)."""
    if plan.resume is not None:  # the checkpoint must fit what was built, before its run reopens
        plan.resume.check_fits(parts, comm.world_size)
    resolution = Resolution(plan.properties, [*plan.resolution.findings, *parts.findings])
    if parts.findings:  # info only: never stops the run
        log.info(
            "Precision findings about the model:\n%s",
            Resolution(plan.properties, parts.findings).findings_table(),
        )
    model = data_parallel(plan, comm, device, parts.model)
    params, tags = record(plan, comm, device, launch, parts, resolution, tuning)
    checkpointer = Checkpointer(plan, comm, parts)
    with (
        StopRequest() as stop,
        checkpointer.lock(),
        files_folder(launch) as files,
        tracked_run(tracker, plan, comm, launch, params, tags) as tracked,
        failure.record_errors(tracked, launch.run_log, launch.log_from),
        distributed.catch_lost_peers(comm, checkpointer.kept),
    ):
        checkpointer.start(tracked)
        # a second signal where the loop cannot take it: the record ends KILLED at once
        stop.at_once = partial(stopped_at_once, tracked, launch.run_log, launch.log_from)
        if comm.is_main:
            started(tracker, tracked, plan, parts, resolution, launch, tuning)
        context = RunContext(
            on_metrics=tracked.log_metrics,
            comm=comm,
            checkpointer=checkpointer,
            stop=stop,
            on_artifact=tracked.log_file if comm.is_main else None,
            artifact_dir=files / "diagnostics",
            layers_dir=files / "layers",
        )
        trainer = Trainer(plan.cfg.trainer, parts, context, device=device, model=model)
        checkpointer.restore(trainer)
        # running out of memory: one line, the run FAILED with it (runner.run.out_of_memory)
        result = out_of_memory.guarded(
            trainer.fit, device, plan.properties.opt_level, partial(sizes, plan, trainer)
        )
        if comm.is_main:  # the headline figures, side by side in MLflow's UI (summary/)
            headline = parts.task.summary_metrics(result.epochs, result.best, result.train_time_s)
            tracked.log_metrics(headline, plan.cfg.trainer.max_epochs)
        if comm.is_main and tuning is not None and tuning.rows and plan.resume is None:
            record_tuning(tracked, plan, comm, tuning, result.epochs)
    if comm.is_main:
        speed = parts.task.run_speed(result.epochs)  # (the epochs' means, with their spread)
        busy = watch.busy_frac(trainer)  # (a CUDA device's busy share; None elsewhere)
        log.info(
            "Finished %s: %s %.4f in %s%s%s.\n%s",
            plan.run_name,
            result.objective.replace("_", " ", 1),
            result.best,
            time_left.took(result.train_time_s),
            f", {speed}" if speed else " (no steady step: see the warm-up above)",
            "" if busy is None else f", device busy {busy:.0%}",
            tracker.hint(),
        )
    return result.best


def data_parallel(
    plan: RunPlan, comm: Comm, device: torch.device, model: torch.nn.Module
) -> torch.nn.Module:
    """The model a distributed run trains through: DDP-wrapped (a sharded model is FSDP2's
    already); a single process's own."""
    if not comm.active or sharded(plan, comm):
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def record(
    plan: RunPlan,
    comm: Comm,
    device: torch.device,
    launch: Launch,
    parts: Parts,
    resolution: Resolution,
    tuning: Optional[Tuning],
) -> tuple[dict[str, str], dict[str, str]]:
    """The MLflow run's params and tags (runner.run.recorded.run_record), with trainer.tune's
    decision for a new run."""
    from runner.tracking.record import typed_command

    kernels = csrc.name_of(parts.engine.kernels)
    log.info("Kernels: %s (precision.kernels=%s)", kernels, plan.cfg.precision.kernels)
    params, tags = run_record(
        plan,
        parts,
        resolution,
        world_size=comm.world_size,
        launch=launch,
        environment=environment_tags(device),
        kernels=kernels,
        command=typed_command(),
        log_head=job_log.head(launch.run_log, launch.log_from),
    )
    if tuning is not None and plan.resume is None:
        params.update(tuning.params())
    return params, tags


def tracked_run(
    tracker: Any, plan: RunPlan, comm: Comm, launch: Launch, params: dict, tags: dict
) -> Any:
    """The run's MLflow run (rank 0; the other ranks' record nothing): a new one, or the resumed
    run's own, reopened."""
    from runner.tracking.base import null_run

    if not comm.is_main:
        return null_run()
    return tracker.start_run(
        plan.run_name,
        params,
        tags,
        resume_run_id=plan.resume.run_id if plan.resume is not None else None,
        folder=run_folder(plan, launch),
    )


@contextlib.contextmanager
def files_folder(launch: Launch) -> Iterator[Path]:
    """Where the run writes its diagnostics' and layer audit's files: Hydra's output folder, or
    (a run started from Python) a temporary one, removed once the run has ended and its store,
    or the offline store, took them."""
    if launch.output_dir is not None:
        yield launch.output_dir
        return
    with tempfile.TemporaryDirectory(prefix="amp-run-") as folder:
        yield Path(folder)


def started(
    tracker: Any,
    tracked: Any,
    plan: RunPlan,
    parts: Parts,
    resolution: Resolution,
    launch: Launch,
    tuning: Optional[Tuning],
) -> None:
    """Rank 0, once the MLflow run exists: where it is, the system metrics' sampling, and for a
    new run what it records at the start (runner.run.recorded.record_start)."""
    cfg = plan.cfg
    log.info("%s run %r (%s) in %s", tracker.label, plan.run_name, tracked.run_id, tracker.location)
    if cfg.mlflow.system_metrics_s > 0:
        tracked.sample_system(cfg.mlflow.system_metrics_s, resumed=plan.resume is not None)
    if plan.resume is None:
        record_start(tracked, plan, parts, resolution, launch, tuning)


def print_dry_run(plan: RunPlan) -> None:
    """What `dry_run=true` shows: the config, the properties, every finding (the model's Tensor
    Core shapes and, with low-bit optimizer state, the parameters that keep plain state, from a
    model built on the meta device), the layer plan and the resume decision."""
    device = DeviceInfo.from_torch(plan.device)
    findings = shape_findings(plan.cfg, plan.properties, device, plan.meta_model)
    if plan.properties.low_bit_state:
        model = plan.meta_model()
        if model is not None:
            findings += state_findings(model, plan.properties)
    print(OmegaConf.to_yaml(plan.cfg, resolve=True))
    print(
        f"Task: {plan.task}"
        + (
            " (task=auto: the dataset's)"
            if OmegaConf.select(plan.cfg, "task.name") == "auto"
            else ""
        )
    )
    print(plan.properties.table())
    print(Resolution(plan.properties, [*plan.resolution.findings, *findings]).findings_table())
    if plan.properties.layer_plan == layers.AUTO:
        print(
            f"Layer plan: auto, measured before training by a pre-flight of "
            f"{plan.cfg.precision.layer_plan_steps} fp32 steps (runner.run.autoplan)"
            + ("; then precision.layers on top" if plan.properties.layers else "")
        )
    elif plan.layer_rules:
        print(
            "Layer plan:\n"
            + (
                plan.layer_check.table()
                if plan.layer_check is not None
                else "(checked against the model once its data is loaded)"
            )
        )
    slow = slow_fp16(plan.cfg, plan.properties, plan.device, plan.meta, plan.specs, plan.task)
    if slow is not None:
        print(f"Would refuse: {slow}")
    elif plan.resume is not None and plan.resume.finished(plan.cfg.trainer.max_epochs):
        print(f"Would do nothing: {plan.run_name} {plan.resume.finished_message()}")
    elif plan.resume is not None:
        print(f"Would resume from {plan.resume.path} ({plan.resume.position()})")


def record_tuning(
    tracked: Any, plan: RunPlan, comm: Comm, tuning: Tuning, epochs: Sequence[Mapping]
) -> None:
    """tune.md again, once the run has trained: the run's steady step (its last epoch's
    samples_per_s, a batch of each rank's) beside the step the tuner measured."""
    rates = [e[SAMPLES_PER_S] for e in epochs if math.isfinite(e.get(SAMPLES_PER_S, math.nan))]
    batch = plan.cfg.trainer.batch_size
    run_ms = 1e3 * batch * comm.world_size / rates[-1] if rates and rates[-1] > 0 else None
    said = tuning.against_run(run_ms, batch)
    if said:
        log.info("trainer.tune: %s", said.rstrip())
        tracked.log_text(tuning.table() + "\n" + said, "tune.md")


def stopped_at_once(tracked: Any, run_log: Optional[Path], since: int, signum: int) -> None:
    """`StopRequest.at_once` of a run: its record ended KILLED, stopped at once by `signum`,
    its log attached (runner.run.failure.stopped_at_once)."""
    failure.stopped_at_once(tracked, run_log, since, StoppedAtOnce(signum))
