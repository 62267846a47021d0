"""An optimizer's own step skipped on a device-side overflow flag, with no host read.

The kernels and torch's fused optimizers skip an overflowing update on the device themselves. Any
other optimizer's `step` (torch's unfused SGD, Adam and AdamW under `precision.kernels=torch`, an
option the kernels do not implement such as `amsgrad`, the 16-bit weights of O3 with a dynamic
scale) knows nothing of the flag. `guarded_step` runs such a step unconditionally and then undoes
it on the device where the flag is set: every tensor the step may change (each param with a
gradient and the tensors of its optimizer state) is copied first, and after the step each is
put back with `torch.where(flag, copy, new)`, elementwise and exact (an inf or NaN the update
wrote is discarded, not multiplied by zero). A skipped step so leaves the params and the state
bit for bit as they were, as the host's verdict would have. The copies exist only during the
step (allocated and freed by it: the forward's activations are gone by then), so memory holds
one more copy of the stepped params and their state for that moment.

Step counters the host keeps (torch's Adam and AdamW keep `state["step"]` as a CPU tensor unless
`capturable` or `fused`) cannot be undone on the device: on an accelerator such groups are made
`capturable` (torch's own algorithm for counters on the device), their counters moved there.

What cannot be undone on the device is decided on the host, as before (one read): a step that
creates optimizer state (the first step of Adam, or of SGD with momentum: state created by a
step that then proves skipped is dropped again, so the state stays as never stepped), a step
that replaces a state tensor or changes a non-tensor entry, state on another device, a tensor
subclass (a sharded DTensor, a low-bit optimizer's quantised state), a closure. `reason` says
which; the path logs it once per optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch


def prepare(optimizer: torch.optim.Optimizer, device: torch.device, args: tuple) -> Optional[str]:
    """Ready the optimizer for `guarded_step` on `device` (host-kept step counters moved there);
    returns why its step cannot be undone on the device, None where it can."""
    _counters_to_device(optimizer, device)
    return reason(optimizer, device, args)


def _counters_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Groups whose step counters the host keeps, made `capturable` with counters on `device`
    (an accelerator's; a CPU's counters are on the params' device already)."""
    if device.type == "cpu":
        return
    for group in optimizer.param_groups:
        if "capturable" not in group or group["capturable"]:
            continue
        if group.get("fused") or group.get("differentiable"):
            continue
        group["capturable"] = True
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if torch.is_tensor(step) and step.device != p.device:
                state["step"] = step.to(p.device)


def reason(optimizer: torch.optim.Optimizer, device: torch.device, args: tuple) -> Optional[str]:
    """Why this step cannot be undone on `device` (None: it can, once state exists)."""
    if args:
        return "a step with a closure or arguments"
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.device != device:
                return f"a param on {p.device}, the overflow flag on {device}"
            if not _plain(p):
                return f"a {type(p).__name__} param"
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.device != device:
                    return f"optimizer state '{key}' on {value.device}, not on {device}"
                if torch.is_tensor(value) and not _plain(value):
                    return f"optimizer state '{key}' kept as a {type(value).__name__}"
    return None


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor (or Parameter): not a subclass (a sharded DTensor, a low-bit optimizer's
    quantised state), whose copy and `torch.where` the copies could not be trusted with."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _snapshot(optimizer: torch.optim.Optimizer) -> tuple[list, list, dict, list]:
    """(the live tensors, their copies, each stepped param's state entries as they are, the
    non-tensor entries with their values)."""
    live: list[torch.Tensor] = []
    entries: dict[torch.Tensor, dict[str, Any]] = {}
    others: list[tuple[dict, str, Any]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            live.append(p)
            state = optimizer.state.get(p)
            entries[p] = dict(state) if state else {}
            for key, value in entries[p].items():
                if torch.is_tensor(value):
                    live.append(value)
                else:
                    others.append((state, key, value))
    with torch.no_grad():
        copies = [t.detach().clone(memory_format=torch.preserve_format) for t in live]
    return live, copies, entries, others


@torch.no_grad()
def guarded_step(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, run: Callable[[], Any]
) -> bool:
    """`run()` (the optimizer's step), undone on the device where `found_inf` is non-zero.

    Returns False when the step needed the host's verdict (it created or replaced state, or
    changed a non-tensor entry): the flag was read, and on an overflow everything was put back
    as it was. True: no host read."""
    live, copies, entries, others = _snapshot(optimizer)
    run()
    skip = found_inf.reshape(()) != 0
    if _changed_shape(optimizer, entries, others):
        if bool(skip.item()):  # (one read: this step made new state)
            _put_back(live, copies)
            for p, before in entries.items():
                state = optimizer.state.get(p)
                if state is not None:
                    state.clear()
                    state.update(before)
                    if not before:
                        del optimizer.state[p]
        return False
    for new, old in zip(live, copies):
        torch.where(skip, old, new, out=new)
    return True


def _changed_shape(optimizer, entries: dict, others: list) -> bool:
    """Whether the step made state the copies do not cover: new entries, a state tensor
    replaced by another, a non-tensor entry changed."""
    for p, before in entries.items():
        state = optimizer.state.get(p) or {}
        if state.keys() != before.keys():
            return True
        if any(state[k] is not v for k, v in before.items() if torch.is_tensor(v)):
            return True
    return any(state.get(key) != value for state, key, value in others)


def _put_back(live: list, copies: list) -> None:
    for new, old in zip(live, copies):
        new.copy_(old)
