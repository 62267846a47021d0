"""The engine's per-optimizer stages (`runner.precision.engine.Stage`): misuse is refused with a
clear error, the sequences real training loops use still work, the execution path falls back to
torch's ops inside itself, and the runner's O1 is plain autocast (no function patches). On CPU
with real tensors; every model is tiny.

Tolerances: O0 with a static scale of 1 steps with the optimizer's own `step` on the very
gradients plain torch computes, so it is compared bit for bit; so is the fused path's one-step
fallback against the torch path (the same copy, unscale, step and rounding).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runner.precision import AmpEngine, amp
from runner.precision import autocast as ac
from runner.precision.apex_engine import ApexEngine
from runner.precision.engine import Stage
from tests.helpers.precision import OpRecorder, batch, ce, fresh_amp, net, props  # noqa: F401 (autouse)

CPU = torch.device("cpu")


def prepared(level="O2", kernels="auto"):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(props(level), CPU, kernels=kernels)
    engine.prepare(model, opt)
    return model, opt, engine


# ---- misuse ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_step_twice_without_a_backward_is_refused_and_changes_nothing(kernels):
    model, opt, engine = prepared(kernels=kernels)
    x, y = batch()
    engine.backward(ce(model, x, y))
    assert engine.step(opt)
    after = {k: v.detach().clone() for k, v in model.named_parameters()}
    masters = [m.detach().clone() for m in engine.master_params(opt)]
    with pytest.raises(RuntimeError) as e:
        engine.step(opt)
    assert str(e.value).startswith(
        "step() called twice without a backward in between (this optimizer's stage: 'stepped')"
    )
    assert "zero_grad" in str(e.value)
    for k, v in model.named_parameters():  # the refused step touched nothing
        assert torch.equal(v, after[k]), k
    assert all(torch.equal(m, b) for m, b in zip(engine.master_params(opt), masters))
    assert engine.scaler.state_dict()["unskipped"] == 1 and engine.skipped_steps == 0
    engine.zero_grad(opt)
    engine.backward(ce(model, x, y))
    assert engine.step(opt)  # the next round goes through


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda engine, opt: engine.clip_grad_norm_(1.0, opt),
            "clip_grad_norm_() called after step()",
        ),
        (lambda engine, opt: engine.unscale_(opt), "unscale_() called after step()"),
    ],
)
def test_gradient_work_after_the_step_is_refused(call, message):
    model, opt, engine = prepared()
    x, y = batch()
    engine.backward(ce(model, x, y))
    engine.step(opt)
    with pytest.raises(RuntimeError, match=r"stage: 'stepped'") as e:
        call(engine, opt)
    assert str(e.value).startswith(message)
    assert engine.stage(opt) is Stage.STEPPED


def test_backward_after_clip_is_refused_until_the_step():
    model, opt, engine = prepared()
    x, y = batch()
    engine.backward(ce(model, x, y))
    engine.clip_grad_norm_(1.0, opt)
    assert engine.stage(opt) is Stage.CLIPPED
    with pytest.raises(RuntimeError) as e:
        engine.backward(ce(model, x, y))
    assert str(e.value) == (
        "backward after clip_grad_norm_ and before step: the clipped gradients would be mixed "
        "with new ones (this optimizer's stage: 'clipped'). Call step() (or zero_grad()) first."
    )
    assert engine.step(opt)
    engine.backward(ce(model, x, y))  # after the step a new round may start
    assert engine.stage(opt) is Stage.ACCUMULATING


def test_a_second_optimizer_is_refused_with_what_to_use():
    """The trainer's engine steps one optimizer; several (each with its losses) are the Apex
    facade's engine's (test_apex_engine.py)."""
    model, opt, engine = prepared()
    other = torch.optim.SGD(net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="AmpEngine steps one optimizer, and a SGD was prepared"):
        engine.add_optimizer(other)
    with pytest.raises(RuntimeError, match="this optimizer was not passed to AmpEngine.prepare"):
        engine.step(other)
    engine.add_optimizer(opt, [net()])  # the same optimizer again, with one more model: fine


def test_optimizer_step_twice_through_the_apex_facade_is_refused():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch()
    with amp.scale_loss(ce(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"step\(\) called twice without a backward"):
        opt.step()


# ---- what training loops legitimately do -----------------------------------------------------
def test_unscale_twice_is_a_no_op():
    model, opt, engine = prepared()
    x, y = batch()
    engine.backward(ce(model, x, y))
    engine.unscale_(opt)
    grads = [p.grad.clone() for p in engine.master_params(opt)]
    with OpRecorder() as rec:
        engine.unscale_(opt)
    assert rec.ops == []
    assert all(torch.equal(p.grad, g) for p, g in zip(engine.master_params(opt), grads))
    assert engine.stage(opt) is Stage.UNSCALED


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_stages_through_a_round_with_accumulation_unscale_and_clipping(kernels):
    """The trainer's round with 16-bit gradients accumulated over three batches (unscaled into
    the fp32 stash between them), then clipped."""
    model, opt, engine = prepared(kernels=kernels)
    assert engine.stage(opt) is Stage.READY
    for seed in (1, 2, 3):
        engine.backward(ce(model, *batch(seed)))
        assert engine.stage(opt) is Stage.ACCUMULATING
        if seed < 3:
            engine.unscale_(opt)
            assert engine.stage(opt) is Stage.UNSCALED
    norm = engine.clip_grad_norm_(0.5, opt)
    assert torch.isfinite(norm) and engine.stage(opt) is Stage.CLIPPED
    engine.clip_grad_norm_(0.5, opt)  # clipping again is allowed
    engine.unscale_(opt)  # and unscale_ after the clip is a no-op on the clipped values
    assert engine.stage(opt) is Stage.CLIPPED
    assert engine.step(opt)
    assert engine.stage(opt) is Stage.STEPPED
    assert engine.scaler.state_dict()["unskipped"] == 1
    engine.zero_grad(opt)
    assert engine.stage(opt) is Stage.READY


def test_backward_again_after_a_step_without_zero_grad_accumulates_as_plain_torch():
    """O0 (static scale 1, the optimizer's own step): a loop that never zeroes its gradients
    gets exactly what the same loop gets in plain torch."""
    model, opt, engine = prepared("O0")
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for seed in (1, 2, 3):
        x, y = batch(seed)
        ce(ref, x, y).backward()
        ref_opt.step()
        engine.backward(ce(model, x, y))
        assert engine.step(opt)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_step_with_no_gradients_is_allowed_and_changes_nothing():
    """As in plain torch: a step after zero_grad (no backward) finds no gradients to apply."""
    model, opt, engine = prepared()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert engine.step(opt)
    for k, v in model.named_parameters():
        assert torch.equal(v, before[k]), k
    assert engine.scaler.state_dict()["unskipped"] == 0  # no loss, no scaler update


def test_zero_grad_abandons_a_clipped_round():
    model, opt, engine = prepared()
    x, y = batch()
    engine.backward(ce(model, x, y))
    engine.clip_grad_norm_(1e-3, opt)
    engine.zero_grad(opt)
    assert engine.stage(opt) is Stage.READY
    engine.backward(ce(model, x, y))
    masters = engine.masters(opt)
    unscaled = {
        id(m): p.grad.float() / engine.loss_scale
        for p, m in zip(masters.model_params, masters.masters)
    }
    before = {id(p): p.detach().clone() for p in engine.master_params(opt)}
    assert engine.step(opt)
    for m in masters.masters:  # the abandoned clip's coefficient is gone: a plain SGD step
        torch.testing.assert_close(m, before[id(m)] - 0.1 * unscaled[id(m)], rtol=1e-6, atol=1e-7)


# ---- execution paths -------------------------------------------------------------------------
def test_fused_path_falls_back_to_torch_for_an_optimizer_the_kernels_lack():
    """amsgrad Adam under O2: the kernel path plans no fused update and steps with the
    optimizer's own step, bit for bit what the torch path does."""
    results = []
    for kernels in ("torch", "auto"):
        model = net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
        engine = AmpEngine(props("O2"), CPU, kernels=kernels)
        engine.prepare(model, opt)
        for seed in (1, 2):
            engine.backward(ce(model, *batch(seed)))
            assert engine.step(opt)
            engine.zero_grad(opt)
        results.append(
            (
                [m.detach().clone() for m in engine.master_params(opt)],
                copy.deepcopy(opt.state_dict()["state"]),
            )
        )
    (torch_masters, torch_state), (fused_masters, fused_state) = results
    assert all(torch.equal(a, b) for a, b in zip(torch_masters, fused_masters))
    for i, state in torch_state.items():
        for k, v in state.items():
            assert torch.equal(fused_state[i][k], v), (i, k)


# ---- O1: plain autocast in the runner, Apex's patches only in the facade ---------------------
def test_the_runners_o1_is_plain_autocast_without_function_patches():
    ac.register_float_function(torch, "matmul")
    original = torch.matmul
    engine = AmpEngine(props("O1"), CPU)  # as the runner makes it
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    p, t = torch.rand(4), torch.rand(4)
    with engine.autocast():
        assert torch.matmul is original and not ac.in_patched_region()
        assert torch.matmul(a, b).dtype == torch.float16  # autocast as usual, not fp32
        bce = nn.functional.binary_cross_entropy(p.half(), t.half())  # not banned
    # autocast's own policy for this op: fp32, on the inputs as rounded to fp16
    assert torch.equal(bce, nn.functional.binary_cross_entropy(p.half().float(), t.half().float()))
    with ApexEngine(props("O1"), CPU).autocast():  # the facade's engine
        assert torch.matmul is not original and torch.matmul(a, b).dtype == torch.float32
        with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
            nn.functional.binary_cross_entropy(p.half(), t.half())
    assert torch.matmul is original
