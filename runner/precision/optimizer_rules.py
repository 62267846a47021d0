"""`OPTIMIZER_RULES`: the findings about the optimizer and the format of its state, run after
the device rules (`runner.precision.resolver`). Each reads the optimizer's config
(`Context.optimizer`: its name, eps, betas) and, where it matters, the device.

- Adam/AdamW `eps` that underflows in the type holding the optimizer state (error), or is a
  subnormal there (warning).
- The optimizer's state format: low-bit state needs torchao's Adam/AdamW (and, for fp8 on CUDA,
  compute capability 8.9); fp16 state of fp32 weights loses small second moments (warning);
  bf16 state rounded to nearest keeps Adam's second moment from decaying (warning).
  `runner.precision.checks.state_findings` (needs the built model) lists the parameters that
  keep plain state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from runner.precision.checks import FP8_MIN_CAPABILITY
from runner.precision.properties import (
    HALF_DTYPES,
    Context,
    Finding,
    Properties,
    RuleSet,
    dtype_name,
)

OPTIMIZER_RULES = RuleSet()

_ADAM_NAMES = ("adam", "adamw")


def _normal_eps(dtype: torch.dtype) -> str:
    """The smallest power of ten that is a normal number in `dtype` (fp16: "1e-4")."""
    tiny = torch.finfo(dtype).tiny
    exponent = 0
    while 10.0 ** (exponent - 1) >= tiny:
        exponent -= 1
    return f"1e{exponent}"


@OPTIMIZER_RULES
def _adam_eps_underflow(p: Properties, ctx: Context) -> Iterable[Finding]:
    """Adam divides by sqrt(v) + eps in the type of its state. Where eps rounds to 0 in that type
    (fp16: anything below 2^-25 ~ 3e-8, e.g. the default 1e-8), a parameter whose squared gradient
    underflowed (|grad| < ~2.4e-4 in fp16) gets 0/0 = NaN or m/0 = inf: the weights blow up."""
    opt = ctx.optimizer
    if not opt or str(opt.get("name", "")).lower() not in _ADAM_NAMES or opt.get("eps") is None:
        return
    dtype = p.optimizer_state_dtype
    if dtype not in HALF_DTYPES:
        return
    eps = float(opt["eps"])
    name = dtype_name(dtype)
    stored = torch.tensor(eps, dtype=dtype).item()
    why = f"the optimizer state is {name} ({p.opt_level} without fp32 master weights)"
    fix = (
        f"set optimizer.eps={_normal_eps(dtype)}, or keep fp32 master weights "
        "(precision=o2, precision.master_weights=true)"
    )
    if stored == 0.0:
        yield Finding(
            "error",
            "optimizer.eps",
            f"{opt.get('name')} eps={eps:g} underflows to 0 in {name}: {why}, so sqrt(v) + eps "
            "is 0 "
            "wherever the squared gradient underflowed, and the update becomes inf/NaN",
            fix,
        )
    elif abs(stored) < torch.finfo(dtype).tiny:
        yield Finding(
            "warning",
            "optimizer.eps",
            f"{opt.get('name')} eps={eps:g} is a subnormal {name} number (stored as {stored:.3g}): "
            f"{why}, and subnormals lose precision (and flush to zero on some hardware)",
            fix,
        )


# ---- the optimizer's state format -----------------------------------------------------------
@OPTIMIZER_RULES
def _optimizer_state(p: Properties, ctx: Context) -> Iterable[Finding]:
    """Low-bit state is torchao's Adam/AdamW (installed, on a device whose compiled step can
    convert to fp8 for fp8 state); fp16 state of fp32 weights loses small second moments."""
    from runner.precision import state

    if p.state_format == "float16" and p.stepped_dtype != torch.float16:
        yield Finding(
            "warning",
            "optimizer_state",
            "float16 optimizer state: Adam's second moment v = g^2 underflows to 0 in fp16 for "
            "|g| < 2^-12 (~2.4e-4), and where it does the update m / (sqrt(v) + eps) is m / eps "
            f"(eps={_eps_text(ctx)}): a huge step; momentum loses small values the same way",
            "set precision.optimizer_state=bfloat16 (fp32's range in half the bytes), or int8",
        )
    yield from _bf16_second_moment(p, ctx)
    if not p.low_bit_state:
        return
    fmt = p.state_format
    opt = ctx.optimizer
    name = str(opt.get("name", "")).lower() if opt else None
    if name is not None and name not in state.LOW_BIT_OPTIMIZERS:
        yield Finding(
            "error",
            "optimizer_state",
            f"{fmt} optimizer state comes from torchao's low-bit Adam and AdamW; "
            f"optimizer.name={opt.get('name')} has no {fmt} implementation",
            "use optimizer=adamw or optimizer=adam, or precision.optimizer_state=bfloat16 "
            "(any torch optimizer's state in bf16)",
        )
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        yield Finding(
            "error",
            "optimizer_state",
            f"{fmt} optimizer state needs torchao, which is not installed",
            'pip install "amp-runner[fp8]" (torchao)',
        )
    device = ctx.device
    if (
        fmt == "fp8"
        and device is not None
        and device.type == "cuda"
        and device.capability is not None
        and device.capability < FP8_MIN_CAPABILITY
    ):
        yield Finding(
            "error",
            "optimizer_state",
            f"fp8 optimizer state on {device.describe()}: torchao compiles its step with Triton, "
            "which converts to float8_e4m3fn only on compute capability 8.9 (Ada) or newer",
            "use precision.optimizer_state=int8 (same bytes) on this GPU",
        )
    if p.stochastic_rounding:
        yield Finding(
            "info",
            "optimizer_state",
            f"stochastic rounding with {fmt} state: torchao's optimizer rounds the bf16 weights "
            "itself (its bf16_stochastic_round), drawing from torch's generator (checkpointed "
            "with the run) rather than the runner's counter-based bits",
            "",
        )


# Half of bf16's spacing, relative to the value: 2^-9 just below a power of two, up to 2^-8.
_BF16_HALF_SPACING = 2.0**-9


def _bf16_second_moment(p: Properties, ctx: Context) -> Iterable[Finding]:
    """Adam's v = beta2 * v + (1 - beta2) * g^2 moves by at most (1 - beta2) of itself downwards
    a step; stored in bf16 rounded to nearest, a change below half of bf16's spacing rounds
    back: with beta2 > 1 - 2^-9 (0.998; the default 0.999) v can grow but never decay. Rounded
    stochastically (stochastic_rounding), it decays as in fp32 on average."""
    opt = ctx.optimizer
    if (
        p.state_format != "bfloat16"
        or p.stochastic_rounding
        or not opt
        or str(opt.get("name", "")).lower() not in _ADAM_NAMES
    ):
        return
    betas = opt.get("betas")
    try:
        beta2 = float(betas[1])
    except (TypeError, IndexError, ValueError):
        return
    if 1.0 - beta2 >= _BF16_HALF_SPACING:
        return
    yield Finding(
        "warning",
        "optimizer_state",
        f"bfloat16 optimizer state rounded to nearest: Adam's second moment moves down by at most "
        f"1 - beta2 = {1 - beta2:.2g} of itself a step, less than half of bf16's spacing "
        "(0.2-0.4% of the value), so it rounds back: v can grow but never decay, and the steps "
        "stay as small as the largest gradients ever seen made them (measured: squared "
        "gradients falling 10x over 3000 steps leave bf16 v at its peak; fp32 v follows them)",
        "set precision.optimizer_state=float32 (or int8), round the state stochastically (a bf16 "
        "model: precision=o3_bf16_sr keeps its bf16 state rounded at random), or lower "
        "optimizer.betas[1] to 0.99",
    )


def _eps_text(ctx: Context) -> str:
    opt = ctx.optimizer
    return f"{float(opt['eps']):g}" if opt and opt.get("eps") is not None else "optimizer.eps"
