"""A `_target_` of the user's: import it and check its arguments before any work starts.

`model._target_`, `data._target_` and `loss._target_` name a callable by its dotted path (Hydra's
convention); its other keys are its arguments. `check` imports it (the user's own code is the only
code a config can run) and binds the arguments to its signature, so that a missing module or
attribute, an argument it does not take or one it needs but lacks is a `ConfigError` naming the key
before any data, model or MLflow run exists. `call` then calls it through Hydra's `instantiate`
(nested `_target_` arguments work as in any Hydra app).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import pkgutil
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from runner.config.mistakes import did_you_mean
from runner.errors import ConfigError

TARGET = "_target_"
# the option key that names the argument the number of classes goes to (default: num_classes)
NUM_CLASSES_ARG = "_num_classes_"
HOW = (
    "a dotted path to a callable, importable from the launch directory or installed "
    "(e.g. my_pkg.nets.MyNet)"
)


def _launch_dir_importable() -> None:
    """`python -m runner` imports from the launch directory; the `amp-runner` script too."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _why_not(path: str) -> str:
    """Which module or attribute of `path` is missing (or what importing it raised)."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:end])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # this prefix is not a module: try a shorter one
            return f"importing module {module!r} failed: {exc}"
        except Exception as exc:  # the user's module raised while importing
            return f"importing module {module!r} raised {type(exc).__name__}: {exc}"
        for depth, attr in enumerate(parts[end:]):
            if not hasattr(found, attr):
                owner = ".".join(parts[: end + depth])
                near = did_you_mean(attr, _names(found), prefix=f"{owner}.")
                return (
                    f"module {owner!r} has no attribute {attr!r}{near}"
                    if depth == 0
                    else f"{owner!r} has no attribute {attr!r}{near}"
                )
            found = getattr(found, attr)
        return f"{path!r} cannot be imported"
    return f"no module named {parts[0]!r} (is its package installed, or in the launch directory?)"


def _names(found: Any) -> list[str]:
    """What a dotted path may go on with after `found`: its public attributes and, for a
    package, its modules not yet imported."""
    names = [name for name in dir(found) if not name.startswith("_")]
    if inspect.ismodule(found) and hasattr(found, "__path__"):
        names += [m.name for m in pkgutil.iter_modules(found.__path__) if m.name not in names]
    return names


def resolve(key: str, path: Any) -> Any:
    """The object `path` names; ConfigError naming `key` with what is missing."""
    if not isinstance(path, str) or "." not in path.strip(". "):
        raise ConfigError(key, f"got {path!r}", HOW)
    from hydra.utils import get_object

    _launch_dir_importable()
    hydra_log = logging.getLogger("hydra.utils")  # it logs the failure: ours says it better
    level = hydra_log.level
    hydra_log.setLevel(logging.CRITICAL)
    try:
        target = get_object(path)
    except Exception:  # Hydra wraps the cause; say precisely which part is missing
        raise ConfigError(key, f"cannot import {path!r}: {_why_not(path)}", HOW) from None
    finally:
        hydra_log.setLevel(level)
    if not callable(target):
        raise ConfigError(key, f"{path!r} is a {type(target).__name__}, not a callable", HOW)
    return target


def arguments(node: Any, runner_keys: Iterable[str] = ()) -> dict[str, Any]:
    """The keys of `node` that are the callable's arguments (not `_target_`, not the runner's)."""
    values = (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    )
    skip = {TARGET, NUM_CLASSES_ARG, *runner_keys}
    return {k: v for k, v in values.items() if k not in skip}


def refuse_given(group: str, kwargs: Mapping[str, Any], keys: Iterable[str], why: str) -> None:
    """A ConfigError for the first of `keys` that `kwargs` gives a value (not None, False or ""):
    `group.key`, what it got and `why` no value is allowed."""
    for key in keys:
        value = kwargs.get(key)
        if value not in (None, False, ""):
            raise ConfigError(f"{group}.{key}", f"got {value!r}: {why}", "null (or leave it out)")


def accepts(target: Any, name: str) -> bool:
    """Whether `target` takes a keyword argument `name` (or any, via **kwargs)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): assume it does
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def parameter_names(signature: inspect.Signature) -> list[str]:
    """The names a callable's arguments go by (not its *args and **kwargs)."""
    return [
        n
        for n, p in signature.parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def check_arguments(group: str, path: str, target: Any, kwargs: Mapping[str, Any]) -> None:
    """Bind `kwargs` to `target`'s signature; ConfigError naming the argument it rejects."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # nothing to check against: calling it will tell
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        names = parameter_names(signature)
        unknown = [k for k in kwargs if k not in signature.parameters]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            raise ConfigError(
                f"{group}.{unknown[0]}",
                f"{path} takes no argument {unknown[0]!r}{did_you_mean(unknown[0], names)}",
                names,
            ) from None
        missing = [
            n
            for n, p in signature.parameters.items()
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and n not in kwargs
        ]
        if missing:
            raise ConfigError(
                f"{group}.{missing[0]}",
                f"{path} needs the argument {missing[0]!r}, which is not set",
                f"add it with +{group}.{missing[0]}=... or in the option file",
            ) from None
        raise ConfigError(
            f"{group}.{TARGET}", f"{path} rejects its arguments: {exc}", names
        ) from None


def num_classes_arg(group: str, node: Any, target: Any) -> Optional[str]:
    """The argument the number of classes goes to: the one `_num_classes_` names (which the
    callable must take), else `num_classes` when the callable takes it and the node does not set
    it itself (a value of the user's is passed as it is); None: not passed."""
    named = node.get(NUM_CLASSES_ARG) if hasattr(node, "get") else None
    if named is not None:
        if not accepts(target, str(named)):
            raise ConfigError(
                f"{group}.{NUM_CLASSES_ARG}", f"{node[TARGET]} takes no argument {named!r}"
            )
        return str(named)
    if "num_classes" not in node and accepts(target, "num_classes"):
        return "num_classes"
    return None


def check(
    group: str,
    node: Any,
    runner_keys: Iterable[str] = (),
    extra: Optional[Mapping[str, Any]] = None,
) -> Any:
    """Import `node._target_` and bind its arguments (plus `extra`, e.g. the number of
    classes); returns the callable. Raises ConfigError naming the key."""
    if OmegaConf.is_missing(node, TARGET):
        raise ConfigError(f"{group}.{TARGET}", "is required but not set", HOW)
    path = node[TARGET]
    target = resolve(f"{group}.{TARGET}", path)
    check_arguments(group, path, target, {**arguments(node, runner_keys), **(extra or {})})
    return target


def call(
    group: str,
    node: Any,
    runner_keys: Iterable[str] = (),
    extra: Optional[Mapping[str, Any]] = None,
) -> Any:
    """`check`, then call the target through Hydra's instantiate with `extra` added."""
    from hydra.utils import instantiate

    check(group, node, runner_keys, extra)
    config = {TARGET: node[TARGET], **arguments(node, runner_keys)}
    return instantiate(config, **(extra or {}), _convert_="all")


_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def rejected_argument(exc: BaseException) -> Optional[str]:
    """The argument a TypeError says a callable did not take (deep inside a builder's
    **kwargs, where binding the signature could not see it), else None."""
    match = _UNEXPECTED.search(str(exc))
    return match.group(1) if match else None
