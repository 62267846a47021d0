"""`AmpEngine`: executes resolved `Properties` around a plain PyTorch training step.

The trainer calls, per step: `with engine.autocast(): loss = ...`, `engine.backward(loss)`,
optionally `engine.clip_grad_norm_(max_norm)`, `engine.step(optimizer)`,
`engine.zero_grad(optimizer)`.
The engine never wraps `optimizer.step` (LR schedulers wrap it themselves; the Apex facade in
`amp.py` does, on the instance), and reads the non-finite flags from the device at most once per
step, only when a check is needed at all (dynamic scale, or a static scale other than 1).

Stages. Each prepared optimizer is in one `Stage`; every call checks it and moves it on. The
usual round is

    READY --backward--> ACCUMULATING [--unscale_--> UNSCALED] [--clip_grad_norm_--> CLIPPED]
          --step--> STEPPED --zero_grad--> READY

and in full (rows: the stage; columns: the call; entries: the next stage):

    stage         backward        unscale_, settle   clip_grad_norm_   step      zero_grad
    READY         ACCUMULATING    UNSCALED           CLIPPED           STEPPED   READY
    ACCUMULATING  ACCUMULATING    UNSCALED           CLIPPED           STEPPED   READY
    UNSCALED      ACCUMULATING 1  (no-op) 2          CLIPPED           STEPPED   READY
    CLIPPED       error           (no-op) 3          CLIPPED           STEPPED   READY
    STEPPED       ACCUMULATING 4  error              error             error     READY

    1 the unscaled gradients go to the fp32 stash; the new ones accumulate scaled
    2 as torch's GradScaler: unscale_ twice is a no-op (settle only re-reads the verdict)
    3 unscale_ applies a planned fused step's multiplier to .grad, else does nothing
    4 a new round; .grad is kept as it is, as plain torch keeps it without zero_grad

Several losses and gradient accumulation stay in ACCUMULATING; the Apex facade's `scale_loss`
ends in `settle` (UNSCALED) and its `optimizer.step()` steps from there. One backward over
several optimizers (`scale_loss(loss, loss_id, [a, b])`) gets one overflow decision: the first of
them to step or settle checks the others too, and when the loss overflowed in any of them, all of
them skip (as Apex skipped every optimizer of that `scale_loss`; `settle_all` settles several at
once). The errors are RuntimeErrors that name the call,
the stage and what to do: `step`, `unscale_`, `clip_grad_norm_` or `settle` after `step` and
before the next backward (the gradients were already stepped or skipped), and `backward` after
`clip_grad_norm_` and before the step. A round's data (which losses' scaled gradients sit in
`.grad`, the stash of earlier losses, the device flags and verdicts, a planned fused step) lives
in one `_Round`, replaced at each step and `zero_grad`.

Execution paths (`paths.py`), one per optimizer: with the compiled kernels (`runner.csrc`,
`kernels="auto"`) and precision work to fuse (fp32 masters, or a loss-scale check), a step that
nobody unscaled first runs straight from the model's scaled gradients: a read-only check pass
(or the clipping norm, which also flags non-finite values), the single host read, then one fused
pass that unscales, clips, updates the fp32 params and their optimizer state and writes the
16-bit model copy (`fused.py`). No fp32 master gradients are materialised on that path. When
something asked for the unscaled gradients first (`unscale_`, several losses, the facade's
`scale_loss`), one kernel pass copies, unscales and checks them into the masters' `.grad`, and
the fused step reads those. Without kernels (a failed build, `kernels="torch"`) the same steps
run on torch's own ops; an optimizer the kernels do not implement steps with its own `step`
after the kernels' copy and unscale. A plain fp32 run (O0) has nothing to fuse and always steps
with its optimizer.

Gradient accumulation: several `backward` calls of one loss before one `step` accumulate scaled
gradients, unscaled once at the step. Several losses (`num_losses`, `loss_id`): before a
different loss's backward, the gradients already accumulated are unscaled by their own scaler
(its overflow flag recorded against that loss) and moved into fp32 stash buffers, which are added
back after the last loss is unscaled; the step is skipped if any loss overflowed, and each scaler
updates once per round with its own loss's verdict, however many optimizers step that loss.

O1 here is plain `torch.autocast`; Apex's own O1 (its function lists, registered casts, the
binary_cross_entropy ban: `autocast.py`, `apex_o1.py`) runs instead only with
`patch_functions=True`, which the Apex facade (`amp.initialize`) passes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner import csrc
from runner.precision import fp8, layers, paths
from runner.precision.autocast import autocast_context
from runner.precision.casting import IOCastHooks, cast_model, install_output_cast
from runner.precision.checks import concrete_device
from runner.precision.master import MasterSet, MasterWeights
from runner.precision.properties import Properties
from runner.precision.scaler import LossScaler


class Stage(enum.Enum):
    """Where one optimizer is in its round (see the module docstring for the transitions)."""

    READY = "ready"  # no gradients of this round yet (prepared, or zero_grad)
    ACCUMULATING = "accumulating"  # scaled gradients of one or more backward calls
    UNSCALED = "unscaled"  # the stepped .grad hold true values (unscale_, settle)
    CLIPPED = "clipped"  # clipped: true values in .grad, or a planned fused step
    # holds the clipping coefficient in its multiplier
    STEPPED = "stepped"  # stepped or skipped; the next backward starts a new round


# The calls refused after the step (stage STEPPED): what happened, why it is wrong, what to do.
_AFTER_STEP = {
    "step": (
        "step() called twice without a backward in between",
        "this round's gradients were already stepped (or the step skipped), and stepping "
        "them again would apply them twice",
        "Run the next round's backward (after zero_grad) before stepping again.",
    ),
    "clip_grad_norm_": (
        "clip_grad_norm_() called after step()",
        "the step has already used the gradients, so clipping them now changes nothing",
        "Clip between backward and step: backward, clip_grad_norm_, step, zero_grad.",
    ),
    "unscale_": (
        "unscale_() called after step()",
        "the step has already used the gradients",
        "Call unscale_ between backward and step (step unscales by itself when nobody did).",
    ),
    "settle": (
        "settle() called after step()",
        "the step has already used the gradients",
        "Settle between backward and step (the Apex facade does so at the end of scale_loss).",
    ),
}

_BACKWARD_AFTER_CLIP = (
    "backward after clip_grad_norm_ and before step: the clipped gradients "
    "would be mixed with new ones"
)


@dataclass
class _Round:
    """One optimizer's data between its first backward and its step (or zero_grad)."""

    # loss ids whose *scaled* gradients sit in the model's .grad (accumulated, one scale)
    scaled_ids: set[int] = field(default_factory=set)
    # every loss id that contributed gradients this round (their scalers update at the step)
    loss_ids: set[int] = field(default_factory=set)
    # fp32 sums of already unscaled gradients of earlier losses: id(stepped param) -> tensor
    stash: dict[int, torch.Tensor] = field(default_factory=dict)
    flags: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # device flags per loss
    found: dict[int, bool] = field(default_factory=dict)  # resolved flags per loss
    # a fused step planned from the scaled gradients by a lazy clip (its multiplier set)
    planned: Optional[paths.ScaledStep] = None
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

    def verdicts(self, flag_reducer: Optional[Callable[[torch.Tensor], Any]]) -> dict[int, bool]:
        """The per-loss overflow verdicts of this round (and those of the shared backward calls,
        in `call_found`): at most one host sync per call."""
        pending = [(self.found, i, flags) for i, flags in self.flags.items() if flags]
        pending += [(self.call_found, c, flags) for c, flags in self.call_flags.items() if flags]
        if pending:
            sums = []
            for _, _, flags in pending:
                f = flags[0]
                for o in flags[1:]:
                    f = f + o.to(f.device)
                sums.append(f)
            if len(sums) == 1 and flag_reducer is None:
                values = [sums[0].item()]
            else:
                dev = sums[0].device
                combined = torch.cat([s.to(dev).reshape(1) for s in sums])
                if flag_reducer is not None:
                    flag_reducer(combined)
                values = combined.tolist()
            for (table, key, flags), v in zip(pending, values):
                table[key] = table.get(key, False) or v != 0
                flags.clear()
        return self.found


@dataclass
class _Prepared:
    """What the engine keeps per prepared optimizer."""

    optimizer: torch.optim.Optimizer
    path: paths.ExecutionPath
    models: list[nn.Module] = field(default_factory=list)  # their grads cleared by zero_grad
    masters: Optional[MasterWeights] = None
    n_groups: int = 0
    stage: Stage = Stage.READY
    round: _Round = field(default_factory=_Round)

    def refuse_after_step(self, call: str) -> None:
        """`call` (a key of `_AFTER_STEP`) is refused in stage STEPPED."""
        if self.stage is Stage.STEPPED:
            what, why, fix = _AFTER_STEP[call]
            raise RuntimeError(
                f"{what} (this optimizer's stage: '{self.stage.value}'): {why}. {fix}"
            )

    def refuse_backward(self) -> None:
        """A backward is refused in stage CLIPPED."""
        if self.stage is Stage.CLIPPED:
            raise RuntimeError(
                f"{_BACKWARD_AFTER_CLIP} (this optimizer's stage: "
                f"'{self.stage.value}'). Call step() (or zero_grad()) first."
            )

    def new_round(self, stage: Stage) -> None:
        self.stage = stage
        self.round = _Round()


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
        patch_functions: bool = False,
        seed: int = 0,
        masters_for_half_params: bool = False,
        layer_rules: tuple = (),
        sharded: bool = False,
    ):
        if num_losses < 1:
            raise ValueError(f"num_losses must be >= 1, got {num_losses}")
        self.properties = properties
        self.device = concrete_device(device)  # "cuda" -> "cuda:0", as its tensors say
        self.cast_model_outputs = cast_model_outputs
        # Apex's function patches in the O1 region (the facade's); the runner's O1 is autocast
        self.patch_functions = patch_functions
        # fp32 masters for the 16-bit parameters a model brought itself, without a model cast
        # (the facade's `cast_model_type=False` with master weights, as Apex's O2 made them)
        self.masters_for_half_params = masters_for_half_params
        bounds = {
            k: v
            for k, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale))
            if v is not None
        }
        self.scalers = [LossScaler.from_properties(properties, **bounds) for _ in range(num_losses)]
        self._scales = paths.ScaleTensors(self.device)
        # stochastic rounding's random key: the run's seed and the count of rounded steps
        self._clock = paths.RoundingClock(seed) if properties.stochastic_rounding else None
        # the float type the optimizer keeps its state in where that is not the stepped params'
        # own (optimizer_state); None: torch's layout (the params' types), or a low-bit format
        self._state_dtype = None if properties.state_follows_weights else properties.state_dtype
        # which Linear layers run in fp8 (fp8_linear), once a model is cast
        self.fp8: Optional[fp8.Conversion] = None
        # precision per layer (runner.precision.layers): the entries of precision.layer_plan and
        # precision.layers, and the plan they make for the (first) model cast
        self.layer_rules: tuple[layers.LayerRule, ...] = tuple(layer_rules)
        # the model is sharded with FSDP2 after its cast (runner.run.fsdp): with master weights
        # its fp32 shards are the masters and FSDP's param_dtype casts for the compute, so the
        # engine casts nothing but the output and keeps no copies
        self.sharded = sharded
        self.layer_plan: Optional[layers.LayerPlan] = None
        self._enforcements: list[layers.Enforcement] = []
        self._optimizers: dict[int, _Prepared] = {}
        # the compiled kernels for this device (None: torch's ops); see runner.csrc
        self._kernels: Optional[csrc.Kernels] = csrc.load(self.device, kernels)
        # data-parallel training: sums the non-finite flags over the ranks in place before the
        # host read, so that every rank skips (and backs off) together
        self.flag_reducer = flag_reducer
        self.skipped_steps = 0
        self._master_set = MasterSet()
        self._io_hooks: list[IOCastHooks] = []
        self._model_hooks: list[RemovableHandle] = []
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
        for st in self._optimizers.values():
            st.path = paths.choose(
                kernels, self.device, self._scales, self._clock, self._state_dtype
            )

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
        """The model half of `prepare`: the layer plan (precision per layer), fp8 Linear layers
        (fp8_linear, or the plan's fp8 layers), the cast (each planned layer's weights in its
        type), IO hooks, the plan's input casts or local autocasts, fp32 state-dict hooks."""
        p = self.properties
        plan = layers.assign(model, self.layer_rules, p)  # a glob matching nothing: ConfigError
        if self.layer_plan is None:
            self.layer_plan = plan
        fp8_names = plan.fp8_layers()
        if p.fp8_linear is not None or fp8_names:
            only, reasons = None, {}
            if self.layer_rules:
                only = set(fp8_names)
                for layer in plan.layers:
                    if layer.rule is not None and layer.name not in only:
                        reasons[layer.name] = f"{layer.planned}: {layer.why}"
                    elif p.fp8_linear is None and layer.name not in only:
                        reasons[layer.name] = "the level's type (fp8 only for the plan's layers)"
            conversion = fp8.convert(
                model,
                p.fp8_linear or "tensorwise",
                emulate=not self._fp8_hardware(),
                only=only,
                reasons=reasons,
                fsdp_all_gather=self.sharded,
            )
            if self.fp8 is None:
                self.fp8 = conversion
            else:  # several models: one listing
                self.fp8.converted += conversion.converted
                self.fp8.skipped += conversion.skipped
                self.fp8.planned_out += conversion.planned_out
        hooks = None
        if self.sharded and p.uses_master_weights:  # FSDP's param_dtype casts the compute
            hooks = install_output_cast(model, self.cast_model_outputs or torch.float32)
        elif p.cast_model_type is not None:
            deviating = p.casts_to_half and plan.deviates
            hooks = cast_model(
                model,
                p.cast_model_type,
                p.keep_batchnorm_fp32,
                self.cast_model_outputs,
                layer_dtypes=plan.weight_dtypes(model) if self.layer_rules else None,
                cast_inputs=not deviating,
            )
        elif self.cast_model_outputs is not None:
            hooks = install_output_cast(model, self.cast_model_outputs)
        if hooks is not None:
            self._io_hooks.append(hooks)
        if self.layer_rules:
            self._enforcements.append(layers.enforce(model, plan, p, self.device.type))
        if p.casts_to_half and not self.sharded:
            self._model_hooks += self._master_set.install_state_dict_hooks(model)
        return model

    def _fp8_hardware(self) -> bool:
        """Whether this device has fp8 Tensor Cores (else torchao emulates fp8)."""
        from runner.precision.checks import FP8_MIN_CAPABILITY

        return (
            self.device.type == "cuda"
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability(self.device) >= FP8_MIN_CAPABILITY
        )

    def add_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module] = ()
    ) -> torch.optim.Optimizer:
        """The optimizer half of `prepare`, after its models were cast: fp32 masters for its
        16-bit parameters where asked; `models` get their grads cleared by `zero_grad`. The
        optimizer's execution path (kernels or torch's ops) is chosen here, once."""
        st = self._optimizers.get(id(optimizer))
        if st is None:
            st = self._optimizers[id(optimizer)] = _Prepared(
                optimizer,
                paths.choose(
                    self._kernels, self.device, self._scales, self._clock, self._state_dtype
                ),
            )
        st.models.extend(m for m in models if all(m is not o for o in st.models))
        if (
            self.properties.uses_master_weights or self.masters_for_half_params
        ) and not self.sharded:
            if st.masters is None:
                st.masters = MasterWeights(optimizer)
                self._master_set.add(st.masters)
            else:  # one optimizer over several models, prepared one by one
                st.masters.add_new_half_params()
        st.n_groups = len(optimizer.param_groups)
        return optimizer

    def remove_hooks(self) -> None:
        """Remove the input/output cast and state-dict hooks (and a layer plan's input casts and
        local autocasts) from every prepared model."""
        for h in self._io_hooks:
            h.remove()
        self._io_hooks = []
        for enforcement in self._enforcements:
            enforcement.remove()
        self._enforcements = []
        for h in self._model_hooks:
            h.remove()
        self._model_hooks = []

    def release(self) -> None:
        """Undo `prepare` as far as it can be undone: hooks removed, optimizers get the model's
        parameters back (with the master values, rounded). The model stays in its cast type."""
        self.remove_hooks()
        self._master_set.release()
        self._optimizers.clear()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [st.optimizer for st in self._optimizers.values()]

    def _state(self, optimizer: Optional[torch.optim.Optimizer]) -> _Prepared:
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

    # ---- model state dicts under a 16-bit cast (the hooks live with the masters) -----------
    def refresh_masters(
        self, skip: Optional[set[int]] = None, only: Optional[set[int]] = None
    ) -> None:
        """Re-seed the masters from their model parameters (after loading weights into the
        model other than through `model.load_state_dict`, e.g. `param.copy_`); `skip` holds ids
        of masters to leave alone, `only` (if given) ids of the model parameters to take."""
        self._master_set.refresh(skip, only)

    def load_model_state(self, model: nn.Module, state_dict: dict, strict: bool = True):
        """`model.load_state_dict(state_dict)` with the masters re-seeded (fp32 values of the
        state dict exactly, else from the model)."""
        return model.load_state_dict(state_dict, strict=strict)  # the hooks re-seed the masters

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
        scale = self.scalers[loss_id].scale
        loss = loss.float()
        if scale != 1.0:
            loss = loss * scale
        return loss

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """`(loss.float() * scale).backward()`; no multiply when the scale is exactly 1."""
        self.scale_loss(loss, loss_id).backward()

    def _before_backward(self, st: _Prepared, loss_id: int) -> None:
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
    def _stash_grads(self, st: _Prepared) -> None:
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

    def _unscale(self, st: _Prepared) -> None:
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

    def _scaled_step(self, st: _Prepared) -> Optional[paths.ScaledStep]:
        """The step straight from the model's scaled gradients: the one a lazy clip planned, or
        a new plan when one loss's gradients sit in place with nothing unscaled or stashed and
        the path can plan it (kernels, precision work to fuse, an optimizer they implement)."""
        rnd = st.round
        if rnd.planned is not None:
            return rnd.planned
        if rnd.stash or len(rnd.scaled_ids) != 1:
            return None
        return st.path.plan(st.optimizer, st.masters, self.scalers[min(rnd.scaled_ids)])

    def _update_scalers(self, rnd: _Round) -> None:
        for i in sorted(rnd.loss_ids):
            found = rnd.found.get(i, False)
            done = self._verdicts.get(i)
            if done is None:
                self.scalers[i].update(found)
                self._verdicts[i] = found
            elif found and not done:
                self.scalers[i].update(True)
                self._verdicts[i] = True

    def _sharing(self, st: _Prepared) -> list[_Prepared]:
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

    def _decide(self, states: list[_Prepared]) -> None:
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
        **kwargs: Any,
    ) -> bool:
        """Unscale if not done, then skip (non-finite grads) or step; masters -> model.

        Each scaler whose loss contributed to this step updates once per round (backing off only
        for its own loss's overflow). `step_fn` replaces `optimizer.step` (the Apex facade passes
        the unwrapped step) where the kernels do not step. Returns True when the optimizer
        stepped."""
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
        # The only host sync of the step, and none when no check ran.
        self._decide([st, *sharing])
        found_inf = any(rnd.found.values())
        if found_inf:
            self.skipped_steps += 1
        else:
            st.path.apply(st.optimizer, st.masters, planned, step_fn, args, kwargs)
        self._update_scalers(rnd)
        st.new_round(Stage.STEPPED)
        return not found_inf

    def zero_grad(
        self, optimizer: Optional[torch.optim.Optimizer] = None, set_to_none: bool = True
    ) -> None:
        """Model and master grads cleared (to None by default; the masters' grad buffers are kept
        for reuse). Also forgets a pending unscale or stash, so a step abandoned by the caller
        does not leak into the next one: the optimizer is READY again."""
        st = self._state(optimizer)
        params = list(paths.stepped_params(st.optimizer))
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
        st.new_round(Stage.READY)

    # ---- introspection and checkpoints -------------------------------------------------------
    def master_params(
        self, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> Iterator[torch.Tensor]:
        """What the optimizer steps: the fp32 masters under master weights, else the model's."""
        return paths.stepped_params(self._state(optimizer).optimizer)

    def masters(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[MasterWeights]:
        """The model<->master pairing of `optimizer`, or None without master weights."""
        return self._state(optimizer).masters

    @property
    def loss_scale(self) -> float:
        return self.scalers[0].scale

    def state_dict(self) -> dict[str, Any]:
        """Apex layout (`loss_scaler0`, ...) plus `skipped_steps` (and, with stochastic
        rounding, `rounding_steps`: the count that keys the next step's random bits)."""
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
