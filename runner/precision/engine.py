"""`AmpEngine`: executes resolved `Properties` around a plain PyTorch training step.

The trainer calls, per step: `with engine.autocast(): loss = ...`, `engine.backward(loss)`,
optionally `engine.clip_grad_norm_(max_norm)`, `engine.step(optimizer)`,
`engine.zero_grad(optimizer)` (those calls: `engine_step.EngineStep`; each optimizer's stage:
`engine_rounds`). This module sets a run up: the loss scalers and kernels, a model's cast and
layer plan (`cast`), each optimizer's fp32 masters and execution path (`add_optimizer`), and the
engine's state dict. How a step runs: README.md beside this file.

O1 here is plain `torch.autocast`; Apex's own O1 (its function lists, registered casts, the
binary_cross_entropy ban: `autocast.py`, `apex_o1.py`) runs instead only with
`patch_functions=True`, which the Apex facade (`amp.initialize`) passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner import csrc
from runner.precision import fp8, layers, paths
from runner.precision.casting import IOCastHooks, cast_model, install_output_cast
from runner.precision.checks import concrete_device
from runner.precision.engine_rounds import Prepared, Stage
from runner.precision.engine_step import EngineStep
from runner.precision.master import MasterSet, MasterWeights
from runner.precision.recipe import Properties
from runner.precision.scaler import LossScaler

__all__ = ["AmpEngine", "Stage"]


class AmpEngine(EngineStep):
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
        self.scalers = [
            LossScaler.from_properties(properties, **bounds).to(self.device)
            for _ in range(num_losses)
        ]
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
        self._optimizers: dict[int, Prepared] = {}
        # the compiled kernels for this device (None: torch's ops); see runner.csrc
        self._kernels: Optional[csrc.Kernels] = csrc.load(self.device, kernels)
        for scaler in self.scalers:  # (the scale's update: one kernel op where they serve)
            scaler.kernels = self._kernels
        # data-parallel training: sums the non-finite flags over the ranks in place before the
        # host read, so that every rank skips (and backs off) together
        self.flag_reducer = flag_reducer
        # skipped steps: counted on the host where the verdict was read there, else on the
        # device (`step(wait=False)`), read only when asked (`skipped_steps`)
        self._skipped_host = 0
        self._skipped_device: Optional[torch.Tensor] = None
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
        for scaler in self.scalers:
            scaler.kernels = kernels
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
            st = self._optimizers[id(optimizer)] = Prepared(
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
        """The first loss's current scale (a dynamic scale is read from the device)."""
        return self.scalers[0].scale

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

    def _count_skipped(self, skipped: bool | torch.Tensor) -> None:
        if not torch.is_tensor(skipped):
            self._skipped_host += int(skipped)
        elif self._skipped_device is None:
            self._skipped_device = skipped.to(torch.int64)
        else:
            self._skipped_device.add_(skipped)

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
