"""Apex-compatible `amp` front end over `ApexEngine`: port an Apex script by changing one import.

    from runner.precision import amp          # was: from apex import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

This module holds Apex's public calls (`initialize`, `scale_loss`, `init`, `master_params`,
`state_dict`, `load_state_dict`, `deinitialize`, ...); the engine of each `initialize` call (several
losses and optimizers) is `apex_engine.ApexEngine`, `_amp_state` and the handles live in
`amp_state`, what `initialize` installs on models and optimizers in `amp_wrappers`, and the
registered casts and decorators in `autocast`, all importable from here. How Apex's behaviour is
reproduced on modern PyTorch: README.md beside this file.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from runner.config.levels import SCALER_DEFAULTS
from runner.precision import apex_o1
from runner.precision.amp_state import (
    AmpHandle,
    NoOpHandle,
    _amp_state,
    _Init,
    _OptProperties,
    disable_casts,
    engine,
)
from runner.precision.amp_wrappers import (
    _AutocastForward as _AutocastForward,  # O1 models pickled before the move name it here
)
from runner.precision.amp_wrappers import (
    _init_of,
    _install_optimizer,
    _teardown,
    _wrap_forward,
)
from runner.precision.apex_engine import ApexEngine
from runner.precision.autocast import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from runner.precision.properties import LEVEL_DESCRIPTIONS
from runner.precision.resolver import resolve
from runner.precision.scaler import state_dict_problems

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


def _as_list(obj: Any) -> tuple[list, bool]:
    if isinstance(obj, (list, tuple)):
        return list(obj), True
    return [obj], False


def _device_of(models: list[nn.Module]) -> torch.device:
    for m in models:
        for t in (*m.parameters(), *m.buffers()):
            return t.device
    return torch.device("cpu")


def deinitialize() -> None:
    """Undo every `initialize`: forward wraps, model hooks and optimizer wrappers removed,
    optimizers get the model's parameters back (master values, rounded). Models keep their dtype.
    An `amp.init()` handle stays until its `_deactivate()`."""
    for init in _amp_state.live():
        _teardown(init)
    _amp_state.inits = []
    _amp_state.latest = None


def _replace_earlier(models: list[nn.Module], optimizers: list) -> list[nn.Module]:
    """Tear down the earlier `initialize` calls that were given one of these models or
    optimizers; returns the models none of them had (the ones to check for fp32 parameters)."""
    earlier = [i for i in _amp_state.live() if any(i.owns(o) for o in (*models, *optimizers))]
    seen = [m for i in earlier for m in i.models]
    for init in earlier:
        _teardown(init)
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
    _check_types(model_list, opt_list)
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
    _check_params_fp32(_replace_earlier(model_list, opt_list))
    if cast_model_outputs is None and props.patch_torch_functions:
        cast_model_outputs = torch.float32  # O1: the loss outside forward runs in fp32 (README)
    eng = ApexEngine(
        props,
        device,
        num_losses=num_losses,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        cast_model_outputs=cast_model_outputs,
        masters_for_half_params=bool(no_cast and props.master_weights),
    )
    init = _prepare(eng, model_list, opt_list)
    _amp_state.inits = [weakref.ref(i) for i in _amp_state.live()] + [weakref.ref(init)]
    _amp_state.latest = init
    _amp_state.opt_properties = _OptProperties(True, props, cast_model_type)
    if props.patch_torch_functions:
        _amp_state.handle = AmpHandle(
            props.loss_scale, verbose=verbosity == 2, on_deactivate=init.unwrap_forwards
        )
    if verbosity >= 1:
        _say_level(resolution, no_cast)
    out_models = model_list if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_listed else opt_list[0])


def _check_types(models: list, optimizers: list) -> None:
    for m in models:
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize expects torch.nn.Module models, got {type(m)!r}")
    for o in optimizers:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"amp.initialize expects torch.optim.Optimizer, got {type(o)!r}")


def _prepare(eng: ApexEngine, models: list[nn.Module], optimizers: list) -> _Init:
    """`eng` casts the models (O1: their forwards wrapped in Apex's O1 region) and prepares the
    optimizers (masters, the wrappers on each instance); returns the call's `_Init`."""
    init = _Init(eng, models, optimizers)
    # the fp32 values the model comes with (e.g. a checkpoint's masters loaded before this call)
    # seed the masters, not their 16-bit casts: held by reference, the cast makes new tensors
    fp32_values = (
        {id(p): p.data for m in models for p in m.parameters() if p.dtype == torch.float32}
        if eng.properties.uses_master_weights
        else {}
    )
    for m in models:
        eng.cast(m)
        if eng.properties.patch_torch_functions:
            _wrap_forward(m, init)
    for o in optimizers:
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        owners = [m for m in models if any(id(p) in ids for p in m.parameters())]
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
    return init


def _say_level(resolution: Any, no_cast: bool) -> None:
    """Apex's print of the level, with the properties' table and the findings."""
    props = resolution.properties
    description = LEVEL_DESCRIPTIONS.get(props.opt_level, "")
    print(f"Selected optimization level {props.opt_level}: {description}")
    print(props.table())
    for f in resolution.findings:
        if no_cast and f.property == "master_weights":
            continue  # with cast_model_type=False the model's own 16-bit params get masters
        print(f)


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
    accepted for Apex compatibility and ignored. While amp is disabled (the latest `initialize`
    said `enabled=False`) the loss passes through unchanged whatever earlier calls set up, as in
    Apex: no engine scales, unscales or checks anything."""
    props = getattr(_amp_state, "opt_properties", None)
    if props is None:  # Apex's error: a script that forgot initialize is not left unscaled
        raise RuntimeError(
            "Invoked 'with amp.scale_loss', but internal Amp state has not been initialized: "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before 'with amp.scale_loss'"
        )
    if not props.enabled:
        yield loss
        return
    opts, _ = _as_list(optimizers)
    inits = [_init_of(o) if isinstance(o, torch.optim.Optimizer) else None for o in opts]
    if not any(inits):
        if _amp_state.engine is None:
            yield loss  # after amp.deinitialize(): nothing to scale
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
