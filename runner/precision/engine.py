"""`AmpEngine`: executes resolved `Properties` around a plain PyTorch training step.

The trainer calls, per step: `with engine.autocast(): loss = ...`, `engine.backward(loss)`,
optionally `engine.clip_grad_norm_(max_norm)`, `engine.step(optimizer)`,
`engine.zero_grad(optimizer)`.
The engine never wraps `optimizer.step` (LR schedulers wrap it themselves), and reads the
non-finite flag from the device at most once per step, only when a check is needed at all
(dynamic scale, or a static scale other than 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Optional

import torch
from torch import nn

from runner.precision.autocast import autocast_context
from runner.precision.casting import IOCastHooks, cast_model
from runner.precision.master import MasterWeights
from runner.precision.properties import Properties
from runner.precision.scaler import LossScaler


@dataclass
class _OptimizerState:
    """What the engine tracks per prepared optimizer between backward and step."""

    models: list[nn.Module] = field(default_factory=list)
    masters: Optional[MasterWeights] = None
    unscaled: bool = False
    found_inf: Optional[torch.Tensor] = None


class AmpEngine:
    """Casting, autocast, loss scaling and master weights for one run."""

    def __init__(
        self,
        properties: Properties,
        device: torch.device | str,
        num_losses: int = 1,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0 ** 24,
    ):
        if num_losses < 1:
            raise ValueError(f"num_losses must be >= 1, got {num_losses}")
        self.properties = properties
        self.device = torch.device(device)
        self.scalers = [
            LossScaler(properties.loss_scale, min_loss_scale=min_loss_scale,
                       max_loss_scale=max_loss_scale)
            for _ in range(num_losses)
        ]
        self.skipped_steps = 0
        self._optimizers: dict[int, tuple[torch.optim.Optimizer, _OptimizerState]] = {}
        self._io_hooks: list[IOCastHooks] = []
        self._pending_losses: set[int] = set()  # loss_ids with a backward since the last step
        self._last_losses: set[int] = {0}

    # ---- setup -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        """Cast `model` per the properties and give `optimizer` fp32 masters where asked.

        `model` must already be on the device. Returns the same objects, modified in place.
        """
        p = self.properties
        if p.cast_model_type is not None:
            hooks = cast_model(model, p.cast_model_type, p.keep_batchnorm_fp32)
            if hooks is not None:
                self._io_hooks.append(hooks)
        if optimizer is not None:
            _, state = self._optimizers.setdefault(id(optimizer), (optimizer, _OptimizerState()))
            state.models.append(model)
            if p.uses_master_weights:
                if state.masters is None:
                    state.masters = MasterWeights(optimizer)
                else:  # one optimizer over several models, prepared one by one
                    state.masters.add_new_half_params()
        return model, optimizer

    def remove_hooks(self) -> None:
        """Remove the input/output cast hooks from every prepared model."""
        for h in self._io_hooks:
            h.remove()
        self._io_hooks = []

    def _state(self, optimizer: Optional[torch.optim.Optimizer]
               ) -> tuple[torch.optim.Optimizer, _OptimizerState]:
        if optimizer is None:
            if len(self._optimizers) != 1:
                raise RuntimeError(
                    "optimizer=None needs exactly one prepared optimizer; "
                    f"{len(self._optimizers)} are prepared")
            return next(iter(self._optimizers.values()))
        try:
            return self._optimizers[id(optimizer)]
        except KeyError:
            raise RuntimeError("this optimizer was not passed to AmpEngine.prepare") from None

    # ---- per step --------------------------------------------------------------------------
    def autocast(self) -> ContextManager:
        """Context for forward and loss: `torch.autocast` under O1-style properties, else no-op."""
        return autocast_context(self.properties, self.device)

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """`(loss.float() * scale).backward()`; no multiply when the scale is exactly 1."""
        if not 0 <= loss_id < len(self.scalers):
            raise ValueError(f"loss_id {loss_id} out of range for num_losses={len(self.scalers)}")
        if any(st.unscaled for _, st in self._optimizers.values()):
            raise RuntimeError("backward after unscale_/clip_grad_norm_ and before step: "
                               "gradients would mix scaled and unscaled values")
        scale = self.scalers[loss_id].scale
        loss = loss.float()
        if scale != 1.0:
            loss = loss * scale
        loss.backward()
        self._pending_losses.add(loss_id)

    def _step_scalers(self) -> list[LossScaler]:
        """The scalers whose losses produced this step's gradients."""
        ids = sorted(self._pending_losses or self._last_losses)
        scalers = [self.scalers[i] for i in ids]
        if len({s.scale for s in scalers}) > 1:
            # Gradients of losses with different scales are summed in .grad and cannot be told
            # apart any more; per-loss unscaling at backward time is needed for that case.
            raise RuntimeError(f"losses {ids} have different scales "
                               f"{[s.scale for s in scalers]} but share one step")
        return scalers

    def unscale_(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Make the stepped gradients true fp32 values: once per step (a no-op until step after).

        O2: copy the model's half grads into the fp32 masters. Then, where a check is needed,
        unscale in place and record a non-finite flag as a device tensor (no host sync here).
        """
        optimizer, st = self._state(optimizer)
        if st.unscaled:
            return
        if st.masters is not None:
            st.masters.copy_grads_to_master()
        scaler = self._step_scalers()[0]
        if scaler.needs_check:
            grads = [p.grad for p in self._stepped_params(optimizer) if p.grad is not None]
            st.found_inf = scaler.unscale_(grads)
        st.unscaled = True

    def clip_grad_norm_(self, max_norm: float, optimizer: Optional[torch.optim.Optimizer] = None,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the unscaled gradients the optimizer will step (masters under O2); returns the
        total norm before clipping. Non-finite grads give a non-finite norm; the step is skipped."""
        optimizer, _ = self._state(optimizer)
        self.unscale_(optimizer)
        params = [p for p in self._stepped_params(optimizer) if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def step(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Unscale if not done, then skip (non-finite grads) or step.

        Returns True when the optimizer stepped."""
        optimizer, st = self._state(optimizer)
        self.unscale_(optimizer)
        scalers = self._step_scalers()
        # The only host sync of the step, and none when no check ran.
        found_inf = st.found_inf is not None and bool(st.found_inf.item())
        if found_inf:
            self.skipped_steps += 1
        else:
            optimizer.step()
            if st.masters is not None:
                st.masters.copy_master_to_model()
        for s in scalers:
            s.update(found_inf)
        self._end_step(st)
        return not found_inf

    def _end_step(self, st: _OptimizerState) -> None:
        st.unscaled = False
        st.found_inf = None
        if self._pending_losses:
            self._last_losses = set(self._pending_losses)
        self._pending_losses.clear()

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Model grads to None; the masters' grad buffers are kept for reuse. Also forgets a
        pending unscale, so a step abandoned by the caller does not leak into the next one."""
        optimizer, st = self._state(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        if st.masters is not None:
            for p in st.masters.model_params:
                p.grad = None
            st.masters.zero_grad()
        for model in st.models:
            for p in model.parameters():
                p.grad = None
        self._end_step(st)

    # ---- introspection and checkpoints -------------------------------------------------------
    def _stepped_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        for group in optimizer.param_groups:
            yield from group["params"]

    def master_params(self, optimizer: Optional[torch.optim.Optimizer] = None
                      ) -> Iterator[torch.Tensor]:
        """What the optimizer steps: the fp32 masters under master weights, else the model's."""
        optimizer, _ = self._state(optimizer)
        return self._stepped_params(optimizer)

    def masters(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[MasterWeights]:
        """The model<->master pairing of `optimizer`, or None without master weights."""
        return self._state(optimizer)[1].masters

    @property
    def loss_scale(self) -> float:
        return self.scalers[0].scale

    def state_dict(self) -> dict[str, Any]:
        """Apex layout (`loss_scaler0`, ...) plus `skipped_steps`."""
        sd: dict[str, Any] = {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, s in enumerate(self.scalers):
            if f"loss_scaler{i}" in state:
                s.load_state_dict(state[f"loss_scaler{i}"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
