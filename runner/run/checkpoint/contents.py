"""What a checkpoint holds: the schema of its contents (every key, the type of its value, the
trainer's keys and the run's), checked on writing and on loading (`content_problems`).
Whether it fits the run that resumes it: fit.py."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from runner.precision.scaler import state_dict_problems
from runner.run.rng import numpy_legacy

# what a refused checkpoint should be (every refusal's `allowed`)
ALLOWED = "an intact checkpoint written by amp-runner"


# Exact types, not subclasses: a NumPy float is a float subclass that torch.save pickles as
# NumPy's, which the safe unpickler refuses (and bool is an int subclass).
def _is_int(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


def is_real(value: Any) -> bool:
    return type(value) in (int, float)


def _is_tensor_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.layout == torch.strided
        for k, v in value.items()
    )


def _is_plain(value: Any, scalars: bool = False) -> bool:
    """Config-like data: dicts with str keys, lists, str, numbers, bools, None; with `scalars`,
    0-d tensors too (a learning rate kept as a tensor, as torchao's optimizers keep it, and the
    scheduler's copies of it)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if scalars and type(value) is torch.Tensor:
        return value.dim() == 0 and value.layout == torch.strided
    if type(value) in (list, tuple):
        return all(_is_plain(v, scalars) for v in value)
    if isinstance(value, dict):
        return all(type(k) is str and _is_plain(v, scalars) for k, v in value.items())
    return False


def _optimizer_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping) or set(value) != {"state", "param_groups"}:
        return ["optimizer: a torch optimizer state dict (state, param_groups) belongs here"]
    groups, state = value["param_groups"], value["state"]
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping)
        and all(isinstance(k, str) for k in g)
        and isinstance(g.get("params"), list)
        and all(_is_int(i) for i in g["params"])
        and all(_is_plain(v, scalars=True) for k, v in g.items() if k != "params")
        for g in groups
    ):
        return [
            "optimizer.param_groups: a list of groups of plain hyperparameters and integer "
            "parameter ids belongs here"
        ]
    if not isinstance(state, Mapping):
        return ["optimizer.state: a mapping of parameter ids to their state belongs here"]
    ids = {i for g in groups for i in g["params"]}
    for index, entry in state.items():
        if index not in ids:
            return [f"optimizer.state.{index}: a state for no parameter of param_groups"]
        if not isinstance(entry, Mapping) or not all(
            isinstance(k, str)
            and (is_real(v) or isinstance(v, torch.Tensor) and v.layout == torch.strided)
            for k, v in entry.items()
        ):
            return [
                f"optimizer.state.{index}: a mapping of names to tensors or numbers belongs here"
            ]
    return []


def _engine_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return ["engine: a mapping of loss_scaler<i> entries and skipped_steps belongs here"]
    problems = []
    for key, entry in value.items():
        if key in ("skipped_steps", "rounding_steps"):  # (rounding: stochastic rounding's count)
            if not _is_int(entry):
                problems.append(f"engine.{key}: {entry!r} is not an integer >= 0")
        elif isinstance(key, str) and re.fullmatch(r"loss_scaler(0|[1-9][0-9]*)", key):
            problems += state_dict_problems(entry, f"engine.{key}")
        else:
            problems.append(
                f"engine.{key}: unknown key (allowed: loss_scaler<i>, skipped_steps, "
                "rounding_steps)"
            )
    if "loss_scaler0" not in value:
        problems.append("engine.loss_scaler0: missing")
    return problems


def _rng_problems(value: Any) -> list[str]:
    """Each RNG state must be accepted by a fresh generator of its kind (nothing global is set
    here)."""
    if not isinstance(value, Mapping):
        return ["rng: a mapping of RNG states (torch, python, cuda, numpy) belongs here"]
    problems = [
        f"rng.{k}: unknown key (allowed: torch, python, cuda, numpy)"
        for k in value
        if k not in ("torch", "python", "cuda", "numpy")
    ]
    for key in ("torch", "python"):
        if key not in value:
            problems.append(f"rng.{key}: missing")
    checks: dict[str, Callable[[Any], None]] = {
        "torch": lambda s: torch.Generator().set_state(_byte_tensor(s)),
        "python": lambda s: random.Random().setstate(s),
        "cuda": lambda s: [_byte_tensor(t) for t in _as_list(s)],
        "numpy": _check_numpy_state,
    }
    for key, check in checks.items():
        if key in value:
            try:
                check(value[key])
            except (TypeError, ValueError, OverflowError, RuntimeError, IndexError) as error:
                problems.append(f"rng.{key}: not a valid state ({error})")
    return problems


def _byte_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError("a 1-D uint8 tensor belongs here")
    return value


def _as_list(value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError("a list belongs here")
    return value


def content_problems(state: Mapping[str, Any]) -> list[str]:
    """What is wrong with a checkpoint's contents without looking at the run: unknown keys,
    missing trainer keys, values of the wrong type. Each problem names its key."""
    problems = [f"{key}: unknown key" for key in state if key not in _SCHEMA]
    for key, (check, wanted, required) in _SCHEMA.items():
        if key not in state:
            if required:
                problems.append(f"{key}: missing ({wanted})")
            continue
        value = state[key]
        if key == "optimizer":
            problems += _optimizer_problems(value)
        elif key == "engine":
            problems += _engine_problems(value)
        elif key == "rng":
            problems += _rng_problems(value)
        elif not check(value):
            problems.append(f"{key}: {show(value)} where {wanted} belongs")
    return problems


def show(value: Any) -> str:
    text = repr(value) if _is_plain(value) else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_sharded(value: Any) -> bool:
    if not isinstance(value, dict) or set(value) != {"files", "world_size"}:
        return False
    files = value["files"]
    return (
        _is_int(value["world_size"], 1)
        and isinstance(files, dict)
        and bool(files)
        and all(
            type(k) is str
            and "/" not in k
            and k not in ("", ".", "..")
            and type(v) is str
            and re.fullmatch(r"[0-9a-f]{64}", v)
            for k, v in files.items()
        )
    )


def _is_layer_plan(value: Any) -> bool:
    if not isinstance(value, dict) or set(value) != {"layers", "rules"}:
        return False
    layers, rules = value["layers"], value["rules"]
    return (
        isinstance(layers, dict)
        and all(type(k) is str and type(v) is str for k, v in layers.items())
        and isinstance(rules, list)
        and all(type(r) is list and len(r) == 4 and all(type(x) is str for x in r) for r in rules)
    )


def _is_history(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, Mapping) and all(isinstance(k, str) and is_real(v) for k, v in m.items())
        for m in value
    )


# key: (check, what belongs there, required by `load`); optimizer, engine and rng have their own
# problem finders. The run's keys (mlflow_run_id, config, world_size) are written by the app and
# required by `check_resumable`; a trainer's state alone (Trainer.state) also loads.
_SCHEMA: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "format": (_is_int, "an integer", True),
    "model": (_is_tensor_map, "a mapping of names to tensors", True),
    "optimizer": (lambda v: True, "an optimizer state dict", True),
    "engine": (lambda v: True, "the loss scalers' state", True),
    "scheduler": (
        lambda v: v is None or isinstance(v, dict) and _is_plain(v, scalars=True),
        "a scheduler state dict of plain values, or None",
        True,
    ),
    "epoch": (_is_int, "an integer >= 0", True),
    "batch": (_is_int, "an integer >= 0", True),
    "global_step": (_is_int, "an integer >= 0", True),
    "best_val_acc": (is_real, "a number", True),
    "best_val_loss": (is_real, "a number", False),  # a language model's (not in older ones)
    "history": (_is_history, "a list of {metric name: number}", True),
    "elapsed_s": (is_real, "a number", True),
    "skip_streak": (_is_int, "an integer >= 0", True),
    "bad_loss_streak": (_is_int, "an integer >= 0", True),
    "rng": (lambda v: True, "the RNG states", True),
    "mlflow_run_id": (lambda v: isinstance(v, str) and bool(v), "an MLflow run id", False),
    "config": (
        lambda v: isinstance(v, dict) and _is_plain(v),
        "the resolved config (a mapping of plain values)",
        False,
    ),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1", False),
    # a sharded run's checkpoint (runner.run.checkpoint.sharded): its files' SHA-256, the world
    "sharded": (lambda v: _is_sharded(v), "{files: {name: sha256 hex}, world_size: int}", False),
    # the layer plan (runner.precision.layers): not in checkpoints written before it
    "layer_plan": (
        lambda v: _is_layer_plan(v),
        "{layers: {layer: format}, rules: [[glob, format, source, why], ...]}",
        False,
    ),
}
RUN_KEYS = ("mlflow_run_id", "config", "world_size")


def _check_numpy_state(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != {
        "kind",
        "key",
        "pos",
        "has_gauss",
        "cached_gaussian",
    }:
        raise TypeError("a mapping of kind, key, pos, has_gauss, cached_gaussian belongs here")
    if not (
        isinstance(value["kind"], str)
        and _is_int(value["pos"])
        and _is_int(value["has_gauss"])
        and is_real(value["cached_gaussian"])
    ):
        raise TypeError("kind a str, pos and has_gauss integers, cached_gaussian a number")
    key = value["key"]
    if (
        isinstance(key, torch.Tensor)
        and not key.is_floating_point()
        and key.numel()
        and (int(key.min()) < 0 or int(key.max()) >= 2**32)
    ):
        raise ValueError("key: values outside 0 .. 2**32 - 1")
    try:
        import numpy
    except ImportError:
        return
    numpy.random.RandomState().set_state(numpy_legacy(value))
