"""Range diagnostics (runner.measure.diagnostics) and the pre-flight (runner.diagnose): known
answers for
the underflow/overflow fractions and the exponent histograms, hooks only on diagnosed steps, the
in-run metrics against a reference counted by hand, and the pre-flight's recommendation on a model
built to overflow in fp16."""

from __future__ import annotations

import collections
import csv
import math
import shlex
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from runner.diagnose import analysis, cli
from runner.measure.diagnostics import (
    ACTIVATION,
    ACTIVATION_GRAD,
    BF16,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    LOG2_MIN,
    WEIGHT_GRAD,
    RangeProbe,
    TensorStats,
    layers_of,
    model_metrics,
    run_formats,
    tensor_stats,
)
from runner.measure.run_diagnostics import RangeInstrument, RunDiagnostics
from runner.precision import AmpEngine, resolve
from runner.run import watch
from tests.helpers.runs import FAST, REPO, run_cli
from tests.helpers.trainer import make_trainer

CPU = torch.device("cpu")
INF, NAN = math.inf, math.nan


class Scale(nn.Module):
    """y = x * w, w = 1: fed x = 1, the gradient of w is exactly the gradient of y."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


# chosen magnitudes: 12 values, one zero and one NaN, so 10 count towards the fractions
GRADIENT = [
    0.0,
    2.0**-30,
    2.0**-20,
    2.0**-15,
    2.0**-14,
    1.0,
    2.0**14,
    65536.0,
    70000.0,
    1e-40,
    INF,
    NAN,
]
# (format, scale) -> (values that underflow, values that overflow), counted by hand:
#   fp16 at 1:    2^-30, 2^-20, 2^-15, 1e-40 below 2^-14;   65536, 70000, inf above 65504
#   bf16 at 1:    1e-40 below 2^-126;                        inf
#   fp16 at 2^10: 2^-30, 1e-40 below 2^-24;                  2^14, 65536, 70000, inf above 63.97
#   bf16 at 2^10: none (1e-40 * 1024 > 2^-126);              inf
EXPECTED = {
    ("fp16", 1.0): (4, 3),
    ("bf16", 1.0): (1, 1),
    ("fp16", 1024.0): (2, 4),
    ("bf16", 1024.0): (0, 1),
}


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_a_layer_fed_chosen_gradients_reports_the_exact_fractions(scale):
    layer = nn.Sequential(Scale(len(GRADIENT)))
    probe = RangeProbe(layer, [FP16, BF16], scale=scale)
    with probe:
        out = layer(torch.ones(len(GRADIENT)))
        out.backward(torch.tensor(GRADIENT))
        probe.observe_weight_grads()
    records = {r.kind: r.stats for r in probe.read(step=7)}
    assert set(records) == {ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD}
    for kind in (ACTIVATION_GRAD, WEIGHT_GRAD):  # both see exactly GRADIENT
        stats = records[kind]
        assert (stats.count, stats.zeros, stats.nans, stats.infs) == (12, 1, 1, 1)
        assert stats.nonzero == 10
        for fmt in ("fp16", "bf16"):
            under, over = EXPECTED[(fmt, scale)]
            assert stats.underflow[fmt] == under and stats.overflow[fmt] == over
            assert stats.underflow_frac(fmt) == under / 10
            assert stats.overflow_frac(fmt) == over / 10
    acts = records[ACTIVATION]  # y = 1 everywhere: in range, whatever the gradient scale
    assert acts.count == 12 and acts.underflow["fp16"] == acts.overflow["fp16"] == 0
    assert acts.bins[0 - LOG2_MIN] == 12  # 1.0 is in [2^0, 2^1)


def test_fp8_limits_are_e4m3_for_forward_and_e5m2_for_gradients():
    stats = tensor_stats(
        [torch.tensor([2.0**-7, 2.0**-6, 448.0, 449.0, 2.0**-15, 57344.0, 6e4])],
        [FP8_E4M3, FP8_E5M2],
    )
    assert (FP8_E4M3.max, FP8_E4M3.tiny, FP8_E5M2.max, FP8_E5M2.tiny) == (
        448.0,
        2.0**-6,
        57344.0,
        2.0**-14,
    )
    assert stats.underflow == {"fp8_e4m3": 2, "fp8_e5m2": 1}  # 2^-7, 2^-15 | 2^-15
    assert stats.overflow == {"fp8_e4m3": 3, "fp8_e5m2": 1}  # 449, 57344, 6e4 | 6e4


def test_the_exponent_histogram_sums_to_the_element_count_and_matches_frexp():
    torch.manual_seed(0)
    values = torch.randn(10_000) * torch.exp2(torch.randint(-40, 40, (10_000,)).float())
    values[:7] = torch.tensor([0.0, -0.0, INF, -INF, NAN, 1e-40, -3e-39])
    half = values[:100].half()  # (its large values become inf, its small ones zero)
    stats = tensor_stats([values, half], [FP16])
    assert stats.count == 10_100 == sum(n for _, n in stats.histogram())
    both = torch.cat([values, half.float()])
    assert (stats.zeros, stats.infs, stats.nans, stats.below) == (
        int((both == 0).sum()),
        int(both.isinf().sum()),
        2,
        2,
    )
    assert stats.zeros > 2 and stats.infs > 2  # the fp16 copy's
    # the reference: floor(log2|x|) = frexp's exponent - 1, for the normal fp32 values
    reference = collections.Counter()
    for t in (values, half.float()):
        normal = t[torch.isfinite(t) & (t.abs() >= 2.0**-126)]
        reference.update((torch.frexp(normal)[1] - 1).tolist())
    assert {LOG2_MIN + i: c for i, c in enumerate(stats.bins) if c} == dict(reference)


def test_underflow_from_the_histogram_at_a_power_of_two_scale_is_exact():
    torch.manual_seed(1)
    g = torch.randn(5000) * 1e-6
    stats = tensor_stats([g], [FP16])
    for log2_scale in (0, 4, 10, 16, 24):
        scale = 2.0**log2_scale
        direct = tensor_stats([g], [FP16], scale=scale).underflow["fp16"]
        assert stats.underflow_at(FP16, scale) == direct
        assert direct == int(((g.abs() * scale < 2.0**-14) & (g != 0)).sum())
    with pytest.raises(ValueError):
        stats.underflow_at(FP16, 1000.0)


def test_run_formats_follow_the_compute_dtypes():
    assert run_formats(set()) == [FP16]  # fp32 runs: fp16 as the reference
    assert run_formats({torch.bfloat16}) == [BF16]
    assert run_formats({torch.bfloat16, torch.float16}) == [FP16, BF16]


def test_layers_are_the_parameter_owning_leaf_modules():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Sequential(nn.Linear(4, 2)),
    )
    assert [name for name, _ in layers_of(model)] == ["0", "1", "4.0"]


# ---- inside a run --------------------------------------------------------------------------------
def _hook_counts(model: nn.Module) -> dict[str, int]:
    return {
        name: len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for name, m in model.named_modules()
        if name
    }


def _watch_hooks(trainer) -> list[dict[str, int]]:
    """The hook count of every submodule, seen from inside each step's forward (the loss)."""
    seen = []
    criterion = trainer.criterion

    def spying(logits, y):
        seen.append(_hook_counts(trainer.module))
        return criterion(logits, y)

    trainer.criterion = spying
    return seen


def test_off_means_no_hooks_but_the_first_steps_audit():
    """Diagnostics off: no probe ever; the only hooks are the layer audit's on the first step
    (a forward pre-hook and a forward hook per layer: runner.measure.audit), gone after it."""
    trainer, logged = make_trainer("O2", {}, diagnose_every_n_steps=0)
    seen = _watch_hooks(trainer)
    trainer.train_epoch(1)
    assert trainer.instruments.find(RangeInstrument) is None
    layers = {layer.name for layer in trainer.layer_plan}
    assert len(seen) == 4
    assert {name: n for name, n in seen[0].items() if n} == {name: 2 for name in layers}
    assert all(not any(counts.values()) for counts in seen[1:])
    assert not any(_hook_counts(trainer.module).values())
    assert not torch.nn.modules.module._global_forward_hooks
    assert not any(k.startswith("diag_") for m, _ in logged for k in m)
    assert [s for m, s in logged if "layers_off_plan" in m] == [1]


def test_hooks_exist_only_during_the_diagnosed_steps():
    trainer, logged = make_trainer("O0", {}, diagnose_every_n_steps=3)
    seen = _watch_hooks(trainer)
    trainer.train_epoch(1)  # steps 1-4: 1 and 4 are diagnosed (and audited)
    layers = {name for name, _ in layers_of(trainer.module)}
    for step, counts in enumerate(seen, start=1):
        hooked = {name for name, n in counts.items() if n}
        assert hooked == (layers if step in (1, 4) else set()), step
    assert not any(_hook_counts(trainer.module).values())  # none left after the step
    steps = [s for m, s in logged if "diag_grad_underflow_frac" in m]
    assert steps == [1, 4]


def test_in_run_metrics_match_a_count_by_hand():
    """Step 1 of an O0 run, diagnosed in fp16: the whole-model fractions equal a direct count
    over the same step's layer outputs, their gradients and the weight gradients."""
    torch.manual_seed(0)
    trainer, logged = make_trainer("O0", {}, diagnose_every_n_steps=100)
    torch.manual_seed(0)
    twin, _ = make_trainer("O0", {})
    x, y = trainer.to_device(*next(iter(trainer.train_loader)))
    trainer.train_step(x, y)

    outputs, grads = [], []

    def keep(module, inputs, out):
        outputs.append(out.detach().clone())
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    for _, module in layers_of(twin.module):
        module.register_forward_hook(keep)
    twin.criterion(twin.model(x), y).backward()
    grads += [p.grad for _, m in layers_of(twin.module) for p in m.parameters(recurse=False)]

    def fraction(tensors, test) -> float:
        hit = sum(int((test(t.abs()) & (t != 0)).sum()) for t in tensors)
        return hit / sum(int((t != 0).sum()) for t in tensors)

    metrics = next(m for m, s in logged if "diag_grad_underflow_frac" in m)
    assert metrics["diag_grad_underflow_frac"] == fraction(grads, lambda a: a < 2.0**-14) > 0
    assert metrics["diag_act_underflow_frac"] == fraction(outputs, lambda a: a < 2.0**-14)
    assert metrics["diag_grad_overflow_frac"] == fraction(grads, lambda a: a > 65504) == 0


def test_an_fp16_run_judges_its_stored_scaled_gradients(tmp_path):
    """O2 with a static loss scale of 2^40 overflows fp16 in every gradient that is not tiny:
    the in-run figure shows it (the gradients are observed as stored, scaled), and the
    artifacts are written and handed over under diagnostics/."""
    handed = []
    trainer, logged = make_trainer("O2", {"loss_scale": 2.0**40}, diagnose_every_n_steps=2)
    formats = trainer.instruments.find(RangeInstrument).diagnostics.formats
    diagnostics = RunDiagnostics(
        2, formats, tmp_path, lambda path, folder: handed.append((path.name, folder))
    )
    trainer.instruments = watch.instruments(trainer, diagnostics, audit=True)
    trainer.fit()
    metrics = [m for m, s in logged if "diag_grad_overflow_frac" in m]
    assert len(metrics) == 4  # steps 1, 3, 5, 7
    assert all(m["diag_grad_overflow_frac"] > 0.5 for m in metrics)
    assert sorted(handed) == sorted(
        [(n, "diagnostics") for n in ("layers.csv", "exponents.csv", "grad_exponents.png")] * 2
    )
    with (tmp_path / "layers.csv").open() as f:
        rows = list(csv.DictReader(f))
    layers = len(layers_of(trainer.module))
    assert len(rows) == 4 * layers * 3  # per diagnosed step: every layer, three kinds
    assert {r["loss_scale"] for r in rows} == {str(2.0**40)}
    assert {r["judged_at_scale"] for r in rows} == {"1.0"}
    with (tmp_path / "exponents.csv").open() as f:
        counts = collections.Counter()
        for r in csv.DictReader(f):
            counts[(r["step"], r["layer"], r["kind"])] += int(r["count"])
    assert all(counts[(r["step"], r["layer"], r["kind"])] == int(r["elements"]) for r in rows)
    assert (tmp_path / "grad_exponents.png").read_bytes()[:4] == b"\x89PNG"


def test_model_metrics_pool_the_gradient_kinds():
    a = TensorStats(1.0, [0] * 254, 0, 0, 0, 0, {"fp16": 1}, {"fp16": 0})
    a.bins[0] = 4
    b = TensorStats(1.0, [0] * 254, 0, 2, 1, 0, {"fp16": 0}, {"fp16": 1})
    b.bins[0] = 5
    records = [
        type("R", (), {"kind": k, "stats": s})()
        for k, s in ((ACTIVATION_GRAD, a), (WEIGHT_GRAD, b), (ACTIVATION, a))
    ]
    metrics = model_metrics(records, FP16)
    assert metrics["diag_grad_underflow_frac"] == 1 / 10  # (4 + 5 + 1 inf) non-zero values
    assert metrics["diag_grad_overflow_frac"] == 1 / 10
    assert metrics["diag_act_underflow_frac"] == 1 / 4


# ---- the pre-flight ------------------------------------------------------------------------------
class Overflowing(nn.Module):
    """A small CNN whose `amplifier` layer produces activations far above fp16's max."""

    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.amplifier = nn.Linear(8, 8)
        with torch.no_grad():
            self.amplifier.weight.fill_(3e4)
            self.amplifier.bias.fill_(1e5)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.pool(torch.relu(self.features(x))).flatten(1)
        return self.head(self.amplifier(h) * 1e-5)


def _fp32_trainer(model: nn.Module):
    trainer, _ = make_trainer("O0", {})
    engine = AmpEngine(resolve("O0", device=CPU).properties, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = engine.prepare(model, optimizer)
    trainer.model = trainer.module = model
    trainer.optimizer, trainer.engine, trainer.scheduler = optimizer, engine, None
    return trainer


def test_the_preflight_names_the_layer_that_overflows_fp16(tmp_path):
    result, text, paths = cli.preflight(_fp32_trainer(Overflowing()), 2, tmp_path, "t")
    assert result.preset == "o2_bf16" and result.keep_fp32 == ["amplifier"]
    fp16 = result.judgements[0]
    assert fp16.name == "fp16" and fp16.act_overflow == ["amplifier"]
    assert result.judgements[1].act_overflow == []  # bf16 holds them
    assert "fp16 OVERFLOWS in the forward pass: the activations of amplifier" in text
    assert "Recommendation: precision=o2_bf16; keep in fp32: amplifier" in text
    assert {p.name for p in paths} == {
        "layers.csv",
        "exponents.csv",
        "grad_exponents.png",
        "report.txt",
    }
    assert all(p.is_file() for p in paths)


class AmplifyingLinearWithALongClassName(nn.Linear):
    """A layer whose class name is longer than the table's `module` header."""


def test_the_preflights_table_keeps_its_columns_for_long_module_names(tmp_path):
    model = Overflowing()
    long = AmplifyingLinearWithALongClassName(8, 8)
    long.load_state_dict(model.amplifier.state_dict())
    model.amplifier = long
    _, text, _ = cli.preflight(_fp32_trainer(model), 2, tmp_path, "t")
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if "act under" in line)
    table = lines[head : lines.index("", head)]
    assert any("AmplifyingLinearWithALongClassName" in line for line in table)
    assert {len(line) for line in table} == {len(lines[head])}  # every cell under its heading


def test_the_preflight_recommends_loss_scaling_for_small_gradients(tmp_path):
    torch.manual_seed(0)
    result, text, _ = cli.preflight(
        _fp32_trainer(
            nn.Sequential(
                nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)
            )
        ),
        2,
        tmp_path,
        "t",
        device_type="cuda",
    )
    assert result.preset == "o2" and result.keep_fp32 == []
    top = result.grads.max_log2
    assert result.loss_scale == min(2.0 ** (14 - top), 2.0**24)  # max|g| * S < 2^15
    assert result.underflow_at_scale == (
        result.grads.underflow_at(FP16, result.loss_scale) / result.grads.nonzero
    )
    assert f"precision.loss_scale={result.loss_scale:g}" in text


def test_a_step_of_accumulated_batches_is_measured_as_the_run_divides_its_loss(tmp_path):
    """With trainer.accumulate_grad_batches=2 a run's step is two batches, each loss halved
    before its backward: the gradients the half type holds are half of one batch's alone. The
    pre-flight measured one batch's undivided loss, a binade (a factor k) farther from underflow
    than the run stands."""
    from runner.run import autoplan

    def first_step(k: int) -> dict:
        torch.manual_seed(0)
        trainer, _ = make_trainer("O0", {}, batch_size=8, accumulate_grad_batches=k)
        folder = tmp_path / str(k)
        folder.mkdir()
        records = autoplan.measure(trainer, 1, folder, echo=False)
        assert trainer.global_step == 1
        grads = (ACTIVATION_GRAD, WEIGHT_GRAD)
        return {(r.layer, r.kind): r.stats for r in records if r.kind in grads}

    alone, halved = first_step(1), first_step(2)
    assert alone and alone.keys() == halved.keys()
    for key, stats in alone.items():  # (x 0.5 is exact: every value one binade lower)
        assert halved[key].bins[:-1] == stats.bins[1:], key
        assert sum(halved[key].bins) + halved[key].below == sum(stats.bins) + stats.below, key


class WideGradients(nn.Module):
    """A CNN whose `wide` Linear layer's output gradients span 2^40: half of them are 1e-12 of
    the others, below e5m2's range (30 binades) even with the tensor scaled to its own max."""

    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(3, 8, 3, padding=1)
        self.wide = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)
        self.register_buffer("spread", torch.tensor([1.0, 1e-12] * 4))

    def forward(self, x):
        h = torch.relu(self.features(x)).mean((2, 3))
        return self.head(self.wide(h) * self.spread)


def test_the_preflight_judges_fp8_as_the_fp8_presets_scale_it(tmp_path):
    """It said "fp8 (no runner preset ...)" beside o1_fp8 and o2_fp8, and judged fp8 unscaled
    alone: those presets scale each tensor of a Linear layer's GEMM to its own max."""
    torch.manual_seed(0)
    _, text, _ = cli.preflight(_fp32_trainer(WideGradients()), 2, tmp_path, "t")
    assert "no runner preset" not in text
    assert (
        "fp8 (precision=o1_fp8 / o2_fp8 run the Linear layers' GEMMs in fp8, each tensor scaled "
        "to its own max): so scaled, the e5m2 output gradients of 1 of the 2 Linear layers lose "
        "1% or more to underflow (wide); --plan FILE with precision=o2_fp8 judges" in text
    )
    convolutional = nn.Sequential(nn.Conv2d(3, 10, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    _, text, _ = cli.preflight(_fp32_trainer(convolutional), 2, tmp_path, "t")
    assert (
        "fp8 (precision=o1_fp8 / o2_fp8 run the Linear layers' GEMMs in fp8): this model has no "
        "Linear layer. Unscaled, e4m3 activations overflow in 0" in text
    )


def test_recommended_scale_keeps_gradients_below_half_of_fp16_max():
    def stats(top: int) -> TensorStats:
        s = TensorStats(1.0, [0] * 254, 0, 0, 0, 0)
        s.bins[top - LOG2_MIN] = 1
        return s

    assert analysis.recommended_scale(stats(-3)) == 2.0**17  # [2^-3, 2^-2) * 2^17 < 2^15
    assert analysis.recommended_scale(stats(-40)) == 2.0**24  # the dynamic scaler's ceiling
    assert analysis.recommended_scale(stats(16)) == 2.0**-2  # too large for fp16 unscaled
    assert analysis.recommended_scale(None) is None


# ---- the command ---------------------------------------------------------------------------------
def _run_diagnose(*args: str, cwd: Path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "runner.diagnose", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_command_prints_its_table_and_logs_a_diagnose_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*FAST, "precision=o2", f"mlflow.tracking_uri={uri}", "+mlflow.tags.note='a b'"]
    result = _run_diagnose(*args, "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "asked for precision=o2" in out and "Recommendation: precision=" in out
    for block in ("fp16: fp16 (max 65504", "bf16: bf16", "fp8: activations in fp8_e4m3"):
        assert block in out
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-diagnose"
    assert run.data.tags["diagnose"] == "true" and run.data.tags["diagnose.target_preset"] == "o2"
    assert run.data.params["precision.opt_level"] == "O0"  # measured in fp32
    # the command as typed, each word as the shell gave it (a value with a space: one word)
    typed = shlex.split(run.data.tags["command"])
    assert typed[1:] == ["-m", "runner.diagnose", *args, "--steps", "2"], typed
    assert shlex.split(run.data.tags["overrides"]) == args
    assert "diag_grad_underflow_frac" in run.data.metrics
    assert run.data.metrics["mem_total_mb"] > 0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "diagnostics")}
    assert artifacts == {
        f"diagnostics/{n}"
        for n in ("layers.csv", "exponents.csv", "grad_exponents.png", "report.txt")
    }
    assert (tmp_path / "diagnostics" / "report.txt").read_text() in out


@pytest.mark.slow
def test_a_reader_that_has_gone_does_not_stop_the_pre_flight(tmp_path):
    """`python -m runner.diagnose ... --plan plan.yaml | head`: once the reader has gone, the
    pre-flight still writes its files and its plan and ends its run FINISHED, exit 0, no
    BrokenPipeError traceback (the first print ended it: the run FAILED, no plan)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = tmp_path / "plan.yaml"
    result = run_cli(
        *FAST, "precision=o2_bf16", f"mlflow.tracking_uri={uri}", "--steps", "2",
        "--plan", str(plan), module="runner.diagnose", cwd=tmp_path, reader_gone=True,
    )  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert plan.is_file() and (tmp_path / "diagnostics" / "report.txt").is_file()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_the_pre_flight_of_a_gpt_names_every_transformer_layer(tmp_path):
    """The pre-flight on a language model: one row per layer of gpt_tiny (the attention's q, k,
    v and proj, the MLP's up and down, the norms, the head), measured on token-id batches."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = _run_diagnose(
        "model=gpt_tiny",
        "data=synthetic_text",
        "data.num_train=4096",
        "data.block_size=32",
        "trainer.batch_size=8",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "precision=o2_bf16",
        f"mlflow.tracking_uri={uri}",
        "--steps",
        "2",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for layer in (
        "blocks.0.attn.q",
        "blocks.0.attn.proj",
        "blocks.1.mlp.down",
        "blocks.1.ln2",
        "ln_f",
        "head",
    ):
        assert f"  {layer} " in result.stdout, layer
    assert "Recommendation: precision=" in result.stdout
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.run_name == "gpt_tiny-diagnose" and run.info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["trainer.batch_size=0"], "trainer.batch_size"),
        # said as `python -m runner` says them (they were Hydra's messages, of several lines)
        (["trainer.max_epoch=2"], "trainer.max_epoch: unknown key; did you mean trainer.max_e"),
        (["model=resnet1000"], "model: unknown option 'resnet1000'; did you mean resnet18"),
        (["trainer.diagnose_every_n_steps=-1"], "trainer.diagnose_every_n_steps"),
        (["precision=o0,o2"], "precision: got o0,o2, the values of a sweep, but the command runs"),
    ],
)
def test_bad_overrides_exit_2_without_a_traceback_or_a_run(tmp_path, args, needle):
    result = _run_diagnose(
        *FAST, *args, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}", cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and needle in output and "Traceback" not in output
    assert not (tmp_path / "m.db").exists()


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--out", "taken"], "Cannot write the diagnostics to taken: "),
        (["--out", "taken/sub"], "is not a folder (a file is in the way)"),
        (["--plan", "folder", "precision=o2"], "--plan folder is a folder; give the plan file's"),
        (["--plan", "taken/plan.yaml", "precision=o2"], "Cannot write the layer plan to taken/"),
    ],
)
def test_outputs_that_cannot_be_written_are_refused_before_the_steps(
    tmp_path, monkeypatch, capsys, flags, says
):
    """Found after the measured steps, an --out that is a file or a --plan that is a folder
    cost the measurement and ended in a traceback (exit 1)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file")
    (tmp_path / "folder").mkdir()
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert cli.main([*flags, *FAST, f"mlflow.tracking_uri={uri}"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "m.db").exists()


def test_an_out_that_cannot_be_made_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A folder the checks cannot foresee failing (under /proc, where even root makes none:
    the check passes for root, and mkdir fails) ended in mkdir's traceback (exit 1); it is
    refused like the others, before the run is tracked."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    out = "/proc/amp-runner-diagnostics"
    assert cli.main(["--out", out, *FAST, f"mlflow.tracking_uri={uri}"]) == 2
    err = capsys.readouterr().err
    assert f"Cannot write the diagnostics to {out}: " in err and "Traceback" not in err
    assert "you can write" in err
    if (tmp_path / "m.db").exists():  # (root: refused after the store was opened, no run)
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("amp-runner")
        assert experiment is None or not client.search_runs([experiment.experiment_id])


def test_an_out_and_a_plan_under_a_tilde_are_in_the_home(monkeypatch):
    """`--out=~/d --plan=~/p.yaml`: the shell leaves a `~` after `=` as it is (a folder named `~`
    was made); both are the home's."""
    monkeypatch.setenv("HOME", "/home/someone")
    args = cli.parse_args(["--out=~/d", "--plan=~/plans/p.yaml", "precision=o2"])
    assert args.out == Path("/home/someone/d") and args.plan == Path("/home/someone/plans/p.yaml")
