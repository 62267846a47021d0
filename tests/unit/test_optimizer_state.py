"""precision.optimizer_state: the optimizer's state in float32, bfloat16, float16 (the
engine's fp32 step, state stored back rounded) or in int8, int4, fp8 (torchao's blockwise
quantised Adam/AdamW): parsing and defaults, findings, memory counted from the real storages,
numerics against a float64 reference, training, checkpoints and resume.

torchao compiles its update with torch.compile (tens of seconds per parameter shape on a CPU,
cached on disk); the tests that train in this process run its update eagerly (`eager_low_bit`),
one end-to-end test runs it compiled as a user does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchao.optim  # noqa: F401  (the low-bit optimizers: a [dev] dependency)
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from torch import nn

from runner.config.precision import run_name_suffixes
from runner.errors import ConfigError
from runner.measure.memory import measure, plain_tensors
from runner.precision import AmpEngine, resolve, state
from runner.precision.checks import DeviceInfo, state_findings
from runner.precision.properties import resolve_properties
from runner.run import app, checkpoint
from tests.helpers.runs import FAST, compose_config, run_cli

ADAMW = dict(name="adamw", lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.01, amsgrad=False)


@pytest.fixture
def eager_low_bit(monkeypatch):
    """torchao's update run eagerly, uncompiled (the numerics are torchao's own; compiling fuses
    them), so that a test does not wait for torch.compile."""
    import torchao.optim.adam as adam

    monkeypatch.setattr(adam.torch, "compile", lambda fn, **kwargs: fn)


# ---- the property ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spelling,parsed",
    [
        ("int8", "int8"),
        ("INT4", "int4"),
        ("e4m3", "fp8"),
        ("fp8", "fp8"),
        ("bf16", "bfloat16"),
        ("fp32", "float32"),
        (torch.bfloat16, "bfloat16"),
        ("half", "float16"),
    ],
)
def test_every_spelling_parses_to_one_format(spelling, parsed):
    props, _ = resolve_properties("O2", {"optimizer_state": spelling})
    assert props.optimizer_state == parsed


def test_a_format_that_does_not_exist_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as e:
        resolve_properties("O2", {"optimizer_state": "int3"})
    assert e.value.key == "precision.optimizer_state"
    assert "int8" in str(e.value) and "fp8" in str(e.value)


@pytest.mark.parametrize(
    "level,overrides,fmt",
    [
        ("O0", {}, "float32"),
        ("O1", {}, "float32"),
        ("O2", {}, "float32"),
        ("O3", {}, "float16"),
        ("O3", {"cast_model_type": "bfloat16", "stochastic_rounding": True}, "bfloat16"),
        ("O2", {"master_weights": False}, "float16"),
    ],
)
def test_unset_the_state_follows_the_stepped_weights_as_torch_keeps_it(level, overrides, fmt):
    props, _ = resolve_properties(level, overrides)
    assert props.optimizer_state == fmt  # the param names the format
    assert props.as_params()["optimizer_state"] == fmt
    assert not [s for s in run_name_suffixes(props.as_params()) if s.endswith("state")]


def test_the_run_name_says_a_state_other_than_the_weights():
    props, _ = resolve_properties("O2", {"cast_model_type": "bf16", "optimizer_state": "int8"})
    assert run_name_suffixes(props.as_params()) == ["bf16", "int8state"]
    props, _ = resolve_properties("O3", {"optimizer_state": "float32"})
    assert run_name_suffixes(props.as_params()) == ["fp32state"]


def test_the_report_says_a_state_format_other_than_the_weights():
    from runner.report.analysis import describe_dtype

    assert (
        describe_dtype(compose_config("precision=o2_bf16_int8state").precision)
        == "bfloat16 (fp32 BatchNorm, fp32 master weights), int8 optimizer state"
    )
    assert (
        describe_dtype(compose_config("precision=o3_bf16_sr_int8state").precision)
        == "bfloat16 (stochastic rounding), int8 optimizer state"
    )
    params = {"opt_level": "O3", "cast_model_type": "float16", "master_weights": "False"}
    assert describe_dtype({**params, "optimizer_state": "float16"}) == "float16"
    assert (
        describe_dtype({**params, "optimizer_state": "float32"})
        == "float16, float32 optimizer state"
    )


# ---- findings -------------------------------------------------------------------------------
def _findings(level, overrides, device=None, optimizer=ADAMW):
    return resolve(level, overrides, device, optimizer=optimizer).findings


def test_low_bit_state_of_sgd_is_an_error_naming_the_key():
    sgd = dict(name="sgd", lr=0.1, momentum=0.9)
    errors = [
        f for f in _findings("O2", {"optimizer_state": "int8"}, optimizer=sgd) if f.level == "error"
    ]
    assert len(errors) == 1 and errors[0].key == "precision.optimizer_state"
    assert "optimizer.name=sgd" in errors[0].message
    assert "bfloat16" in errors[0].hint  # what does work for SGD
    assert not [
        f for f in _findings("O2", {"optimizer_state": "bf16"}, optimizer=sgd) if f.level == "error"
    ]


@pytest.mark.parametrize("capability,error", [((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_state_needs_a_gpu_that_converts_to_fp8(capability, error):
    found = _findings(
        "O2",
        {"optimizer_state": "fp8", "cast_model_type": "bf16"},
        DeviceInfo("cuda", capability, "GPU"),
    )
    errors = [f for f in found if f.level == "error" and f.key == "precision.optimizer_state"]
    assert bool(errors) == error
    if error:
        assert "int8" in errors[0].hint
    # int8 state has no such limit
    assert not [
        f
        for f in _findings(
            "O2",
            {"optimizer_state": "int8", "cast_model_type": "bf16"},
            DeviceInfo("cuda", capability, "GPU"),
        )
        if f.level == "error"
    ]


def test_fp16_state_of_fp32_weights_warns_of_the_second_moment_underflow():
    found = [
        f
        for f in _findings("O2", {"optimizer_state": "float16"})
        if f.key == "precision.optimizer_state"
    ]
    assert [f.level for f in found] == ["warning"]
    assert "underflows" in found[0].message and "eps=1e-08" in found[0].message
    # O3's own fp16 state is the eps rule's (optimizer.eps), not this one
    assert not [f for f in _findings("O3", {}) if f.key == "precision.optimizer_state"]
    assert [f.key for f in _findings("O3", {}) if f.level == "error"] == ["optimizer.eps"]
    # fp32 state at O3 computes sqrt(v) + eps in fp32: the eps rule no longer applies
    assert not [f for f in _findings("O3", {"optimizer_state": "float32"}) if f.level == "error"]


def test_bf16_state_rounded_to_nearest_warns_that_adams_second_moment_cannot_decay():
    """The warning's claim, measured: v = 0.999 v + 0.001 g^2 with g^2 ~ U(0, 0.2) from v = 1,
    3000 steps: fp32 decays to ~0.14, bf16 rounded to nearest stays at 1, bf16 rounded
    stochastically follows fp32."""
    from runner.precision.rounding import stochastic_round

    gen = torch.Generator().manual_seed(0)
    v32, v16, vsr = (
        torch.ones(4096),
        torch.ones(4096, dtype=torch.bfloat16),
        torch.ones(4096, dtype=torch.bfloat16),
    )
    for t in range(3000):
        g2 = torch.rand(4096, generator=gen) * 0.2
        v32 = 0.999 * v32 + 0.001 * g2
        v16 = (0.999 * v16.float() + 0.001 * g2).bfloat16()
        vsr = stochastic_round(0.999 * vsr.float() + 0.001 * g2, 0, t, 0)
    assert abs(v32.mean().item() - 0.145) < 0.01 and v16.float().min().item() == 1.0
    assert abs(vsr.float().mean().item() - v32.mean().item()) < 0.005
    bf16 = {"cast_model_type": "bf16", "optimizer_state": "bfloat16"}
    (warning,) = [f for f in _findings("O2", bf16) if f.key == "precision.optimizer_state"]
    assert warning.level == "warning" and "never decay" in warning.message
    assert "o3_bf16_sr" in warning.hint
    # torch's own bf16 step (o3_bf16) has it too; a rounded one and a smaller beta2 do not
    assert [f.key for f in _findings("O3", {"cast_model_type": "bf16"})] == [
        "precision.optimizer_state"
    ]
    assert not _findings("O3", {"cast_model_type": "bf16", "stochastic_rounding": True})
    assert not [
        f
        for f in _findings("O2", bf16, optimizer={**ADAMW, "betas": [0.9, 0.99]})
        if f.key == "precision.optimizer_state"
    ]


def test_small_tensors_keeping_plain_state_are_listed():
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 10), nn.Linear(10, 300))
    props, _ = resolve_properties("O2", {"cast_model_type": "bf16", "optimizer_state": "int8"})
    (finding,) = state_findings(model, props)
    # 0.bias 512 (< 4096), 1.weight 5120 (quantised: >= 4096, 20 blocks of 256), 1.bias 10,
    # 2.weight 3000 (< 4096), 2.bias 300
    assert finding.level == "info" and finding.key == "precision.optimizer_state"
    assert finding.message.startswith("4 of 6 parameter tensors")
    for name in ("0.bias (512)", "1.bias (10)", "2.weight (3000)", "2.bias (300)"):
        assert name in finding.message
    assert "0.weight" not in finding.message and "1.weight" not in finding.message
    none, _ = resolve_properties("O2", {"optimizer_state": "bfloat16"})
    assert state_findings(model, none) == []


def test_a_dry_run_lists_the_tensors_that_keep_plain_state_and_what_fused_kernels_do(capsys):
    """The model built on the meta device tells a dry run what build would tell; with
    precision.kernels=fused an info finding says the update is torchao's, not a kernel."""
    app.run(
        compose_config(
            *FAST,
            "precision=o2_bf16_int8state",
            "optimizer=adamw",
            "precision.kernels=fused",
            "dry_run=true",
        )
    )
    out = capsys.readouterr().out
    assert "precision.optimizer_state" in out and "keep float32 state, not int8" in out
    assert "0.0.weight (432)" in out  # the first conv: 16 x 3 x 3 x 3 elements
    assert "precision.kernels" in out and "torchao's low-bit optimizer's own compiled step" in out
    app.run(compose_config(*FAST, "precision=o2_bf16", "dry_run=true"))
    assert "keep float32 state" not in capsys.readouterr().out


# ---- memory: the real bytes -------------------------------------------------------------------
# torchao's quantisation map, one per quantised moment: 2^bits fp32 values (fp8 needs none)
QMAP_BYTES = {"int8": 256 * 4, "int4": 16 * 4, "fp8": 0}
CODE_BITS = {"int8": 8, "int4": 4, "fp8": 8}


def _stepped(fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 10))
    if fmt == "float32":
        optimizer = torch.optim.AdamW(model.parameters())
    else:
        optimizer = state.build_low_bit(OmegaConf.create(ADAMW), list(model.parameters()), fmt)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_memory_by_kind_counts_codes_scales_and_maps_exactly(fmt, eager_low_bit):
    model, optimizer = _stepped(fmt)
    block = state.BLOCK_SIZES[fmt]
    expected = 4 * len(list(model.parameters()))  # the step counters
    for p in model.parameters():
        if p.numel() >= state.MIN_QUANTISED_NUMEL and p.numel() % block == 0:
            expected += 2 * (
                p.numel() * CODE_BITS[fmt] // 8 + p.numel() // block * 4 + QMAP_BYTES[fmt]
            )
        else:
            expected += 2 * p.numel() * 4  # plain fp32 moments
    assert measure(model, optimizer).optimizer_state == expected
    inner = plain_tensors(optimizer.state[model[0].weight]["exp_avg"])
    assert all(type(t) is torch.Tensor for t in inner) and len(inner) >= 2
    fp32 = measure(*_stepped("float32")).optimizer_state
    ratio = expected / fp32
    assert ratio <= {"int8": 0.3, "int4": 0.2, "fp8": 0.3}[fmt], ratio


# ---- numerics: bf16 state against a float64 reference ------------------------------------------
def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def test_bf16_state_matches_a_float64_adamw_whose_moments_are_stored_in_bf16():
    """The engine's fp32 step with bf16 state (O2 bf16, fp32 masters): each step computes in fp32
    with the moments loaded from bf16, and stores them rounded to nearest. The float64 reference
    does the same in float64. Tolerances: the moments within one bf16 spacing (2^-8 to 2^-7 of
    the value: fp32's arithmetic may round a value near a midpoint the other way); the masters
    within 2e-6 absolute after 12 steps at lr 1e-3 for 99% of the elements, and within 5e-5 for
    all (where a moment came out one spacing off, that step's update, up to ~3 lr for Adam's
    default betas, moves by 2^-7 of itself)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    # the masters start from the model cast to bf16 (Apex O2's order: cast, then copy)
    start = {k: v.to(torch.bfloat16).double() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    props, _ = resolve_properties(
        "O2", {"cast_model_type": "bf16", "loss_scale": 1.0, "optimizer_state": "bfloat16"}
    )
    engine = AmpEngine(props, torch.device("cpu"), kernels="torch")
    model, optimizer = engine.prepare(model, optimizer)
    masters = engine.masters(optimizer)
    names = [n for n, _ in model.named_parameters()]
    ref_p = [start[n] for n in names]
    ref_m = [torch.zeros_like(p) for p in ref_p]
    ref_v = [torch.zeros_like(p) for p in ref_p]
    b1, b2, lr, wd, eps = 0.9, 0.999, 1e-3, 0.01, 1e-8
    for step in range(1, 13):
        x = torch.randn(16, 32, dtype=torch.bfloat16)
        engine.zero_grad(optimizer)
        with engine.autocast():
            loss = model(x).float().square().mean()
        engine.backward(loss)
        grads = [p.grad.double() for p in model.parameters()]  # the bf16 gradients stepped
        engine.step(optimizer)
        for i, g in enumerate(grads):
            ref_p[i] = ref_p[i] * (1 - lr * wd)
            m = b1 * ref_m[i] + (1 - b1) * g
            v = b2 * ref_v[i] + (1 - b2) * g * g
            denom = (v / (1 - b2**step)).sqrt() + eps
            ref_p[i] = ref_p[i] - lr * (m / (1 - b1**step)) / denom
            ref_m[i], ref_v[i] = _bf16(m), _bf16(v)  # stored in bf16 for the next step
    for i, master in enumerate(masters.masters):
        st = optimizer.state[master]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert master.dtype == torch.float32
        torch.testing.assert_close(st["exp_avg"].double(), ref_m[i], rtol=2**-7, atol=1e-12)
        torch.testing.assert_close(st["exp_avg_sq"].double(), ref_v[i], rtol=2**-7, atol=1e-15)
        off = (master.double() - ref_p[i]).abs()
        assert off.max() <= 5e-5 and (off > 2e-6).double().mean() <= 0.01, off.max()


def test_the_kernels_step_bf16_state_as_torchs_ops_do(monkeypatch):
    """O2 bf16 with bf16 state on the fused path (the C++ kernels: one pass over gradient,
    master, both moments and the bf16 model copy) and on torch's ops (`float_state_step`), from
    the same weights and batches: the masters agree to fp32's rounding (rtol 1e-5) but for
    rare elements whose moment came out one bf16 spacing apart (an fp32 difference near a
    midpoint: that update, at most ~3 lr, moves by 2^-7 of itself); the moments are equal or
    one spacing apart."""
    from runner.precision import fused

    calls = []
    real_apply = fused.apply
    monkeypatch.setattr(fused, "apply", lambda *a, **k: calls.append(1) or real_apply(*a, **k))
    results = {}
    for kernels in ("fused", "torch"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        props, _ = resolve_properties(
            "O2", {"cast_model_type": "bf16", "loss_scale": 1.0, "optimizer_state": "bfloat16"}
        )
        engine = AmpEngine(props, torch.device("cpu"), kernels=kernels)
        model, optimizer = engine.prepare(model, optimizer)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            engine.zero_grad(optimizer)
            x = torch.randn(32, 64, generator=gen).bfloat16()
            engine.backward(model(x).float().logsumexp(1).mean())
            engine.step(optimizer)
        masters = engine.masters(optimizer).masters
        results[kernels] = (
            [m.detach().clone() for m in masters],
            [optimizer.state[m][k].clone() for m in masters for k in ("exp_avg", "exp_avg_sq")],
        )
    assert len(calls) == 5  # every step of the fused run went through the kernels
    (pa, sa), (pb, sb) = results["fused"], results["torch"]
    for a, b in zip(pa, pb):  # (a moment one spacing apart moves that update by 2^-7 of it)
        off = (a - b).abs()
        assert (
            off.max() <= 3e-3 * 2**-7 and (off > 1e-5 * b.abs() + 1e-8).double().mean() <= 0.001
        ), off.max()
    for a, b in zip(sa, sb):
        assert a.dtype == b.dtype == torch.bfloat16
        a64, b64 = a.double(), b.double()
        spacing = torch.maximum(a64.abs(), b64.abs()) * 2.0**-7 + 1e-30
        assert torch.all((a64 - b64).abs() <= spacing)
        assert (a64 != b64).double().mean() < 0.01


def test_fp32_state_of_stochastically_rounded_bf16_weights_stays_fp32():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    optimizer = torch.optim.Adam(model.parameters())
    props, _ = resolve_properties(
        "O3", {"cast_model_type": "bf16", "stochastic_rounding": True, "optimizer_state": "float32"}
    )
    engine = AmpEngine(props, torch.device("cpu"), kernels="torch")
    model, optimizer = engine.prepare(model, optimizer)
    for _ in range(2):
        engine.zero_grad(optimizer)
        engine.backward(model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum())
        engine.step(optimizer)
    assert model.weight.dtype == torch.bfloat16
    assert {optimizer.state[p]["exp_avg"].dtype for p in model.parameters()} == {torch.float32}


# ---- training, end to end ---------------------------------------------------------------------
def _store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _train(tmp_path: Path, name: str, *overrides: str) -> dict:
    app.run(
        compose_config(
            *FAST,
            "optimizer=adamw",
            f"mlflow.tracking_uri={_store(tmp_path)}",
            f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
            f"mlflow.run_name={name}",
            "precision.kernels=torch",
            *overrides,
        )
    )
    client = MlflowClient(_store(tmp_path))
    run = client.search_runs(
        [client.get_experiment_by_name("amp-runner").experiment_id],
        filter_string=f"attributes.run_name = '{name}'",
    )[0]
    return {
        "run": run,
        "losses": [m.value for m in client.get_metric_history(run.info.run_id, "train_loss")],
    }


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "vit_tiny"])
def test_each_format_trains_at_o2_bf16_and_its_state_shrinks(tmp_path, model, eager_low_bit):
    image = (
        ["data.image_size=16", "model.patch_size=4", "trainer.max_epochs=1"]
        if model == "vit_tiny"
        else []
    )
    base = _train(tmp_path, "fp32", f"model={model}", *image, "precision=o2_bf16")
    fp32_mb = float(base["run"].data.metrics["mem_optimizer_state_mb"])
    shrink = {}
    for fmt in ("bfloat16", "int8", "int4", "fp8"):
        got = _train(
            tmp_path,
            fmt,
            f"model={model}",
            *image,
            "precision=o2_bf16",
            f"precision.optimizer_state={fmt}",
        )
        run = got["run"]
        assert run.info.status == "FINISHED", fmt
        assert run.data.params["precision.optimizer_state"] == fmt
        assert got["losses"] and all(torch.isfinite(torch.tensor(got["losses"]))), fmt
        shrink[fmt] = float(run.data.metrics["mem_optimizer_state_mb"]) / fp32_mb
    # bf16: exactly half of the moments (the 4-byte step counters stay)
    assert 0.45 < shrink["bfloat16"] <= 0.5 + 1e-3, shrink
    if model == "vit_tiny":  # most of its elements are in tensors torchao quantises
        assert shrink["int8"] <= 0.3 and shrink["fp8"] <= 0.3 and shrink["int4"] <= 0.2, shrink
    else:  # the tiny CNN's tensors are mostly below 4096 elements: fp32 state, listed
        assert shrink["int4"] < shrink["int8"] < shrink["bfloat16"], shrink


def _state_tensors(ckpt: dict) -> list[torch.Tensor]:
    return [
        t
        for entry in ckpt["optimizer"]["state"].values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
        for t in plain_tensors(value)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset",
    [
        "precision=o2_bf16_int8state",
        "precision=o3_bf16_sr_int8state",
        "precision.optimizer_state=bfloat16",
    ],
)
def test_a_resumed_run_is_bit_identical_with_its_state_format(tmp_path, preset, eager_low_bit):
    # (a schedule that does not depend on max_epochs: the first session's budget is 1 epoch)
    common = [
        "data.num_train=160",
        *(["precision=o2_bf16"] if preset.startswith("precision.") else []),
        preset,
        "scheduler=step",
        "scheduler.step_epochs=1",
        "scheduler.gamma=0.5",
    ]
    _train(tmp_path, "straight", *common, "trainer.max_epochs=2")
    _train(tmp_path, "resumed", *common, "trainer.max_epochs=1")
    _train(tmp_path, "resumed", *common, "trainer.max_epochs=2", "resume=auto")
    a, b = (
        checkpoint.load(
            checkpoint.find(
                "auto", checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", name)
            )
        )
        for name in ("straight", "resumed")
    )
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    kinds = {type(v).__name__ for e in a["optimizer"]["state"].values() for v in e.values()}
    assert kinds == ({"Tensor"} if "bfloat16" in preset else {"Tensor", "OptimState8bit"})
    sa, sb = _state_tensors(a), _state_tensors(b)
    assert len(sa) == len(sb) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(sa, sb)
    )


def test_a_checkpoint_of_another_state_format_is_told_apart():
    model, int8 = _stepped_eager("int8")
    saved = int8.state_dict()
    fp32 = torch.optim.AdamW(model.parameters())
    problems = state.state_format_differences(saved, fp32)
    assert problems and "OptimState8bit -> a plain tensor" in problems[0]
    int4 = state.build_low_bit(OmegaConf.create(ADAMW), list(model.parameters()), "int4")
    assert "OptimState8bit -> OptimState4bit" in state.state_format_differences(saved, int4)[0]
    again = state.build_low_bit(OmegaConf.create(ADAMW), list(model.parameters()), "int8")
    assert state.state_format_differences(saved, again) == []


def _stepped_eager(fmt):
    import torchao.optim.adam as adam

    compile_ = adam.torch.compile
    adam.torch.compile = lambda fn, **kwargs: fn
    try:
        return _stepped(fmt)
    finally:
        adam.torch.compile = compile_


@pytest.mark.slow
def test_the_cli_with_defaults_trains_int8_compiled_and_resumes_in_a_new_process(tmp_path):
    """As a user runs it: DataLoader workers, the progress bar, torchao's compiled update; the
    second process reads the int8 state back through the safe unpickler (torchao's classes are
    registered only once torchao is imported), and an SGD run with int8 state exits 2 first."""
    store = [
        f"mlflow.tracking_uri={_store(tmp_path)}",
        "precision=o2_bf16_int8state",
        "optimizer=adamw",
        "model=tiny",
        "data=synthetic",
        "data.num_train=96",
        "data.num_val=32",
        "data.image_size=16",
        "trainer.batch_size=32",
        "trainer.num_workers=2",
        "mlflow.run_name=int8",
    ]
    refused = run_cli(
        *store[:-1], "optimizer=sgd", "trainer.max_epochs=1", cwd=tmp_path, timeout=300
    )
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "precision.optimizer_state" in output, output[-2000:]
    assert "Traceback" not in output
    first = run_cli(*store, "trainer.max_epochs=1", cwd=tmp_path, timeout=900)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    second = run_cli(*store, "trainer.max_epochs=2", "resume=auto", cwd=tmp_path, timeout=900)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-3000:]
    assert "epoch 2/2" in output and "refused" not in output
    client = MlflowClient(_store(tmp_path))
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    assert run.data.params["precision.optimizer_state"] == "int8"
