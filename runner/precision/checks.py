"""Findings about the machine and the built model, beyond the properties themselves (those about
the optimizer: `runner.precision.optimizer_rules`).

Every rule takes a *description* of the device (`DeviceInfo`), never a live device, so each one is
testable on any machine: `DeviceInfo("cuda", (6, 1), "Tesla P100")` describes a Pascal GPU on a
laptop without a GPU. `DeviceInfo.from_torch(device)` describes the device a run uses.

- fp16 on a CPU: emulated, far slower than bfloat16 (warning).
- bfloat16 on a CPU whose bf16 matrix products are measured at least `BF16_SLOW_RATIO` times
  slower than fp32 ones (a CPU without AVX512_BF16 or AMX): the level trains slower than O0
  (warning).
- fp16 on a CUDA GPU below compute capability 7.0: no Tensor Cores, so fp16 saves memory but
  brings no speed-up (warning).
- bfloat16 on a CUDA GPU below compute capability 8.0: not supported in hardware (error).
- fp8 Linear layers: torchao installed; on CUDA compute capability 8.9 (error) and
  torch.compile (warning); on a CPU emulated (info).
- The optimizer's state under a low-bit `optimizer_state` (`state_findings`, needs the built
  model): the parameters that keep plain state (one info finding).
- Tensor Core shapes (`tensor_core_findings`, needs the built model): Linear/convolution sizes and a
  batch size that are not multiples of 8 (one info finding).
"""

from __future__ import annotations

import functools
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
from torch import nn

from runner.precision.properties import (
    HALF_DTYPES,
    Context,
    Finding,
    Properties,
    RuleSet,
    dtype_name,
)


def concrete_device(device: torch.device | str) -> torch.device:
    """`device` as its tensors report it: an index-less CUDA device ("cuda") becomes the current
    GPU ("cuda:0"). torch.device("cuda") != torch.device("cuda:0"), and a tensor made on "cuda"
    reports "cuda:0", so code that compares a tensor's device with an index-less one finds them
    different (the engine did, and stepped every single-GPU run on torch's ops instead of the
    fused kernels). Without CUDA the device is returned as given (nothing can be made on it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class DeviceInfo:
    """What the rules need to know about a device: its type, CUDA compute capability, name."""

    type: Literal["cpu", "cuda"] | str
    capability: Optional[tuple[int, int]] = None  # CUDA (major, minor); None: CPU or unknown
    name: str = ""
    # a CPU's: how many times as long a bfloat16 matrix product takes as an fp32 one
    # (`cpu_bf16_matmul_ratio`); None: not given (see `bf16_ratio`)
    bf16_matmul_ratio: Optional[float] = None
    # where no ratio is given: measure this CPU's when a rule first asks (`from_torch`'s CPU), so
    # that a level that computes nothing in bf16 costs no measurement
    measure_bf16: bool = False

    @classmethod
    def from_torch(cls, device: torch.device | str) -> DeviceInfo:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return cls("cuda", None, "cuda (not available)")
            index = concrete_device(device).index
            major, minor = torch.cuda.get_device_capability(index)
            return cls("cuda", (major, minor), torch.cuda.get_device_name(index))
        if device.type == "cpu":
            return cls("cpu", None, _cpu_name(), measure_bf16=True)
        return cls(device.type, None, device.type)

    def bf16_ratio(self) -> Optional[float]:
        """The CPU's bf16 matrix product time over fp32's: the one given, else this CPU's measured
        (once per process) where `measure_bf16`, else None (unknown)."""
        if self.bf16_matmul_ratio is not None:
            return self.bf16_matmul_ratio
        if self.measure_bf16 and self.type == "cpu":
            return cpu_bf16_matmul_ratio()
        return None

    def describe(self) -> str:
        if self.capability is None:
            return self.name or self.type
        major, minor = self.capability
        return f"{self.name or 'this GPU'} (compute capability {major}.{minor})"


# Rules about the machine and the optimizer, run after the level rules (runner.precision.resolver).
DEVICE_RULES = RuleSet()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


# From this ratio on, a bf16 level cannot train faster than fp32 on a CPU. Measured on an AVX2 AMD
# EPYC, which has neither AVX512_BF16 nor AMX (oneDNN takes a reference path there): products
# 24-72x, a 3 x 3 convolution 73x, the tiny CNN's step 8x (benchmarks/results/cpu/cpu_bf16_cpu.md);
# below 1 where the CPU has them (an Intel Xeon trained ResNet-50 1.9x faster in bf16 than in
# fp32: benchmarks/results/cpu/levels_cpu.md).
BF16_SLOW_RATIO = 3.0


@functools.cache
def cpu_bf16_matmul_ratio(size: int = 128, repeats: int = 5) -> float:
    """How many times as long a `size` x `size` bfloat16 matrix product takes as an fp32 one on
    this CPU, on one thread: the best of `repeats` timings each, after one untimed product.
    Measured once per process (10-30 ms where bf16 is slow, less where it is not). One thread,
    since on torch's threads a busy machine stalls fp32's parallel product and not bf16's slow
    one: with another process computing on this 2-core machine the ratio read 0.1, against 28 on
    one thread, busy or not."""

    def best(dtype: torch.dtype) -> float:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(torch.bfloat16) / best(torch.float32)
    finally:
        torch.set_num_threads(threads)


def _dtype_users(p: Properties) -> list[tuple[str, torch.dtype]]:
    """(property, 16-bit dtype) for each way the properties compute in 16 bit."""
    users = []
    if p.casts_to_half:
        users.append(("cast_model_type", p.cast_model_type))
    if p.patch_torch_functions and p.autocast_dtype in HALF_DTYPES:
        users.append(("autocast_dtype", p.autocast_dtype))
    return users


# ---- device rules ----------------------------------------------------------------------------
@DEVICE_RULES
def _fp16_on_cpu(p: Properties, ctx: Context) -> Iterable[Finding]:
    device = ctx.device
    if device is None or device.type != "cpu":
        return
    if p.cast_model_type == torch.float16:
        yield Finding(
            "warning",
            "cast_model_type",
            "fp16 is emulated on CPU and far slower than bfloat16 "
            "(about 100x slower than fp32 for ResNet-18)",
            "set precision.cast_model_type=bfloat16 on CPU (precision=o2_bf16/o3_bf16)",
        )
    if p.patch_torch_functions and p.autocast_dtype == torch.float16:
        yield Finding(
            "warning",
            "patch_torch_functions",
            "fp16 is emulated on CPU and far slower than bfloat16 (autocast with float16)",
            "autocast with autocast_dtype=bfloat16 on CPU (precision=o1_bf16)",
        )


@DEVICE_RULES
def _bf16_on_a_slow_cpu(p: Properties, ctx: Context) -> Iterable[Finding]:
    """bfloat16 on a CPU that computes it slowly: a CPU without bf16 instructions (AVX512_BF16,
    AMX) runs bf16 matrix products and convolutions on a slow path, 20-70x fp32's time."""
    device = ctx.device
    if device is None or device.type != "cpu":
        return
    users = [prop for prop, dtype in _dtype_users(p) if dtype == torch.bfloat16]
    if not users:
        return
    ratio = device.bf16_ratio()  # measured here, where a level computes in bf16
    if ratio is None or ratio < BF16_SLOW_RATIO:
        return
    yield Finding(
        "warning",
        users[0],
        f"bfloat16 on {device.describe()}: a bfloat16 matrix product took "
        f"{ratio:.0f}x as long as an fp32 one here (measured at start), so "
        "this level trains slower than precision=o0 (it still saves memory); a CPU without "
        "AVX512_BF16 or AMX instructions computes bf16 on a slow path",
        "use precision=o0 for speed on this CPU; bf16 is faster than fp32 on CPUs with "
        "AVX512_BF16 or AMX (Intel Cooper Lake, Sapphire Rapids and newer; AMD Zen 4 and newer)",
    )


@DEVICE_RULES
def _cuda_capability(p: Properties, ctx: Context) -> Iterable[Finding]:
    device = ctx.device
    if device is None or device.type != "cuda" or device.capability is None:
        return
    seen: set[torch.dtype] = set()
    for prop, dtype in _dtype_users(p):
        if dtype in seen:
            continue
        seen.add(dtype)
        if dtype == torch.float16 and device.capability < (7, 0):
            yield Finding(
                "warning",
                prop,
                f"fp16 on {device.describe()}: no Tensor Cores below capability 7.0 (Volta), so "
                "fp16 saves memory but does not speed training up (it may slow it down)",
                "expect memory savings only; precision=o0 is as fast here",
            )
        if dtype == torch.bfloat16 and device.capability < (8, 0):
            yield Finding(
                "error",
                prop,
                f"bfloat16 on {device.describe()}: bfloat16 needs compute capability 8.0 "
                "(Ampere) or newer",
                "use an fp16 preset (precision=o1 or o2) on this GPU",
            )


# fp8 GEMMs need Ada (8.9) or Hopper (9.0) Tensor Cores.
FP8_MIN_CAPABILITY = (8, 9)


@DEVICE_RULES
def _fp8_device(p: Properties, ctx: Context) -> Iterable[Finding]:
    """fp8 Linear layers: torchao installed; on CUDA a GPU with fp8 Tensor Cores (and
    torch.compile, without which torchao's casts run as separate slow kernels); on a CPU
    emulated, for numerics only."""
    if p.fp8_linear is None:
        return
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        yield Finding(
            "error",
            "fp8_linear",
            "fp8 Linear layers need torchao, which is not installed",
            'pip install "amp-runner[fp8]" (torchao)',
        )
    device = ctx.device
    if device is None:
        return
    if device.type == "cpu":
        yield Finding(
            "info",
            "fp8_linear",
            "fp8 on a CPU is emulated (torchao's emulate mode): the numerics of fp8 "
            "training, no speed-up",
            "measure fp8's speed on a CUDA GPU of compute capability 8.9 or newer",
        )
    elif device.type == "cuda" and device.capability is not None:
        if device.capability < FP8_MIN_CAPABILITY:
            yield Finding(
                "error",
                "fp8_linear",
                f"fp8 on {device.describe()}: fp8 Tensor Cores need compute capability 8.9 "
                "(Ada) or 9.0 (Hopper) or newer",
                "use precision=o1_bf16 or o2_bf16 on this GPU",
            )
        elif ctx.compiled is False:
            yield Finding(
                "warning",
                "fp8_linear",
                "fp8 without torch.compile: torchao's scaling and casting run as separate "
                "kernels around each GEMM, so fp8 will be slower than bf16",
                "set trainer.compile=true",
            )


# ---- the optimizer's state (needs the built model) -----------------------------------------------
def state_findings(model: nn.Module, properties: Properties) -> list[Finding]:
    """Which parameters keep plain state under a low-bit `optimizer_state` (torchao quantises a
    tensor of at least 4096 elements that is a multiple of its block size, as bitsandbytes
    does: a block's scale costs 4 bytes, and small tensors gain nothing): one info finding with
    their count and share of the elements; [] otherwise."""
    if not properties.low_bit_state:
        return []
    from runner.precision import state

    fmt = properties.state_format
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plain = state.plain_state_params(named, fmt)
    if not plain:
        return []
    total = sum(p.numel() for _, p in named) or 1
    share = sum(n for _, n in plain) / total
    shown = ", ".join(f"{name} ({n})" for name, n in plain[:6])
    more = f" and {len(plain) - 6} more" if len(plain) > 6 else ""
    return [
        Finding(
            "info",
            "optimizer_state",
            f"{len(plain)} of {len(named)} parameter tensors ({share:.1%} of the elements) keep "
            f"{dtype_name(properties.stepped_dtype)} state, not {fmt}: fewer than "
            f"{state.MIN_QUANTISED_NUMEL} elements or not a multiple of the block size "
            f"{state.BLOCK_SIZES[fmt]} (torchao's rule, after bitsandbytes): {shown}{more}",
            "",
        )
    ]


# ---- model shapes (called by the app once the model is built) ---------------------------------
def _off_eight(n: int) -> bool:
    return n % 8 != 0


def size_origins(model: nn.Module) -> dict[int, str]:
    """{layer size: the config key it comes from} where the model says so (`size_keys()`: the
    runner's GPT names `model.n_embd`, `4 x model.n_embd` and `model.vocab_size`), so that a shape
    finding tells which setting to change, not only which layer."""
    keys = getattr(model, "size_keys", None)
    try:
        return dict(keys()) if callable(keys) else {}
    except Exception:  # noqa: BLE001  (a user's model: no names, the finding still stands)
        return {}


def sized(label: str, n: int, origins: dict[int, str]) -> str:
    """`in_features 100`, or `in_features 100 = model.n_embd` where the size has a known origin."""
    return f"{label} {n}" + (f" = {origins[n]}" if n in origins else "")


def origins_hint(texts: Iterable[str], origins: dict[int, str], multiple: int) -> str:
    """What to set, where a listed size comes from a config key: `set model.n_embd,
    model.vocab_size to multiples of 8 (a vocabulary can be padded: 50257 -> 50304)`."""
    used = [
        key for key in dict.fromkeys(origins.values()) if any(f"= {key}" in text for text in texts)
    ]
    if not used:
        return ""
    keys = dict.fromkeys(k.split(" x ")[-1] for k in used)  # `4 x model.n_embd`: model.n_embd
    hint = f"; set {', '.join(keys)} to multiples of {multiple}"
    if any("vocab_size" in key for key in used):
        hint += (
            " (a vocabulary can be padded with unused ids: GPT-2's 50257 -> 50304, as "
            "nanoGPT does, with model.vocab_size)"
        )
    return hint


def tensor_core_findings(
    model: nn.Module,
    batch_size: Optional[int],
    properties: Properties,
    device_info: Optional[DeviceInfo],
) -> list[Finding]:
    """One info finding listing every Linear and convolution layer (1d/2d/3d, transposed too) and
    the batch size whose sizes are not multiples of 8, which Tensor Cores need for fp16/bf16 GEMMs
    and convolutions; [] when the run is not 16-bit on a CUDA device or every size fits. A
    convolution's input channels of 1 or 3 (an image, a signal) are not listed: cuDNN pads those
    itself."""
    if device_info is None or device_info.type != "cuda" or not properties.compute_dtypes:
        return []
    offenders: list[str] = []
    layers = 0
    origins = size_origins(model)
    for name, module in model.named_modules():
        sizes: list[str] = []
        if isinstance(module, nn.Linear):
            layers += 1
            if _off_eight(module.in_features):
                sizes.append(sized("in_features", module.in_features, origins))
            if _off_eight(module.out_features):
                sizes.append(sized("out_features", module.out_features, origins))
        elif isinstance(module, nn.modules.conv._ConvNd):
            layers += 1
            if module.in_channels not in (1, 3) and _off_eight(module.in_channels):
                sizes.append(f"in_channels {module.in_channels}")
            if _off_eight(module.out_channels):
                sizes.append(f"out_channels {module.out_channels}")
        if sizes:
            offenders.append(f"{name or type(module).__name__} ({', '.join(sizes)})")
    parts: list[str] = []
    if offenders:
        parts.append(
            f"{len(offenders)} of {layers} Linear/convolution layers have sizes that are "
            f"not multiples of 8: {', '.join(offenders)}"
        )
    if batch_size is not None and _off_eight(batch_size):
        parts.append(f"the batch size {batch_size} is not a multiple of 8")
    if not parts:
        return []
    dtypes = "/".join(sorted(dtype_name(d) for d in properties.compute_dtypes))
    return [
        Finding(
            "info",
            "model" if offenders else "trainer.batch_size",
            "; ".join(parts)
            + f", so {dtypes} Tensor Core kernels pad them or fall back to slower ones",
            "sizes that are multiples of 8 (trainer.batch_size, layer widths) use Tensor Cores "
            "fully" + origins_hint(offenders, origins, 8),
        )
    ]
