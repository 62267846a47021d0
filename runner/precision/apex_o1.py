"""Apex's O1 casts: the wrappers Apex put around torch's functions, by the lists of
`apex_lists`, and `STATE`, what they read at each call.

Half-list functions run on 16-bit copies of their floating arguments (an fp32 Parameter's copy
cached), float-list ones in fp32, promote-list ones in the widest type when fp32 and 16 bits
meet; `binary_cross_entropy` on 16-bit inputs raises; RNNs run in 16 bits. The wrappers are
installed by `runner.precision.autocast` while an O1 region of the facade is open. Apex's O1 in
full, and this runner's deliberate departures from it: README.md beside this file.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from runner.precision.apex_lists import (
    FUNCTIONAL_BANNED,
    FUNCTIONAL_FLOAT,
    FUNCTIONAL_HALF,
    RNN_CELLS,
    RNN_NAMES,
    TENSOR_FLOAT,
    TENSOR_HALF,
    TENSOR_INPLACE_OPERATORS,
    TENSOR_PROMOTE,
    TORCH_FLOAT,
    TORCH_HALF,
    TORCH_PROMOTE,
    TORCH_SEQUENCE,
)


# ---- what the wrappers read at each call ----------------------------------------------------
@dataclass
class _State:
    """Set by the region (`runner.precision.autocast`) and `amp.init`."""

    active: Callable[[], bool] = lambda: False  # a region is open and casts are not disabled
    in_region: Callable[[], bool] = lambda: False  # a region is open
    half: torch.dtype = torch.float16  # the 16-bit type of the region
    allow_banned: bool = False
    caching: bool = True
    verbose: bool = False
    # id(parameter) -> (weak reference, version, cast): fp32 Parameters cast to 16 bits
    cache: dict[int, tuple[Any, int, torch.Tensor]] = field(default_factory=dict)
    lock: Any = field(default_factory=threading.Lock)


STATE = _State()
# RNN functions that fell back to fp32 on a device (name, device type) -> the error, once each
FALLBACKS: dict[tuple[str, str], str] = {}


def clear_cache() -> None:
    """Forget every cached 16-bit cast (Apex's `handle._clear_cache()`)."""
    with STATE.lock:
        STATE.cache.clear()


# ---- casts ----------------------------------------------------------------------------------
def _is_fp(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _say(kind: str, name: str) -> None:
    if STATE.verbose:
        print(f"{kind} ({name})")


def _to_half(x: torch.Tensor, name: str) -> torch.Tensor:
    half = STATE.half
    if x.dtype == half or x.dtype == torch.float64:
        return x
    _say(f"Float->{'Half' if half == torch.float16 else 'BFloat16'}", name)
    return x.to(half)


def _to_float(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dtype not in (torch.float16, torch.bfloat16):
        return x
    _say("Half->Float", name)
    return x.float()


def _cached_half(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x` in 16 bits; an fp32 Parameter's cast is reused while caching is on, the parameter
    is unchanged (its version) and the cast's requires_grad still fits (Apex's rule: under
    no_grad a cast made for evaluation is reused; with grad enabled it is remade)."""
    if not (STATE.caching and isinstance(x, torch.nn.Parameter) and x.dtype == torch.float32):
        return _to_half(x, name)
    key = id(x)
    with STATE.lock:
        entry = STATE.cache.get(key)
    if entry is not None:
        ref, version, cast = entry
        if (
            ref() is x
            and version == x._version
            and cast.dtype == STATE.half
            and not (torch.is_grad_enabled() and x.requires_grad != cast.requires_grad)
        ):
            return cast
    cast = _to_half(x, name)
    with STATE.lock:
        STATE.cache[key] = (weakref.ref(x), x._version, cast)
    return cast


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if _is_fp(obj):
        return fn(obj)
    if isinstance(obj, (list, tuple)) and obj and all(_is_fp(o) for o in obj):
        return type(obj)(fn(o) for o in obj)  # Apex cast sequences only when all are floating
    return obj


def _cast_args(
    fn: Callable[[torch.Tensor], torch.Tensor], args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    return (tuple(_map(a, fn) for a in args), {k: _map(v, fn) for k, v in kwargs.items()})


def _fp_types(args: tuple, kwargs: dict) -> set[torch.dtype]:
    found: set[torch.dtype] = set()

    def visit(x: Any) -> None:
        if isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif _is_fp(x):
            found.add(x.dtype)

    for a in (*args, *kwargs.values()):
        visit(a)
    return found


def _mixed(types: set[torch.dtype]) -> bool:
    """fp32 met the region's 16-bit type (the only mix Apex promoted)."""
    return types == {torch.float32, STATE.half}


# ---- wrapper factories: make(original, name) -> wrapper ---------------------------------------
def _wraps(orig: Callable, wrapper: Callable) -> Callable:
    try:
        functools.update_wrapper(wrapper, orig)
    except (AttributeError, TypeError):
        pass
    wrapper.__amp_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _casting(
    cast: Callable[[torch.Tensor, str], torch.Tensor],
) -> Callable[[Callable, str], Callable]:
    """The wrapper factory of a list whose functions run on `cast` copies of their floating
    arguments while the region is active."""

    def make(orig: Callable, name: str) -> Callable:
        def wrapper(*args, **kwargs):
            if STATE.active():
                args, kwargs = _cast_args(lambda t: cast(t, name), args, kwargs)
            return orig(*args, **kwargs)

        return _wraps(orig, wrapper)

    return make


half_cast = _casting(_cached_half)  # Apex's FP16 lists: 16-bit copies, fp32 Parameters cached
float_cast = _casting(_to_float)  # Apex's FP32 lists


def promote(orig: Callable, name: str) -> Callable:
    def wrapper(*args, **kwargs):
        if STATE.active() and _mixed(_fp_types(args, kwargs)):
            args, kwargs = _cast_args(lambda t: _to_float(t, name), args, kwargs)
        return orig(*args, **kwargs)

    return _wraps(orig, wrapper)


def sequence_promote(orig: Callable, name: str) -> Callable:
    def wrapper(seq, *args, **kwargs):
        if STATE.active() and isinstance(seq, (list, tuple)):
            types = {t.dtype for t in seq if _is_fp(t)}
            if _mixed(types):
                seq = [_to_float(t, name) if _is_fp(t) else t for t in seq]
        return orig(seq, *args, **kwargs)

    return _wraps(orig, wrapper)


def match_self(orig: Callable, name: str) -> Callable:
    """In-place methods: the other arguments take `self`'s type (fp32 or the 16-bit type)."""

    def wrapper(self, *args, **kwargs):
        if STATE.active() and _is_fp(self):
            if self.dtype == STATE.half:
                args, kwargs = _cast_args(lambda t: _to_half(t, name), args, kwargs)
            elif self.dtype == torch.float32:
                args, kwargs = _cast_args(lambda t: _to_float(t, name), args, kwargs)
        return orig(self, *args, **kwargs)

    return _wraps(orig, wrapper)


def refuse_half_self(orig: Callable, name: str) -> Callable:
    """In-place methods of the float list: refused on a 16-bit tensor, fp32 arguments else."""

    def wrapper(self, *args, **kwargs):
        if STATE.active():
            if _is_fp(self) and self.dtype == STATE.half:
                raise NotImplementedError(f"Cannot call in-place method {name} on fp16 Tensors.")
            args, kwargs = _cast_args(lambda t: _to_float(t, name), args, kwargs)
        return orig(self, *args, **kwargs)

    return _wraps(orig, wrapper)


def refuse_any_half(orig: Callable, name: str) -> Callable:
    """In-place functions of the float list: refused when any argument is 16-bit."""

    def wrapper(*args, **kwargs):
        if STATE.active() and STATE.half in _fp_types(args, kwargs):
            raise NotImplementedError(f"Cannot call in-place function {name} with fp16 arguments.")
        return orig(*args, **kwargs)

    return _wraps(orig, wrapper)


BANNED_MESSAGE = (
    "{name} on 16-bit inputs is banned inside the O1 mixed-precision region (as in Apex amp): "
    "the probability input has already been rounded to 16 bits, so log(p) and log(1-p) saturate "
    "and the loss is unsafe to autocast. Return logits instead of sigmoid outputs and use "
    "torch.nn.BCEWithLogitsLoss / torch.nn.functional.binary_cross_entropy_with_logits, which are "
    "safe (fused sigmoid + log in fp32). If you must, cast the inputs with .float() first, or pass "
    "allow_banned=True to amp.init() to run it in fp32."
)


def banned(orig: Callable, name: str) -> Callable:
    """The banned functions raise on 16-bit inputs inside the region, even with casts disabled
    (Apex's error ignored its handle's state too); with `allow_banned` they run in fp32."""

    def wrapper(*args, **kwargs):
        if not STATE.in_region():
            return orig(*args, **kwargs)
        if STATE.allow_banned:
            if STATE.active():
                args, kwargs = _cast_args(lambda t: _to_float(t, name), args, kwargs)
            return orig(*args, **kwargs)
        if _fp_types(args, kwargs) & {torch.float16, torch.bfloat16}:
            raise NotImplementedError(
                BANNED_MESSAGE.format(name=f"torch.nn.functional.{name} (and nn.BCELoss)")
            )
        return orig(*args, **kwargs)

    return _wraps(orig, wrapper)


# ---- RNNs ------------------------------------------------------------------------------------
class VariableFunctionsShim:
    """Stands in for `torch.nn.modules.rnn._VF` inside the region (as in Apex), so that the RNN
    functions it exposes can be wrapped without touching `torch._VF` itself; every other name is
    the real one."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _half_tree(obj: Any, name: str) -> Any:
    if _is_fp(obj):
        return _cached_half(obj, name)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_half_tree(o, name) for o in obj)
    return obj


def _float_tree(obj: Any) -> Any:
    if _is_fp(obj):
        return obj.float() if obj.dtype != torch.float32 and obj.dtype != torch.float64 else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_float_tree(o) for o in obj)
    return obj


def _device_type(args: tuple) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def rnn_cast(orig: Callable, name: str) -> Callable:
    """An RNN function (`lstm`, `gru_cell`, ...) on 16-bit inputs, hidden states and weights.
    Where the device's kernel cannot run it in 16 bits (a RuntimeError from the 16-bit call),
    it runs in fp32 and its outputs are cast to the 16-bit type, with a warning naming it once
    per function and device (`FALLBACKS`)."""

    def wrapper(*args, **kwargs):
        if not STATE.active():
            return orig(*args, **kwargs)
        half_args = _half_tree(args, name)
        key = (name, _device_type(args))
        if key not in FALLBACKS:
            try:
                return orig(*half_args, **kwargs)
            except RuntimeError as error:
                FALLBACKS[key] = str(error).splitlines()[0][:200]
                warnings.warn(
                    f"amp O1: torch's {name} cannot run in {STATE.half} on {key[1]} "
                    f"({FALLBACKS[key]}); it runs in float32 there and its outputs are cast to "
                    f"{STATE.half}, so the rest of the model sees the types Apex gave it",
                    RuntimeWarning,
                    stacklevel=2,
                )
        out = orig(*_float_tree(args), **kwargs)
        return _half_tree(out, name) if not isinstance(out, torch.Tensor) else _to_half(out, name)

    return _wraps(orig, wrapper)


def _rnn_check_input(orig: Callable) -> Callable:
    """`RNNBase.check_input` refuses an input whose dtype differs from the weights' unless
    autocast is on; under O1 the RNN function casts both, so the check runs on a stand-in of the
    weights' dtype (on the meta device: no copy)."""

    def check_input(self, input, batch_sizes):
        weights = getattr(self, "_flat_weights", None)
        if (
            STATE.active()
            and _is_fp(input)
            and weights
            and weights[0] is not None
            and input.dtype != weights[0].dtype
        ):
            input = torch.empty(input.shape, dtype=weights[0].dtype, device="meta")
        return orig(self, input, batch_sizes)

    return _wraps(orig, check_input)


# ---- the plan: (owner, attribute name, wrapper factory) ---------------------------------------
Patch = tuple[Any, str, Callable[[Callable], Callable]]


def _each(
    owner: Any, names: Iterable[str], make: Callable[[Callable, str], Callable]
) -> Iterator[Patch]:
    for name in names:
        if hasattr(owner, name) and callable(getattr(owner, name)):
            yield owner, name, functools.partial(_bind, make, name)


def _bind(make: Callable[[Callable, str], Callable], name: str, orig: Callable) -> Callable:
    return make(orig, name)


def patches() -> list[Patch]:
    """Every function Apex's O1 wrapped, in Apex's order (a later wrapper wraps an earlier one).
    The RNN shim is installed by the caller first (`rnn_module_patch`)."""
    out: list[Patch] = []
    for owner, half, flt in (
        (F, FUNCTIONAL_HALF, FUNCTIONAL_FLOAT),
        (torch, TORCH_HALF, TORCH_FLOAT),
        (torch.Tensor, TENSOR_HALF, TENSOR_FLOAT),
    ):
        out += _each(owner, half, half_cast)
        out += _each(owner, flt, float_cast)
    out += _each(torch, TORCH_PROMOTE, promote)
    out += _each(torch, TORCH_SEQUENCE, sequence_promote)
    out += _each(torch.Tensor, TENSOR_PROMOTE, promote)
    out += _each(torch, [f"{n}_" for n in TORCH_FLOAT], refuse_any_half)
    out += _each(torch.Tensor, [f"{n}_" for n in TENSOR_FLOAT], refuse_half_self)
    out += _each(
        torch.Tensor,
        [*TENSOR_INPLACE_OPERATORS, *(f"{n}_" for n in (*TENSOR_HALF, *TENSOR_PROMOTE))],
        match_self,
    )
    out += _each(F, FUNCTIONAL_BANNED, banned)
    return out


def rnn_patches(shim: VariableFunctionsShim) -> list[Patch]:
    """The RNN functions on the shim and the input check of `nn.RNNBase`."""
    out: list[Patch] = [
        (shim, name, functools.partial(_bind, rnn_cast, name))
        for name in (*RNN_NAMES, *RNN_CELLS)
        if hasattr(shim._real, name)
    ]
    out.append((torch.nn.modules.rnn.RNNBase, "check_input", _rnn_check_input))
    return out


def fallback_findings() -> list[str]:
    """One line per RNN function that ran in fp32 instead of 16 bits, and why."""
    return [
        f"{name} on {device}: ran in float32 ({why})"
        for (name, device), why in sorted(FALLBACKS.items())
    ]


__all__ = [
    "STATE",
    "FALLBACKS",
    "patches",
    "rnn_patches",
    "VariableFunctionsShim",
    "clear_cache",
    "fallback_findings",
    "BANNED_MESSAGE",
]
