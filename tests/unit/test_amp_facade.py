"""The Apex-compatible facade `runner.precision.amp`, on CPU with real tensors (no mocks).

Tolerances: fp32 paths (O0 with a dynamic scale; the fp32 masters of O2) are compared bit for bit
or at rtol 1e-6, since power-of-two scaling is exact; half copies are compared after rounding the
fp32 reference to the same half type (exact), and half forward/backward results at fp16's
resolution (rtol 2e-2). fp16 is emulated on CPU, so every model here is tiny.
"""

from __future__ import annotations

import copy
import textwrap
import warnings

import pytest
import torch
from torch import nn

from runner.precision import amp
from tests.helpers.precision import Snapshot, batch, ce, fresh_amp, net  # noqa: F401 (autouse)
from tests.helpers.runs import REPO


def train_step(model, opt, x, y, loss_id=0, poison_param=None) -> torch.Tensor:
    opt.zero_grad()
    loss = ce(model, x, y)
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
        if poison_param is not None:
            list(model.parameters())[poison_param].grad.view(-1)[0] = float("inf")
    opt.step()
    return loss.detach()


# ---- the legacy script ---------------------------------------------------------------------
LEGACY_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    from runner.precision import amp  # was: from apex import amp

    device = "cuda" if torch.cuda.is_available() else "cpu"  # was: .cuda() everywhere

    torch.manual_seed(0)
    N, D_in, D_out = 64, 32, 4
    x = torch.randn(N, D_in, device=device)
    y = torch.randint(0, D_out, (N,), device=device)

    model = nn.Sequential(nn.Linear(D_in, 64), nn.ReLU(), nn.Linear(64, D_out)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

    losses = []
    for step in range(30):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
""")


def test_legacy_apex_script_runs_unchanged_but_for_the_import(capsys):
    scope: dict = {}
    exec(compile(LEGACY_SCRIPT, "legacy_apex_script.py", "exec"), scope)
    losses = scope["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    out = capsys.readouterr().out
    assert "Selected optimization level O1" in out and "loss " in out


def test_the_documented_port_example_is_the_tested_script():
    doc = (REPO / "docs" / "apex.md").read_text()
    for line in LEGACY_SCRIPT.strip().splitlines():
        assert line in doc, line


# ---- initialize ------------------------------------------------------------------------------
def test_initialize_returns_the_shapes_it_was_given():
    m, o = net(), None
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    assert amp.initialize(m, o, opt_level="O1", verbosity=0) == (m, o)
    m2 = net(1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    models, opts = amp.initialize([m, m2], [o, o2], opt_level="o2", verbosity=0)
    assert isinstance(models, list) and models[0] is m and opts[1] is o2
    assert amp.initialize(m, opt_level="O1", verbosity=0) is m
    assert amp.initialize((m,), opt_level="O1", verbosity=0) == [m]


def test_initialize_level_spellings_and_overrides(capsys):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="o2", keep_batchnorm_fp32=False, loss_scale=128.0)
    out = capsys.readouterr().out
    assert "Selected optimization level O2" in out and "keep_batchnorm_fp32" in out
    props = amp.engine().properties
    assert props.keep_batchnorm_fp32 is False and props.loss_scale == 128.0
    assert props.master_weights is True  # None = the level's default
    assert m[1].weight.dtype == torch.float16
    with pytest.raises(Exception, match="letter O"):
        amp.initialize(net(), opt_level="02", verbosity=0)


def _scale() -> float:
    return amp.state_dict()["loss_scaler0"]["loss_scale"]


def test_initialize_max_loss_scale_caps_the_start_and_growth():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.0**10, verbosity=0)
    assert _scale() == 2.0**10  # the dynamic start, 2**16, capped
    # one clean step short of a growth (growth_interval 2000): it would double without the cap
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**10, "unskipped": 1999}})
    x, y = batch()
    train_step(model, opt, x, y)
    assert amp.state_dict()["loss_scaler0"] == {
        **amp.state_dict()["loss_scaler0"],
        "loss_scale": 2.0**10,
        "unskipped": 0,
    }


def test_initialize_min_loss_scale_floors_the_back_off():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", min_loss_scale=2.0**15, verbosity=0)
    x, y = batch()
    before = Snapshot(model, amp.master_params(opt), opt)
    for _ in range(3):
        train_step(model, opt, x, y, poison_param=0)
        assert _scale() == 2.0**15  # 2**16 halves once, then stays at the floor
    assert amp.engine().skipped_steps == 3  # at the floor, overflowing steps are still skipped
    before.assert_unchanged(model, amp.master_params(opt), opt)


def test_initialize_cast_model_type_override():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0
    )
    assert amp.engine().properties.cast_model_type == torch.bfloat16
    assert model[0].weight.dtype == model[3].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == model[1].running_mean.dtype == torch.float32  # BN kept fp32
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    x, y = batch()
    losses = [train_step(model, opt, x, y).item() for _ in range(5)]
    assert losses[-1] < losses[0]


def test_initialize_master_weights_false_under_o2_steps_the_half_model():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", master_weights=False, verbosity=0)
    assert amp.engine().properties.master_weights is False
    assert amp.engine().masters(opt) is None
    stepped = list(amp.master_params(opt))
    assert [id(p) for p in stepped] == [id(p) for p in model.parameters()]  # no fp32 copies
    assert stepped[0].dtype == torch.float16
    before = model[0].weight.detach().clone()
    x, y = batch()
    train_step(model, opt, x, y)
    assert model[0].weight.dtype == torch.float16 and not torch.equal(model[0].weight, before)


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW])
def test_an_adam_eps_that_underflows_in_half_state_is_refused(make):
    """O3 keeps Adam's state in fp16, where the default eps 1e-8 is 0: refused before any step,
    as in the runner; with eps=1e-4, or fp32 masters (O2), the same optimizer is accepted."""
    model = net()
    opt = make(
        [{"params": model[0].parameters()}, {"params": model[1:].parameters(), "eps": 1e-8}],
        lr=1e-3,
        eps=1e-4,
    )
    with pytest.raises(ValueError, match=r"optimizer\.eps.*1e-4|eps=1e-08 underflows"):
        amp.initialize(model, opt, opt_level="O3", verbosity=0)
    opt = make(net().parameters(), lr=1e-3, eps=1e-4)
    amp.initialize(net(), opt, opt_level="O3", verbosity=0)
    amp.initialize(net(), make(net().parameters(), lr=1e-3), opt_level="O2", verbosity=0)


def test_enabled_false_is_a_no_op():
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    ref, ref_o = copy.deepcopy(m), None
    ref_o = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert amp.initialize(m, o, enabled=False, opt_level="O2") == (m, o)
    assert "step" not in o.__dict__ and "forward" not in m.__dict__
    assert m[0].weight.dtype == torch.float32
    x, y = batch()
    loss = ce(m, x, y)
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss
        scaled.backward()
    o.step()
    ce(ref, x, y).backward()
    ref_o.step()
    for p, r in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, r)
    assert amp.state_dict() == {}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_enabled_false_after_an_earlier_initialize_passes_through(level):
    """As in Apex, amp disabled by the latest `initialize` passes every loss through unchanged,
    whatever an earlier call in the process set up: no scale, no unscale, no overflow check (an
    inf gradient is left as it is, and a plain optimizer steps as without amp)."""
    earlier = net(3)
    earlier_opt = torch.optim.SGD(earlier.parameters(), lr=0.1)
    amp.initialize(earlier, earlier_opt, opt_level=level, loss_scale=128.0, verbosity=0)
    m, ref = net(), net()
    o, ref_o = (torch.optim.SGD(p.parameters(), lr=0.1) for p in (m, ref))
    assert amp.initialize(m, o, enabled=False) == (m, o)
    x, y = batch()
    for opt, model in ((o, m), (earlier_opt, earlier)):
        loss = ce(model, x, y)
        with amp.scale_loss(loss, opt) as scaled:
            assert scaled is loss
    loss = ce(m, x, y)
    with amp.scale_loss(loss, o) as scaled:
        scaled.backward()
        m[0].bias.grad[0] = float("inf")
    assert m[0].bias.grad[0] == float("inf")  # no unscale, no check, nothing zeroed
    m[0].bias.grad[0] = 0.0
    o.step()
    loss = ce(ref, x, y)
    loss.backward()
    ref[0].bias.grad[0] = 0.0
    ref_o.step()
    for p, r in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, r)


# ---- O2 numerics -----------------------------------------------------------------------------
def _fp32_twin(model: nn.Module, masters_by_id: dict) -> nn.Module:
    """An fp32 model holding exactly the O2 masters' values (and fp32 BN params)."""
    twin = net(99)
    with torch.no_grad():
        for t, p in zip(twin.parameters(), model.parameters()):
            t.copy_(masters_by_id.get(id(p), p).float())
    return twin


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_o2_step_equals_fp32_step_on_the_same_gradients(optim):
    make = (
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        if optim == "sgd"
        else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    )
    model = net()
    opt = make(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = amp.engine().masters(opt)
    by_id = masters.master_of()
    twin = _fp32_twin(model, by_id)
    twin_opt = make(twin.parameters())
    x, y = batch()
    for _ in range(3):
        train_step(model, opt, x, y)
        # the fp32 reference steps on the very gradients the masters got
        for t, p in zip(twin.parameters(), amp.master_params(opt)):
            t.grad = p.grad.clone()
        twin_opt.step()
        for t, p in zip(twin.parameters(), model.parameters()):
            m = by_id.get(id(p), p)
            torch.testing.assert_close(m, t, rtol=1e-6, atol=0)  # masters: fp32 exact-ish
            assert torch.equal(p, m.to(p.dtype))  # model copy: the master, rounded
    assert amp.engine().skipped_steps == 0


def test_o2_masters_equal_model_after_each_step_and_match_fp32_training():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = amp.engine().masters(opt)
    x, y = batch()
    for _ in range(10):
        loss = train_step(model, opt, x, y)
        ref_opt.zero_grad()
        ref_loss = ce(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        for p, m in zip(masters.model_params, masters.masters):
            assert p.dtype == torch.float16 and m.dtype == torch.float32
            assert torch.equal(m.half(), p)
        assert abs(loss.item() - ref_loss.item()) < 1e-2  # fp16 forward vs fp32 (observed ~1e-3)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_inf_in_any_parameter_skips_step_and_halves_scale(where):
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0}})
    n = len(list(model.parameters()))
    idx = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    x, y = batch()
    train_step(model, opt, x, y)  # creates the Adam state
    before = Snapshot(model, amp.master_params(opt), opt)
    train_step(model, opt, x, y, poison_param=idx)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 512.0
    assert amp.engine().skipped_steps == 1
    before.assert_unchanged(model, amp.master_params(opt), opt)
    train_step(model, opt, x, y)
    assert any(not torch.equal(v, before.weights[k]) for k, v in model.named_parameters())


def test_optimizer_zero_grad_clears_model_grads_under_o2():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch()
    with amp.scale_loss(ce(model, x, y), opt) as s:
        s.backward()
    assert model[0].weight.grad is not None
    assert all(p.dtype == torch.float32 and p.grad is not None for p in amp.master_params(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in amp.master_params(opt))


def test_closure_is_refused_like_apex():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)


# ---- several models, optimizers and losses ---------------------------------------------------
def test_two_models_two_optimizers_three_losses_with_different_scales():
    torch.manual_seed(0)
    enc, head = nn.Linear(6, 8), nn.Linear(8, 3)
    ref_enc, ref_head = copy.deepcopy(enc), copy.deepcopy(head)
    o_enc = torch.optim.SGD(enc.parameters(), lr=0.1)
    o_head = torch.optim.SGD(head.parameters(), lr=0.1)
    [enc, head], [o_enc, o_head] = amp.initialize(
        [enc, head],
        [o_enc, o_head],
        opt_level="O0",
        loss_scale="dynamic",
        num_losses=3,
        verbosity=0,
    )
    amp.load_state_dict(
        {
            f"loss_scaler{i}": {"loss_scale": s, "unskipped": 0}
            for i, s in enumerate((2.0**12, 2.0**6, 2.0**2))
        }
    )
    x, y = batch()

    def losses(e, h):
        f = e(x)
        return (
            nn.functional.cross_entropy(h(f), y),  # both models
            e(x).square().mean(),  # encoder only
            h(f.detach()).abs().mean(),
        )  # head only

    for loss in losses(ref_enc, ref_head):
        loss.backward()
    l0, l1, l2 = losses(enc, head)
    with amp.scale_loss(l0, [o_enc, o_head], loss_id=0) as s:
        s.backward(retain_graph=True)
    with amp.scale_loss(l1, o_enc, loss_id=1) as s:
        s.backward()
    with amp.scale_loss(l2, o_head, loss_id=2) as s:
        s.backward()
    for p, r in zip(
        (*enc.parameters(), *head.parameters()), (*ref_enc.parameters(), *ref_head.parameters())
    ):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-8)
    o_enc.step()
    o_head.step()
    assert [amp.state_dict()[f"loss_scaler{i}"]["unskipped"] for i in range(3)] == [1, 1, 1]

    # an overflow in loss 1 only: the encoder's step is skipped, only scaler 1 backs off
    o_enc.zero_grad(), o_head.zero_grad()
    before = [p.detach().clone() for p in (*enc.parameters(), *head.parameters())]
    l0, l1, l2 = losses(enc, head)
    with amp.scale_loss(l0, [o_enc, o_head], loss_id=0) as s:
        s.backward(retain_graph=True)
    with amp.scale_loss(l1, o_enc, loss_id=1) as s:
        s.backward()
        enc.weight.grad.view(-1)[0] = float("nan")
    with amp.scale_loss(l2, o_head, loss_id=2) as s:
        s.backward()
    o_enc.step()
    o_head.step()
    sd = amp.state_dict()
    assert [sd[f"loss_scaler{i}"]["loss_scale"] for i in range(3)] == [2.0**12, 2.0**5, 2.0**2]
    assert all(torch.equal(p, b) for p, b in zip(enc.parameters(), before[:2]))
    assert all(not torch.equal(p, b) for p, b in zip(head.parameters(), before[2:]))


def test_two_losses_o2_fp16():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    amp.load_state_dict(
        {
            "loss_scaler0": {"loss_scale": 2.0**14, "unskipped": 0},
            "loss_scaler1": {"loss_scale": 2.0**3, "unskipped": 0},
        }
    )
    twin = _fp32_twin(model, amp.engine().masters(opt).master_of())
    x, y = batch()
    ce(twin, x, y).backward()
    twin(x).square().mean().backward()
    opt.zero_grad()
    with amp.scale_loss(ce(model, x, y), opt, loss_id=0) as s:
        s.backward()
    with amp.scale_loss(model(x).square().mean(), opt, loss_id=1) as s:
        s.backward()
    for p, t in zip(amp.master_params(opt), twin.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.grad, t.grad, rtol=2e-2, atol=2e-3)
    opt.step()
    assert amp.engine().skipped_steps == 0


# ---- gradient accumulation -------------------------------------------------------------------
def test_gradient_accumulation_with_delay_unscale():
    model = net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**8, "unskipped": 0}})
    micro = [batch(seed) for seed in (1, 2, 3, 4)]
    for i, (x, y) in enumerate(micro):
        ce(ref, x, y).backward()
        with amp.scale_loss(ce(model, x, y), opt, delay_unscale=i < len(micro) - 1) as s:
            s.backward()
        if i < len(micro) - 1:  # still scaled: nothing unscaled or counted yet
            assert amp.state_dict()["loss_scaler0"]["unskipped"] == 0
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)  # one unscale of the accumulated, scaled sum: exact
    opt.step()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


# ---- add_param_group -------------------------------------------------------------------------
def test_add_param_group_after_initialize_gets_masters():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    head = nn.Linear(3, 2).half()
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))  # right away
    before = head.weight.detach().clone()
    x, y = batch()
    opt.zero_grad()
    with amp.scale_loss(head(model(x).half()).float().square().mean(), opt) as s:
        s.backward()
    opt.step()
    assert head.weight.dtype == torch.float16 and not torch.equal(head.weight, before)
    m = amp.engine().masters(opt)
    for p, master in zip(m.model_params, m.masters):
        assert torch.equal(master.half(), p)


# ---- checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_checkpoint_restore_continues_bit_identically(level):
    x, y = batch()
    kw = dict(opt_level=level, verbosity=0)
    if level == "O1":
        kw["patch_torch_functions"] = True

    def fresh(seed):
        m = net(seed)
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        return amp.initialize(m, o, **kw)

    model, opt = fresh(0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**10, "unskipped": 0}})
    train_step(model, opt, x, y)
    train_step(model, opt, x, y, poison_param=2)  # a skipped step: the scale is now 2**9
    train_step(model, opt, x, y)
    ckpt = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
    )
    assert all(v.dtype != torch.float16 for v in ckpt["model"].values())
    assert ckpt["amp"]["loss_scaler0"] == {
        **ckpt["amp"]["loss_scaler0"],
        "loss_scale": 2.0**9,
        "unskipped": 1,
    }
    go_on = [train_step(model, opt, x, y).item() for _ in range(4)]
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2 = fresh(123)  # the Apex recipe: initialize, then load the three state dicts
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    resumed = [train_step(model2, opt2, x, y).item() for _ in range(4)]
    assert resumed == go_on
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), k
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 5


def test_amp_state_dict_layout():
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", num_losses=2, verbosity=0)
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1"]
    assert sd["loss_scaler0"]["loss_scale"] == 2.0**16 and sd["loss_scaler0"]["unskipped"] == 0
    with pytest.warns(UserWarning, match="1 loss scalers"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}})
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 8.0


# ---- copies and whole-model pickles ----------------------------------------------------------
def _zero_weights(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _first_layer_dtype(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """`model(x)` and the dtype the first Linear computed in (fp16: autocast or a half model)."""
    seen = {}
    handle = model[0].register_forward_hook(lambda mod, args, out: seen.update(dtype=out.dtype))
    try:
        out = model(x)
    finally:
        handle.remove()
    return out, seen["dtype"]


def trained_for_one_step(level: str):
    """An initialised net after one SGD step, in eval mode: (model, x, its output for x)."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y)
    model.eval()
    return model, x, model(x).detach()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_deepcopy_is_an_independent_model_that_still_casts(level):
    """The EMA pattern: a copy of an initialised model runs on its own weights (zeroed here:
    Linear/BatchNorm(eval)/ReLU/Linear then output exactly 0), casts like the original, and
    leaves the original alone."""
    model, x, expected = trained_for_one_step(level)
    ema = copy.deepcopy(model)
    out, inner = _first_layer_dtype(ema, x)
    assert torch.equal(out, expected) and inner == torch.float16
    _zero_weights(ema)
    out, inner = _first_layer_dtype(ema, x)
    assert out.dtype == torch.float32 and inner == torch.float16
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(model(x), expected)  # the original still runs its own weights
    assert ema[0].weight.dtype == model[0].weight.dtype


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_torch_save_and_load_of_a_whole_model(tmp_path, level):
    model, x, expected = trained_for_one_step(level)
    weight_dtype = model[0].weight.dtype
    torch.save(model, tmp_path / "model.pt")
    amp.deinitialize()  # the loaded model needs no live engine
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    out, inner = _first_layer_dtype(loaded, x)
    assert torch.equal(out, expected) and out.dtype == torch.float32
    assert inner == torch.float16  # O1: still autocast inside forward; O2/O3: a half model
    assert loaded[0].weight.dtype == weight_dtype
    assert loaded.state_dict()["0.weight"].dtype == weight_dtype  # no engine: its own dtype
    _zero_weights(loaded)
    out = loaded(x)
    assert torch.equal(out, torch.zeros_like(out))


def test_loading_weights_into_an_o2_copy_leaves_the_masters_alone():
    """The EMA update `ema.load_state_dict(model.state_dict())`: the copy carries the model's
    state-dict hooks, which must not re-seed the original's fp32 masters from fp16 weights."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y)
    masters = amp.engine().masters(opt)
    # masters hold fp32 values that fp16 cannot: re-seeding would change them
    assert any(not torch.equal(m, p.float()) for p, m in zip(masters.model_params, masters.masters))
    before = [m.detach().clone() for m in masters.masters]
    ema = copy.deepcopy(model)
    sd = model.state_dict()
    assert all(v.dtype != torch.float16 for v in sd.values())  # fp32 masters' values
    ema.load_state_dict(sd)
    assert all(torch.equal(m, b) for m, b in zip(masters.masters, before))
    for (name, p), q in zip(model.named_parameters(), ema.parameters()):
        assert torch.equal(p, q), name  # the copy got the weights, in its 16-bit type


def test_loading_one_of_two_o2_models_reseeds_only_its_own_masters():
    enc, head = net(1), net(2)
    opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
    (enc, head), opt = amp.initialize([enc, head], opt, opt_level="O2", verbosity=0)
    x, y = batch()
    for _ in range(2):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(enc(x)[:, :3].repeat(1, 2)), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    masters = amp.engine().masters(opt)
    head_ids = {id(p) for p in head.parameters()}
    head_masters = [m for p, m in zip(masters.model_params, masters.masters) if id(p) in head_ids]
    assert any(not torch.equal(m, m.half().float()) for m in head_masters)  # real fp32 values
    before = [m.detach().clone() for m in head_masters]
    enc.load_state_dict(net(3).state_dict())  # new fp32 weights for the encoder only
    assert all(torch.equal(m, b) for m, b in zip(head_masters, before))
    enc_masters = {id(p): m for p, m in zip(masters.model_params, masters.masters)}
    for (name, p), want in zip(enc.named_parameters(), net(3).parameters()):
        if id(p) in enc_masters:  # the encoder's masters took the loaded fp32 values exactly
            assert torch.equal(enc_masters[id(p)], want), name


# ---- re-initialize ---------------------------------------------------------------------------
def test_initialize_calls_on_other_models_coexist_and_a_repeat_replaces_its_own():
    """As in Apex: a second initialize of other models leaves the first working (Apex's
    test_checkpointing initializes a restored model while the first trains on); the same model
    or optimizer again replaces only the call that had it."""
    m1 = net()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    amp.initialize(m1, o1, opt_level="O1", verbosity=0)
    assert "forward" in m1.__dict__ and "step" in o1.__dict__
    x, y = batch()
    train_step(m1, o1, x, y)

    m2 = net(1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    assert "forward" in m1.__dict__ and "step" in o1.__dict__  # the first call still stands
    first = [train_step(m1, o1, x, y).item() for _ in range(5)]
    assert first[-1] < first[0]
    losses = [train_step(m2, o2, x, y).item() for _ in range(5)]
    assert losses[-1] < losses[0]
    assert amp.engine().properties.opt_level == "O2"  # the latest call's, as Apex's globals

    # the same (already O2) model and optimizer again: masters rebuilt, hooks not doubled,
    # and the first call (other objects) untouched
    amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    assert len(m2._forward_hooks) == 1 and len(m2._forward_pre_hooks) == 1
    assert all(p.dtype == torch.float32 for p in amp.master_params(o2))
    assert len(amp.engine().masters(o2)) == 4
    more = [train_step(m2, o2, x, y).item() for _ in range(5)]
    assert more[-1] < losses[-1]
    assert "forward" in m1.__dict__
    amp.deinitialize()
    assert not m2._forward_hooks and "step" not in o2.__dict__
    assert "forward" not in m1.__dict__ and "step" not in o1.__dict__
    assert m1(x).dtype == torch.float32 and m1[0].weight.dtype == torch.float32


# ---- O1 forward, registration, BCE -----------------------------------------------------------
def test_o1_autocasts_forward_without_a_context_manager():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    model[0].register_forward_hook(lambda mod, a, out: seen.update(inner=out.dtype))
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = batch()
    out = model(x)
    assert seen["inner"] == torch.float16  # linear ran in fp16 inside forward
    assert out.dtype == torch.float32  # outputs come back fp32 ...
    assert (x @ x.T).dtype == torch.float32  # ... and outside forward nothing is autocast
    assert model[0].weight.dtype == torch.float32
    model2 = amp.initialize(net(), opt_level="O1", cast_model_outputs=torch.float16, verbosity=0)
    assert model2(x).dtype == torch.float16


def test_register_functions_apply_inside_the_o1_forward_only():
    calls = []

    class Ops:
        @staticmethod
        def dtypes(*ts):
            calls.append([t.dtype for t in ts])
            return ts[0]

    amp.register_float_function(Ops, "dtypes")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return Ops.dtypes(self.lin(x).half(), x)

    model = amp.initialize(M(), opt_level="O1", verbosity=0)
    model(torch.randn(2, 4))
    assert calls[-1] == [torch.float32, torch.float32]
    Ops.dtypes(torch.randn(2).half())
    assert calls[-1] == [torch.float16]


def test_function_decorators_cast_inside_the_o1_forward_only():
    """Each decorated function records the dtypes it receives and the dtype of a matmul inside
    it; undecorated, the O1 region would hand it the raw dtypes and autocast the matmul (fp16)."""
    seen: list[tuple[str, torch.dtype, torch.dtype, torch.dtype]] = []

    def record(name, a, b):
        seen.append((name, a.dtype, b.dtype, (a @ b.to(a.dtype).T).dtype))
        return a

    @amp.half_function
    def as_half(a, b):
        return record("half", a, b)

    @amp.float_function
    def as_float(a, b):
        return record("float", a, b)

    @amp.promote_function
    def promoted(a, b):
        return record("promote", a, b)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)  # fp16 under O1's autocast, x is fp32
            as_half(x, x)
            as_float(h, h)
            promoted(h, x)
            promoted(h, h)
            return h

    model = amp.initialize(M(), opt_level="O1", verbosity=0)
    x = torch.randn(2, 4)
    model(x)
    h16, f32 = torch.float16, torch.float32
    assert seen == [
        ("half", h16, h16, h16),
        ("float", f32, f32, f32),
        ("promote", f32, f32, f32),
        ("promote", h16, h16, h16),
    ]
    assert as_half.__name__ == "as_half"
    seen.clear()
    as_half(x, x), as_float(x.half(), x.half()), promoted(x.half(), x)  # outside: unchanged
    assert seen == [("half", f32, f32, f32), ("float", h16, h16, h16), ("promote", h16, f32, h16)]


def test_disable_casts_runs_a_matmul_inside_forward_in_fp32():
    seen = {}

    @amp.half_function
    def as_half(a):
        seen["decorated"] = a.dtype
        return a

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            seen["before"] = (x @ self.w).dtype
            with amp.disable_casts():
                inside = x @ self.w
                as_half(x)
                with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):  # the ban stays
                    nn.functional.binary_cross_entropy(torch.rand(2).half(), torch.rand(2).half())
            seen["after"] = (x @ self.w).dtype
            return inside

    model = amp.initialize(M(), opt_level="O1", verbosity=0)
    x = torch.randn(2, 4)
    out = model(x)
    assert seen == {"before": torch.float16, "decorated": torch.float32, "after": torch.float16}
    assert out.dtype == torch.float32 and torch.equal(out, x @ model.w)  # fp32, bit for bit
    with amp.disable_casts():  # around the call: the whole forward runs uncast
        model(x)
    assert seen["before"] == seen["after"] == torch.float32
    model(x)
    assert seen["before"] == torch.float16  # and casting is back after the block


def test_scale_loss_before_initialize_is_apexs_error_not_an_unscaled_backward():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    with pytest.raises(RuntimeError, match="amp.initialize.*must be called before"):
        with amp.scale_loss(ce(model, x, y), opt):
            pass
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with amp.scale_loss(ce(model, x, y), opt) as scaled:
        scaled.backward()
    amp.deinitialize()  # (the runner's own undo: amp is off again, the loss passes through)
    loss = ce(model.float(), x, y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


def test_amp_state_loss_scalers_report_the_current_scale():
    assert amp._amp_state.loss_scalers == []  # before initialize
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    scalers = amp._amp_state.loss_scalers
    assert [s.loss_scale() for s in scalers] == [2.0**16, 2.0**16]
    x, y = batch()
    train_step(model, opt, x, y, poison_param=1)  # an injected inf in loss 0's gradients
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert scalers[0].loss_scale() == 2.0**15  # a view taken before follows the back-off
    assert scalers[1].loss_scale() == 2.0**16  # only the overflowing loss's scaler


def test_bce_banned_inside_o1_forward():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, t):
            return nn.BCELoss()(torch.sigmoid(self.lin(x)).squeeze(1), t)

    model = amp.initialize(Bad(), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
        model(torch.randn(3, 4), torch.rand(3).half())


# ---- LR schedulers ---------------------------------------------------------------------------
@pytest.mark.parametrize("made", ["after", "before"])
def test_lr_scheduler_with_skipped_steps_emits_no_warning(made):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = None
    if made == "before":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    if made == "after":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(model, opt, x, y, poison_param=0)  # first step skipped
        sched.step()
        for _ in range(2):
            train_step(model, opt, x, y)
            sched.step()
    assert amp.engine().skipped_steps == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)  # skipped steps count
    assert all(p.dtype == torch.float32 for p in opt.param_groups[0]["params"])
