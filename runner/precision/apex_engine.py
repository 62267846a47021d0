"""`ApexEngine`: the Apex facade's engine (`amp.initialize` makes one per call): Apex's several
losses and several optimizers over one `OptimizerStepper` per optimizer and one `LossScaler` per
loss, every verdict read on the host, as Apex read it.

What Apex did, and this engine keeps (the facade's calls in `amp.py`):

- `num_losses`, `loss_id`: each loss has its own scaler. Before the backward of a *different*
  loss, the gradients already accumulated are unscaled by their own scaler (its overflow flag
  recorded against that loss) and moved into the stepper's fp32 stash, added back after the last
  loss is unscaled; so each loss keeps its own scale, only the overflowing loss's scaler backs
  off, and the step is skipped when any loss overflowed. Each scaler updates once per round with
  its own loss's verdict, however many optimizers step that loss.
- One `scale_loss(loss, loss_id, [a, b])` over several optimizers is one overflow decision: the
  first of them to step or settle checks the others too, and when the loss overflowed in any of
  them, all of them skip (Apex skipped every optimizer of that `scale_loss`; `settle_all`
  settles several at once).
- `settle` (the end of Apex's `scale_loss`, unless `delay_unscale`): unscale, check and update
  the scalers now; the next `step` of that optimizer then only steps or skips.
- Apex's O1: `autocast()` opens Apex's own O1 region (its function lists, the registered casts,
  the binary_cross_entropy ban: `autocast.py`, `apex_o1.py`), not plain `torch.autocast`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from runner import csrc
from runner.precision import fp8, paths
from runner.precision.autocast import autocast_context
from runner.precision.checks import concrete_device
from runner.precision.master import MasterWeights
from runner.precision.model_cast import ModelCast
from runner.precision.recipe import Properties
from runner.precision.scaler import LossScaler
from runner.precision.stepper import OptimizerStepper, Stage

__all__ = ["ApexEngine"]


@dataclass
class LossRound:
    """One optimizer's losses between its first backward and its step (or zero_grad): which
    losses' gradients it holds, their device flags and verdicts, and the backward calls it shares
    with other optimizers (one `scale_loss` over several)."""

    # loss ids whose *scaled* gradients sit in the model's .grad (accumulated, one scale)
    scaled_ids: set[int] = field(default_factory=set)
    # every loss id that contributed gradients this round (their scalers update at the step)
    loss_ids: set[int] = field(default_factory=set)
    flags: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # device flags per loss
    found: dict[int, bool] = field(default_factory=dict)  # resolved flags per loss
    # backward calls shared with other optimizers (one scale_loss over several): call -> loss id
    shared: dict[int, int] = field(default_factory=dict)
    scaled_calls: set[int] = field(default_factory=set)  # shared calls whose grads sit scaled
    call_flags: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    call_found: dict[int, bool] = field(default_factory=dict)  # resolved flags per shared call

    def record(self, flag: Optional[torch.Tensor]) -> None:
        """A device-side non-finite flag counts against every loss (and shared backward call)
        whose gradients it covers."""
        if flag is not None:
            for i in self.scaled_ids:
                self.flags.setdefault(i, []).append(flag)
            for call in self.scaled_calls:
                self.call_flags.setdefault(call, []).append(flag)

    def unscaled(self) -> None:
        """The scaled gradients were unscaled: none of the losses' sits scaled any more."""
        self.scaled_ids.clear()
        self.scaled_calls.clear()

    def verdicts(self) -> dict[int, bool]:
        """The per-loss overflow verdicts of this round (and those of the shared backward calls,
        in `call_found`): at most one host read per call."""
        pending = [(self.found, i, flags) for i, flags in self.flags.items() if flags]
        pending += [(self.call_found, c, flags) for c, flags in self.call_flags.items() if flags]
        if pending:
            sums = []
            for _, _, flags in pending:
                f = flags[0]
                for o in flags[1:]:
                    f = f + o.to(f.device)
                sums.append(f)
            if len(sums) == 1:
                values = [sums[0].item()]
            else:
                dev = sums[0].device
                values = torch.cat([s.to(dev).reshape(1) for s in sums]).tolist()
            for (table, key, flags), v in zip(pending, values):
                table[key] = table.get(key, False) or v != 0
                flags.clear()
        return self.found


@dataclass
class Prepared:
    """What the facade's engine keeps per optimizer: its stepper and its round's losses."""

    stepper: OptimizerStepper
    round: LossRound = field(default_factory=LossRound)

    def new_round(self, stage: Stage) -> None:
        self.stepper.new_round(stage)
        self.round = LossRound()


class ApexEngine:
    """Casting, Apex's O1 region, loss scaling and master weights for one `amp.initialize` call:
    `num_losses` scalers and any number of optimizers. `masters_for_half_params`: fp32 masters
    for the 16-bit parameters a model brought itself, without a model cast (the facade's
    `cast_model_type=False` with master weights, as Apex's O2 made them)."""

    def __init__(
        self,
        properties: Properties,
        device: torch.device | str,
        num_losses: int = 1,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: Optional[float] = None,
        cast_model_outputs: Optional[torch.dtype] = None,
        kernels: str = "auto",
        seed: int = 0,
        masters_for_half_params: bool = False,
    ):
        if num_losses < 1:
            raise ValueError(f"num_losses must be >= 1, got {num_losses}")
        self.properties = properties
        self.device = concrete_device(device)
        bounds = {
            k: v
            for k, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale))
            if v is not None
        }
        self.scalers = [
            LossScaler.from_properties(properties, **bounds).to(self.device)
            for _ in range(num_losses)
        ]
        self.model_cast = ModelCast(properties, self.device, cast_model_outputs)
        self.masters_for_half_params = masters_for_half_params
        self._scales = paths.ScaleTensors(self.device)
        self._clock = paths.RoundingClock(seed) if properties.stochastic_rounding else None
        self._state_dtype = None if properties.state_follows_weights else properties.state_dtype
        self._kernels: Optional[csrc.Kernels] = csrc.load(self.device, kernels)
        for scaler in self.scalers:
            scaler.kernels = self._kernels
        self._optimizers: dict[int, Prepared] = {}
        self.skipped_steps = 0
        # loss id -> the overflow verdict its scaler was updated with since that loss's last
        # backward (absent: not updated yet). Several optimizers stepping one loss's gradients
        # update its scaler once (backing off if any of them overflowed).
        self._verdicts: dict[int, bool] = {}
        self._backward_calls = 0  # numbers the backward calls shared by several optimizers

    @property
    def kernels(self) -> Optional[csrc.Kernels]:
        """The compiled kernels for this device, or None (torch's ops)."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: Optional[csrc.Kernels]) -> None:
        """Replacing the kernels (None: torch's ops) re-chooses every optimizer's path."""
        self._kernels = kernels
        for scaler in self.scalers:
            scaler.kernels = kernels
        for prepared in self._optimizers.values():
            prepared.stepper.path = self._path()

    def _path(self) -> paths.ExecutionPath:
        return paths.choose(
            self._kernels, self.device, self._scales, self._clock, self._state_dtype
        )

    # ---- setup -----------------------------------------------------------------------------
    def cast(self, model: nn.Module) -> nn.Module:
        """Cast `model` per the properties (`ModelCast.cast`); it must be on the device."""
        return self.model_cast.cast(model)

    def add_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module] = ()
    ) -> torch.optim.Optimizer:
        """After its models were cast: fp32 masters for the optimizer's 16-bit parameters where
        asked; `models` get their grads cleared by `zero_grad`."""
        prepared = self._optimizers.get(id(optimizer))
        if prepared is None:
            prepared = Prepared(OptimizerStepper(optimizer, self._path()))
            self._optimizers[id(optimizer)] = prepared
        masters = self.properties.uses_master_weights or self.masters_for_half_params
        prepared.stepper.add_models(models, self.model_cast.masters if masters else None)
        return optimizer

    def release(self) -> None:
        """Undo the set-up as far as it can be undone: hooks removed, optimizers get the model's
        parameters back (with the master values, rounded). The models stay in their cast type."""
        self.model_cast.release()
        self._optimizers.clear()

    def _prepared(self, optimizer: Optional[torch.optim.Optimizer]) -> Prepared:
        if optimizer is None:
            if len(self._optimizers) != 1:
                raise RuntimeError(
                    "optimizer=None needs exactly one prepared optimizer; "
                    f"{len(self._optimizers)} are prepared"
                )
            return next(iter(self._optimizers.values()))
        try:
            return self._optimizers[id(optimizer)]
        except KeyError:
            raise RuntimeError("this optimizer was not passed to amp.initialize") from None

    def _all(self, optimizers: Optional[list[torch.optim.Optimizer]]) -> list[Prepared]:
        if optimizers is None:
            return list(self._optimizers.values())
        return [self._prepared(o) for o in optimizers]

    @property
    def fp8(self) -> Optional[fp8.Conversion]:
        """Which Linear layers run in fp8, once a model is cast (None: no fp8)."""
        return self.model_cast.fp8

    def stage(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Stage:
        """Where `optimizer` is in its round (see `Stage`)."""
        return self._prepared(optimizer).stepper.stage

    def sync_param_groups(self, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
        """After `optimizer.add_param_group`: fp32 masters for the new 16-bit params."""
        return self._prepared(optimizer).stepper.sync_param_groups()

    def masters(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[MasterWeights]:
        """The model<->master pairing of `optimizer`, or None without master weights."""
        return self._prepared(optimizer).stepper.masters

    def master_params(
        self, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> Iterator[torch.Tensor]:
        """What the optimizer steps: the fp32 masters under master weights, else the model's."""
        return paths.stepped_params(self._prepared(optimizer).stepper.optimizer)

    # ---- per step --------------------------------------------------------------------------
    def autocast(self) -> ContextManager:
        """Apex's O1 region under O1's properties (`initialize` wraps each model's forward in
        it), else a no-op context."""
        return autocast_context(self.properties, self.device, patch_functions=True)

    def scale_loss(
        self,
        loss: torch.Tensor,
        loss_id: int = 0,
        optimizers: Optional[list[torch.optim.Optimizer]] = None,
    ) -> torch.Tensor:
        """`loss.float() * scale` of loss `loss_id`, ready for `.backward()`; prepares the
        optimizers' gradients for it first (every prepared optimizer when `optimizers` is
        None): gradients of another loss are unscaled by their own scaler and stashed. Several
        optimizers: their backward call is one overflow decision."""
        if not 0 <= loss_id < len(self.scalers):
            raise ValueError(f"loss_id {loss_id} out of range for num_losses={len(self.scalers)}")
        prepared = self._all(optimizers)
        for p in prepared:  # (all checked before any of them moves on)
            p.stepper.refuse_backward()
        for p in prepared:
            self._before_backward(p, loss_id)
        if len(prepared) > 1:  # one backward over several optimizers: one overflow decision
            self._backward_calls += 1
            for p in prepared:
                p.round.shared[self._backward_calls] = loss_id
                p.round.scaled_calls.add(self._backward_calls)
        self._verdicts.pop(loss_id, None)
        return self.scalers[loss_id].scale_loss(loss)

    def _before_backward(self, p: Prepared, loss_id: int) -> None:
        """Another loss's scaled gradients are unscaled first (where either scale needs it;
        static scales of 1 accumulate together), then go to the stash with any unscaled ones."""
        rnd = p.round
        if rnd.scaled_ids and loss_id not in rnd.scaled_ids:
            pending_checks = any(self.scalers[i].needs_check for i in rnd.scaled_ids)
            if pending_checks or self.scalers[loss_id].needs_check:
                self._unscale(p)
        rnd.scaled_ids.add(loss_id)
        rnd.loss_ids.add(loss_id)
        one = len(rnd.scaled_ids) == 1
        p.stepper.before_backward(self.scalers[loss_id] if one else None)

    def _unscale(self, p: Prepared) -> None:
        p.round.record(p.stepper.unscale())
        p.round.unscaled()

    def settle(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Unscale, check and update the scalers now (Apex's end of `scale_loss`); the next
        `step` of this optimizer then only steps or skips. Returns True when it will skip."""
        return self.settle_all([optimizer] if optimizer is not None else None)

    def settle_all(self, optimizers: Optional[list[torch.optim.Optimizer]] = None) -> bool:
        """`settle` for several optimizers with one decision (Apex's `scale_loss(loss, [a, b])`):
        all of them are unscaled and checked before any scaler is updated, and when a loss they
        share overflowed in any of them, every one of them skips its next step. Returns True
        when they will skip. None: every prepared optimizer."""
        prepared = self._all(optimizers)
        for p in prepared:
            p.stepper.refuse_after_step("settle")
        for p in prepared:
            self._unscale(p)
        self._decide(prepared)
        for p in prepared:
            self._update_scalers(p.round)
        return any(any(p.round.found.values()) for p in prepared)

    def step(
        self,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *args: Any,
        step_fn: Optional[Callable[..., Any]] = None,
        **kwargs: Any,
    ) -> bool:
        """Unscale if not done, then skip (non-finite grads) or step; masters -> model. Each
        scaler whose loss contributed updates once per round (backing off only for its own
        loss's overflow). `step_fn` replaces `optimizer.step` (the facade passes the unwrapped
        step) where the kernels do not step. Returns True when the optimizer stepped."""
        p = self._prepared(optimizer)
        st, rnd = p.stepper, p.round
        st.refuse_after_step("step")
        planned = None if args or kwargs else st.scaled_step()
        if planned is not None:  # fused, straight from the model's scaled gradients
            rnd.record(st.check(planned))
        else:
            self._unscale(p)
        # A loss whose gradients other optimizers hold as well: they are checked now too, so
        # that all of them skip when it overflowed in any (one decision per loss).
        sharing = self._sharing(p)
        for other in sharing:
            self._unscale(other)
        self._decide([p, *sharing])  # the only host read of the step, none without a check
        found_inf = any(rnd.found.values())
        if found_inf:
            self.skipped_steps += 1
        else:
            st.apply(planned, step_fn, args, kwargs)
        self._update_scalers(rnd)
        p.new_round(Stage.STEPPED)
        return not found_inf

    def zero_grad(
        self, optimizer: Optional[torch.optim.Optimizer] = None, set_to_none: bool = True
    ) -> None:
        """Model and master grads cleared; a pending unscale or stash forgotten (READY)."""
        p = self._prepared(optimizer)
        p.stepper.zero_grad(set_to_none)
        p.new_round(Stage.READY)

    # ---- one decision per loss and per shared backward call --------------------------------
    def _sharing(self, p: Prepared) -> list[Prepared]:
        """The other optimizers still in a round with a backward call `p`'s round shares."""
        calls = p.round.shared.keys()
        if not calls:
            return []
        return [
            o
            for o in self._optimizers.values()
            if o is not p
            and o.stepper.stage in (Stage.ACCUMULATING, Stage.UNSCALED, Stage.CLIPPED)
            and o.round.shared.keys() & calls
        ]

    def _decide(self, prepared: list[Prepared]) -> None:
        """The overflow verdicts of `prepared` (unscaled already), with one decision per shared
        backward call: when the loss of a call made for several optimizers overflowed in any of
        them, it counts as overflowed in all of them, so they all skip (as Apex skipped every
        optimizer passed to that scale_loss)."""
        bad: set[int] = set()
        for p in prepared:
            p.round.verdicts()
            bad.update(call for call, found in p.round.call_found.items() if found)
        if bad:
            for p in prepared:
                for call, i in p.round.shared.items():
                    if call in bad:
                        p.round.found[i] = True

    def _update_scalers(self, rnd: LossRound) -> None:
        """Each loss's scaler updated once per round with its verdict; a later optimizer of the
        same loss that overflowed where the first did not updates it again as an overflow."""
        for i in sorted(rnd.loss_ids):
            done = self._verdicts.get(i)
            found = rnd.found.get(i, False)
            if done is None:
                self.scalers[i].update(found)
                self._verdicts[i] = found
            elif found and not done:
                self.scalers[i].update(True)
                self._verdicts[i] = True

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Apex's layout (`loss_scaler0`, `loss_scaler1`, ...) plus `skipped_steps` (and, with
        stochastic rounding, `rounding_steps`)."""
        sd: dict[str, Any] = {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}
        sd["skipped_steps"] = self.skipped_steps
        if self._clock is not None:
            sd["rounding_steps"] = self._clock.steps
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, s in enumerate(self.scalers):
            if f"loss_scaler{i}" in state:
                s.load_state_dict(state[f"loss_scaler{i}"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self._clock is not None:
            self._clock.steps = int(state.get("rounding_steps", 0))
