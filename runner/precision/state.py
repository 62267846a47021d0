"""The optimizer's state format (the `optimizer_state` property): how momentum and Adam's moments
are stored, independently of the type of the weights the optimizer steps.

Two families:

* **float** (`float32`, `bfloat16`, `float16`): torch's own optimizers. Where the state's type is
  the stepped weights' type (the default: fp32 with masters, the model's type at O3), the
  optimizer's step runs as it is. Otherwise each step loads the state (and 16-bit weights) to
  fp32, runs the optimizer's own `step` there and stores the state back in its type, rounded to
  nearest (`step_in_fp32`): Adam's arithmetic, `sqrt(v) + eps` included, is fp32 whatever the
  storage. Stochastically rounded runs (`rounding.sr_step`, the `*_step_sr` kernels) step the
  same way, and store their bf16 weights and bf16 state rounded stochastically (each with its own
  random bits), so that Adam's second moment can decay (rounded to nearest it cannot: a
  0.1% decrease a step is under half of bf16's spacing).
* **low-bit** (`int8`, `int4`, `fp8`): torchao's blockwise-quantised Adam/AdamW
  (`torchao.optim.AdamW8bit`, `AdamW4bit`, `AdamWFp8` and their Adam siblings): each moment is
  codes (uint8; two 4-bit codes per byte; float8_e4m3fn) plus one fp32 scale per block of
  `block_size` elements (256; 128 for int4), dequantised to fp32 for the update. As torchao and
  bitsandbytes do, a tensor smaller than 4096 elements or not a multiple of the block size keeps
  plain state in the stepped weights' type (`plain_state_params`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from runner.config.formats import LOW_BIT_STATES

# torchao's rule for quantised state (torchao.optim.adam._AdamBase._new_buffer, after
# bitsandbytes' min_8bit_size): at least this many elements, and a multiple of the block size
MIN_QUANTISED_NUMEL = 4096
BLOCK_SIZES = {"int8": 256, "int4": 128, "fp8": 256}

_LOW_BIT_CLASSES = {  # (optimizer name, format) -> torchao.optim class name
    ("adam", "int8"): "Adam8bit",
    ("adam", "int4"): "Adam4bit",
    ("adam", "fp8"): "AdamFp8",
    ("adamw", "int8"): "AdamW8bit",
    ("adamw", "int4"): "AdamW4bit",
    ("adamw", "fp8"): "AdamWFp8",
}
LOW_BIT_OPTIMIZERS = ("adam", "adamw")


def low_bit_class(optimizer_name: str, fmt: str) -> type:
    """torchao's optimizer class for `optimizer_name` (adam | adamw) with `fmt` state."""
    import torchao.optim

    return getattr(torchao.optim, _LOW_BIT_CLASSES[(optimizer_name, fmt)])


def build_low_bit(
    cfg: Any, params: list, fmt: str, stochastic_rounding: bool = False
) -> torch.optim.Optimizer:
    """torchao's low-bit Adam/AdamW with the hyperparameters of the optimizer config `cfg`; with
    `stochastic_rounding` it stores bf16 weights rounded stochastically itself (its
    `bf16_stochastic_round`, drawing from torch's generator, which checkpoints restore)."""
    name = str(cfg.name).lower()
    if fmt not in LOW_BIT_STATES or name not in LOW_BIT_OPTIMIZERS:
        raise ValueError(f"no low-bit {name} with {fmt} state")  # the plan refuses it earlier
    cls = low_bit_class(name, fmt)
    return cls(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        amsgrad=cfg.amsgrad,
        block_size=BLOCK_SIZES[fmt],
        bf16_stochastic_round=stochastic_rounding,
    )


def is_low_bit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is one of torchao's low-bit optimizers (it quantises its own state)."""
    return type(optimizer).__module__.startswith("torchao.optim")


def rounds_itself(optimizer: torch.optim.Optimizer) -> bool:
    """A low-bit optimizer that stores bf16 weights rounded stochastically itself."""
    return is_low_bit(optimizer) and bool(getattr(optimizer, "bf16_stochastic_round", False))


def plain_state_params(
    named: Iterable[tuple[str, torch.Tensor]], fmt: str
) -> list[tuple[str, int]]:
    """(name, numel) of the parameters that keep plain (unquantised) state under `fmt`: fewer
    than 4096 elements, or not a multiple of the block size."""
    return [(name, p.numel()) for name, p in named if not quantised(p.numel(), BLOCK_SIZES[fmt])]


def quantised(numel: int, block_size: int) -> bool:
    """torchao's rule: a tensor's state is quantised when it has at least 4096 elements and is
    a multiple of the block size."""
    return numel >= MIN_QUANTISED_NUMEL and block_size > 0 and numel % block_size == 0


def param_shaped(key: Any, value: Any, param: torch.Tensor) -> bool:
    """Optimizer state that is elementwise with the param (moments, momentum buffers) and plain
    (not a quantised subclass; a sharded run's DTensor is plain per shard); torch's `step`
    counter is not, even for a 0-d param."""
    return (
        key != "step"
        and (type(value) is torch.Tensor or is_dtensor(value))
        and value.is_floating_point()
        and value.shape == param.shape
    )


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (a sharded run's parameter, gradient or state), without importing
    torch.distributed."""
    return type(t).__name__ == "DTensor" or (
        isinstance(t, torch.Tensor) and hasattr(t, "to_local") and hasattr(t, "placements")
    )


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if is_dtensor(t) else t


def needs_fp32_step(optimizer: torch.optim.Optimizer, state_dtype: Optional[torch.dtype]) -> bool:
    """Whether a step must go through `step_in_fp32`: some stepped param with a gradient is
    not of `state_dtype` (None: the state follows the params, as torch keeps it)."""
    if state_dtype is None or is_low_bit(optimizer):
        return False
    return any(
        p.grad is not None and p.dtype != state_dtype
        for group in optimizer.param_groups
        for p in group["params"]
    )


@torch.no_grad()
def step_in_fp32(
    optimizer: torch.optim.Optimizer,
    select: Callable[[torch.Tensor], bool],
    store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    state_dtype: Optional[torch.dtype],
    step_fn: Optional[Callable[[], Any]] = None,
    round_state: Optional[Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor]] = None,
) -> None:
    """One `optimizer.step()` on fp32 values for the params `select` picks (with a gradient):

      1. a 16-bit param's data and gradient are replaced by fp32 copies, and its param-shaped
         plain state tensors (moments, momentum buffers; not `step`) by fp32 copies (fp32
         state is used as is) -- the param object, its id and its state keys stay;
      2. the optimizer's own `step()` runs once;
      3. the state is written back in its own dtype, into the same tensor objects, rounded to
         nearest, or for bf16 state by `round_state(param, key, fp32)` where given (stochastic
         rounding); state created by this step (a first step) is stored in `state_dtype` (None:
         the param's dtype, torch's `zeros_like(param)`) the same way;
      4. a swapped param's fp32 result is written into its own storage by `store(param, data,
         fp32)` (round to nearest, or stochastically), and its gradient restored.

    If the optimizer raises, params, gradients and state are restored as they were."""
    swapped = []  # (param, its own data, its own grad or None, {state key: original tensor})
    replaced = []  # (group, index, param, its fp32 stand-in): DTensor params (a sharded run)
    done = False
    try:
        for group in optimizer.param_groups:
            for index, p in enumerate(group["params"]):
                if p.grad is None or not select(p):
                    continue
                if is_dtensor(p) and p.dtype != torch.float32:
                    _stand_in(optimizer, group, index, p, replaced)
                else:
                    _swap_in_fp32(optimizer, p, swapped)
        (step_fn or optimizer.step)()
        done = True
    finally:
        for group, index, p, stand_in, originals in replaced:
            _put_back_stand_in(optimizer, group, index, p, stand_in, done, store)
            swapped.append((p, None, originals))
        for p, own, originals in swapped:
            _put_back(optimizer, p, own, originals, done, store, state_dtype, round_state)


def _stand_in(optimizer, group: dict, index: int, p: torch.Tensor, replaced: list) -> None:
    """A DTensor's type cannot change under it (`.data =` keeps bf16): an fp32 stand-in takes
    its place in `group`, its gradient and its state for the step (noted in `replaced`)."""
    stand_in = torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad)
    stand_in.grad = p.grad.to(torch.float32)
    originals: dict = {}
    state = optimizer.state.pop(p, None)
    if state is not None:
        _state_in_fp32(state, p, originals)
        optimizer.state[stand_in] = state
    group["params"][index] = stand_in
    replaced.append((group, index, p, stand_in, originals))


def _swap_in_fp32(optimizer, p: torch.Tensor, swapped: list) -> None:
    """A 16-bit param's data and gradient replaced by fp32 copies (the param object stays), and
    its param-shaped state; noted in `swapped` before its state is, so that a failure half-way
    is undone."""
    data, grad = p.data, p.grad
    originals: dict = {}
    own = None
    if p.dtype != torch.float32:
        own = (data, grad)
        p.grad = None
        p.data = data.to(torch.float32)
        p.grad = grad.to(torch.float32)
    swapped.append((p, own, originals))
    _state_in_fp32(optimizer.state.get(p), p, originals)


def _state_in_fp32(state: Optional[dict], p: torch.Tensor, originals: dict) -> None:
    """`p`'s param-shaped state tensors that are not fp32 replaced by fp32 copies, the originals
    kept in `originals` by key (`step` and fp32 state are left as they are)."""
    for key, value in (state or {}).items():
        if param_shaped(key, value, p) and value.dtype != torch.float32:
            originals[key] = value
            state[key] = value.to(torch.float32)


def _put_back_stand_in(
    optimizer, group: dict, index: int, p: torch.Tensor, stand_in, done: bool, store: Callable
) -> None:
    """The DTensor back in its place with its state, the stand-in's fp32 result stored into it
    where the step ran (`done`)."""
    group["params"][index] = p
    state = optimizer.state.pop(stand_in, None)
    if state is not None:
        optimizer.state[p] = state
    if done:
        with torch.no_grad():
            store(p, p.detach(), stand_in.detach())


def _put_back(
    optimizer,
    p: torch.Tensor,
    own: Optional[tuple],
    originals: dict,
    done: bool,
    store: Callable,
    state_dtype: Optional[torch.dtype],
    round_state: Optional[Callable],
) -> None:
    """A swapped param's own data and gradient back (its fp32 result stored into the data where
    the step ran), and its state written back into its own tensors in their own types; state the
    step created, stored in `state_dtype` (None: the param's)."""
    if own is not None:
        data, grad = own
        if done:
            store(p, data, p.data)
        p.grad = None
        p.data = data
        p.grad = grad
    state: Optional[dict] = optimizer.state.get(p)
    if state is None:
        return
    for key, value in list(state.items()):
        if key in originals:
            original = originals[key]
            if done and value is not original:
                original.copy_(_stored(p, key, value, original.dtype, round_state))
            state[key] = original
        elif done and param_shaped(key, value, p):
            dtype = state_dtype or p.dtype
            if value.dtype != dtype:
                state[key] = _stored(p, key, value, dtype, round_state)


def _stored(
    param: torch.Tensor,
    key: str,
    value: torch.Tensor,
    dtype: torch.dtype,
    round_state: Optional[Callable],
) -> torch.Tensor:
    """`value` (fp32) in `dtype`: rounded by `round_state` for bf16 where given, else to
    nearest."""
    if round_state is not None and dtype == torch.bfloat16 and value.dtype == torch.float32:
        return round_state(param, key, value)
    return value.to(dtype)


def float_state_step(
    optimizer: torch.optim.Optimizer,
    state_dtype: torch.dtype,
    step_fn: Optional[Callable[[], Any]] = None,
) -> None:
    """The optimizer's step with its state stored in `state_dtype` (see the module docstring):
    the params not of that type are stepped in fp32 and stored back rounded to nearest."""
    step_in_fp32(
        optimizer,
        lambda p: p.dtype != state_dtype,
        lambda p, data, fp32: data.copy_(fp32),
        state_dtype,
        step_fn,
    )


_STATE_CLASSES = {"8bit": "OptimState8bit", "4bit": "OptimState4bit", "Fp8": "OptimStateFp8"}


def quantised_class(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Optional[str]:
    """The class name of the quantised state a low-bit `optimizer` keeps for `param`, or None
    where its state is a plain tensor (any other optimizer; a small or odd-sized param)."""
    if not is_low_bit(optimizer):
        return None
    if not quantised(param.numel(), getattr(optimizer, "block_size", 0)):
        return None
    name = type(optimizer).__name__
    return next((cls for key, cls in _STATE_CLASSES.items() if name.endswith(key)), None)


def state_format_differences(saved: dict, optimizer: torch.optim.Optimizer) -> list[str]:
    """How a checkpoint's optimizer state differs in format from what `optimizer` keeps (a
    run with another `optimizer_state`): quantised state of one class where this optimizer
    keeps another class or plain tensors, and the reverse. [] when they match."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = []
    for index, entry in saved.get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            continue
        wanted = quantised_class(optimizer, params[index])
        for key, value in entry.items():
            if key == "step" or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            have = None if type(value) is torch.Tensor else type(value).__name__
            if have != wanted:
                out.append(
                    f"optimizer.state.{index}.{key}: {have or 'a plain tensor'} -> "
                    f"{wanted or 'a plain tensor'} (another precision.optimizer_state)"
                )
                break
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """`optimizer.load_state_dict(saved)`, then each plain state tensor back in the type it was
    saved in: torch's loader casts floating state to its param's type (bf16 state of fp32
    masters would come back fp32, fp32 state of bf16 weights bf16), and the state's format is
    what the checkpoint holds."""
    optimizer.load_state_dict(saved)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in saved.get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            continue
        state = optimizer.state.get(params[index])
        if not state:
            continue
        for key, value in entry.items():
            now = state.get(key)
            if (
                type(value) is torch.Tensor
                and type(now) is torch.Tensor
                and value.is_floating_point()
                and now.dtype != value.dtype
            ):
                state[key] = now.to(value.dtype)
