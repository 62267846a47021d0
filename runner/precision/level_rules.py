"""`LEVEL_RULES`: the rules about the combination of properties (Apex's refusals as warnings,
the meaningless or harmful mixes as errors), and `level_preset`, the preset a hint names.

`runner.precision.resolver.resolve` runs these, then the hardware rules of
`runner.precision.checks` and the optimizer rules of `runner.precision.optimizer_rules`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from runner.precision.findings import Context, Finding, RuleSet
from runner.precision.recipe import Properties, dtype_name

# The rules about the combination of properties, in the order they run.
LEVEL_RULES = RuleSet()


def level_preset(level: str, dtype: Optional[torch.dtype] = None) -> str:
    """The preset to choose for `level`: precision=o2, or precision=o2_bf16 for bfloat16."""
    suffix = "_bf16" if dtype == torch.bfloat16 and level != "O0" else ""
    return f"precision={level.lower()}{suffix}"


@LEVEL_RULES
def _master_weights_without_half_model(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.master_weights and not p.casts_to_half:
        if p.opt_level == "O1" and p.cast_model_type is None:
            what = (
                "O1 keeps the model's weights in fp32, so they are their own masters "
                "(Apex refused master_weights with O1)"
            )
        else:
            what = (
                "the model is not cast to a 16-bit type "
                f"(cast_model_type={dtype_name(p.cast_model_type)})"
            )
        yield Finding(
            "warning",
            "master_weights",
            f"master_weights=True is meaningless here and ignored: {what}",
            "leave precision.master_weights unset (null) for this level",
        )


@LEVEL_RULES
def _o1_cast_model(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O1" and p.casts_to_half:
        yield Finding(
            "warning",
            "cast_model_type",
            f"O1 casts around ops (autocast) and keeps the weights fp32; cast_model_type="
            f"{dtype_name(p.cast_model_type)} makes every weight 16-bit as well, which is O2/O3 "
            "with autocast on top (Apex refused this: with O1 the weights should remain fp32)",
            f"leave precision.cast_model_type null under O1, or use "
            f"{level_preset('O2', p.cast_model_type)} for a 16-bit model",
        )


@LEVEL_RULES
def _o1_keep_batchnorm(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O1" and p.keep_batchnorm_fp32 is not None:
        yield Finding(
            "warning",
            "keep_batchnorm_fp32",
            f"keep_batchnorm_fp32={p.keep_batchnorm_fp32} under O1: autocast already runs "
            "batch norm in fp32 and the model is not cast, so the setting has no effect "
            "(Apex refused it: with O1 it should be None)",
            "leave precision.keep_batchnorm_fp32 null under O1",
        )


@LEVEL_RULES
def _patch_outside_o1(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.patch_torch_functions and p.opt_level != "O1":
        yield Finding(
            "warning",
            "patch_torch_functions",
            f"patch_torch_functions=True under {p.opt_level}: autocast now runs on top of the "
            "level's casts, a mix Apex refused outright (only opt_level O1 may patch functions)",
            f"set precision.patch_torch_functions=false, or use {level_preset('O1')}",
        )


@LEVEL_RULES
def _o0_loss_scaling(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O0" and p.loss_scale != 1.0 and not p.compute_dtypes:
        what = "dynamic loss scaling" if p.dynamic_loss_scale else f"loss_scale={p.loss_scale:g}"
        yield Finding(
            "warning",
            "loss_scale",
            f"{what} under O0: fp32 gradients do not underflow, so scaling only adds a pass over "
            "the gradients each step (and skips steps that overflow)",
            "set precision.loss_scale=1.0 for the fp32 baseline",
        )


# Relative size below which an update to a weight is lost to rounding (half its spacing).
_VANISHING_UPDATE = {torch.float16: "2^-11", torch.bfloat16: "2^-8"}


@LEVEL_RULES
def _o2_without_masters(p: Properties, ctx: Context) -> Iterable[Finding]:
    if (
        p.opt_level == "O2"
        and p.casts_to_half
        and not p.master_weights
        and not p.stochastic_rounding
    ):
        name = dtype_name(p.cast_model_type)
        hint = "keep precision.master_weights=true (fp32 master copies) under O2"
        if p.cast_model_type == torch.bfloat16:
            hint += (
                ", or round the bf16 weights stochastically "
                "(precision.stochastic_rounding=true, as precision=o3_bf16_sr does)"
            )
        yield Finding(
            "warning",
            "master_weights",
            f"O2 without master weights: the optimizer updates the {name} weights directly, and "
            f"an update smaller than {_VANISHING_UPDATE[p.cast_model_type]} of a weight rounds "
            f"away in {name}, so small learning rates (and late, decayed ones) stop training",
            hint,
        )


@LEVEL_RULES
def _stochastic_rounding(p: Properties, ctx: Context) -> Iterable[Finding]:
    """Stochastic rounding stores a bf16 model's weights at each update; it replaces fp32
    masters, so it needs a bf16 model and no masters."""
    if not p.stochastic_rounding:
        return
    if p.cast_model_type != torch.bfloat16:
        yield Finding(
            "error",
            "stochastic_rounding",
            "stochastic rounding stores bfloat16 weights rounded up or down at random, but this "
            f"level keeps the weights in {dtype_name(p.cast_model_type or torch.float32)}"
            + (" (O1 does not cast the model)" if p.cast_model_type is None else ""),
            "use precision=o3_bf16_sr (a bf16 model without master weights), or set "
            "precision.stochastic_rounding=false",
        )
    elif p.uses_master_weights:
        yield Finding(
            "error",
            "stochastic_rounding",
            "stochastic rounding replaces fp32 master weights (the update is computed in fp32 "
            "and stored in bf16 unbiased); with master_weights=true the weights are updated "
            "in fp32 already",
            "set precision.master_weights=false (or use precision=o3_bf16_sr), or "
            "precision.stochastic_rounding=false",
        )


@LEVEL_RULES
def _fp8_linear_level(p: Properties, ctx: Context) -> Iterable[Finding]:
    """torchao's float8 training: Linear GEMMs in fp8 (e4m3 forward, e5m2 gradients), the rest of
    the model in bf16 (autocast or a cast model) with the weights updated in high precision."""
    if p.fp8_linear is None:
        return
    if torch.float16 in p.compute_dtypes:
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers with float16: torchao's float8 training runs the rest of the "
            "model in bfloat16 or fp32 (its scaled fp8 GEMMs output bf16), not fp16",
            "use precision=o1_fp8 (bf16 autocast) or precision=o2_fp8 (bf16 model)",
        )
    elif p.opt_level == "O3":
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers under O3: torchao's float8 training needs the weights updated in "
            "high precision (fp32 masters, or an fp32 model), and O3 keeps no masters",
            "use precision=o2_fp8 (bf16 model, fp32 master weights)",
        )
    elif p.opt_level == "O0":
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers under O0: O0 is the fp32 baseline the other levels are compared "
            "with",
            "use precision=o1_fp8 or precision=o2_fp8",
        )


@LEVEL_RULES
def _bf16_dynamic_scaling(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.dynamic_loss_scale and p.compute_dtypes == {torch.bfloat16}:
        yield Finding(
            "info",
            "loss_scale",
            "dynamic loss scaling is unneeded with bfloat16: it has fp32's exponent range, so "
            "gradients do not underflow; scaling only adds a pass over the gradients per step",
            "set precision.loss_scale=1.0 (the *_bf16 presets do)",
        )


@LEVEL_RULES
def _o3_batchnorm_fp32(p: Properties, ctx: Context) -> Iterable[Finding]:
    if p.opt_level == "O3" and p.keep_batchnorm_fp32:
        yield Finding(
            "info",
            "keep_batchnorm_fp32",
            "O3 with keep_batchnorm_fp32=True: everything 16-bit except BatchNorm, Apex's "
            '"speed of light" setting; allowed',
            "",
        )
