"""The Apex facade's engine (`runner.precision.apex_engine.ApexEngine`): several losses with their
own scales, one backward over several optimizers with one overflow decision, `settle`, its stages
and state dict. On CPU with real tensors; every model is tiny. (What the facade's calls make of
it: test_amp_facade.py, test_apex_amp_semantics.py.)

Tolerances: scaling by a power of two and unscaling is exact in fp32 (no overflow/underflow at
these magnitudes), so fp32-model paths are compared bit for bit; fp16 paths are compared with
fp16's resolution (rtol 2e-2 on values of order 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runner.precision.apex_engine import ApexEngine
from runner.precision.stepper import Stage
from tests.helpers.precision import batch, ce, fresh_amp, net, props, two_optimizers  # noqa: F401 (autouse)

CPU = torch.device("cpu")


def prepared(p, **engine_kw):
    """A fresh `net()` with plain SGD, set up by an `ApexEngine` for properties `p`."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ApexEngine(p, CPU, **engine_kw)
    engine.cast(model)
    engine.add_optimizer(opt, [model])
    return model, opt, engine


def two_losses(model, x, y):
    """Two losses over two forwards (separate graphs, so each can run its own backward)."""
    return (nn.functional.cross_entropy(model(x).float(), y), model(x).float().square().mean())


def _fp32_grads(model, losses_fn, x, y):
    ref = copy.deepcopy(model)
    for loss in losses_fn(ref, x, y):
        loss.backward()
    return [p.grad.clone() for p in ref.parameters()]


# ---- several losses, each with its own scale -----------------------------------------------
def test_two_losses_with_different_scales_sum_exactly_like_fp32():
    model, opt, engine = prepared(props("O0", loss_scale="dynamic"), num_losses=2)
    x, y = batch()
    want = _fp32_grads(model, two_losses, x, y)
    engine.scalers[0].load_state_dict({"loss_scale": 2.0**10})
    engine.scalers[1].load_state_dict({"loss_scale": 2.0**3})
    la, lb = two_losses(model, x, y)
    engine.scale_loss(la, 0).backward()
    engine.scale_loss(lb, 1).backward()
    assert engine.settle(opt) is False
    for p, g in zip(model.parameters(), want):
        assert torch.equal(p.grad, g)  # power-of-two scales: exact
    assert engine.step(opt)
    assert engine.scalers[0].scale == 2.0**10 and engine.scalers[1].scale == 2.0**3
    assert [s.state_dict()["unskipped"] for s in engine.scalers] == [1, 1]


@pytest.mark.parametrize("poisoned", [0, 1])
def test_only_the_overflowing_loss_backs_off(poisoned):
    model, opt, engine = prepared(props("O0", loss_scale="dynamic"), num_losses=2)
    x, y = batch()
    engine.scalers[0].load_state_dict({"loss_scale": 2.0**10})
    engine.scalers[1].load_state_dict({"loss_scale": 2.0**3})
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    la, lb = two_losses(model, x, y)
    for loss_id, loss in enumerate((la, lb)):
        engine.scale_loss(loss, loss_id).backward()
        if loss_id == poisoned:
            model[0].weight.grad.view(-1)[3] = float("inf")
    assert not engine.step(opt)
    scales = [s.scale for s in engine.scalers]
    expected = [2.0**10, 2.0**3]
    expected[poisoned] /= 2
    assert scales == expected and engine.skipped_steps == 1
    for k, v in model.named_parameters():
        assert torch.equal(v, before[k]), k
    engine.zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())
    la, lb = two_losses(model, x, y)
    engine.scale_loss(la, 0).backward()
    engine.scale_loss(lb, 1).backward()
    assert engine.step(opt)


def test_two_losses_o2_fp16_masters_match_fp32_reference():
    model, opt, engine = prepared(props("O2"), num_losses=2)
    x, y = batch()
    engine.scalers[1].load_state_dict({"loss_scale": 2.0**5})
    ref = net()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters()):
            r.copy_(p.float())
    want = _fp32_grads(ref, two_losses, x, y)
    la, lb = two_losses(model, x, y)
    engine.scale_loss(la, 0).backward()
    engine.scale_loss(lb, 1).backward()
    assert engine.settle(opt) is False
    got = [p.grad for p in engine.master_params(opt)]
    assert all(g.dtype == torch.float32 for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)  # fp16 forward/backward
    assert engine.step(opt)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_stages_through_a_round_with_two_losses_and_accumulation(kernels):
    model, opt, engine = prepared(props("O2"), kernels=kernels, num_losses=2)
    engine.scalers[1].load_state_dict({"loss_scale": 2.0**4})
    assert engine.stage(opt) is Stage.READY
    for seed in (1, 2):  # gradient accumulation of loss 0
        engine.scale_loss(ce(model, *batch(seed)), 0).backward()
        assert engine.stage(opt) is Stage.ACCUMULATING
    engine.scale_loss(model(batch(3)[0]).float().square().mean(), 1).backward()
    assert engine.stage(opt) is Stage.ACCUMULATING
    assert engine.settle(opt) is False and engine.stage(opt) is Stage.UNSCALED
    assert engine.step(opt)
    assert engine.stage(opt) is Stage.STEPPED
    assert [s.state_dict()["unskipped"] for s in engine.scalers] == [1, 1]
    engine.zero_grad(opt)
    assert engine.stage(opt) is Stage.READY


def test_num_losses_gives_one_scaler_per_loss():
    engine = ApexEngine(props("O1"), CPU, num_losses=3)
    assert len(engine.scalers) == 3 and len({id(s) for s in engine.scalers}) == 3
    with pytest.raises(ValueError, match="loss_id 3 out of range for num_losses=3"):
        engine.scale_loss(torch.ones((), requires_grad=True), 3)
    with pytest.raises(ValueError, match="num_losses must be >= 1"):
        ApexEngine(props("O1"), CPU, num_losses=0)


def test_state_dict_round_trip_with_two_losses():
    model, opt, engine = prepared(props("O2", cast_model_type="bfloat16"), num_losses=2)
    x, y = batch()
    for poison in (True, False):
        engine.scale_loss(ce(model, x, y), 0).backward()
        if poison:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        engine.step(opt)
        engine.zero_grad(opt)
    sd = engine.state_dict()
    assert sd["skipped_steps"] == 1 and sd["loss_scaler0"]["loss_scale"] == 2.0**15
    assert sd["loss_scaler0"]["unskipped"] == 1 and sd["loss_scaler1"]["unskipped"] == 0
    fresh = ApexEngine(props("O2", cast_model_type="bfloat16"), CPU, num_losses=2)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state_dict() == sd


# ---- one backward over several optimizers: one decision ----------------------------------
def test_one_loss_over_two_optimizers_updates_its_scaler_once_per_round():
    engine, a, b, oa, ob = two_optimizers()
    engine.scalers[0].load_state_dict({"loss_scale": 64.0})
    x = torch.randn(3, 4)
    engine.scale_loss(b(a(x)).square().mean()).backward()
    assert engine.step(oa) and engine.step(ob)
    assert engine.scalers[0].state_dict()["unskipped"] == 1 and engine.scalers[0].scale == 64.0
    engine.zero_grad(oa), engine.zero_grad(ob)
    engine.scale_loss(b(a(x)).square().mean()).backward()
    b.weight.grad.view(-1)[0] = float("inf")
    a_before = a.weight.detach().clone()
    # one decision for the loss (as Apex's scale_loss over [oa, ob]): a's gradients are finite,
    # but the loss overflowed in b's, so a skips as well; the scale backs off once
    assert not engine.step(oa)
    assert not engine.step(ob)
    assert torch.equal(a.weight, a_before)
    assert engine.scalers[0].scale == 32.0 and engine.skipped_steps == 2
    # the next round is a fresh decision: both step
    engine.zero_grad(oa), engine.zero_grad(ob)
    engine.scale_loss(b(a(x)).square().mean()).backward()
    assert engine.step(ob) and engine.step(oa)


def test_two_losses_each_over_its_own_optimizer_skip_on_their_own():
    """Apex's rule is per scale_loss call, not per loss id: two backward calls with the same
    loss id but different optimizers decide apart (test_2models2losses2optimizers)."""
    engine, a, b, oa, ob = two_optimizers()
    x = torch.randn(3, 4)
    engine.scale_loss(a(x).square().mean(), 0, [oa]).backward()
    a.weight.grad.view(-1)[0] = float("inf")
    assert engine.settle_all([oa]) is True
    engine.scale_loss(b(x).square().mean(), 0, [ob]).backward()
    b_before = b.weight.detach().clone()
    assert engine.settle_all([ob]) is False
    assert not engine.step(oa) and engine.step(ob)
    assert not torch.equal(b.weight, b_before)


# ---- settle (the end of Apex's scale_loss) -------------------------------------------------
def test_settle_then_step_as_the_facade_does():
    model, opt, engine = prepared(props("O2"), kernels="torch")
    x, y = batch()
    engine.scale_loss(ce(model, x, y), 0, [opt]).backward()
    assert engine.settle(opt) is False
    assert engine.stage(opt) is Stage.UNSCALED
    assert engine.settle(opt) is False  # settled again: the same verdict, no second update
    assert engine.scalers[0].state_dict()["unskipped"] == 1
    assert engine.step(opt)
    assert engine.scalers[0].state_dict()["unskipped"] == 1  # updated once per round


def test_settle_and_step_after_the_step_are_refused():
    model, opt, engine = prepared(props("O2"))
    x, y = batch()
    engine.scale_loss(ce(model, x, y)).backward()
    assert engine.step(opt)
    with pytest.raises(RuntimeError, match=r"stage: 'stepped'") as e:
        engine.settle(opt)
    assert str(e.value).startswith("settle() called after step()")
    with pytest.raises(RuntimeError) as e:
        engine.step(opt)
    assert str(e.value).startswith(
        "step() called twice without a backward in between (this optimizer's stage: 'stepped')"
    )
    assert engine.stage(opt) is Stage.STEPPED


def test_an_optimizer_not_set_up_is_named():
    model, opt, engine = prepared(props("O2"))
    other = torch.optim.SGD(net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="not passed to amp.initialize"):
        engine.step(other)
