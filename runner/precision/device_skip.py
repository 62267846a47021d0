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
step (allocated and freed by it, when the forward's activations are gone), so memory holds one
more copy of the stepped params and their state for that moment, and the step launches one
`where` per copied tensor. The optimizer's `step` is called on a skipped step too, so its step
hooks run, as they do for torch's fused optimizers handed a set flag.

Step counters the host keeps (torch's Adam and AdamW keep `state["step"]` as a CPU tensor unless
`capturable` or `fused`) cannot be undone on the device: on an accelerator they are moved there
(as the kernels keep them) and their groups step as `capturable` (torch's own algorithm for
counters on the device), for the guarded step only.

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
    """Step counters the host keeps, moved to `device` (an accelerator's; a CPU's counters are on
    the params' device already), where `guarded_step` steps their groups as `capturable`."""
    if device.type == "cpu":
        return
    for group in _host_counted(optimizer, device):
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if torch.is_tensor(step) and step.device != p.device:
                state["step"] = step.to(p.device)


def _host_counted(optimizer: torch.optim.Optimizer, device: torch.device) -> list[dict]:
    """The groups on an accelerator whose optimizer reads its step counters on the host (not
    `capturable`, not `fused`): for one guarded step they are made `capturable`."""
    if device.type == "cpu":
        return []
    return [
        group
        for group in optimizer.param_groups
        if group.get("capturable") is False
        and not group.get("fused")
        and not group.get("differentiable")
    ]


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


def _snapshot(optimizer: torch.optim.Optimizer) -> tuple[list, list, list, list]:
    """(the live tensors, their copies, per stepped param (param, its state dict or None, the
    entries as they are), the non-tensor entries with their values)."""
    live: list[torch.Tensor] = []
    entries: list[tuple[torch.Tensor, Optional[dict], tuple]] = []
    others: list[tuple[dict, str, Any]] = []
    states = optimizer.state
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            live.append(p)
            state = states.get(p)
            before = tuple(state.items()) if state else ()
            entries.append((p, state, before))
            for key, value in before:
                if isinstance(value, torch.Tensor):
                    live.append(value)
                else:
                    others.append((state, key, value))
    # one multi-tensor pass, bitwise (torch._foreach_clone is newer than torch 2.11)
    copies = [torch.empty_like(t) for t in live]
    if live:
        torch._foreach_copy_(copies, live)
    return live, copies, entries, others


@torch.no_grad()
def guarded_step(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, run: Callable[[], Any]
) -> Optional[str]:
    """`run()` (the optimizer's step), undone on the device where `found_inf` is non-zero.

    Returns None (no host read), or what made the step need the host's verdict (`NEW_STATE`, a
    replaced state tensor, a changed non-tensor entry): then the flag was read, and on an
    overflow everything was put back as it was."""
    live, copies, entries, others = _snapshot(optimizer)
    # torch's algorithm for counters on the device, for this step only: the groups stay as the
    # user made them (their state_dict, the kernels' choice, which takes no capturable group)
    flipped = _host_counted(optimizer, found_inf.device)
    for group in flipped:
        group["capturable"] = True
    try:
        run()
    finally:
        for group in flipped:
            group["capturable"] = False
    skip = found_inf.reshape(()) != 0
    changed = _changed_shape(optimizer, entries, others)
    if changed is not None:
        if bool(skip.item()):  # (one read: this step made new state)
            _put_back(live, copies)
            states = optimizer.state
            for p, _, before in entries:
                state = states.get(p)
                if state is not None:
                    state.clear()
                    state.update(before)
                    if not before:
                        del states[p]
        return changed
    for new, old in zip(live, copies):
        torch.where(skip, old, new, out=new)
    return None


NEW_STATE = "a step that creates optimizer state"


def _changed_shape(optimizer, entries: list, others: list) -> Optional[str]:
    """What the step made of the state that the copies do not cover (None: nothing): new
    entries, a state tensor replaced by another, a non-tensor entry changed."""
    states = optimizer.state
    for p, _, before in entries:
        state = states.get(p)
        if state is None or len(state) != len(before):
            if state or before:
                return NEW_STATE
            continue
        for key, value in before:
            if isinstance(value, torch.Tensor) and state.get(key) is not value:
                return f"a step that replaces its state tensor '{key}'"
    for state, key, value in others:
        if state.get(key) != value:
            return f"a step that changes its state entry '{key}', not a tensor"
    return None


def _put_back(live: list, copies: list) -> None:
    for new, old in zip(live, copies):
        new.copy_(old)
