"""AmpEngine semantics beyond one backward per step, on CPU with real tensors: gradient
accumulation (scaled, or unscaled into the fp32 stash), fp32 state dicts of a half model,
add_param_group after prepare, zero_grad, one optimizer over two models, and the O1 function
registration API of the Apex facade's engine (with the binary_cross_entropy ban). Several losses
and optimizers: test_apex_engine.py.

Tolerances: scaling by a power of two and unscaling is exact in fp32 (no overflow/underflow at
these magnitudes), so fp32-model paths are compared bit for bit; fp16 paths are compared with
fp16's resolution (rtol 1e-2 on values of order 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runner.precision import AmpEngine
from runner.precision import autocast as ac
from runner.precision.apex_engine import ApexEngine
from tests.helpers.precision import KernelSpy, OpRecorder, batch, net, props

CPU = torch.device("cpu")


def _fp32_grads(model, losses_fn, x, y):
    ref = copy.deepcopy(model)
    for loss in losses_fn(ref, x, y):
        loss.backward()
    return [p.grad.clone() for p in ref.parameters()]


@pytest.fixture(autouse=True)
def _clean_registry():
    ac.clear_registrations()
    yield
    ac.clear_registrations()


# ---- a backward after unscale_ --------------------------------------------------------------
def test_backward_after_unscale_accumulates_in_fp32():
    """The trainer's accumulation of 16-bit gradients (`unscale_` between its batches; Apex's
    scale_loss twice before one step): the second backward stashes the unscaled gradients
    first, and they add up in fp32."""
    model = net()
    x, y = batch()
    want = _fp32_grads(model, lambda m, x, y: [nn.functional.cross_entropy(m(x), y)], x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(props("O0", loss_scale="dynamic"), CPU)
    engine.prepare(model, opt)
    for _ in range(2):
        engine.backward(nn.functional.cross_entropy(model(x), y))
        engine.unscale_(opt)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-6, atol=1e-7)


# ---- gradient accumulation -----------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_gradient_accumulation_unscales_once(level, kernels):
    model = net()
    xs = [batch(seed) for seed in (1, 2, 3)]
    ref = copy.deepcopy(model)
    p = props(level, loss_scale="dynamic") if level == "O0" else props(level)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(p, CPU, kernels=kernels)
    engine.prepare(model, opt)
    spy = KernelSpy(engine) if kernels == "auto" else None
    if level == "O2":
        with torch.no_grad():
            for r, q in zip(ref.parameters(), model.parameters()):
                r.copy_(q.float())
    for x, y in xs:
        nn.functional.cross_entropy(ref(x), y).backward()
    with OpRecorder() as rec:
        for x, y in xs:
            engine.backward(nn.functional.cross_entropy(model(x), y))

    def checks():
        return spy.count("unscale_check") if spy else rec.count("non_finite_check")

    assert checks() == 0  # nothing unscaled between the backward calls
    with OpRecorder() as rec:
        engine.unscale_(opt)
    assert checks() == 1
    for g, r in zip((q.grad for q in engine.master_params(opt)), ref.parameters()):
        if level == "O0":
            assert torch.equal(g, r.grad)
        else:
            torch.testing.assert_close(g, r.grad, rtol=2e-2, atol=2e-3)
    assert engine.step(opt)
    assert engine.scaler.state_dict()["unskipped"] == 1


# ---- O2 state dicts ------------------------------------------------------------------------
def test_o2_state_dict_is_fp32_masters_and_loads_into_fp32_model():
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = AmpEngine(props("O2"), CPU)
    engine.prepare(model, opt)
    x, y = batch()
    for _ in range(3):
        engine.backward(nn.functional.cross_entropy(model(x), y))
        assert engine.step(opt)
        engine.zero_grad(opt)
    sd = model.state_dict()
    floating = {k: v for k, v in sd.items() if v.is_floating_point()}
    assert floating and all(v.dtype == torch.float32 for v in floating.values())
    masters = engine.masters(opt)
    by_id = {id(p): m for p, m in zip(masters.model_params, masters.masters)}
    for name, p in model.named_parameters():
        if id(p) in by_id:
            assert torch.equal(sd[name], by_id[id(p)])  # the exact fp32 values, not p.float()
    assert model[0].weight.dtype == torch.float16  # the model itself stays half
    fp32 = net(seed=5)
    fp32.load_state_dict(sd)
    assert all(p.dtype == torch.float32 for p in fp32.parameters())

    # and back: an fp32 state dict into a freshly prepared half model re-seeds the masters exactly
    model2 = net(seed=7)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    engine2 = AmpEngine(props("O2"), CPU)
    engine2.prepare(model2, opt2)
    model2.load_state_dict(sd)
    m2 = engine2.masters(opt2)
    for a, b in zip(m2.masters, masters.masters):
        assert torch.equal(a, b)
    for a, b in zip(m2.model_params, masters.model_params):
        assert a.dtype == torch.float16 and torch.equal(a, b)
    # a half state dict (e.g. from another tool) seeds the masters from the loaded model
    half_sd = {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    engine2.load_model_state(model2, half_sd)
    for p, m in zip(m2.model_params, m2.masters):
        assert torch.equal(m, p.float())
    engine2.remove_hooks()
    assert model2.state_dict()["0.weight"].dtype == torch.float16


def test_refresh_masters_after_direct_weight_copy():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(props("O2"), CPU)
    engine.prepare(model, opt)
    with torch.no_grad():
        model[0].weight.fill_(0.25)
    engine.refresh_masters()
    m = engine.masters(opt)
    i = next(i for i, p in enumerate(m.model_params) if p is model[0].weight)
    assert torch.equal(m.masters[i], torch.full_like(m.masters[i], 0.25))


# ---- add_param_group after prepare ---------------------------------------------------------
@pytest.mark.parametrize("explicit", [False, True])
def test_add_param_group_after_prepare_gets_masters(explicit):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(props("O2"), CPU)
    engine.prepare(model, opt)
    n = len(engine.masters(opt))
    head = nn.Linear(3, 2).half()
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    if explicit:
        assert engine.sync_param_groups(opt) == 2
    x, y = batch()
    before = head.weight.detach().clone()
    engine.backward(head(model(x).half()).float().square().mean())
    assert engine.step(opt)
    masters = engine.masters(opt)
    assert len(masters) == n + 2
    assert all(p.dtype == torch.float32 for p in engine.master_params(opt))
    assert head.weight.dtype == torch.float16 and not torch.equal(head.weight, before)
    for p, m in zip(masters.model_params, masters.masters):
        assert torch.equal(m.to(p.dtype), p)


# ---- zero_grad -------------------------------------------------------------------------------
def test_zero_grad_clears_model_and_master_grads():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(props("O2"), CPU)
    engine.prepare(model, opt)
    x, y = batch()
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.unscale_(opt)
    assert all(p.grad is not None for p in engine.master_params(opt))
    engine.zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in engine.master_params(opt))
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.zero_grad(opt, set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# ---- O1 registration API and the BCE ban ----------------------------------------------------
class Funcs:
    """A user module whose functions are registered (a namespace, like Apex's examples)."""

    @staticmethod
    def mm(a, b):
        return a @ b

    @staticmethod
    def dtype_of(*tensors):
        return [t.dtype for t in tensors]


def _o1_engine(dtype="bfloat16"):
    """An O1 engine with Apex's function patches, as the facade (`amp.initialize`) makes it."""
    return ApexEngine(props("O1", autocast_dtype=dtype), CPU)


def test_register_float_function_runs_fp32_inside_the_region_only():
    ac.register_float_function(Funcs, "mm")
    original = Funcs.__dict__["mm"]
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    engine = _o1_engine()
    with engine.autocast():
        assert (a @ b).dtype == torch.bfloat16  # autocast as usual
        out = Funcs.mm(a, b)
        assert out.dtype == torch.float32  # registered: fp32, autocast off inside it
    assert Funcs.__dict__["mm"] is original  # restored on exit
    assert torch.equal(out, Funcs.mm(a, b))


def test_register_half_and_promote_functions():
    ac.register_half_function(Funcs, "dtype_of")
    a = torch.randn(2)
    with _o1_engine("bfloat16").autocast():
        assert Funcs.dtype_of(a, a.double(), torch.arange(2)) == [torch.bfloat16] * 2 + [
            torch.int64
        ]
    assert Funcs.dtype_of(a) == [torch.float32]  # outside: untouched
    ac.clear_registrations()
    ac.register_promote_function(Funcs, "dtype_of")
    with _o1_engine().autocast():
        assert Funcs.dtype_of(a.half(), a) == [torch.float32] * 2
        assert Funcs.dtype_of(a.half(), a.half()) == [torch.float16] * 2
        assert Funcs.dtype_of(a.half(), a.bfloat16()) == [torch.float32] * 2
    assert Funcs.dtype_of(a.half(), a) == [torch.float16, torch.float32]


def test_register_torch_function_and_reentrancy():
    ac.register_float_function(torch, "matmul")
    original = torch.matmul
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    engine = _o1_engine()
    with engine.autocast():
        with engine.autocast():  # nested region: patched once, restored once
            assert torch.matmul(a, b).dtype == torch.float32
            assert ac.in_patched_region()
        assert torch.matmul is not original and torch.matmul(a, b).dtype == torch.float32
    assert torch.matmul is original and not ac.in_patched_region()
    with pytest.raises(ZeroDivisionError):
        with engine.autocast():
            _ = 1 / 0
    assert torch.matmul is original  # restored after an exception too
    # not an O1 engine: no region, nothing patched
    with ApexEngine(props("O2"), CPU).autocast():
        assert torch.matmul is original


def test_register_rejects_unknown_names():
    with pytest.raises(AttributeError):
        ac.register_half_function(torch, "no_such_function")


def test_bce_on_half_inputs_is_banned_inside_o1_with_a_clear_message():
    engine = _o1_engine("float16")
    p = torch.rand(4).half()
    t = torch.rand(4).half()
    with engine.autocast():
        with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
            nn.functional.binary_cross_entropy(p, t)
        with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
            nn.BCELoss()(p, t)
        # fp32 inputs and the logits version are fine
        assert nn.functional.binary_cross_entropy(p.float(), t.float()).dtype == torch.float32
        nn.BCEWithLogitsLoss()(torch.randn(4), t.float())
    assert nn.functional.binary_cross_entropy(p.float(), t.float()).isfinite()
    assert not ac.in_patched_region()


# ---- the device, named as a user names it ---------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_kernels_step_a_device_named_without_an_index(device, optimizer):
    """`trainer.device=cuda` names no GPU index, and torch.device("cuda") != the "cuda:0" its
    tensors report: compared as given, no tensor matched the engine's device and every GPU step
    ran on torch's ops (found on an H200: the fused O2 step measured 0.45x the stock
    one). The engine takes the device as its tensors report it, and its O2 step is the kernels'
    one unscale-check and one fused update (whose numbers tests/unit/test_kernels.py checks)."""
    from runner.run.plan import select_device

    run_device = select_device(device)
    assert run_device == torch.empty(0, device=device).device  # what tensors made there say
    model = net().to(device)
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-2)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    engine = AmpEngine(props("O2"), device, kernels="fused")  # as given: "cuda", no index
    assert engine.device == run_device
    engine.prepare(model, opt)
    spy = KernelSpy(engine)
    x, y = (t.to(device) for t in batch())
    for _ in range(2):
        engine.backward(nn.functional.cross_entropy(model(x), y))
        assert engine.step(opt)
        model.zero_grad(set_to_none=True)
    update = "adam_step" if optimizer == "adam" else "sgd_step"
    assert spy.count(update) == 2, dict(spy.calls)
    assert spy.count("unscale_check") + spy.count("check_finite") == 2, dict(spy.calls)
    # the 16-bit model holds the masters rounded to nearest: the kernels' copy-back
    for m, q in zip(engine.master_params(opt), model.parameters()):
        if q.dtype != torch.float32:
            assert torch.equal(q, m.to(q.dtype))
