"""`EngineStep`: the calls of a training step on `AmpEngine` (autocast, scale_loss and backward,
unscale_ and settle, clip_grad_norm_, step, zero_grad), each moving its optimizer's `Stage` on.

The engine never wraps `optimizer.step` (LR schedulers wrap it themselves; the Apex facade in
`amp.py` does, on the instance). `step(wait=False)` keeps the overflow verdict on the device;
`step()` reads the non-finite flags at most once, only when a check is needed at all (dynamic
scale, or a static scale other than 1). Several
losses, one backward over several optimizers, gradient accumulation and the execution paths
(kernels or torch's ops): README.md beside this file.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional, Union

import torch

from runner.precision import paths
from runner.precision.autocast import autocast_context
from runner.precision.engine_rounds import Prepared, Round, Stage
from runner.precision.recipe import Properties
from runner.precision.scaler import LossScaler


class EngineStep:
    """The per-step half of `AmpEngine` (runner.precision.engine), which sets up the attributes
    below: the prepared optimizers, one loss scaler per loss, and the run's settings."""

    properties: Properties
    device: torch.device
    patch_functions: bool  # Apex's function patches in the O1 region (the facade's)
    scalers: list[LossScaler]  # one per loss
    flag_reducer: Optional[Callable[[torch.Tensor], Any]]  # sums the ranks' non-finite flags
    _count_skipped: Callable[[Union[bool, torch.Tensor]], None]  # one more skipped step, or not
    _optimizers: dict[int, Prepared]  # id(optimizer) -> what the engine keeps for it
    _verdicts: dict[int, bool]  # loss id -> the verdict its scaler was updated with
    _backward_calls: int  # numbers the backward calls shared by several optimizers

    # ---- the prepared optimizers -----------------------------------------------------------
    def _state(self, optimizer: Optional[torch.optim.Optimizer]) -> Prepared:
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
            raise RuntimeError("this optimizer was not passed to AmpEngine.prepare") from None

    def stage(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Stage:
        """Where `optimizer` is in its round (see `Stage`)."""
        return self._state(optimizer).stage

    def sync_param_groups(self, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
        """After `optimizer.add_param_group`: give new 16-bit params fp32 masters (also done
        automatically at the next unscale/step). Returns how many masters were added."""
        st = self._state(optimizer)
        st.n_groups = len(st.optimizer.param_groups)
        if st.masters is None:
            return 0
        return st.masters.add_new_half_params()

    # ---- per step --------------------------------------------------------------------------
    def autocast(self) -> ContextManager:
        """Context for forward and loss: `torch.autocast` under O1-style properties (with Apex's
        function patches only when the engine was made with `patch_functions`), else no-op."""
        return autocast_context(self.properties, self.device, patch_functions=self.patch_functions)

    def _check_loss_id(self, loss_id: int) -> None:
        if not 0 <= loss_id < len(self.scalers):
            raise ValueError(f"loss_id {loss_id} out of range for num_losses={len(self.scalers)}")

    def scale_loss(
        self,
        loss: torch.Tensor,
        loss_id: int = 0,
        optimizers: Optional[list[torch.optim.Optimizer]] = None,
    ) -> torch.Tensor:
        """`loss.float() * scale`, ready for `.backward()`; prepares the optimizers' gradients
        for it first (every prepared optimizer when `optimizers` is None). `backward(loss,
        loss_id)` is `scale_loss(loss, loss_id).backward()`.

        Gradients of one loss accumulate scaled (gradient accumulation; unscaled once at the
        step). Before a *different* loss's backward, the gradients already there are unscaled by
        their own scaler (overflow recorded against that loss) and moved into fp32 stash buffers,
        so each loss keeps its own scale and each scaler backs off only for its own overflow.
        """
        self._check_loss_id(loss_id)
        states = (
            list(self._optimizers.values())
            if optimizers is None
            else [self._state(o) for o in optimizers]
        )
        for st in states:  # (all checked before any of them moves on)
            st.refuse_backward()
        for st in states:
            self._before_backward(st, loss_id)
        if len(states) > 1:  # one backward over several optimizers: one overflow decision
            self._backward_calls += 1
            for st in states:
                st.round.shared[self._backward_calls] = loss_id
                st.round.scaled_calls.add(self._backward_calls)
        self._verdicts.pop(loss_id, None)
        return self.scalers[loss_id].scale_loss(loss)

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """`(loss.float() * scale).backward()`; no multiply when the scale is exactly 1."""
        self.scale_loss(loss, loss_id).backward()

    def _before_backward(self, st: Prepared, loss_id: int) -> None:
        rnd = st.round
        if st.stage is Stage.UNSCALED:
            self._stash_grads(st)
        elif rnd.scaled_ids and loss_id not in rnd.scaled_ids:
            pending_checks = any(self.scalers[i].needs_check for i in rnd.scaled_ids)
            if pending_checks or self.scalers[loss_id].needs_check:
                self._unscale(st)
                self._stash_grads(st)
        rnd.scaled_ids.add(loss_id)
        rnd.loss_ids.add(loss_id)
        st.stage = Stage.ACCUMULATING

    @torch.no_grad()
    def _stash_grads(self, st: Prepared) -> None:
        """Move the (unscaled) stepped gradients into the fp32 stash and clear the model's."""
        stash = st.round.stash
        for p in paths.stepped_params(st.optimizer):
            g = p.grad
            if g is None:
                continue
            buf = stash.get(id(p))
            if buf is None:
                stash[id(p)] = g.detach().to(torch.float32, copy=True)
            else:
                buf.add_(g)
            p.grad = None
        if st.masters is not None:
            for p in st.masters.model_params:
                p.grad = None
            st.masters.zero_grad()

    def unscale_(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Make the stepped gradients true fp32 values: once per round (a no-op until the step).

        O2: copy the model's half grads into the fp32 masters. Then, where a check is needed,
        unscale in place and record a non-finite flag as a device tensor (no host sync here);
        gradients stashed from earlier losses are added back. With kernels, the copy, the
        unscale and the check are one pass (and a pending lazy clip's coefficient is applied).
        """
        st = self._state(optimizer)
        st.refuse_after_step("unscale_")
        self._unscale(st)

    def _unscale(self, st: Prepared) -> None:
        rnd = st.round
        if st.stage is Stage.UNSCALED or (st.stage is Stage.CLIPPED and rnd.planned is None):
            return  # .grad already hold the true values
        if len(st.optimizer.param_groups) != st.n_groups:
            self.sync_param_groups(st.optimizer)
        # one scale: see _before_backward
        scaler = self.scalers[min(rnd.scaled_ids)] if rnd.scaled_ids else None
        multiplier = rnd.planned.multiplier if rnd.planned is not None else None
        rnd.record(st.path.unscale(st.optimizer, st.masters, scaler, multiplier))
        rnd.scaled_ids.clear()
        rnd.scaled_calls.clear()
        rnd.planned = None
        if rnd.stash:
            with torch.no_grad():
                for p in paths.stepped_params(st.optimizer):
                    buf = rnd.stash.get(id(p))
                    if buf is None:
                        continue
                    if p.grad is None:
                        p.grad = buf if buf.dtype == p.dtype else buf.to(p.dtype)
                    else:
                        p.grad.add_(buf)
            rnd.stash.clear()
        if st.stage is not Stage.CLIPPED:
            st.stage = Stage.UNSCALED

    def _scaled_step(self, st: Prepared) -> Optional[paths.ScaledStep]:
        """The step straight from the model's scaled gradients: the one a lazy clip planned, or
        a new plan when one loss's gradients sit in place with nothing unscaled or stashed and
        the path can plan it (kernels, precision work to fuse, an optimizer they implement)."""
        rnd = st.round
        if rnd.planned is not None:
            return rnd.planned
        if rnd.stash or len(rnd.scaled_ids) != 1:
            return None
        return st.path.plan(st.optimizer, st.masters, self.scalers[min(rnd.scaled_ids)])

    def _update_scalers(self, rnd: Round, flags: Optional[dict[int, torch.Tensor]] = None) -> None:
        """Each loss's scaler updated once per round with its verdict (host bools, or with
        `flags` device flags: then on the device); a later optimizer of the same loss that
        overflowed where the first did not updates it again as an overflow."""
        for i in sorted(rnd.loss_ids):
            done = self._verdicts.get(i)
            if flags is None:
                found = rnd.found.get(i, False)
                if done is None:
                    self.scalers[i].update(found)
                    self._verdicts[i] = found
                elif torch.is_tensor(done):  # (the first updated it on the device)
                    if found:
                        self.scalers[i].update(True, when=done == 0)
                        self._verdicts[i] = True
                elif found and not done:
                    self.scalers[i].update(True)
                    self._verdicts[i] = True
                continue
            flag = flags.get(i)
            if flag is None:
                flag = torch.zeros(1, device=self.device)
            if done is None:
                self.scalers[i].update(flag)
                self._verdicts[i] = flag
            else:
                before = done if torch.is_tensor(done) else float(done)
                self.scalers[i].update(True, when=(flag != 0) & (before == 0))
                self._verdicts[i] = flag + before

    def _sharing(self, st: Prepared) -> list[Prepared]:
        """The other optimizers still in a round with a backward call `st`'s round shares."""
        calls = st.round.shared.keys()
        if not calls:
            return []
        return [
            o
            for o in self._optimizers.values()
            if o is not st
            and o.stage in (Stage.ACCUMULATING, Stage.UNSCALED, Stage.CLIPPED)
            and o.round.shared.keys() & calls
        ]

    def _decide(self, states: list[Prepared]) -> None:
        """The overflow verdicts of `states` (unscaled already), with one decision per shared
        backward call: when the loss of a call made for several optimizers overflowed in any of
        them, it counts as overflowed in all of them, so they all skip (as Apex skipped every
        optimizer passed to that scale_loss)."""
        bad: set[int] = set()
        for st in states:
            st.round.verdicts(self.flag_reducer)
            bad.update(call for call, found in st.round.call_found.items() if found)
        if bad:
            for st in states:
                for call, i in st.round.shared.items():
                    if call in bad:
                        st.round.found[i] = True

    def settle(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Unscale, check and update the scalers now (Apex's end of `scale_loss`); the next
        `step` of this optimizer then only steps or skips. Returns True when it will skip."""
        return self.settle_all([optimizer] if optimizer is not None else None)

    def settle_all(self, optimizers: Optional[list[torch.optim.Optimizer]] = None) -> bool:
        """`settle` for several optimizers with one decision (Apex's `scale_loss(loss, [a, b])`):
        all of them are unscaled and checked before any scaler is updated, and when a loss they
        share overflowed in any of them, every one of them skips its next step. Returns True
        when they will skip. None: every prepared optimizer."""
        states = (
            list(self._optimizers.values())
            if optimizers is None
            else [self._state(o) for o in optimizers]
        )
        for st in states:
            st.refuse_after_step("settle")
        for st in states:
            self._unscale(st)
        self._decide(states)
        for st in states:
            self._update_scalers(st.round)
        return any(any(st.round.found.values()) for st in states)

    def clip_grad_norm_(
        self,
        max_norm: float,
        optimizer: Optional[torch.optim.Optimizer] = None,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip the unscaled gradients the optimizer will step (masters under O2); returns the
        total norm before clipping. Non-finite grads give a non-finite norm; the step is skipped.

        With kernels on the fused path the gradients are not rewritten: the norm comes from the
        scaled model gradients (a pass that also flags non-finite values), and the clipping
        coefficient joins the inverse scale in the multiplier the fused step applies."""
        st = self._state(optimizer)
        st.refuse_after_step("clip_grad_norm_")
        planned = self._scaled_step(st) if float(norm_type) == 2.0 else None
        if planned is not None:
            total, flag = st.path.clip(planned, max_norm)
            st.round.record(flag)
            st.round.planned = planned
        else:
            self._unscale(st)
            params = [p for p in paths.stepped_params(st.optimizer) if p.grad is not None]
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        st.stage = Stage.CLIPPED
        return total

    def step(
        self,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *args: Any,
        step_fn: Optional[Callable[..., Any]] = None,
        wait: bool = True,
        **kwargs: Any,
    ) -> Union[bool, torch.Tensor]:
        """Unscale if not done, then skip (non-finite grads) or step; masters -> model.

        Each scaler whose loss contributed to this step updates once per round (backing off only
        for its own loss's overflow). `step_fn` replaces `optimizer.step` (the Apex facade passes
        the unwrapped step) where the kernels do not step. Returns True when the optimizer
        stepped.

        `wait=False` (the trainer's): the overflow verdict stays on the device. The kernels
        skip the update on the device flag, the loss scale and the skipped-step count update
        there too, and the return value is a bool device tensor (True: stepped), so the host
        never waits for the gradients. An update the kernels do not run (torch's ops, an
        optimizer they do not implement) is taken and undone on the device where the flag is set
        (`device_skip`); only one that creates optimizer state reads the flag on the host first.
        A step shared with other optimizers (one backward over several) decides on the host as
        with `wait=True`."""
        st = self._state(optimizer)
        st.refuse_after_step("step")
        rnd = st.round
        planned = None if args or kwargs else self._scaled_step(st)
        if planned is not None:  # fused, straight from the model's scaled gradients
            if planned.multiplier is None:  # (a lazy clip has checked already)
                rnd.record(st.path.check(planned))
        else:
            self._unscale(st)
        # A loss whose gradients other optimizers hold as well: they are checked now too, so
        # that all of them skip when it overflowed in any (one decision per loss).
        sharing = self._sharing(st)
        for other in sharing:
            self._unscale(other)
        if not wait and not sharing:
            return self._step_on_device(st, planned, step_fn, args, kwargs)
        # The only host sync of the step, and none when no check ran.
        self._decide([st, *sharing])
        found_inf = any(rnd.found.values())
        if found_inf:
            self._count_skipped(True)
        else:
            st.path.apply(st.optimizer, st.masters, planned, step_fn, args, kwargs)
        self._update_scalers(rnd)
        st.new_round(Stage.STEPPED)
        return not found_inf

    def _step_on_device(
        self,
        st: Prepared,
        planned: Optional[paths.ScaledStep],
        step_fn: Optional[Callable[..., Any]],
        args: tuple,
        kwargs: dict,
    ) -> Union[bool, torch.Tensor]:
        """`step(wait=False)`: the verdict, the update, the scalers and the count on the device."""
        rnd = st.round
        flags = rnd.device_flags(self.flag_reducer)
        found = None
        for flag in flags.values():
            flag = flag.to(self.device)
            found = flag if found is None else found + flag
        st.path.apply(st.optimizer, st.masters, planned, step_fn, args, kwargs, found_inf=found)
        self._update_scalers(rnd, flags)
        st.new_round(Stage.STEPPED)
        if found is None:
            return True
        skipped = found.reshape(()) != 0
        self._count_skipped(skipped)
        return ~skipped

    def zero_grad(
        self, optimizer: Optional[torch.optim.Optimizer] = None, set_to_none: bool = True
    ) -> None:
        """Model and master grads cleared (to None by default; the masters' grad buffers are kept
        for reuse). Also forgets a pending unscale or stash, so a step abandoned by the caller
        does not leak into the next one: the optimizer is READY again."""
        st = self._state(optimizer)
        if st.masters is not None:
            st.masters.zero_grad()
        holders = st.grad_holders()
        for p in holders:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().requires_grad_(False)
                p.grad.zero_()
        st.new_round(Stage.READY)
