"""Memory by kind, counted from the tensors themselves: exact on any device, per run.

Five kinds (weights, master_weights, grads, optimizer_state, activations), each storage counted
once, in the first kind that holds it; `total` is their sum: an upper bound of what a step holds
at its fullest (what each kind counts: README.md beside this file). `MemoryInstrument` measures
the first step of a training session that steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from runner.measure.instruments import Instrument
from runner.metrics import MEM_TOTAL_MB, MEMORY_KINDS, memory_metric

MB = 2**20


def storage_key(t: torch.Tensor) -> tuple[Any, int]:
    """Identifies the memory a tensor lives in (its storage), whatever view of it this is."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no plain storage (e.g. a tensor subclass)
        return ("id", id(t))


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class StorageCounter:
    """Bytes of distinct storages: each counted once, by the first `add` that meets it."""

    def __init__(self) -> None:
        self.seen: set[tuple[Any, int]] = set()

    def add(self, tensors: Iterable[Optional[torch.Tensor]]) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if key in self.seen:
                continue
            self.seen.add(key)
            total += storage_bytes(t)
        return total


@dataclass(frozen=True)
class MemoryByKind:
    """Bytes per kind of tensor (see the module's docstring)."""

    weights: int = 0
    master_weights: int = 0
    grads: int = 0
    optimizer_state: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.master_weights
            + self.grads
            + self.optimizer_state
            + self.activations
        )

    def metrics(self) -> dict[str, float]:
        """`mem_<kind>_mb` for the five kinds and `mem_total_mb`, in MiB (2^20 bytes)."""
        out = {memory_metric(kind): getattr(self, kind) / MB for kind in MEMORY_KINDS}
        out[MEM_TOTAL_MB] = self.total / MB
        return out


def _masters(engine: Any, optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The engine's fp32 master copies for `optimizer` (none without master weights)."""
    if engine is None or optimizer is None:
        return []
    try:
        masters = engine.masters(optimizer)
    except RuntimeError:  # an optimizer the engine was not given
        return []
    return list(masters.masters) if masters is not None else []


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`: itself, or a tensor subclass's inner tensors (torchao's
    quantised optimizer state: codes, block scales and a quantisation map; a sharded run's
    DTensor: this rank's shard), recursively, so that memory is counted from the storages really
    allocated."""
    if type(t) in (torch.Tensor, nn.Parameter):  # (a sharded DTensor parameter is neither)
        return [t]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    names, _ = flatten()
    return [inner for name in names for inner in plain_tensors(getattr(t, name))]


def _plain(tensors: Iterable[Optional[torch.Tensor]]) -> Iterator[torch.Tensor]:
    for t in tensors:
        if t is not None:
            yield from plain_tensors(t)


def _state_tensors(optimizer: Optional[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield from plain_tensors(value)


def model_state_tensors(
    model: nn.Module, engine: Any = None, optimizer: Optional[torch.optim.Optimizer] = None
) -> list[torch.Tensor]:
    """Weights and masters: the tensors that are not activations when a layer saves them."""
    return [*model.parameters(), *model.buffers(), *_masters(engine, optimizer)]


def measure(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    engine: Any = None,
    activations: int = 0,
) -> MemoryByKind:
    """The four kinds held by the model, the engine and the optimizer as they are now, plus
    `activations` (bytes, from an `ActivationMeter` of the same step). Reads only tensor
    metadata: no device sync."""
    counter = StorageCounter()
    masters = _masters(engine, optimizer)
    params = list(model.parameters())
    weights = counter.add(_plain([*params, *model.buffers()]))  # (a sharded one: its shard)
    master_weights = counter.add(masters)
    grads = counter.add(_plain(p.grad for p in (*params, *masters)))
    state = counter.add(_state_tensors(optimizer))
    return MemoryByKind(weights, master_weights, grads, state, activations)


class ActivationMeter:
    """Bytes saved for backward while the meter is entered (`with meter: forward; backward`).

    Each storage counts once however many ops save it; storages of `exclude` (the weights and
    masters: `model_state_tensors`) are not counted. The pack hook keeps a detached alias of
    the tensor, as autograd would keep the tensor itself, so nothing is copied."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {storage_key(t) for t in exclude}
        self._counter = StorageCounter()
        self.bytes = 0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if storage_key(t) not in self._exclude:
            self.bytes += self._counter.add([t])
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)


class MemoryInstrument(Instrument):
    """Memory by kind of the first step of a session that steps: its forward and backward run
    under an `ActivationMeter`, and the other kinds are counted after its optimizer step, before
    `zero_grad` (the gradients still held). A skipped step (no optimizer state yet) is measured
    again at the next one. The total goes to `probe` (`MemoryProbe.record_tensors`: a CPU's
    `peak_mem_mb`); the `mem_*_mb` figures go out once per measurement with the epoch's metrics,
    with `extra()`'s beside them (a sharded run's all-gather). Reads no device value."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        engine: Any,
        probe: Any,
        extra: Optional[Callable[[], dict[str, float]]] = None,
    ):
        self.module, self.optimizer, self.engine = module, optimizer, engine
        self.probe = probe
        self.extra = extra
        self.parts: Optional[MemoryByKind] = None  # the latest measurement
        self.final = False  # a step that stepped was measured: no step is metered again
        self._logged = False
        self._meter: Optional[ActivationMeter] = None
        self._metering = False

    def due(self, step: int) -> bool:
        return not self.final

    def start(self, step: int) -> None:
        self._meter = ActivationMeter(model_state_tensors(self.module, self.engine, self.optimizer))
        self._meter.__enter__()
        self._metering = True

    def after_backward(self, step: int) -> None:
        self.close()

    def after_step(self, step: int, stepped: bool) -> None:
        self.parts = measure(self.module, self.optimizer, self.engine, self._meter.bytes)
        self.probe.record_tensors(self.parts.total / MB)
        self.final = bool(stepped)  # (a device verdict read at this measured step only)
        self._logged = False

    def close(self) -> None:
        if self._metering:
            self._metering = False
            self._meter.__exit__(None, None, None)

    def epoch_metrics(self) -> dict[str, float]:
        if self.parts is None or self._logged:
            return {}
        out = self.parts.metrics()
        if self.extra is not None:
            out.update(self.extra())
        self._logged = self.final
        return out
