"""Memory by kind, counted from the tensors themselves: exact on any device, per run.

A training step holds five kinds of tensors; `measure` counts each from the objects that own
them, so that the figure does not depend on an allocator or on what another run in the same
process freed:

  weights          the model's parameters and buffers (BatchNorm's running statistics), in the
                   type the precision level keeps them in (fp16 under O2/O3, fp32 BatchNorm
                   under keep_batchnorm_fp32);
  master_weights   the engine's fp32 master copies of 16-bit parameters (O2: one per fp16
                   parameter; 0 at O0, O1 and O3);
  grads            every `.grad` at the moment of measurement (after the optimizer step, before
                   zero_grad): the model's and the masters' (the fused O2 step reads the model's
                   16-bit gradients directly and never materialises fp32 master gradients);
  optimizer_state  every tensor in `optimizer.state` (momentum, Adam's moments and steps;
                   quantised state by its codes, block scales and map: `plain_tensors`);
  activations      the bytes autograd saved for backward during one training step
                   (`ActivationMeter`, through `torch.autograd.graph.saved_tensors_hooks`):
                   layer inputs and outputs, BatchNorm's batch statistics, the 16-bit copies
                   of weights that O1's autocast makes and saves, the batch itself as the first
                   layer saves it. Tensors that are parameters or buffers (a weight saved by its
                   own layer) are not activations and are not counted again.

Every tensor is counted by its storage, once (storages shared by several tensors, views of one
tensor, a tensor saved by two layers), in the first kind above that holds it. The sum is
`total`: the training state of a step as if all five were alive at once, an upper bound of
what the step holds at its fullest (activations are freed during backward as gradients appear)
that leaves out temporaries (workspaces, the loss, intermediate values not saved for backward).
Checkpointing code that installs its own `saved_tensors_hooks` inside the step hides its saved
tensors from the meter (only the innermost pair of hooks applies).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

MB = 2**20
KINDS = ("weights", "master_weights", "grads", "optimizer_state", "activations")
TOTAL_METRIC = "mem_total_mb"


def metric_name(kind: str) -> str:
    """The metric of one kind: `mem_<kind>_mb` (the names the report reads)."""
    return f"mem_{kind}_mb"


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
        out = {metric_name(kind): getattr(self, kind) / MB for kind in KINDS}
        out[TOTAL_METRIC] = self.total / MB
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
