"""The fused steps with the learning rate on the device (`lr_tensor`, a 0-dim float64 tensor
read when the step runs, as a step captured in a CUDA graph reads it): the same bits as the rate
given as a number, for every SGD and Adam case and a rate that changes between steps in place;
`runner.precision.rates` keeps a group's tensor at its number and the kernels read it."""

from __future__ import annotations

import pytest
import torch

from runner import csrc
from runner.precision import fused, rates
from tests.helpers.kernel_cases import ADAM_CASES, SGD_CASES

RATES = [0.1, 0.0731, 1e-3, 3.3e-4]  # a schedule's numbers, most not exact in fp32
SIZES = [1, 7, 65537]


@pytest.fixture(params=["cpp", pytest.param("cuda", marks=pytest.mark.gpu)], scope="module")
def backend(request):
    return csrc.build(request.param)


def _tensors(device, seed, dtype=torch.float32, scale=1.0):
    out = []
    for i, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(seed + i)
        out.append((torch.randn(n, generator=g) * scale).to(dtype).to(device))
    return out


def _run(backend, op: str, case: dict, live: bool) -> list[torch.Tensor]:
    """Four steps of `op` at RATES; with `live`, the rate read from one tensor set in place
    between steps (and a wrong number given beside it, which must not be read)."""
    device = torch.device(backend.device_type)
    params = _tensors(device, 100)
    grads = _tensors(device, 110, torch.float16, 256.0)
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    copies = [torch.empty(p.shape, dtype=torch.float16, device=device) for p in params]
    scale = torch.full((1,), 1.0 / 256.0, device=device)
    rate = torch.zeros((), dtype=torch.float64, device=device)
    steps = torch.zeros(len(params), device=device)
    for lr in RATES:
        rate.fill_(lr)
        steps.add_(1)
        number, given = (123.0, {"lr_tensor": rate}) if live else (lr, {})
        if op == "sgd":
            backend.ops.sgd_step(
                params, grads, state[0], copies, scale, None, number,
                case["weight_decay"], case["momentum"], case["dampening"], case["nesterov"],
                case["maximize"], False, **given,
            )  # fmt: skip
        else:
            kind, hyper = case
            backend.ops.adam_step(
                params, grads, state[0], state[1], copies, scale, None, number, 0.9, 0.999,
                1e-8, hyper["weight_decay"], 1.0, 1.0, kind == "adamw", hyper["maximize"],
                steps=steps, **given,
            )  # fmt: skip
    return [*params, *state[0], *state[1], *copies]


@pytest.mark.parametrize(
    "op,case", [("sgd", c) for c in SGD_CASES] + [("adam", c) for c in ADAM_CASES], ids=str
)
def test_a_rate_on_the_device_steps_as_the_same_number(backend, op, case):
    by_number, by_tensor = _run(backend, op, case, False), _run(backend, op, case, True)
    for a, b in zip(by_number, by_tensor):
        assert torch.equal(a, b)


def test_a_rate_tensor_is_refused_unless_one_float64_number_beside_the_counters(backend):
    device = torch.device(backend.device_type)
    p, g = [torch.zeros(4, device=device)], [torch.zeros(4, device=device)]
    m, v = [torch.zeros(4, device=device)], [torch.zeros(4, device=device)]
    one = torch.ones(1, device=device)
    wrong = torch.ones((), device=device)  # float32
    with pytest.raises(RuntimeError, match="lr_tensor must be a one-element float64 tensor"):
        backend.ops.sgd_step(p, g, m, [], one, None, 0.1, 0.0, 0.9, 0.0, False, False, False,
                             lr_tensor=wrong)  # fmt: skip
    rate = torch.full((), 0.1, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="read with the step counters"):
        backend.ops.adam_step(p, g, m, v, [], one, None, 0.1, 0.9, 0.999, 1e-8, 0.0, 1.0, 1.0,
                              False, False, lr_tensor=rate)  # fmt: skip


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_live_rates_follow_the_schedule_through_the_fused_step(backend, name):
    """The fused step of an optimizer whose rates are live, under a cosine schedule, ends with the
    bits of the same steps with the rates as numbers; the group's `lr` stays a number and its
    tensor holds it after each step."""

    def train(live: bool):
        device = torch.device(backend.device_type)
        params = [p.requires_grad_() for p in _tensors(device, 200)]
        make = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
        extra = {"momentum": 0.9} if name == "sgd" else {}
        optimizer = make(params, lr=0.05, weight_decay=1e-2, **extra)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)
        kept = rates.live_rates(optimizer) if live else None
        for step in range(4):
            grads = _tensors(device, 300 + step)
            gp = fused.GroupPlan(optimizer.param_groups[0], params, grads, params)
            scale = torch.ones(1, device=device)
            with torch.no_grad():
                fused.apply(backend, optimizer, [gp], scale)
            schedule.step()
            if kept is not None:
                kept.refresh()
                group = optimizer.param_groups[0]
                assert isinstance(group["lr"], float) and kept.covers()
                assert float(kept.rate(group, params[0].device)) == group["lr"]
        return [p.detach() for p in params]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)
