"""fp8 Linear layers through torchao's float8 training (the `fp8_linear` property).

`convert(model, recipe, emulate)` swaps every `nn.Linear` whose input and output sizes are
multiples of 16 (what torchao's scaled fp8 GEMM takes) for torchao's `Float8Linear`, in place:
the layer keeps its own weight and bias Parameters (the optimizer and the state dict see the
same tensors under the same names), and its matmuls run in fp8: e4m3 for the forward's inputs
and weights, e5m2 for the gradients, each tensor scaled dynamically (per tensor, or per row with
the `rowwise` recipe). Everything else stays in the level's type (bf16). Layers that cannot be
converted are listed with the reason. On a CPU, or a GPU without fp8 Tensor Cores, torchao's
emulation computes the same numerics in higher precision (no speed-up): `emulate=True`.

torchao is an optional dependency (`amp-runner[fp8]`); it is imported only here, on use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from runner.precision.checks import origins_hint, size_origins, sized
from runner.precision.properties import Finding

# torchao's scaled fp8 GEMM takes matrices whose sizes are multiples of 16
FP8_DIVISOR = 16


@dataclass
class Conversion:
    """Which Linear layers run in fp8 (their qualified names), and which stay as they were."""

    recipe: str
    emulated: bool
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    # Linear layers a layer plan keeps out of fp8 (name, the plan's format and why)
    planned_out: list[tuple[str, str]] = field(default_factory=list)
    origins: dict[int, str] = field(default_factory=dict)  # size -> the config key it comes from

    def inductor_options(self) -> dict[str, bool]:
        """The inductor settings a compiled model with these fp8 layers needs: with the rowwise
        recipe, `emulate_precision_casts` (inductor keeps eager's bf16 round trips between fused
        ops), as torchtitan sets for it: without it the compiled scaling and casting drift from
        eager (~1e-3 of the loss at the first step of GPT-2 small), and pytorch#150859 (NaNs from
        an RMS norm recomputed in the backward with other numerics than its forward)."""
        return (
            {"emulate_precision_casts": True} if self.recipe == "rowwise" and self.converted else {}
        )

    def findings(self) -> list[Finding]:
        """An info finding naming every Linear layer left out of fp8 (none: no finding), and the
        config key a size comes from where the model names it (`checks.size_origins`)."""
        if not self.skipped:
            return []
        listed = ", ".join(f"{name} ({why})" for name, why in self.skipped)
        return [
            Finding(
                "info",
                "fp8_linear",
                f"{len(self.skipped)} of {len(self.skipped) + len(self.converted)} Linear layers "
                "stay "
                f"in the level's type, not fp8: {listed}",
                f"sizes that are multiples of {FP8_DIVISOR} let torchao run a layer in fp8"
                + origins_hint([why for _, why in self.skipped], self.origins, FP8_DIVISOR),
            )
        ]

    def listing(self) -> str:
        """The `fp8_layers.txt` artifact: one line per Linear layer."""
        kept = len(self.skipped) + len(self.planned_out)
        source = (
            f"fp8_linear={self.recipe}"
            if not self.planned_out
            else f"the layer plan's fp8 layers ({self.recipe} recipe)"
        )
        lines = [
            f"# {source}{' (emulated)' if self.emulated else ''}: "
            f"{len(self.converted)} Linear layers in fp8, {kept} not"
        ]
        lines += [f"fp8   {name}" for name in self.converted]
        lines += [f"kept  {name}  ({why})" for name, why in self.skipped]
        lines += [f"plan  {name}  ({why})" for name, why in self.planned_out]
        return "\n".join(lines) + "\n"


def _why_not(module: nn.Linear, origins: dict[int, str] | None = None) -> str | None:
    origins = origins or {}
    sizes = []
    if module.in_features % FP8_DIVISOR:
        sizes.append(sized("in_features", module.in_features, origins))
    if module.out_features % FP8_DIVISOR:
        sizes.append(sized("out_features", module.out_features, origins))
    if sizes:
        return f"{', '.join(sizes)} not a multiple of {FP8_DIVISOR}"
    return None


def convert(
    model: nn.Module,
    recipe: str,
    emulate: bool,
    only: Optional[set[str]] = None,
    reasons: Optional[Mapping[str, str]] = None,
    fsdp_all_gather: bool = False,
) -> Conversion:
    """Swap `model`'s eligible Linear layers for torchao's Float8Linear (in place) with the
    `recipe` ("tensorwise" or "rowwise"); `emulate` on a device without fp8 Tensor Cores.
    `only`: a layer plan's fp8 layers (checked eligible), converted and no other; the others are
    listed with their `reasons` (name -> the plan's format and why). `fsdp_all_gather`: the
    model is about to be sharded with FSDP2 on fp8 hardware: its weights are all-gathered in fp8
    (torchao's `enable_fsdp_float8_all_gather`, tensorwise recipe only)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    conversion = Conversion(recipe, emulate, origins=size_origins(model))
    if type(model) is nn.Linear:  # torchao replaces a root Linear by a new module, not in place
        conversion.skipped.append((type(model).__name__, "the model itself is one Linear layer"))
        return conversion
    eligible: set[str] = set()
    reasons = reasons or {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and only is not None and name not in only:
            conversion.planned_out.append(
                (name or type(module).__name__, reasons.get(name, "not an fp8 layer of the plan"))
            )
        elif type(module) is nn.Linear:  # (not a subclass torchao would not know how to copy)
            why = _why_not(module, conversion.origins)
            if why is None:
                eligible.add(name)
                conversion.converted.append(name or type(module).__name__)
            else:
                conversion.skipped.append((name or type(module).__name__, why))
    if eligible:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        if fsdp_all_gather and recipe == "tensorwise" and not emulate:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _module, name: name in eligible
        )
    return conversion
