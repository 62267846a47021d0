"""Apex-compatible `amp` front end over `AmpEngine`: port an Apex script by changing one import.

    from runner.precision import amp          # was: from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

How Apex's behaviour is reproduced on modern PyTorch (CPU and CUDA):

* O1: Apex patched torch functions globally. Here each model's `forward` is wrapped in the
  facade's O1 region (autocast plus the registered function casts and the binary_cross_entropy
  ban, which only the facade installs: the runner's O1 is plain autocast), so no context
  manager is needed in user code. Floating model outputs come back as fp32 (unless
  `cast_model_outputs` says otherwise), so a loss computed outside `forward` runs in fp32. The
  wrapper is an object that holds its model, not a closure: `copy.deepcopy(model)` (an EMA copy)
  runs on the copy's own weights, and `torch.save(model)` pickles it. Apex's decorators
  (`half_function`, `float_function`, `promote_function`) and `disable_casts()` act on that same
  region (`autocast.py`).
* O2/O3: the model is cast (fp32 BatchNorm under O2), inputs are cast to the model type and
  outputs to fp32 (or `cast_model_outputs`). O2's optimizer steps fp32 masters;
  `model.state_dict()` returns fp32 tensors (the masters' values) and `model.load_state_dict`
  re-seeds the masters.
* Apex patched `optimizer.step` to skip a step whose gradients overflowed. Here `initialize`
  installs a thin `step` on each optimizer *instance*: `scale_loss`'s exit unscales (into the
  masters under O2), checks and updates the loss scaler; the next `optimizer.step()` then steps
  (and copies masters -> model) or, after an overflow, does nothing for that one call. The wrapper
  is a bound method, so an LR scheduler made before or after `initialize` wraps it as usual and
  sees the call (no "lr_scheduler.step() before optimizer.step()" warning on a skipped step).
  `optimizer.zero_grad()` clears the model's grads too, and `optimizer.add_param_group` gives new
  16-bit parameters masters.
* Several losses (`num_losses`, `loss_id`) each have their own scaler; gradients of different
  losses are unscaled separately and summed in fp32 (only the overflowing loss's scale backs off;
  the step is skipped when any of them overflowed). `delay_unscale=True` leaves gradients scaled
  for accumulation; the next `scale_loss` without it unscales them all.
  `_amp_state.loss_scalers[i].loss_scale()` reads loss i's current scale, as Apex scripts did.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from collections import OrderedDict
from typing import Any, ContextManager, Iterator, Optional

import torch
from torch import nn

from runner.precision.autocast import (
    autocast_context,
    casts_disabled,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from runner.precision.engine import AmpEngine
from runner.config.levels import SCALER_DEFAULTS
from runner.precision.properties import LEVEL_DESCRIPTIONS, Properties
from runner.precision.resolver import resolve
from runner.precision.scaler import LossScaler, state_dict_problems

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "register_half_function", "register_float_function", "register_promote_function",
    "half_function", "float_function", "promote_function", "disable_casts",
    "engine", "deinitialize",
]


class _ApexLossScaler:
    """What Apex scripts read from `amp._amp_state.loss_scalers[i]`: `loss_scale()`, the current
    scale of the engine's scaler for loss i (a live view: it follows back-offs and growth)."""

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        return self._scaler.scale

    def __repr__(self) -> str:
        return f"<amp loss scaler: {self._scaler!r}>"


class _AmpState:
    def __init__(self) -> None:
        self.engine: Optional[AmpEngine] = None
        self.enabled = False
        self.verbosity = 1
        self.forward_wraps: list[tuple[nn.Module, Any]] = []  # (model, previous instance forward)
        self.optimizers: list[torch.optim.Optimizer] = []

    @property
    def loss_scalers(self) -> list[_ApexLossScaler]:
        """Apex's `_amp_state.loss_scalers`, one per loss (empty before `initialize`)."""
        if self.engine is None:
            return []
        return [_ApexLossScaler(s) for s in self.engine.scalers]


_amp_state = _AmpState()
_MISSING = object()


def engine() -> Optional[AmpEngine]:
    """The engine behind the current `initialize` (None before it, or when disabled)."""
    return _amp_state.engine


def _as_list(obj: Any) -> tuple[list, bool]:
    if isinstance(obj, (list, tuple)):
        return list(obj), True
    return [obj], False


def _device_of(models: list[nn.Module]) -> torch.device:
    for m in models:
        for t in (*m.parameters(), *m.buffers()):
            return t.device
    return torch.device("cpu")


# ---- optimizer wrappers (installed per instance) -------------------------------------------
def _managed(opt: torch.optim.Optimizer) -> Optional[AmpEngine]:
    eng = _amp_state.engine
    if eng is None or not any(o is opt for o in eng.optimizers):
        return None
    return eng


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
        raise NotImplementedError("amp does not support optimizer.step(closure) (neither did "
                                  "Apex): compute the loss, scale_loss/backward, then step()")
    opt.__dict__["_amp_in_step"] = True
    try:
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


_WRAPPERS = {"step": _amp_step, "zero_grad": _amp_zero_grad,
             "add_param_group": _amp_add_param_group}


def _install_optimizer(opt: torch.optim.Optimizer) -> None:
    for name, impl in _WRAPPERS.items():
        current = opt.__dict__.get(name)
        if getattr(getattr(current, "__func__", None), "__amp_wrapper__", False):
            continue  # ours already on top (e.g. re-initialised while still installed)
        opt.__dict__[f"_amp_prev_{name}"] = current

        def method(self, *args, __impl=impl, **kwargs):
            return __impl(self, *args, **kwargs)

        functools.update_wrapper(method, getattr(type(opt), name),
                                 assigned=("__name__", "__qualname__", "__doc__"), updated=())
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

    def __init__(self, module: nn.Module, properties: Properties, device: torch.device,
                 previous: Any = None):
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


def _wrap_forward(model: nn.Module, eng: AmpEngine) -> None:
    previous = model.__dict__.get("forward", _MISSING)
    model.forward = _AutocastForward(model, eng.properties, eng.device,
                                     None if previous is _MISSING else previous)
    _amp_state.forward_wraps.append((model, previous))


def _unwrap_forwards() -> None:
    for model, previous in reversed(_amp_state.forward_wraps):
        if previous is _MISSING:
            model.__dict__.pop("forward", None)
        else:
            model.forward = previous
    _amp_state.forward_wraps = []


def deinitialize() -> None:
    """Undo the previous `initialize`: forward wraps, model hooks and optimizer wrappers removed,
    optimizers get the model's parameters back (master values, rounded). Models keep their dtype."""
    _unwrap_forwards()
    for opt in _amp_state.optimizers:
        _uninstall_optimizer(opt)
    if _amp_state.engine is not None:
        _amp_state.engine.release()
    _amp_state.engine = None
    _amp_state.optimizers = []
    _amp_state.enabled = False


# ---- public API --------------------------------------------------------------------------
def _adam_description(optimizers: list) -> Optional[dict]:
    """The optimizer as the precision rules read it (`name`, `eps`): the Adam/AdamW group with
    the smallest eps among `optimizers`, so an eps that underflows in 16-bit state is refused
    here as in the runner; None when there is no Adam."""
    found: Optional[dict] = None
    for o in optimizers:
        if not isinstance(o, torch.optim.Adam) and not isinstance(o, torch.optim.AdamW):
            continue
        name = "adamw" if isinstance(o, torch.optim.AdamW) else "adam"
        for group in o.param_groups:
            eps = group.get("eps")
            if eps is not None and (found is None or float(eps) < found["eps"]):
                found = {"name": name, "eps": float(eps)}
    return found


def initialize(models, optimizers=None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale=None, cast_model_outputs=None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale=None,
               max_loss_scale: float = SCALER_DEFAULTS["max_loss_scale"], fp8_linear=None, stochastic_rounding=None):
    """Apex's `amp.initialize`: returns `models` (and `optimizers`, when given) in the shape they
    came in. Property arguments left None take the level's default. Calling it again
    re-initialises (the previous call's wrappers and hooks are removed first). Beyond Apex:
    `fp8_linear="tensorwise"|"rowwise"` runs the Linear layers' GEMMs in fp8 (torchao; O1 with
    bf16 autocast or O2 with a bf16 model), `stochastic_rounding=True` rounds a bf16 model's
    weights stochastically at each update (O3 with cast_model_type=torch.bfloat16)."""
    deinitialize()
    _amp_state.verbosity = verbosity
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    model_list, models_listed = _as_list(models)
    opt_list, opts_listed = ([], False) if optimizers is None else _as_list(optimizers)
    for m in model_list:
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize expects torch.nn.Module models, got {type(m)!r}")
    for o in opt_list:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"amp.initialize expects torch.optim.Optimizer, got {type(o)!r}")

    overrides = {k: v for k, v in dict(
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, fp8_linear=fp8_linear,
        stochastic_rounding=stochastic_rounding).items() if v is not None}
    device = _device_of(model_list)
    resolution = resolve(opt_level, overrides, device, optimizer=_adam_description(opt_list))
    if resolution.errors:
        raise ValueError("amp.initialize: inconsistent precision properties\n"
                         + resolution.findings_table())
    props = resolution.properties
    output_dtype = cast_model_outputs
    if output_dtype is None and props.patch_torch_functions:
        output_dtype = torch.float32  # O1: the loss outside forward runs in fp32 (see module doc)

    eng = AmpEngine(props, device, num_losses=num_losses, min_loss_scale=min_loss_scale,
                    max_loss_scale=max_loss_scale, cast_model_outputs=output_dtype,
                    patch_functions=True)
    for m in model_list:
        eng.cast(m)
        if props.patch_torch_functions:
            _wrap_forward(m, eng)
    for o in opt_list:
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        owners = [m for m in model_list if any(id(p) in ids for p in m.parameters())]
        eng.add_optimizer(o, owners)
        _install_optimizer(o)
    _amp_state.engine = eng
    _amp_state.optimizers = opt_list
    _amp_state.enabled = True

    if verbosity >= 1:
        print(f"Selected optimization level {props.opt_level}: "
              f"{LEVEL_DESCRIPTIONS.get(props.opt_level, '')}")
        print(props.table())
        for f in resolution.findings:
            print(f)

    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers, loss_id: int = 0, model=None,
               delay_unscale: bool = False, delay_overflow_check: bool = False
               ) -> Iterator[torch.Tensor]:
    """Yield `loss.float() * scale` for `.backward()`; on exit (unless `delay_unscale`) unscale
    the optimizers' gradients, check them, update loss `loss_id`'s scaler and make the next
    `optimizer.step()` a no-op if they overflowed. `model` and `delay_overflow_check` are
    accepted for Apex compatibility and ignored."""
    eng = _amp_state.engine
    if eng is None:
        yield loss
        return
    opts, _ = _as_list(optimizers)
    scaled = eng.scale_loss(loss, loss_id, opts)
    yield scaled
    if delay_unscale:
        return
    skip = False
    for opt in opts:
        skip = eng.settle(opt) or skip
    if skip and _amp_state.verbosity >= 1:
        print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
              f"{eng.scalers[loss_id].scale:g}")


def disable_casts() -> ContextManager[None]:
    """Apex's `amp.disable_casts()`: inside it O1 casts nothing, so ops run in their inputs' own
    types (autocast off for the engine's device; registered and decorated functions uncast; a
    model called inside runs its forward uncast). For this thread only, like torch.autocast."""
    eng = _amp_state.engine
    return casts_disabled(None if eng is None else eng.device.type)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters `optimizer` steps: the fp32 masters under O2, else the model's own."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: Optional[dict] = None) -> dict:
    """Apex layout: `{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}`."""
    out = OrderedDict() if destination is None else destination
    eng = _amp_state.engine
    if eng is not None:  # the engine's own layout, without its runner-only skipped_steps
        out.update((k, v) for k, v in eng.state_dict().items() if k.startswith("loss_scaler"))
    return out


def load_state_dict(sd: dict) -> None:
    """Apex's `amp.load_state_dict`: loss `i`'s scaler takes `sd["loss_scaler<i>"]`. The whole
    dict is checked before any scaler changes: a key other than `loss_scaler<i>` (or the engine's
    own `skipped_steps`, accepted and ignored) is a RuntimeError, as in Apex; entries numbered
    with a gap, or one that is malformed (`loss_scale` missing, not a finite number > 0,
    `unskipped` missing or not an integer >= 0, an unknown key), a ValueError naming the key; a
    `sd` that is not a dict a TypeError. More or fewer entries than `num_losses` only warn, as
    in Apex: the ones present load in order."""
    eng = _amp_state.engine
    if eng is None:
        raise RuntimeError("amp.load_state_dict before amp.initialize (or with enabled=False)")
    if not isinstance(sd, dict):
        raise TypeError(f"amp.load_state_dict expects the dict amp.state_dict() returns, got "
                        f"{type(sd).__name__}")
    indices = {key: _scaler_number(key) for key in sd}
    unexpected = [key for key, index in indices.items()
                  if index is None and key != "skipped_steps"]
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{key}"' for key in unexpected)
                           + " (amp's state dict holds loss_scaler0, loss_scaler1, ...)")
    count = sum(index is not None for index in indices.values())
    gap = next((i for i in range(count) if f"loss_scaler{i}" not in sd), None)
    if gap is not None:
        raise ValueError(f"amp.load_state_dict: loss_scaler{gap} is missing (the entries are "
                         f"loss_scaler0 .. loss_scaler{count - 1}, one per loss, in order)")
    problems = [p for i in range(count)
                for p in state_dict_problems(sd[f"loss_scaler{i}"], f"loss_scaler{i}")]
    skipped = sd.get("skipped_steps", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or skipped < 0:
        problems.append(f"skipped_steps: {skipped!r} is not an integer >= 0")
    if problems:
        raise ValueError("amp.load_state_dict: malformed state dict: " + "; ".join(problems))
    if count != len(eng.scalers):
        warnings.warn(f"amp state_dict has {count} loss scalers, while {len(eng.scalers)} "
                      "are used", stacklevel=2)
    for i, s in enumerate(eng.scalers[:count]):
        s.load_state_dict(sd[f"loss_scaler{i}"])


def _scaler_number(key: Any) -> Optional[int]:
    """`i` for the key `loss_scaler<i>` (decimal digits, no leading zero), else None."""
    if not isinstance(key, str) or not key.startswith("loss_scaler"):
        return None
    digits = key[len("loss_scaler"):]
    if not (digits.isascii() and digits.isdecimal()) or digits != str(int(digits)):
        return None
    return int(digits)
