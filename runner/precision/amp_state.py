"""Apex's module state, `amp._amp_state`, and what hangs from it: the loss scalers and
`opt_properties` Apex scripts read, one `_Init` per `initialize` call, the handles of `amp.init()`,
and `disable_casts`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch
from torch import nn

from runner.precision import apex_o1
from runner.precision.apex_engine import ApexEngine
from runner.precision.autocast import casts_disabled, function_patches
from runner.precision.recipe import Properties
from runner.precision.scaler import LossScaler

# a model's `forward` that was the class's (no instance attribute to put back)
_MISSING = object()


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
    or optimizer of an earlier call replaces that earlier call (`amp_wrappers._teardown` takes
    the earlier one off)."""

    def __init__(
        self, engine: ApexEngine, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]
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
    def engine(self) -> Optional[ApexEngine]:
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


def engine() -> Optional[ApexEngine]:
    """The engine behind the latest `initialize` (None before it, or when disabled)."""
    return _amp_state.engine


def disable_casts() -> ContextManager[None]:
    """Apex's `amp.disable_casts()`: inside it O1 casts nothing, so ops run in their inputs' own
    types (autocast off for the engine's device; registered and decorated functions uncast; a
    model called inside runs its forward uncast). For this thread only, like torch.autocast."""
    eng = _amp_state.engine
    return casts_disabled(None if eng is None else eng.device.type)
