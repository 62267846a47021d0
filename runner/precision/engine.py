"""`AmpEngine`: executes resolved `Properties` around a plain PyTorch training step, for one loss
(one `LossScaler`) and one optimizer, as torch's `GradScaler` does: the trainer's engine.

The trainer calls, per step: `with engine.autocast(): loss = ...`, `engine.backward(loss)`,
optionally `engine.unscale_(optimizer)` (between accumulated batches) and
`engine.clip_grad_norm_(max_norm)`, `engine.step(optimizer)`, `engine.zero_grad(optimizer)`. The
models' cast is a `ModelCast` (model_cast.py), the optimizer's round an `OptimizerStepper`
(stepper.py, with the table of its stages); this class keeps the loss scaler, the overflow checks
of the round and their verdict, the skipped-step count and the state dict. How a step runs:
README.md beside this file. Several losses and optimizers are the Apex facade's
(`apex_engine.ApexEngine`).

O1 here is plain `torch.autocast`; Apex's own O1 (its function lists, registered casts, the
binary_cross_entropy ban) is the facade's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional, Union

import torch
from torch import nn

from runner import csrc
from runner.precision import fp8, layers, paths
from runner.precision.autocast import autocast_context
from runner.precision.checks import concrete_device
from runner.precision.master import MasterWeights
from runner.precision.model_cast import ModelCast
from runner.precision.recipe import Properties
from runner.precision.scaler import LossScaler
from runner.precision.stepper import OptimizerStepper, Stage

__all__ = ["AmpEngine", "Stage"]


class AmpEngine:
    """Casting, autocast, loss scaling and master weights for one run: one loss, one optimizer.

    `kernels`: the compiled kernels' backend ("auto", "fused", "torch": runner.csrc);
    `flag_reducer` (data-parallel training) sums the non-finite flags over the ranks in place
    before they are read, so that every rank skips (and backs off) together; `seed`: stochastic
    rounding's random key; `layer_rules`, `sharded`: see `ModelCast`."""

    def __init__(
        self,
        properties: Properties,
        device: torch.device | str,
        kernels: str = "auto",
        flag_reducer: Optional[Callable[[torch.Tensor], Any]] = None,
        seed: int = 0,
        layer_rules: tuple = (),
        sharded: bool = False,
    ):
        self.properties = properties
        self.device = concrete_device(device)  # "cuda" -> "cuda:0", as its tensors say
        self.scaler = LossScaler.from_properties(properties).to(self.device)
        self.model_cast = ModelCast(properties, self.device, None, layer_rules, sharded)
        self.flag_reducer = flag_reducer
        self._scales = paths.ScaleTensors(self.device)
        # stochastic rounding's random key: the run's seed and the count of rounded steps
        self._clock = paths.RoundingClock(seed) if properties.stochastic_rounding else None
        # the float type the optimizer keeps its state in where that is not the stepped params'
        # own (optimizer_state); None: torch's layout (the params' types), or a low-bit format
        self._state_dtype = None if properties.state_follows_weights else properties.state_dtype
        # the compiled kernels for this device (None: torch's ops); see runner.csrc
        self._kernels: Optional[csrc.Kernels] = csrc.load(self.device, kernels)
        self.scaler.kernels = self._kernels  # (the scale's update: one kernel op where they serve)
        self._stepper: Optional[OptimizerStepper] = None
        # skipped steps: counted on the host where the verdict was read there, else on the
        # device (`step(wait=False)`), read only when asked (`skipped_steps`)
        self._skipped_host = 0
        self._skipped_device: Optional[torch.Tensor] = None
        # this round: the device flags of its checks, and whether a backward ran (the scaler
        # updates at the step only then)
        self._flags: list[torch.Tensor] = []
        self._backward_ran = False

    @property
    def kernels(self) -> Optional[csrc.Kernels]:
        """The compiled kernels for this device, or None (torch's ops)."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: Optional[csrc.Kernels]) -> None:
        """Replacing the kernels (None: torch's ops) re-chooses the optimizer's path."""
        self._kernels = kernels
        self.scaler.kernels = kernels
        if self._stepper is not None:
            self._stepper.path = self._path()

    def _path(self) -> paths.ExecutionPath:
        return paths.choose(
            self._kernels, self.device, self._scales, self._clock, self._state_dtype
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
        """The model half of `prepare` (`ModelCast.cast`)."""
        return self.model_cast.cast(model)

    def add_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[nn.Module] = ()
    ) -> torch.optim.Optimizer:
        """The optimizer half of `prepare`, after its models were cast: fp32 masters for its
        16-bit parameters where asked; `models` get their grads cleared by `zero_grad`. The
        optimizer's execution path (kernels or torch's ops) is chosen here, once. One optimizer
        (it may be given again with more models); several are the Apex facade's."""
        if self._stepper is None:
            self._stepper = OptimizerStepper(optimizer, self._path())
        elif self._stepper.optimizer is not optimizer:
            raise RuntimeError(
                f"AmpEngine steps one optimizer, and a {type(self._stepper.optimizer).__name__} "
                "was prepared already: several optimizers (or losses) are the Apex facade's "
                "(runner.precision.amp)"
            )
        p = self.properties
        masters = p.uses_master_weights and not self.model_cast.sharded
        self._stepper.add_models(models, self.model_cast.masters if masters else None)
        return optimizer

    def _prepared(self, optimizer: Optional[torch.optim.Optimizer]) -> OptimizerStepper:
        """The stepper of `optimizer` (None: the one prepared)."""
        st = self._stepper
        if st is None:
            raise RuntimeError("no optimizer was passed to AmpEngine.prepare (or add_optimizer)")
        if optimizer is not None and optimizer is not st.optimizer:
            raise RuntimeError("this optimizer was not passed to AmpEngine.prepare")
        return st

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The prepared optimizer (None before `prepare`)."""
        return None if self._stepper is None else self._stepper.optimizer

    @property
    def layer_plan(self) -> Optional[layers.LayerPlan]:
        """The precision per layer of the (first) model cast."""
        return self.model_cast.layer_plan

    @property
    def fp8(self) -> Optional[fp8.Conversion]:
        """Which Linear layers run in fp8, once a model is cast (None: no fp8)."""
        return self.model_cast.fp8

    def remove_hooks(self) -> None:
        """Remove the cast and state-dict hooks from every prepared model (`ModelCast`)."""
        self.model_cast.remove_hooks()

    def release(self) -> None:
        """Undo `prepare` as far as it can be undone: hooks removed, the optimizer gets the
        model's parameters back (with the master values, rounded). The model stays cast."""
        self.model_cast.release()
        self._stepper = None

    def stage(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Stage:
        """Where the optimizer is in its round (see `Stage`)."""
        return self._prepared(optimizer).stage

    def sync_param_groups(self, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
        """After `optimizer.add_param_group`: give new 16-bit params fp32 masters (also done
        automatically at the next unscale/step). Returns how many masters were added."""
        return self._prepared(optimizer).sync_param_groups()

    # ---- per step --------------------------------------------------------------------------
    def autocast(self, cache_enabled: bool = True) -> ContextManager:
        """Context for forward and loss: `torch.autocast` under O1-style properties, else
        no-op. `cache_enabled=False`: no cast copies kept across the region (a forward captured
        in a CUDA graph: runner.run.whole_step)."""
        return autocast_context(self.properties, self.device, cache_enabled=cache_enabled)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss.float() * scale`, ready for `.backward()`; the optimizer's gradients made ready
        for it first (unscaled ones go to the fp32 stash, see `OptimizerStepper`). Gradients of
        several backward calls accumulate scaled, unscaled once at the step (or `unscale_`)."""
        if self._stepper is not None:
            self._stepper.refuse_backward()
            self._stepper.before_backward(self.scaler)
        self._backward_ran = True
        return self.scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """`(loss.float() * scale).backward()`; no multiply when the scale is exactly 1."""
        self.scale_loss(loss).backward()

    def unscale_(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Make the stepped gradients true fp32 values: once per round (a no-op until the step).

        O2: copy the model's half grads into the fp32 masters. Then, where a check is needed,
        unscale in place and record a non-finite flag as a device tensor (no host sync here).
        A backward after it moves these gradients to an fp32 stash (gradient accumulation of
        16-bit gradients: the trainer unscales between its accumulated batches)."""
        st = self._prepared(optimizer)
        st.refuse_after_step("unscale_")
        self._record(st.unscale())

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
        st = self._prepared(optimizer)
        st.refuse_after_step("clip_grad_norm_")
        total, flag = st.clip_grad_norm_(max_norm, norm_type)
        self._record(flag)
        return total

    def step(
        self,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *args: Any,
        wait: bool = True,
        **kwargs: Any,
    ) -> Union[bool, torch.Tensor]:
        """Unscale if not done, then skip (non-finite grads) or step; masters -> model; the loss
        scaler updates once (when a backward ran this round). Returns True when it stepped.

        `wait=False` (the trainer's): the overflow verdict stays on the device. The kernels skip
        the update on the device flag, the loss scale and the skipped-step count update there
        too, and the return value is a bool device tensor (True: stepped), so the host never
        waits for the gradients. An update the kernels do not run (torch's ops, an optimizer
        they do not implement) is taken and undone on the device where the flag is set
        (`device_skip`); only one that creates optimizer state reads the flag on the host.
        `wait=True` reads the flags once, only when a check ran at all (a dynamic scale, or a
        static one other than 1)."""
        st = self._prepared(optimizer)
        st.refuse_after_step("step")
        planned = None if args or kwargs else st.scaled_step()
        self._record(st.check(planned) if planned is not None else st.unscale())
        if not wait:
            return self._step_on_device(st, planned, args, kwargs)
        found_inf = self._read_flags()  # the only host sync of the step, none without a check
        if found_inf:
            self._count_skipped(True)
        else:
            st.apply(planned, None, args, kwargs)
        if self._backward_ran:
            self.scaler.update(found_inf)
        self._new_round(Stage.STEPPED)
        return not found_inf

    def _step_on_device(
        self,
        st: OptimizerStepper,
        planned: Optional[paths.ScaledStep],
        args: tuple,
        kwargs: dict,
    ) -> Union[bool, torch.Tensor]:
        """`step(wait=False)`: the verdict, the update, the scaler and the count on the device."""
        flag = self._device_flag()
        found = None if flag is None else flag.to(self.device)
        st.apply(planned, None, args, kwargs, found_inf=found)
        if self._backward_ran:
            self.scaler.update(flag if flag is not None else torch.zeros(1, device=self.device))
        self._new_round(Stage.STEPPED)
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
        self._prepared(optimizer).zero_grad(set_to_none)
        self._new_round(Stage.READY)

    # ---- the round's overflow checks -------------------------------------------------------
    def _record(self, flag: Optional[torch.Tensor]) -> None:
        if flag is not None:
            self._flags.append(flag)

    def _summed_flags(self) -> Optional[torch.Tensor]:
        """The round's flags summed into one one-element device tensor (non-zero: some gradient
        was inf/NaN), and over the ranks by `flag_reducer`; None when nothing was checked."""
        if not self._flags:
            return None
        f = self._flags[0]
        for other in self._flags[1:]:
            f = f + other.to(f.device)
        self._flags = []
        return f

    def _read_flags(self) -> bool:
        """The round's verdict, read on the host (one read; none when nothing was checked)."""
        f = self._summed_flags()
        if f is None:
            return False
        if self.flag_reducer is None:
            return f.item() != 0
        combined = f.reshape(1).clone()
        self.flag_reducer(combined)
        return combined.item() != 0

    def _device_flag(self) -> Optional[torch.Tensor]:
        """The round's verdict as a one-element device tensor, with no host read."""
        f = self._summed_flags()
        if f is None:
            return None
        f = f.reshape(1)
        if self.flag_reducer is not None:
            f = f.clone()
            self.flag_reducer(f)
        return f

    def _new_round(self, stage: Stage) -> None:
        self._stepper.new_round(stage)
        self._flags = []
        self._backward_ran = False

    def _count_skipped(self, skipped: bool | torch.Tensor) -> None:
        if not torch.is_tensor(skipped):
            self._skipped_host += int(skipped)
        elif self._skipped_device is None:
            self._skipped_device = skipped.to(torch.int64)
        else:
            self._skipped_device.add_(skipped)

    # ---- masters, counts, checkpoints ------------------------------------------------------
    def refresh_masters(
        self, skip: Optional[set[int]] = None, only: Optional[set[int]] = None
    ) -> None:
        """Re-seed the masters from their model parameters (after loading weights into the
        model other than through `model.load_state_dict`, e.g. `param.copy_`); `skip` holds ids
        of masters to leave alone, `only` (if given) ids of the model parameters to take."""
        self.model_cast.masters.refresh(skip, only)

    def load_model_state(self, model: nn.Module, state_dict: dict, strict: bool = True):
        """`model.load_state_dict(state_dict)` with the masters re-seeded (fp32 values of the
        state dict exactly, else from the model)."""
        return model.load_state_dict(state_dict, strict=strict)  # the hooks re-seed the masters

    def master_params(
        self, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> Iterator[torch.Tensor]:
        """What the optimizer steps: the fp32 masters under master weights, else the model's."""
        return paths.stepped_params(self._prepared(optimizer).optimizer)

    def masters(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[MasterWeights]:
        """The model<->master pairing of `optimizer`, or None without master weights."""
        return self._prepared(optimizer).masters

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a dynamic scale is read from the device)."""
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for overflowing gradients (one device read where steps
        counted there). The device count only ever grows in place, so that a step replayed
        from a CUDA graph keeps counting into it."""
        if self._skipped_device is None:
            return self._skipped_host
        return self._skipped_host + int(self._skipped_device.item())

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host = int(value)
        if self._skipped_device is not None:
            self._skipped_device.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Apex's layout (`loss_scaler0`) plus `skipped_steps` (and, with stochastic rounding,
        `rounding_steps`: the count that keys the next step's random bits)."""
        sd: dict[str, Any] = {"loss_scaler0": self.scaler.state_dict()}
        sd["skipped_steps"] = self.skipped_steps
        if self._clock is not None:
            sd["rounding_steps"] = self._clock.steps
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loss_scaler0" in state:
            self.scaler.load_state_dict(state["loss_scaler0"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self._clock is not None:
            self._clock.steps = int(state.get("rounding_steps", 0))
