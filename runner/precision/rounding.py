"""Stochastic rounding to bf16, for bf16 training without fp32 master weights.

Why: bf16 keeps 8 significant bits, so neighbouring bf16 values are 2^-8 to 2^-7 of the value
apart. A weight stored in bf16 and updated with round to nearest loses every update smaller than
half of that spacing, every step: lr * grad at 1/10 of the spacing leaves the weight where it is
forever. Rounded stochastically -- up to the next bf16 value with probability (distance to the
lower neighbour) / (spacing), else down -- the stored weight equals the exact fp32 result on
average (unbiased), so small updates accumulate in expectation, and training without fp32
masters tracks training with them far better (at the cost of some noise, about half a spacing).

What is seeded how: the random bits of element `i` (its index in memory order) of the tensor with
id `tensor_id` at step `step` under `seed` are a pure function of those four numbers, defined in
`runner/csrc/step_math.h` (a counter-based hash, lowbias32 rounds) and written here in torch
integer ops bit for bit. Nothing is drawn from a generator's state, so the bits do not depend on
threads, kernel launch geometry or the order of tensors in a call, and a resumed run draws
exactly what the uninterrupted run would have drawn, given the same `step` numbering. The C++
and CUDA kernels (`stochastic_round`, `sgd_step_sr`, `adam_step_sr`) and the functions here round
the same fp32 value to the same bf16 value.

For callers: `seed` is the run's seed, in [0, 2^64); `step` counts optimizer steps and must be
restored on resume (the checkpointed step counter), in [0, 2^64); `tensor_id` is a param's index
in its optimizer's flattened param list (`tensor_ids`), in [0, 2^32). Under data parallelism
every rank passes the same three numbers (no rank in the seed), so the replicas round alike and
stay identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from runner.precision.state import is_dtensor, local_shard, step_in_fp32

_MASK32 = 0xFFFFFFFF
_MIX_C1 = 0x7FEB352D
_MIX_C2 = 0x846CA68B
_SEED_SALT = 0x9E3779B9
_K2_SALT = 0x85EBCA6B


# ---- the random source (integers, then torch int64 tensors holding uint32 values) ----------
def _mix_int(x: int) -> int:
    """lowbias32 on a Python int in [0, 2^32)."""
    x ^= x >> 16
    x = (x * _MIX_C1) & _MASK32
    x ^= x >> 15
    x = (x * _MIX_C2) & _MASK32
    x ^= x >> 16
    return x


def _check_range(name: str, value, limit_bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << limit_bits:
        raise ValueError(
            f"stochastic rounding: {name}={value!r}; an integer in [0, 2^{limit_bits}) is expected"
        )
    return value


_STREAM_SALT = 0x5BD1E995
# the streams of a param's optimizer state, as the kernels number them (others: 3, 4, ...)
STATE_STREAMS = {"momentum_buffer": 1, "exp_avg": 1, "exp_avg_sq": 2}


def sr_key(seed: int, step: int, tensor_id: int, stream: int = 0) -> tuple[int, int]:
    """The (k1, k2) key of one tensor at one step, as `sr_key` in step_math.h computes it;
    `stream` s >= 1: the key of its optimizer state's stream s (`sr_stream`)."""
    seed = _check_range("seed", seed, 64)
    step = _check_range("step", step, 64)
    tensor_id = _check_range("tensor_id", tensor_id, 32)
    stream = _check_range("stream", stream, 32)
    h = _mix_int((seed & _MASK32) ^ _SEED_SALT)
    h = _mix_int(h ^ (seed >> 32))
    h = _mix_int(h ^ (step & _MASK32))
    h = _mix_int(h ^ (step >> 32))
    h = _mix_int(h ^ tensor_id)
    if stream:
        h = _mix_int(h ^ _mix_int(stream ^ _STREAM_SALT))
    return h, _mix_int(h ^ _K2_SALT)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow: c in 16-bit halves."""
    lo = x * (c & 0xFFFF)  # < 2^48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # the part of x * c_hi * 2^16 below 2^32
    return (lo + hi) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_C2)
    return x ^ (x >> 16)


def random_bits(
    seed: int, step: int, tensor_id: int, index: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """The 32 random bits of the elements at `index` (int64, memory-order element indices) of
    tensor `tensor_id` at `step` under `seed`, as int64 values in [0, 2^32); the rounding uses
    the top 16 (`bits >> 16`)."""
    k1, k2 = sr_key(seed, step, tensor_id, stream)
    if index.dtype != torch.int64:
        raise ValueError(f"random_bits: index must be int64, got {index.dtype}")
    lo = index & _MASK32
    hi = index >> 32
    return _mix(_mix(lo ^ k1) ^ (hi ^ k2))


# ---- rounding --------------------------------------------------------------------------------
def _is_dense(t: torch.Tensor) -> bool:
    """No gaps and no overlaps: the elements fill numel consecutive slots of memory in some
    order (contiguous, channels_last, a permutation), as the kernels require."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `t`'s elements in memory order (the order the kernels index them in)."""
    if t.layout != torch.strided or not _is_dense(t):
        raise ValueError(
            "stochastic rounding needs a dense tensor (contiguous or another dense "
            f"layout), got a {t.layout} tensor with shape {tuple(t.shape)} and "
            f"strides {tuple(t.stride()) if t.layout == torch.strided else None}"
        )
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def round_with_bits(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (int64 in [0, 2^16)) of fp32 `x` rounded with the random words `bits`
    (int64 in [0, 2^32), same shape): `sr_round_bf16` of step_math.h -- the top 16 random bits
    added to x's bit pattern, the low 16 bits cut off; NaN -> 0x7FC0; +-inf and zeros kept."""
    u = x.view(torch.int32).to(torch.int64) & _MASK32
    rounded = (u + (bits >> 16)) >> 16
    return torch.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)


def stochastic_round(
    x: torch.Tensor, seed: int, step: int, tensor_id: int, stream: int = 0
) -> torch.Tensor:
    """`x` (fp32, dense) rounded stochastically to a new bf16 tensor of the same shape and
    strides, bit for bit what the kernels' `stochastic_round` writes for the same (seed, step,
    tensor_id); `stream` >= 1 draws the bits of the tensor's optimizer state instead (what the
    kernels' rounded steps store bf16 state with).

    Each value becomes one of its two neighbouring bf16 values, the upper one (away from zero)
    with probability (|x| - lo) / (hi - lo): unbiased over the random bits. Values bf16
    represents, zeros and +-inf are unchanged, NaN becomes bf16's quiet NaN; see `sr_round_bf16`
    in step_math.h for subnormals and values beyond bf16's largest finite value. Works on any
    device (int64 temporaries of x's size: a reference and a fallback, not a fast path).
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round: x must be float32, got {x.dtype}")
    if is_dtensor(x):  # a sharded run: its shard, with its global indices
        return _round_shard(x, seed, step, tensor_id, stream)
    flat = _memory_order(x)
    index = torch.arange(flat.numel(), dtype=torch.int64, device=x.device)
    pattern = round_with_bits(flat, random_bits(seed, step, tensor_id, index, stream))
    signed = torch.where(pattern >= 1 << 15, pattern - (1 << 16), pattern).to(torch.int16)
    out = torch.empty_strided(x.shape, x.stride(), dtype=torch.bfloat16, device=x.device)
    _memory_order(out).copy_(signed.view(torch.bfloat16))
    return out


def _shard_offset(x: torch.Tensor) -> int:
    """Where a DTensor's local shard starts among the whole tensor's elements (row-major), for a
    tensor sharded on its first dimension only (FSDP2's `Shard(0)`); else a ValueError."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(
        not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0))
        for pl in x.placements
    ):
        raise ValueError(
            "stochastic rounding of a DTensor sharded on another dimension than "
            f"the first: {x.placements}"
        )
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    row = 1
    for size in x.shape[1:]:
        row *= size
    return int(offset[0]) * row if x.dim() else 0


def _round_shard(
    x: torch.Tensor, seed: int, step: int, tensor_id: int, stream: int
) -> torch.Tensor:
    """`stochastic_round` of a DTensor: each element's bits keyed by its index in the whole
    tensor, so a sharded run rounds every element as the unsharded run would."""
    from torch.distributed.tensor import DTensor

    local = x.to_local()
    flat = _memory_order(local)
    start = _shard_offset(x)
    index = torch.arange(start, start + flat.numel(), dtype=torch.int64, device=local.device)
    pattern = round_with_bits(flat, random_bits(seed, step, tensor_id, index, stream))
    signed = torch.where(pattern >= 1 << 15, pattern - (1 << 16), pattern).to(torch.int16)
    out = torch.empty_strided(
        local.shape, local.stride(), dtype=torch.bfloat16, device=local.device
    )
    _memory_order(out).copy_(signed.view(torch.bfloat16))
    return DTensor.from_local(out, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())


# ---- any torch.optim optimizer ---------------------------------------------------------------
def tensor_ids(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """`id(param)` -> the param's index in the optimizer's flattened param list (groups in
    order, params in order: the index torch's `state_dict()` gives it). Stable across runs and
    resumes as long as the model and its param groups are built the same way: the tensor id to
    pass to the kernels."""
    ids: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            ids.setdefault(id(p), len(ids))
    return ids


@torch.no_grad()
def sr_step(
    optimizer: torch.optim.Optimizer,
    seed: int,
    step: int,
    step_fn: Optional[Callable[[], Any]] = None,
    state_dtype: Optional[torch.dtype] = None,
) -> None:
    """One `optimizer.step()` in which bf16 params are updated in fp32 and stored rounded
    stochastically: the fallback for optimizers the kernels do not implement.

    Semantics, per bf16 param with a gradient (others are stepped by the optimizer as usual):
      1. the param's data, its gradient and its param-shaped floating state tensors (momentum
         buffers, moments: same shape as the param; not `step`) are replaced by fp32 copies
         (fp32 state is used as is) -- the param object, its id and its state keys stay;
      2. the optimizer's own `step()` runs once, on fp32 values;
      3. the state is written back in its original dtype (into the same tensor objects), bf16
         rounded stochastically with the state's own stream of bits (`STATE_STREAMS`: stream
         1 for the momentum buffer and exp_avg, 2 for exp_avg_sq, 3... for any other key in
         sorted order), as the kernels store it; state created by this step (a first step) is
         stored so in `state_dtype` (None: the param's dtype, the layout torch creates for a
         bf16 param, `zeros_like(param)`); `step` and other non-param-shaped entries stay as
         the optimizer left them;
      4. the param is written back into its own storage as `stochastic_round(fp32 result, seed,
         step, tensor_ids(optimizer)[id(param)])`, and its bf16 gradient is restored.
    So an SGD or Adam step through here is the kernels' `sgd_step_sr` / `adam_step_sr` up to the
    fp32 rounding differences between torch's and the kernels' arithmetic (a few ulps, which
    change a rounded bf16 value by one spacing in about 1 element of 2^16 per ulp). If the
    optimizer raises, the params, gradients and state are restored as they were.

    No closure: it would run the model on the temporary fp32 params. `step_fn` replaces
    `optimizer.step` (the Apex facade passes the optimizer's own, unwrapped step). The swap
    and restore are `runner.precision.state.step_in_fp32`'s.
    """
    ids = tensor_ids(optimizer)

    def select(p: torch.Tensor) -> bool:
        if p.dtype != torch.bfloat16:
            return False
        _memory_order(local_shard(p))  # a clear error for a param the rounding cannot
        # index (a sharded one: its shard)
        return True

    def store(param: torch.Tensor, data16: torch.Tensor, fp32: torch.Tensor) -> None:
        data16.copy_(stochastic_round(fp32, seed, step, ids[id(param)]))

    def round_state(param: torch.Tensor, key: str, fp32: torch.Tensor) -> torch.Tensor:
        state = optimizer.state[param]
        others = sorted(k for k in state if k not in STATE_STREAMS and k != "step")
        stream = STATE_STREAMS.get(key) or 3 + others.index(key)
        return stochastic_round(fp32, seed, step, ids[id(param)], stream)

    step_in_fp32(optimizer, select, store, state_dtype, step_fn, round_state)
