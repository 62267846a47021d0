"""Findings about a layer plan's formats at the run's level and on its device, before the model
exists (`rule_findings`): fp32 anywhere, the level's own 16-bit type, fp8 where torchao's float8
training can run. See README.md beside this file."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from runner.precision.layers.rules import AUTO, DTYPES, FP8, LAYERS_KEY, PLAN_KEY, LayerRule
from runner.precision.properties import Context, Finding, Properties, RuleSet, dtype_name

LAYER_RULES = RuleSet()


def level_half(p: Properties) -> Optional[torch.dtype]:
    """The 16-bit type the level computes in: the cast model's, O1's autocast type, or None."""
    if p.casts_to_half:
        return p.cast_model_type
    if p.autocasts:
        return p.autocast_dtype
    return None


def fp8_refusal(p: Properties) -> Optional[tuple[str, str]]:
    """Why fp8 Linear layers cannot run at this level, with the fix; None when they can: bf16
    compute (O1 bf16 autocast, or a bf16 model) with the weights updated in high precision (an
    fp32 model, or fp32 master weights): torchao's float8 training."""
    if torch.float16 in p.compute_dtypes:
        return (
            "torchao's float8 training runs the rest of the model in bfloat16 or fp32 (its "
            "scaled fp8 GEMMs output bf16), not fp16",
            "use precision=o1_bf16 or o2_bf16 (or the fp8 presets o1_fp8 / o2_fp8)",
        )
    if p.opt_level == "O0" or not p.compute_dtypes:
        return (
            "O0 computes in fp32: it is the baseline the other levels are compared with",
            "use precision=o1_bf16 or o2_bf16 with fp8 layers",
        )
    if p.casts_to_half and not p.uses_master_weights:
        return (
            "fp8 training needs the weights updated in high precision (fp32 masters, or an "
            "fp32 model), and this level keeps no masters",
            "use precision=o2_bf16 (fp32 master weights) or o1_bf16",
        )
    return None


@LAYER_RULES
def _formats_for_level(p: Properties, ctx: Any, rules: Sequence[LayerRule]) -> Iterable[Finding]:
    """Each entry's format must be one the level can run: fp32 anywhere, the level's own 16-bit
    type (one 16-bit type per run: the loss scaling and the master weights are set for it), and
    fp8 where torchao's float8 training can run."""
    half = level_half(p)
    for rule in rules:
        fmt = rule.format
        if fmt == "float32":
            continue
        if fmt == FP8:
            refusal = fp8_refusal(p)
            if refusal is not None:
                yield Finding(
                    "error",
                    rule.key,
                    f"'{rule.pattern}': fp8 under {p.opt_level}{_of_source(rule)}: {refusal[0]}",
                    refusal[1],
                )
            continue
        if half is None:
            yield Finding(
                "error",
                rule.key,
                f"'{rule.pattern}': {fmt} under {p.opt_level}{_of_source(rule)}: this "
                "level computes in fp32 everywhere (the baseline), so no layer can be "
                "16-bit",
                f"use a {fmt} level (precision=o1_bf16, o2_bf16, ...) with fp32 layers where needed"
                if fmt == "bfloat16"
                else "use an fp16 level (precision=o1, o2) with fp32 layers where needed",
            )
        elif DTYPES[fmt] != half:
            yield Finding(
                "error",
                rule.key,
                f"'{rule.pattern}': {fmt} in a {dtype_name(half)} run"
                f"{_of_source(rule)}: one 16-bit type per run (its loss scaling and "
                "master weights are set for it)",
                f"float32 or {dtype_name(half)} for this layer, or a {fmt} level",
            )


@LAYER_RULES
def _fp8_layers_device(p: Properties, ctx: Any, rules: Sequence[LayerRule]) -> Iterable[Finding]:
    """fp8 entries need what fp8_linear needs (its own rule covers a level with fp8_linear)."""
    fp8_rules = [r for r in rules if r.format == FP8]
    if not fp8_rules or p.fp8_linear is not None or fp8_refusal(p) is not None:
        return
    import importlib.util

    from runner.precision.checks import FP8_MIN_CAPABILITY

    key = fp8_rules[0].key
    if importlib.util.find_spec("torchao") is None:
        yield Finding(
            "error",
            key,
            "fp8 layers need torchao, which is not installed",
            'pip install "amp-runner[fp8]" (torchao)',
        )
    device = getattr(ctx, "device", None)
    if device is None:
        return
    if device.type == "cpu":
        yield Finding(
            "info",
            key,
            "fp8 on a CPU is emulated (torchao's emulate mode): the "
            "numerics of fp8 training, no speed-up",
            "",
        )
    elif (
        device.type == "cuda"
        and device.capability is not None
        and device.capability < FP8_MIN_CAPABILITY
    ):
        yield Finding(
            "error",
            key,
            f"fp8 layers on {device.describe()}: fp8 Tensor Cores need "
            "compute capability 8.9 (Ada) or 9.0 (Hopper) or newer",
            "give these layers bfloat16 (or float32) on this GPU",
        )


@LAYER_RULES
def _auto_at_o0(p: Properties, ctx: Any, rules: Sequence[LayerRule]) -> Iterable[Finding]:
    if p.layer_plan == AUTO and level_half(p) is None:
        yield Finding(
            "info",
            PLAN_KEY,
            f"layer_plan=auto under {p.opt_level}: the level computes "
            "in fp32 everywhere, so the plan can only keep every layer in fp32",
            "plan for a 16-bit level (precision=o2_bf16 precision.layer_plan=auto)",
        )


def _of_source(rule: LayerRule) -> str:
    return "" if rule.source == LAYERS_KEY else f" ({rule.origin()})"


def rule_findings(p: Properties, rules: Sequence[LayerRule], ctx: Any = None) -> list[Finding]:
    """Every finding about `rules` (the plan file's and `precision.layers`) at level `p` on the
    context's device (a `properties.Context`; None: unknown)."""
    ctx = ctx if ctx is not None else Context()
    return [f for rule in LAYER_RULES for f in rule(p, ctx, rules)]
