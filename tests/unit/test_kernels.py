"""The fused multi-tensor kernels (runner/csrc) against float64 references and torch.optim.

The same test bodies run on every backend present: the C++ kernels on the CPU always, the CUDA
kernels where a GPU is (marked `gpu`, skipped elsewhere). A separate test compiles the CUDA
sources wherever a CUDA toolkit is installed, GPU or not, so a CUDA compile error fails the suite.

Tolerances, stated per test: elementwise scaling and dtype conversion are exact (one IEEE
rounding, the same one torch makes); L2 norms accumulate in fp32 per 64Ki-element chunk and fp64
across chunks (rtol 1e-5 against fp64); optimizer steps agree with torch.optim on fp32 params to
rtol 1e-6 / atol 1e-7 per step (fused multiply-adds round once where torch may round twice).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner import csrc
from runner.csrc import loader
from runner.errors import RunnerError
from tests.helpers.kernel_cases import ADAM_CASES, SCALE_BOUNDED, SGD_CASES

SIZES = [1, 7, 65535, 65536, 65537, 3 * 65536 + 5]  # odd, chunk edges, several chunks
LARGE = (1 << 22) + 3  # 4M elements: many chunks, an odd tail
HALF = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _two_threads_at_least():
    """The C++ kernels share a call's spans among torch's threads (at::parallel_for): these tests
    run them on two at least, as a run on a multi-core machine does, whatever the suite's workers
    use (one: tests/conftest.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["cpp", pytest.param("cuda", marks=pytest.mark.gpu)], scope="module")
def backend(request):
    kernels = csrc.build(request.param)
    return kernels


def dev(backend) -> torch.device:
    return torch.device(backend.device_type)


def scalar(backend, value: float) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=dev(backend))


def randn(n, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype).to(device)


def poison_positions(tensors):
    """(tensor index, element index) pairs: first/middle/last tensor x first/last element."""
    last = len(tensors) - 1
    return [(t, e) for t in (0, last // 2, last) for e in (0, tensors[t].numel() - 1)]


# ---- unscale_check -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_unscale_check_into_fp32_is_exact(backend, in_dtype, out_dtype):
    d = dev(backend)
    sizes = [*SIZES, LARGE]
    grads = [randn(n, in_dtype, d, seed=i, scale=1000.0) for i, n in enumerate(sizes)]
    out = [torch.empty(n, dtype=out_dtype, device=d) for n in sizes]
    found = scalar(backend, 0.0)
    inv = 1.0 / 3000.0  # not a power of two: a real rounding
    backend.ops.unscale_check(grads, out, scalar(backend, inv), found)
    assert found.item() == 0.0
    for g, o in zip(grads, out):
        # one rounding of the exact product (exact in float64) to fp32: bit for bit
        want = (g.double() * torch.tensor(inv, dtype=torch.float32).double()).to(out_dtype)
        assert torch.equal(o, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_unscale_check_in_place_matches_torch(backend, dtype):
    d = dev(backend)
    grads = [randn(n, dtype, d, seed=10 + i, scale=64.0) for i, n in enumerate(SIZES)]
    want = [(g.float() * (1.0 / 64.0)).to(dtype) for g in grads]
    found = scalar(backend, 0.0)
    backend.ops.unscale_check(grads, grads, scalar(backend, 1.0 / 64.0), found)
    assert found.item() == 0.0
    for g, w in zip(grads, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_unscale_check_flags_every_non_finite_position(backend, bad, dtype):
    d = dev(backend)
    base = [randn(n, dtype, d, seed=20 + i) for i, n in enumerate(SIZES)]
    for t, e in poison_positions(base):
        grads = [g.clone() for g in base]
        grads[t][e] = bad
        out = [torch.empty(n, dtype=torch.float32, device=d) for n in SIZES]
        found = scalar(backend, 0.0)
        backend.ops.unscale_check(grads, out, scalar(backend, 0.5), found)
        assert found.item() == 1.0, (t, e)
        # every other value is still unscaled correctly
        mask = torch.ones(grads[t].numel(), dtype=torch.bool, device=d)
        mask[e] = False
        assert torch.equal(out[t][mask], grads[t][mask].float() * 0.5)


def test_flags_are_sticky(backend):
    found = scalar(backend, 1.0)
    g = [randn(10, torch.float32, dev(backend), seed=1)]
    backend.ops.unscale_check(g, g, scalar(backend, 1.0), found)
    backend.ops.check_finite(g, found)
    assert found.item() == 1.0  # a clean pass never clears an earlier verdict


# ---- check_finite --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_check_finite_is_read_only_and_finds_every_position(backend, dtype):
    d = dev(backend)
    base = [randn(n, dtype, d, seed=30 + i, scale=1e3) for i, n in enumerate(SIZES)]
    found = scalar(backend, 0.0)
    copies = [b.clone() for b in base]
    backend.ops.check_finite(base, found)
    assert found.item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(base, copies))
    # the largest finite values are finite (bit test on the exponent, not a range test)
    biggest = [torch.full((5,), torch.finfo(dtype).max, dtype=dtype, device=d)]
    backend.ops.check_finite(biggest, found)
    assert found.item() == 0.0
    for t, e in poison_positions(base):
        tensors = [b.clone() for b in base]
        tensors[t][e] = float("nan") if e else float("inf")
        found = scalar(backend, 0.0)
        backend.ops.check_finite(tensors, found)
        assert found.item() == 1.0, (t, e)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_check_finite_reads_every_stretch_of_a_long_tensor(backend, dtype):
    """A long tensor is read in interleaved stretches: a non-finite value anywhere in any of
    them (both ends of each quarter of a chunk, the tail) is found, and the extreme finite
    values (+-max, the smallest subnormal, -0) anywhere are not flagged."""
    d = dev(backend)
    info = torch.finfo(dtype)
    n = 65536 + 13
    finite = randn(n, dtype, d, seed=35)
    for i, value in enumerate([info.max, -info.max, info.smallest_normal / 4, -0.0] * 8):
        finite[(i * 8191) % n] = value
    found = scalar(backend, 0.0)
    backend.ops.check_finite([finite], found)
    assert found.item() == 0.0
    q = 65536 // 4
    for e in [0, q - 1, q, 2 * q - 1, 2 * q, 3 * q - 1, 3 * q, 65535, 65536, n - 1]:
        for bad in (float("inf"), float("-inf"), float("nan")):
            poisoned = finite.clone()
            poisoned[e] = bad
            found = scalar(backend, 0.0)
            backend.ops.check_finite([poisoned], found)
            assert found.item() == 1.0, (e, bad)


# ---- l2norm --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_l2norm_matches_float64(backend, dtype):
    d = dev(backend)
    tensors = [randn(n, dtype, d, seed=40 + i, scale=8.0) for i, n in enumerate([*SIZES, LARGE])]
    scale = 1.0 / 8.0
    total, per = backend.ops.l2norm(tensors, scalar(backend, scale), None)
    want_per = torch.stack([torch.linalg.vector_norm(t.double() * scale) for t in tensors])
    want_total = torch.linalg.vector_norm(want_per)
    assert total.dtype == per.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(per.double(), want_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.double(), want_total, rtol=1e-5, atol=0)


def test_l2norm_non_finite_and_empty(backend):
    d = dev(backend)
    tensors = [randn(n, torch.float16, d, seed=50 + i) for i, n in enumerate(SIZES)]
    tensors[2][100] = float("inf")
    found = scalar(backend, 0.0)
    total, per = backend.ops.l2norm(tensors, scalar(backend, 1.0), found)
    assert found.item() == 1.0 and total.item() == float("inf")
    assert per[2].item() == float("inf") and torch.isfinite(per[[0, 1, 3, 4, 5]]).all()
    tensors[2][100] = float("nan")
    total, per = backend.ops.l2norm(tensors, scalar(backend, 1.0), None)
    assert torch.isnan(total) and torch.isnan(per[2])
    # empty list and empty tensors
    total, per = backend.ops.l2norm([], scalar(backend, 1.0), None)
    assert total.item() == 0.0 and per.numel() == 0
    empty = torch.empty(0, device=d)
    total, per = backend.ops.l2norm(
        [empty, torch.ones(4, device=d), empty], scalar(backend, 1.0), None
    )
    assert per.tolist() == [0.0, 2.0, 0.0] and total.item() == 2.0


# ---- copy_scale: dtype conversion as torch rounds --------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_copy_to_half_rounds_exactly_like_torch(backend, dtype):
    d = dev(backend)
    info = torch.finfo(dtype)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            info.max,
            info.max * 1.0001,
            65520.0,
            65519.99,
            info.tiny,
            info.tiny / 3,
            1.0 + 2**-11,
            1.0 + 3 * 2**-11,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
        ],
        dtype=torch.float32,
    )
    values = torch.cat(
        [
            special,
            randn(70001, torch.float32, "cpu", seed=60, scale=100.0),
            randn(1001, torch.float32, "cpu", seed=61, scale=1e-6),
        ]
    ).to(d)
    out = torch.empty_like(values, dtype=dtype)
    backend.ops.copy_scale([values], [out], scalar(backend, 1.0))
    want = values.to(dtype)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])


def test_copy_scale_fp32_and_back(backend):
    d = dev(backend)
    src = [randn(n, torch.bfloat16, d, seed=70 + i) for i, n in enumerate(SIZES)]
    dst = [torch.empty(n, dtype=torch.float32, device=d) for n in SIZES]
    backend.ops.copy_scale(src, dst, scalar(backend, 2.0))
    assert all(torch.equal(b, a.float() * 2.0) for a, b in zip(src, dst))


# ---- fused optimizer steps against torch.optim ---------------------------------------------
def _torch_reference(make_opt, params, grads_fp32, steps):
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    opt = make_opt(ref)
    for _ in range(steps):
        for r, g in zip(ref, grads_fp32):
            r.grad = g.clone()
        opt.step()
    return ref, opt


@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.float32])
def test_sgd_step_matches_torch_optim(backend, case, grad_dtype):
    d = dev(backend)
    sizes = [1, 7, 65537]
    params = [randn(n, torch.float32, d, seed=80 + i) for i, n in enumerate(sizes)]
    # scaled gradients in their storage type, and the true fp32 gradients they stand for
    grads = [
        (randn(n, torch.float32, d, seed=90 + i) * 1024.0).to(grad_dtype)
        for i, n in enumerate(sizes)
    ]
    true = [g.float() / 1024.0 for g in grads]
    lr = 0.05
    steps = 3
    ref, _ = _torch_reference(lambda ps: torch.optim.SGD(ps, lr=lr, **case), params, true, steps)
    mine = [p.clone() for p in params]
    bufs = [torch.empty_like(p) for p in params]
    copies = [torch.empty(p.shape, dtype=torch.float16, device=d) for p in params]
    for step in range(steps):
        backend.ops.sgd_step(
            mine,
            grads,
            bufs if case["momentum"] else [],
            copies,
            scalar(backend, 1.0 / 1024.0),
            None,
            lr,
            case["weight_decay"],
            case["momentum"],
            case["dampening"],
            case["nesterov"],
            case["maximize"],
            step == 0,
        )
    for m, r, c in zip(mine, ref, copies):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(c, m.half())  # the model copy: the fp32 result, rounded


@pytest.mark.parametrize("kind,case", ADAM_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_adam_step_matches_torch_optim(backend, kind, case, grad_dtype):
    d = dev(backend)
    sizes = [1, 7, 65537]
    params = [randn(n, torch.float32, d, seed=100 + i) for i, n in enumerate(sizes)]
    grads = [
        (randn(n, torch.float32, d, seed=110 + i) * 256.0).to(grad_dtype)
        for i, n in enumerate(sizes)
    ]
    true = [g.float() / 256.0 for g in grads]
    lr, betas, eps, steps = 1e-2, (0.9, 0.999), 1e-8, 4
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    ref, _ = _torch_reference(
        lambda ps: cls(ps, lr=lr, betas=betas, eps=eps, **case), params, true, steps
    )
    mine = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    copies = [torch.empty(p.shape, dtype=torch.bfloat16, device=d) for p in params]
    for step in range(1, steps + 1):
        backend.ops.adam_step(
            mine,
            grads,
            m,
            v,
            copies,
            scalar(backend, 1.0 / 256.0),
            None,
            lr,
            betas[0],
            betas[1],
            eps,
            case["weight_decay"],
            1 - betas[0] ** step,
            1 - betas[1] ** step,
            kind == "adamw",
            case["maximize"],
        )
    for p, r, c in zip(mine, ref, copies):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(c, p.bfloat16())


@pytest.mark.parametrize("op", ["sgd", "adam"])
def test_bf16_state_is_the_fp32_state_step_rounded_to_nearest(backend, op):
    """Optimizer state kept in bf16 beside fp32 masters: each step loads it exactly, computes as
    the fp32-state step does and stores it rounded to nearest even. The reference is the same
    step with fp32 state (checked against torch.optim above) whose state is rounded to bf16
    after every step: params, state and 16-bit copies agree bit for bit. The 16-bit copies are
    views one element into their storage (not vector-aligned), and the sizes end in tails."""
    d = dev(backend)
    sizes = [1, 7, 65537, 3 * 65536 + 5]
    params = [randn(n, torch.float32, d, seed=150 + i) for i, n in enumerate(sizes)]
    grads = [randn(n, torch.float16, d, seed=160 + i, scale=256.0) for i, n in enumerate(sizes)]
    n_state = 2 if op == "adam" else 1
    runs = {}
    for state_dtype in (torch.bfloat16, torch.float32):
        mine = [p.clone() for p in params]
        states = [[torch.zeros_like(p, dtype=state_dtype) for p in params] for _ in range(n_state)]
        copies = [torch.empty(n + 1, dtype=torch.float16, device=d)[1:] for n in sizes]
        for step in range(1, 4):
            if op == "adam":
                backend.ops.adam_step(
                    mine,
                    grads,
                    *states,
                    copies,
                    scalar(backend, 1 / 256),
                    None,
                    1e-2,
                    0.9,
                    0.999,
                    1e-8,
                    0.01,
                    1 - 0.9**step,
                    1 - 0.999**step,
                    True,
                    False,
                )
            else:
                backend.ops.sgd_step(
                    mine,
                    grads,
                    states[0],
                    copies,
                    scalar(backend, 1 / 256),
                    None,
                    0.05,
                    0.01,
                    0.9,
                    0.1,
                    True,
                    False,
                    step == 1,
                )
            if state_dtype == torch.float32:  # the reference: the state rounded after each step
                for s in (s for lst in states for s in lst):
                    s.copy_(s.bfloat16())
        runs[state_dtype] = (mine, [s.float() for lst in states for s in lst], copies)
    for got, want in zip(runs[torch.bfloat16], runs[torch.float32]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("op", ["sgd", "adam"])
def test_steps_do_nothing_when_found_inf_is_set(backend, op):
    """An inf/NaN in the first, a middle or the last gradient, at its first or last element:
    the check pass raises the flag, and the fused step given that flag leaves the weights, the
    optimizer state and the 16-bit copies bit for bit as they were. A clear flag steps."""
    d = dev(backend)
    params = [randn(n, torch.float32, d, seed=120 + i) for i, n in enumerate(SIZES)]
    clean = [randn(n, torch.float16, d, seed=130 + i) for i, n in enumerate(SIZES)]
    state1 = [torch.full_like(p, 0.25) for p in params]
    state2 = [torch.full_like(p, 0.5) for p in params]
    copies = [p.half() for p in params]
    everything = [*params, *state1, *state2, *copies]
    before = [t.clone() for t in everything]

    def run(grads, flag):
        if op == "sgd":
            backend.ops.sgd_step(
                params,
                grads,
                state1,
                copies,
                scalar(backend, 1.0),
                flag,
                0.1,
                1e-4,
                0.9,
                0.0,
                False,
                False,
                False,
            )
        else:
            backend.ops.adam_step(
                params,
                grads,
                state1,
                state2,
                copies,
                scalar(backend, 1.0),
                flag,
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.0,
                0.1,
                0.001,
                False,
                False,
            )

    for t, e in poison_positions(clean):
        grads = [g.clone() for g in clean]
        grads[t][e] = float("nan") if e else float("inf")
        found = scalar(backend, 0.0)
        backend.ops.check_finite(grads, found)
        assert found.item() == 1.0, (t, e)
        run(grads, found)
        assert all(torch.equal(a, b) for a, b in zip(everything, before)), (t, e)
    run(clean, scalar(backend, 0.0))  # a clear flag: the step runs and changes params and state
    changed = [not torch.equal(a, b) for a, b in zip(everything, before)]
    n = len(SIZES)
    assert all(changed[:n]) and all(changed[n : 2 * n])


# ---- update_scale: the dynamic loss scale's update in one op ---------------------------------
@pytest.mark.parametrize(
    "knobs",
    [
        SCALE_BOUNDED,
        dict(init_scale=2.0**16, growth_interval=3, min_loss_scale=None, max_loss_scale=2.0**17),
    ],
)
def test_update_scale_is_the_scalers_tensor_ops_bit_for_bit(backend, knobs):
    """Growth, back-off, hysteresis, min and max scale, and `when`: the kernel leaves the float64
    state, the fp32 scale and its inverse exactly where the scaler's tensor ops leave them, from
    a device flag (any non-zero value, NaN included, is an overflow) or a host verdict."""
    from runner.precision.scaler import LossScaler

    device = dev(backend)
    fused, ops = LossScaler(**knobs).to(device), LossScaler(**knobs).to(device)
    fused.kernels = backend
    nan, seen = float("nan"), set()
    verdicts = [0, 0, 0, 0, 0, 0, 3.0, 0, 1, 1, nan, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]
    for i, found in enumerate(verdicts):
        on_host = i % 3 == 2
        verdict = bool(found) if on_host else torch.tensor([float(found)], device=device)
        when = None if i % 4 else torch.tensor(i % 8 == 0, device=device)
        fused.update(verdict, when=when)
        ops.update(verdict, when=when)
        assert torch.equal(fused._state, ops._state), (i, fused._state, ops._state)
        assert torch.equal(fused.scale_tensor, ops.scale_tensor)
        assert torch.equal(fused.inv_scale_tensor, ops.inv_scale_tensor)
        seen.add(fused.scale)
    assert fused.state_dict() == ops.state_dict()
    assert len(seen) >= 3  # (the pattern grew and backed off the scale)


def test_update_scale_refuses_what_it_cannot_read(backend):
    device = dev(backend)
    state = torch.tensor([4.0, 0.0, 1.0], dtype=torch.float64, device=device)
    s32, inv = torch.empty((), device=device), torch.empty(1, device=device)
    args = (2.0, 0.5, 2, False, 0.0, 2.0**24, 1)
    with pytest.raises(RuntimeError, match="state must be 3 contiguous float64"):
        backend.ops.update_scale(state.float(), s32, inv, None, False, None, *args)
    with pytest.raises(RuntimeError, match="found_inf must be a one-element float32"):
        backend.ops.update_scale(state, s32, inv, state, False, None, *args)
    with pytest.raises(RuntimeError, match="when must be a one-element bool"):
        backend.ops.update_scale(state, s32, inv, None, False, state[:1], *args)
    backend.ops.update_scale(state, s32, inv, None, True, None, *args)
    assert state.tolist() == [2.0, 0.0, 0.0] and s32.item() == 2.0 and inv.item() == 0.5


# ---- lists: many tensors, mixed dtypes, channels_last, empty ---------------------------------
def test_more_than_110_tensors_mixed_dtypes_in_one_call(backend):
    d = dev(backend)
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    sizes = [1 + (i * 7919) % 70000 for i in range(150)]  # 150 tensors, some over one chunk
    grads = [randn(n, dtypes[i % 3], d, seed=i, scale=4.0) for i, n in enumerate(sizes)]
    out = [torch.empty(n, device=d) for n in sizes]
    found = scalar(backend, 0.0)
    backend.ops.unscale_check(grads, out, scalar(backend, 0.25), found)
    assert found.item() == 0.0
    assert all(torch.equal(o, g.float() * 0.25) for g, o in zip(grads, out))
    total, per = backend.ops.l2norm(grads, scalar(backend, 1.0), None)
    want = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
    torch.testing.assert_close(per.double(), want, rtol=1e-5, atol=0)
    # the last tensor of a long list is stepped too
    params = [torch.zeros(n, device=d) for n in sizes]
    copies = [torch.empty(n, dtype=torch.float16, device=d) for n in sizes]
    backend.ops.sgd_step(
        params,
        grads,
        [],
        copies,
        scalar(backend, 1.0),
        None,
        1.0,
        0.0,
        0.0,
        0.0,
        False,
        False,
        True,
    )
    assert all(torch.equal(p, -g.float()) for p, g in zip(params, grads))
    assert all(torch.equal(c, p.half()) for c, p in zip(copies, params))


def test_channels_last_tensors(backend):
    d = dev(backend)
    shape = (8, 16, 5, 3)  # 4-D, as conv weights; channels_last strides differ from contiguous
    params = randn(8 * 16 * 5 * 3, torch.float32, d, seed=140).view(shape)
    params = params.contiguous(memory_format=torch.channels_last)
    grads = (
        randn(params.numel(), torch.float16, d, seed=141)
        .view(shape)
        .contiguous(memory_format=torch.channels_last)
    )
    m = torch.zeros_like(params)
    v = torch.zeros_like(params)
    copy = torch.empty_like(params, dtype=torch.float16)
    assert params.stride() != params.contiguous().stride()
    ref = params.detach().clone().requires_grad_(True)
    ref.grad = grads.float()
    torch.optim.Adam([ref], lr=1e-2).step()
    backend.ops.adam_step(
        [params],
        [grads],
        [m],
        [v],
        [copy],
        scalar(backend, 1.0),
        None,
        1e-2,
        0.9,
        0.999,
        1e-8,
        0.0,
        0.1,
        0.001,
        False,
        False,
    )
    torch.testing.assert_close(params, ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(copy, params.half()) and copy.is_contiguous(
        memory_format=torch.channels_last
    )


def test_empty_lists_and_empty_tensors_are_no_ops(backend):
    d = dev(backend)
    found = scalar(backend, 0.0)
    one = scalar(backend, 1.0)
    backend.ops.unscale_check([], [], one, found)
    backend.ops.check_finite([], found)
    backend.ops.copy_scale([], [], one)
    backend.ops.sgd_step([], [], [], [], one, None, 0.1, 0.0, 0.9, 0.0, False, False, True)
    backend.ops.adam_step(
        [], [], [], [], [], one, None, 0.1, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, False, False
    )
    e = torch.empty(0, device=d)
    backend.ops.unscale_check([e], [e.clone()], one, found)
    backend.ops.sgd_step([e], [e.half()], [], [], one, None, 0.1, 0.0, 0.0, 0.0, False, False, True)
    assert found.item() == 0.0


def test_bad_arguments_are_refused_with_the_reason(backend):
    d = dev(backend)
    one = scalar(backend, 1.0)
    a = torch.ones(4, device=d)
    with pytest.raises(RuntimeError, match="has 1 tensors"):
        backend.ops.copy_scale([a, a], [a], one)
    with pytest.raises(RuntimeError, match="elements"):
        backend.ops.copy_scale([a], [torch.ones(5, device=d)], one)
    with pytest.raises(RuntimeError, match="float32"):
        backend.ops.sgd_step(
            [a.half()], [a], [], [], one, None, 0.1, 0.0, 0.0, 0.0, False, False, True
        )
    with pytest.raises(RuntimeError, match="one-element float32"):
        backend.ops.copy_scale([a], [a], torch.ones(2, device=d))
    with pytest.raises(RuntimeError, match="layouts"):
        x = torch.ones(2, 3, 4, 5, device=d)
        backend.ops.copy_scale([x], [x.contiguous(memory_format=torch.channels_last)], one)
    with pytest.raises(RuntimeError, match="not dense"):
        backend.ops.copy_scale([torch.ones(8, device=d)[::2]], [a], one)
    with pytest.raises(RuntimeError, match="float16, bfloat16 or float32"):
        backend.ops.copy_scale([a.double()], [a], one)


# The checks' messages where libstdc++ is linked statically into the module, as the GPU image's
# toolchain (/opt/gcc) links it: formatting a number through an iostream compiled into the module
# segfaulted there (CUDA) and cut the message short at the first number here (found on an H200).
# The calls run in a child process, so a crash fails this test instead of the suite.
STATIC_PROBE = """
import sys, torch
from runner import csrc
from runner.csrc import loader
flags = loader.build_flags
def static_flags(backend):
    f = flags(backend)
    f["extra_ldflags"] = [*f["extra_ldflags"], "-static-libstdc++"]
    return f
loader.build_flags = static_flags
k = csrc.build("cpp")
a, one = torch.ones(4), torch.ones(1)
x = torch.ones(2, 3, 4, 5)
calls = [
    lambda: k.ops.copy_scale([a, a], [a], one),
    lambda: k.ops.copy_scale([a], [torch.ones(5)], one),
    lambda: k.ops.copy_scale([x], [x.contiguous(memory_format=torch.channels_last)], one),
    lambda: k.ops.copy_scale([a], [a], torch.ones(2)),
    lambda: k.ops.copy_scale([a.double()], [a], one),
    lambda: k.ops.stochastic_round([a], [a.bfloat16()], 0, 0, [1 << 33]),
]
for call in calls:
    try:
        call()
        print("no error")
    except RuntimeError as error:
        print(str(error).splitlines()[0])
"""


def _static_libstdcxx() -> bool:
    import subprocess

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return False
    found = subprocess.run(
        [compiler, "-print-file-name=libstdc++.a"], capture_output=True, text=True
    ).stdout.strip()
    return os.path.isabs(found) and os.path.isfile(found)


def probe(code: str, cache: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -c CODE` in a fresh process (no kernels loaded yet) with its kernel cache at
    `cache`."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "AMP_RUNNER_KERNEL_CACHE": str(cache)},
    )


@pytest.mark.slow
@pytest.mark.skipif(not _static_libstdcxx(), reason="no static libstdc++ (libstdc++.a) to link")
def test_messages_are_whole_with_a_statically_linked_libstdcxx(tmp_path):
    result = probe(STATIC_PROBE, tmp_path / "cache", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "copy_scale: dst has 1 tensors, src has 2",
        "copy_scale: dst[0] has 5 elements, src[0] has 4",
        "copy_scale: dst[0] and src[0] have different layouts (strides [60, 1, 15, 3] vs "
        "[60, 20, 5, 1])",
        "scale must be a one-element float32 tensor, got Float with 2 elements",
        "copy_scale: src[0] is Double; float16, bfloat16 or float32 expected",
        "stochastic_round: tensor_ids[0] = 8589934592 is outside [0, 2^32)",
    ], result.stdout


# ---- building ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(
    csrc.cuda_toolkit() is None,
    reason="no CUDA toolkit (set CUDA_HOME to the folder holding bin/nvcc)",
)
def test_cuda_sources_compile(monkeypatch):
    """Compiles the CUDA kernels (for TORCH_CUDA_ARCH_LIST, e.g. 9.0, without a GPU), so a CUDA
    compile error fails the suite on any machine with nvcc; the module loads and checks its
    arguments (it refuses CPU tensors). Into the cache runs use, as `python -m runner.csrc build`
    builds (docs/precision.md runs it): a suite compiles the CUDA sources once, not twice (a
    minute of CPU); the cache is keyed by the sources' content, so changed sources compile
    again."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    monkeypatch.setattr(loader, "_LOADED", {})
    kernels = csrc.build("cuda")
    assert kernels.name == "cuda" and kernels.ops.backend == "cuda"
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        kernels.ops.check_finite([torch.ones(3)], torch.zeros(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU gives the build its targets")
def test_a_cuda_build_without_a_gpu_or_an_arch_list_says_what_to_set(tmp_path, monkeypatch):
    """No GPU and no TORCH_CUDA_ARCH_LIST: torch's builder would fail with a bare IndexError;
    the build says which variable to set, before compiling anything."""
    if loader.cuda_toolkit() is None:
        pytest.skip("no CUDA toolkit here (CUDA_HOME)")
    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setenv("AMP_RUNNER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(csrc.KernelBuildError, match="set TORCH_CUDA_ARCH_LIST .* e.g. 9.0"):
        csrc.build("cuda")
    assert not list((tmp_path / "cache").rglob("*.o"))


def test_a_failed_build_falls_back_to_torch_with_the_reason(tmp_path, monkeypatch, caplog):
    """A real failed build (the C++ compiler does not exist): `auto` warns once and returns None
    (the engine runs on torch's ops), `fused` raises with the reason."""
    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setattr(loader, "_FAILED", {})
    monkeypatch.setenv("AMP_RUNNER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(csrc.KernelBuildError, match="no-such-compiler|Error building"):
        csrc.load("cpu", "fused")
    with caplog.at_level("WARNING", logger="runner.csrc"):
        assert csrc.load("cpu", "auto") is None
        assert csrc.load("cpu", "auto") is None  # remembered: one warning, no second build
    warnings = [
        r for r in caplog.records if r.name == "runner.csrc.loader" and r.levelname == "WARNING"
    ]
    assert len(warnings) == 1
    assert "could not be built" in warnings[0].getMessage()
    assert "python -m runner.csrc build" in warnings[0].getMessage()
    assert csrc.load("cpu", "torch") is None
    assert csrc.name_of(None) == "torch"
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_a_cache_that_cannot_be_made_says_so_and_what_to_set(tmp_path, monkeypatch, caplog):
    """A cache path that cannot be made (a read-only home on a cluster's nodes; here a file in
    the way) ended the run with an "unexpected error" and a traceback, at any kernels choice
    (exit 1). Now `auto` warns once, with the variable to set, and steps with torch's ops;
    `fused` is refused in a message (a RunnerError: exit 2) that names both ways out."""
    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setattr(loader, "_FAILED", {})
    (tmp_path / "file").write_text("a file where the cache should be")
    monkeypatch.setenv("AMP_RUNNER_KERNEL_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(RunnerError) as refused:
        csrc.load("cpu", "fused")
    said = str(refused.value)
    assert said.startswith("precision.kernels=fused: amp-runner's fused cpp kernels could not")
    assert f"the kernel cache {tmp_path / 'file' / 'cache'}/" in said
    assert "cannot be made (Not a directory)" in said
    assert "To fix: set AMP_RUNNER_KERNEL_CACHE to a folder you can write" in said
    assert "or precision.kernels=auto" in said and "install a C++ compiler" not in said
    with caplog.at_level("WARNING", logger="runner.csrc"):
        assert csrc.load("cpu", "auto", wait=False) is None  # (a single run's first look)
        assert csrc.load("cpu", "auto") is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "runner.csrc.loader"]
    assert "uses torch's own ops" in warning and "set AMP_RUNNER_KERNEL_CACHE" in warning


LOAD_PROBE = """
from runner import csrc
print(csrc.load("cpu", "fused").name, csrc.load("cpu", "auto", wait=False).name)
"""


@pytest.mark.slow
def test_a_complete_build_loads_from_a_cache_it_cannot_lock(tmp_path):
    """A shared cache this user cannot write (its lock file cannot be opened: here a folder in
    its place) failed every run ("unexpected error") although its build was complete; the
    build loads without the lock (its mark is written last, atomically), in a fresh process."""
    built = Path(csrc.build("cpp").ops.__file__).parent
    copy = tmp_path / "cache" / built.parent.parent.name / built.parent.name / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(".lock", "build.log"))
    (copy / ".lock").mkdir()  # (no lock can be opened there, even by root)
    result = probe(LOAD_PROBE, tmp_path / "cache", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["cpp", "cpp"]
    assert not (copy / "build.log").exists()  # (nothing built, nothing started)


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="precision.kernels"):
        csrc.load("cpu", "fast")
