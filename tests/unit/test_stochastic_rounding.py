"""Stochastic rounding to bf16: the kernels (runner/csrc) and the torch reference and fallback
(runner.precision.rounding) against float64 references.

The same test bodies run on every backend present: the C++ kernels always, the CUDA kernels where
a GPU is (marked `gpu`, skipped elsewhere); a slow test compiles the CUDA sources wherever a CUDA
toolkit is installed and checks the new ops are bound.

Tolerances, stated per test:
- the kernels and the torch reference draw the same bits and round the same fp32 value to the
  same bf16 value: bit for bit;
- a rounded value is one of the two bf16 neighbours of its input (computed in float64), and a
  value bf16 represents is returned unchanged: exact;
- unbiased: with P(up) = p exactly (p from the float64 position between the neighbours), the count
  of values rounded up over n independent draws is within 5 binomial sigmas of n * p (plus one
  for p near 0 or 1), i.e. the mean rounded value is the float64 value within 5 sigmas;
- independence: the rounding decisions at p = 1/2 of two different steps, tensors or seeds, or of
  neighbouring elements, agree in a fraction within 5 sigmas of 1/2;
- SR optimizer steps: the stored bf16 param lies between the bf16 values bracketing the float64
  result widened by the fp32 error of the update (4 fp32 ulps of the param, plus 4e-6 of the
  update for Adam); fp32 state matches float64 to the same fp32 tolerance, bf16 state (rounded
  stochastically too, with its own bits) lies between the bf16 values bracketing it, unbiased;
- the torch fallback `sr_step` agrees with the kernel steps up to the fp32 rounding differences
  between torch's and the kernels' arithmetic: each bf16 value equal or one spacing apart (1e-6
  where cancellation made a value much smaller than its operands of order 1), at most 1 element
  in 1000 apart; for optimizers without kernels it is bit for bit the stochastic
  rounding of the optimizer's own fp32 step.
"""

from __future__ import annotations

import io
import math
import os

import pytest
import torch

from runner import csrc
from runner.csrc import loader
from runner.precision import rounding
from tests.helpers.kernel_cases import ADAM_CASES, SGD_CASES  # the kernels' step cases

SIZES = [1, 7, 65535, 65536, 65537, 3 * 65536 + 5]  # odd, chunk edges, several chunks
MASK32 = 0xFFFFFFFF


@pytest.fixture(params=["cpp", pytest.param("cuda", marks=pytest.mark.gpu)], scope="module")
def backend(request):
    return csrc.build(request.param)


def dev(backend) -> torch.device:
    return torch.device(backend.device_type)


def scalar(backend, value: float) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=dev(backend))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def wide_fp32(n: int, seed: int) -> torch.Tensor:
    """Random fp32 values of both signs over the whole exponent range, subnormals included."""
    g = gen(seed)
    mantissa = torch.rand(n, generator=g, dtype=torch.float64) + 1.0
    exponent = torch.randint(-149, 128, (n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (sign * torch.ldexp(mantissa, exponent)).clamp(-3.4e38, 3.4e38).float()


def sr_kernel(backend, xs, seed, step, ids):
    out = [torch.empty_like(x, dtype=torch.bfloat16) for x in xs]
    backend.ops.stochastic_round(xs, out, seed, step, ids)
    return out


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# ---- float64 references ----------------------------------------------------------------------
def neighbours(v: torch.Tensor):
    """For float64 values v: (toward-zero bf16 neighbour, away-from-zero neighbour, spacing), all
    float64; both neighbours are v itself when bf16 represents v. Beyond bf16's largest finite
    value the upper neighbour is inf (2^128). Computed from the value, not from bit patterns."""
    a = v.double().abs()
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=-126) - 7)
    lo = torch.floor(a / spacing) * spacing
    hi = torch.where(lo == a, a, lo + spacing)
    hi = torch.where(hi >= 2.0**128, torch.inf, hi)
    sign = torch.where(torch.signbit(v), -1.0, 1.0).double()
    return sign * lo, sign * hi, spacing


def bf16_floor(v: torch.Tensor) -> torch.Tensor:
    lo, hi, _ = neighbours(v)
    return torch.where(v >= 0, lo, hi)


def bf16_ceil(v: torch.Tensor) -> torch.Tensor:
    lo, hi, _ = neighbours(v)
    return torch.where(v >= 0, hi, lo)


def ulp32(v: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(v.double().abs())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), torch.clamp(e - 1, min=-126) - 23)


def within_sigmas(count: float, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


# ---- the random source -----------------------------------------------------------------------
def _mix(x: int) -> int:  # lowbias32, as step_math.h defines it
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _bits(seed: int, step: int, tid: int, i: int) -> int:
    h = _mix((seed & MASK32) ^ 0x9E3779B9)
    for word in (seed >> 32, step & MASK32, step >> 32, tid):
        h = _mix(h ^ word)
    k2 = _mix(h ^ 0x85EBCA6B)
    return _mix(_mix((i & MASK32) ^ h) ^ k2 ^ (i >> 32))


def test_random_bits_follow_the_documented_definition():
    """The torch integer emulation equals the definition in step_math.h written with Python
    ints, for 64-bit seeds and steps, 32-bit ids and element indices past 2^32."""
    cases = [(0, 0, 0), (1, 1, 1), (2**64 - 1, 2**63 + 5, 2**32 - 1), (12345, 10**12, 77)]
    index = torch.tensor([0, 1, 2, 65535, 65536, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**62 + 11])
    for seed, step, tid in cases:
        got = rounding.random_bits(seed, step, tid, index).tolist()
        assert got == [_bits(seed, step, tid, i) for i in index.tolist()], (seed, step, tid)
    with pytest.raises(ValueError, match="seed"):
        rounding.sr_key(-1, 0, 0)
    with pytest.raises(ValueError, match="tensor_id"):
        rounding.sr_key(0, 0, 2**32)


def test_random_bits_are_uniform():
    """The 16 bits the rounding uses, over 2^18 draws (4 steps x 2^16 elements): each of their 256
    top-byte values holds 1/256 of the draws within 5 sigmas, each bit is set half the time."""
    index = torch.arange(1 << 16)
    r = torch.cat([rounding.random_bits(7, s, 3, index) >> 16 for s in range(4)])
    n = r.numel()
    counts = torch.bincount(r >> 8, minlength=256)
    assert all(within_sigmas(c, n, 1 / 256) for c in counts.tolist())
    for b in range(16):
        assert within_sigmas(((r >> b) & 1).sum().item(), n, 0.5), b


# ---- the rounding itself ---------------------------------------------------------------------
def test_kernels_equal_the_torch_reference_bit_for_bit(backend):
    """Every size around the chunk edges, values over the whole fp32 range and the special ones,
    a channels_last tensor (elements indexed in memory order), several seeds, steps and ids;
    the bits do not depend on which other tensors share the call nor on their order."""
    d = dev(backend)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            3.4e38,
            -3.4e38,
            2**-149,
            -(2**-149),
            1.0,
            1.0 + 2**-20,
        ]
    )
    xs = [torch.cat([special, wide_fp32(n, seed=n)])[: n + 11].to(d) for n in SIZES]
    xs.append(
        wide_fp32(8 * 16 * 5 * 3, seed=1)
        .view(8, 16, 5, 3)
        .to(d)
        .contiguous(memory_format=torch.channels_last)
    )
    if backend.name == "cuda":  # past 320 chunks: one tensor spread over two launches
        xs.append(wide_fp32(321 * 65536 + 3, seed=2).to(d))
    ids = [3 * i + 1 for i in range(len(xs))]
    for seed, step in [(0, 0), (2**64 - 1, 1), (42, 10**9)]:
        out = sr_kernel(backend, xs, seed, step, ids)
        for x, o, tid in zip(xs, out, ids):
            want = rounding.stochastic_round(x, seed, step, tid)
            assert o.stride() == x.stride() and want.stride() == x.stride()
            assert torch.equal(bits16(o), bits16(want)), (x.shape, seed, step)
        # one at a time, in reverse order: the same bits
        for x, o, tid in reversed(list(zip(xs, out, ids))):
            assert torch.equal(bits16(sr_kernel(backend, [x], seed, step, [tid])[0]), bits16(o))


def test_the_bits_do_not_depend_on_the_thread_count(backend):
    d = dev(backend)
    xs = [wide_fp32(n, seed=10 + n).to(d) for n in (65537, 3 * 65536 + 5)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sr_kernel(backend, xs, 5, 6, [0, 1])
    finally:
        torch.set_num_threads(threads)
    assert all(
        torch.equal(bits16(a), bits16(b)) for a, b in zip(one, sr_kernel(backend, xs, 5, 6, [0, 1]))
    )


def test_a_value_becomes_one_of_its_two_neighbours_and_representable_values_stay(backend):
    d = dev(backend)
    x = wide_fp32(200_003, seed=20).to(d)
    lo, hi, _ = neighbours(x.cpu())
    for step in range(3):
        out = sr_kernel(backend, [x], 1, step, [0])[0].cpu().double()
        assert torch.all((out == lo) | (out == hi)), step
        assert not torch.equal(out, lo) and not torch.equal(out, hi)  # both directions occur
    exact = wide_fp32(100_001, seed=21).bfloat16().float().to(d)  # representable in bf16
    for step in range(3):
        assert torch.equal(
            bits16(sr_kernel(backend, [exact], 1, step, [0])[0]), bits16(exact.bfloat16())
        )


# (base value, fractions of the spacing above it): normal values of both signs, a tiny normal, a
# subnormal, the top binade; p = 1/65536 and 65535/65536 are the extreme probabilities.
BASES = [1.0, -3.5, 2.0**-120, -(2.0**-130), 1.5 * 2.0**127]  # all bf16 values
FRACTIONS = [1, 6554, 16384, 32768, 58982, 65535]  # in 65536ths of the spacing


def test_rounding_is_unbiased(backend):
    """For values between two bf16 neighbours, the fraction rounded up over 2^18 draws (2^16
    elements x 4 steps) is the float64 position between the neighbours within 5 sigmas: the mean
    rounded value is the value."""
    d = dev(backend)
    n = 1 << 16
    xs, ps = [], []
    for base in BASES:
        lo, hi, spacing = (t.item() for t in neighbours(torch.tensor([base])))
        assert lo == hi == base
        for f in FRACTIONS:
            value = torch.tensor(
                base + math.copysign(f / 65536 * spacing, base), dtype=torch.float64
            )
            x32 = value.float()
            assert x32.double() == value  # the test value is exact in fp32
            xs.append(torch.full((n,), x32.item(), device=d))
            ps.append((abs(value.item()) - abs(lo)) / spacing)
    ids = list(range(len(xs)))
    up = [0] * len(xs)
    sums = [0.0] * len(xs)
    for step in range(4):
        for i, (x, o) in enumerate(zip(xs, sr_kernel(backend, xs, 99, step, ids))):
            lo = neighbours(x[:1].cpu())[0].item()
            o64 = o.double()
            up[i] += (o64 != lo).sum().item()
            sums[i] += o64.sum().item()
    for i, (x, p) in enumerate(zip(xs, ps)):
        draws = 4 * n
        assert within_sigmas(up[i], draws, p), (x[0].item(), p, up[i] / draws)
        _, _, spacing = neighbours(x[:1].cpu())
        mean, value = sums[i] / draws, x[0].double().item()
        assert abs(mean - value) <= spacing.item() * (
            5 * math.sqrt(p * (1 - p) / draws) + 1 / draws
        ), (value, mean)


def test_decisions_are_independent_across_steps_tensors_seeds_and_elements(backend):
    d = dev(backend)
    n = 1 << 17
    x = torch.full((n,), 1.0 + 2**-8, device=d)  # halfway between 1 and 1 + 2^-7: p = 1/2

    def ups(seed, step, tid):
        return (sr_kernel(backend, [x], seed, step, [tid])[0] != 1.0).cpu()

    base = ups(1, 10, 0)
    assert within_sigmas(base.sum().item(), n, 0.5)
    for other in (ups(1, 11, 0), ups(1, 10, 1), ups(2, 10, 0)):  # step, tensor, seed
        assert within_sigmas((other == base).sum().item(), n, 0.5)
    assert within_sigmas((base[1:] == base[:-1]).sum().item(), n - 1, 0.5)  # neighbours
    assert torch.equal(ups(1, 10, 0), base)  # and the same arguments draw the same bits


def test_nan_inf_zeros_subnormals_and_the_largest_values(backend):
    d = dev(backend)
    bf16_max = torch.finfo(torch.bfloat16).max  # 0x7F7F: (2 - 2^-7) * 2^127
    top_spacing = 2.0**120
    n = 1 << 16
    values = {
        "+0": 0.0,
        "-0": -0.0,
        "+inf": math.inf,
        "-inf": -math.inf,
        "bf16 max": bf16_max,
        "-bf16 max": -bf16_max,
        "quarter past max": bf16_max + top_spacing / 4,
        "fp32 max": torch.finfo(torch.float32).max,
        "smallest subnormal": 2.0**-149,
        "between bf16 subnormals": -1.5 * 2.0**-133,
    }
    xs = [torch.full((n,), v, dtype=torch.float32, device=d) for v in values.values()]
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF], dtype=torch.int64)
    xs.append(nans.to(torch.int32).view(torch.float32).to(d))  # quiet, signalling, negative
    out = {
        k: o.cpu()
        for k, o in zip([*values, "nan"], sr_kernel(backend, xs, 3, 4, list(range(len(xs)))))
    }
    for key in ("+0", "-0", "+inf", "-inf", "bf16 max", "-bf16 max"):
        assert torch.equal(
            bits16(out[key]), bits16(torch.full((n,), values[key], dtype=torch.bfloat16))
        ), key
    assert torch.all(bits16(out["nan"]) == 0x7FC0)  # bf16's quiet NaN, as torch converts NaN
    # beyond the largest finite value inf is the next value: up with the float64 probability
    for key, p in (("quarter past max", 0.25), ("fp32 max", 1 - 2**-16)):
        assert torch.all((out[key] == bf16_max) | torch.isposinf(out[key])), key
        assert within_sigmas(torch.isposinf(out[key]).sum().item(), n, p), key
    # subnormals are rounded, never flushed: 2^-149 becomes 2^-133 with probability 2^-16
    small = out["smallest subnormal"].double()
    assert torch.all((small == 0) | (small == 2.0**-133))
    assert within_sigmas((small != 0).sum().item(), n, 2**-16)
    between = out["between bf16 subnormals"].double()
    assert torch.all((between == -(2.0**-133)) | (between == -(2.0**-132)))
    assert within_sigmas((between == -(2.0**-132)).sum().item(), n, 0.5)


def test_negative_values_mirror_positive_ones(backend):
    """The magnitude is rounded: -x with the same bits gives exactly -(rounded x)."""
    x = wide_fp32(65537, seed=30).abs().to(dev(backend))
    pos, neg = sr_kernel(backend, [x, -x], 8, 9, [4, 4])
    assert torch.equal(bits16(neg), bits16(-pos))


def test_the_torch_reference_refuses_what_it_cannot_index():
    with pytest.raises(ValueError, match="float32"):
        rounding.stochastic_round(torch.ones(3, dtype=torch.bfloat16), 0, 0, 0)
    with pytest.raises(ValueError, match="dense"):
        rounding.stochastic_round(torch.ones(8)[::2], 0, 0, 0)
    with pytest.raises(ValueError, match="step"):
        rounding.stochastic_round(torch.ones(2), 0, -1, 0)


# ---- SR optimizer steps against float64 ------------------------------------------------------
def sgd64(p, g, buf, *, lr, weight_decay, momentum, dampening, nesterov, first_run):
    g = g + weight_decay * p
    if momentum:
        buf = g.clone() if first_run else buf * momentum + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


def adam64(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decoupled):
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    update = (lr / (1 - beta1**step)) * m / (v.sqrt() / math.sqrt(1 - beta2**step) + eps)
    return p - update, m, v, update


def assert_rounded_from(out: torch.Tensor, want64: torch.Tensor, tol: torch.Tensor):
    """The stored bf16 values lie between the bf16 values bracketing want64 +- tol, and they are
    unbiased in aggregate: the mean of (out - want64) / spacing is 0 within 5 sigmas (sigma at
    most 1/2 / sqrt(n)) plus the fp32 tolerance."""
    o = out.cpu().double()
    assert torch.all(o >= bf16_floor(want64 - tol)) and torch.all(o <= bf16_ceil(want64 + tol))
    _, _, spacing = neighbours(want64)
    bias = ((o - want64) / spacing).mean().item()
    assert abs(bias) <= 5 * 0.5 / math.sqrt(o.numel()) + (tol / spacing).max().item(), bias


def assert_state(out: torch.Tensor, want64: torch.Tensor, tol: torch.Tensor):
    """fp32 state: within the fp32 tolerance of float64; bf16 state: rounded stochastically (its
    own stream of bits), so one of the two bf16 neighbours of float64 (within that tolerance),
    without bias (`assert_rounded_from`)."""
    if out.dtype == torch.bfloat16:
        assert_rounded_from(out, want64, tol)
        return
    assert torch.all((out.cpu().double() - want64).abs() <= tol)


STEP_SIZES = [1, 7, 65537]


def _bf16(n, seed, d, scale=1.0):
    return (torch.randn(n, generator=gen(seed)) * scale).bfloat16().to(d)


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first_run", [True, False])
def test_sgd_step_sr_matches_float64(backend, case, state_dtype, grad_dtype, first_run):
    d = dev(backend)
    params = [_bf16(n, 200 + i, d) for i, n in enumerate(STEP_SIZES)]
    grads = [(_bf16(n, 210 + i, d).float() * 256).to(grad_dtype) for i, n in enumerate(STEP_SIZES)]
    bufs = [_bf16(n, 220 + i, d).to(state_dtype) for i, n in enumerate(STEP_SIZES)]
    lr, scale, sign = 0.05, 1 / 256, -1.0 if case["maximize"] else 1.0
    before = [
        (p.cpu().double(), g.cpu().double() * scale * sign, b.cpu().double())
        for p, g, b in zip(params, grads, bufs)
    ]
    backend.ops.sgd_step_sr(
        params,
        grads,
        bufs if case["momentum"] else [],
        scalar(backend, scale),
        None,
        lr,
        case["weight_decay"],
        case["momentum"],
        case["dampening"],
        case["nesterov"],
        case["maximize"],
        first_run,
        5,
        17,
        [2, 0, 1],
    )
    for p, b, (p0, g0, b0) in zip(params, bufs, before):
        math_args = {k: v for k, v in case.items() if k != "maximize"}
        want_p, want_b = sgd64(p0, g0, b0, lr=lr, first_run=first_run, **math_args)
        assert p.dtype == torch.bfloat16
        tol = 4 * ulp32(want_p) + 4 * ulp32(p0) + 1e-30
        assert_rounded_from(p, want_p, tol)
        if case["momentum"]:
            assert b.dtype == state_dtype
            assert_state(b, want_b, 4 * ulp32(want_b) + 4 * ulp32(b0) + 4 * ulp32(g0) + 1e-30)
        else:
            assert torch.equal(b.cpu().double(), b0)  # no momentum: the buffers are not touched


@pytest.mark.parametrize("kind,case", ADAM_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_adam_step_sr_matches_float64(backend, kind, case, state_dtype, grad_dtype):
    d = dev(backend)
    params = [_bf16(n, 300 + i, d) for i, n in enumerate(STEP_SIZES)]
    grads = [(_bf16(n, 310 + i, d).float() * 64).to(grad_dtype) for i, n in enumerate(STEP_SIZES)]
    m = [_bf16(n, 320 + i, d, 0.1).to(state_dtype) for i, n in enumerate(STEP_SIZES)]
    v = [(_bf16(n, 330 + i, d, 0.1).float() ** 2).to(state_dtype) for i, n in enumerate(STEP_SIZES)]
    lr, beta1, beta2, eps, step, scale = 1e-2, 0.9, 0.999, 1e-8, 3, 1 / 64
    sign = -1.0 if case["maximize"] else 1.0
    before = [
        (p.cpu().double(), g.cpu().double() * scale * sign, a.cpu().double(), b.cpu().double())
        for p, g, a, b in zip(params, grads, m, v)
    ]
    backend.ops.adam_step_sr(
        params,
        grads,
        m,
        v,
        scalar(backend, scale),
        None,
        lr,
        beta1,
        beta2,
        eps,
        case["weight_decay"],
        1 - beta1**step,
        1 - beta2**step,
        kind == "adamw",
        case["maximize"],
        11,
        3,
        [0, 1, 2],
    )
    for p, a, b, (p0, g0, a0, b0) in zip(params, m, v, before):
        want_p, want_m, want_v, update = adam64(
            p0,
            g0,
            a0,
            b0,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=case["weight_decay"],
            step=step,
            decoupled=kind == "adamw",
        )
        assert_rounded_from(p, want_p, 4 * ulp32(p0) + 4e-6 * update.abs() + 1e-30)
        assert a.dtype == b.dtype == state_dtype
        assert_state(a, want_m, 4 * (ulp32(a0) + ulp32(g0) + ulp32(want_m)) + 1e-30)
        assert_state(b, want_v, 4 * (ulp32(b0) + ulp32(g0 * g0) + ulp32(want_v)) + 1e-30)


# ---- the fused steps of fp32 params with bf16 state (precision.optimizer_state=bfloat16) --------
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fused_steps_with_bf16_state_match_float64(backend, kind, grad_dtype):
    """fp32 params (masters) with bf16 state on the kernels' `sgd_step`/`adam_step`: the state
    is loaded to fp32, updated with the params and stored back rounded to nearest even. Against
    float64 from the same values: the params within the fp32 tolerance of the SR steps (4 ulps
    of the param, plus 4e-6 of the update for Adam, plus lr times the momentum's fp32 error for
    SGD), the state within half a bf16 spacing plus the fp32 tolerance, the 16-bit model copies
    the params rounded to nearest."""
    d = dev(backend)
    params = [_bf16(n, 500 + i, d).float() + 0.25 for i, n in enumerate(STEP_SIZES)]
    grads = [(_bf16(n, 510 + i, d).float() * 64).to(grad_dtype) for i, n in enumerate(STEP_SIZES)]
    copies = [torch.empty(p.shape, dtype=torch.bfloat16, device=d) for p in params]
    scale = 1 / 64
    if kind == "sgd":
        bufs = [_bf16(n, 520 + i, d) for i, n in enumerate(STEP_SIZES)]
        before = [
            (p.cpu().double(), g.cpu().double() * scale, b.cpu().double())
            for p, g, b in zip(params, grads, bufs)
        ]
        backend.ops.sgd_step(
            params,
            grads,
            bufs,
            copies,
            scalar(backend, scale),
            None,
            0.05,
            1e-4,
            0.9,
            0.0,
            False,
            False,
            False,
        )
        for p, b, c, (p0, g0, b0) in zip(params, bufs, copies, before):
            want_p, want_b = sgd64(
                p0,
                g0,
                b0,
                lr=0.05,
                weight_decay=1e-4,
                momentum=0.9,
                dampening=0.0,
                nesterov=False,
                first_run=False,
            )
            assert b.dtype == torch.bfloat16 and torch.equal(c, p.bfloat16())
            tol = 4 * ulp32(want_b) + 4 * ulp32(b0) + 4 * ulp32(g0) + 1e-30
            assert torch.all(
                (p.cpu().double() - want_p).abs() <= 4 * ulp32(want_p) + 4 * ulp32(p0) + 0.05 * tol
            )  # (lr times the momentum's error)
            assert torch.all((b.cpu().double() - want_b).abs() <= neighbours(want_b)[2] / 2 + tol)
        return
    m = [_bf16(n, 520 + i, d, 0.1) for i, n in enumerate(STEP_SIZES)]
    v = [(_bf16(n, 530 + i, d, 0.1).float() ** 2).bfloat16() for i, n in enumerate(STEP_SIZES)]
    lr, beta1, beta2, eps, step = 1e-2, 0.9, 0.999, 1e-8, 3
    before = [
        (p.cpu().double(), g.cpu().double() * scale, a.cpu().double(), b.cpu().double())
        for p, g, a, b in zip(params, grads, m, v)
    ]
    backend.ops.adam_step(
        params,
        grads,
        m,
        v,
        copies,
        scalar(backend, scale),
        None,
        lr,
        beta1,
        beta2,
        eps,
        1e-2,
        1 - beta1**step,
        1 - beta2**step,
        kind == "adamw",
        False,
    )
    for p, a, b, c, (p0, g0, a0, b0) in zip(params, m, v, copies, before):
        want_p, want_m, want_v, update = adam64(
            p0,
            g0,
            a0,
            b0,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=1e-2,
            step=step,
            decoupled=kind == "adamw",
        )
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(c, p.bfloat16())
        assert torch.all(
            (p.cpu().double() - want_p).abs() <= 4 * ulp32(p0) + 4e-6 * update.abs() + 1e-30
        )
        for got, want, tol in (
            (a, want_m, 4 * (ulp32(a0) + ulp32(g0) + ulp32(want_m))),
            (b, want_v, 4 * (ulp32(b0) + ulp32(g0 * g0) + ulp32(want_v))),
        ):
            assert torch.all(
                (got.cpu().double() - want).abs() <= neighbours(want)[2] / 2 + tol + 1e-30
            )


def test_sgd_step_sr_rounds_the_exact_update_bit_for_bit(backend):
    """With values whose update fp32 computes exactly (bf16 params in [1, 2), gradients and
    momentum of magnitude in [1/4, 1), lr 2^-10, momentum 1/2: every result is a multiple of
    2^-20 below 2), the fused step stores exactly the reference's stochastic rounding of the
    float64 result under the same seed, step and tensor ids: the step kernels index elements
    (chunk edges, channels_last) and tensors as `stochastic_round` does."""
    d = dev(backend)
    shapes = [(n,) for n in SIZES] + [(8, 16, 5, 3)]

    def in_range(seed, shape, lo, hi, signed):
        g = gen(seed)
        x = torch.rand(shape, generator=g) * (hi - lo) + lo
        if signed:
            x = x * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
        x = x.bfloat16()
        return (x.contiguous(memory_format=torch.channels_last) if len(shape) == 4 else x).to(d)

    params = [in_range(400 + i, s, 1.0, 1.99, False) for i, s in enumerate(shapes)]
    grads = [in_range(410 + i, s, 0.25, 0.99, True) for i, s in enumerate(shapes)]
    bufs = [in_range(420 + i, s, 0.25, 0.99, True).float() for i, s in enumerate(shapes)]
    ids = [9, 4, 0, 13, 2, 7, 5]
    lr = 2.0**-10
    before = [(p.double(), g.double(), b.double()) for p, g, b in zip(params, grads, bufs)]
    backend.ops.sgd_step_sr(
        params,
        grads,
        bufs,
        scalar(backend, 1.0),
        None,
        lr,
        0.0,
        0.5,
        0.0,
        False,
        False,
        False,
        2**40 + 1,
        123,
        ids,
    )
    for p, b, tid, (p0, g0, b0) in zip(params, bufs, ids, before):
        want_p, want_b = sgd64(
            p0,
            g0,
            b0,
            lr=lr,
            weight_decay=0.0,
            momentum=0.5,
            dampening=0.0,
            nesterov=False,
            first_run=False,
        )
        assert torch.equal(want_p.float().double(), want_p)  # exact in fp32 indeed
        assert torch.equal(b.double(), want_b)
        want = rounding.stochastic_round(want_p.float(), 2**40 + 1, 123, tid)
        assert p.stride() == want.stride()
        assert torch.equal(bits16(p), bits16(want)), p.shape


@pytest.mark.parametrize("op", ["sgd", "adam"])
def test_sr_steps_do_nothing_when_found_inf_is_set(backend, op):
    d = dev(backend)
    params = [_bf16(n, 500 + i, d) for i, n in enumerate(STEP_SIZES)]
    grads = [_bf16(n, 510 + i, d) for i, n in enumerate(STEP_SIZES)]
    s1 = [torch.full_like(p, 0.25) for p in params]
    s2 = [torch.full_like(p, 0.5, dtype=torch.float32) for p in params]
    everything = [*params, *s1, *s2]
    before = [t.clone() for t in everything]

    def run(flag):
        if op == "sgd":
            backend.ops.sgd_step_sr(
                params,
                grads,
                s1,
                scalar(backend, 1.0),
                flag,
                0.1,
                1e-4,
                0.9,
                0.0,
                False,
                False,
                False,
                0,
                1,
                [0, 1, 2],
            )
        else:
            backend.ops.adam_step_sr(
                params,
                grads,
                s1,
                s2,
                scalar(backend, 1.0),
                flag,
                1.0,
                0.9,
                0.999,
                1e-8,
                0.0,
                0.1,
                0.001,
                False,
                False,
                0,
                1,
                [0, 1, 2],
            )

    run(scalar(backend, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(everything, before))
    run(scalar(backend, 0.0))
    n = len(params)
    changed = [not torch.equal(a, b) for a, b in zip(everything, before)]
    assert all(changed[:n]) and all(changed[n : 2 * n])


def test_sr_ops_refuse_bad_arguments_with_the_reason(backend):
    d = dev(backend)
    one = scalar(backend, 1.0)
    p = torch.ones(4, dtype=torch.bfloat16, device=d)
    x = torch.ones(4, device=d)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        backend.ops.sgd_step_sr(
            [x], [x], [], one, None, 0.1, 0.0, 0.0, 0.0, False, False, True, 0, 0, [0]
        )
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        backend.ops.adam_step_sr(
            [p],
            [p],
            [p.half()],
            [p],
            one,
            None,
            0.1,
            0.9,
            0.999,
            1e-8,
            0.0,
            0.1,
            0.001,
            False,
            False,
            0,
            0,
            [0],
        )
    with pytest.raises(RuntimeError, match="tensor_ids has 2 ids for 1 tensors"):
        backend.ops.stochastic_round([x], [p], 0, 0, [0, 1])
    with pytest.raises(RuntimeError, match=r"outside \[0, 2\^32\)"):
        backend.ops.stochastic_round([x], [p], 0, 0, [2**32])
    with pytest.raises(RuntimeError, match="dst\\[0\\] must be bfloat16"):
        backend.ops.stochastic_round([x], [x.half()], 0, 0, [0])
    with pytest.raises(RuntimeError, match="src\\[0\\] must be float32"):
        backend.ops.stochastic_round([p], [p], 0, 0, [0])
    with pytest.raises(TypeError):  # seeds and steps are unsigned 64-bit
        backend.ops.stochastic_round([x], [p], -1, 0, [0])


# ---- determinism and resume ------------------------------------------------------------------
def _run_steps(backend, state, first, last, seed):
    """Steps first..last-1 of an SR SGD (bf16 momentum) and an SR Adam (fp32 state) model, each
    step's gradients a function of the step number, in place on `state`."""
    d = dev(backend)
    for step in range(first, last):
        grads = [_bf16(p.numel(), 1000 * step + i, d) for i, p in enumerate(state["sgd_p"])]
        backend.ops.sgd_step_sr(
            state["sgd_p"],
            grads,
            state["sgd_buf"],
            scalar(backend, 1.0),
            None,
            1e-3,
            1e-4,
            0.9,
            0.0,
            True,
            False,
            step == 0,
            seed,
            step,
            [0, 1],
        )
        backend.ops.adam_step_sr(
            state["adam_p"],
            grads,
            state["m"],
            state["v"],
            scalar(backend, 1.0),
            None,
            1e-3,
            0.9,
            0.999,
            1e-8,
            1e-2,
            1 - 0.9 ** (step + 1),
            1 - 0.999 ** (step + 1),
            True,
            False,
            seed,
            step,
            [0, 1],
        )


def _fresh(backend):
    d = dev(backend)
    sizes = [65537, 33]
    p = [_bf16(n, 600 + i, d) for i, n in enumerate(sizes)]
    return {
        "sgd_p": [t.clone() for t in p],
        "sgd_buf": [torch.empty_like(t) for t in p],
        "adam_p": [t.clone() for t in p],
        "m": [torch.zeros_like(t, dtype=torch.float32) for t in p],
        "v": [torch.zeros_like(t, dtype=torch.float32) for t in p],
    }


def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(backend):
    """20 steps in one go == 8 steps, a save and a load into new tensors, 12 more steps; a second
    uninterrupted run repeats the first bit for bit, another seed does not."""
    whole = _fresh(backend)
    _run_steps(backend, whole, 0, 20, seed=77)
    again = _fresh(backend)
    _run_steps(backend, again, 0, 20, seed=77)
    part = _fresh(backend)
    _run_steps(backend, part, 0, 8, seed=77)
    buffer = io.BytesIO()
    torch.save(part, buffer)
    buffer.seek(0)
    resumed = torch.load(buffer, weights_only=True)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(resumed["sgd_p"], part["sgd_p"]))
    _run_steps(backend, resumed, 8, 20, seed=77)

    def raw(t):  # the bit patterns (NaN-safe, -0 != +0)
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    for key in whole:
        for a, b, c in zip(whole[key], again[key], resumed[key]):
            assert torch.equal(raw(a), raw(b)) and torch.equal(raw(a), raw(c)), key
    other = _fresh(backend)
    _run_steps(backend, other, 0, 20, seed=78)
    assert not torch.equal(other["sgd_p"][0], whole["sgd_p"][0])


# ---- the torch fallback ----------------------------------------------------------------------
def _model_params(d):
    """Three bf16 params with gradients, one fp32 param with a gradient, one bf16 param without."""
    shapes = [(65537,), (8, 16, 5, 3), (7,)]
    params = [
        torch.nn.Parameter(_bf16(math.prod(s), 700 + i, d).view(s)) for i, s in enumerate(shapes)
    ]
    params[1] = torch.nn.Parameter(params[1].detach().contiguous(memory_format=torch.channels_last))
    fp32 = torch.nn.Parameter(torch.randn(33, generator=gen(710)).to(d))
    idle = torch.nn.Parameter(_bf16(5, 711, d))
    return params, fp32, idle


def _set_grads(params, fp32, step, d):
    for i, p in enumerate(params):
        p.grad = (
            _bf16(p.numel(), 720 + 10 * step + i, d)
            .view(p.shape)
            .contiguous(
                memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format
            )
        )
    fp32.grad = torch.randn(33, generator=gen(730 + step)).to(d)


def assert_agree(a: torch.Tensor, b: torch.Tensor, what: str):
    """Equal in all but at most 1 element in 1000, those one bf16 spacing apart -- or 1e-6 apart
    where fp32 cancellation left a value far below its operands (all of order 1 here), whose
    absolute fp32 error then exceeds the value's own bf16 spacing."""
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    differ = a64 != b64
    assert differ.sum().item() <= max(1, a.numel() // 1000), (what, differ.sum().item())
    if a.dtype == torch.bfloat16:
        spacing = neighbours(torch.maximum(a64.abs(), b64.abs()))[2].clamp(min=1e-6)
        assert torch.all((a64 - b64).abs()[differ] <= spacing[differ]), what
    else:
        torch.testing.assert_close(a64, b64, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_the_fallback_agrees_with_the_kernel_steps(backend, kind):
    """Three steps of torch.optim's SGD (momentum, Nesterov, weight decay), Adam or AdamW on bf16
    params through `rounding.sr_step`, each compared with the SR kernel step from the same
    params and state (then the fallback continues from the kernel's values). The fallback keeps
    torch's layout (bf16 state for bf16 params, `step` a float32 scalar), the params' storage and
    bf16 gradients; fp32 params step as torch steps them; a param without gradient is left alone
    and still counts in the tensor ids."""
    d = dev(backend)
    params, fp32, idle = _model_params(d)
    reference_fp32 = torch.nn.Parameter(fp32.detach().clone())
    hyper = dict(lr=1e-2, weight_decay=1e-2)
    if kind == "sgd":
        make = lambda ps: torch.optim.SGD(ps, momentum=0.9, nesterov=True, **hyper)  # noqa: E731
    else:
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        make = lambda ps: cls(ps, betas=(0.9, 0.999), eps=1e-8, **hyper)  # noqa: E731
    opt = make([{"params": [params[0], idle]}, {"params": [fp32, params[1], params[2]]}])
    ref_opt = make([reference_fp32])
    ids = [0, 3, 4]  # positions in the flattened param list: idle is 1, fp32 is 2
    assert [rounding.tensor_ids(opt)[id(p)] for p in params] == ids
    storage = [p.data_ptr() for p in params]
    idle_before = idle.detach().clone()
    seed = 31
    for step in range(3):
        _set_grads(params, fp32, step, d)
        grads = [p.grad.clone() for p in params]
        reference_fp32.grad = fp32.grad.clone()
        mine = [p.detach().clone() for p in params]
        if kind == "sgd":
            bufs = (
                [torch.empty_like(p) for p in params]
                if step == 0
                else [opt.state[p]["momentum_buffer"].clone() for p in params]
            )
            backend.ops.sgd_step_sr(
                mine,
                grads,
                bufs,
                scalar(backend, 1.0),
                None,
                1e-2,
                1e-2,
                0.9,
                0.0,
                True,
                False,
                step == 0,
                seed,
                step,
                ids,
            )
            states = [{"momentum_buffer": b} for b in bufs]
        else:
            m = [opt.state[p]["exp_avg"].clone() if step else torch.zeros_like(p) for p in params]
            v = [
                opt.state[p]["exp_avg_sq"].clone() if step else torch.zeros_like(p) for p in params
            ]
            backend.ops.adam_step_sr(
                mine,
                grads,
                m,
                v,
                scalar(backend, 1.0),
                None,
                1e-2,
                0.9,
                0.999,
                1e-8,
                1e-2,
                1 - 0.9 ** (step + 1),
                1 - 0.999 ** (step + 1),
                kind == "adamw",
                False,
                seed,
                step,
                ids,
            )
            states = [{"exp_avg": a, "exp_avg_sq": b} for a, b in zip(m, v)]
        rounding.sr_step(opt, seed, step)
        ref_opt.step()
        for i, (p, g, want, state) in enumerate(zip(params, grads, mine, states)):
            assert p.dtype == torch.bfloat16 and p.data_ptr() == storage[i]
            assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, g)
            assert p.stride() == want.stride()
            assert_agree(p, want, f"param {i} step {step}")
            for key, value in state.items():
                got = opt.state[p][key]
                assert got.dtype == torch.bfloat16 and got.shape == p.shape, key
                assert_agree(got, value, f"{key} {i} step {step}")
                got.copy_(value)  # continue from the kernel's values
            p.data.copy_(want)
            if kind != "sgd":
                assert opt.state[p]["step"].dtype == torch.float32
                assert opt.state[p]["step"].item() == step + 1
        assert torch.equal(fp32, reference_fp32)  # an fp32 param: torch's own step
        assert torch.equal(idle, idle_before) and idle not in opt.state


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-1),
    ],
    ids=["rmsprop", "adagrad"],
)
def test_the_fallback_rounds_any_optimizers_fp32_step(backend, make):
    """An optimizer the kernels do not implement: `sr_step` stores exactly the stochastic
    rounding of that optimizer's own step on fp32 copies of the bf16 params and state (bit for
    bit: the same torch ops on the same fp32 values), the bf16 state rounded stochastically with
    its own stream of bits (3, 4, ... for keys the kernels do not know, in sorted order)."""
    d = dev(backend)
    params, _, _ = _model_params(d)
    opt = make(params)
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = (
                _bf16(p.numel(), 800 + 10 * step + i, d)
                .view(p.shape)
                .contiguous(
                    memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format
                )
            )
        twins = [torch.nn.Parameter(p.detach().float()) for p in params]
        twin_opt = make(twins)
        for p, t in zip(params, twins):
            t.grad = p.grad.float()
            twin_opt.state[t] = {
                k: (v.float() if k != "step" and v.shape == p.shape else v.clone())
                for k, v in opt.state[p].items()
            }
        twin_opt.step()
        rounding.sr_step(opt, 5, step)
        for i, (p, t) in enumerate(zip(params, twins)):
            want = rounding.stochastic_round(t.detach(), 5, step, i)
            assert torch.equal(bits16(p.detach()), bits16(want)), (i, step)
            others = sorted(
                k for k in twin_opt.state[t] if k not in rounding.STATE_STREAMS and k != "step"
            )
            for key, value in twin_opt.state[t].items():
                got = opt.state[p][key]
                if key == "step":
                    assert torch.equal(got, value)
                else:
                    stream = rounding.STATE_STREAMS.get(key) or 3 + others.index(key)
                    want = rounding.stochastic_round(value, 5, step, i, stream)
                    assert got.dtype == torch.bfloat16 and torch.equal(bits16(got), bits16(want)), (
                        key
                    )
                    assert (
                        not torch.equal(bits16(got), bits16(value.bfloat16())) or value.numel() < 64
                    ), key  # not rounded to nearest


def test_the_fallback_restores_everything_when_the_optimizer_raises():
    class FailingSGD(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)  # the fp32 copies are updated, then the step fails
            raise RuntimeError("the optimizer failed")

    params, _, _ = _model_params(torch.device("cpu"))
    opt = FailingSGD(params, lr=0.1, momentum=0.9)
    _set_grads(params, torch.nn.Parameter(torch.zeros(33)), 0, torch.device("cpu"))
    for p in params:
        opt.state[p]["momentum_buffer"] = torch.ones_like(p)
    before = [(p.detach().clone(), p.grad, opt.state[p]["momentum_buffer"]) for p in params]
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        rounding.sr_step(opt, 0, 0)
    for p, (data, grad, buf) in zip(params, before):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), data)
        assert p.grad is grad and opt.state[p]["momentum_buffer"] is buf
        assert torch.equal(buf, torch.ones_like(p))


# ---- the point of it all ---------------------------------------------------------------------
def test_sr_keeps_updates_smaller_than_the_bf16_spacing(backend):
    """A weight of 1.5 (bf16 spacing 2^-7 there) stepped 1000 times by lr * grad = 3 * 2^-12 (about
    a tenth of the spacing; every fp32 update exact): plain bf16 SGD (round to nearest) leaves it
    at 1.5; SR moves 4096 independent copies on average to 1.5 - 1000 * 3 * 2^-12 = 0.767578125
    within 5 sigmas (sigma <= sqrt(1000) * 2^-7 / 2 / sqrt(4096)), through the kernels and through
    the fallback."""
    d = dev(backend)
    n, steps, lr = 4096, 1000, 3 * 2.0**-12
    expected = 1.5 - steps * lr
    tol = 5 * math.sqrt(steps) * 2.0**-7 / 2 / math.sqrt(n)

    plain = torch.nn.Parameter(torch.full((n,), 1.5, dtype=torch.bfloat16, device=d))
    plain_opt = torch.optim.SGD([plain], lr=lr)
    for _ in range(steps):
        plain.grad = torch.ones_like(plain)
        plain_opt.step()
    assert torch.all(plain.detach() == 1.5)  # every update lost

    w = [torch.full((n,), 1.5, dtype=torch.bfloat16, device=d)]
    grad = [torch.ones(n, dtype=torch.bfloat16, device=d)]
    one = scalar(backend, 1.0)
    for step in range(steps):
        backend.ops.sgd_step_sr(
            w, grad, [], one, None, lr, 0.0, 0.0, 0.0, False, False, True, 2024, step, [0]
        )
    assert abs(w[0].double().mean().item() - expected) <= tol, w[0].double().mean().item()

    fallback = torch.nn.Parameter(torch.full((n,), 1.5, dtype=torch.bfloat16, device=d))
    fallback_opt = torch.optim.SGD([fallback], lr=lr)
    for step in range(steps):
        fallback.grad = torch.ones_like(fallback)
        rounding.sr_step(fallback_opt, 2025, step)
    assert abs(fallback.detach().double().mean().item() - expected) <= tol


# ---- building ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(
    csrc.cuda_toolkit() is None,
    reason="no CUDA toolkit (set CUDA_HOME to the folder holding bin/nvcc)",
)
def test_cuda_backend_binds_the_sr_ops(monkeypatch):
    """The CUDA kernels compile (for TORCH_CUDA_ARCH_LIST, e.g. 9.0, without a GPU) with the SR
    ops bound, and those check their arguments (CPU tensors refused) before any launch."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    monkeypatch.setattr(loader, "_LOADED", {})
    kernels = csrc.build("cuda")
    x, p = torch.ones(3), torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        kernels.ops.stochastic_round([x], [p], 0, 0, [0])
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        kernels.ops.sgd_step_sr(
            [p], [p], [], torch.ones(1), None, 0.1, 0.0, 0.0, 0.0, False, False, True, 0, 0, [0]
        )
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        kernels.ops.adam_step_sr(
            [p],
            [p],
            [p],
            [p],
            torch.ones(1),
            None,
            0.1,
            0.9,
            0.999,
            1e-8,
            0.0,
            0.1,
            0.001,
            False,
            False,
            0,
            0,
            [0],
        )
