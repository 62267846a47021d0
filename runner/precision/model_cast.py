"""`ModelCast`: what an engine does to its models, and undoes: the layer plan (precision per layer),
fp8 Linear layers, the cast of the weights, the input/output cast hooks, a plan's input casts and
local autocasts, and the fp32 state-dict hooks of a 16-bit model over the masters (`MasterSet`).
Both engines hold one (the trainer's `AmpEngine`, the Apex facade's `ApexEngine`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.precision import fp8, layers
from runner.precision.casting import IOCastHooks, cast_model, install_output_cast
from runner.precision.master import MasterSet
from runner.precision.recipe import Properties


class ModelCast:
    """The models' half of an engine: `cast` each model once it is on the device.

    `layer_rules`: the entries of precision.layer_plan and precision.layers (the plan of the
    first model cast is `layer_plan`). `sharded`: the model is sharded with FSDP2 after its cast
    (runner.run.fsdp): with master weights its fp32 shards are the masters and FSDP's
    param_dtype casts for the compute, so nothing but the output is cast and no copies kept.
    `cast_model_outputs`: the type floating outputs come back in (None: the level's)."""

    def __init__(
        self,
        properties: Properties,
        device: torch.device,
        cast_model_outputs: Optional[torch.dtype] = None,
        layer_rules: tuple = (),
        sharded: bool = False,
    ):
        self.properties = properties
        self.device = device
        self.cast_model_outputs = cast_model_outputs
        self.layer_rules: tuple[layers.LayerRule, ...] = tuple(layer_rules)
        self.sharded = sharded
        self.layer_plan: Optional[layers.LayerPlan] = None
        # which Linear layers run in fp8 (fp8_linear, or the plan's fp8 layers), once cast
        self.fp8: Optional[fp8.Conversion] = None
        # the engine's fp32 masters (one `MasterWeights` per optimizer), which the state-dict
        # hooks of its 16-bit models read and re-seed
        self.masters = MasterSet()
        self._io_hooks: list[IOCastHooks] = []
        self._enforcements: list[layers.Enforcement] = []
        self._model_hooks: list[RemovableHandle] = []

    def cast(self, model: nn.Module) -> nn.Module:
        """The layer plan, fp8 Linear layers (fp8_linear, or the plan's fp8 layers), the cast
        (each planned layer's weights in its type), IO hooks, the plan's input casts or local
        autocasts, fp32 state-dict hooks. Returns `model`, changed in place."""
        p = self.properties
        plan = layers.assign(model, self.layer_rules, p)  # a glob matching nothing: ConfigError
        if self.layer_plan is None:
            self.layer_plan = plan
        if p.fp8_linear is not None or plan.fp8_layers():
            self._convert_fp8(model, plan)
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
            self._model_hooks += self.masters.install_state_dict_hooks(model)
        return model

    def _convert_fp8(self, model: nn.Module, plan: layers.LayerPlan) -> None:
        """fp8 Linear layers (torchao): every Linear with `fp8_linear`, or the plan's fp8 layers
        only, each layer left out listed with why."""
        p = self.properties
        fp8_names = plan.fp8_layers()
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

    def _fp8_hardware(self) -> bool:
        """Whether this device has fp8 Tensor Cores (else torchao emulates fp8)."""
        from runner.precision.checks import FP8_MIN_CAPABILITY

        return (
            self.device.type == "cuda"
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability(self.device) >= FP8_MIN_CAPABILITY
        )

    def remove_hooks(self) -> None:
        """Remove the input/output cast and state-dict hooks (and a layer plan's input casts and
        local autocasts) from every cast model."""
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
        """The hooks removed and the optimizers given the model's parameters back (with the
        master values, rounded). The models stay in their cast type."""
        self.remove_hooks()
        self.masters.release()
