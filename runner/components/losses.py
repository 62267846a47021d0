"""The loss: the criterion `loss._target_` names (cross-entropy by default), and the check of what
a criterion of one's own returns (`check_criterion`, in planning)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner.config import targets
from runner.errors import ConfigError

log = logging.getLogger(__name__)

TARGET_KEY = "loss._target_"


class FunctionLoss(torch.nn.Module):
    """A loss function (`loss._target_=torch.nn.functional.cross_entropy`) as a criterion:
    `fn(outputs, targets, **kwargs)`, the node's other keys its keyword arguments."""

    def __init__(self, fn: Callable[..., torch.Tensor], kwargs: dict[str, Any]):
        super().__init__()
        self.fn, self.kwargs = fn, kwargs

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(outputs, targets, **self.kwargs)

    def extra_repr(self) -> str:
        return f"{getattr(self.fn, '__qualname__', self.fn)}, {self.kwargs}"


def loss_function(node: Any) -> Optional[Callable[..., torch.Tensor]]:
    """`loss._target_` where it names a loss function itself, not a criterion's class or a
    function that builds one: a function whose first two parameters are positional, required
    and not set by the node (F.cross_entropy's input and target). None otherwise."""
    target = targets.resolve(TARGET_KEY, node[targets.TARGET])
    if inspect.isclass(target):
        return None
    try:
        params = list(inspect.signature(target).parameters.values())[:2]
    except (TypeError, ValueError):
        return None
    given = targets.arguments(node)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) == 2 and all(
        p.kind in positional and p.default is p.empty and p.name not in given for p in params
    ):
        return target
    return None


def check_target(node: Any) -> None:
    """Planning's check of `loss._target_`: imported, its arguments bound (a loss function's
    after the outputs and targets it is called with)."""
    fn = None if OmegaConf.is_missing(node, targets.TARGET) else loss_function(node)
    if fn is None:
        targets.check("loss", node)  # (a missing one: says how to set it)
    else:
        _bind(fn, node)


def _bind(fn: Callable[..., torch.Tensor], node: Any) -> None:
    """A loss function's keyword arguments bound after the outputs and targets it is called with."""
    path = str(node[targets.TARGET])
    partial = functools.partial(fn, None, None)
    targets.check_arguments("loss", path, partial, targets.arguments(node))


def build_loss(cfg) -> torch.nn.Module:
    """The criterion `loss._target_` names (torch.nn.CrossEntropyLoss by default, and for a
    config without a loss group), called as criterion(logits, targets); a loss function
    (`loss_function`) is wrapped as one (`FunctionLoss`)."""
    if "loss" not in cfg:
        return torch.nn.CrossEntropyLoss()
    fn = loss_function(cfg.loss)
    if fn is not None:
        _bind(fn, cfg.loss)
        return FunctionLoss(fn, targets.arguments(cfg.loss))
    criterion = targets.call("loss", cfg.loss)
    if not isinstance(criterion, torch.nn.Module):
        raise ConfigError(
            TARGET_KEY,
            f"{cfg.loss._target_} returned a "
            f"{type(criterion).__name__}, not an nn.Module (a criterion)",
        )
    return criterion


def check_criterion(criterion: torch.nn.Module, path: str, task: Any, num_outputs: int) -> None:
    """Call `criterion` once, as the task calls it, on a small batch of random outputs (with a
    gradient) and class targets on the CPU, and refuse what training cannot take: a forward that
    takes other arguments than (outputs, targets), and a result that is not one floating value
    with a gradient to the outputs (a tuple, `reduction='none'`, an integer count, a detached
    value). Each was an unexpected error at the first step, after the run had started. A
    criterion that raises on these inputs is not judged (it may want targets of another kind:
    the first step tells)."""
    outputs, labels = _probe(task, num_outputs)
    forward = getattr(criterion, "forward", criterion)
    try:
        inspect.signature(forward).bind(outputs, labels)
    except TypeError as exc:
        raise ConfigError(
            TARGET_KEY,
            f"{path} takes {_arguments(forward)}, but the runner calls it as "
            f"criterion(outputs, targets) ({exc})",
            "a criterion whose forward takes (outputs, targets)",
        ) from None
    except ValueError:  # no signature to read
        pass
    try:
        with torch.enable_grad():
            loss = task.loss(criterion, outputs, labels)
    except Exception as exc:  # (its inputs may not be what it takes: not judged here)
        log.debug("%s not checked on class targets: %s: %s", path, type(exc).__name__, exc)
        return
    problem = _loss_problem(loss)
    if problem:
        raise ConfigError(
            TARGET_KEY,
            f"{path} returns {problem}",
            "a criterion returning the batch's loss: one floating value, with a gradient "
            "(e.g. reduction='mean')",
        )


def _probe(task: Any, num_outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random outputs and class targets of the task's shapes (its `target_dims`): (4, classes)
    and (4,), or a language model's (2, 2, vocabulary) and (2, 2)."""
    g = torch.Generator().manual_seed(0)  # (the run's own random state is left alone)
    batch = (2, 2) if task.target_dims == 2 else (4,)
    outputs = torch.randn(*batch, num_outputs, generator=g).requires_grad_()
    return outputs, torch.randint(0, num_outputs, batch, generator=g)


def _arguments(forward: Any) -> str:
    try:
        names = targets.parameter_names(inspect.signature(forward))
    except (TypeError, ValueError):
        return "other arguments"
    return f"({', '.join(names)})" if names else "no arguments"


def _loss_problem(loss: Any) -> str:
    """What is wrong with a criterion's result for a backward, or '' where nothing is."""
    if isinstance(loss, (tuple, list)):
        return f"a {type(loss).__name__} of {len(loss)} (the runner takes the loss alone)"
    if not isinstance(loss, torch.Tensor):
        return f"a {type(loss).__name__}, not a tensor"
    if loss.numel() != 1:
        return (
            f"a tensor of shape {tuple(loss.shape)}, not one value (a loss per item, as "
            "reduction='none' gives)"
        )
    if not loss.is_floating_point():
        name = str(loss.dtype).replace("torch.", "")
        article = "an" if name[0] in "aeiou" else "a"
        return f"{article} {name} tensor (a count, not a loss to descend)"
    if not loss.requires_grad:
        return (
            "a value without a gradient to the model's outputs (detached, or computed from "
            "argmax or .item())"
        )
    return ""
