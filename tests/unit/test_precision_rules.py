"""Findings about precision overrides, the device, the optimizer and the model's shapes; the loss
scaling knobs; strict mode; the refusal of `precision.opt_level` overrides.

Every rule takes a device *description* (`DeviceInfo`), so GPU rules are tested on any machine.
Each finding below has a test that fails when its rule is removed.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.config.levels import SCALER_DEFAULTS
from runner.errors import ConfigError
from runner.precision import Finding, checks, resolve
from runner.precision.checks import DeviceInfo, tensor_core_findings
from runner.precision.scaler import LossScaler
from runner.run.plan import check_opt_level, resolve_precision
from tests.helpers.images import write_image_folder
from tests.helpers.runs import compose_config

CPU = DeviceInfo("cpu", None, "test cpu")
PASCAL = DeviceInfo("cuda", (6, 1), "Tesla P100")
VOLTA = DeviceInfo("cuda", (7, 0), "Tesla V100")
TURING = DeviceInfo("cuda", (7, 5), "T4")
AMPERE = DeviceInfo("cuda", (8, 0), "A100")
ADAM = {"name": "adam", "eps": 1e-8}


def found(level: str, overrides: dict | None = None, **kw) -> list[tuple[str, str]]:
    return [(f.level, f.property) for f in resolve(level, overrides or {}, **kw).findings]


# ---- property combinations -------------------------------------------------------------------
def test_a_finding_says_its_hint_as_a_sentence_of_its_own():
    """A message and its hint read as two sentences (the refusal of a low-bit state with SGD
    read "... has no int8 implementation Hint: use ..."); a message with its own stop keeps it."""
    told = Finding(
        "error", "optimizer_state", "sgd has no int8 implementation", "use adam"
    ).describe()
    assert told == "sgd has no int8 implementation. Hint: use adam"
    assert (
        Finding("warning", "loss_scale", "too big.", "lower it").describe()
        == "too big. Hint: lower it"
    )
    assert Finding("info", "loss_scale", "fine").describe() == "fine"


def test_clean_presets_have_no_findings_without_a_device():
    for level in ("O0", "O1", "O2", "O3"):
        assert found(level) == [], level


def test_o1_master_weights_is_ignored_with_a_warning():
    r = resolve("O1", {"master_weights": True})
    assert [(f.level, f.property) for f in r.findings] == [("warning", "master_weights")]
    assert "fp32" in r.findings[0].message and "ignored" in r.findings[0].message


def test_o1_cast_model_type_half_warns_and_fp32_does_not():
    r = resolve("O1", {"cast_model_type": "float16"})
    assert ("warning", "cast_model_type") in [(f.level, f.property) for f in r.findings]
    text = str(r.findings[0])
    assert "Apex refused" in text and "precision=o2" in text
    assert "precision=o2_bf16" in str(resolve("O1", {"cast_model_type": "bf16"}).findings[0])
    assert found("O1", {"cast_model_type": "float32"}) == []
    assert found("O1", {"cast_model_type": None}) == []


@pytest.mark.parametrize("value", [True, False])
def test_o1_keep_batchnorm_fp32_set_warns(value):
    assert found("O1", {"keep_batchnorm_fp32": value}) == [("warning", "keep_batchnorm_fp32")]
    assert found("O1", {"keep_batchnorm_fp32": None}) == []


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_patch_torch_functions_outside_o1_warns(level):
    r = resolve(level, {"patch_torch_functions": True})
    f = [f for f in r.findings if f.property == "patch_torch_functions"]
    assert [x.level for x in f] == ["warning"]
    assert "Apex refused" in f[0].message and "precision=o1" in f[0].hint


@pytest.mark.parametrize("scale", ["dynamic", 128.0, 0.5])
def test_o0_loss_scaling_warns(scale):
    assert found("O0", {"loss_scale": scale}) == [("warning", "loss_scale")]


def test_o2_without_master_weights_warns_about_vanishing_updates():
    r = resolve("O2", {"master_weights": False})
    assert [(f.level, f.property) for f in r.findings] == [("warning", "master_weights")]
    assert "2^-11" in r.findings[0].message
    assert (
        "2^-8"
        in resolve(
            "O2", {"master_weights": False, "cast_model_type": "bfloat16", "loss_scale": 1.0}
        )
        .findings[0]
        .message
    )
    assert found("O3") == []  # pure 16 bit without masters is what O3 means


def test_the_2_to_minus_11_claim_holds_in_fp16():
    w = torch.tensor(1.0, dtype=torch.float16)
    assert (w + 2.0**-12) == w  # below half a spacing: the update vanishes
    assert (w + 2.0**-10) != w


def test_bf16_with_dynamic_scaling_is_an_info():
    assert found("O2", {"cast_model_type": "bfloat16"}) == [("info", "loss_scale")]
    assert found("O1", {"autocast_dtype": "bfloat16"}) == [("info", "loss_scale")]
    assert found("O1", {"autocast_dtype": "bfloat16", "loss_scale": 1.0}) == []
    assert found("O2") == []  # fp16 needs the scaling


def test_o3_keep_batchnorm_fp32_is_speed_of_light_info():
    r = resolve("O3", {"keep_batchnorm_fp32": True})
    assert [(f.level, f.property) for f in r.findings] == [("info", "keep_batchnorm_fp32")]
    assert "speed of light" in r.findings[0].message


# ---- hardware --------------------------------------------------------------------------------
def test_fp16_on_cpu_warns_emulated():
    assert found("O2", device=CPU) == [("warning", "cast_model_type")]
    assert found("O1", device=CPU) == [("warning", "patch_torch_functions")]
    assert "emulated" in resolve("O3", device=CPU).findings[0].message
    assert found("O2", {"cast_model_type": "bfloat16", "loss_scale": 1.0}, device=CPU) == []


SLOW_BF16_CPU = DeviceInfo("cpu", None, "AMD EPYC", bf16_matmul_ratio=21.0)


def test_bf16_on_a_cpu_that_computes_it_slowly_warns_to_use_o0():
    """An AVX2 AMD EPYC took 21x as long for a bf16 matrix product as for an fp32 one (and a
    bf16 ViT step 14x): a bf16 level trains slower than O0 there, whichever way it computes in
    bf16; fp32 levels and fp16 ones (their own warning) say nothing of it."""
    bf16 = {"cast_model_type": "bfloat16", "loss_scale": 1.0}
    (finding,) = resolve("O2", bf16, device=SLOW_BF16_CPU).findings
    assert (finding.level, finding.key) == ("warning", "precision.cast_model_type")
    assert "bfloat16 on AMD EPYC: a bfloat16 matrix product took 21x" in finding.message
    assert "slower than precision=o0" in finding.message and "AVX512_BF16" in finding.message
    assert "use precision=o0 for speed on this CPU" in finding.hint
    autocast = {"autocast_dtype": "bfloat16", "loss_scale": 1.0}
    assert found("O1", autocast, device=SLOW_BF16_CPU) == [("warning", "autocast_dtype")]
    assert found("O0", device=SLOW_BF16_CPU) == []
    assert found("O1", device=SLOW_BF16_CPU) == [("warning", "patch_torch_functions")]
    # strict refuses it, as every warning
    assert [f.level for f in resolve("O2", bf16, SLOW_BF16_CPU, strict=True).findings] == ["error"]
    # below the ratio, or not measured (a description without it): nothing
    for ratio in (0.6, 2.9, None):
        cpu = DeviceInfo("cpu", None, "a CPU", bf16_matmul_ratio=ratio)
        assert found("O2", bf16, device=cpu) == [], ratio


def test_the_cpu_s_bf16_speed_is_measured_only_where_a_level_computes_in_bf16(monkeypatch):
    """A run's description of its CPU measures nothing itself: the rule asks for the ratio only
    where the level computes in bf16 (an O0 or fp16 run pays no measurement), and a ratio given
    is never replaced by a measurement."""
    calls = []
    monkeypatch.setattr(checks, "cpu_bf16_matmul_ratio", lambda: calls.append(1) or 21.0)
    cpu = DeviceInfo.from_torch("cpu")
    assert cpu.measure_bf16 and cpu.bf16_matmul_ratio is None and calls == []
    assert found("O0", device=cpu) == [] and found("O2", device=cpu)[0][1] == "cast_model_type"
    assert calls == []  # O0, and O2's fp16 (its own warning): nothing measured
    bf16 = {"cast_model_type": "bfloat16", "loss_scale": 1.0}
    assert found("O2", bf16, device=cpu) == [("warning", "cast_model_type")] and calls == [1]
    given = DeviceInfo("cpu", None, "a CPU", bf16_matmul_ratio=0.6, measure_bf16=True)
    assert found("O2", bf16, device=given) == [] and calls == [1]


@pytest.mark.real_cpu_speed
def test_the_cpu_s_bf16_speed_is_measured_as_a_larger_product_finds_it(monkeypatch):
    """DeviceInfo.from_torch measures the CPU's bf16 matrix products against fp32's (128 x
    128); a larger product (256 x 256, timed here) puts this CPU on the same side of the warning's
    ratio wherever it is clearly on one side, and the warning is given exactly where the measured
    ratio reaches it. Both on one thread (on two, a busy machine stalls fp32's product: 0.1), and
    the measurement leaves torch's thread count as it found it."""
    import time

    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(256, 256).to(dtype), torch.randn(256, 256).to(dtype)
        torch.mm(a, b)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # whatever the suite's workers use: the measurement takes one
    try:
        device = DeviceInfo.from_torch("cpu")
        seen, mm = [], torch.mm
        monkeypatch.setattr(
            torch, "mm", lambda a, b: seen.append(torch.get_num_threads()) or mm(a, b)
        )
        checks.cpu_bf16_matmul_ratio.__wrapped__()  # (uncached)
        monkeypatch.setattr(torch, "mm", mm)
        assert set(seen) == {1} and len(seen) == 12 and torch.get_num_threads() == 2
        torch.set_num_threads(1)
        larger = best(torch.bfloat16) / best(torch.float32)
    finally:
        torch.set_num_threads(threads)
    measured = device.bf16_ratio()
    assert measured is not None and measured > 0
    assert DeviceInfo.from_torch("cpu").bf16_ratio() == measured  # once per process
    if larger > 2 * checks.BF16_SLOW_RATIO or larger < checks.BF16_SLOW_RATIO / 2:
        assert (measured >= checks.BF16_SLOW_RATIO) == (larger >= checks.BF16_SLOW_RATIO), (
            measured,
            larger,
        )
    warned = found("O2", {"cast_model_type": "bfloat16", "loss_scale": 1.0}, device="cpu")
    assert warned == (
        [("warning", "cast_model_type")] if measured >= checks.BF16_SLOW_RATIO else []
    )


def test_fp16_below_volta_warns_memory_only():
    r = resolve("O2", device=PASCAL)
    assert [(f.level, f.property) for f in r.findings] == [("warning", "cast_model_type")]
    assert "Tensor Cores" in r.findings[0].message and "memory" in r.findings[0].message
    assert "6.1" in r.findings[0].message
    assert found("O1", device=PASCAL) == [("warning", "autocast_dtype")]
    assert found("O2", device=VOLTA) == []
    assert found("O0", device=PASCAL) == []


def test_bf16_below_ampere_is_an_error():
    bf16 = {"cast_model_type": "bfloat16", "loss_scale": 1.0}
    r = resolve("O2", bf16, device=TURING)
    assert [(f.level, f.property) for f in r.findings] == [("error", "cast_model_type")]
    assert "8.0" in r.findings[0].message
    assert found("O1", {"autocast_dtype": "bf16", "loss_scale": 1.0}, device=VOLTA) == [
        ("error", "autocast_dtype")
    ]
    assert found("O2", bf16, device=AMPERE) == []
    assert found("O2", bf16, device=DeviceInfo("cuda", None, "unknown")) == []


def test_device_may_be_a_torch_device_a_string_or_a_description():
    described = found("O2", device=DeviceInfo.from_torch("cpu"))
    assert described == found("O2", device="cpu") == found("O2", device=torch.device("cpu"))
    assert described == [("warning", "cast_model_type")]
    info = DeviceInfo.from_torch(torch.device("cpu"))
    assert info.type == "cpu" and info.capability is None and info.name


# ---- optimizer epsilon -----------------------------------------------------------------------
def test_adam_eps_that_underflows_in_fp16_state_is_an_error_with_the_fix():
    r = resolve("O3", optimizer=ADAM)
    errors = [f for f in r.findings if f.level == "error"]
    assert [f.property for f in errors] == ["optimizer.eps"]
    assert errors[0].key == "optimizer.eps"
    assert "underflows to 0 in float16" in errors[0].message
    assert "optimizer.eps=1e-4" in errors[0].hint
    adamw = {"name": "adamw", "eps": 1e-8}
    assert ("error", "optimizer.eps") in found("O2", {"master_weights": False}, optimizer=adamw)


def test_adam_eps_is_fine_with_fp32_state_or_bf16_or_sgd():
    assert found("O2", optimizer=ADAM) == []  # fp32 masters hold the state
    assert found("O1", optimizer=ADAM) == []
    assert found("O3", {"cast_model_type": "bfloat16"}, optimizer=ADAM) == []  # 1e-8 fits bf16
    assert found("O3", optimizer={"name": "adam", "eps": 1e-4}) == []
    assert found("O3", optimizer={"name": "sgd", "lr": 0.1}) == []


def test_adam_eps_subnormal_in_fp16_warns():
    r = resolve("O3", optimizer={"name": "adam", "eps": 1e-7})
    assert [(f.level, f.property) for f in r.findings] == [("warning", "optimizer.eps")]
    assert "subnormal" in r.findings[0].message


def _adam_step_fp16(eps: float) -> torch.Tensor:
    w = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.Adam([w], lr=1e-3, eps=eps, foreach=False)
    w.grad = torch.full_like(w, 1e-5)  # its square (1e-10) underflows in fp16
    opt.step()
    return w.detach()


def test_the_underflow_claim_holds_for_a_real_adam_step():
    """What the error prevents: fp16 Adam with eps=1e-8 turns weights non-finite at once."""
    assert not torch.isfinite(_adam_step_fp16(1e-8)).all()
    assert torch.isfinite(_adam_step_fp16(1e-4)).all()


def test_app_passes_the_optimizer_config_and_stops_on_the_eps_error():
    cfg = compose_config("precision=o3", "optimizer=adam")
    with pytest.raises(ConfigError) as e:
        resolve_precision(cfg, DeviceInfo("cuda", (9, 0), "H100"))
    assert e.value.key == "optimizer.eps" and "optimizer.eps=1e-4" in str(e.value)
    resolve_precision(
        compose_config("precision=o3", "optimizer=adam", "optimizer.eps=1e-4"),
        DeviceInfo("cuda", (9, 0), "H100"),
    )


# ---- Tensor Core shapes ----------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self, widths=(3, 16, 16), classes: int = 10):
        super().__init__()
        self.convs = nn.Sequential(*[nn.Conv2d(a, b, 3) for a, b in zip(widths, widths[1:])])
        self.fc = nn.Linear(widths[-1], classes)


def test_tensor_core_shapes_one_info_naming_the_layers():
    p = resolve("O2").properties
    out = tensor_core_findings(Net(classes=10), 30, p, AMPERE)
    assert [(f.level, f.property) for f in out] == [("info", "model")]
    msg = out[0].message
    assert "1 of 3" in msg and "fc (out_features 10)" in msg and "batch size 30" in msg
    assert "convs.0" not in msg  # 3 input channels (an image): cuDNN pads them


def test_tensor_core_shapes_list_every_layer_of_every_convolution_kind():
    p = resolve("O1").properties
    model = Net(widths=(3, 12, 20, 28, 36, 44), classes=5)
    model.extra = nn.ModuleList(
        [nn.Conv1d(1, 6, 3), nn.ConvTranspose2d(16, 16, 2), nn.Conv3d(8, 12, 1)]
    )
    out = tensor_core_findings(model, 64, p, AMPERE)
    assert len(out) == 1 and "batch size" not in out[0].message
    msg = out[0].message
    assert "8 of 9" in msg  # all but the aligned transposed conv
    for name in (
        "convs.0",
        "convs.4",
        "fc",
        "extra.0 (out_channels 6)",
        "extra.2 (out_channels 12)",
    ):
        assert name in msg
    assert "extra.1" not in msg and "extra.0 (in_channels" not in msg


def test_tensor_core_shapes_silent_when_aligned_or_not_applicable():
    p = resolve("O2").properties
    assert tensor_core_findings(Net(classes=16), 32, p, AMPERE) == []
    assert tensor_core_findings(Net(classes=10), 30, p, CPU) == []
    assert tensor_core_findings(Net(classes=10), 30, resolve("O0").properties, AMPERE) == []
    only_batch = tensor_core_findings(Net(classes=16), 30, p, AMPERE)
    assert [(f.level, f.property) for f in only_batch] == [("info", "trainer.batch_size")]


def test_dry_run_shape_findings_come_from_a_meta_model(tmp_path):
    """A dry run has no data and builds no weights: the model is built on the meta device, its
    head sized from the data config (CIFAR-100: 100 classes; an ImageFolder: its class folders)."""
    from runner.run import build, plan

    cfg = compose_config(  # (on a CPU, planned for its shapes alone: fp16's time is no matter)
        "model=resnet50",
        "precision=o2",
        "data=cifar100",
        "trainer.batch_size=128",
        "trainer.allow_slow_fp16=true",
    )
    p = plan.check_config(cfg).resolution.properties
    (finding,) = build.shape_findings(cfg, p, AMPERE)
    assert "fc (out_features 100)" in finding.message and "batch size" not in finding.message
    assert build.shape_findings(cfg, p, CPU) == []  # not a CUDA device: nothing built at all
    write_image_folder(tmp_path, classes=("a", "b", "c"), per_class={"train": 1, "val": 1}, size=8)
    folder = compose_config(
        "model=tiny",
        "precision=o2_bf16",
        "data=imagefolder",
        f"data.root={tmp_path}",
        "trainer.batch_size=64",
    )
    (finding,) = build.shape_findings(
        folder, plan.check_config(folder).resolution.properties, AMPERE
    )
    assert "out_features 3" in finding.message


# ---- strict mode -----------------------------------------------------------------------------
def test_strict_turns_warnings_into_errors_and_keeps_infos():
    r = resolve("O2", {"strict": True, "master_weights": False}, device=CPU)
    assert {f.level for f in r.findings} == {"error"}
    assert all("precision.strict=true" in f.hint for f in r.findings)
    r = resolve("O3", {"keep_batchnorm_fp32": True}, strict=True)
    assert [f.level for f in r.findings] == ["info"]
    assert resolve("O2", {"strict": "false"}, device=CPU).warnings


def test_strict_stops_the_app_before_anything_is_built():
    cfg = compose_config("precision=o2", "precision.strict=true")
    with pytest.raises(ConfigError) as e:
        resolve_precision(cfg, torch.device("cpu"))
    assert e.value.key == "precision.cast_model_type" and "strict" in str(e.value)
    resolve_precision(
        compose_config("precision=o2_bf16", "precision.strict=true"), torch.device("cpu")
    )


def test_finding_keys_and_summaries():
    assert Finding("warning", "loss_scale", "m").key == "precision.loss_scale"
    assert Finding("error", "optimizer.eps", "m").key == "optimizer.eps"
    assert str(Finding("info", "model", "m", "h")) == "[info] model: m (h)"
    r = resolve("O2", {"master_weights": False}, device=CPU, optimizer=ADAM)
    assert r.summary() == "1 error, 2 warning, 0 info"
    assert r.compact().split("; ") == [
        "warning precision.master_weights",
        "warning precision.cast_model_type",
        "error optimizer.eps",
    ]
    assert "optimizer.eps" in r.findings_table()


# ---- loss scaling knobs ----------------------------------------------------------------------
def test_scaler_knobs_resolve_with_defaults_and_overrides():
    p = resolve("O2").properties
    assert {k: getattr(p, k) for k in SCALER_DEFAULTS} == dict(
        init_scale=65536.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        hysteresis=1,
        min_loss_scale=None,
        max_loss_scale=16777216.0,
    )
    p = resolve(
        "O2",
        {"hysteresis": "2", "init_scale": 1024, "min_loss_scale": "null", "growth_interval": 10.0},
    ).properties
    got = (p.hysteresis, p.init_scale, p.min_loss_scale, p.growth_interval)
    assert got == (2, 1024.0, None, 10)
    assert p.as_params()["hysteresis"] == "2" and "max_loss_scale" in p.table()


@pytest.mark.parametrize(
    "key,value",
    [
        ("init_scale", 0),
        ("init_scale", "inf"),
        ("growth_factor", 1.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", 0),
        ("growth_interval", 0),
        ("growth_interval", 2.5),
        ("hysteresis", 0),
        ("hysteresis", "two"),
        ("min_loss_scale", -1),
        ("max_loss_scale", None),
    ],
)
def test_bad_scaler_knobs_name_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        resolve("O2", {key: value})
    assert e.value.key == f"precision.{key}" and e.value.allowed


def test_min_above_max_loss_scale_is_refused():
    with pytest.raises(ConfigError, match="precision.min_loss_scale"):
        resolve("O2", {"min_loss_scale": 2.0**10, "max_loss_scale": 2.0**5})


def test_scaler_from_properties_uses_every_knob():
    p = resolve(
        "O2",
        {
            "init_scale": 8,
            "growth_factor": 4,
            "backoff_factor": 0.25,
            "growth_interval": 3,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "max_loss_scale": 64,
        },
    ).properties
    s = LossScaler.from_properties(p)
    assert (
        s.dynamic,
        s.scale,
        s.growth_factor,
        s.backoff_factor,
        s.growth_interval,
        s.hysteresis,
        s.min_loss_scale,
        s.max_loss_scale,
    ) == (True, 8.0, 4.0, 0.25, 3, 2, 1.0, 64.0)
    assert LossScaler.from_properties(p, max_loss_scale=16.0).max_loss_scale == 16.0
    static = LossScaler.from_properties(resolve("O3", {"loss_scale": 128}).properties)
    assert not static.dynamic and static.scale == 128.0
    # the old constructor call still works
    assert LossScaler("dynamic", min_loss_scale=None, max_loss_scale=2.0**24).hysteresis == 1


def test_hysteresis_backs_off_only_when_the_counter_is_spent():
    s = LossScaler("dynamic", init_scale=64.0, growth_interval=3, hysteresis=3)
    s.update(True)
    s.update(True)
    assert s.scale == 64.0 and s.hysteresis_left == 1  # two overflows tolerated
    s.update(False)  # a clean step does not refill the counter (DeepSpeed's default)
    s.update(True)
    assert s.scale == 32.0 and s.hysteresis_left == 0
    s.update(True)
    assert s.scale == 16.0  # spent: every further overflow backs off...
    for _ in range(3):
        s.update(False)
    assert s.scale == 32.0 and s.hysteresis_left == 3  # ...until the scale grows again
    s.update(True)
    assert s.scale == 32.0


def test_hysteresis_one_is_apex():
    s = LossScaler("dynamic", init_scale=64.0)
    s.update(True)
    assert s.scale == 32.0
    s.update(False)
    s.update(True)
    assert s.scale == 16.0


def test_scaler_state_dict_round_trips_bit_for_bit():
    s = LossScaler(
        "dynamic",
        init_scale=3.0 * 2.0**-7,
        growth_factor=1.1,
        backoff_factor=0.3,
        growth_interval=5,
        hysteresis=3,
    )
    for flag in (True, False, False, True, True, False, False, False, False, False, True):
        s.update(flag)
    sd = s.state_dict()
    assert set(sd) == {"loss_scale", "unskipped", "hysteresis_tracker"}
    t = LossScaler(
        "dynamic", growth_factor=1.1, backoff_factor=0.3, growth_interval=5, hysteresis=3
    )
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert math.copysign(1, t.scale) == 1 and t.scale.hex() == s.scale.hex()
    for flag in (False, True, True, False):  # and they stay in lockstep
        s.update(flag), t.update(flag)
        assert t.state_dict() == s.state_dict()
    old = LossScaler("dynamic", hysteresis=2)
    old.load_state_dict({"loss_scale": 8.0, "unskipped": 1})  # an Apex checkpoint
    assert old.hysteresis_left == 2 and old.scale == 8.0


def test_static_scale_other_than_one_still_detects_and_flags():
    s = LossScaler.from_properties(resolve("O3", {"loss_scale": 4.0}).properties)
    assert s.needs_check
    assert s.unscale_([torch.tensor([float("inf")])]).item() != 0
    s.update(True)
    assert s.scale == 4.0


# ---- precision.opt_level: the level is a preset -----------------------------------------------
@pytest.mark.parametrize(
    "overrides,instead",
    [
        (["precision.opt_level=O2"], "use precision=o2"),
        (["precision=o1", "precision.opt_level=o3"], "use precision=o3"),
        (["precision=o1_bf16", "precision.opt_level=O2"], "use precision=o2_bf16"),
        (["precision=o2", "++precision.opt_level=O0"], "use precision=o0"),
    ],
)
def test_opt_level_override_is_refused_naming_the_preset(overrides, instead):
    with pytest.raises(ConfigError) as e:
        check_opt_level(compose_config(*overrides))
    assert e.value.key == "precision.opt_level"
    assert instead in str(e.value) and "precision=o2_bf16" in e.value.allowed


def test_opt_level_override_equal_to_the_preset_is_harmless():
    check_opt_level(compose_config("precision=o2", "precision.opt_level=O2"))
    check_opt_level(compose_config("precision.opt_level=O0"))  # the default preset is o0
    check_opt_level(compose_config("precision=o2", "precision.loss_scale=128"))
    check_opt_level(compose_config("precision=o3_bf16", "precision.opt_level=o3"))


def test_opt_level_zero_prefix_keeps_the_letter_o_hint():
    with pytest.raises(ConfigError, match="letter O"):
        check_opt_level(compose_config("precision=o2", "precision.opt_level=02"))
    with pytest.raises(ConfigError, match="letter O"):
        resolve("02")


def test_opt_level_is_checked_from_the_config_not_the_command_line():
    """A config whose level contradicts its preset is refused however it got there: here an
    app.run call that passes no override strings at all."""
    from runner.run.plan import make_plan

    cfg = compose_config("precision=o3", "precision.opt_level=O1")
    with pytest.raises(ConfigError, match="use precision=o1"):
        make_plan(cfg)
    cfg = compose_config("precision=o3", "precision.opt_level=???")  # (deletion is refused)
    with pytest.raises(ConfigError, match="choose the level with precision=<preset>"):
        make_plan(cfg)


def test_app_run_refuses_the_opt_level_override(tmp_path):
    from runner.run import app

    overrides = ["precision=o0", "precision.opt_level=O2"]
    uri = f"sqlite:///{tmp_path / 'never.db'}"
    cfg = compose_config(*overrides, f"mlflow.tracking_uri={uri}", "dry_run=true")
    assert OmegaConf.select(cfg, "precision.opt_level") == "O2"  # Hydra itself accepts it
    with pytest.raises(ConfigError, match="use precision=o2"):
        app.run(cfg, overrides=overrides)
    assert not (tmp_path / "never.db").exists()
