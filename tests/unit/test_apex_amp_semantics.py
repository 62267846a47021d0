"""Apex's own amp semantics, checked without Apex (CI has no mirror of it): the behaviours its
tests/L0/run_amp tests exercise (tests/helpers/apex_l0.sh runs those against the facade when
APEX_GIT names a mirror), each reproduced here on a CPU.

Numerics: 16-bit results are compared with the same computation done by hand in that type, or
with fp32/fp64 references at tolerances stated where used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.precision import amp, apex_o1
from runner.precision import autocast as ac
from tests.helpers.precision import fresh_amp  # noqa: F401 (autouse)
from tests.helpers.runs import HELPERS

H, B = 16, 4


@pytest.fixture
def handle():
    h = amp.init(enabled=True)
    yield h
    h._deactivate()


# ---- amp.init and its handle -----------------------------------------------------------------
def test_init_casts_by_apex_lists_until_deactivate():
    original = F.linear
    h = amp.init()
    assert amp._amp_state.handle is h and h.is_active() and ac.in_patched_region()
    m = nn.Linear(H, H)
    x = torch.randn(B, H, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.float16  # GEMM: half
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
    assert torch.equal(y, F.linear(x.half(), m.weight.half(), m.bias.half()))
    assert F.softmax(y, dim=1).dtype == torch.float32  # float list
    h._deactivate()
    assert not h.is_active() and not ac.in_patched_region()
    assert F.linear is original and m(x).dtype == torch.float32
    h._deactivate()  # twice: nothing more happens


def test_init_enabled_false_is_a_no_op_handle():
    h = amp.init(enabled=False)
    assert not h.is_active() and not ac.in_patched_region()
    assert nn.Linear(H, H)(torch.randn(B, H)).dtype == torch.float32
    h._deactivate()


@pytest.mark.parametrize(
    "fn, expected",
    [
        (lambda x: x.sum(), torch.float32),
        (lambda x: x.pow(2.0), torch.float32),
        (lambda x: x**2.0, torch.float32),
        (lambda x: F.softmax(x, dim=1), torch.float32),
        (lambda x: F.mse_loss(x, torch.zeros(B, H)), torch.float32),
        (lambda x: x.cpu(), torch.float32),
        (lambda x: F.relu(x), None),  # None: the input's own type
        (lambda x: x @ torch.randn(H, H), torch.float16),
        (lambda x: torch.randn(H, B) @ x, torch.float16),
        (lambda x: x.matmul(torch.randn(H, H)), torch.float16),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cpu_computes_in_the_dtypes_apex_gave_on_cuda(handle, fn, expected, dtype):
    """torch.autocast's CPU lists leave softmax, sum and pow of fp16 inputs in fp16 and `.cpu()`
    of a half tensor half; Apex's lists (applied here on every device) run them in fp32."""
    x = torch.randn(B, H, dtype=dtype, requires_grad=True)
    y = fn(x)
    assert y.dtype == (expected or dtype)
    y.float().sum().backward()
    assert x.grad.dtype == dtype


def test_group_norm_and_batch_norm(handle):
    x = torch.randn(B, H, 8, 8, dtype=torch.float16)
    assert nn.GroupNorm(4, H)(x).dtype == torch.float32
    bn = nn.BatchNorm2d(H)
    assert bn(x).dtype == torch.float16 and bn.weight.dtype == torch.float32  # match input


def test_promotion_to_the_widest_type(handle):
    h, f = torch.randn(B, dtype=torch.float16), torch.randn(B)
    for op in (torch.mul, torch.atan2, torch.add, lambda a, b: a * b, lambda a, b: a.atan2(b)):
        assert op(h, f).dtype == torch.float32 and op(f, h).dtype == torch.float32
        assert op(h, h).dtype == torch.float16
    assert torch.cat([h, h, f]).dtype == torch.float32 and torch.cat([h, h]).dtype == torch.float16
    assert torch.stack([f, h]).dtype == torch.float32
    # the product of the widened inputs, exactly
    assert torch.equal(torch.mul(h, f), h.float() * f)


def test_in_place_methods_keep_their_type_and_fp32_ones_refuse_half(handle):
    h = torch.randn(B, dtype=torch.float16)
    f = torch.randn(B)
    out = h.clone().add_(f)
    assert out.dtype == torch.float16
    assert torch.equal(out, h + f.half())
    g = h.clone()
    ptr = g.data_ptr()
    g += f  # an in-place operator stays in place (Apex made it out of place)
    assert g.dtype == torch.float16 and g.data_ptr() == ptr
    y = torch.randn(B)
    y.exp_()
    assert y.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="exp_"):
        h.clone().exp_()
    with pytest.raises(NotImplementedError):
        torch.exp_(h.clone())


def test_binary_cross_entropy_is_banned_unless_allowed():
    target = torch.rand(B, H)
    p = torch.rand(B, H, dtype=torch.float16)
    h = amp.init()
    for fn in (nn.BCELoss(), F.binary_cross_entropy):
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            fn(p, target)
    h._deactivate()
    h = amp.init(allow_banned=True)
    out = F.binary_cross_entropy(p, target)
    assert out.dtype == torch.float32
    assert torch.allclose(out, F.binary_cross_entropy(p.float(), target), rtol=0, atol=0)
    h._deactivate()
    assert not apex_o1.STATE.allow_banned  # the next init bans again


def test_disable_casts_inside_init(handle):
    x = torch.randn(B, H)
    with amp.disable_casts():
        assert (x @ x.T).dtype == torch.float32
    assert (x @ x.T).dtype == torch.float16


# ---- RNNs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, tuple_state",
    [
        (lambda: nn.RNNCell(H, H), False),
        (lambda: nn.GRUCell(H, H), False),
        (lambda: nn.LSTMCell(H, H), True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rnn_cells_run_in_half(handle, make, tuple_state, dtype):
    cell = make()
    x = torch.randn(B, H, dtype=dtype, requires_grad=True)
    state = torch.zeros(B, H, dtype=dtype)
    state = (state, state.clone()) if tuple_state else state
    out = cell(x, state)
    out = out[0] if tuple_state else out
    assert out.dtype == torch.float16 and cell.weight_ih.dtype == torch.float32
    out.float().sum().backward()
    assert x.grad.dtype == dtype and cell.weight_ih.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.RNN(H, H, num_layers=2, nonlinearity="relu", bidirectional=True),
        lambda: nn.GRU(H, H, num_layers=2),
        lambda: nn.LSTM(H, H, num_layers=2, bidirectional=True),
    ],
)
def test_rnns_run_in_half_with_fp32_weights(handle, make):
    rnn = make()
    x = torch.randn(5, B, H, requires_grad=True)
    out, _ = rnn(x)
    assert out.dtype == torch.float16
    out[-1].float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad is not None for p in rnn.parameters())
    # the same as the module cast to half by hand (the same 16-bit arithmetic)
    with amp.disable_casts():
        ref = make().half()
        ref.load_state_dict({k: v.half() for k, v in rnn.state_dict().items()})
        expected, _ = ref(x.detach().half())
    assert torch.equal(out, expected)


def test_packed_sequence(handle):
    rnn = nn.RNN(H, H, num_layers=2)
    x = torch.randn(6, B, H, requires_grad=True)
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 5, 4, 3]))
    out, _ = rnn(packed)
    assert out.data.dtype == torch.float16
    out.data.float().sum().backward()
    assert x.grad.dtype == torch.float32


class _HalfLSTMFails:
    """torch._VF as seen from nn.LSTM on a CPU whose kernel has no fp16 LSTM (oneDNN on some
    machines): the 16-bit call raises as oneDNN does; every other call is the real one."""

    def __init__(self, real):
        self.real = real

    def lstm(self, *args):
        if args[0].dtype == torch.float16:
            raise RuntimeError(
                "could not create a primitive descriptor for the LSTM forward propagation primitive"
            )
        return self.real.lstm(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_an_rnn_the_cpu_cannot_run_in_half_runs_in_fp32_with_a_warning(monkeypatch, handle):
    handle._deactivate()  # re-open the region over the stand-in kernel
    monkeypatch.setattr(torch.nn.modules.rnn, "_VF", _HalfLSTMFails(torch.nn.modules.rnn._VF))
    monkeypatch.setattr(apex_o1, "FALLBACKS", {})
    h = amp.init()
    lstm = nn.LSTM(H, H)
    x = torch.randn(5, B, H)
    with pytest.warns(RuntimeWarning, match="lstm cannot run in torch.float16 on cpu"):
        out, (hn, cn) = lstm(x)
    assert out.dtype == hn.dtype == cn.dtype == torch.float16  # the types Apex gave
    with amp.disable_casts():
        ref, _ = lstm(x)  # fp32 on the fp32 inputs and weights as they came
    assert torch.equal(out, ref.half())
    assert apex_o1.fallback_findings() == [
        "lstm on cpu: ran in float32 (could not create a primitive descriptor for the LSTM "
        "forward propagation primitive)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per function and device
        lstm(x)
    h._deactivate()


# ---- the cast cache --------------------------------------------------------------------------
def test_a_parameters_half_cast_is_cached_until_it_changes(handle):
    m = nn.Linear(H, H)
    x = torch.randn(B, H)
    casts = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        if self is m.weight:
            casts.append(1)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "to", spy)
        m(x), m(x)
        assert len(casts) == 1  # cached for the second forward
        with torch.no_grad():
            m.weight.add_(1.0)  # changed in place: the cache sees its version
        y = m(x)
        assert len(casts) == 2
    assert torch.equal(y, F.linear(x.half(), m.weight.half(), m.bias.half()))
    handle._clear_cache()
    assert not apex_o1.STATE.cache


def test_eval_casts_are_not_reused_for_training():
    """Apex's test_cache: an eval forward under no_grad caches a cast without grad; the next
    training forward must not reuse it, or the weight gets no gradient."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0  # (2 * 65536 overflows the fp16 grads)
    x = torch.ones(2, 8)
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32
        ref = torch.ones(2, 8).half().float().sum(0).expand(2, 8)  # d sum(xW^T) / dW
        torch.testing.assert_close(model.weight.grad, ref, rtol=0, atol=0)
        opt.step()
        with torch.no_grad():
            model(x)
    amp._amp_state.handle._deactivate()


# ---- _amp_state --------------------------------------------------------------------------------
def test_amp_state_after_initialize():
    assert not hasattr(amp._amp_state, "opt_properties") or amp._amp_state.opt_properties
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    props = amp._amp_state.opt_properties
    assert props.enabled and props.opt_level == "O2" and props.cast_model_type == torch.float16
    assert props.master_weights is True and props.keep_batchnorm_fp32 is True
    assert props.loss_scale == "dynamic" and props.patch_torch_functions is False
    scalers = amp._amp_state.loss_scalers
    assert scalers is amp._amp_state.loss_scalers and len(scalers) == 2  # the same views
    scalers[1]._loss_scale = 16.0  # a write goes to the engine's scaler
    assert amp.engine().scalers[1].scale == 16.0 and scalers[1].loss_scale() == 16.0
    assert amp.state_dict()["loss_scaler1"]["loss_scale"] == 16.0
    with pytest.raises(ValueError):
        scalers[0]._loss_scale = float("inf")
    amp.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)
    assert amp._amp_state.handle is not None and amp._amp_state.opt_properties.opt_level == "O1"


def test_a_written_static_scale_is_used():
    """O0 has a static scale of 1; Apex's tests set 4.0 by hand and expect it applied."""
    model = nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0
    x = torch.ones(1, 4)
    loss = model(x).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss * 4.0)
        scaled.backward()
    assert torch.equal(model.weight.grad, torch.ones(1, 4))  # unscaled again


def test_handle_of_an_o1_initialize_ends_its_casts():
    model = nn.Sequential(nn.Linear(4, 4))
    model = amp.initialize(model, opt_level="O1", verbosity=0)
    seen = {}
    model[0].register_forward_hook(lambda mod, a, out: seen.update(dtype=out.dtype))
    model(torch.randn(2, 4))
    assert seen["dtype"] == torch.float16
    amp._amp_state.handle._deactivate()
    model(torch.randn(2, 4))
    assert seen["dtype"] == torch.float32


def test_a_half_model_is_refused_unless_allowed():
    model = nn.Linear(4, 4).half()
    with pytest.raises(RuntimeError, match="you do not need to call .half"):
        amp.initialize(model, opt_level="O1", verbosity=0)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        amp.initialize(model, opt_level="O1", verbosity=0)
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False


# ---- one overflow decision per scale_loss ------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_skips_every_optimizer_of_that_scale_loss(level):
    """A reported failure: two layers, two optimizers, one scale_loss over both losses with
    [oa, ob], an inf in b's gradient: Apex skips oa as well."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level=level, verbosity=0)
    before = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    amp._amp_state.loss_scalers[0]._loss_scale = scale = 8.0
    x = torch.randn(2, 4)
    with amp.scale_loss(a(x).sum() + b(x).sum(), [oa, ob]) as scaled:
        scaled.backward()
        b.weight.grad.view(-1)[0] = float("inf")
    oa.step(), ob.step()
    after = [p.detach() for p in (*a.parameters(), *b.parameters())]
    assert all(torch.equal(p, q) for p, q in zip(before, after))
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale / 2  # backed off once
    # and the next iteration steps both
    oa.zero_grad(), ob.zero_grad()
    with amp.scale_loss(a(x).sum() + b(x).sum(), [oa, ob]) as scaled:
        scaled.backward()
    oa.step(), ob.step()
    assert not torch.equal(a.weight, before[0]) and not torch.equal(b.weight, before[2])


def test_optimizers_of_two_initialize_calls_in_one_scale_loss_are_refused():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, oa = amp.initialize(a, oa, opt_level="O0", verbosity=0)
    b, ob = amp.initialize(b, ob, opt_level="O0", verbosity=0)
    with pytest.raises(RuntimeError, match="same amp.initialize"):
        with amp.scale_loss(a(torch.ones(1, 2)).sum(), [oa, ob]):
            pass
    stranger = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="not returned by amp.initialize"):
        with amp.scale_loss(a(torch.ones(1, 2)).sum(), stranger):
            pass


# ---- cast_model_type=False, coexisting initialize, restored masters ------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_cast_model_type_false_keeps_the_models_own_types(level):
    """Apex's test_add_param_group and test_multiple_models: a model with an fp32 and an fp16
    parameter, not cast; under O2 the fp16 one gets an fp32 master. SGD on values that are exact
    in fp16 (small integers, lr a power of two): equal to plain torch bit for bit."""

    def make():
        m = nn.Module()
        m.w0 = nn.Parameter(torch.arange(2, dtype=torch.float32) + 1)
        m.w1 = nn.Parameter(torch.arange(2, dtype=torch.float16) + 2)
        return m

    def loss_of(m):
        return (torch.ones(2) * m.w0.float() * m.w1.float()).sum()

    ref, model = make(), make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.25)
    for _ in range(2):
        ref_opt.zero_grad()
        loss_of(ref).backward()
        ref_opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        model, opt = amp.initialize(model, opt, opt_level=level, cast_model_type=False, verbosity=0)
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False
    assert model.w0.dtype == torch.float32 and model.w1.dtype == torch.float16
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0  # as Apex's tests (65536 overflows fp16)
    masters = amp.engine().masters(opt)
    assert (masters is not None and len(masters) == 1) == (level == "O2")
    assert amp._amp_state.opt_properties.cast_model_type is False
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model), opt) as scaled:
            scaled.backward()
        opt.step()
    assert torch.equal(model.w0, ref.w0) and torch.equal(model.w1, ref.w1)


def test_a_first_initialize_keeps_working_after_a_second_one():
    """A reported failure: initialize a model, then a restored copy; the first
    optimizer's scale_loss must still work (Apex's test_checkpointing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    x = torch.randn(8, 4)

    def step(m, o, loss_id):
        o.zero_grad()
        with amp.scale_loss(m(x).square().mean(), o, loss_id=loss_id) as scaled:
            scaled.backward()
        o.step()

    for _ in range(3):
        step(model, opt, 0)
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    restored = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1)
    restored.load_state_dict(checkpoint["model"])  # fp32 masters' values, before initialize
    restored_opt.load_state_dict(checkpoint["optimizer"])
    restored, restored_opt = amp.initialize(
        restored, restored_opt, opt_level="O2", num_losses=2, verbosity=0
    )
    # the masters come from the loaded fp32 values, not from their 16-bit casts
    for p, q in zip(amp.master_params(restored_opt), checkpoint["model"].values()):
        assert torch.equal(p, q)
    for _ in range(3):
        step(model, opt, 0)  # the first call's optimizer still works ...
        step(restored, restored_opt, 1)  # ... beside the second
    for (k, v), w in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(v, w), k


# ---- Apex's own tests, when a mirror is at hand -------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("APEX_GIT"), reason="APEX_GIT names no NVIDIA/apex mirror")
def test_apex_l0_amp_tests_pass():
    bash = shutil.which("bash")
    result = subprocess.run(
        [bash, str(HELPERS / "apex_l0.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and summary.endswith("passed 41 of 41"), result.stdout[-3000:]
