"""Apex-compatible `amp` front end over `AmpEngine`: port an Apex script by changing one import.

    from runner.precision import amp          # was: from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

How Apex's behaviour is reproduced on modern PyTorch (CPU and CUDA):

* O1: Apex replaced torch functions process-wide by casting wrappers (its function lists). Here
  `amp.init()` does exactly that until its handle's `_deactivate()`, and `amp.initialize` wraps
  each model's `forward` in the same O1 region (Apex's lists, the registered function casts,
  the binary_cross_entropy ban: `autocast.py`, `apex_o1.py`), so no context manager is needed in
  user code. The lists apply on every device, so a CPU computes in the dtypes Apex gave on a GPU.
  Floating model outputs come back as fp32 (unless `cast_model_outputs` says otherwise), so a
  loss computed outside `forward` runs in fp32. The wrapper is an object that holds its model,
  not a closure: `copy.deepcopy(model)` (an EMA copy) runs on the copy's own weights, and
  `torch.save(model)` pickles it. Apex's decorators (`half_function`, `float_function`,
  `promote_function`) and `disable_casts()` act on that same region.
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
* One `scale_loss` over several optimizers is one overflow decision: all of them skip when its
  loss overflowed in any (Apex's rule). Several `initialize` calls on different objects coexist;
  `_amp_state` (`handle`, `opt_properties`, writable `loss_scalers`) follows Apex's.
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
import math
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch
from torch import nn

from runner.config.levels import SCALER_DEFAULTS
from runner.precision import apex_o1
from runner.precision.autocast import (
    autocast_context,
    casts_disabled,
    float_function,
    function_patches,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from runner.precision.engine import AmpEngine
from runner.precision.properties import LEVEL_DESCRIPTIONS, Properties
from runner.precision.resolver import resolve
from runner.precision.scaler import LossScaler, state_dict_problems

__all__ = [
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "disable_casts",
    "engine",
    "deinitialize",
    "init",
    "AmpHandle",
    "NoOpHandle",
]


class _ApexLossScaler:
    """What Apex scripts read and write in `amp._amp_state.loss_scalers[i]`: `loss_scale()`, the
    current scale of the engine's scaler for loss i (a live view: it follows back-offs and
    growth), `_loss_scale` (writable: a script's `loss_scalers[0]._loss_scale = 4.0` sets the
    engine's scale), `_unskipped`, `dynamic`."""

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        return self._scaler.scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler.scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"a loss scale must be a finite number > 0, got {value!r}")
        self._scaler._scale = value

    @property
    def _unskipped(self) -> int:
        return self._scaler._unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._scaler._unskipped = int(value)

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    def __repr__(self) -> str:
        return f"<amp loss scaler: {self._scaler!r}>"


class _OptProperties:
    """Apex's `_amp_state.opt_properties`: the properties of the latest `initialize`, in Apex's
    spelling (`loss_scale` is "dynamic" or a float; `cast_model_type` a dtype, None, or False
    when the call said False)."""

    def __init__(
        self, enabled: bool, props: Optional[Properties] = None, cast_model_type: Any = None
    ) -> None:
        self.enabled = enabled
        self.opt_level = props.opt_level if props is not None else None
        self.cast_model_type = (
            False
            if cast_model_type is False
            else props.cast_model_type
            if props is not None
            else None
        )
        self.patch_torch_functions = bool(props and props.patch_torch_functions)
        self.keep_batchnorm_fp32 = props.keep_batchnorm_fp32 if props is not None else None
        self.master_weights = props.master_weights if props is not None else None
        self.loss_scale = props.loss_scale if props is not None else 1.0

    def __repr__(self) -> str:
        return (
            "<amp opt_properties: " + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()) + ">"
        )


class _Init:
    """What one `initialize` call set up: its engine, models, optimizers, O1 forward wraps and
    handle. Calls on different models and optimizers coexist (as in Apex); a call given a model
    or optimizer of an earlier call replaces that earlier call."""

    def __init__(
        self, engine: AmpEngine, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]
    ) -> None:
        self.engine = engine
        self.models = models
        self.optimizers = optimizers
        self.forward_wraps: list[tuple[nn.Module, Any]] = []  # (model, previous instance forward)
        self.scalers = [_ApexLossScaler(s) for s in engine.scalers]
        self.alive = True

    def owns(self, obj: Any) -> bool:
        return any(obj is m for m in self.models) or any(obj is o for o in self.optimizers)

    def unwrap_forwards(self) -> None:
        for model, previous in reversed(self.forward_wraps):
            if previous is _MISSING:
                model.__dict__.pop("forward", None)
            else:
                model.forward = previous
        self.forward_wraps = []

    def teardown(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.unwrap_forwards()
        for opt in self.optimizers:
            _uninstall_optimizer(opt)
            opt.__dict__.pop("_amp_init", None)
        self.engine.release()


class AmpHandle:
    """Apex's handle: `amp.init()` returns one (its O1 casts stay on until `_deactivate()`), and
    `amp.initialize(opt_level="O1")` sets one as `_amp_state.handle` (its `_deactivate()` ends
    that call's O1 casts: the models' forwards run uncast). `_clear_cache()` drops the cached
    16-bit casts of fp32 parameters; `_disable_casts()` is `amp.disable_casts()`. Apex's old
    per-handle API (`handle.scale_loss`, `wrap_optimizer`) raises, as it did in Apex."""

    def __init__(
        self,
        loss_scale: Any = "dynamic",
        enable_caching: bool = True,
        verbose: bool = False,
        allow_banned: bool = False,
        on_deactivate: Optional[Any] = None,
    ) -> None:
        self.loss_scale = loss_scale
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._allow_banned = allow_banned
        self._on_deactivate = on_deactivate
        self._stack: Optional[contextlib.ExitStack] = None
        self._is_active = True

    def _open_region(self) -> None:
        """`amp.init()`: Apex's O1 casts on, process-wide, until `_deactivate()`."""
        apex_o1.STATE.allow_banned = self._allow_banned
        apex_o1.STATE.caching = self._enable_caching
        apex_o1.STATE.verbose = self._verbose
        stack = contextlib.ExitStack()
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        stack.enter_context(function_patches(device_type, torch.float16))
        self._stack = stack

    def is_active(self) -> bool:
        return self._is_active

    def _deactivate(self) -> None:
        if not self._is_active:
            return
        self._is_active = False
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            apex_o1.STATE.allow_banned = False
            apex_o1.STATE.caching = True
            apex_o1.STATE.verbose = False
        if self._on_deactivate is not None:
            self._on_deactivate()
        apex_o1.clear_cache()

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        with disable_casts():
            yield

    def _clear_cache(self) -> None:
        apex_o1.clear_cache()

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict:
        """The cached casts: id(fp32 parameter) -> (weak reference, version, 16-bit cast)."""
        return apex_o1.STATE.cache

    def remove_cache(self, param: torch.Tensor) -> None:
        apex_o1.STATE.cache.pop(id(param), None)

    @property
    def verbose(self) -> bool:
        return self._verbose

    def scale_loss(self, loss, optimizer):
        raise RuntimeError(
            "The old Amp API is no longer supported (nor was it in Apex's last "
            "releases): use amp.initialize and amp.scale_loss"
        )

    def wrap_optimizer(self, optimizer, num_loss: int = 1):
        raise RuntimeError(
            "The old Amp API is no longer supported (nor was it in Apex's last "
            "releases): use amp.initialize and amp.scale_loss"
        )


class NoOpHandle(AmpHandle):
    """`amp.init(enabled=False)`: casts nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._is_active = False

    def is_active(self) -> bool:
        return False

    @property
    def has_cache(self) -> bool:
        return False


class _AmpState:
    """Apex's `amp._amp_state`: `handle`, `opt_properties` (after `initialize`), `loss_scalers`
    (the latest `initialize`'s, one per loss), `verbosity`, `allow_incoming_model_not_fp32`,
    `hard_override`."""

    def __init__(self) -> None:
        self.verbosity = 1
        self.handle: Optional[AmpHandle] = None
        self.allow_incoming_model_not_fp32 = False
        self.hard_override = False
        self.latest: Optional[_Init] = None
        self.inits: list[weakref.ref] = []  # every live initialize, oldest first

    @property
    def engine(self) -> Optional[AmpEngine]:
        return self.latest.engine if self.latest is not None and self.latest.alive else None

    @property
    def enabled(self) -> bool:
        return self.engine is not None

    def live(self) -> list[_Init]:
        out = [i for i in (r() for r in self.inits) if i is not None and i.alive]
        self.inits = [weakref.ref(i) for i in out]
        return out

    @property
    def loss_scalers(self) -> list[_ApexLossScaler]:
        """Apex's `_amp_state.loss_scalers`, one per loss (empty before `initialize`)."""
        if self.latest is None or not self.latest.alive:
            return []
        return self.latest.scalers


_amp_state = _AmpState()
_MISSING = object()


def engine() -> Optional[AmpEngine]:
    """The engine behind the latest `initialize` (None before it, or when disabled)."""
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
def _init_of(opt: torch.optim.Optimizer) -> Optional[_Init]:
    init = opt.__dict__.get("_amp_init")
    return init if init is not None and init.alive else None


def _managed(opt: torch.optim.Optimizer) -> Optional[AmpEngine]:
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


def deinitialize() -> None:
    """Undo every `initialize`: forward wraps, model hooks and optimizer wrappers removed,
    optimizers get the model's parameters back (master values, rounded). Models keep their dtype.
    An `amp.init()` handle stays until its `_deactivate()`."""
    for init in _amp_state.live():
        init.teardown()
    _amp_state.inits = []
    _amp_state.latest = None


def _replace_earlier(models: list[nn.Module], optimizers: list) -> list[nn.Module]:
    """Tear down the earlier `initialize` calls that were given one of these models or
    optimizers; returns the models none of them had (the ones to check for fp32 parameters)."""
    earlier = [i for i in _amp_state.live() if any(i.owns(o) for o in (*models, *optimizers))]
    seen = [m for i in earlier for m in i.models]
    for init in earlier:
        init.teardown()
    return [m for m in models if all(m is not s for s in seen)]


def _check_params_fp32(models: list[nn.Module]) -> None:
    """Apex's check: a model comes to `initialize` in fp32 (amp casts it), unless
    `_amp_state.allow_incoming_model_not_fp32` (or `hard_override`: a warning)."""
    if _amp_state.allow_incoming_model_not_fp32:
        return
    for model in models:
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype in (torch.float16, torch.bfloat16):
                msg = (
                    f"Found param {name} with type {param.dtype}, expected torch.float32.\n"
                    "When using amp.initialize, you do not need to call .half() on your model\n"
                    "before passing it, no matter what optimization level you choose (set "
                    "amp._amp_state.allow_incoming_model_not_fp32 = True if you mean it)."
                )
                if _amp_state.hard_override:
                    print("Warning:  " + msg)
                else:
                    raise RuntimeError(msg)


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


def initialize(
    models,
    optimizers=None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale=None,
    max_loss_scale: float = SCALER_DEFAULTS["max_loss_scale"],
    fp8_linear=None,
    stochastic_rounding=None,
):
    """Apex's `amp.initialize`: returns `models` (and `optimizers`, when given) in the shape they
    came in. Property arguments left None take the level's default; `cast_model_type=False`
    leaves the models' types alone. A call on other models and optimizers coexists with the
    earlier ones; one given a model or optimizer of an earlier call replaces that call (its
    wrappers and hooks are removed first). Beyond Apex:
    `fp8_linear="tensorwise"|"rowwise"` runs the Linear layers' GEMMs in fp8 (torchao; O1 with
    bf16 autocast or O2 with a bf16 model), `stochastic_rounding=True` rounds a bf16 model's
    weights stochastically at each update (O3 with cast_model_type=torch.bfloat16)."""
    _amp_state.verbosity = verbosity
    if not enabled:
        _amp_state.opt_properties = _OptProperties(False)
        return models if optimizers is None else (models, optimizers)
    model_list, models_listed = _as_list(models)
    opt_list, opts_listed = ([], False) if optimizers is None else _as_list(optimizers)
    for m in model_list:
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize expects torch.nn.Module models, got {type(m)!r}")
    for o in opt_list:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"amp.initialize expects torch.optim.Optimizer, got {type(o)!r}")

    no_cast = cast_model_type is False  # Apex: "leave the model's types as they are"
    overrides = {
        k: v
        for k, v in dict(
            cast_model_type="none" if no_cast else cast_model_type,
            patch_torch_functions=patch_torch_functions,
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights,
            loss_scale=loss_scale,
            fp8_linear=fp8_linear,
            stochastic_rounding=stochastic_rounding,
        ).items()
        if v is not None
    }
    device = _device_of(model_list)
    resolution = resolve(opt_level, overrides, device, optimizer=_adam_description(opt_list))
    if resolution.errors:
        raise ValueError(
            "amp.initialize: inconsistent precision properties\n" + resolution.findings_table()
        )
    props = resolution.properties
    new_models = _replace_earlier(model_list, opt_list)
    _check_params_fp32(new_models)
    output_dtype = cast_model_outputs
    if output_dtype is None and props.patch_torch_functions:
        output_dtype = torch.float32  # O1: the loss outside forward runs in fp32 (see module doc)

    eng = AmpEngine(
        props,
        device,
        num_losses=num_losses,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        cast_model_outputs=output_dtype,
        patch_functions=True,
        masters_for_half_params=bool(no_cast and props.master_weights),
    )
    init = _Init(eng, model_list, opt_list)
    # the fp32 values the model comes with (e.g. a checkpoint's masters loaded before this call)
    # seed the masters, not their 16-bit casts: held by reference, the cast makes new tensors
    fp32_values = (
        {id(p): p.data for m in model_list for p in m.parameters() if p.dtype == torch.float32}
        if props.uses_master_weights
        else {}
    )
    for m in model_list:
        eng.cast(m)
        if props.patch_torch_functions:
            _wrap_forward(m, init)
    for o in opt_list:
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        owners = [m for m in model_list if any(id(p) in ids for p in m.parameters())]
        eng.add_optimizer(o, owners)
        masters = eng.masters(o)
        if masters is not None:
            with torch.no_grad():
                for p, master in zip(masters.model_params, masters.masters):
                    value = fp32_values.get(id(p))
                    if value is not None and value.shape == master.shape:
                        master.copy_(value)
        _install_optimizer(o)
        o.__dict__["_amp_init"] = init
    del fp32_values
    _amp_state.inits = [weakref.ref(i) for i in _amp_state.live()] + [weakref.ref(init)]
    _amp_state.latest = init
    _amp_state.opt_properties = _OptProperties(True, props, cast_model_type)
    if props.patch_torch_functions:
        _amp_state.handle = AmpHandle(
            props.loss_scale, verbose=verbosity == 2, on_deactivate=init.unwrap_forwards
        )

    if verbosity >= 1:
        print(
            f"Selected optimization level {props.opt_level}: "
            f"{LEVEL_DESCRIPTIONS.get(props.opt_level, '')}"
        )
        print(props.table())
        for f in resolution.findings:
            if no_cast and f.property == "master_weights":
                continue  # with cast_model_type=False the model's own 16-bit params get masters
            print(f)

    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers,
    loss_id: int = 0,
    model=None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield `loss.float() * scale` for `.backward()`; on exit (unless `delay_unscale`) unscale
    the optimizers' gradients, check them, update loss `loss_id`'s scaler and make the next
    `optimizer.step()` a no-op if they overflowed. `model` and `delay_overflow_check` are
    accepted for Apex compatibility and ignored."""
    opts, _ = _as_list(optimizers)
    inits = [_init_of(o) if isinstance(o, torch.optim.Optimizer) else None for o in opts]
    if not any(inits):
        if _amp_state.engine is None:
            yield loss  # before initialize, or initialize(enabled=False): nothing to scale
            return
        raise RuntimeError(
            "amp.scale_loss: the optimizer(s) given were not returned by "
            "amp.initialize (pass the optimizer objects initialize returned)"
        )
    if not all(inits) or any(i is not inits[0] for i in inits):
        raise RuntimeError(
            "amp.scale_loss: every optimizer passed to one scale_loss must come "
            "from the same amp.initialize call"
        )
    eng = inits[0].engine
    scaled = eng.scale_loss(loss, loss_id, opts)
    yield scaled
    apex_o1.clear_cache()  # the casts cached for this backward are stale after the step
    if delay_unscale:
        return
    with disable_casts():
        skip = eng.settle_all(opts)  # one decision for every optimizer of this scale_loss
    if skip and _amp_state.verbosity >= 1:
        print(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{eng.scalers[loss_id].scale:g}"
        )


def init(
    enabled: bool = True,
    loss_scale: Any = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
) -> AmpHandle:
    """Apex's `amp.init()`: Apex's O1 casts (its function lists) on for the whole process,
    until the returned handle's `_deactivate()`. `enable_caching` reuses the 16-bit cast of an
    fp32 parameter until the cache is cleared (`handle._clear_cache()`, the end of
    `scale_loss`); `verbose` prints each cast; `allow_banned` runs the banned functions
    (binary_cross_entropy) in fp32 instead of raising. `enabled=False` returns a handle that
    casts nothing. `loss_scale` is kept for Apex's old handle API, which raises."""
    if not enabled:
        handle: AmpHandle = NoOpHandle()
    else:
        handle = AmpHandle(loss_scale, enable_caching, verbose, allow_banned)
        handle._open_region()
    _amp_state.handle = handle
    return handle


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
    """Apex layout: `{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}`, of the latest
    `initialize` (Apex's loss scalers were global, the latest call's)."""
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
        raise TypeError(
            f"amp.load_state_dict expects the dict amp.state_dict() returns, got "
            f"{type(sd).__name__}"
        )
    indices = {key: _scaler_number(key) for key in sd}
    unexpected = [key for key, index in indices.items() if index is None and key != "skipped_steps"]
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{key}"' for key in unexpected)
            + " (amp's state dict holds loss_scaler0, loss_scaler1, ...)"
        )
    count = sum(index is not None for index in indices.values())
    gap = next((i for i in range(count) if f"loss_scaler{i}" not in sd), None)
    if gap is not None:
        raise ValueError(
            f"amp.load_state_dict: loss_scaler{gap} is missing (the entries are "
            f"loss_scaler0 .. loss_scaler{count - 1}, one per loss, in order)"
        )
    problems = [
        p
        for i in range(count)
        for p in state_dict_problems(sd[f"loss_scaler{i}"], f"loss_scaler{i}")
    ]
    skipped = sd.get("skipped_steps", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or skipped < 0:
        problems.append(f"skipped_steps: {skipped!r} is not an integer >= 0")
    if problems:
        raise ValueError("amp.load_state_dict: malformed state dict: " + "; ".join(problems))
    if count != len(eng.scalers):
        warnings.warn(
            f"amp state_dict has {count} loss scalers, while {len(eng.scalers)} are used",
            stacklevel=2,
        )
    for i, s in enumerate(eng.scalers[:count]):
        s.load_state_dict(sd[f"loss_scaler{i}"])


def _scaler_number(key: Any) -> Optional[int]:
    """`i` for the key `loss_scaler<i>` (decimal digits, no leading zero), else None."""
    if not isinstance(key, str) or not key.startswith("loss_scaler"):
        return None
    digits = key[len("loss_scaler") :]
    if not (digits.isascii() and digits.isdecimal()) or digits != str(int(digits)):
        return None
    return int(digits)
