"""Value rules that types cannot express, checked before anything is built or logged.

Hydra and the schemas in `runner.config` already reject unknown keys, wrong types and unknown
group choices; this catches the rest (a negative lr, an unknown model name, a data.root that does
not exist) with a message naming the key, what was wrong and what is allowed. The rules of an
option live with its spec (`runner.config.options`); those of the other groups are here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import typing
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, ValidationError

from runner.config import (
    COMPILE_MODES,
    CUDA_GRAPHS,
    DEVICES,
    FSDP_CHECKPOINTS,
    KERNEL_CHOICES,
    STRATEGIES,
    TASK_CHOICES,
    TRACKERS,
    TUNE_CHOICES,
    mistakes,
    options,
)
from runner.config.schema import RunConfig
from runner.config.values import (  # noqa: F401  (the predicates, where they were before)
    BARE_DATABASE_PATH,
    BATCH_LIMIT,
    SEED_RANGE,
    Rule,
    bare_database_path,
    bare_database_refusal,
    batch_limit,
    finite,
    integer_at_least,
    non_negative,
    one_of,
    optional,
    positive,
    seed,
    unit_interval,
)
from runner.errors import ConfigError


def _rules(
    cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]] | None = None
) -> list[Rule]:
    """(key, predicate, what is allowed) for every key present in this config (`specs`: each
    group's option spec, where the caller has them)."""
    specs = options.specs_of(cfg) if specs is None else specs
    rules: list[Rule] = []
    for group in options.GROUPS:  # the name (unless a `_target_` names the callable), its rules
        node = cfg.get(group)
        if node is None:
            continue
        if not options.has_target(node):
            names = options.names(group)
            rules.append((f"{group}.name", one_of(names), ", ".join(names)))
        spec = specs.get(group)
        if spec is not None:
            rules += [(f"{group}.{key}", ok, allowed) for key, ok, allowed in spec.rules]
    return rules + _fixed_rules()


def _fixed_rules() -> list[Rule]:
    """The rules of the keys outside the groups' options (trainer, precision, mlflow, ...)."""
    return [
        ("task.name", one_of(TASK_CHOICES), ", ".join(TASK_CHOICES)),
        ("loss.label_smoothing", lambda v: finite(v) and 0 <= v < 1, "a number in [0, 1)"),
        ("precision.kernels", one_of(KERNEL_CHOICES), ", ".join(KERNEL_CHOICES)),
        # precision.layer_plan=auto: its pre-flight's steps and the shares a format may lose
        ("precision.layer_plan_steps", integer_at_least(1), "an integer >= 1"),
        ("precision.layer_plan_max_underflow", unit_interval, "a share in [0, 1)"),
        ("precision.layer_plan_max_overflow", unit_interval, "a share in [0, 1)"),
        ("data.seed", seed, SEED_RANGE),
        ("trainer.seed", seed, SEED_RANGE),
        ("trainer.max_epochs", lambda v: v >= 1, "an integer >= 1"),
        ("trainer.batch_size", lambda v: v >= 1, "an integer >= 1"),
        (
            "trainer.device",
            one_of(DEVICES),
            ", ".join(DEVICES) + " (one GPU of several: CUDA_VISIBLE_DEVICES=3 python -m runner "
            "...; a sweep's jobs each on a GPU of their own: hydra/launcher=parallel)",
        ),
        ("trainer.strategy", one_of(STRATEGIES), ", ".join(STRATEGIES)),
        ("trainer.fsdp_checkpoint", one_of(FSDP_CHECKPOINTS), ", ".join(FSDP_CHECKPOINTS)),
        (
            "trainer.fsdp_wrap",
            optional(lambda v: len(v) > 0 and all(isinstance(x, str) and x.strip() for x in v)),
            "null (the model's blocks) or a non-empty list of class names or module-name globs",
        ),
        ("trainer.num_workers", lambda v: v >= 0, "an integer >= 0"),
        ("trainer.grad_clip_norm", optional(positive), "null or a finite number > 0"),
        (
            "trainer.accumulate_grad_batches",
            lambda v: v >= 1,
            "an integer >= 1 (batches whose gradients are summed into one optimizer step)",
        ),
        ("trainer.limit_train_batches", optional(batch_limit), BATCH_LIMIT),
        ("trainer.limit_val_batches", optional(batch_limit), BATCH_LIMIT),
        ("trainer.log_every_n_steps", lambda v: v >= 1, "an integer >= 1"),
        (
            "trainer.warmup_steps",
            lambda v: v >= 0,
            "an integer >= 0 (the first steps of each session left out of the steady figures)",
        ),
        ("trainer.max_bad_steps", lambda v: v >= 1, "an integer >= 1"),
        ("trainer.collapsed_loss_scale", non_negative, "a finite number >= 0 (0: never)"),
        (
            "trainer.checkpoint_every_n_epochs",
            lambda v: v >= 0,
            "an integer >= 0 (0: only when interrupted)",
        ),
        ("trainer.checkpoint_dir", lambda v: bool(v and v.strip()), "a folder path"),
        ("trainer.compile_mode", one_of(COMPILE_MODES), ", ".join(COMPILE_MODES)),
        ("trainer.cuda_graphs", _graphs_mode, ", ".join(CUDA_GRAPHS) + " (true: optimizer)"),
        ("trainer.tune", one_of(TUNE_CHOICES), ", ".join(TUNE_CHOICES)),
        ("trainer.tune_budget_s", optional(positive), "null or a finite number of seconds > 0"),
        (
            "trainer.diagnose_every_n_steps",
            lambda v: v >= 0,
            "an integer >= 0 (0: off; n: diagnose steps 1, 1+n, 1+2n, ...)",
        ),
        ("tracking.name", one_of(TRACKERS), ", ".join(TRACKERS)),
        ("mlflow.tracking_uri", lambda v: bool(v and v.strip()), "a non-empty MLflow URI"),
        (
            "mlflow.tracking_uri",
            lambda v: not bare_database_path(v),
            BARE_DATABASE_PATH,
        ),
        ("mlflow.experiment_name", lambda v: bool(v and v.strip()), "a non-empty name"),
        ("mlflow.heartbeat_s", lambda v: finite(v) and v >= 1, "a number of seconds >= 1"),
        (
            "mlflow.stale_after_s",
            positive,
            "a finite number of seconds > 0, at least twice mlflow.heartbeat_s",
        ),
        (
            "mlflow.system_metrics_s",
            lambda v: finite(v) and (v == 0 or v >= 0.1),
            "0 (off) or a number of seconds >= 0.1",
        ),
    ]


def _graphs_mode(value: Any) -> bool:
    """trainer.cuda_graphs: a bool as Hydra reads true/false (true: optimizer), or a mode."""
    return isinstance(value, bool) or value in CUDA_GRAPHS[1:]


def setting_problem(key: str, value: Any) -> Optional[str]:
    """Why `value` may not be set at `key`, a key of a typed section of the run's config
    (trainer.num_workers, precision.kernels), as `validate` says it ("got 'evil' (allowed:
    ...)"); None where it may. For a value that comes from outside the composed config (a tune
    cache's row): its type is the schema's own, not one OmegaConf would convert ("true", 1)."""
    section, _, leaf = key.partition(".")
    node = _typed_section(section)
    if node is None or leaf not in node.keys():  # (`in` is False for ??? values)
        return f"{key} is not a key of a typed section of the run's config"
    probe = copy.deepcopy(node)
    try:
        probe[leaf] = value
        kept = probe[leaf]
    except (ValidationError, ValueError, TypeError):
        kept = _REFUSED
    if kept is _REFUSED or (value is not None and type(kept) is not type(value)):
        wanted = typing.get_type_hints(OmegaConf.get_type(node))[leaf]
        return f"{key}: got {value!r} (allowed: a value of type {_type_name(wanted)})"
    for rule_key, ok, allowed in _fixed_rules():
        if rule_key == key and not _holds(ok, value):
            return f"{key}: got {value!r} (allowed: {allowed})"
    return None


_REFUSED = object()


@functools.cache
def _typed_section(section: str) -> Optional[DictConfig]:
    """The typed node of the run config's `section` (trainer, precision: a dataclass schema),
    with its defaults, built once; None for a section without one (model, data: an option's)."""
    schema = typing.get_type_hints(RunConfig).get(section)
    return OmegaConf.structured(schema) if dataclasses.is_dataclass(schema) else None


def _holds(ok: Any, value: Any) -> bool:
    """Whether `value` passes the rule `ok` (a value of a type the rule cannot take does not)."""
    try:
        return bool(ok(value))
    except TypeError:
        return False


def _type_name(hint: Any) -> str:
    """`Optional[bool]` as "bool or null", `int` as "int"."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return f"{_type_name(args[0])} or null"
    return getattr(hint, "__name__", str(hint))


_NOT_GLOBAL = (
    "an experiment file's setting of {0} was placed under experiment (its own free-form "
    "settings), where nothing reads it: the file's first line must be `# @package _global_` "
    "(experiments/README.md); a setting of its own takes another name than the run's sections"
)


def _check_known_keys(cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]]) -> None:
    """Hydra's `+key=value` appends even to typed nodes, and to the root; a key no schema declares
    is a typo (`+lr=0.1` for `optimizer.lr=0.1`) that would otherwise change nothing, silently.
    An option file of one's own that names a built-in option (`name: tiny`) without its schema in
    the defaults list is untyped: its keys are checked against the option's schema (`specs`), so
    a misspelt one (`widht: 8`) is not kept unread."""
    root = [f.name for f in dataclasses.fields(RunConfig)]
    for key in cfg:
        if key in root or key == "hydra":  # (hydra: Hydra's own, where a caller kept it)
            continue
        homes = [
            f"{section}.{key}"
            for section in root
            if isinstance(cfg.get(section), DictConfig) and key in cfg[section]
        ]
        if homes:  # a group's key given at the top
            listed = " or ".join(homes)
            raise ConfigError(str(key), f"unknown key at the top level; did you mean {listed}?")
        raise mistakes.unknown_key("", str(key), root)
    own = cfg.get("experiment")
    misplaced = [k for k in own if k in root or k == "hydra"] if isinstance(own, DictConfig) else []
    if misplaced:  # (an experiment file without its package line: its keys, all unread)
        raise ConfigError(f"experiment.{misplaced[0]}", _NOT_GLOBAL.format(misplaced[0]))
    for section in cfg:
        node = cfg[section]
        if not isinstance(node, DictConfig):
            continue
        schema = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(schema) and specs.get(section) is not None:
            schema = specs[section].schema  # (an untyped option file of one's own)
        if not dataclasses.is_dataclass(schema):
            continue
        declared = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in declared:
                raise mistakes.unknown_key(str(section), str(key), declared)


def validate(cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]] | None = None) -> None:
    """Raise ConfigError for the first key whose value breaks its rule (`specs`: each group's
    option spec, `options.specs_of(cfg)`, where the caller has them)."""
    specs = options.specs_of(cfg) if specs is None else specs
    _check_known_keys(cfg, specs)
    for key, ok, allowed in _rules(cfg, specs):
        section, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, section)
        if parent is None or leaf not in parent.keys():  # (`in` is False for ??? values)
            continue  # this option has no such key (e.g. momentum for adam)
        if OmegaConf.is_missing(parent, leaf):
            raise ConfigError(key, "is required but not set", allowed)
        value = parent[leaf]
        if not _holds(ok, value):
            source = _interpolated_from(cfg, parent, leaf)
            if source is not None:  # (model.block_size: ${oc.select:data.block_size,256})
                raise ConfigError(source, f"got {value!r}, which {key} takes", allowed)
            if key == "mlflow.tracking_uri" and bare_database_path(value):  # (the fix, pasted)
                raise ConfigError(key, bare_database_refusal(value), allowed)
            raise ConfigError(key, f"got {value!r}", allowed)
    _check_combinations(cfg)


_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?\s*([A-Za-z_][\w.]*)\s*(?:,[^}]*)?\}$")


def _interpolated_from(cfg: DictConfig, parent: DictConfig, leaf: str) -> Optional[str]:
    """The key whose value `parent.leaf` takes by interpolation (`${data.block_size}` or
    `${oc.select:data.block_size,256}` with that key present), else None: a bad value the user
    gave there is named where they gave it, not at the key that copies it."""
    raw = OmegaConf.to_container(parent, resolve=False).get(leaf)
    match = _INTERPOLATION.match(raw) if isinstance(raw, str) else None
    if match is None:
        return None
    source = match.group(1)
    section, _, key = source.rpartition(".")
    node = OmegaConf.select(cfg, section) if section else cfg
    if not isinstance(node, DictConfig) or key not in node:
        return None
    return source


def _check_combinations(cfg: DictConfig) -> None:
    """Rules that involve several keys."""
    tracking = cfg.mlflow
    if "stale_after_s" in tracking and tracking.stale_after_s < 2 * tracking.heartbeat_s:
        raise ConfigError(
            "mlflow.stale_after_s",
            f"{tracking.stale_after_s} s is less than two heartbeats (mlflow.heartbeat_s="
            f"{tracking.heartbeat_s}): a live run on another host would be ended as vanished "
            "after one late heartbeat",
            f"a number >= {2 * tracking.heartbeat_s:g} (2 x mlflow.heartbeat_s)",
        )
    opt = cfg.optimizer
    sched = cfg.get("scheduler")
    if sched is not None and sched.get("name") == "cosine" and sched.eta_min > opt.lr:
        raise ConfigError(
            "scheduler.eta_min",
            f"{sched.eta_min:g} is above optimizer.lr={opt.lr:g}: cosine annealing would raise "
            "the learning rate to it over the run, not lower it",
            f"a number in [0, {opt.lr:g}] (the lr the schedule ends at)",
        )
    if opt.get("nesterov") and (opt.momentum <= 0 or opt.dampening != 0):
        raise ConfigError(
            "optimizer.nesterov",
            f"needs momentum > 0 and dampening 0 (got momentum {opt.momentum}, "
            f"dampening {opt.dampening})",
            "nesterov=false, or momentum > 0 with dampening 0",
        )
