"""Precision per layer (runner.precision.layers, runner.run.autoplan, runner.measure.audit): the
entries and plan files, every refusal before any work, the enforcement on the tiny CNN, vit_tiny
and gpt_tiny, what ran where, a plan from measured ranges, resume, the report.

Numerics: a layer planned in fp32 inside a bf16 model is compared with the same layer computed in
fp32 by hand on the same inputs: equal bit for bit (the same ops in the same type).
"""

from __future__ import annotations

import csv
import math
import tempfile
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from runner.config import precision as ptable
from runner.errors import ConfigError, LayerPlanError
from runner.measure import audit as layer_audit
from runner.measure import diagnostics as diag
from runner.precision import AmpEngine, resolve
from runner.precision import layers as L
from runner.run import app, autoplan, layer_ranges, recorded
from runner.run.plan import default_run_name, make_plan
from tests.helpers.runs import FAST, TINY, compose_config, run_cli


def props(level: str = "O2", **overrides):
    base = {
        "O1": {"patch_torch_functions": True, "autocast_dtype": "bfloat16", "loss_scale": 1.0},
        "O2": {"cast_model_type": "bfloat16", "loss_scale": 1.0},
        "O3": {"cast_model_type": "bfloat16", "loss_scale": 1.0},
        "O0": {},
    }[level]
    return resolve(level, {**base, **overrides}).properties


def prepared(model: nn.Module, level: str = "O2", rules=(), **overrides):
    p = props(level, **overrides)
    rules = [r if isinstance(r, L.LayerRule) else L.LayerRule(*r) for r in rules]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = AmpEngine(p, "cpu", kernels="torch", layer_rules=rules)
    engine.prepare(model, opt)
    return engine, opt


class TinyNet(nn.Module):
    """conv -> BN -> relu -> pool -> head, with names to plan by."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 10))

    def forward(self, x):
        return self.head(nn.functional.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 4))


# ---- the entries ---------------------------------------------------------------------------------
def test_formats_by_any_spelling_and_bad_ones_name_the_glob():
    assert ptable.parse_layers({"head": "fp32", "*norm*": "BF16", "mlp": "e4m3"}) == (
        ("head", "float32"),
        ("*norm*", "bfloat16"),
        ("mlp", "fp8"),
    )
    assert ptable.parse_layers(None) == () and ptable.parse_layers({}) == ()
    with pytest.raises(ConfigError) as bad:
        ptable.parse_layers({"head": "fp4"})
    assert bad.value.key == "precision.layers.head" and "fp8" in str(bad.value)
    assert ptable.parse_layer_format("x", torch.float16) == "float16"


def test_layers_from_the_command_line_name_the_run_and_log_one_param():
    cfg = compose_config(
        *FAST,
        "precision=o2_bf16",
        "+precision.layers.5=float32",
        "+precision.layers={0.*: float32}",
    )
    assert list(cfg.precision.layers.items()) == [("5", "float32"), ("0.*", "float32")]
    plan = make_plan(cfg)
    assert plan.run_name == "tiny-O2-bf16-plan"
    params = recorded.config_params(plan)
    assert params["precision.layers"] == "{5: float32, 0.*: float32}"
    assert not any(k.startswith("precision.layers.") for k in params)  # (a glob: no param name)
    assert (
        default_run_name(compose_config(*FAST, "precision=o2_bf16", "precision.layer_plan=auto"))
        == "tiny-O2-bf16-autoplan"
    )
    long = ptable.layers_string(tuple((f"blocks.{i}.mlp.*", "fp8") for i in range(200)))
    assert len(long) <= 400 and long.endswith("(200 entries)}")


def test_a_module_name_hydra_reads_as_a_number(tmp_path):
    """A Sequential's modules are named 5, 0.1: Hydra reads `{5: float32}` with the key 5, an
    int, which the schema refused ("Key 5 (int) is incompatible with (str)", a dead end). An int
    is its name; a float has lost its text (1.10 is 1.1, another module): refused, saying how."""
    cfg = compose_config(*FAST, "precision=o2_bf16", "+precision.layers={5: float32}")
    plan = make_plan(cfg)
    assert recorded.config_params(plan)["precision.layers"] == "{5: float32}"
    with pytest.raises(ConfigError) as bad:
        make_plan(compose_config(*FAST, "precision=o2_bf16", "+precision.layers={1.10: float32}"))
    assert bad.value.key == "precision.layers"
    assert "the module name 1.1 arrived as a number: Hydra reads a name such as 0.1" in str(
        bad.value
    )
    assert "('+precision.layers={1.10*: float32}')" in str(bad.value)
    with_glob = compose_config(*FAST, "precision=o2_bf16", "+precision.layers={0.1*: float32}")
    assert recorded.config_params(make_plan(with_glob))["precision.layers"] == "{0.1*: float32}"
    plan_file = tmp_path / "plan.yaml"  # (YAML reads them so too, unquoted)
    plan_file.write_text("5: float32\n'0.1': float32\n")
    assert [(r.pattern, r.format) for r in L.load_plan_file(plan_file)] == [
        ("5", "float32"),
        ("0.1", "float32"),
    ]
    plan_file.write_text("1.10: float32\n")
    with pytest.raises(ConfigError, match=f"the plan file {plan_file}: the module name 1.1 arr"):
        L.load_plan_file(plan_file)


# ---- plan files ---------------------------------------------------------------------------------
def test_a_plan_file_in_either_form_reads_back_in_order(tmp_path):
    short = tmp_path / "short.yaml"
    short.write_text("head: fp32\n'*norm*': float32\nblocks.*.mlp.*: fp8\n")
    assert [(r.pattern, r.format) for r in L.load_plan_file(short)] == [
        ("head", "float32"),
        ("*norm*", "float32"),
        ("blocks.*.mlp.*", "fp8"),
    ]
    rules = [L.LayerRule("fc", "float32", "x", "its outputs overflow"), L.LayerRule("a.b", "fp8")]
    long = tmp_path / "long.yaml"
    long.write_text(L.plan_yaml(rules, ["a header"]))
    assert long.read_text().startswith("# a header\n")
    back = L.load_plan_file(long)
    assert [(r.pattern, r.format, r.why) for r in back] == [
        ("fc", "float32", "its outputs overflow"),
        ("a.b", "fp8", ""),
    ]
    assert all(r.source == str(long) and r.key == "precision.layer_plan" for r in back)
    none = tmp_path / "none.yaml"  # an auto plan that found nothing to change
    none.write_text("# every layer as the level makes it\nlayers: {}\n")
    assert L.load_plan_file(none) == []


@pytest.mark.parametrize(
    "text, says",
    [
        (None, "does not exist"),
        ("head: [float32\n", "not valid YAML"),
        ("- head\n- float32\n", "not a mapping"),
        ("", "holds nothing"),
        ("layers: {head: float32}\nextra: 1\n", "unknown key(s) extra"),
        ("{}\n", "names no layer"),
        ("head: double\n", "'head': unknown layer format"),
        ("!!python/object/apply:os.system ['touch pwned']\n", "not valid YAML"),
    ],
)
def test_a_bad_plan_file_is_refused_naming_the_key_and_the_file(tmp_path, text, says):
    path = tmp_path / "plan.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as bad:
        L.load_plan_file(path)
    assert bad.value.key == "precision.layer_plan" and says in str(bad.value)
    assert str(path) in str(bad.value)
    assert not (tmp_path / "pwned").exists()


# ---- refusals before any work -------------------------------------------------------------------
@pytest.mark.parametrize(
    "level, overrides, layers, says",
    [
        ("O0", {}, {"head": "bfloat16"}, "bfloat16 under O0"),
        (
            "O2",
            {"cast_model_type": "float16", "loss_scale": "dynamic"},
            {"head": "bfloat16"},
            "bfloat16 in a float16 run",
        ),
        ("O3", {}, {"head": "fp8"}, "fp8 under O3"),
        ("O0", {}, {"head": "fp8"}, "fp8 under O0"),
        (
            "O1",
            {"autocast_dtype": "float16", "loss_scale": "dynamic"},
            {"head": "fp8"},
            "fp8 under O1",
        ),
        ("O2", {"master_weights": False}, {"head": "fp8"}, "keeps no masters"),
    ],
)
def test_a_format_the_level_cannot_run_is_an_error_naming_the_entry(level, overrides, layers, says):
    p = props(level, **overrides, layers=layers)
    (finding,) = [f for f in L.rule_findings(p, L.config_rules(p)) if f.level == "error"]
    assert finding.key == "precision.layers.head" and says in finding.message


def test_every_level_takes_fp32_and_its_own_type():
    for level, fmt in (
        ("O0", "float32"),
        ("O1", "bfloat16"),
        ("O2", "bfloat16"),
        ("O3", "float32"),
        ("O2", "fp8"),
        ("O1", "fp8"),
    ):
        p = props(level, layers={"x": fmt})
        assert not [f for f in L.rule_findings(p, L.config_rules(p)) if f.level == "error"], (
            level,
            fmt,
        )


def _exit_2_without_a_run(tmp_path, *overrides) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli(f"mlflow.tracking_uri={uri}", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists() or not MlflowClient(uri).search_runs(
        [e.experiment_id for e in MlflowClient(uri).search_experiments()]
    )
    return result.stderr + result.stdout


@pytest.mark.slow  # two CLI processes
def test_the_cli_exits_2_for_an_impossible_format_and_an_unmatched_glob(tmp_path):
    text = _exit_2_without_a_run(tmp_path, *FAST, "precision=o0", "+precision.layers.5=bf16")
    assert "precision.layers.5" in text and "bfloat16 under O0" in text
    plan = tmp_path / "plan.yaml"
    plan.write_text("output: float32\n")  # torchtitan #4008: the head is called `head` here
    text = _exit_2_without_a_run(
        tmp_path,
        "model=gpt_tiny",
        "data=synthetic_text",
        "precision=o2_bf16",
        f"precision.layer_plan={plan}",
    )
    assert "precision.layer_plan" in text and "'output'" in text and "head" in text


def test_the_renamed_head_is_caught_before_anything_is_built():
    """torchtitan #4008: its fp8 exclusion said `output` after the head became `lm_head`; here
    the plan names `lm_head` and the model calls it `head`: refused, with the closest name."""
    cfg = compose_config(
        "model=gpt_tiny",
        "data=synthetic_text",
        "precision=o1_fp8",
        "+precision.layers.lm_head=bfloat16",
    )
    with pytest.raises(ConfigError) as bad:
        make_plan(cfg)
    assert bad.value.key == "precision.layers.lm_head"
    assert "matches no module of GPT" in str(bad.value) and "closest module names: head" in str(
        bad.value
    )


def test_globs_that_cannot_mean_anything_are_refused():
    model = TinyNet()
    p = props("O2")
    with pytest.raises(ConfigError, match="matches no module.*closest module names: head"):
        L.assign(model, [L.LayerRule("heads", "float32")], p)
    with pytest.raises(ConfigError, match=r"matches only modules without parameters \(head.0\)"):
        L.assign(model, [L.LayerRule("head.0", "float32")], p)
    with pytest.raises(ConfigError, match="gives fp8 to bn.*not an nn.Linear"):
        L.assign(model, [L.LayerRule("bn", "fp8")], p)
    odd = nn.Sequential(nn.Linear(10, 32))
    with pytest.raises(ConfigError, match="in_features 10 not a multiple of 16"):
        L.assign(odd, [L.LayerRule("0", "fp8")], p)


def test_tied_weights_must_keep_one_type():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.out = nn.Linear(8, 16, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.emb(x))

    with pytest.raises(ConfigError, match="tied weights"):
        L.assign(Tied(), [L.LayerRule("out", "float32")], props("O2"))
    L.assign(Tied(), [L.LayerRule("*", "float32")], props("O2"))  # both fp32: fine


class Attending(nn.Module):
    """A projection, torch's attention (whose forward computes with out_proj's weights without
    calling out_proj) and a head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.proj(x)
        return self.head(self.attn(h, h, h)[0].mean(1))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_attentions_out_proj_cannot_be_planned_apart_from_the_attention(level):
    p = props(level)
    with pytest.raises(ConfigError) as bad:
        L.assign(Attending(), [L.LayerRule("attn.out_proj", "float32")], p)
    assert bad.value.key == "precision.layers.attn.out_proj"
    assert "MultiheadAttention computes with out_proj's weights in its own forward" in str(
        bad.value
    )
    assert "an entry 'attn'" in str(bad.value)
    with pytest.raises(ConfigError, match="attn.out_proj as bfloat16.* and attn as float32"):
        L.assign(
            Attending(),
            [L.LayerRule("attn", "float32"), L.LayerRule("attn.out_proj", "bfloat16")],
            p,
        )
    plan = L.assign(Attending(), [L.LayerRule("attn", "float32")], p)  # the whole attention
    assert plan.get("attn.out_proj").expect.compute == "float32"
    assert plan.get("attn.out_proj").inside == "attn" and plan.get("head").inside == ""


def test_an_attention_planned_whole_runs_on_plan_in_a_cast_model():
    model = Attending()
    engine, opt = prepared(model, "O2", [("attn", "float32")])
    audit = layer_audit.DtypeAudit(
        [(layer.name, model.get_submodule(layer.name)) for layer in engine.layer_plan]
    )
    with audit:
        loss = model(torch.randn(2, 5, 8)).float().sum()
        engine.backward(loss)
        audit.observe_grads()
    rows = {r["layer"]: r for r in engine.layer_plan.compare(audit.read())}
    inner = rows["attn.out_proj"]
    assert not inner["off_plan"] and inner["weights"] == "float32"
    assert "computed inside attn's forward" in inner["note"]
    assert not any(r["off_plan"] for r in rows.values())


def test_a_later_entry_wins_and_a_module_gives_its_format_to_everything_inside():
    model = TinyNet()
    p = props("O2")
    plan = L.assign(model, [L.LayerRule("*", "float32"), L.LayerRule("head", "bfloat16")], p)
    assert plan.formats() == {"conv": "float32", "bn": "float32", "head.1": "bfloat16"}
    plan = L.assign(model, [L.LayerRule("head.1", "bfloat16"), L.LayerRule("*", "float32")], p)
    assert set(plan.formats().values()) == {"float32"}
    plan = L.assign(model, [], p)
    assert plan.formats() == {
        "conv": "bfloat16",
        "bn": "bfloat16 (fp32 weights)",
        "head.1": "bfloat16",
    }
    assert (
        not plan.deviates
        and plan.digest() != L.assign(model, [L.LayerRule("head", "float32")], p).digest()
    )


# ---- enforcement and numerics --------------------------------------------------------------------
def _dtypes_seen(model: nn.Module, x: torch.Tensor, engine) -> dict[str, tuple]:
    seen = {}

    def keep(name, module, inputs, output) -> None:
        seen.setdefault(name, (inputs[0].dtype, output.dtype))

    hooks = [
        m.register_forward_hook(lambda mod, i, o, n=n: keep(n, mod, i, o))
        for n, m in model.named_modules()
        if list(m.parameters(recurse=False))
    ]
    with engine.autocast():
        out = model(x)
    for h in hooks:
        h.remove()
    return seen, out


def test_o2_keeps_the_planned_layers_in_fp32_exactly():
    torch.manual_seed(0)
    model = TinyNet()
    reference = TinyNet()
    reference.load_state_dict(model.state_dict())
    engine, _ = prepared(model, "O2", [("head", "float32"), ("bn", "float32")])
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        "conv.weight": torch.bfloat16,
        "conv.bias": torch.bfloat16,
        "bn.weight": torch.float32,
        "bn.bias": torch.float32,
        "head.1.weight": torch.float32,
        "head.1.bias": torch.float32,
    }
    x = torch.randn(4, 3, 8, 8)
    seen, out = _dtypes_seen(model, x, engine)
    assert seen == {
        "conv": (torch.bfloat16, torch.bfloat16),
        "bn": (torch.float32, torch.float32),
        "head.1": (torch.float32, torch.float32),
    }
    # the conv computes in bf16 as the level says, bn and head in fp32: as casting by hand
    conv = reference.conv.to(torch.bfloat16)
    features = conv(x.to(torch.bfloat16)).float()
    reference.bn.train()
    pooled = nn.functional.adaptive_avg_pool2d(torch.relu(reference.bn(features)), 4)
    want = reference.head(pooled)  # bn and head in fp32, on the bf16 conv's outputs
    assert out.dtype == torch.float32 and torch.equal(out, want)


def test_o3_and_o3_bf16_sr_train_with_fp32_layers():
    for overrides in ({}, {"stochastic_rounding": True}):
        torch.manual_seed(0)
        model = TinyNet()
        engine, opt = prepared(model, "O3", [("head", "float32")], **overrides)
        before = model.head[1].weight.detach().clone()
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        assert engine.step(opt)
        assert (
            model.head[1].weight.dtype == torch.float32
            and model.conv.weight.dtype == torch.bfloat16
        )
        assert not torch.equal(before, model.head[1].weight)


def test_o1_runs_a_planned_module_and_its_functional_ops_outside_autocast():
    torch.manual_seed(0)
    model = TinyNet()
    reference = TinyNet()
    reference.load_state_dict(model.state_dict())
    engine, _ = prepared(model, "O1", [("head", "float32")])
    x = torch.randn(4, 3, 8, 8)
    seen, out = _dtypes_seen(model, x, engine)
    assert seen["conv"][1] == torch.bfloat16 and seen["head.1"] == (torch.float32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pooled = nn.functional.adaptive_avg_pool2d(torch.relu(reference.bn(reference.conv(x))), 4)
    want = reference.head(pooled.float())  # outside autocast: fp32
    assert torch.equal(out, want)
    engine.remove_hooks()  # the wrapper comes off: the class's forward again
    assert "forward" not in model.head.__dict__


def test_the_plan_survives_a_deep_copy():
    import copy

    model = TinyNet()
    engine, _ = prepared(model, "O1", [("head", "float32")])
    twin = copy.deepcopy(model)
    assert twin.head.forward.__self__ is twin.head
    with engine.autocast():
        assert twin(torch.randn(2, 3, 8, 8)).dtype == torch.float32


# ---- what ran where ------------------------------------------------------------------------------
class Upcasting(nn.Linear):
    """A layer that computes in fp32 whatever its weights' type (as some custom code does)."""

    def forward(self, x):
        return nn.functional.linear(x.float(), self.weight.float(), self.bias.float())


class WithUpcast(nn.Module):
    def __init__(self, num_classes: int = 10, image_size: int = 8):
        super().__init__()
        self.body = nn.Linear(3 * image_size * image_size, 32)
        self.sneaky = Upcasting(32, num_classes)

    def forward(self, x):
        return self.sneaky(torch.relu(self.body(x.flatten(1))))


def test_the_audit_sees_each_layers_dtypes_and_flags_what_ran_off_plan():
    model = WithUpcast()
    engine, opt = prepared(model, "O2")
    audit = layer_audit.DtypeAudit(
        [(layer.name, model.get_submodule(layer.name)) for layer in engine.layer_plan]
    )
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    with audit:
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        audit.observe_grads()
    rows = {r["layer"]: r for r in engine.layer_plan.compare(audit.read())}
    assert rows["body"]["observed"] == "bfloat16" and not rows["body"]["off_plan"]
    assert rows["body"]["grads"] == "bfloat16" and rows["body"]["weights"] == "bfloat16"
    sneaky = rows["sneaky"]
    assert (
        sneaky["off_plan"] and sneaky["observed"] == "float32" and sneaky["planned"] == "bfloat16"
    )
    assert "computed in float32, planned bfloat16" in sneaky["note"]
    assert layer_audit.counts(rows.values()) == {"fp32": 1, "bf16": 1, "fp16": 0, "fp8": 0}


def test_the_figure_is_worth_drawing_only_where_it_shows_more_than_one_colour():
    def row(planned, observed, off_plan=False):
        return {"planned": planned, "observed": observed, "off_plan": off_plan}

    assert not layer_audit.worth_a_figure([row("float32", "float32")] * 3)
    assert not layer_audit.worth_a_figure([row("float16", "float16")] * 3)
    assert not layer_audit.worth_a_figure([row("bfloat16 (autocast)", "bfloat16")] * 3)
    assert layer_audit.worth_a_figure([row("float32", "float32"), row("bfloat16", "bfloat16")])
    assert layer_audit.worth_a_figure([row("float32", "float32"), row("float32", "not called")])
    assert layer_audit.worth_a_figure([row("float32", "float32", off_plan=True)])


class UsesInnerWeights(nn.Module):
    """A layer of the user's whose forward computes with its child's weights without calling
    the child (which the plan cannot know of beforehand)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.inner = nn.Linear(16, 16)

    def forward(self, x):
        return nn.functional.linear(x * self.scale, self.inner.weight, self.inner.bias)


def test_a_layer_whose_forward_never_runs_is_named_when_an_entry_planned_it():
    model = nn.Sequential(UsesInnerWeights())
    engine, _ = prepared(model, "O1", [("0.inner", "float32")])
    audit = layer_audit.DtypeAudit(
        [(layer.name, model.get_submodule(layer.name)) for layer in engine.layer_plan]
    )
    with audit, engine.autocast():
        model(torch.randn(2, 16))
    rows = {r["layer"]: r for r in engine.layer_plan.compare(audit.read())}
    assert rows["0.inner"]["observed"] == "not called" and rows["0.inner"]["off_plan"]
    assert "never ran" in rows["0.inner"]["note"]


def test_strict_stops_a_run_whose_layer_ran_off_plan(tmp_path, caplog, monkeypatch):
    """A layer that computes off its plan is warned of, or with precision.strict stops the run
    (FAILED). A run started without Hydra's output folder (as here) keeps its audit's files in a
    temporary folder only until its store took them: none is left behind, finished or failed."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # (this process's temporary folders)
    base = [
        "model=custom",
        "model._target_=tests.unit.test_layer_plan.WithUpcast",
        "+model.image_size=8",
        "data=synthetic",
        "data.num_train=64",
        "data.num_val=32",
        "data.image_size=8",
        "trainer.batch_size=32",
        "trainer.max_epochs=1",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "precision=o2_bf16",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
    ]
    app.run(compose_config(*base, "mlflow.run_name=warned"))
    assert "sneaky (Upcasting) ran off plan" in caplog.text
    app.run(compose_config(*base, "precision=o0", "mlflow.run_name=uniform"))
    with pytest.raises(LayerPlanError, match="sneaky.*computed in float32, planned bfloat16"):
        app.run(compose_config(*base, "precision.strict=true", "mlflow.run_name=strict"))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    }
    assert runs["warned"].info.status == "FINISHED"
    assert runs["warned"].data.metrics["layers_off_plan"] == 1

    def layer_files(name: str) -> set[str]:
        return {a.path for a in client.list_artifacts(runs[name].info.run_id, "layers")}

    # the figure where it shows something (a layer off plan), not where every layer ran as
    # planned in one format (O0: all fp32); the table in both
    assert {"layers/layers_ran.csv", "layers/layers_ran.png"} <= layer_files("warned")
    assert runs["uniform"].data.metrics["layers_fp32"] == 2
    assert "layers/layers_ran.csv" in layer_files("uniform")
    assert "layers/layers_ran.png" not in layer_files("uniform")
    assert (
        runs["strict"].info.status == "FAILED"
        and "ran off plan" in runs["strict"].data.tags["error"]
    )
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("amp-")]


# ---- end to end, as users run it -----------------------------------------------------------------
def _artifact(client, run, path, tmp_path) -> str:
    return Path(client.download_artifacts(run.info.run_id, path, str(tmp_path))).read_text()


@pytest.mark.slow  # a CLI process with DataLoader workers and the progress bar
def test_a_plan_file_keeps_the_tiny_cnns_head_and_norms_in_fp32_and_the_run_says_so(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("'*.1': float32   # every BatchNorm\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli(
        *TINY,
        "trainer.batch_size=32",
        "trainer.max_epochs=1",
        "precision=o2_bf16",
        f"precision.layer_plan={plan}",
        "+precision.layers.5=float32",
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.run_name == "tiny-O2-bf16-plan"
    assert run.data.params["precision.layer_plan"] == str(plan)
    assert run.data.params["precision.layers"] == "{5: float32}"
    assert len(run.data.tags["precision.layer_plan_hash"]) == 12
    rows = {
        r["layer"]: r
        for r in csv.DictReader(
            _artifact(client, run, "layers/layers_ran.csv", tmp_path).splitlines()
        )
    }
    assert {k: (r["planned"], r["observed"]) for k, r in rows.items()} == {
        "0.0": ("bfloat16", "bfloat16"),
        "0.1": ("float32", "float32"),
        "1.0": ("bfloat16", "bfloat16"),
        "1.1": ("float32", "float32"),
        "2.0": ("bfloat16", "bfloat16"),
        "2.1": ("float32", "float32"),
        "5": ("float32", "float32"),
    }
    assert rows["5"]["why"] == "precision.layers['5']" and rows["0.1"]["why"] == f"{plan}: '*.1'"
    assert run.data.metrics["layers_off_plan"] == 0
    assert (run.data.metrics["layers_fp32"], run.data.metrics["layers_bf16"]) == (4, 3)
    again = tmp_path / "again.yaml"  # the logged plan is a plan file: the same plan again
    again.write_text(_artifact(client, run, "layers/layer_plan.yaml", tmp_path))
    assert [(r.pattern, r.format) for r in L.load_plan_file(again)] == [
        ("0.1", "float32"),
        ("1.1", "float32"),
        ("2.1", "float32"),
        ("5", "float32"),
    ]
    assert "layers/layers_ran.png" in [
        f.path for f in client.list_artifacts(run.info.run_id, "layers")
    ]


def test_vit_tiny_keeps_its_head_and_norms_in_fp32(tmp_path):
    plan = tmp_path / "norms.yaml"
    plan.write_text("'*ln*': float32\n")  # (a glob starting with * needs a file or a config file)
    cfg = compose_config(
        "model=vit_tiny",
        "data=synthetic",
        "data.num_train=32",
        "data.num_val=16",
        "data.image_size=32",
        "trainer.batch_size=16",
        "trainer.max_epochs=1",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "precision=o2_bf16",
        f"precision.layer_plan={plan}",
        "+precision.layers.heads=float32",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
        "optimizer=adamw",
    )
    app.run(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    rows = {
        r["layer"]: r
        for r in csv.DictReader(
            _artifact(client, run, "layers/layers_ran.csv", tmp_path).splitlines()
        )
    }
    norms = [k for k in rows if "ln" in k.rsplit(".", 1)[-1]]
    assert norms and all(rows[k]["observed"] == "float32" for k in norms)
    assert rows["heads.head"]["observed"] == rows["heads.head"]["planned"] == "float32"
    mlp = [k for k in rows if ".mlp." in k]
    assert mlp and all(rows[k]["observed"] == "bfloat16" for k in mlp)
    assert [(k, r["note"]) for k, r in rows.items() if r["off_plan"] == "True"] == []


def test_gpt_tiny_with_fp8_on_the_mlp_and_an_fp32_head_runs_exactly_so(tmp_path):
    """o2_bf16 with the MLP projections in fp8 and the head in fp32: torchao converts exactly the
    four MLP layers, the head's weights stay fp32, and layers_ran.csv shows both."""
    pytest.importorskip("torchao")
    cfg = compose_config(
        "model=gpt_tiny",
        "data=synthetic_text",
        "trainer.batch_size=8",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "precision=o2_bf16",
        "+precision.layers={blocks.*.mlp.*: fp8}",
        "+precision.layers.head=float32",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
    )
    app.run(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.data.params["precision.fp8_layers"] == "4"
    listing = _artifact(client, run, "fp8_layers.txt", tmp_path)
    fp8 = sorted(line.split()[1] for line in listing.splitlines() if line.startswith("fp8 "))
    assert fp8 == ["blocks.0.mlp.down", "blocks.0.mlp.up", "blocks.1.mlp.down", "blocks.1.mlp.up"]
    rows = {
        r["layer"]: r
        for r in csv.DictReader(
            _artifact(client, run, "layers/layers_ran.csv", tmp_path).splitlines()
        )
    }
    assert sorted(k for k, r in rows.items() if r["observed"] == "fp8") == fp8
    assert rows["blocks.0.attn.q"]["observed"] == "bfloat16"
    assert (rows["head"]["planned"], rows["head"]["observed"], rows["head"]["weights"]) == (
        "float32",
        "float32",
        "float32",
    )
    assert run.data.metrics["layers_off_plan"] == 0 and run.data.metrics["layers_fp8"] == 4


def test_at_o1_fp8_a_plan_keeps_fp8_to_the_mlp():
    pytest.importorskip("torchao")
    cfg = compose_config(
        "model=gpt_tiny",
        "data=synthetic_text",
        "precision=o1_fp8",
        "+precision.layers={blocks.*.attn.*: bfloat16, head: bfloat16}",
    )
    layer_plan = make_plan(cfg).layer_check
    assert sorted(layer_plan.fp8_layers()) == [
        "blocks.0.mlp.down",
        "blocks.0.mlp.up",
        "blocks.1.mlp.down",
        "blocks.1.mlp.up",
    ]


# ---- a plan from measured ranges -----------------------------------------------------------------
def _stats(values, scale=1.0) -> diag.TensorStats:
    return diag.tensor_stats(
        [torch.tensor(values, dtype=torch.float32)], list(diag.FORMATS.values()), scale
    )


def test_the_shares_count_the_values_a_format_loses():
    s = _stats([1e-9, 1e-6, 3e-5, 1.0, 7e4, 2e5, float("inf")])
    assert layer_ranges.underflow_share(s, diag.FP16) == pytest.approx(3 / 7)  # exact: the probe's
    assert layer_ranges.overflow_share(s, diag.FP16) == pytest.approx(3 / 7)
    # at loss scale 2^10 (from the histogram): 1e-9 * 1024 < 2^-14 still; 1e-6 * 1024 is not
    assert layer_ranges.underflow_share(s, diag.FP16, 1024.0) == pytest.approx(1 / 7)
    # 1.0 * 2^16 = 65536 > 65504, and the bin [1, 2) straddles nothing: counted
    assert layer_ranges.overflow_share(s, diag.FP16, 2.0**16) == pytest.approx(4 / 7)
    # fp8 per-tensor scaling: the largest finite bin is 2^17; e4m3 keeps 2^14.8 below it
    t = _stats([2.0**17, 2.0**5, 2.0**1, 1.0])
    assert layer_ranges.scaled_underflow_share(t, diag.FP8_E4M3) == pytest.approx(2 / 4)


def test_a_layer_with_huge_gradients_goes_to_fp32_so_the_others_keep_a_high_scale():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    p = resolve("O2").properties  # fp16, dynamic loss scale
    small = _stats([1e-7] * 50 + [1e-5] * 50)  # needs a scale of 2^10 or more
    huge = _stats([1e3] * 100)  # overflows fp16 above a scale of 2^5
    act = _stats([1.0] * 10)
    records = [
        diag.LayerRecord(1, name, "Linear", kind, stats)
        for name, grad in (("0", small), ("1", huge), ("2", small))
        for kind, stats in (("input", act), ("activation", act), ("activation_grad", grad))
    ]
    auto = autoplan.decide(model, records, {}, p, layer_ranges.Thresholds(0.01, 0.0), "o2", 3)
    assert {d.name: d.format for d in auto.decisions} == {
        "0": "float16",
        "1": "float32",
        "2": "float16",
    }
    assert auto.scale >= 2.0**10 and "2 of 3" in auto.scale_note
    assert [(r.pattern, r.format) for r in auto.rules] == [("1", "float32")]
    assert "of its gradients overflow fp16 at loss scale" in auto.decisions[1].why


def test_a_layer_the_pre_flight_did_not_see_takes_the_format_of_the_layer_around_it():
    model = Attending()
    p = resolve("O2").properties
    fine, hot = _stats([1.0] * 10), _stats([1e6] * 10)  # hot overflows fp16
    records = [
        diag.LayerRecord(1, name, "x", kind, stats)
        for name, act in (("proj", fine), ("attn", hot), ("head", fine))  # (out_proj: not run)
        for kind, stats in (("input", fine), ("activation", act), ("activation_grad", fine))
    ]
    auto = autoplan.decide(model, records, {}, p, layer_ranges.Thresholds(0.01, 0.0), "o2", 3)
    got = {d.name: d.format for d in auto.decisions}
    assert got == {
        "proj": "float16",
        "attn": "float32",
        "attn.out_proj": "float32",
        "head": "float16",
    }
    assert "attn's, the layer around it" in auto.decisions[2].why
    assert [(r.pattern, r.format) for r in auto.rules] == [("attn", "float32")]
    L.assign(model, auto.rules, p)  # a plan the run takes


def test_fp8_only_where_torchaos_shape_rule_and_the_ranges_allow_it():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 2048), nn.Linear(256, 256), nn.LayerNorm(256))
    p = props("O1", fp8_linear="tensorwise")
    fine = _stats([1.0, 0.5, 0.25, 2.0])
    wide = _stats([1.0] * 10 + [1e-12] * 90)  # 90% below e4m3's range under scaling
    records = [
        diag.LayerRecord(1, name, "x", kind, stats)
        for name in ("0", "1", "2")
        for kind, stats in (("input", fine), ("activation", fine), ("activation_grad", fine))
    ]
    weights = {"0": fine, "1": fine, "2": fine}
    auto = autoplan.decide(model, records, weights, p)
    got = {d.name: d.format for d in auto.decisions}
    assert got == {"0": "fp8", "1": "bfloat16", "2": "bfloat16"}
    assert "torchao.float8._auto_filter_for_recipe" in auto.decisions[1].why
    assert [(r.pattern, r.format) for r in auto.rules] == [("1", "bfloat16")]  # level: fp8
    auto = autoplan.decide(model, records, {"0": wide}, p)
    assert auto.decisions[0].format == "bfloat16" and "e4m3" in auto.decisions[0].why


@pytest.mark.slow  # uniform fp16 (emulated), an auto-planned run, diagnose --plan and its run
def test_a_layer_that_overflows_fp16_is_kept_wider_and_the_run_trains(tmp_path):
    """HotMLP's `hot` layer outputs above fp16's max: uniform O2 skips its steps (the forward
    overflows whatever the loss scale); the auto plan keeps `hot` and `norm` (its input) in fp32
    and the run trains without a skipped step. The same plan from diagnose --plan, run again."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = [
        "model=custom",
        "model._target_=tests.helpers.layer_models.HotMLP",
        "+model.image_size=8",
        "data=synthetic",
        "data.num_train=128",
        "data.num_val=32",
        "data.image_size=8",
        "trainer.batch_size=32",
        "trainer.max_epochs=2",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "precision=o2",
        "optimizer=adamw",
        f"mlflow.tracking_uri={uri}",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
    ]
    app.run(compose_config(*base, "mlflow.run_name=uniform"))
    # as users run it: DataLoader workers and the progress bar on
    app.run(
        compose_config(
            *base,
            "precision.layer_plan=auto",
            "mlflow.run_name=auto",
            "trainer.num_workers=2",
            "trainer.progress_bar=true",
        )
    )
    plan_file = tmp_path / "plan.yaml"
    result = run_cli_diagnose(tmp_path, *base, "--plan", str(plan_file), "--steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Layer plan for precision=o2" in result.stdout
    app.run(compose_config(*base, f"precision.layer_plan={plan_file}", "mlflow.run_name=file"))
    client = MlflowClient(uri)
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
        if r.data.tags.get("diagnose") != "true"
    }
    uniform, auto, file = runs["uniform"], runs["auto"], runs["file"]
    assert uniform.data.metrics["skipped_steps"] >= 4 and math.isnan(
        uniform.data.metrics["val_loss"]
    )
    for run in (auto, file):
        assert run.data.metrics["skipped_steps"] == 0 and math.isfinite(
            run.data.metrics["val_loss"]
        )
        rows = {
            r["layer"]: r
            for r in csv.DictReader(
                _artifact(client, run, "layers/layers_ran.csv", tmp_path).splitlines()
            )
        }
        assert {k: r["observed"] for k, r in rows.items()} == {
            "stem": "float16",
            "hot": "float32",
            "norm": "float32",
            "head": "float16",
        }
    entries = {r.pattern: (r.format, r.why) for r in L.load_plan_file(plan_file)}
    assert set(entries) == {"hot", "norm"}
    assert "overflows" in entries["norm"][1] and "inputs" in entries["norm"][1]
    assert "# amp-runner layer plan for precision=o2" in plan_file.read_text()
    auto_yaml = _artifact(client, auto, "layers/auto_plan.yaml", tmp_path)
    assert "stem: float16 (the level)" in auto_yaml


def run_cli_diagnose(tmp_path: Path, *args: str):
    import os
    import subprocess
    import sys

    from tests.helpers.runs import REPO

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "runner.diagnose", "--out", str(tmp_path / "diag"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---- resume --------------------------------------------------------------------------------------
def test_a_planned_run_resumes_bit_identical_and_refuses_an_edited_plan(tmp_path):
    from tests.helpers.resume import last_checkpoint, straight_and_resumed
    from tests.helpers.store import history, runs_by_name

    plan = tmp_path / "plan.yaml"
    plan.write_text("'5': float32\n'*.1': float32\n")
    extra = (
        "precision=o2_bf16",
        f"precision.layer_plan={plan}",
        "optimizer=adamw",
        "scheduler=step",
        "scheduler.step_epochs=1",
    )
    uri = straight_and_resumed(tmp_path, *extra)
    runs = runs_by_name(uri)
    got, want = (
        history(uri, runs["resumed"].info.run_id),
        history(uri, runs["straight"].info.run_id),
    )
    assert got.pop("best_val_acc")[-1] == want.pop("best_val_acc")[-1]
    assert got == want
    a, b = last_checkpoint(tmp_path, "straight"), last_checkpoint(tmp_path, "resumed")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["layer_plan"]["layers"]["5"] == "float32"
    plan.write_text("'5': bfloat16\n'*.1': float32\n")  # edited since: another plan
    from tests.helpers.resume import settings

    with pytest.raises(ConfigError, match=r"layer_plan.5: float32 -> bfloat16"):
        app.run(
            compose_config(
                *settings(tmp_path, *extra),
                "trainer.max_epochs=3",
                "mlflow.run_name=resumed",
                "resume=auto",
            )
        )


def test_an_auto_planned_run_resumes_with_its_checkpoints_plan(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = [
        "model=custom",
        "model._target_=tests.helpers.layer_models.HotMLP",
        "+model.image_size=8",
        "data=synthetic",
        "data.num_train=64",
        "data.num_val=32",
        "data.image_size=8",
        "trainer.batch_size=32",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "precision=o2",
        "precision.layer_plan=auto",
        f"mlflow.tracking_uri={uri}",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
        "mlflow.run_name=auto",
    ]
    app.run(compose_config(*base, "trainer.max_epochs=1"))

    def no_preflight(*args, **kwargs):
        raise AssertionError("a resumed auto plan must not measure again")

    monkeypatch.setattr(autoplan, "preflight", no_preflight)
    app.run(compose_config(*base, "trainer.max_epochs=2", "resume=auto"))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["skipped_steps"] == 0


# ---- the report ----------------------------------------------------------------------------------
def test_the_report_counts_the_layers_per_format():
    from runner.report.analysis import Row
    from runner.report.tables import columns, layer_counts

    row = Row(
        "id",
        "r",
        "FINISHED",
        "tiny",
        "sgd",
        "O2",
        "bfloat16",
        32,
        metrics={"layers_fp32": 3.0, "layers_bf16": 4.0, "layers_fp16": 0.0, "layers_fp8": 0.0},
    )
    assert layer_counts(row) == "3/4/0/0"
    titles = [t for t, _ in columns([row])]
    assert titles[titles.index("dtype") + 1] == "layers fp32/bf16/fp16/fp8"
    assert layer_counts(Row("id", "r", "FINISHED", "tiny", "sgd", "O2", "x", 32)) == "-"


def test_a_dry_run_prints_the_plan(capsys):
    app.run(
        compose_config(*FAST, "precision=o2_bf16", "+precision.layers.5=float32", "dry_run=true")
    )
    out = capsys.readouterr().out
    assert "Layer plan:" in out and "precision.layers['5']" in out
    app.run(compose_config(*FAST, "precision=o2_bf16", "precision.layer_plan=auto", "dry_run=true"))
    assert (
        "Layer plan: auto, measured before training by a pre-flight of 3 fp32 steps"
        in capsys.readouterr().out
    )
