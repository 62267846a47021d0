"""fp32 master weights for a 16-bit model (Apex O2): the optimizer steps fp32 copies.

Small updates vanish when added to fp16 weights, so the optimizer works on fp32 masters and the
model gets a rounded copy after each step. The masters replace the half parameters inside the
optimizer's existing `param_groups` dicts (not new dicts), so an LR scheduler made before or after
keeps driving the same groups, and `optimizer.step` itself is never touched. fp32 parameters that
the model already has (BatchNorm under keep_batchnorm_fp32) are their own masters.

`MasterSet` holds one engine's masters (one `MasterWeights` per optimizer) and the state-dict
hooks of the 16-bit models they mirror: `model.state_dict()` returns fp32 tensors (the masters'
exact values where a parameter has one) and `model.load_state_dict(sd)` re-seeds the masters.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.precision.properties import HALF_DTYPES


class MasterWeights:
    """Pairs each half model parameter of `optimizer` with an fp32 master that replaces it there."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.model_params: list[torch.Tensor] = []
        self.masters: list[nn.Parameter] = []
        self._grad_buffers: list[Optional[torch.Tensor]] = []
        self.add_new_half_params()

    def add_new_half_params(self) -> int:
        """Give a master to every half parameter of the optimizer that has none yet (again after
        another model that shares this optimizer was cast, or after `add_param_group`).
        Returns how many masters were added."""
        before = len(self.masters)
        seen: dict[int, nn.Parameter] = {id(p): m for p, m in zip(self.model_params, self.masters)}
        for group in self.optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if p.dtype not in HALF_DTYPES:
                    continue
                if id(p) in seen:  # the same parameter in two groups: share one master
                    params[i] = seen[id(p)]
                    continue
                master = nn.Parameter(
                    p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad
                )
                seen[id(p)] = master
                params[i] = master
                self.model_params.append(p)
                self.masters.append(master)
                self._grad_buffers.append(None)
                self._move_state(p, master)
        return len(self.masters) - before

    def _move_state(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Optimizer state made before prepare (rare) follows the parameter, in fp32."""
        state = self.optimizer.state
        if param not in state:
            return
        old = state.pop(param)

        def to_fp32(k, v):
            floating = torch.is_tensor(v) and v.is_floating_point() and k != "step"
            return v.to(torch.float32) if floating else v

        state[master] = {k: to_fp32(k, v) for k, v in old.items()}

    def __len__(self) -> int:
        return len(self.masters)

    def attach_grad_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Point every master's `.grad` at its fp32 buffer (allocated once) and return the
        (model half grads, master buffers) pairs still to be filled, for one pass that copies
        (and, with the kernels, unscales and checks) them.

        A master whose model parameter has no gradient gets `.grad = None`, so the optimizer
        skips it exactly as it would have skipped the model parameter.
        """
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        for i, (p, m) in enumerate(zip(self.model_params, self.masters)):
            if p.grad is None:
                m.grad = None
                continue
            buf = self._grad_buffers[i]
            if buf is None:
                buf = self._grad_buffers[i] = torch.empty_like(m)
            m.grad = buf
            src.append(p.grad)
            dst.append(buf)
        return src, dst

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """model .grad (half) -> master .grad (fp32), into buffers allocated once."""
        src, dst = self.attach_grad_buffers()
        if dst:
            torch._foreach_copy_(dst, src)

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """After a step: masters (fp32) -> model params (rounded to their 16-bit type)."""
        if self.masters:
            torch._foreach_copy_(self.model_params, self.masters)

    def master_of(self) -> dict[int, nn.Parameter]:
        """id(model parameter) -> its fp32 master."""
        return {id(p): m for p, m in zip(self.model_params, self.masters)}

    def model_of(self) -> dict[int, torch.Tensor]:
        """id(master) -> the 16-bit model parameter it mirrors."""
        return {id(m): p for p, m in zip(self.model_params, self.masters)}

    @torch.no_grad()
    def release(self) -> None:
        """Undo the pairing: the model gets the (rounded) master values and its own parameters
        back in the optimizer's groups; optimizer state follows them unchanged (fp32)."""
        self.copy_master_to_model()
        back = {id(m): p for p, m in zip(self.model_params, self.masters)}
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            params = group["params"]
            for i, m in enumerate(params):
                p = back.get(id(m))
                if p is None:
                    continue
                params[i] = p
                if m in state:
                    state[p] = state.pop(m)
        self.model_params, self.masters, self._grad_buffers = [], [], []

    def zero_grad(self) -> None:
        """Drop the masters' grads; the buffers are kept and reused by the next copy."""
        for m in self.masters:
            m.grad = None


class _StateDictHook:
    """A model state-dict hook that calls a `MasterSet` method through a weak reference: the
    model does not keep the masters (nor the engine that owns them) alive, and stays picklable.
    Pickling and `copy.deepcopy` both go through `__getstate__`, which drops the reference: the
    hook of a saved-and-loaded or deep-copied model does nothing, so the copy's state dict is its
    own (16-bit) tensors and loading into it leaves the masters alone. (torch tags hooks with
    attributes, which bound methods refuse, so this is an object, not a bound method.)"""

    def __init__(self, target: MasterSet, method: str):
        self._target: Optional[weakref.ref] = weakref.ref(target)
        self._method = method

    def __call__(self, *args: Any) -> Any:
        target = self._target() if self._target is not None else None
        return None if target is None else getattr(target, self._method)(*args)

    def __getstate__(self) -> dict:
        return {"_method": self._method}

    def __setstate__(self, state: dict) -> None:
        self._method = state["_method"]
        self._target = None


class MasterSet:
    """One engine's master weights (one `MasterWeights` per optimizer; empty without master
    weights) and the state-dict hooks of its 16-bit models."""

    def __init__(self) -> None:
        self._all: list[MasterWeights] = []

    def add(self, masters: MasterWeights) -> None:
        if all(masters is not m for m in self._all):
            self._all.append(masters)

    def release(self) -> None:
        """`MasterWeights.release` for every optimizer; the set is empty afterwards."""
        for masters in self._all:
            masters.release()
        self._all = []

    def master_of(self) -> dict[int, nn.Parameter]:
        """id(model parameter) -> its fp32 master, over every optimizer."""
        out: dict[int, nn.Parameter] = {}
        for masters in self._all:
            out.update(masters.master_of())
        return out

    @torch.no_grad()
    def refresh(self, skip: Optional[set[int]] = None, only: Optional[set[int]] = None) -> None:
        """Re-seed the masters from their model parameters; `skip` holds ids of masters to leave
        alone, `only` (if given) ids of the model parameters to take."""
        for masters in self._all:
            for p, m in zip(masters.model_params, masters.masters):
                if (skip is None or id(m) not in skip) and (only is None or id(p) in only):
                    m.copy_(p)

    def install_state_dict_hooks(self, model: nn.Module) -> list[RemovableHandle]:
        """fp32 `model.state_dict()` (the masters' exact values for parameters that have one,
        every other 16-bit tensor as `.float()`), and `model.load_state_dict(sd)` re-seeding the
        masters (from fp32 values in `sd` when present, else from the loaded model)."""
        # torch < 2.5 has the state-dict post hook under its private name only
        register_state_hook = (
            getattr(model, "register_state_dict_post_hook", None) or model._register_state_dict_hook
        )
        return [
            register_state_hook(_StateDictHook(self, "_fp32_state_hook")),
            model.register_load_state_dict_pre_hook(_StateDictHook(self, "_load_pre_hook")),
            model.register_load_state_dict_post_hook(_StateDictHook(self, "_load_post_hook")),
        ]

    def _fp32_state_hook(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any
    ) -> None:
        masters = self.master_of()
        for name, param in module.named_parameters(
            prefix=prefix.rstrip(".") if prefix else "", remove_duplicate=False
        ):
            if name in state_dict and id(param) in masters:
                state_dict[name] = masters[id(param)].detach()
        for key, value in list(state_dict.items()):
            if key.startswith(prefix) and torch.is_tensor(value) and value.dtype in HALF_DTYPES:
                state_dict[key] = value.float()

    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        masters = self.master_of()
        pending = []
        for name, param in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if id(param) in masters and torch.is_tensor(value):
                pending.append((masters[id(param)], value))
        module.__dict__["_amp_pending_masters"] = pending

    @torch.no_grad()
    def _load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        pending = module.__dict__.pop("_amp_pending_masters", [])
        exact = set()
        for master, value in pending:
            if value.dtype == torch.float32 and value.shape == master.shape:
                master.copy_(value)  # exact: the checkpoint carries the fp32 values
                exact.add(id(master))
        # the rest from what the model now holds; only this module's own parameters (another
        # model whose parameters share the optimizer keeps its masters)
        self.refresh(skip=exact, only={id(q) for q in module.parameters()})
