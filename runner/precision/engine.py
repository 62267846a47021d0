"""`AmpEngine`: executes resolved `Properties` around a plain PyTorch training step.

The trainer calls, per step: `with engine.autocast(): loss = ...`, `engine.backward(loss)`,
optionally `engine.clip_grad_norm_(max_norm)`, `engine.step(optimizer)`,
`engine.zero_grad(optimizer)`.
The engine never wraps `optimizer.step` (LR schedulers wrap it themselves; the Apex facade in
`amp.py` does, on the instance), and reads the non-finite flags from the device at most once per
step, only when a check is needed at all (dynamic scale, or a static scale other than 1).

Kernels (`runner.csrc`, `kernels="auto"`): where there is precision work to fuse (fp32 masters,
or a loss-scale check), a step that nobody unscaled first runs straight from the model's scaled
gradients: a read-only check pass (or the clipping norm, which also flags non-finite values),
the single host read, then one fused pass that unscales, clips, updates the fp32 params and
their optimizer state and writes the 16-bit model copy (`fused.py`). No fp32 master gradients
are materialised on that path. When something asked for the unscaled gradients first
(`unscale_`, several losses, the facade's `scale_loss`), one kernel pass copies, unscales and
checks them into the masters' `.grad`, and the fused step reads those. Without kernels (a failed
build, `kernels="torch"`, an optimizer the kernels do not implement) the same steps run on
torch's own ops. A plain fp32 run (O0) has nothing to fuse and always steps with its optimizer.

Gradient accumulation: several `backward` calls of one loss before one `step` accumulate scaled
gradients, unscaled once at the step. Several losses (`num_losses`, `loss_id`): before a
different loss's backward, the gradients already accumulated are unscaled by their own scaler
(its overflow flag recorded against that loss) and moved into fp32 stash buffers, which are added
back after the last loss is unscaled; the step is skipped if any loss overflowed, and each scaler
updates once per round with its own loss's verdict, however many optimizers step that loss.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner import csrc
from runner.precision import fused
from runner.precision.autocast import autocast_context
from runner.precision.casting import IOCastHooks, cast_model, install_output_cast
from runner.precision.master import MasterWeights
from runner.precision.properties import HALF_DTYPES, Properties
from runner.precision.scaler import LossScaler


class _EngineHook:
    """A model state-dict hook that calls an engine method through a weak reference: the model
    stays picklable (pickling drops the engine, and the unpickled hook does nothing) and does not
    keep the engine alive; a deep copy of the model shares the engine (torch tags hooks with
    attributes, which bound methods refuse, so this is an object, not a bound method)."""

    def __init__(self, engine: "AmpEngine", method: str):
        self._engine: Optional[weakref.ref] = weakref.ref(engine)
        self._method = method

    def __call__(self, *args: Any) -> Any:
        engine = self._engine() if self._engine is not None else None
        return None if engine is None else getattr(engine, self._method)(*args)

    def __getstate__(self) -> dict:
        return {"_method": self._method}

    def __setstate__(self, state: dict) -> None:
        self._method = state["_method"]
        self._engine = None


@dataclass
class _OptimizerState:
    """What the engine tracks per prepared optimizer between backward and step (one "round")."""

    models: list[nn.Module] = field(default_factory=list)
    masters: Optional[MasterWeights] = None
    n_groups: int = 0
    # loss ids whose *scaled* gradients sit in the model's .grad (accumulated, one scale)
    scaled_ids: set[int] = field(default_factory=set)
    # every loss id that contributed gradients this round (their scalers update at the step)
    loss_ids: set[int] = field(default_factory=set)
    # fp32 sums of already unscaled gradients of earlier losses: id(stepped param) -> tensor
    stash: dict[int, torch.Tensor] = field(default_factory=dict)
    flags: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # device flags per loss
    found: dict[int, bool] = field(default_factory=dict)               # resolved flags per loss
    unscaled: bool = False  # the stepped .grad hold the final, unscaled values
    clipped: bool = False
    # kernels: the fused step's work and gradient multiplier (inverse scale times the clipping
    # coefficient) once a lazy clip computed them; applied by the step (or by unscale_)
    plans: Optional[list[fused.GroupPlan]] = None
    multiplier: Optional[torch.Tensor] = None

    def reset(self) -> None:
        self.scaled_ids.clear()
        self.loss_ids.clear()
        self.stash.clear()
        self.flags.clear()
        self.found.clear()
        self.unscaled = False
        self.clipped = False
        self.plans = None
        self.multiplier = None


class AmpEngine:
    """Casting, autocast, loss scaling and master weights for one run."""

    def __init__(
        self,
        properties: Properties,
        device: torch.device | str,
        num_losses: int = 1,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: Optional[float] = None,
        cast_model_outputs: Optional[torch.dtype] = None,
        kernels: str = "auto",
        flag_reducer: Optional[Callable[[torch.Tensor], Any]] = None,
    ):
        if num_losses < 1:
            raise ValueError(f"num_losses must be >= 1, got {num_losses}")
        self.properties = properties
        self.device = torch.device(device)
        self.cast_model_outputs = cast_model_outputs
        bounds = {k: v for k, v in (("min_loss_scale", min_loss_scale),
                                    ("max_loss_scale", max_loss_scale)) if v is not None}
        self.scalers = [LossScaler.from_properties(properties, **bounds)
                        for _ in range(num_losses)]
        # the compiled kernels for this device (None: torch's ops); see runner.csrc
        self.kernels: Optional[csrc.Kernels] = csrc.load(self.device, kernels)
        self._scale_tensors: dict[float, torch.Tensor] = {}
        # data-parallel training: sums the non-finite flags over the ranks in place before the
        # host read, so that every rank skips (and backs off) together
        self.flag_reducer = flag_reducer
        self.skipped_steps = 0
        self._optimizers: dict[int, tuple[torch.optim.Optimizer, _OptimizerState]] = {}
        self._io_hooks: list[IOCastHooks] = []
        self._model_hooks: list[RemovableHandle] = []
        # loss id -> the overflow verdict its scaler was updated with since that loss's last
        # backward (absent: not updated yet). Several optimizers stepping one loss's gradients
        # update its scaler once (backing off if any of them overflowed).
        self._round: dict[int, bool] = {}

    # ---- setup -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        """Cast `model` per the properties and give `optimizer` fp32 masters where asked.

        `model` must already be on the device. Returns the same objects, modified in place.
        With master weights, `model.state_dict()` returns fp32 tensors (the masters' exact values
        for parameters that have one) and `model.load_state_dict(sd)` also re-seeds the masters
        (from fp32 values in `sd` when present, else from the loaded model).
        """
        self.cast(model)
        if optimizer is not None:
            self.add_optimizer(optimizer, [model])
        return model, optimizer

    def cast(self, model: nn.Module) -> nn.Module:
        """The model half of `prepare`: cast, IO hooks, fp32 state-dict hooks."""
        p = self.properties
        hooks = None
        if p.cast_model_type is not None:
            hooks = cast_model(model, p.cast_model_type, p.keep_batchnorm_fp32,
                               self.cast_model_outputs)
        elif self.cast_model_outputs is not None:
            hooks = install_output_cast(model, self.cast_model_outputs)
        if hooks is not None:
            self._io_hooks.append(hooks)
        if p.casts_to_half:
            # torch < 2.5 has the state-dict post hook under its private name only
            register_state_hook = getattr(model, "register_state_dict_post_hook", None) or \
                model._register_state_dict_hook
            self._model_hooks += [
                register_state_hook(_EngineHook(self, "_fp32_state_hook")),
                model.register_load_state_dict_pre_hook(_EngineHook(self, "_load_pre_hook")),
                model.register_load_state_dict_post_hook(_EngineHook(self, "_load_post_hook")),
            ]
        return model

    def add_optimizer(self, optimizer: torch.optim.Optimizer,
                      models: list[nn.Module] = ()) -> torch.optim.Optimizer:
        """The optimizer half of `prepare`, after its models were cast: fp32 masters for its
        16-bit parameters where asked; `models` get their grads cleared by `zero_grad`."""
        _, state = self._optimizers.setdefault(id(optimizer), (optimizer, _OptimizerState()))
        state.models.extend(m for m in models if all(m is not o for o in state.models))
        if self.properties.uses_master_weights:
            if state.masters is None:
                state.masters = MasterWeights(optimizer)
            else:  # one optimizer over several models, prepared one by one
                state.masters.add_new_half_params()
        state.n_groups = len(optimizer.param_groups)
        return optimizer

    def remove_hooks(self) -> None:
        """Remove the input/output cast and state-dict hooks from every prepared model."""
        for h in self._io_hooks:
            h.remove()
        self._io_hooks = []
        for h in self._model_hooks:
            h.remove()
        self._model_hooks = []

    def release(self) -> None:
        """Undo `prepare` as far as it can be undone: hooks removed, optimizers get the model's
        parameters back (with the master values, rounded). The model stays in its cast type."""
        self.remove_hooks()
        for _, st in self._optimizers.values():
            if st.masters is not None:
                st.masters.release()
                st.masters = None
        self._optimizers.clear()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for opt, _ in self._optimizers.values()]

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

    def sync_param_groups(self, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
        """After `optimizer.add_param_group`: give new 16-bit params fp32 masters (also done
        automatically at the next unscale/step). Returns how many masters were added."""
        optimizer, st = self._state(optimizer)
        st.n_groups = len(optimizer.param_groups)
        if st.masters is None:
            return 0
        return st.masters.add_new_half_params()

    # ---- model state dicts under a 16-bit cast -------------------------------------------
    def _master_map(self) -> dict[int, nn.Parameter]:
        out: dict[int, nn.Parameter] = {}
        for _, st in self._optimizers.values():
            if st.masters is not None:
                out.update(st.masters.master_of())
        return out

    def _fp32_state_hook(self, module: nn.Module, state_dict: dict, prefix: str,
                         local_metadata: Any) -> None:
        masters = self._master_map()
        for name, param in module.named_parameters(prefix=prefix.rstrip(".") if prefix else "",
                                                   remove_duplicate=False):
            if name in state_dict and id(param) in masters:
                state_dict[name] = masters[id(param)].detach()
        for key, value in list(state_dict.items()):
            if (key.startswith(prefix) and torch.is_tensor(value)
                    and value.dtype in HALF_DTYPES):
                state_dict[key] = value.float()

    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        masters = self._master_map()
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
        # the rest from what the model now holds; only this module's own parameters (a copy of
        # the model, e.g. an EMA, carries these hooks too and must not touch the masters)
        self.refresh_masters(skip=exact, only={id(q) for q in module.parameters()})

    @torch.no_grad()
    def refresh_masters(self, skip: Optional[set[int]] = None,
                        only: Optional[set[int]] = None) -> None:
        """Re-seed the masters from their model parameters (after loading weights into the
        model other than through `model.load_state_dict`, e.g. `param.copy_`); `skip` holds ids
        of masters to leave alone, `only` (if given) ids of the model parameters to take."""
        for _, st in self._optimizers.values():
            if st.masters is None:
                continue
            for p, m in zip(st.masters.model_params, st.masters.masters):
                if (skip is None or id(m) not in skip) and (only is None or id(p) in only):
                    m.copy_(p)

    def load_model_state(self, model: nn.Module, state_dict: dict, strict: bool = True):
        """`model.load_state_dict(state_dict)` with the masters re-seeded (fp32 values of the
        state dict exactly, else from the model)."""
        return model.load_state_dict(state_dict, strict=strict)  # the hooks re-seed the masters

    # ---- per step --------------------------------------------------------------------------
    def autocast(self) -> ContextManager:
        """Context for forward and loss: `torch.autocast` under O1-style properties, else no-op."""
        return autocast_context(self.properties, self.device)

    def _check_loss_id(self, loss_id: int) -> None:
        if not 0 <= loss_id < len(self.scalers):
            raise ValueError(f"loss_id {loss_id} out of range for num_losses={len(self.scalers)}")

    def scale_loss(self, loss: torch.Tensor, loss_id: int = 0,
                   optimizers: Optional[list[torch.optim.Optimizer]] = None) -> torch.Tensor:
        """`loss.float() * scale`, ready for `.backward()`; prepares the optimizers' gradients
        for it first. `backward(loss, loss_id)` is `scale_loss(loss, loss_id).backward()`.

        Gradients of one loss accumulate scaled (gradient accumulation; unscaled once at the
        step). Before a *different* loss's backward, the gradients already there are unscaled by
        their own scaler (overflow recorded against that loss) and moved into fp32 stash buffers,
        so each loss keeps its own scale and each scaler backs off only for its own overflow.
        """
        self._check_loss_id(loss_id)
        states = (self._optimizers.values() if optimizers is None
                  else [self._state(o) for o in optimizers])
        for opt, st in states:
            self._before_backward(opt, st, loss_id)
        self._round.pop(loss_id, None)
        scale = self.scalers[loss_id].scale
        loss = loss.float()
        if scale != 1.0:
            loss = loss * scale
        return loss

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """`(loss.float() * scale).backward()`; no multiply when the scale is exactly 1."""
        self.scale_loss(loss, loss_id).backward()

    def _before_backward(self, opt: torch.optim.Optimizer, st: _OptimizerState,
                         loss_id: int) -> None:
        if st.clipped:
            raise RuntimeError("backward after clip_grad_norm_ and before step: the clipped "
                               "gradients would be mixed with new ones")
        if st.unscaled:
            self._stash_grads(opt, st)
        elif st.scaled_ids and loss_id not in st.scaled_ids:
            pending_checks = any(self.scalers[i].needs_check for i in st.scaled_ids)
            if pending_checks or self.scalers[loss_id].needs_check:
                self.unscale_(opt)
                self._stash_grads(opt, st)
        st.scaled_ids.add(loss_id)
        st.loss_ids.add(loss_id)

    @torch.no_grad()
    def _stash_grads(self, opt: torch.optim.Optimizer, st: _OptimizerState) -> None:
        """Move the (unscaled) stepped gradients into the fp32 stash and clear the model's."""
        for p in self._stepped_params(opt):
            g = p.grad
            if g is None:
                continue
            buf = st.stash.get(id(p))
            if buf is None:
                st.stash[id(p)] = g.detach().to(torch.float32, copy=True)
            else:
                buf.add_(g)
            p.grad = None
        self._clear_model_grads(opt, st)
        st.unscaled = False

    def _clear_model_grads(self, opt: torch.optim.Optimizer, st: _OptimizerState) -> None:
        if st.masters is not None:
            for p in st.masters.model_params:
                p.grad = None
            st.masters.zero_grad()

    def unscale_(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Make the stepped gradients true fp32 values: once per step (a no-op until step after).

        O2: copy the model's half grads into the fp32 masters. Then, where a check is needed,
        unscale in place and record a non-finite flag as a device tensor (no host sync here);
        gradients stashed from earlier losses are added back. With kernels, the copy, the
        unscale and the check are one pass (and a pending lazy clip's coefficient is applied).
        """
        optimizer, st = self._state(optimizer)
        if st.unscaled:
            return
        if len(optimizer.param_groups) != st.n_groups:
            self.sync_param_groups(optimizer)
        # one scale: see _before_backward
        scaler = self.scalers[min(st.scaled_ids)] if st.scaled_ids else None
        check = scaler is not None and scaler.needs_check
        if not self._kernel_unscale(optimizer, st, scaler, check):
            if st.masters is not None:
                st.masters.copy_grads_to_master()
            if check:
                grads = [p.grad for p in self._stepped_params(optimizer) if p.grad is not None]
                self._record_flag(st, scaler.unscale_(grads))
        st.scaled_ids.clear()
        st.plans = st.multiplier = None
        if st.stash:
            with torch.no_grad():
                for p in self._stepped_params(optimizer):
                    buf = st.stash.get(id(p))
                    if buf is None:
                        continue
                    if p.grad is None:
                        p.grad = buf if buf.dtype == p.dtype else buf.to(p.dtype)
                    else:
                        p.grad.add_(buf)
            st.stash.clear()
        st.unscaled = True

    def _kernel_unscale(self, optimizer: torch.optim.Optimizer, st: _OptimizerState,
                        scaler: Optional[LossScaler], check: bool) -> bool:
        """One kernel pass: the model's 16-bit grads into the masters' fp32 `.grad`, the model's
        own fp32 grads in place, all times the multiplier, non-finite values flagged. False when
        there is nothing for the kernels to do or they cannot take these tensors."""
        if self.kernels is None or (st.masters is None and not check and st.multiplier is None):
            return False
        src, dst = st.masters.attach_grad_buffers() if st.masters is not None else ([], [])
        if check or st.multiplier is not None:
            masters = st.masters.model_of() if st.masters is not None else {}
            own = [p.grad for p in self._stepped_params(optimizer)
                   if p.grad is not None and id(p) not in masters]
            src, dst = src + own, dst + own
        if not fused.kernel_compatible(src, dst, self.device):
            return False
        if st.multiplier is not None:
            multiplier = st.multiplier
        else:
            multiplier = self._scale_tensor(1.0 / scaler.scale if check else 1.0)
        if check:
            flag = self._new_flag()
            self.kernels.ops.unscale_check(src, dst, multiplier, flag)
            self._record_flag(st, flag)
        elif src:
            self.kernels.ops.copy_scale(src, dst, multiplier)
        return True

    def _new_flag(self) -> torch.Tensor:
        """A cleared device-side found-inf flag for a kernel to raise (read at `_resolve`)."""
        return torch.zeros(1, dtype=torch.float32, device=self.device)

    def _record_flag(self, st: _OptimizerState, flag: Optional[torch.Tensor]) -> None:
        """A device-side non-finite flag counts against every loss whose gradients it covers."""
        if flag is not None:
            for i in st.scaled_ids:
                st.flags.setdefault(i, []).append(flag)

    def _scale_tensor(self, value: float) -> torch.Tensor:
        """`value` as a one-element fp32 tensor on the device, cached: the kernels take scales
        as device tensors, and the scale changes rarely."""
        t = self._scale_tensors.get(value)
        if t is None:
            if len(self._scale_tensors) > 16:
                self._scale_tensors.clear()
            t = self._scale_tensors[value] = torch.full((1,), value, dtype=torch.float32,
                                                        device=self.device)
        return t

    def _lazy_plans(self, optimizer: torch.optim.Optimizer, st: _OptimizerState
                    ) -> Optional[list[fused.GroupPlan]]:
        """The fused step's work when it can run straight from the model's scaled gradients:
        kernels loaded, precision work to fuse (masters or a check), one loss's gradients in
        place and nothing unscaled or stashed yet, an optimizer the kernels implement."""
        if self.kernels is None or st.unscaled or st.stash or len(st.scaled_ids) != 1:
            return None
        if st.masters is None and not self.scalers[min(st.scaled_ids)].needs_check:
            return None
        model_of = st.masters.model_of() if st.masters is not None else {}

        def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
            return model_of.get(id(p), p).grad

        return fused.plan(optimizer, self.device, grad_of, lambda p: model_of.get(id(p)))

    def _resolve(self, st: _OptimizerState) -> dict[int, bool]:
        """The per-loss overflow verdicts of this round: at most one host sync per call."""
        pending = [(i, flags) for i, flags in st.flags.items() if flags]
        if pending:
            sums = []
            for _, flags in pending:
                f = flags[0]
                for o in flags[1:]:
                    f = f + o.to(f.device)
                sums.append(f)
            if len(sums) == 1 and self.flag_reducer is None:
                values = [sums[0].item()]
            else:
                dev = sums[0].device
                combined = torch.cat([s.to(dev).reshape(1) for s in sums])
                if self.flag_reducer is not None:
                    self.flag_reducer(combined)
                values = combined.tolist()
            for (i, flags), v in zip(pending, values):
                st.found[i] = st.found.get(i, False) or v != 0
                flags.clear()
        return st.found

    def _update_scalers(self, st: _OptimizerState) -> None:
        for i in sorted(st.loss_ids):
            found = st.found.get(i, False)
            done = self._round.get(i)
            if done is None:
                self.scalers[i].update(found)
                self._round[i] = found
            elif found and not done:
                self.scalers[i].update(True)
                self._round[i] = True

    def settle(self, optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Unscale, check and update the scalers now (Apex's end of `scale_loss`); the next
        `step` of this optimizer then only steps or skips. Returns True when it will skip."""
        optimizer, st = self._state(optimizer)
        self.unscale_(optimizer)
        found = self._resolve(st)
        self._update_scalers(st)
        return any(found.values())

    def clip_grad_norm_(self, max_norm: float, optimizer: Optional[torch.optim.Optimizer] = None,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the unscaled gradients the optimizer will step (masters under O2); returns the
        total norm before clipping. Non-finite grads give a non-finite norm; the step is skipped.

        With kernels on the fused path the gradients are not rewritten: the norm comes from the
        scaled model gradients (a pass that also flags non-finite values), and the clipping
        coefficient joins the inverse scale in the multiplier the fused step applies."""
        optimizer, st = self._state(optimizer)
        plans = self._lazy_plans(optimizer, st) if float(norm_type) == 2.0 else None
        if plans is not None:
            scaler = self.scalers[min(st.scaled_ids)]
            inv = self._scale_tensor(1.0 / scaler.scale)
            flag = self._new_flag()
            total, _ = self.kernels.ops.l2norm(fused.gradients(plans), inv, flag)
            if scaler.needs_check:
                self._record_flag(st, flag)
            st.multiplier = inv * torch.clamp(max_norm / (total + 1e-6), max=1.0)
            st.plans = plans
            st.clipped = True
            return total
        self.unscale_(optimizer)
        params = [p for p in self._stepped_params(optimizer) if p.grad is not None]
        st.clipped = True
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def step(self, optimizer: Optional[torch.optim.Optimizer] = None, *args: Any,
             step_fn: Optional[Callable[..., Any]] = None, **kwargs: Any) -> bool:
        """Unscale if not done, then skip (non-finite grads) or step; masters -> model.

        Each scaler whose loss contributed to this step updates once per round (backing off only
        for its own loss's overflow). `step_fn` replaces `optimizer.step` (the Apex facade passes
        the unwrapped step) where the kernels do not step. Returns True when the optimizer
        stepped."""
        optimizer, st = self._state(optimizer)
        plans = None
        if not args and not kwargs:
            plans = st.plans if st.plans is not None else self._lazy_plans(optimizer, st)
        if plans is not None:  # fused, straight from the model's scaled gradients
            multiplier = st.multiplier
            if multiplier is None:
                scaler = self.scalers[min(st.scaled_ids)]
                if scaler.needs_check:
                    flag = self._new_flag()
                    self.kernels.ops.check_finite(fused.gradients(plans), flag)
                    self._record_flag(st, flag)
                multiplier = self._scale_tensor(1.0 / scaler.scale)
            found_inf = any(self._resolve(st).values())  # the only host sync of the step
            if not found_inf:
                fused.apply(self.kernels, optimizer, plans, multiplier)
        else:
            self.unscale_(optimizer)
            # The only host sync of the step, and none when no check ran.
            found_inf = any(self._resolve(st).values())
            if not found_inf:
                self._step_unscaled(optimizer, st, step_fn, args, kwargs)
        if found_inf:
            self.skipped_steps += 1
        self._update_scalers(st)
        st.reset()
        return not found_inf

    def _step_unscaled(self, optimizer: torch.optim.Optimizer, st: _OptimizerState,
                       step_fn: Optional[Callable[..., Any]], args: tuple, kwargs: dict) -> None:
        """The step on gradients already unscaled into `.grad`: with masters and kernels, fused
        with the copy back into the model; else the optimizer's own step, then the copy."""
        if st.masters is not None and self.kernels is not None and not args and not kwargs:
            model_of = st.masters.model_of()
            plans = fused.plan(optimizer, self.device, lambda p: p.grad,
                               lambda p: model_of.get(id(p)))
            if plans is not None:
                fused.apply(self.kernels, optimizer, plans, self._scale_tensor(1.0))
                return
        (step_fn or optimizer.step)(*args, **kwargs)
        if st.masters is not None:
            self._copy_back(st.masters)

    def _copy_back(self, masters: MasterWeights) -> None:
        """Masters (fp32) -> the model's 16-bit parameters, rounded."""
        if self.kernels is not None and fused.kernel_compatible(
                masters.masters, masters.model_params, self.device):
            self.kernels.ops.copy_scale(masters.masters, masters.model_params,
                                        self._scale_tensor(1.0))
        else:
            masters.copy_master_to_model()

    def zero_grad(self, optimizer: Optional[torch.optim.Optimizer] = None,
                  set_to_none: bool = True) -> None:
        """Model and master grads cleared (to None by default; the masters' grad buffers are kept
        for reuse). Also forgets a pending unscale or stash, so a step abandoned by the caller
        does not leak into the next one."""
        optimizer, st = self._state(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if st.masters is not None:
            params += st.masters.model_params
            st.masters.zero_grad()
        for model in st.models:
            params += list(model.parameters())
        for p in params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().requires_grad_(False)
                p.grad.zero_()
        st.reset()

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
