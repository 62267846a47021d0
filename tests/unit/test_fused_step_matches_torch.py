"""The fused O2 step (the kernels, Adam's step counters in one tensor per group, the loss
scale's update in one kernel call) trains as torch's ops do: the same skips, scale and counters
exactly, the fp32 masters to fp32 rounding, through overflows, hysteresis and both scale bounds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.precision import AmpEngine, resolve
from tests.helpers.precision import fresh_amp  # noqa: F401  (autouse: no amp state leaks)

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
                engine.scaler.state_dict(),
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
    skips, scale, hysteresis counter and counters exactly, the fp32 masters to fp32 rounding (with
    room for a model weight whose fp16 copy rounds the other way at a tie)."""
    fused, reference = _train(device, "fused", optimizer), _train(device, "torch", optimizer)
    scales = {state["loss_scale"] for state, *_ in reference}
    assert min(scales) == 2.0**9 and max(scales) == 2.0**11  # (both bounds were reached)
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert a[:3] == b[:3], i
        for m, r in zip(a[3], b[3]):
            torch.testing.assert_close(m, r, rtol=1e-4, atol=1e-5)
