"""Sharded runs: FSDP2 (`torch.distributed.fsdp.fully_shard`) with the precision levels.

`trainer.strategy=fsdp` under torchrun shards each *unit* of the model (its repeated blocks by
default, `trainer.fsdp_wrap` to choose) and then the model itself over the ranks: every rank holds
1/N of the parameters, of their gradients and of the optimizer state, and gathers a unit's full
parameters only while the unit computes. A single process without torchrun is refused: FSDP2
shards over a process group, and `torchrun --nproc_per_node=1` gives one of size 1 when that is
what is wanted (the same code path, nothing hidden).

How each level maps onto FSDP2 (the engine's stages and loss scaling unchanged):

| level | sharded parameters | compute (all-gathered) | gradient reduction | masters |
|---|---|---|---|---|
| O0 | fp32 | fp32 | fp32 | - |
| O1 | fp32 | autocast (the engine's) | fp32 | the fp32 shards |
| O2 | fp32 | `param_dtype` = the 16-bit type | `reduce_dtype` fp32 | the fp32 shards |
| O3 | the 16-bit type (the model cast before sharding) | the 16-bit type | the 16-bit type | none |

`stochastic_rounding` (o3_bf16_sr): bf16 shards, each update computed in fp32 and rounded with the
bits the unsharded run draws for each element (`rounding.stochastic_round` keys a shard's
elements by their index in the whole tensor). fp8 (`fp8_linear`): torchao's Float8Linear layers,
converted before sharding; on fp8 hardware with the tensorwise recipe their weights are gathered
in fp8 (`enable_fsdp_float8_all_gather`), emulated elsewhere in the level's type.

`keep_batchnorm_fp32` (O2): each BatchNorm is a unit of its own whose policy keeps fp32
(`param_dtype=None`), so its weights and statistics compute in fp32 on the 16-bit activations, as
the unsharded O2 does. The model's output comes back as fp32 (the engine's output cast), so the
loss is computed in fp32.

One overflow decision across the ranks: each rank checks its own gradient shards, the flags are
summed over the ranks before the one host read (the engine's `flag_reducer`), so every rank skips
(and backs off) together. Clipping: torch's `clip_grad_norm_` over the DTensor gradients, which
computes the global norm of the sharded gradients. The fused kernels take plain tensors: a sharded
run steps with torch's ops.

Checkpoints of a sharded run hold the *full* state (`get_model_state_dict` /
`get_optimizer_state_dict` with `full_state_dict`, gathered to rank 0's CPU), written by rank 0 in
the runner's ordinary checkpoint format (atomic, digested, read without unpickling code); the
optimizer's state is stored under the parameters' indices as torch's own state dict is. Every
rank reads the checkpoint and loads it into its shards (`set_*_state_dict`), so a run resumes at
another world size (at an epoch boundary: the batches already trained mid-epoch belong to the old
world's shards).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from runner.config.mistakes import did_you_mean
from runner.errors import ConfigError
from runner.precision import Properties
from runner.precision.state import local_shard as local  # noqa: F401  (a DTensor's shard)

WRAP_KEY = "trainer.fsdp_wrap"
STRATEGY_KEY = "trainer.strategy"


# ---- which modules are units ---------------------------------------------------------------------
def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def default_units(model: nn.Module) -> list[str]:
    """The model's repeated blocks: the children of each outermost `nn.ModuleList` or
    `nn.Sequential` that holds two or more children with parameters (a GPT's `blocks.N`, a ViT's
    `encoder.layers.N`, a ResNet's blocks in `layerK`, the tiny CNN's conv blocks); a model
    without such a container: its direct children with parameters."""
    units: list[str] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(t == "" or name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = [
                (f"{name}.{child}" if name else child, m)
                for child, m in module.named_children()
                if _owns_parameters(m)
            ]
            if len(children) >= 2:
                units += [child for child, _ in children]
                taken.append(name)
    if not units:
        units = [child for child, m in model.named_children() if _owns_parameters(m)]
    return units


def _glob(pattern: str) -> re.Pattern:
    """A module-name glob whose `*` and `?` stay within one name (`blocks.*` is each block, not
    everything inside the blocks)."""
    out = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.compile(out + r"\Z")


def units_for(model: nn.Module, wrap: Optional[Sequence[str]]) -> list[str]:
    """The qualified names of the modules to shard as units, children before their parents:
    `wrap`'s entries (a class name, or a module-name glob), or the default blocks. An entry that
    matches no module is a ConfigError naming `trainer.fsdp_wrap`."""
    names = [n for n, _ in model.named_modules() if n]
    if wrap is None:
        chosen = default_units(model)
    else:
        chosen = []
        for entry in wrap:
            entry = str(entry).strip()
            by_class = [n for n, m in model.named_modules() if n and type(m).__name__ == entry]
            by_name = [n for n in names if _glob(entry).match(n)]
            matched = by_class or by_name
            if not matched:
                top = ", ".join(n for n, _ in model.named_children())
                classes = sorted({type(m).__name__ for _, m in model.named_modules()})
                # a module name's glob is told names first, a class name classes first
                first, then = (
                    (names, classes) if any(c in entry for c in ".*?") else (classes, names)
                )
                near = did_you_mean(entry, first) or did_you_mean(entry, then)
                raise ConfigError(
                    WRAP_KEY,
                    f"'{entry}' matches no module of "
                    f"{type(model).__name__} (by class name, or by a module-name "
                    f"glob whose * stays within one name); its top-level modules: "
                    f"{top}{near}",
                    "class names (Block) or globs (blocks.*, layer?)",
                )
            chosen += [n for n in matched if n not in chosen]
        chosen = [n for n in chosen if _owns_parameters(model.get_submodule(n))]
    # children before parents (FSDP2 shards a parent's remaining parameters after its units)
    return sorted(chosen, key=lambda n: -n.count("."))


# ---- sharding ------------------------------------------------------------------------------------
def policies(p: Properties) -> tuple[Any, Any]:
    """(the units' MixedPrecisionPolicy, the BatchNorm units' one or None): O2's `param_dtype`
    (the 16-bit type) with fp32 reduction; fp32 BatchNorm units with `keep_batchnorm_fp32`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if p.casts_to_half and p.uses_master_weights:
        main = MixedPrecisionPolicy(param_dtype=p.cast_model_type, reduce_dtype=torch.float32)
        norm = (
            MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
            if p.keep_batchnorm_fp32
            else None
        )
        return main, norm
    return MixedPrecisionPolicy(), None


def shard(model: nn.Module, p: Properties, wrap: Optional[Sequence[str]]) -> list[str]:
    """`fully_shard` each unit of `model` (children first), every BatchNorm as a unit of its own
    where O2 keeps it fp32, then the model itself, in place: the parameters become DTensors sharded
    over the default process group. Returns the units' names."""
    from torch.distributed.fsdp import fully_shard

    main, norm = policies(p)
    units = units_for(model, wrap)
    if norm is not None:
        for module in model.modules():
            if isinstance(module, _BatchNorm) and _owns_parameters(module):
                fully_shard(module, mp_policy=norm)
    for name in units:
        fully_shard(model.get_submodule(name), mp_policy=main)
    fully_shard(model, mp_policy=main)
    return units


def allgather_bytes(model: nn.Module) -> int:
    """The all-gather working set: the largest unit's parameters gathered whole, in the type it
    gathers them in (O2: `param_dtype`), counting each parameter in the innermost unit that
    manages it. One unit's at a time (FSDP2 prefetches the next unit's too: up to twice this)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    largest = 0
    for unit in units:
        nested = {
            id(p)
            for m in unit.modules()
            if m is not unit and isinstance(m, FSDPModule)
            for p in m.parameters()
        }
        policy = getattr(getattr(unit, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
        total = sum(
            p.numel() * (dtype or p.dtype).itemsize
            for p in unit.parameters()
            if id(p) not in nested
        )
        largest = max(largest, total)
    return largest


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# ---- full state dicts (checkpoints) --------------------------------------------------------------
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state, gathered to rank 0's CPU (a collective: every rank calls it;
    the other ranks get {})."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state gathered to rank 0's CPU (a collective), in torch's own
    layout: parameters by their index in the param groups, as `optimizer.state_dict()` is."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not named:
        return {}
    index = {
        fqn: i for i, fqn in enumerate(fqn for g in named["param_groups"] for fqn in g["params"])
    }
    return {
        "state": {index[fqn]: value for fqn, value in named["state"].items()},
        "param_groups": [
            {**g, "params": [index[fqn] for fqn in g["params"]]} for g in named["param_groups"]
        ],
    }


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """A checkpoint's full state into this rank's shards (every rank has read the checkpoint):
    the optimizer's indices mapped back to the parameters' names."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, model_state, options=_options())
    names = [
        fqn
        for g in get_optimizer_state_dict(model, optimizer, options=_options())["param_groups"]
        for fqn in g["params"]
    ]
    named = {
        "state": {names[i]: value for i, value in optimizer_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]}
            for g in optimizer_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=_options())


# ---- what a sharded run cannot do (yet) ----------------------------------------------------------
def refusals(cfg: Any, p: Properties, layer_rules: Iterable[Any]) -> list[tuple[str, str, str]]:
    """(key, why, what to do) for each setting a sharded run does not take, checked before any
    work; [] for a run that does not shard."""
    out: list[tuple[str, str, str]] = []
    trainer = cfg.trainer
    if trainer.compile:
        out.append(
            (
                "trainer.compile",
                "torch.compile is not wired into sharded runs yet",
                "trainer.compile=false with trainer.strategy=fsdp",
            )
        )
    if trainer.sync_batchnorm:
        out.append(
            (
                "trainer.sync_batchnorm",
                "SyncBatchNorm is DDP's; FSDP2 does not convert it",
                "trainer.sync_batchnorm=false",
            )
        )
    if not p.state_follows_weights:
        out.append(
            (
                "precision.optimizer_state",
                f"{p.state_format} optimizer state is not sharded yet",
                "precision.optimizer_state=null",
            )
        )
    if list(layer_rules) or p.layer_plan is not None:
        out.append(
            (
                "precision.layers" if p.layers else "precision.layer_plan",
                "a layer plan is not enforced on sharded units yet",
                "no precision.layers / precision.layer_plan with trainer.strategy=fsdp",
            )
        )
    if cfg.precision.kernels == "fused":
        out.append(
            (
                "precision.kernels",
                "the fused kernels take plain tensors, and a sharded run's parameters are DTensors",
                "precision.kernels=auto or torch",
            )
        )
    return out
