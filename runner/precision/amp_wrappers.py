"""What `amp.initialize` installs on the user's own objects, and `_teardown`, which takes it off:
`step`, `zero_grad` and `add_param_group` on each optimizer instance (a skipped step after an
overflow, the masters kept in step), and O1's `forward` on each model.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Optional

import torch
from torch import nn

from runner.precision.amp_state import _MISSING, _Init, disable_casts
from runner.precision.apex_engine import ApexEngine
from runner.precision.autocast import autocast_context
from runner.precision.recipe import Properties


# ---- optimizer wrappers (installed per instance) -------------------------------------------
def _init_of(opt: torch.optim.Optimizer) -> Optional[_Init]:
    init = opt.__dict__.get("_amp_init")
    return init if init is not None and init.alive else None


def _managed(opt: torch.optim.Optimizer) -> Optional[ApexEngine]:
    init = _init_of(opt)
    return None if init is None else init.engine


def _previous(opt: torch.optim.Optimizer, name: str):
    prev = opt.__dict__.get(f"_amp_prev_{name}", None)
    return prev if prev is not None else getattr(type(opt), name).__get__(opt, type(opt))


def _amp_step(opt, *args, **kwargs):
    opt._opt_called = True  # LR scheduler bookkeeping, also for a skipped step
    original = _previous(opt, "step")
    eng = _managed(opt)
    if eng is None or opt.__dict__.get("_amp_in_step"):
        return original(*args, **kwargs)
    closure = kwargs.get("closure", args[0] if args else None)
    if closure is not None:
        raise NotImplementedError(
            "amp does not support optimizer.step(closure) (neither did "
            "Apex): compute the loss, scale_loss/backward, then step()"
        )
    opt.__dict__["_amp_in_step"] = True
    try:
        with disable_casts():  # O1's casts never apply to the optimizer's own step (Apex's rule)
            eng.step(opt, step_fn=original)
    finally:
        opt.__dict__.pop("_amp_in_step", None)
    return None


def _amp_zero_grad(opt, set_to_none: bool = True):
    eng = _managed(opt)
    if eng is None:
        return _previous(opt, "zero_grad")(set_to_none=set_to_none)
    eng.zero_grad(opt, set_to_none=set_to_none)


def _amp_add_param_group(opt, param_group):
    out = _previous(opt, "add_param_group")(param_group)
    eng = _managed(opt)
    if eng is not None:
        eng.sync_param_groups(opt)
    return out


_WRAPPERS = {
    "step": _amp_step,
    "zero_grad": _amp_zero_grad,
    "add_param_group": _amp_add_param_group,
}


def _install_optimizer(opt: torch.optim.Optimizer) -> None:
    for name, impl in _WRAPPERS.items():
        current = opt.__dict__.get(name)
        if getattr(getattr(current, "__func__", None), "__amp_wrapper__", False):
            continue  # ours already on top (e.g. re-initialised while still installed)
        opt.__dict__[f"_amp_prev_{name}"] = current

        def method(self, *args, __impl=impl, **kwargs):
            return __impl(self, *args, **kwargs)

        functools.update_wrapper(
            method,
            getattr(type(opt), name),
            assigned=("__name__", "__qualname__", "__doc__"),
            updated=(),
        )
        method.__amp_wrapper__ = True  # type: ignore[attr-defined]
        if getattr(current, "_wrapped_by_lr_sched", False):
            # an LR scheduler made before initialize wrapped step: keep its marker visible
            method._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.__dict__[name] = types.MethodType(method, opt)


def _uninstall_optimizer(opt: torch.optim.Optimizer) -> None:
    for name in _WRAPPERS:
        current = opt.__dict__.get(name)
        if not getattr(getattr(current, "__func__", None), "__amp_wrapper__", False):
            continue  # something (an LR scheduler) wrapped ours: ours passes through from now
        prev = opt.__dict__.pop(f"_amp_prev_{name}", None)
        if prev is None:
            del opt.__dict__[name]
        else:
            opt.__dict__[name] = prev


# ---- O1 forward --------------------------------------------------------------------------
class _AutocastForward:
    """O1's `model.forward`: the model's own forward run in the O1 region.

    An object holding its model, not a closure over it: `copy.deepcopy(model)` copies it along
    with the model (memo), so the copy's forward runs the copy's weights, and `torch.save(model)`
    can pickle it. It keeps the engine's properties and device, not the engine, so a copy does not
    drag the engine (optimizers, masters) along."""

    def __init__(
        self, module: nn.Module, properties: Properties, device: torch.device, previous: Any = None
    ):
        self.module = module
        self.properties = properties
        self.device = device
        self.previous = previous  # the instance `forward` it replaced; None: the class's

    def _inner(self):
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args, **kwargs):
        with autocast_context(self.properties, self.device, patch_functions=True):
            return self._inner()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._inner())


def _wrap_forward(model: nn.Module, init: _Init) -> None:
    previous = model.__dict__.get("forward", _MISSING)
    eng = init.engine
    model.forward = _AutocastForward(
        model, eng.properties, eng.device, None if previous is _MISSING else previous
    )
    init.forward_wraps.append((model, previous))


def _teardown(init: _Init) -> None:
    """Take off everything `init` installed (forward wraps, optimizer wrappers, the engine's hooks
    and masters); the optimizers get the model's parameters back."""
    if not init.alive:
        return
    init.alive = False
    init.unwrap_forwards()
    for opt in init.optimizers:
        _uninstall_optimizer(opt)
        opt.__dict__.pop("_amp_init", None)
    init.engine.release()
