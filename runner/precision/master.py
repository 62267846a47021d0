"""fp32 master weights for a 16-bit model (Apex O2): the optimizer steps fp32 copies.

Small updates vanish when added to fp16 weights, so the optimizer works on fp32 masters and the
model gets a rounded copy after each step. The masters replace the half parameters inside the
optimizer's existing `param_groups` dicts (not new dicts), so an LR scheduler made before or after
keeps driving the same groups, and `optimizer.step` itself is never touched. fp32 parameters that
the model already has (BatchNorm under keep_batchnorm_fp32) are their own masters.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

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
                master = nn.Parameter(p.detach().to(torch.float32, copy=True),
                                      requires_grad=p.requires_grad)
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
