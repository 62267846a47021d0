"""The O1 context: the runner's O1 is `torch.autocast`; the Apex facade's O1 is Apex's own.

Autocast casts per op (matmul/conv in 16 bit, reductions and losses in fp32) and leaves the model's
weights in fp32, which is what Apex O1 achieved by monkey-patching torch functions. The runner's
O1 is exactly that: `autocast_context(properties, device)` is plain `torch.autocast`.

The Apex facade (`amp.initialize`, `amp.init`) runs Apex's O1 instead
(`autocast_context(..., patch_functions=True)`, its O1 region): the functions of Apex's lists
(`apex_o1`: GEMMs and convolutions in 16 bits, reductions, losses and `pow` in fp32, mixed-type
binary functions promoted, in-place fp32 functions refused on 16-bit tensors, RNNs in 16 bits,
`binary_cross_entropy` banned) are replaced by casting wrappers, on every device, so that a script
computes in the dtypes Apex gave it (torch.autocast's CPU lists differ). Apex's registration API:
`register_half_function(module, name)`, `register_float_function(module, name)` and
`register_promote_function(module, name)` name a function whose floating tensor arguments are
cast to the 16-bit type / fp32 / the widest floating type of the arguments before it runs (with
O1's casts off inside it, so the cast sticks: in Apex the lists still cast inside). Every attribute
is replaced only while such a
region is open (patched on entering the outermost region, restored on leaving it; nested and
re-entered regions are counted), so code outside the region sees the original function. As in
Apex the patch is on the module attribute: a reference taken before (`from torch import matmul`)
is not affected, and the patch is visible to every thread while a region is open.

Apex's decorator forms, `half_function(fn)`, `float_function(fn)` and `promote_function(fn)`, wrap a
user function with the same casts; the wrapper casts only while a patched O1 region is open and
otherwise calls `fn` unchanged. `casts_disabled()` (Apex's `amp.disable_casts()`) turns O1's
casting off for the current thread: autocast off, the list, registered and decorated functions run
on their inputs as they are. The BCE ban stays: `torch.nn.functional.binary_cross_entropy` (which
`nn.BCELoss` calls) raises NotImplementedError on 16-bit inputs inside the region with a pointer
to `BCEWithLogitsLoss` (on 16-bit inputs it saturates: log of a rounded-to-1 probability).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch

from runner.precision import apex_o1
from runner.precision.casting import cast_tensor, map_tensors
from runner.precision.properties import HALF_DTYPES, Properties

_KINDS = ("half", "float", "promote")

# (module, name) -> kind, in registration order (a later registration of the same name wins).
_REGISTRY: dict[tuple[int, str], tuple[Any, str, str]] = {}
_LOCK = threading.RLock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []  # (module, name, original attribute) while patched
_region_device_type = "cpu"
_region_half_dtype = torch.float16
_thread = threading.local()  # .disabled: depth of casts_disabled() in this thread


def _register(module: Any, name: str, kind: str) -> None:
    if not hasattr(module, name):
        raise AttributeError(f"{getattr(module, '__name__', module)!r} has no attribute {name!r}")
    if not callable(getattr(module, name)):
        raise TypeError(f"{getattr(module, '__name__', module)!r}.{name} is not callable")
    with _LOCK:
        if _depth:
            raise RuntimeError("register_*_function must be called outside an O1 autocast region")
        _REGISTRY[(id(module), name)] = (module, name, kind)


def register_half_function(module: Any, name: str) -> None:
    """Inside the O1 region, `module.name` runs on 16-bit copies of its floating tensor args."""
    _register(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Inside the O1 region, `module.name` runs on fp32 copies of its floating tensor args."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Inside the O1 region, `module.name` runs with its floating tensor args cast to the widest
    floating type among them (fp16 + fp32 -> fp32; fp16 + bf16 -> fp32)."""
    _register(module, name, "promote")


def half_function(fn: Callable) -> Callable:
    """Decorator form of `register_half_function`: inside the O1 region `fn` runs on 16-bit copies
    of its floating tensor args (with autocast off); elsewhere it runs unchanged."""
    return _casting_wrapper(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator form of `register_float_function`: fp32 args inside the O1 region."""
    return _casting_wrapper(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator form of `register_promote_function`: args cast to their widest floating type
    inside the O1 region."""
    return _casting_wrapper(fn, "promote")


def clear_registrations() -> None:
    """Forget every registered function (tests; a fresh process starts empty)."""
    with _LOCK:
        if _depth:
            raise RuntimeError("cannot clear registrations inside an O1 autocast region")
        _REGISTRY.clear()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _cast_all(obj: Any, dtype: torch.dtype) -> Any:
    return map_tensors(obj, lambda t: cast_tensor(t, dtype))


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    dtypes = {t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()}
    if not dtypes:
        return None
    if len(dtypes) == 1:
        return dtypes.pop()
    wide = [d for d in dtypes if d not in HALF_DTYPES]
    if wide:
        return max(wide, key=lambda d: torch.finfo(d).bits)
    return torch.float32  # fp16 with bf16: neither holds the other


def _casts_disabled_here() -> bool:
    return getattr(_thread, "disabled", 0) > 0


def _casting_wrapper(fn: Callable, kind: str) -> Callable:
    """`fn` with its floating args cast per `kind` while an O1 region is open and casts are not
    disabled (a registered function is patched in only inside a region; a decorated one is
    wrapped for good and checks)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _depth or _casts_disabled_here():
            return fn(*args, **kwargs)
        if kind == "half":
            dtype = _region_half_dtype
        elif kind == "float":
            dtype = torch.float32
        else:
            dtype = _widest(args, kwargs)
        if dtype is not None:
            args, kwargs = _cast_all(args, dtype), _cast_all(kwargs, dtype)
        with casts_disabled(_region_device_type):  # the cast sticks inside fn
            return fn(*args, **kwargs)

    wrapper.__amp_original__ = fn  # type: ignore[attr-defined]
    return wrapper


_ABSENT = object()


def _set_patch(module: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace `module.name` by `make(original)`, remembering the raw attribute (a class's
    staticmethod stays a staticmethod; an inherited attribute is deleted again on restore)."""
    raw = vars(module).get(name, _ABSENT) if hasattr(module, "__dict__") else _ABSENT
    _saved.append((module, name, raw))
    if isinstance(raw, staticmethod):
        setattr(module, name, staticmethod(make(raw.__func__)))
    else:
        setattr(module, name, make(getattr(module, name)))


# (owner id, name) -> (original, wrapper): the list wrappers are made once per original
_WRAPPERS: dict[tuple[int, str], tuple[Any, Callable]] = {}


def _list_patch(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    def made(original: Callable) -> Callable:
        key = (id(owner), name)
        hit = _WRAPPERS.get(key)
        if hit is not None and hit[0] is original:
            return hit[1]
        wrapper = make(original)
        _WRAPPERS[key] = (original, wrapper)
        return wrapper

    _set_patch(owner, name, made)


def _patch() -> None:
    # Apex's order: the user's registrations, then its lists, then the RNN functions
    for module, name, kind in _REGISTRY.values():
        _set_patch(module, name, lambda fn, kind=kind: _casting_wrapper(fn, kind))
    for owner, name, make in apex_o1.patches():
        _list_patch(owner, name, make)
    rnn_module = torch.nn.modules.rnn
    shim = apex_o1.VariableFunctionsShim(rnn_module._VF)
    _set_patch(rnn_module, "_VF", lambda real: shim)
    for owner, name, make in apex_o1.rnn_patches(shim):
        _set_patch(owner, name, make)


def _unpatch() -> None:
    while _saved:
        module, name, raw = _saved.pop()  # reverse order: a name patched twice comes back
        if raw is _ABSENT:
            delattr(module, name)
        else:
            setattr(module, name, raw)


@contextlib.contextmanager
def function_patches(device_type: str, half_dtype: torch.dtype) -> Iterator[None]:
    """Apex's O1 for the duration (counted, re-entrant): the registered casts, Apex's function
    lists (`apex_o1`) with the BCE ban, the RNN casts. The 16-bit type is the outermost region's;
    the cached casts are dropped when the outermost region closes."""
    global _depth, _region_device_type, _region_half_dtype
    with _LOCK:
        if _depth == 0:
            _region_device_type, _region_half_dtype = device_type, half_dtype
            apex_o1.STATE.half = half_dtype
            try:
                _patch()
            except BaseException:
                _unpatch()
                raise
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                _unpatch()
                apex_o1.clear_cache()


def _casting_now() -> bool:
    return _depth > 0 and not _casts_disabled_here()


apex_o1.STATE.active = _casting_now
apex_o1.STATE.in_region = lambda: _depth > 0


def in_patched_region() -> bool:
    return _depth > 0


@contextlib.contextmanager
def casts_disabled(device_type: Optional[str]) -> Iterator[None]:
    """Apex's `amp.disable_casts()` for this thread: autocast off for `device_type` (None: no
    autocast to turn off), registered/decorated functions uncast, O1 regions opened inside it
    without autocast."""
    ctx = (
        torch.autocast(device_type, enabled=False)
        if device_type is not None
        else contextlib.nullcontext()
    )
    with ctx:
        _thread.disabled = getattr(_thread, "disabled", 0) + 1
        try:
            yield
        finally:
            _thread.disabled -= 1


@contextlib.contextmanager
def _o1_region(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """The facade's O1: Apex's casts by its function lists, not torch.autocast (whose per-device
    lists differ from Apex's: on a CPU autocast leaves softmax or sum of fp16 inputs in fp16)."""
    with function_patches(device_type, dtype):
        yield


def autocast_context(
    properties: Properties,
    device: torch.device | str,
    patch_functions: bool = False,
    cache_enabled: bool = True,
) -> ContextManager:
    """Under patch_torch_functions, `torch.autocast(<device type>, dtype=autocast_dtype)`; with
    `patch_functions` (the Apex facade) Apex's own O1 instead: its function lists, the
    registered functions, the BCE ban (`function_patches`). Without patch_torch_functions, a no-op
    context. `cache_enabled=False`: autocast casts each weight at every use instead of once per
    region (the same values): a forward captured in a CUDA graph must not keep cast copies
    that outlive the capture (torch's CUDA graphs notes)."""
    if not properties.patch_torch_functions:
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    if not patch_functions:
        return torch.autocast(
            device_type, dtype=properties.autocast_dtype, cache_enabled=cache_enabled
        )
    return _o1_region(device_type, properties.autocast_dtype)
