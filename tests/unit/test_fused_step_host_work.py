"""The host work of the fused O2 step, counted: the torch ops one `engine.step` dispatches and the
kernel calls it makes, on the real engine with the C++ kernels (a CPU proxy of the CUDA step,
where every op is a launch that costs the host microseconds). The count is the same for 10 and
for 100 parameters (nothing per tensor: the step counters advance in one op, the loss scale
updates in one kernel call) and stays within a few ops a step."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.precision import AmpEngine, resolve
from tests.helpers.precision import KernelSpy, fresh_amp  # noqa: F401  (fresh_amp: autouse)

CPU = torch.device("cpu")
# (optimizer, wait) -> the most torch ops one step may dispatch (views included) and the most
# kernel calls: the check, the update, the loss scale's update
MOST = {
    ("adamw", True): (4, 3),  # flag, the verdict's read, the counters' add
    ("adamw", False): (9, 3),  # flag, the counters' add of (flag == 0), the skip count, ~skipped
    ("sgd", True): (3, 3),
    ("sgd", False): (7, 3),
}


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _one_step(layers: int, optimizer: str, wait: bool) -> tuple[collections.Counter, dict]:
    """The ops and kernel calls of one O2 step (dynamic scale) after two steps that prepared it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    engine = AmpEngine(resolve("O2", {}, device=CPU).properties, CPU, kernels="fused")
    spy = KernelSpy(engine)  # (before prepare: every path and scaler calls through it)
    engine.prepare(model, opt)
    x = torch.randn(2, 4)
    for i in range(3):
        with engine.autocast():
            loss = model(x).float().mean()
        engine.backward(loss)
        if i < 2:
            assert bool(engine.step(opt, wait=wait))
            engine.zero_grad(opt)
    spy.reset()
    with CountOps() as counted:
        assert bool(engine.step(opt, wait=wait))
    counters = [s["step"].item() for s in opt.state.values() if "step" in s]
    assert counters in ([], [3.0] * len(opt.state))
    return counted.ops, dict(spy.calls)


@pytest.mark.parametrize("wait", [False, True], ids=["on-device", "host-verdict"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_fused_steps_ops_are_few_and_do_not_grow_with_the_params(optimizer, wait):
    ops, calls = _one_step(5, optimizer, wait)
    more_ops, more_calls = _one_step(50, optimizer, wait)
    assert (ops, calls) == (more_ops, more_calls)
    most_ops, most_calls = MOST[(optimizer, wait)]
    assert sum(ops.values()) <= most_ops, ops
    update = "adam_step" if optimizer == "adamw" else "sgd_step"
    assert calls == {"check_finite": 1, update: 1, "update_scale": 1}
    assert sum(calls.values()) <= most_calls


# ---- the same training as torch's ops -----------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# dynamic scaling with every knob in play: hysteresis 2, growth every 2 clean steps, both bounds
SCALING = dict(
    init_scale=2.0**10,
    growth_interval=2,
    hysteresis=2,
    min_loss_scale=2.0**9,
    max_loss_scale=2.0**11,
)
# step -> the gradient that gets an inf: grown to the max and held there (steps 1, 3), a tolerated
# overflow, back-offs down to the min and held there (7), growth that refills the counter
INF_AT = {4: 0, 5: -1, 6: 3, 7: 0, 10: -1}


def _train(device: str, kernels: str, optimizer: str) -> list[tuple]:
    """Eleven O2 steps (`wait=False`), overflows at INF_AT: after each, the scaler's state, the
    skip count, Adam's counters and the masters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    )
    engine = AmpEngine(resolve("O2", SCALING).properties, device, kernels=kernels)
    engine.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    seen = []
    for step in range(11):
        x, y = torch.randn(12, 6, generator=g).to(device), torch.randint(0, 3, (12,), generator=g)
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y.to(device))
        engine.backward(loss)
        if step in INF_AT:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grads[INF_AT[step]].view(-1)[0] = float("inf")
        stepped = engine.step(opt, wait=False)
        assert bool(stepped) == (step not in INF_AT)
        engine.zero_grad(opt)
        seen.append(
            (
                engine.scalers[0].state_dict(),
                engine.skipped_steps,
                [float(s["step"]) for s in opt.state.values() if "step" in s],
                [m.detach().cpu().clone() for m in engine.master_params(opt)],
            )
        )
    return seen


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_step_trains_as_torchs_ops(device, optimizer):
    """The kernels' step (flat step counters, the scale's update in one kernel call) against
    torch's ops (the optimizer's own fp32 step, the scaler's tensor ops), step by step: the same
    skips, scale, hysteresis counter and counters exactly, the fp32 masters to fp32 rounding."""
    fused, reference = _train(device, "fused", optimizer), _train(device, "torch", optimizer)
    scales = {state["loss_scale"] for state, *_ in reference}
    assert min(scales) == 2.0**9 and max(scales) == 2.0**11  # (both bounds were reached)
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert a[:3] == b[:3], i
        for m, r in zip(a[3], b[3]):
            torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
