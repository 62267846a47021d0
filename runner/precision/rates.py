"""Learning rates on the device: each param group's rate also as a 0-dim float64 tensor that the
fused kernels (runner.precision.fused) read when the step runs, so that a step captured in a CUDA
graph (`trainer.cuda_graphs`) replays with the rate the group has now, and a schedule that sets a
new rate at every step (cosine) needs no new capture. Opt-in per optimizer (`live_rates`); the
group's `lr` stays the Python number everything else reads.
"""

from __future__ import annotations

from typing import Optional

import torch


class LiveRates:
    """Each param group's learning rate kept on the device too, where the kernels read it when
    the step runs (`live_rates`): a step captured in a CUDA graph then replays with the rate
    the group has now, with no capture per rate (a schedule that sets one at every step). A
    group's `lr` stays the Python number that schedulers write and state_dict, checkpoints and
    logs read; its tensor (0-dim float64, the same number) follows it at `refresh`, eagerly and
    with no host read, and also at each step the kernels take outside a capture."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._rates: dict[int, tuple[dict, torch.Tensor, float]] = {}  # id(group) -> ...

    def rate(self, group: dict, device: torch.device) -> torch.Tensor:
        """The group's rate on `device`, made (or set) here from its number where it is not
        yet; never inside a capture, which would record the write and replay it."""
        if device.type == "cuda" and device.index is None:  # ("cuda": the current device's)
            device = torch.device("cuda", torch.cuda.current_device())
        value = float(group["lr"])
        entry = self._rates.get(id(group))
        if entry is not None and entry[0] is group and entry[1].device == device:
            if entry[2] != value:
                self._set(group, entry[1], value)
            return entry[1]
        _refuse_in_capture(device)
        tensor = torch.full((), value, dtype=torch.float64, device=device)
        self._rates[id(group)] = (group, tensor, value)
        return tensor

    def refresh(self) -> None:
        """Every group's tensor set from its number where the number changed."""
        for group in self.optimizer.param_groups:
            entry = self._rates.get(id(group))
            if entry is not None and entry[0] is group and entry[2] != float(group["lr"]):
                self._set(group, entry[1], float(group["lr"]))

    def covers(self) -> bool:
        """Whether the kernels read every group's rate from its tensor (they stepped them all)."""
        return all(
            (entry := self._rates.get(id(g))) is not None and entry[0] is g
            for g in self.optimizer.param_groups
        )

    def _set(self, group: dict, tensor: torch.Tensor, value: float) -> None:
        _refuse_in_capture(tensor.device)
        tensor.fill_(value)
        self._rates[id(group)] = (group, tensor, value)


def _refuse_in_capture(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a learning rate changed or appeared while the step is captured: LiveRates.refresh "
            "sets the rates before a capture or replay"
        )


def live_rates(optimizer: torch.optim.Optimizer) -> LiveRates:
    """The optimizer's `LiveRates`, made at the first call: from then on the kernels read its
    groups' learning rates from the device (torch's own steps read the numbers as ever)."""
    rates = getattr(optimizer, _RATES, None)
    if rates is None:
        rates = LiveRates(optimizer)
        setattr(optimizer, _RATES, rates)
    return rates


_RATES = "_amp_runner_live_rates"


def rate_of(optimizer, group: dict, device: torch.device) -> Optional[torch.Tensor]:
    """The group's rate tensor where the optimizer keeps its rates live, else None (the kernels
    take the number)."""
    rates = getattr(optimizer, _RATES, None)
    return None if rates is None else rates.rate(group, device)
