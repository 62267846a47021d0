"""Which params differ between runs, and so which runs compare: the report's columns of "what
differs" and the O0 baseline of each run (the report's table, the sweep's closing summary) are
read from here, so that both compare a run with the same baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runner import metrics as m
from runner.tracking import tags as tag

# Params the report's table shows in columns of their own (model, level and dtype, optimizer,
# batch size, with the batches a step accumulates: "64 x 4") or that follow from others (a
# model's parameter count, the global batch, the dataset's sizes): never listed as what varies
# between runs.
ACCUMULATE = "trainer.accumulate_grad_batches"
GLOBAL_BATCH = "trainer.global_batch_size"  # (logged by the run: runner.run.recorded.run_record)
SHOWN_PARAMS = (
    "model.name",
    "model.arch",
    "optimizer.name",
    "trainer.batch_size",
    ACCUMULATE,
    "task.name",
)
SHOWN_PREFIXES = ("precision.",)
DERIVED_PARAMS = (
    "model.num_parameters",
    m.BATCHNORM_LAYERS,
    m.FLOPS_PER_SAMPLE,
    GLOBAL_BATCH,
    "data.train_size",
    "data.val_size",
    "mlflow.run_name",
)
SEED_PARAMS = ("trainer.seed", "data.seed")
# The machine a run trained on (its `device_name` tag: a GPU's name, or the CPU's), an axis like
# a param: an O2 run on an H200 is not compared with an O0 run on a laptop's CPU, nor with one on
# an A100 (`trainer.device` logs `auto` on both). Runs that did not tag it count on no machine.
MACHINE = "machine"
# trainer.tune's decisions (runner.run.tune: `tune.<key>`, "<value> (<why>)", and `tune.source`):
# the runner's, per run, not an axis the user swept; a key it decided is not one either
TUNE_PREFIX, TUNE_GIVEN = "tune.", "kept: given"


def tuned_keys(runs: Sequence[Any]) -> set[str]:
    """The config keys whose value trainer.tune decided in at least one of the runs (tuned, or
    kept after measuring, rather than given by the user)."""
    return {
        k[len(TUNE_PREFIX) :]
        for r in runs
        for k, why in r.params.items()
        if k.startswith(TUNE_PREFIX) and k != "tune.source" and TUNE_GIVEN not in str(why)
    }


def params_of(run: Any) -> Mapping[str, Any]:
    """A run's params, with the machine it trained on (MACHINE, from its tags where it has them:
    a reader's record; a report's row carries it among its params already)."""
    params, tags = run.params, getattr(run, "tags", None) or {}
    if MACHINE in params or not tags.get(tag.DEVICE_NAME):
        return params
    return {**params, MACHINE: tags[tag.DEVICE_NAME]}


def varying_params(runs: Sequence[Any]) -> list[str]:
    """The params whose values differ between the runs (only those: "what differs"), apart from
    those the table shows anyway and trainer.tune's decisions (a tuned level's channels_last is
    part of its result, not a different experiment: grouped by it, a tuned sweep's O2 had no O0
    to compare with); runs that logged no params (a job that failed before its run began) do
    not count; nor the keys of one option that other runs did not pick (a GPT's `model.n_embd`
    beside a CNN). `runs`: anything with the run's `params` (a report's rows, a reader's
    records)."""
    logged = [params_of(r) for r in runs if r.params]
    keys = sorted({k for params in logged for k in params})
    tuned = tuned_keys(runs)
    return [
        k
        for k in keys
        if k not in SHOWN_PARAMS
        and k not in DERIVED_PARAMS
        and not k.startswith((*SHOWN_PREFIXES, TUNE_PREFIX))
        and k not in tuned
        and len({p.get(k) for p in logged if k != MACHINE or k in p}) > 1
        and not _of_an_option(k, logged)
    ]


def _of_an_option(key: str, logged: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `key` is a key of one option of its group that some runs did not pick: some runs
    lack it, and the group's option differs between the runs (`model.width`: tiny's, which a
    GPT does not have; `optimizer.momentum`: SGD's). It is part of that option, which its own
    column names, not an axis of its own; a key one run added to the same option is."""
    if key == MACHINE or all(key in params for params in logged):
        return False
    section = key.partition(".")[0]
    return any(
        len({params.get(f"{section}.{name}") for params in logged}) > 1
        for name in ("name", "arch", "_target_")
    )


def baseline_keys(runs: Sequence[Any]) -> list[str]:
    """The params a run shares with its O0 baseline, besides its model: those that vary between
    `runs`, seeds apart (an lr's O2 is compared with the O0 of its lr; a seed's with any seed's
    where the same seed did not run)."""
    return [k for k in varying_params(runs) if k not in SEED_PARAMS]


def distance(base: Mapping[str, Any], run: Mapping[str, Any]) -> tuple[bool, ...]:
    """How far an O0 run of `run`'s group (params `base`) is from its baseline, to sort them (False,
    the same, first): whether its seeds differ, then its optimizer, the samples a step learns from
    (the logged `trainer.global_batch_size`: batch size x batches a step x processes), its batch
    size, the batches a step sums. An O2 run of batch 256 compares with an O0 of 256 where one ran,
    else with the O0 of 64 x 4 that fit."""
    return (
        any(base.get(k) != run.get(k) for k in SEED_PARAMS),
        base.get("optimizer.name") != run.get("optimizer.name"),
        base.get(GLOBAL_BATCH) != run.get(GLOBAL_BATCH),
        base.get("trainer.batch_size") != run.get("trainer.batch_size"),
        str(base.get(ACCUMULATE, 1)) != str(run.get(ACCUMULATE, 1)),
    )


def display_names(runs: Sequence[Any]) -> dict[str, str]:
    """run id -> the run's name, with the start of its id where several runs share the name (a
    sweep's jobs on two machines, a name given twice): the report's rows, the sweep's summary."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.run_name] = counts.get(r.run_name, 0) + 1
    return {
        r.run_id: r.run_name if counts[r.run_name] == 1 else f"{r.run_name} ({r.run_id[:8]})"
        for r in runs
    }
