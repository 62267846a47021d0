"""Precision levels, override parsing and the AmpEngine, on CPU with real tensors (no mocks).

fp16 arithmetic on CPU is emulated and slow, so every model and batch here is tiny.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn

from runner.errors import ConfigError
from runner.precision import LEVELS, AmpEngine, Finding, Properties, Resolution, resolve
from runner.precision.casting import cast_model
from runner.precision.scaler import LossScaler
from tests.helpers.precision import KernelSpy, OpRecorder, Snapshot, props, total_norm

CPU = torch.device("cpu")


# ---- helpers -------------------------------------------------------------------------------
class TinyBNNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(self.pool(x).flatten(1))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyBNNet()


def make_batch(seed: int = 1):
    """A fixed, learnable batch: one noisy pattern per class."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(16) % 4
    patterns = torch.randn(4, 3, 8, 8, generator=g)
    x = patterns[y] + 0.5 * torch.randn(16, 3, 8, 8, generator=g)
    return x, y


def sgd_engine(p: Properties, lr: float = 0.1, **engine_kw):
    """A fresh model with plain SGD, prepared by an engine for `p`."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = AmpEngine(p, CPU, **engine_kw)
    engine.prepare(model, opt)
    return model, opt, engine


def fp32_reference_losses(steps: int, lr: float = 0.1) -> list[float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = make_batch()
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def engine_losses(p: Properties, steps: int, lr: float = 0.1):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    engine = AmpEngine(p, CPU)
    model, opt = engine.prepare(model, opt)
    x, y = make_batch()
    losses = []
    for _ in range(steps):
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step(opt)
        engine.zero_grad(opt)
    return losses, engine, model, opt


# ---- properties ----------------------------------------------------------------------------
TABLE = {
    "O0": (torch.float32, False, None, False, 1.0),
    "O1": (None, True, None, None, "dynamic"),
    "O2": (torch.float16, False, True, True, "dynamic"),
    "O3": (torch.float16, False, False, False, 1.0),
}


@pytest.mark.parametrize("level", sorted(TABLE))
def test_level_properties_match_apex_table(level):
    p = resolve(level).properties
    got = (
        p.cast_model_type,
        p.patch_torch_functions,
        p.keep_batchnorm_fp32,
        p.master_weights,
        p.loss_scale,
    )
    assert got == TABLE[level]
    assert p.opt_level == level
    assert set(LEVELS[level]) == {
        "cast_model_type",
        "patch_torch_functions",
        "keep_batchnorm_fp32",
        "master_weights",
        "loss_scale",
    }


def test_as_params_and_table():
    params = resolve("O2").properties.as_params()
    assert params["opt_level"] == "O2"
    assert params["cast_model_type"] == "float16"
    assert params["loss_scale"] == "dynamic"
    assert params["keep_batchnorm_fp32"] == "True"
    assert resolve("O1").properties.as_params()["cast_model_type"] == "None"
    assert resolve("O0").properties.as_params()["loss_scale"] == "1.0"
    assert all(not k.startswith("precision.") for k in params)
    table = resolve("O3").properties.table().splitlines()
    assert table[0].split() == ["property", "value"]
    assert any(line.split() == ["cast_model_type", "float16"] for line in table)


@pytest.mark.parametrize("spelling", ["O2", "o2", " O2 "])
def test_opt_level_spellings(spelling):
    assert resolve(spelling).properties.opt_level == "O2"


def test_opt_level_zero_prefix_refused_with_hint():
    with pytest.raises(ConfigError) as e:
        resolve("02")
    assert e.value.key == "precision.opt_level"
    assert "letter O" in str(e.value)
    with pytest.raises(ConfigError, match="precision.opt_level"):
        resolve("O4")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("float16", torch.float16),
        ("torch.float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float32", torch.float32),
        (None, None),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_cast_model_type_parsing(value, expected):
    assert resolve("O2", {"cast_model_type": value}).properties.cast_model_type == expected


@pytest.mark.parametrize("value", ["int8", "float64", torch.float64, 16, "fp8"])
def test_cast_model_type_refused(value):
    with pytest.raises(ConfigError) as e:
        resolve("O2", {"cast_model_type": value})
    assert e.value.key == "precision.cast_model_type"
    assert "float16" in str(e.value)


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, True),
        (False, False),
        ("True", True),
        ("False", False),
        (None, None),
    ],
)
def test_keep_batchnorm_fp32_parsing(value, expected):
    assert resolve("O2", {"keep_batchnorm_fp32": value}).properties.keep_batchnorm_fp32 is expected


@pytest.mark.parametrize("value", ["maybe", 2, 1.0])
def test_keep_batchnorm_fp32_refused(value):
    with pytest.raises(ConfigError, match="precision.keep_batchnorm_fp32"):
        resolve("O2", {"keep_batchnorm_fp32": value})


@pytest.mark.parametrize(
    "value, expected",
    [
        ("dynamic", "dynamic"),
        (128, 128.0),
        (128.0, 128.0),
        ("128.0", 128.0),
        ("1", 1.0),
        (0.5, 0.5),
    ],
)
def test_loss_scale_parsing(value, expected):
    assert resolve("O3", {"loss_scale": value}).properties.loss_scale == expected


@pytest.mark.parametrize("value", [0, -1.0, "inf", float("nan"), "big", None, True])
def test_loss_scale_refused(value):
    with pytest.raises(ConfigError) as e:
        resolve("O3", {"loss_scale": value})
    assert e.value.key == "precision.loss_scale"
    assert "dynamic" in str(e.value)


def test_overrides_equal_to_defaults_and_unknown_keys():
    whole_config = dict(
        opt_level="O2",
        cast_model_type="float16",
        patch_torch_functions=False,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale="dynamic",
    )
    assert resolve("O2", whole_config).properties == resolve("O2").properties
    with pytest.raises(ConfigError, match="precision.opt_level"):
        resolve("O2", {"opt_level": "O3"})
    with pytest.raises(ConfigError, match="precision.master_weigths"):
        resolve("O2", {"master_weigths": True})


def test_findings():
    r = resolve("O2", device="cpu")
    assert isinstance(r, Resolution)
    assert any(f.level == "warning" and "emulated on CPU" in f.message for f in r.findings)
    bf16 = resolve("O2", {"cast_model_type": "bfloat16"}, device="cpu").findings
    assert [(f.level, f.property) for f in bf16] == [("info", "loss_scale")]  # scaling unneeded
    assert any("emulated on CPU" in f.message for f in resolve("O1", device="cpu").findings)
    assert not resolve("O2").findings  # device unknown: no device rules
    r = resolve("O1", {"master_weights": True})
    assert [f.property for f in r.warnings] == ["master_weights"]
    assert all(isinstance(f, Finding) for f in r.findings)
    assert not resolve("O0", device="cpu").findings


# ---- casting -------------------------------------------------------------------------------
def assert_cast_keeping_batchnorm_fp32(model: nn.Module, half: torch.dtype) -> None:
    """make_model()'s conv/linear layers in `half`; its BatchNorms' weights and statistics fp32."""
    for m in (model.conv, model.conv2, model.fc):
        assert all(p.dtype == half for p in m.parameters())
    for bn in (model.bn, model.bn2):
        assert all(p.dtype == torch.float32 for p in bn.parameters())
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
        assert bn.num_batches_tracked.dtype == torch.long


def test_o2_casting_keeps_batchnorm_fp32_and_casts_io():
    model = make_model()
    params_before = list(model.parameters())
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = args[0].dtype

        return hook

    model.conv.register_forward_pre_hook(record("conv_in"))
    model.bn.register_forward_pre_hook(record("bn_in"))
    engine = AmpEngine(props("O2"), CPU)
    engine.prepare(model, None)
    assert list(model.parameters()) == params_before  # same Parameter objects, cast in place
    assert_cast_keeping_batchnorm_fp32(model, torch.float16)
    x, _ = make_batch()
    out = model(x)
    assert seen == {"conv_in": torch.float16, "bn_in": torch.float16}
    assert out.dtype == torch.float32
    model.eval()
    assert model(x).dtype == torch.float32


def test_o3_casts_batchnorm_too():
    model = make_model()
    AmpEngine(props("O3"), CPU).prepare(model, None)
    assert all(t.dtype == torch.float16 for t in model.parameters())
    assert model.bn.running_mean.dtype == torch.float16
    assert model(make_batch()[0]).dtype == torch.float32


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_keep_batchnorm_fp32_covers_sync_batchnorm(mode):
    """SyncBatchNorm is a _BatchNorm: it keeps fp32 weights and statistics under O2 and takes the
    16-bit activations. Without a process group (this CPU test) SyncBatchNorm runs as plain batch
    norm in both modes, which is what is checked here; the cross-process reduction needs CUDA.
    Tolerance: bf16 activations against an fp32 model with the same weights, 1e-2 absolute on
    outputs of magnitude ~0.2 (observed ~2e-3), 1e-3 on the updated running means."""
    ref = make_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    assert isinstance(model.bn, nn.SyncBatchNorm) and isinstance(model.bn2, nn.SyncBatchNorm)
    seen = {}
    model.bn.register_forward_pre_hook(lambda module, args: seen.update(bn_in=args[0].dtype))
    AmpEngine(props("O2", cast_model_type="bfloat16"), CPU).prepare(model, None)
    assert_cast_keeping_batchnorm_fp32(model, torch.bfloat16)
    getattr(model, mode)()
    getattr(ref, mode)()
    x, _ = make_batch()
    out = model(x)
    assert seen["bn_in"] == torch.bfloat16 and out.dtype == torch.float32
    torch.testing.assert_close(out, ref(x), rtol=0, atol=1e-2)
    for bn, ref_bn in ((model.bn, ref.bn), (model.bn2, ref.bn2)):
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=0, atol=1e-3)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-2, atol=1e-3)
    if mode == "train":
        assert int(model.bn.num_batches_tracked) == 1
        assert not torch.equal(model.bn.running_mean, torch.zeros(8))  # the statistics moved


def test_io_casts_handle_nested_structures_and_remove():
    Pair = namedtuple("Pair", "a b")

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, batch, extra=None):
            a = self.lin(batch["x"][0])
            return {"out": [a, Pair(a.sum(), batch["ids"])], "dtype_extra": extra.dtype}

    model = Nested()
    hooks = cast_model(model, torch.bfloat16, keep_batchnorm_fp32=True)
    ids = torch.arange(2)
    res = model({"x": (torch.randn(3, 2),), "ids": ids}, extra=torch.randn(1))
    assert res["dtype_extra"] == torch.bfloat16  # kwargs cast on the way in
    assert res["out"][0].dtype == torch.float32
    assert isinstance(res["out"][1], Pair) and res["out"][1].a.dtype == torch.float32
    assert res["out"][1].b.dtype == torch.long  # integer tensors untouched
    hooks.remove()
    assert model.lin(torch.randn(1, 2).bfloat16()).dtype == torch.bfloat16
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_cast_model_hooks_travel_with_deepcopy_and_torch_save(tmp_path):
    """The IO-cast hooks are picklable: a cast model saved whole loads and still casts."""
    model = make_model()
    cast_model(model, torch.bfloat16, keep_batchnorm_fp32=True)
    model.eval()
    x, _ = make_batch()
    expected = model(x)
    torch.save(model, tmp_path / "model.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        seen = {}
        twin.conv.register_forward_pre_hook(
            lambda module, args, seen=seen: seen.update(dtype=args[0].dtype)
        )
        out = twin(x)
        assert seen["dtype"] == torch.bfloat16 and out.dtype == torch.float32
        assert torch.equal(out, expected)


# ---- master weights ------------------------------------------------------------------------
def test_master_weights_are_fp32_copies_held_by_the_optimizer():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(props("O2"), CPU)
    group_dict = opt.param_groups[0]
    engine.prepare(model, opt)
    assert opt.param_groups[0] is group_dict
    stepped = list(engine.master_params(opt))
    assert len(stepped) == len(list(model.parameters()))
    assert all(p.dtype == torch.float32 for p in stepped)
    masters = engine.masters(opt)
    assert len(masters) == 5  # conv w/b, conv2 w, fc w/b; the 4 BN params are their own masters
    stepped_ids = {id(p) for p in stepped}
    for p, m in zip(masters.model_params, masters.masters):
        assert p.dtype == torch.float16 and m.dtype == torch.float32
        assert torch.equal(m.half(), p) and id(m) in stepped_ids and id(p) not in stepped_ids
    assert id(model.bn.weight) in stepped_ids
    # one step: masters step in fp32 and the model receives a rounded copy
    x, y = make_batch()
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.unscale_(opt)  # the masters' fp32 .grad buffers are filled (also with kernels)
    assert engine.step(opt)
    for p, m in zip(masters.model_params, masters.masters):
        assert torch.equal(m.half(), p)
    bufs = [m.grad for m in masters.masters]
    assert all(b is not None and b.dtype == torch.float32 for b in bufs)
    engine.zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.unscale_(opt)
    assert all(m.grad is b for m, b in zip(masters.masters, bufs))  # grad buffers reused


# ---- training ------------------------------------------------------------------------------
STEPS = 20


def test_o0_matches_plain_fp32_loop_exactly():
    ref = fp32_reference_losses(STEPS)
    losses, engine, *_ = engine_losses(props("O0"), STEPS)
    assert ref[-1] < 0.6 * ref[0]
    assert losses == pytest.approx(ref, rel=1e-6, abs=1e-7)
    assert engine.skipped_steps == 0


@pytest.mark.parametrize(
    "level, overrides, tol",
    [
        ("O1", {}, 0.01),
        ("O1", {"autocast_dtype": "bfloat16"}, 0.03),
        ("O2", {}, 0.01),
        ("O2", {"cast_model_type": "bfloat16"}, 0.03),
        ("O3", {}, 0.02),
        ("O3", {"cast_model_type": "bfloat16"}, 0.05),
    ],
)
def test_levels_reduce_loss_like_fp32(level, overrides, tol):
    """Every level learns the fixed batch like the fp32 loop: the loss falls from ~1.4 to ~0.57
    in 20 steps, and each level's last loss is within `tol` (absolute) of fp32's (observed gaps:
    <1e-3 for fp16, <5e-3 for bf16; the tolerances leave a 5-10x margin)."""
    ref = fp32_reference_losses(STEPS)
    losses, engine, model, _ = engine_losses(props(level, **overrides), STEPS)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0]
    assert abs(losses[-1] - ref[-1]) < tol
    assert engine.skipped_steps == 0


# ---- loss scaling --------------------------------------------------------------------------
def _one_step(engine, model, opt, x, y, poison: bool = False) -> bool:
    engine.backward(nn.functional.cross_entropy(model(x), y))
    if poison:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    ok = engine.step(opt)
    engine.zero_grad(opt)
    return ok


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_dynamic_scaler_skips_inf_step_and_backs_off(level):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = AmpEngine(props(level, loss_scale="dynamic"), CPU)
    engine.scaler.load_state_dict({"loss_scale": 128.0})  # small start: no real overflow
    engine.prepare(model, opt)
    x, y = make_batch()
    assert _one_step(engine, model, opt, x, y)  # creates Adam state
    before = Snapshot(model, engine.master_params(opt), opt)
    assert not _one_step(engine, model, opt, x, y, poison=True)
    assert engine.skipped_steps == 1
    assert engine.loss_scale == 64.0
    before.assert_unchanged(model, engine.master_params(opt), opt)
    assert _one_step(engine, model, opt, x, y)  # next clean step goes through
    assert engine.skipped_steps == 1


def test_dynamic_scale_growth_and_bounds():
    s = LossScaler(
        "dynamic", init_scale=8.0, growth_interval=3, max_loss_scale=32.0, min_loss_scale=2.0
    )
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    for _ in range(6):
        s.update(False)
    assert s.scale == 32.0  # capped by max_loss_scale
    s.update(False), s.update(True)
    assert s.scale == 16.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0  # floored by min_loss_scale
    defaults = LossScaler("dynamic")
    assert (
        defaults.scale,
        defaults.growth_factor,
        defaults.backoff_factor,
        defaults.growth_interval,
        defaults.max_loss_scale,
    ) == (2.0**16, 2.0, 0.5, 2000, 2.0**24)


def test_engine_scale_grows_after_growth_interval_clean_steps():
    model, opt, engine = sgd_engine(props("O1", autocast_dtype="bfloat16"), lr=0.01)
    engine.scaler.growth_interval = 3
    engine.scaler.load_state_dict({"loss_scale": 4.0})
    x, y = make_batch()
    for _ in range(3):
        assert _one_step(engine, model, opt, x, y)
    assert engine.loss_scale == 8.0


def test_unscale_flags_non_finite_in_fp32_and_fp16():
    s = LossScaler(4.0)
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([2.0], dtype=torch.float16)]
    assert s.unscale_(grads).item() == 0
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].item() == 0.5
    bad = [torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")], dtype=torch.float16)]
    assert s.unscale_(bad).item() != 0
    assert LossScaler(1.0).unscale_(grads) is None


def test_static_scale_one_adds_no_pass_over_grads():
    model, opt, engine = sgd_engine(props("O0"))
    x, y = make_batch()
    loss = nn.functional.cross_entropy(model(x), y)
    with OpRecorder() as bwd:
        engine.backward(loss)
    assert bwd.ops[0] == "aten.ones_like.default"  # straight to backward: no multiply by 1
    grads = {id(p): p.grad for p in model.parameters()}
    snapshot = [p.grad.clone() for p in model.parameters()]
    with OpRecorder() as rec:
        engine.unscale_(opt)
    assert rec.ops == []  # no unscale, no check: nothing ran at all
    with OpRecorder() as rec:
        assert engine.step(opt)
    assert rec.count("non_finite_check") == 0
    assert rec.count("_local_scalar_dense") == 0  # no host sync
    for p, g in zip(model.parameters(), snapshot):
        assert grads[id(p)] is p.grad and torch.equal(p.grad, g)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_checked_steps_sync_exactly_once(kernels):
    for p in (props("O2"), props("O3", loss_scale=8.0)):
        model, opt, engine = sgd_engine(p, kernels=kernels)
        spy = KernelSpy(engine) if kernels == "auto" else None
        engine.scaler.load_state_dict({"loss_scale": 8.0})
        x, y = make_batch()
        engine.backward(nn.functional.cross_entropy(model(x), y))
        with OpRecorder() as rec:
            engine.unscale_(opt)
        checks = spy.count("unscale_check") if spy else rec.count("non_finite_check")
        assert checks >= 1 and rec.count("_local_scalar_dense") == 0
        with OpRecorder() as rec:
            assert engine.step(opt)
        assert rec.count("_local_scalar_dense") == 1
        # unscale_ is once per step
        assert (spy.count("unscale_check") == checks) if spy else rec.count("non_finite_check") == 0


def test_fused_step_checks_and_syncs_once_without_fp32_master_grads():
    """With kernels, a step nobody unscaled runs from the scaled fp16 model gradients: one
    read-only check pass, one host read, one fused update that also writes the fp16 model."""
    model, opt, engine = sgd_engine(props("O2"))
    spy = KernelSpy(engine)
    x, y = make_batch()
    masters = engine.masters(opt)
    engine.scaler.load_state_dict({"loss_scale": 1024.0})
    engine.backward(nn.functional.cross_entropy(model(x), y))
    unscaled = {
        id(m): p.grad.float() / 1024.0 for p, m in zip(masters.model_params, masters.masters)
    }
    unscaled.update(
        {id(p): p.grad / 1024.0 for p in engine.master_params(opt) if id(p) not in unscaled}
    )
    before = {id(p): p.detach().clone() for p in engine.master_params(opt)}
    with OpRecorder() as rec:
        assert engine.step(opt)
    assert rec.count("_local_scalar_dense") == 1
    assert spy.count("check_finite") == 1 and spy.count("sgd_step") == 1
    assert spy.count("unscale_check") == 0 and spy.count("copy_scale") == 0
    assert all(m.grad is None for m in masters.masters)  # no fp32 gradient copies
    for p in engine.master_params(opt):  # SGD without momentum on the unscaled gradient, fp32
        torch.testing.assert_close(p, before[id(p)] - 0.1 * unscaled[id(p)], rtol=1e-6, atol=1e-7)
    for p, m in zip(masters.model_params, masters.masters):
        assert torch.equal(p, m.half())  # the model copy written by the same pass


@pytest.mark.parametrize("where", ["first", "last"])
def test_fused_step_skips_on_overflow_and_backs_off(where):
    model, opt, engine = sgd_engine(props("O2"))
    spy = KernelSpy(engine)
    masters = engine.masters(opt)
    snap = Snapshot(model, masters.masters, opt)
    x, y = make_batch()
    engine.backward(nn.functional.cross_entropy(model(x), y))
    params = list(model.parameters())
    target = params[0] if where == "first" else params[-1]
    target.grad.view(-1)[0 if where == "first" else -1] = float("inf")
    scale = engine.loss_scale
    assert not engine.step(opt)
    assert spy.count("check_finite") == 1 and spy.count("sgd_step") == 0
    snap.assert_unchanged(model, masters.masters, opt)
    assert engine.loss_scale == scale / 2 and engine.skipped_steps == 1


def test_static_scale_other_than_one_unscales_and_skips_inf():
    model, opt, engine = sgd_engine(props("O0", loss_scale=128.0))
    x, y = make_batch()
    ref = make_model()
    nn.functional.cross_entropy(ref(x), y).backward()
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.unscale_(opt)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)
    engine.zero_grad(opt)
    assert not _one_step(engine, model, opt, x, y, poison=True)
    assert engine.loss_scale == 128.0 and engine.skipped_steps == 1


# ---- clipping ------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_clip_grad_norm_exact_on_unscaled_fp32_grads(kernels):
    """O0 with a static scale: the norm of the unscaled gradients, and a step on clipped ones.
    torch's path rewrites the gradients; the kernels fold the coefficient into the fused step."""
    x, y = make_batch()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = total_norm(p.grad for p in ref.parameters())
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt.step()
    model, opt, engine = sgd_engine(props("O0", loss_scale=1024.0), kernels=kernels)
    engine.backward(nn.functional.cross_entropy(model(x), y))
    norm = engine.clip_grad_norm_(0.1)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    if kernels == "torch":
        clipped = total_norm(p.grad for p in engine.master_params(opt))
        assert clipped.item() == pytest.approx(0.1, rel=1e-4)
    assert engine.step(opt)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_clip_grad_norm_o2_clips_fp32_masters(kernels):
    x, y = make_batch()
    model, opt, engine = sgd_engine(props("O2"), kernels=kernels)
    engine.scaler.load_state_dict({"loss_scale": 1024.0})
    # fp32 reference with the same (fp16-rounded) weights
    ref = make_model()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters()):
            r.copy_(p.float())
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = total_norm(p.grad for p in ref.parameters())
    engine.backward(nn.functional.cross_entropy(model(x), y))
    # the unscaled gradients in fp32, before clipping
    masters = engine.masters(opt)
    unscaled = {
        id(m): p.grad.float() / 1024.0 for p, m in zip(masters.model_params, masters.masters)
    }
    unscaled.update(
        {id(p): p.grad / 1024.0 for p in engine.master_params(opt) if id(p) not in unscaled}
    )
    before = {id(p): p.detach().clone() for p in engine.master_params(opt)}
    norm = engine.clip_grad_norm_(0.05)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, ref_norm, rtol=2e-2, atol=0)  # fp16 forward: ~1e-3 apart
    torch.testing.assert_close(norm, total_norm(unscaled.values()), rtol=1e-5, atol=0)
    stepped = list(engine.master_params(opt))
    if kernels == "torch":
        assert all(p.grad.dtype == torch.float32 for p in stepped)
        clipped = total_norm(p.grad for p in stepped)
        assert clipped.item() == pytest.approx(0.05, rel=1e-3)
    assert engine.step(opt)
    coef = 0.05 / (norm.item() + 1e-6)
    for p in stepped:  # plain SGD: the update is lr times the clipped gradient
        torch.testing.assert_close(
            p, before[id(p)] - 0.1 * coef * unscaled[id(p)], rtol=1e-5, atol=1e-7
        )
    for p, m in zip(masters.model_params, masters.masters):
        assert torch.equal(p, m.half())


# ---- schedulers, state ---------------------------------------------------------------------
def test_lr_scheduler_created_before_prepare_drives_master_groups():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = AmpEngine(props("O2", cast_model_type="bfloat16"), CPU)
    engine.prepare(model, opt)
    masters = engine.masters(opt).masters
    x, y = make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            assert _one_step(engine, model, opt, x, y)
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert all(any(m is p for p in opt.param_groups[0]["params"]) for m in masters)
    after = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.1 * (e + 1))
    after.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.2)  # LambdaLR: initial_lr * f(1)


def test_state_dict_round_trip():
    """Apex's layout for the one loss (`loss_scaler0`) and the skipped-step count: the format
    every checkpoint was written in."""
    model, opt, engine = sgd_engine(props("O2", cast_model_type="bfloat16"))
    x, y = make_batch()
    _one_step(engine, model, opt, x, y, poison=True)
    _one_step(engine, model, opt, x, y)
    sd = engine.state_dict()
    assert list(sd) == ["loss_scaler0", "skipped_steps"]
    assert sd["skipped_steps"] == 1 and sd["loss_scaler0"]["loss_scale"] == 2.0**15
    assert sd["loss_scaler0"]["unskipped"] == 1
    fresh = AmpEngine(props("O2", cast_model_type="bfloat16"), CPU)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state_dict() == sd
    assert fresh.loss_scale == 2.0**15 and fresh.skipped_steps == 1


def test_backward_between_unscale_and_step_is_refused():
    model, opt, engine = sgd_engine(props("O0"))
    x, y = make_batch()
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="before step"):
        engine.backward(nn.functional.cross_entropy(model(x), y))


def test_one_optimizer_over_two_models_prepared_one_by_one():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    engine = AmpEngine(props("O2", cast_model_type="bfloat16"), CPU)
    engine.prepare(a, opt)
    engine.prepare(b, opt)
    assert all(p.dtype == torch.float32 for p in engine.master_params(opt))
    assert len(engine.masters(opt)) == 4
    before = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    engine.backward(b(a(torch.randn(3, 4))).square().mean())
    assert engine.step(opt)
    after = list((*a.parameters(), *b.parameters()))
    assert all(not torch.equal(x, y) for x, y in zip(before, after))
    assert all(p.dtype == torch.bfloat16 for p in after)
