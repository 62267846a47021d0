"""Fused optimizer steps: torch.optim's SGD, Adam and AdamW param groups run by the kernels.

The optimizer object stays torch's own: its `param_groups` (hyperparameters, as LR schedulers
edit them) are read at every step and its `state` is kept in torch's layout (`momentum_buffer`;
`step` as a 0-dim fp32 tensor on the params' device, as torch's fused optimizers keep it,
`exp_avg`, `exp_avg_sq`), so `state_dict()`, checkpoints and schedulers work unchanged and a
run can move between the fused and the torch path. One kernel
pass reads each gradient (16-bit model gradients directly, times a multiplier that folds in the
inverse loss scale and the clipping coefficient), updates the fp32 parameter and its state, and
writes the 16-bit model copy, instead of separate copy, unscale, step and copy-back passes.

Anything the kernels do not implement (amsgrad, capturable or differentiable groups, tensor
learning rates, sparse or non-dense gradients, 16-bit parameters, a subclass with its own `step`)
makes `plan` return None, and the engine takes torch's path for that step.

Stochastic rounding (`Rounding`): bf16 parameters without fp32 masters are updated in place by the
`*_step_sr` kernels, which compute in fp32 and store each parameter rounded up or down at random
(`runner.precision.rounding`); `plan(..., param_dtype=torch.bfloat16)` plans them, and `apply`
with a `Rounding` runs them (no model copies: the parameter is the model's own).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from runner.csrc import Kernels
from runner.precision import rates

FUSED_TYPES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class Rounding:
    """A stochastically rounded step's random key: the run's seed, the step's number (restored on
    resume) and each param's tensor id (`rounding.tensor_ids`)."""

    seed: int
    step: int
    ids: Mapping[int, int]  # id(param) -> its index in the optimizer's flattened param list


@dataclass
class GroupPlan:
    """One param group's work: the fp32 params with a gradient, the gradients to read, and the
    16-bit model parameters to write (the param itself where it is the model's own fp32 param:
    the kernels skip writing a param onto itself)."""

    group: dict
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    copies: list[torch.Tensor]
    # a prepared group's kernel arguments kept from step to step (`Layout`); None: made anew
    kept: Optional[dict] = None


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the kernels implement this optimizer's update for every group."""
    if type(optimizer) not in FUSED_TYPES:
        return False
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return False
        if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group.get("betas", ())):
            return False
    return True


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dense(t: torch.Tensor) -> bool:
    """Contiguous, or channels_last (4-D) / channels_last_3d (5-D): no gaps, no overlaps."""
    if t.is_contiguous():
        return True
    dim = t.dim()
    return (dim == 4 and t.is_contiguous(memory_format=torch.channels_last)) or (
        dim == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)
    )


def _partners(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernels can run elementwise over `a` and `b` together: both on `device`,
    16/32-bit floating, dense, same shape and the same memory layout (checked per step, so in
    the order that rejects nothing of a normal step soonest: cheap attributes first)."""
    return (
        a.device == device
        and b.device == device
        and a.dtype in _KERNEL_DTYPES
        and b.dtype in _KERNEL_DTYPES
        and a.shape == b.shape
        and not a.is_sparse
        and not b.is_sparse
        and _dense(a)
        and (a.numel() <= 1 or a.stride() == b.stride())
    )


def kernel_compatible(
    src: list[torch.Tensor], dst: list[torch.Tensor], device: torch.device
) -> bool:
    """Whether one kernel call can take these partner lists (see `_partners`)."""
    return len(src) == len(dst) and all(_partners(a, b, device) for a, b in zip(src, dst))


def plan(
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    grad_of: Callable[[torch.Tensor], Optional[torch.Tensor]],
    copy_of: Callable[[torch.Tensor], Optional[torch.Tensor]],
    param_dtype: torch.dtype = torch.float32,
    state_dtype: Optional[torch.dtype] = None,
) -> Optional[list[GroupPlan]]:
    """The step's work per group, or None when some part of it needs torch's path.

    `grad_of(param)` is the gradient to step with (None: the param has none this step);
    `copy_of(param)` the 16-bit model parameter that mirrors it, or None. Every stepped param
    must be of `param_dtype`: fp32 (masters, or an fp32 model), or bf16 for a stochastically
    rounded step (whose params are their own copies). `state_dtype` is the type the state is
    kept in (None: the params'): fp32 or bf16 (loaded to fp32 for the update, stored back rounded
    to nearest; stochastically on a rounded step), else torch's ops take the step.
    """
    if not supports(optimizer):
        return None
    if state_dtype not in (None, torch.float32, torch.bfloat16):
        return None  # (fp16 state: torch's ops, runner.precision.state)
    plans = []
    for group in optimizer.param_groups:
        params, grads, copies = [], [], []
        for p in group["params"]:
            g = grad_of(p)
            if g is None:
                continue
            if p.dtype != param_dtype or not _partners(p, g, device):
                return None
            copy = copy_of(p)
            if copy is None:
                copy = p
            elif not _partners(p, copy, device):
                return None
            params.append(p)
            grads.append(g)
            copies.append(copy)
        plans.append(GroupPlan(group, params, grads, copies))
    return plans


@dataclass
class _Prepared:
    key: tuple
    # per group: (group, params, the tensors whose .grad is read, copies, kept arguments); None:
    # some param is not the kernels' (a 16-bit param, another device, a strided view)
    groups: Optional[list[tuple[dict, list, list, list, dict]]]
    checked: bool = False  # the gradients were checked once against their params


class Layout:
    """The step's tensor lists prepared once per optimizer and kept while its param groups stay
    (the key: each group's params list and length, the state dict, the caller's `extra`), so that
    a step costs Python per group, not per param: only the gradients are collected anew (they
    are new tensors after each `zero_grad`), checked in full at the first step (autograd keeps
    each gradient's type, shape and layout its param's from then on). A step where some param
    has no gradient takes `plan`'s full path."""

    def __init__(self) -> None:
        self._prepared: dict[int, _Prepared] = {}

    def plan(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        masters: Any,
        scaled: bool,
        state_dtype: Optional[torch.dtype] = None,
    ) -> Optional[list[GroupPlan]]:
        """`plan` for fp32 params from the prepared lists: with `scaled`, the gradients are the
        model's (the 16-bit param's, where `masters` pairs the param with one), else each
        param's own; the copies are the 16-bit model params `masters` pairs them with."""
        if not supports(optimizer) or state_dtype not in (None, torch.float32, torch.bfloat16):
            return None
        groups = optimizer.param_groups
        pairs = (id(masters), len(masters)) if masters is not None else ()
        key = (id(optimizer.state), pairs, *((id(g["params"]), len(g["params"])) for g in groups))
        prep = self._prepared.get(id(optimizer))
        if prep is None or prep.key != key:
            source_of, copy_of = _mapping(masters, scaled)
            prep = _Prepared(key, _prepare(groups, device, source_of, copy_of))
            self._prepared[id(optimizer)] = prep
        if prep.groups is None:
            return None
        plans = []
        for group, params, sources, copies, kept in prep.groups:
            grads = list(map(_GRAD, sources))
            if any(map(operator.is_, grads, itertools.repeat(None))):
                return self._full(optimizer, device, masters, scaled, state_dtype)
            plans.append(GroupPlan(group, params, grads, copies, kept))
        if not prep.checked:
            if not all(
                _partners(p, g, device) for gp in plans for p, g in zip(gp.params, gp.grads)
            ):
                return self._full(optimizer, device, masters, scaled, state_dtype)
            prep.checked = True
        return plans

    @staticmethod
    def _full(optimizer, device, masters, scaled, state_dtype) -> Optional[list[GroupPlan]]:
        source_of, copy_of = _mapping(masters, scaled)
        return plan(
            optimizer, device, lambda p: source_of(p).grad, copy_of, state_dtype=state_dtype
        )


def _mapping(masters: Any, scaled: bool) -> tuple[Callable, Callable]:
    """(the tensor whose .grad steps a param, its 16-bit copy or None) under `masters`."""
    model_of = masters.model_of() if masters is not None else {}
    if scaled:
        return (lambda p: model_of.get(id(p), p)), (lambda p: model_of.get(id(p)))
    return (lambda p: p), (lambda p: model_of.get(id(p)))


_GRAD = operator.attrgetter("grad")


def _prepare(groups: list[dict], device, source_of, copy_of) -> Optional[list[tuple]]:
    out = []
    for group in groups:
        params, sources, copies = [], [], []
        for p in group["params"]:
            copy = copy_of(p)
            if copy is None:
                copy = p
            if p.dtype != torch.float32 or not _partners(p, copy, device):
                return None
            params.append(p)
            sources.append(source_of(p))
            copies.append(copy)
        out.append((group, params, sources, copies, {}))
    return out


def gradients(plans: list[GroupPlan]) -> list[torch.Tensor]:
    return [g for gp in plans for g in gp.grads]


def _buckets(n: int, key) -> list[list[int]]:
    """Indices 0..n-1 grouped by `key(i)` (a step number, a first-run flag): one kernel call
    each, in first-seen order."""
    buckets: dict = {}
    for i in range(n):
        buckets.setdefault(key(i), []).append(i)
    return list(buckets.values())


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps `step` in float32 unless the default dtype is float64
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def apply(
    kernels: Kernels,
    optimizer: torch.optim.Optimizer,
    plans: list[GroupPlan],
    grad_scale: torch.Tensor,
    rounding: Optional[Rounding] = None,
    state_dtype: Optional[torch.dtype] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """One step of every group: params -= update(grads * grad_scale), model copies written (or,
    with `rounding`, bf16 params stored stochastically rounded). State created here (a first
    step) is of `state_dtype` (None: the param's, as torch creates it).

    `found_inf` (a one-element device flag, non-zero: the gradients overflowed) makes the
    kernels skip the whole update on the device, as torch's fused optimizers skip on theirs: no
    host read. Adam's step counters (`state["step"]`, fp32 tensors on the params' device, as
    torch's fused and capturable optimizers keep them) advance on the device, and not on a
    skipped step; the kernels take the bias corrections from them. State a first step creates is
    zeros (a momentum buffer too: zero times the momentum plus the gradient is the gradient,
    torch's first-step value), so a skipped first step leaves it as a step never taken."""
    adam = isinstance(optimizer, torch.optim.Adam)  # AdamW is an Adam in torch >= 2.6
    for gp in plans:
        if not gp.params:
            continue
        if adam:
            _adam(kernels, optimizer, gp, grad_scale, rounding, state_dtype, found_inf)
        else:
            _sgd(kernels, optimizer, gp, grad_scale, rounding, state_dtype, found_inf)
    # What torch's LR-scheduler wrapper of `optimizer.step` records: the optimizer has stepped.
    optimizer._opt_called = True  # type: ignore[attr-defined]


def _counters(optimizer, params: list, steps: list[torch.Tensor]) -> torch.Tensor:
    """A group's Adam step counters as one 1-D tensor whose elements the state's `step` entries
    become (0-dim views: same values, device, type; torch's steps update them in place): one add
    advances them all and the kernels read it as it is, no per-tensor add and stack per step."""
    dtype = steps[0].dtype if all(s.dtype == steps[0].dtype for s in steps) else _scalar_dtype()
    flat = torch.stack([s.to(dtype) for s in steps])
    for i, p in enumerate(params):
        optimizer.state[p]["step"] = flat[i]
    return flat


def _keep(optimizer, params: list, lists: tuple) -> tuple:
    """State lists kept for the next steps, with what tells whether they still hold: the state
    dict and its size (a load replaces the dict; the entries of one dict are kept by torch and
    by the other paths, which update their tensors in place)."""
    return (lists, optimizer.state, len(optimizer.state))


def _still(kept: tuple, optimizer, params: list) -> bool:
    _, state, size = kept
    return state is optimizer.state and size == len(state)


def _pick(items: list, idx: list[int]) -> list:
    return [items[i] for i in idx]


def _sgd(
    kernels,
    optimizer,
    gp: GroupPlan,
    grad_scale,
    rounding: Optional[Rounding],
    state_dtype: Optional[torch.dtype] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    g = gp.group
    momentum = g["momentum"]
    # A new buffer starts as zeros and takes the ordinary update (momentum * 0 + gradient: the
    # gradient, exactly), so a step the device skips leaves it as if never taken. With
    # dampening the ordinary update would damp the first gradient, which torch does not: those
    # buffers start from the kernels' first-run branch, and a flagged step is decided on the host.
    first_run = momentum != 0 and g["dampening"] != 0
    if first_run and found_inf is not None and bool(found_inf.item()):
        return  # (an SGD with dampening, whose first step overflowed: nothing to do)
    first = [False] * len(gp.params)
    bufs: list[torch.Tensor] = []
    kept = gp.kept.get("sgd") if gp.kept is not None and momentum != 0 else None
    if kept is not None and _still(kept, optimizer, gp.params):
        bufs = kept[0]
    elif momentum != 0:
        for i, p in enumerate(gp.params):
            state = optimizer.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                dtype = state_dtype or p.dtype
                if first_run:  # the kernel writes it whole
                    buf = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    first[i] = True
                else:
                    buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["momentum_buffer"] = buf
            bufs.append(buf)
        if gp.kept is not None:
            gp.kept["sgd"] = _keep(optimizer, gp.params, bufs)
    hyper = (
        float(g["lr"]),
        float(g["weight_decay"]),
        float(momentum),
        float(g["dampening"]),
        bool(g["nesterov"]),
        bool(g.get("maximize", False)),
    )
    for idx in _buckets(len(gp.params), lambda i: first[i]) if first_run else [None]:
        params = gp.params if idx is None else _pick(gp.params, idx)
        grads = gp.grads if idx is None else _pick(gp.grads, idx)
        momenta = (bufs if idx is None else _pick(bufs, idx)) if bufs else []
        is_first = first[idx[0]] if idx is not None else False
        if rounding is None:
            kernels.ops.sgd_step(
                params,
                grads,
                momenta,
                gp.copies if idx is None else _pick(gp.copies, idx),
                grad_scale,
                found_inf,
                *hyper,
                is_first,
                lr_tensor=rates.rate_of(optimizer, g, params[0].device),
            )
        else:
            kernels.ops.sgd_step_sr(
                params,
                grads,
                momenta,
                grad_scale,
                found_inf,
                *hyper,
                is_first,
                rounding.seed,
                rounding.step,
                [rounding.ids[id(p)] for p in params],
            )


def _adam(
    kernels,
    optimizer,
    gp: GroupPlan,
    grad_scale,
    rounding: Optional[Rounding],
    state_dtype: Optional[torch.dtype],
    found_inf: Optional[torch.Tensor],
) -> None:
    g = gp.group
    beta1, beta2 = (float(b) for b in g["betas"])
    decoupled = bool(g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    exp_avgs, exp_avg_sqs, counters, steps = _adam_state(optimizer, gp, state_dtype)
    numbers = _advance_steps(counters, steps, found_inf)
    hyper = (
        float(g["lr"]),
        beta1,
        beta2,
        float(g["eps"]),
        float(g["weight_decay"]),
        1.0,  # (the bias corrections come from `numbers`)
        1.0,
        decoupled,
        bool(g.get("maximize", False)),
    )
    moments = (exp_avgs, exp_avg_sqs)
    if rounding is None:
        kernels.ops.adam_step(
            gp.params,
            gp.grads,
            *moments,
            gp.copies,
            grad_scale,
            found_inf,
            *hyper,
            steps=numbers,
            lr_tensor=rates.rate_of(optimizer, g, gp.params[0].device),
        )
    else:
        kernels.ops.adam_step_sr(
            gp.params,
            gp.grads,
            *moments,
            grad_scale,
            found_inf,
            *hyper,
            rounding.seed,
            rounding.step,
            [rounding.ids[id(p)] for p in gp.params],
            steps=numbers,
        )


def _adam_state(
    optimizer, gp: GroupPlan, state_dtype: Optional[torch.dtype]
) -> tuple[list, list, Optional[torch.Tensor], list]:
    """(exp_avgs, exp_avg_sqs, counters, steps): kept from the step before where they still hold
    (the step counters in one tensor), else the optimizer's state, made as torch makes it where a
    parameter has none (its counter on the device) and kept where the group keeps any."""
    kept = gp.kept.get("adam") if gp.kept is not None else None
    if kept is not None and _still(kept, optimizer, gp.params):
        exp_avgs, exp_avg_sqs, counters = kept[0]
        return exp_avgs, exp_avg_sqs, counters, []
    exp_avgs, exp_avg_sqs, steps = [], [], []
    for p in gp.params:
        state = optimizer.state[p]
        if len(state) == 0:  # torch's lazy initialisation, same keys; the counter on the device
            state["step"] = torch.zeros((), dtype=_scalar_dtype(), device=p.device)
            dtype = state_dtype or p.dtype
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # torch's CPU counter (its own step, a resume)
            state["step"] = state["step"].to(p.device)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    counters = _counters(optimizer, gp.params, steps) if gp.kept is not None else None
    if counters is not None:  # (the group's counters in one tensor)
        gp.kept["adam"] = _keep(optimizer, gp.params, (exp_avgs, exp_avg_sqs, counters))
    return exp_avgs, exp_avg_sqs, counters, steps


def _advance_steps(
    counters: Optional[torch.Tensor], steps: list, found_inf: Optional[torch.Tensor]
) -> torch.Tensor:
    """The step counters (`counters`, else each of `steps`) advanced by one on the device (by 0 on
    a step `found_inf` flags), as the fp32 the kernels read their bias corrections from."""
    if counters is not None:  # (a skipped step adds 0)
        counters.add_(1 if found_inf is None else found_inf.eq(0))
        return counters if counters.dtype == torch.float32 else counters.to(torch.float32)
    advance = (  # (a list, whose CPU kernel reads no scalar)
        torch.ones((), dtype=torch.float32, device=steps[0].device)
        if found_inf is None
        else found_inf.reshape(()).eq(0).to(torch.float32)
    )
    torch._foreach_add_(steps, [advance] * len(steps))
    return torch.stack(steps).to(torch.float32)  # read by the kernels, on the device
