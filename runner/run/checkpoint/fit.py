"""Whether a checkpoint fits the run that resumes it: its config (`check_resumable`: the same
but for a grown `trainer.max_epochs`) and the parts this run built (`check_structure`: the model's
state, the optimizer, the loss scalers, the layer plan, the scheduler, the world size). Each
difference is named as `key: the checkpoint's -> this run's`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from runner.config import tunable_defaults
from runner.errors import ConfigError
from runner.precision.state import state_format_differences
from runner.run.checkpoint.contents import ALLOWED, RUN_KEYS, is_real, show

# (where the run is recorded or its checkpoints kept is no training setting: tracking.name and
# trainer.checkpoint_dir may change too, checkpoints moved to a disk with room; nor is the bar)
RESUMABLE_CHANGES = (
    "trainer.max_epochs",
    "resume",
    "tracking.name",
    "trainer.checkpoint_dir",
    "trainer.progress_bar",
    "trainer.tune",  # a resumed run tunes nothing: it keeps the checkpoint's settings
    "trainer.tune_budget_s",
)
# keys added to the config after checkpoints were written without them: the value those runs had
# (before the `loss` group, every run trained with a plain cross-entropy; before the `task`
# group, every run was a classifier's, which task=auto still is for the datasets it had)
IMPLIED_BEFORE = {
    "loss._target_": "torch.nn.CrossEntropyLoss",
    "loss.label_smoothing": 0.0,
    "task.name": "auto",
    "trainer.strategy": "ddp",
    "trainer.pin_memory": None,
    "trainer.fsdp_wrap": None,
    "trainer.fsdp_checkpoint": "sharded",
    "precision.layers": {},
    "precision.layer_plan": None,
    "precision.layer_plan_steps": 3,
    "precision.layer_plan_max_underflow": 0.01,
    "precision.layer_plan_max_overflow": 0.0,
}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: saved -> current` for every key whose value differs (or exists on one side only),
    except the ones a resumed run may change."""
    a, b = _flatten(saved), _flatten(current)
    # a tuned run keeps its checkpoint's settings where the current config leaves them at their
    # defaults (runner.run.tune); one given now must still be the checkpoint's
    tuned = a.get("trainer.tune", "off") != "off"
    kept = [k for k, v in tunable_defaults().items() if tuned and b.get(k) == v]
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_CHANGES or key in kept:
            continue
        old, new = a.get(key, IMPLIED_BEFORE.get(key, missing)), b.get(key, missing)
        if old != new:
            show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            out.append(f"{key}: {show(old)} -> {show(new)}")
    return out


def _require_run_keys(state: Mapping[str, Any], path: Path) -> None:
    missing = [key for key in RUN_KEYS if key not in state]
    if missing:
        raise ConfigError(
            "resume",
            f"the checkpoint {path} lacks the key(s) "
            f"{', '.join(missing)}, which every run's checkpoint holds",
            ALLOWED,
        )


def check_resumable(state: Mapping[str, Any], config: Mapping[str, Any], path: Path) -> None:
    """The current config must be the checkpoint's, but for a grown `trainer.max_epochs`."""
    _require_run_keys(state, path)
    differences = config_differences(state["config"], config)
    if differences:
        raise ConfigError(
            "resume",
            f"the config differs from the checkpoint's ({path}) in "
            f"{len(differences)} key(s): " + "; ".join(differences),
            "the checkpoint's config; only trainer.max_epochs may change (grow), and what "
            "does not change the training: "
            + ", ".join(k for k in RESUMABLE_CHANGES if k not in ("trainer.max_epochs", "resume")),
        )
    done = int(state["epoch"])
    wanted = int(config["trainer"]["max_epochs"])
    if wanted < done:
        raise ConfigError(
            "trainer.max_epochs",
            f"{wanted} is below the {done} epochs the checkpoint {path} has already trained",
            f"an integer >= {done}",
        )


def check_structure(
    state: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: Any,
    scheduler: Any,
    world_size: int,
    path: Path,
    reshardable: bool = False,
    tensors: bool = True,
) -> None:
    """The loaded state (see `load`) must fit the parts this run built: the model's state keys,
    shapes and dtypes, the optimizer's groups, parameters and kind, one loss scaler per loss (a
    static one at this run's scale), the scheduler's kind, the world size. Call it before the
    MLflow run is reopened; ConfigError("resume") lists every difference as
    `key: checkpoint's -> this run's`. `reshardable` (a sharded run): another world size is
    taken at an epoch boundary. `tensors=False`: the model and optimizer are not compared here
    (a sharded checkpoint's shards are compared through their index)."""
    _require_run_keys(state, path)
    problems: list[str] = []
    if state["world_size"] != world_size and not (reshardable and state["batch"] == 0):
        problems.append(
            f"world_size: {state['world_size']} -> {world_size}"
            + (
                " (a sharded run resumes at another world size from an epoch's end; this "
                f"checkpoint is {state['batch']} batches into an epoch of the old world's shards)"
                if reshardable
                else ""
            )
        )
    if tensors:  # (a sharded checkpoint's are in its shards: checked against their index)
        problems += _tensor_differences("model", state["model"], model.state_dict())
        problems += _optimizer_differences(state["optimizer"], optimizer)
    problems += _engine_differences(state["engine"], engine)
    problems += _layer_plan_differences(state.get("layer_plan"), engine)
    problems += _scheduler_differences(state["scheduler"], scheduler)
    if problems:
        shown = problems[:_SHOWN] + (
            [f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else []
        )
        raise ConfigError(
            "resume",
            f"the checkpoint {path} does not fit this run in {len(problems)} key(s) "
            "(the checkpoint's -> this run's): " + "; ".join(shown),
            "a checkpoint of this run's model, optimizer, precision level, scheduler and world "
            "size",
        )


_SHOWN = 8  # differences listed in the message (another architecture has one per tensor)


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _tensor_differences(
    prefix: str, saved: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> list[str]:
    out = []
    for key in list(saved) + [k for k in current if k not in saved]:
        a, b = saved.get(key), current.get(key)
        if a is None:
            out.append(f"{prefix}.{key}: (absent) -> {_describe(b)}")
        elif b is None:
            out.append(f"{prefix}.{key}: {_describe(a)} -> (absent)")
        elif a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{prefix}.{key}: {_describe(a)} -> {_describe(b)}")
    return out


# Optimizers told apart by the hyperparameters only their kind has, and the per-parameter state
# their kind keeps (the optimizers runner.components.optim builds; others are checked for counts
# and shapes).
_OPTIMIZER_KINDS: dict[str, tuple[tuple[type, ...], frozenset, frozenset]] = {
    "SGD": (
        (torch.optim.SGD,),
        frozenset({"momentum", "dampening", "nesterov"}),
        frozenset({"momentum_buffer"}),
    ),
    "Adam/AdamW": (
        (torch.optim.Adam, torch.optim.AdamW),
        frozenset({"betas", "eps", "amsgrad"}),
        frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    ),
}


_KIND_KEYS = frozenset().union(*(keys for _, keys, _ in _OPTIMIZER_KINDS.values()))


def _group_kind(group: Mapping[str, Any]) -> Optional[str]:
    for name, (_, keys, _) in _OPTIMIZER_KINDS.items():
        if keys <= set(group):
            return name
    return None


def _optimizer_differences(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> list[str]:
    current = optimizer.param_groups
    groups = saved["param_groups"]
    if len(groups) != len(current):
        return [f"optimizer.param_groups: {len(groups)} group(s) -> {len(current)}"]
    kind = next(
        (
            name
            for name, (classes, _, _) in _OPTIMIZER_KINDS.items()
            if isinstance(optimizer, classes)
        ),
        None,
    )
    out = []
    shapes: dict[int, torch.Size] = {}
    for g, (a, b) in enumerate(zip(groups, current)):
        if len(a["params"]) != len(b["params"]):
            out.append(
                f"optimizer.param_groups.{g}.params: {len(a['params'])} parameter(s) "
                f"-> {len(b['params'])}"
            )
            continue
        shapes.update((index, p.shape) for index, p in zip(a["params"], b["params"]))
        saved_kind = _group_kind(a)
        if kind is not None and saved_kind != kind:
            names = ", ".join(sorted(set(a) & _KIND_KEYS) or ["none of theirs"])
            out.append(
                f"optimizer.param_groups.{g}: the hyperparameters of "
                f"{saved_kind or 'another optimizer'} ({names}) -> "
                f"{type(optimizer).__name__}'s "
                f"({', '.join(sorted(_OPTIMIZER_KINDS[kind][1]))})"
            )
    if out:
        return out
    out = state_format_differences(saved, optimizer)
    if out:
        return out
    allowed = _OPTIMIZER_KINDS[kind][2] if kind is not None else None
    for index, entry in saved["state"].items():
        if allowed is not None and not set(entry) <= allowed:
            out.append(
                f"optimizer.state.{index}: {', '.join(sorted(entry))} -> "
                f"{type(optimizer).__name__}'s {', '.join(sorted(allowed))}"
            )
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shapes[index]:
                out.append(
                    f"optimizer.state.{index}.{name}: {list(value.shape)} -> "
                    f"{list(shapes[index])} (the parameter's shape)"
                )
    return out


def _engine_differences(saved: Mapping[str, Any], engine: Any) -> list[str]:
    current = engine.state_dict()
    wanted = [k for k in current if k.startswith("loss_scaler")]
    have = sorted(
        (k for k in saved if k.startswith("loss_scaler")),
        key=lambda k: int(k[len("loss_scaler") :]),
    )
    if have != wanted:
        return [
            f"engine: {len(have)} loss scaler(s) ({', '.join(have)}) -> {len(wanted)} "
            f"({', '.join(wanted)})"
        ]
    out = []
    rounding = "rounding_steps" in current
    if ("rounding_steps" in saved) != rounding:
        out.append(
            f"engine.rounding_steps: {'present' if 'rounding_steps' in saved else 'absent'}"
            f" -> {'present' if rounding else 'absent'} (stochastic rounding "
            f"{'on' if rounding else 'off'} in this run)"
        )
    scaler = engine.scaler
    scale = saved["loss_scaler0"]["loss_scale"]
    if not scaler.dynamic and scale != scaler.scale:
        out.append(
            f"engine.loss_scaler0.loss_scale: {scale!r} -> {scaler.scale!r} (this run's static "
            "scale)"
        )
    return out


def _layer_plan_differences(saved: Optional[Mapping[str, Any]], engine: Any) -> list[str]:
    """Each layer must be planned in the checkpoint's format (a plan file edited since, or an
    auto plan measured otherwise, would train the resumed run in other formats)."""
    plan = getattr(engine, "layer_plan", None)
    if saved is None or plan is None:
        return []
    current = plan.formats()
    out = []
    for layer in list(saved["layers"]) + [k for k in current if k not in saved["layers"]]:
        a, b = saved["layers"].get(layer, "(absent)"), current.get(layer, "(absent)")
        if a != b:
            out.append(f"layer_plan.{layer}: {a} -> {b}")
    return out


def _scheduler_differences(saved: Optional[Mapping[str, Any]], scheduler: Any) -> list[str]:
    """The kind, told by the public keys of its state (its constructor's settings, base_lrs,
    last_epoch); private bookkeeping keys vary with the torch version and are not compared."""
    if saved is None or scheduler is None:
        if (saved is None) != (scheduler is None):
            return [
                f"scheduler: {'(none)' if saved is None else 'a scheduler'} -> "
                f"{'(none)' if scheduler is None else type(scheduler).__name__}"
            ]
        return []
    current = scheduler.state_dict()
    public = lambda keys: {k for k in keys if not k.startswith("_") and k != "verbose"}  # noqa
    a, b = public(saved), public(current)
    if a != b:
        return [
            f"scheduler: the state of another scheduler ({', '.join(sorted(a))}) -> "
            f"{type(scheduler).__name__} ({', '.join(sorted(b))})"
        ]
    return [
        f"scheduler.{k}: {show(saved[k])} -> {show(current[k])}"
        for k in sorted(a)
        if _kind(saved[k]) != _kind(current[k])
    ]


def _kind(value: Any) -> Any:
    """A value's shape for comparing scheduler states: number, bool, str, None, or a list's length
    with its items' kinds."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    if is_real(value):
        return "number"
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_kind(v) for v in value))
    return type(value).__name__
