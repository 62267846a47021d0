"""Beyond Apex: bf16 with stochastic rounding (`o3_bf16_sr`), fp8 Linear layers through torchao
(`o1_fp8`, `o2_fp8`, emulated on a CPU) and `trainer.compile`, each a config choice that composes
with the levels, their rules, runs, checkpoints and resume.

Tolerances: the kernels' and the torch fallback's stochastically rounded steps are compared bit for
bit (the same fp32 arithmetic, the same random bits); a resumed run bit for bit; compiled against
eager training within 2e-3 (fp32) and 5e-2 (bf16) of the loss: inductor fuses and reorders fp32
arithmetic (a few ulps per op), and bf16 rounds every layer's output to 8 bits.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from runner.errors import ConfigError
from runner.precision import AmpEngine, amp, resolve
from runner.precision.checks import DeviceInfo
from runner.run import app
from runner.run.build import build
from runner.run.plan import default_run_name, make_plan
from tests.helpers.resume import last_checkpoint, settings, straight_and_resumed
from tests.helpers.runs import compose_config
from tests.helpers.store import history, runs_by_name

H100 = DeviceInfo("cuda", (9, 0), "NVIDIA H100")
A100 = DeviceInfo("cuda", (8, 0), "NVIDIA A100")
CPU = DeviceInfo("cpu", None, "cpu")


def findings(level: str, device=None, compiled=None, **overrides):
    return {
        (f.level, f.key): f for f in resolve(level, overrides, device, compiled=compiled).findings
    }


# ---- the rules ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "level,overrides,why",
    [
        ("O3", {}, "float16"),  # an fp16 model
        ("O0", {}, "float32"),  # an fp32 model
        ("O1", {"autocast_dtype": "bfloat16"}, "O1 does not cast the model"),
        ("O2", {"cast_model_type": "bfloat16"}, "replaces fp32 master weights"),
    ],
)
def test_stochastic_rounding_needs_a_bf16_model_without_masters(level, overrides, why):
    found = findings(level, **overrides, stochastic_rounding=True)
    error = found[("error", "precision.stochastic_rounding")]
    assert why in error.message and "o3_bf16_sr" in error.hint


def test_o3_bf16_sr_and_o2_bf16_without_masters_with_rounding_are_consistent():
    assert findings("O3", cast_model_type="bfloat16", stochastic_rounding=True) == {}
    assert (
        findings(
            "O2",
            cast_model_type="bfloat16",
            master_weights=False,
            stochastic_rounding=True,
            loss_scale=1.0,
        )
        == {}
    )


def test_o2_without_masters_points_to_stochastic_rounding_in_bf16_only():
    bf16 = findings("O2", cast_model_type="bfloat16", master_weights=False, loss_scale=1.0)
    assert (
        "precision.stochastic_rounding=true" in bf16[("warning", "precision.master_weights")].hint
    )
    fp16 = findings("O2", master_weights=False)
    assert "stochastic" not in fp16[("warning", "precision.master_weights")].hint


@pytest.mark.parametrize(
    "level,overrides,why",
    [
        ("O1", {}, "not fp16"),  # fp16 autocast
        ("O2", {}, "not fp16"),  # an fp16 model
        ("O3", {"cast_model_type": "bfloat16"}, "O3 keeps no masters"),
        ("O0", {}, "fp32 baseline"),
    ],
)
def test_fp8_refuses_what_torchao_does_not_train(level, overrides, why):
    found = findings(level, fp8_linear="tensorwise", **overrides)
    assert why in found[("error", "precision.fp8_linear")].message


def test_fp8_device_rules():
    o2_fp8 = dict(cast_model_type="bfloat16", loss_scale=1.0, fp8_linear="rowwise")
    assert (
        "compute capability 8.9"
        in findings("O2", A100, **o2_fp8)[("error", "precision.fp8_linear")].message
    )
    assert "emulated" in findings("O2", CPU, **o2_fp8)[("info", "precision.fp8_linear")].message
    slow = findings("O2", H100, compiled=False, **o2_fp8)
    assert "trainer.compile=true" in slow[("warning", "precision.fp8_linear")].hint
    assert findings("O2", H100, compiled=True, **o2_fp8) == {}


def test_fp8_without_torchao_is_an_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what an uninstalled package looks like
    found = findings("O1", autocast_dtype="bfloat16", loss_scale=1.0, fp8_linear="tensorwise")
    assert "amp-runner[fp8]" in found[("error", "precision.fp8_linear")].hint


def test_a_bad_fp8_recipe_names_the_key():
    with pytest.raises(ConfigError, match="precision.fp8_linear.*tensorwise, rowwise"):
        resolve("O1", {"fp8_linear": "blockwise"})


# ---- presets, names ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "preset,level,expected",
    [
        (
            "o1_fp8",
            "O1",
            dict(autocast_dtype="bfloat16", fp8_linear="tensorwise", loss_scale="1.0"),
        ),
        (
            "o2_fp8",
            "O2",
            dict(
                cast_model_type="bfloat16",
                master_weights="True",
                fp8_linear="tensorwise",
                loss_scale="1.0",
            ),
        ),
        (
            "o3_bf16_sr",
            "O3",
            dict(
                cast_model_type="bfloat16",
                master_weights="False",
                stochastic_rounding="True",
                loss_scale="1.0",
            ),
        ),
    ],
)
def test_the_presets_compose_and_resolve(preset, level, expected, tracking_uri):
    plan = make_plan(
        compose_config(
            f"precision={preset}",
            "model=tiny",
            "data=synthetic",
            "trainer.device=cpu",
            f"mlflow.tracking_uri={tracking_uri}",
        )
    )
    params = plan.properties.as_params()
    assert params["opt_level"] == level
    assert {k: params[k] for k in expected} == expected
    assert not plan.resolution.errors


@pytest.mark.parametrize(
    "overrides,name",
    [
        (["precision=o1_fp8"], "tiny-O1-fp8"),
        (["precision=o1_bf16"], "tiny-O1-bf16"),
        (["precision=o3_bf16_sr"], "tiny-O3-bf16-sr"),
        (["precision=o2_bf16", "trainer.compile=true"], "tiny-O2-bf16-compiled"),
    ],
)
def test_run_names_tell_the_new_choices_apart(overrides, name):
    assert default_run_name(compose_config("model=tiny", *overrides)) == name


def test_compile_mode_is_checked_before_anything():
    with pytest.raises(ConfigError, match="trainer.compile_mode"):
        make_plan(compose_config("trainer.compile=true", "trainer.compile_mode=fastest"))


# ---- stochastic rounding in the engine -------------------------------------------------------
def _sr_training(kernels: str, optimizer: str, steps: int = 4):
    """A small bf16 net trained a few steps at O3 bf16 with stochastic rounding."""
    from tests.helpers.precision import KernelSpy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-4),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    }[optimizer]
    opt = make(model.parameters())
    props = resolve("O3", {"cast_model_type": "bfloat16", "stochastic_rounding": True}).properties
    engine = AmpEngine(props, "cpu", kernels=kernels, seed=3)
    engine.prepare(model, opt)
    spy = KernelSpy(engine) if kernels == "fused" else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    for _ in range(steps):
        engine.backward(nn.functional.cross_entropy(model(x.bfloat16()).float(), y))
        assert engine.step(opt)
        engine.zero_grad(opt)
    return model, engine, spy


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop"])
def test_rounded_steps_are_the_same_on_the_kernels_and_the_fallback(optimizer):
    """The same random bits round the same fp32 values: the kernels and the fallback (torch's
    optimizer on fp32 copies) differ only where their fp32 arithmetic does (a few ulps), which
    moves a rounded bf16 value by at most one spacing, in about one element in a thousand."""
    fused_model, engine, spy = _sr_training("fused", optimizer)
    torch_model, _, _ = _sr_training("torch", optimizer)
    assert all(p.dtype == torch.bfloat16 for p in fused_model.parameters())
    differing = total = 0
    for a, b in zip(fused_model.parameters(), torch_model.parameters()):
        a, b = a.detach().float(), b.detach().float()
        spacing = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs())
        assert bool(((a - b).abs() <= spacing).all())
        differing += int((a != b).sum())
        total += a.numel()
    assert differing <= max(1, total // 200)
    assert engine.state_dict()["rounding_steps"] == 4
    kernel_steps = spy.count("sgd_step_sr") + spy.count("adam_step_sr")
    assert kernel_steps == (0 if optimizer == "rmsprop" else 4)  # RMSprop: the fallback


def test_rounding_keys_differ_by_seed_and_step():
    props = resolve("O3", {"cast_model_type": "bfloat16", "stochastic_rounding": True}).properties
    results = []
    for seed in (1, 1, 2):
        torch.manual_seed(0)
        layer = nn.Linear(64, 64)
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
        engine = AmpEngine(props, "cpu", kernels="torch", seed=seed)
        engine.prepare(layer, opt)
        x = torch.randn(4, 64).bfloat16()
        engine.backward(layer(x).float().pow(2).mean())
        engine.step(opt)
        results.append(layer.weight.detach().clone())
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])


def test_sr_learns_what_round_to_nearest_loses():
    """The weight barely moves per step (lr * grad ~ 1/10 of bf16's spacing): O3 bf16 keeps it
    where it was, stochastic rounding moves it by the expected amount on average."""
    step = 0.1 * 2**-8  # lr * |grad|: 1/20 of bf16's spacing 2^-7 between 1 and 2
    expected_move = 200 * step
    moved = {}
    for sr in (False, True):
        props = resolve("O3", {"cast_model_type": "bfloat16", "stochastic_rounding": sr}).properties
        weight = nn.Parameter(torch.ones(4096))
        opt = torch.optim.SGD([weight], lr=step)
        holder = nn.Module()
        holder.w = weight
        engine = AmpEngine(props, "cpu", kernels="auto", seed=5)
        engine.prepare(holder, opt)
        for _ in range(200):
            engine.backward(-(holder.w.float()).sum())  # gradient -1 everywhere: w grows
            engine.step(opt)
            engine.zero_grad(opt)
        moved[sr] = holder.w.float().mean().item() - 1.0
    assert moved[False] == 0.0  # round to nearest: every update rounds away
    # rounded up one spacing with probability 1/20 per step: the mean over 4096 weights is
    # within 0.5% (one standard deviation) of 200 steps' worth; 5% is ten of them
    assert abs(moved[True] - expected_move) < 0.05 * expected_move


def test_o3_bf16_sr_resumes_bit_for_bit(tmp_path):
    uri = straight_and_resumed(
        tmp_path,
        "precision=o3_bf16_sr",
        "optimizer=adam",
        "optimizer.eps=1e-4",
        "scheduler=step",
        "scheduler.step_epochs=1",
        "scheduler.gamma=0.5",
    )
    runs = runs_by_name(uri)
    got, want = (
        history(uri, runs["resumed"].info.run_id),
        history(uri, runs["straight"].info.run_id),
    )
    assert got.pop("best_val_acc")[-1] == want.pop("best_val_acc")[-1]
    assert got == want
    a, b = last_checkpoint(tmp_path, "straight"), last_checkpoint(tmp_path, "resumed")
    assert a["engine"] == b["engine"] and a["engine"]["rounding_steps"] == 10  # 2 x 5 batches
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


# ---- fp8 Linear layers (emulated on a CPU) ------------------------------------------------------
class Mlp(nn.Module):
    """Two Linear layers torchao takes (sizes multiples of 16) and a head it does not (10)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU()
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize(
    "level,overrides",
    [
        ("O1", dict(autocast_dtype="bfloat16", loss_scale=1.0, fp8_linear="tensorwise")),
        ("O2", dict(cast_model_type="bfloat16", loss_scale=1.0, fp8_linear="rowwise")),
    ],
)
def test_fp8_layers_train_emulated_and_list_what_stays(level, overrides):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = AmpEngine(resolve(level, overrides).properties, "cpu")
    engine.prepare(model, opt)
    assert engine.fp8.converted == ["body.1", "body.3"] and engine.fp8.emulated
    assert [name for name, _ in engine.fp8.skipped] == ["head"]
    assert isinstance(model.body[1], Float8Linear) and type(model.head) is nn.Linear
    (finding,) = engine.fp8.findings()
    assert "head (out_features 10 not a multiple of 16)" in finding.message
    assert list(model.state_dict()) == [
        "body.1.weight",
        "body.1.bias",
        "body.3.weight",
        "body.3.bias",
        "head.weight",
        "head.bias",
    ]
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    losses = []
    for _ in range(30):
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        engine.backward(loss)
        assert engine.step(opt)
        engine.zero_grad(opt)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # it learns, through the fp8 GEMMs


def test_fp8_run_logs_its_layers(tmp_path, tracking_uri):
    """A real run: the count of fp8 layers as a param, the listing as an artifact. The tiny CNN's
    only Linear layer (64 -> 16 classes) runs in fp8."""
    from mlflow.tracking import MlflowClient

    from tests.helpers.runs import FAST

    app.run(
        compose_config(
            *FAST,
            "precision=o2_fp8",
            "data.num_classes=16",
            "trainer.max_epochs=1",
            f"mlflow.tracking_uri={tracking_uri}",
        )
    )
    (run,) = runs_by_name(tracking_uri).values()
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-O2-fp8"
    assert run.data.params["precision.fp8_layers"] == "1"
    assert run.data.params["precision.fp8_linear"] == "tensorwise"
    client = MlflowClient(tracking_uri)
    listing = client.download_artifacts(run.info.run_id, "fp8_layers.txt", str(tmp_path))
    assert "fp8   5" in open(listing).read()  # the Linear layer of the Sequential, index 5


VIT = [
    "model=vit_tiny",
    "data=synthetic",
    "data.num_train=256",
    "data.num_val=32",
    "data.image_size=32",
    "trainer.batch_size=32",
    "trainer.max_epochs=1",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.device=cpu",
    "optimizer=adamw",
    "optimizer.lr=3e-3",
    "trainer.checkpoint_every_n_epochs=0",
]


@pytest.mark.slow  # three short ViT runs of 8 steps, fp8 emulated (torchao's import: seconds)
def test_the_tiny_vit_trains_in_fp8_emulated_as_in_bf16(tracking_uri):
    """The model fp8 is for: the small ViT at o1_fp8 and o2_fp8 on a CPU (emulated). Its 8 MLP
    Linear layers (128 -> 256 -> 128, four blocks) run in fp8; the 10-class head stays in bf16
    (attention's projections are not nn.Linear calls). Same seed, same batches as the same level
    in bf16 (o1_bf16, o2_bf16): the loss of the first four steps follows bf16's within 2%, and of
    every step within 6% (fp8's rounding, e4m3 forward and e5m2 gradients, is not bf16's: the
    numbers differ, and the difference compounds over AdamW steps; the largest difference
    measured: 0.5% at O1 and 1.2% at O2 on an Intel Xeon, 4.8% at O2's step 7 on an AMD EPYC, where
    its first four steps stay within 1%, while the loss moves 7% between steps), and it learns (the
    last step's loss is below the first's, which is ln 10: torchvision's ViT head starts at
    zero)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    losses = {}
    for preset in ("o1_bf16", "o1_fp8", "o2_bf16", "o2_fp8"):
        app.run(compose_config(*VIT, f"precision={preset}", f"mlflow.tracking_uri={tracking_uri}"))
        run = runs_by_name(tracking_uri)[
            default_run_name(compose_config(*VIT, f"precision={preset}"))
        ]
        assert run.info.status == "FINISHED", preset
        if preset.endswith("fp8"):
            assert run.data.params["precision.fp8_layers"] == "8", preset
        losses[preset] = [
            m.value
            for m in sorted(
                client.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step
            )
        ]
    for preset, bf16 in (("o1_fp8", "o1_bf16"), ("o2_fp8", "o2_bf16")):
        reference = losses[bf16]
        assert len(reference) == 8
        assert losses[preset][:4] == pytest.approx(reference[:4], rel=0.02), (preset, losses)
        assert losses[preset] == pytest.approx(reference, rel=0.06), (preset, losses)
        assert losses[preset] != reference, preset  # fp8 did change the numbers
        assert losses[preset][-1] < losses[preset][0] - 0.05, (preset, losses)


def test_the_facade_takes_the_new_properties():
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model, opt = amp.initialize(
            model,
            opt,
            opt_level="O2",
            cast_model_type=torch.bfloat16,
            loss_scale=1.0,
            fp8_linear="tensorwise",
            verbosity=0,
        )
        assert amp.engine().fp8.converted == ["body.1", "body.3"]
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        layer = nn.Linear(8, 8)
        sgd = torch.optim.SGD(layer.parameters(), lr=0.1)
        layer, sgd = amp.initialize(
            layer,
            sgd,
            opt_level="O3",
            cast_model_type=torch.bfloat16,
            stochastic_rounding=True,
            verbosity=0,
        )
        with amp.scale_loss(layer(torch.randn(2, 8)).float().sum(), sgd) as scaled:
            scaled.backward()
        sgd.step()
        assert amp.engine().state_dict()["rounding_steps"] == 1
    finally:
        amp.deinitialize()


# ---- torch.compile ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("level,tolerance", [("o0", 2e-3), ("o2_bf16", 5e-2)])
def test_compiled_training_matches_eager(tmp_path, level, tolerance):
    common = settings(tmp_path, f"precision={level}", "trainer.max_epochs=2")
    app.run(compose_config(*common, "mlflow.run_name=eager"))
    app.run(compose_config(*common, "trainer.compile=true", "mlflow.run_name=compiled"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = runs_by_name(uri)
    eager, compiled = (history(uri, runs[n].info.run_id) for n in ("eager", "compiled"))
    assert [s for s, _ in eager["train_loss"]] == [s for s, _ in compiled["train_loss"]]
    for (_, a), (_, b) in zip(
        eager["train_loss"] + eager["val_loss"], compiled["train_loss"] + compiled["val_loss"]
    ):
        assert abs(a - b) <= tolerance * max(1.0, abs(a)), (a, b)
    metrics = runs["compiled"].data.metrics
    assert metrics["compile_time_s"] > 0 and "compile_time_s" not in runs["eager"].data.metrics
    state = last_checkpoint(tmp_path, "compiled")["model"]
    assert not any(key.startswith("_orig_mod") for key in state)  # loads into an eager model
    assert set(state) == set(last_checkpoint(tmp_path, "eager")["model"])


def first_step_loss(*overrides: str) -> float:
    """The loss of the runner's first training step (`Trainer.train_step` on the objects a run
    builds) for a GPT wide enough that inductor's fused casts show (width 256), on one batch."""
    from runner.run.context import RunContext
    from runner.run.trainer import Trainer, trainer_config

    cfg = compose_config(
        "model=gpt_tiny",
        "model.n_embd=256",
        "data=synthetic_text",
        "data.block_size=32",
        "data.num_train=65",
        "data.num_val=65",
        "trainer.batch_size=2",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        *overrides,
    )
    plan = make_plan(cfg)
    parts = build(plan)
    trainer = Trainer(
        trainer_config(cfg.trainer),
        parts,
        RunContext(on_metrics=lambda *_: None),
        device=plan.device,
    )
    x, y = next(iter(parts.train_loader))
    return float(trainer.train_step(*trainer.to_device(x, y)))


def test_a_compiled_rowwise_fp8_model_computes_what_the_eager_one_does():
    """With the rowwise recipe a compiled model keeps eager's bf16 round trips between fused ops
    (inductor's `emulate_precision_casts`, as torchtitan sets for it; pytorch#150859): the first
    step's loss, before any update, is eager's to 1e-6 (without the setting it is off by ~3e-4
    at this width), and the setting is the model's own, not the process's. Skipped where this
    torch's inductor gives the same loss with the setting as without it on a CPU (torch 2.11)."""
    import torch._inductor.config as inductor

    from runner.run.build import compile_arguments

    rowwise = ("precision=o1_fp8", "precision.fp8_linear=rowwise")
    with inductor.patch(emulate_precision_casts=False):  # the process's setting, whatever it was
        eager = first_step_loss(*rowwise)
        compiled = first_step_loss(*rowwise, "trainer.compile=true")
        assert inductor.emulate_precision_casts is False  # the next job of a sweep is unchanged
    from runner.precision.fp8 import Conversion

    rowwise_layers = Conversion("rowwise", emulated=True, converted=["blocks.0.mlp.fc"])
    assert (
        compile_arguments("max-autotune", rowwise_layers)["options"]
        | {"max_autotune": True, "emulate_precision_casts": True}
        == compile_arguments("max-autotune", rowwise_layers)["options"]
    )  # the mode is kept
    tensorwise = Conversion("tensorwise", emulated=True, converted=["blocks.0.mlp.fc"])
    assert compile_arguments("default", tensorwise) == {"mode": "default"}  # as torchtitan
    if compiled != pytest.approx(eager, rel=1e-6, abs=0):
        with inductor.patch(emulate_precision_casts=True):  # the process's, as a check of torch
            everywhere = first_step_loss(*rowwise, "trainer.compile=true")
        if everywhere == compiled:  # (torch 2.11 on a CPU: 2.6e-4 off with it as without it)
            pytest.skip(f"torch {torch.__version__}'s inductor keeps no bf16 round trip here")
    assert compiled == pytest.approx(eager, rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_compiled_run_resumes_bit_for_bit(tmp_path):
    straight_and_resumed(
        tmp_path,
        "precision=o2_bf16",
        "trainer.compile=true",
        "scheduler=step",
        "scheduler.step_epochs=1",
    )
    a, b = last_checkpoint(tmp_path, "straight"), last_checkpoint(tmp_path, "resumed")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def test_the_report_tells_the_new_presets_apart():
    from runner.report.analysis import describe_dtype

    def described(level, **overrides):
        return describe_dtype(resolve(level, overrides).properties.as_params())

    assert (
        described("O1", autocast_dtype="bfloat16", loss_scale=1.0, fp8_linear="tensorwise")
        == "float32 weights, autocast bfloat16, fp8 Linear (tensorwise)"
    )
    assert (
        described("O3", cast_model_type="bfloat16", stochastic_rounding=True)
        == "bfloat16 (stochastic rounding)"
    )
    assert described("O3", cast_model_type="bfloat16") == "bfloat16"
