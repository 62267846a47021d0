"""Every option of every group composes; bad keys, types, choices and values are refused early."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config import DATASET_NAMES, MODEL_NAMES, OPTIMIZER_NAMES, SCHEDULER_NAMES
from runner.config.finder import config_dir
from runner.config.validation import _rules, setting_problem, validate
from runner.errors import ConfigError
from tests.helpers.runs import compose_config

GROUP_NAMES = {
    "model": MODEL_NAMES,
    "data": DATASET_NAMES,
    "optimizer": OPTIMIZER_NAMES,
    "scheduler": SCHEDULER_NAMES,
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


# option files that configure another name's builder differently: option -> the name it builds
VARIANTS = {"model": {"tiny_gn": "tiny"}}


@pytest.mark.parametrize("group", sorted(GROUP_NAMES))
def test_group_options_are_exactly_the_supported_names(group):
    variants = VARIANTS.get(group, {})
    assert set(options(group)) == set(GROUP_NAMES[group]) | set(variants)
    assert set(variants.values()) <= set(GROUP_NAMES[group])


@pytest.mark.parametrize(
    "group,option",
    [
        (g, o)
        for g in ("model", "data", "optimizer", "scheduler", "precision", "trainer", "mlflow")
        for o in options(g)
    ],
)
def test_every_option_composes(group, option):
    cfg = compose_config(f"{group}={option}")
    node = cfg[group]
    if group in GROUP_NAMES:
        assert node.name == VARIANTS.get(group, {}).get(option, option)
    if group == "precision":
        assert node.opt_level == option.split("_")[0].upper()  # o2_bf16 is still level O2
        assert node.preset == option  # a preset names itself (the opt_level check reads it)
    OmegaConf.to_container(cfg, resolve=True)  # no interpolation left broken


def test_defaults_are_a_sensible_run():
    cfg = compose_config()
    assert cfg.model.name == "resnet18"
    assert cfg.data.name == "cifar10" and cfg.data.download is True
    assert cfg.optimizer.name == "sgd"
    assert cfg.scheduler.name == "cosine"
    assert cfg.precision.opt_level == "O0"
    assert cfg.trainer.batch_size == 128
    assert cfg.mlflow.tracking_uri == "sqlite:///mlflow.db"
    assert cfg.dry_run is False
    synthetic = compose_config("data=synthetic").data
    assert (synthetic.num_train, synthetic.num_val, synthetic.image_size) == (10000, 2000, 32)
    validate(cfg)


APEX_TABLE = {
    "o0": ("float32", False, None, False, 1.0),
    "o1": (None, True, None, None, "dynamic"),
    "o2": ("float16", False, True, True, "dynamic"),
    "o3": ("float16", False, False, False, 1.0),
    # bfloat16 variants: same levels, no loss scaling (bf16 has fp32's exponent range)
    "o1_bf16": (None, True, None, None, 1.0),
    "o2_bf16": ("bfloat16", False, True, True, 1.0),
    "o3_bf16": ("bfloat16", False, False, False, 1.0),
    # beyond Apex: fp8 Linear layers over O1/O2 in bf16; O3 bf16 rounded stochastically
    "o1_fp8": (None, True, None, None, 1.0),
    "o2_fp8": ("bfloat16", False, True, True, 1.0),
    "o3_bf16_sr": ("bfloat16", False, False, False, 1.0),
    # the same levels with Adam's moments in int8 (precision.optimizer_state)
    "o2_bf16_int8state": ("bfloat16", False, True, True, 1.0),
    "o3_bf16_sr_int8state": ("bfloat16", False, False, False, 1.0),
}
AUTOCAST_DTYPE = {"o1": "float16", "o1_bf16": "bfloat16", "o1_fp8": "bfloat16"}
SCALER_KNOBS = dict(
    init_scale=65536.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    hysteresis=1,
    min_loss_scale=None,
    max_loss_scale=16777216.0,
    strict=False,
)


def test_precision_options_are_the_levels_and_their_bf16_variants():
    assert options("precision") == sorted(APEX_TABLE)


@pytest.mark.parametrize("preset", sorted(APEX_TABLE))
def test_precision_presets_fix_the_five_apex_properties(preset):
    p = compose_config(f"precision={preset}").precision
    got = (
        p.cast_model_type,
        p.patch_torch_functions,
        p.keep_batchnorm_fp32,
        p.master_weights,
        p.loss_scale,
    )
    assert got == APEX_TABLE[preset]
    assert p.opt_level == preset.split("_")[0].upper()
    if preset in AUTOCAST_DTYPE:
        assert p.autocast_dtype == AUTOCAST_DTYPE[preset]
    assert {k: p[k] for k in SCALER_KNOBS} == SCALER_KNOBS


def test_bf16_presets_resolve_without_warnings_on_a_cpu_with_bf16_instructions():
    from runner.precision import resolve
    from runner.precision.checks import DeviceInfo

    cpu = DeviceInfo("cpu", None, "a CPU", bf16_matmul_ratio=0.6)  # bf16 faster than fp32
    for preset in ("o1_bf16", "o2_bf16", "o3_bf16"):
        values = dict(compose_config(f"precision={preset}").precision)
        r = resolve(values.pop("opt_level"), values, device=cpu)
        assert not r.findings, (preset, r.findings_table())
        assert torch.bfloat16 in r.properties.compute_dtypes


def test_loss_scaling_knobs_are_keys():
    cfg = compose_config(
        "precision=o2",
        "precision.hysteresis=2",
        "precision.init_scale=1024",
        "precision.min_loss_scale=1",
        "precision.strict=true",
    )
    assert (cfg.precision.hysteresis, cfg.precision.init_scale) == (2, 1024)
    assert cfg.precision.min_loss_scale == 1 and cfg.precision.strict is True
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_config("precision.hysteresis=two")


def test_precision_property_overridable_by_key():
    cfg = compose_config(
        "precision=o2", "precision.master_weights=false", "precision.loss_scale=128"
    )
    assert cfg.precision.master_weights is False
    assert cfg.precision.loss_scale == 128


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["trainer.max_epoch=2"], "trainer.max_epoch"),  # typo'd key
        (["optimizer.lr=fast"], "optimizer.lr"),  # wrong type
        (["trainer.batch_size=1.5"], "trainer.batch_size"),
        (["model=resnet1000"], "model/resnet1000"),  # unknown choice
        (["precision=o4"], "precision/o4"),
        (["optimizer=sgd", "optimizer.eps=1e-4"], "optimizer.eps"),  # key of another option
        (["data=synthetic", "data.root=/tmp"], "data.root"),
        (["model=resnet18", "model.width=8"], "model.width"),
    ],
)
def test_bad_keys_types_and_choices_fail_at_compose_time(overrides, needle):
    with pytest.raises((HydraException, OmegaConfBaseException)) as info:
        compose_config(*overrides)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert needle in text


def test_unknown_choice_lists_the_available_options():
    with pytest.raises(HydraException) as info:
        compose_config("model=resnet1000")
    for name in MODEL_NAMES:
        assert name in str(info.value)


# (overrides, the key the error names): at least one failing case per value rule
VALUE_CASES = [
    (["optimizer.lr=-0.1"], "optimizer.lr"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.lr=nan"], "optimizer.lr"),
    (["optimizer.lr=inf"], "optimizer.lr"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay"),
    (["optimizer.momentum=1.5"], "optimizer.momentum"),
    (["optimizer=adam", "optimizer.eps=0"], "optimizer.eps"),
    (["optimizer=adam", "optimizer.betas=[0.9]"], "optimizer.betas"),
    (["optimizer=adamw", "optimizer.betas=[0.9,1.2]"], "optimizer.betas"),
    (["optimizer.nesterov=true", "optimizer.momentum=0"], "optimizer.nesterov"),
    (["trainer.batch_size=0"], "trainer.batch_size"),
    (["trainer.max_epochs=-1"], "trainer.max_epochs"),
    (["trainer.num_workers=-2"], "trainer.num_workers"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps"),
    (["trainer.limit_train_batches=0"], "trainer.limit_train_batches"),
    (["trainer.limit_train_batches=1.5"], "trainer.limit_train_batches"),  # (a share: at most 1)
    (["trainer.limit_val_batches=0.0"], "trainer.limit_val_batches"),
    (["trainer.limit_val_batches=true"], "trainer.limit_val_batches"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches"),
    (["trainer.grad_clip_norm=-1"], "trainer.grad_clip_norm"),
    (["trainer.device=tpu"], "trainer.device"),
    (["precision.kernels=fast"], "precision.kernels"),
    (["model.name=resnet1000"], "model.name"),
    (["model=tiny", "model.width=0"], "model.width"),
    (["data.name=mnist"], "data.name"),
    (["scheduler=step", "scheduler.gamma=0"], "scheduler.gamma"),
    (["scheduler=onecycle", "scheduler.pct_start=1.0"], "scheduler.pct_start"),
    (["data=cifar10", "data.image_size=64"], "data.image_size"),
    (["data=synthetic", "data.num_classes=1"], "data.num_classes"),
    (["data=synthetic", "data.num_train=0"], "data.num_train"),
    (["data=synthetic", "data.image_size=4"], "data.image_size"),
    (["data=imagefolder"], "data.root"),  # required, not set
    (["data=imagefolder", "data.root=/no/such/folder"], "data.root"),
    (["mlflow.experiment_name= "], "mlflow.experiment_name"),
    (["+trainer.max_epoch=2"], "trainer.max_epoch"),  # Hydra appends with +: still a typo
    (["+optimizer.eps=1e-4"], "optimizer.eps"),
    (["optimizer.dampening=1"], "optimizer.dampening"),
    (["scheduler=cosine", "scheduler.eta_min=-1e-3"], "scheduler.eta_min"),
    (["scheduler=cosine", "scheduler.eta_min=1", "optimizer.lr=0.1"], "scheduler.eta_min"),
    (["scheduler=step", "scheduler.step_epochs=0"], "scheduler.step_epochs"),
    (["scheduler=onecycle", "scheduler.max_lr=0"], "scheduler.max_lr"),
    (["scheduler=onecycle", "scheduler.div_factor=0"], "scheduler.div_factor"),
    (["scheduler=onecycle", "scheduler.final_div_factor=-1"], "scheduler.final_div_factor"),
    (["model=tiny", "model.norm=layer"], "model.norm"),
    (["trainer.seed=-1"], "trainer.seed"),
    (["trainer.seed=99999999999999999999999"], "trainer.seed"),  # past torch's 64 bits
    (["data=synthetic", "data.seed=18446744073709551616"], "data.seed"),
    (["data=synthetic", "data.num_val=0"], "data.num_val"),
    (["data=synthetic", "data.noise=-0.5"], "data.noise"),
    (["data=imagefolder", "data.root=.", "data.num_classes=1"], "data.num_classes"),
    (["optimizer.name=lbfgs"], "optimizer.name"),
    (["scheduler.name=plateau"], "scheduler.name"),
    (["trainer.limit_val_batches=0"], "trainer.limit_val_batches"),
    (["trainer.collapsed_loss_scale=-1"], "trainer.collapsed_loss_scale"),
    (["trainer.checkpoint_every_n_epochs=-1"], "trainer.checkpoint_every_n_epochs"),
    (["trainer.checkpoint_dir= "], "trainer.checkpoint_dir"),
    (["trainer.diagnose_every_n_steps=-1"], "trainer.diagnose_every_n_steps"),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps"),
    (["tracking.name=wandb"], "tracking.name"),
    (["mlflow.tracking_uri= "], "mlflow.tracking_uri"),
    (["mlflow.tracking_uri=/data/runs/mlflow.db"], "mlflow.tracking_uri"),  # (no sqlite:///)
    (["mlflow.tracking_uri=mlflow.sqlite"], "mlflow.tracking_uri"),
    (["mlflow.heartbeat_s=0.5"], "mlflow.heartbeat_s"),
    (["mlflow.system_metrics_s=0.05"], "mlflow.system_metrics_s"),
    (["mlflow.stale_after_s=0"], "mlflow.stale_after_s"),
    (["mlflow.heartbeat_s=60", "mlflow.stale_after_s=100"], "mlflow.stale_after_s"),
    (["trainer.compile_mode=fastest"], "trainer.compile_mode"),
    (["trainer.cuda_graphs=whole"], "trainer.cuda_graphs"),
    (["trainer.cuda_graphs=1"], "trainer.cuda_graphs"),
    (["trainer.tune=always"], "trainer.tune"),
    (["trainer.tune_budget_s=0"], "trainer.tune_budget_s"),
    (["trainer.strategy=zero3"], "trainer.strategy"),
    (["trainer.fsdp_checkpoint=zip"], "trainer.fsdp_checkpoint"),
    (["trainer.fsdp_wrap=[]"], "trainer.fsdp_wrap"),
    (["trainer.fsdp_wrap=[' ']"], "trainer.fsdp_wrap"),
    (["loss.label_smoothing=1.0"], "loss.label_smoothing"),
    (["model=vit_tiny", "model.patch_size=0"], "model.patch_size"),
    (["model=torchvision", "model.arch= "], "model.arch"),
    (["model=vit_tiny", "model.image_size=0"], "model.image_size"),
    (["model=vit_tiny", "model.num_layers=0"], "model.num_layers"),
    (["model=vit_tiny", "model.num_heads=0"], "model.num_heads"),
    (["model=vit_tiny", "model.hidden_dim=0"], "model.hidden_dim"),
    (["model=vit_tiny", "model.mlp_dim=0"], "model.mlp_dim"),
    (["task.name=regression"], "task.name"),
    (["data=synthetic_text", "data.block_size=0"], "data.block_size"),
    (["data=synthetic_text", "data.vocab_size=1"], "data.vocab_size"),
    (["data=synthetic_text", "data.num_train=1"], "data.num_train"),
    (["data=synthetic_text", "data.num_val=1"], "data.num_val"),
    (["data=synthetic_text", "data.branching=0"], "data.branching"),
    (["data=text", "data.path=x", "data.block_size=0"], "data.block_size"),
    (["data=text", "data.path=x", "data.val_fraction=1.0"], "data.val_fraction"),
    (["data=tokens", "data.train=a", "data.val=b", "data.dtype=int8"], "data.dtype"),
    (["data=tokens", "data.train=a", "data.val=b", "data.vocab_size=1"], "data.vocab_size"),
    (["model=gpt_tiny", "model.n_layer=0"], "model.n_layer"),
    (["model=gpt_tiny", "model.n_head=0"], "model.n_head"),
    (["model=gpt_tiny", "model.n_embd=0"], "model.n_embd"),
    (["model=gpt_tiny", "model.block_size=0"], "model.block_size"),
    (["model=gpt_tiny", "model.vocab_size=1"], "model.vocab_size"),
    (["model=gpt_tiny", "model.dropout=1.0"], "model.dropout"),
    (["precision.layer_plan_steps=0"], "precision.layer_plan_steps"),
    (["precision.layer_plan_max_underflow=1.0"], "precision.layer_plan_max_underflow"),
    (["precision.layer_plan_max_overflow=-0.5"], "precision.layer_plan_max_overflow"),
    (["precision.layer_plan_max_overflow=nan"], "precision.layer_plan_max_overflow"),
    (["model=hf", "model.arch=llama", "+model.vocab_size=1"], "model.vocab_size"),
]


def test_the_auto_plan_settings_are_rules_of_the_one_table():
    """precision.layer_plan_steps / _max_underflow / _max_overflow are value rules like every
    other (the plan held a second table of them), said as that table said them."""
    for overrides, said in (
        ("precision.layer_plan_steps=0", "layer_plan_steps: got 0 (allowed: an integer >= 1)"),
        (
            "precision.layer_plan_max_underflow=1.0",
            "layer_plan_max_underflow: got 1.0 (allowed: a share in [0, 1))",
        ),
    ):
        with pytest.raises(ConfigError) as info:
            validate(compose_config(overrides))
        assert str(info.value) == f"precision.{said}"
    assert setting_problem("precision.layer_plan_steps", True) == (
        "precision.layer_plan_steps: got True (allowed: a value of type int)"
    )
    validate(compose_config("precision.layer_plan_max_overflow=0.5"))  # (in range: passes)


@pytest.mark.parametrize("overrides,key", VALUE_CASES)
def test_value_rules_name_the_key(overrides, key):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.key == key
    assert str(info.value).startswith(key + ":")
    assert info.value.allowed  # the message says what is allowed


@pytest.mark.parametrize(
    "given,uri",
    [
        ("/data/runs/mlflow.db", "sqlite:////data/runs/mlflow.db"),
        ("runs/m.db", None),
        ("~/m.db", None),
    ],
)
def test_a_database_path_is_refused_with_its_own_uri(given, uri, monkeypatch, tmp_path):
    """A bare path to a database file (MLflow reads it as a folder store) is refused with the URI
    forms and, to paste, that file's own URI: the launch folder's or the home's, absolute."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    uri = uri or "sqlite:///" + str(tmp_path / given.replace("~", "home"))
    with pytest.raises(ConfigError) as info:
        validate(compose_config(f"mlflow.tracking_uri='{given}'"))  # (quoted: Hydra's ~)
    assert str(info.value).startswith(
        f"mlflow.tracking_uri: got {given!r}, a path; its URI: {uri} ("
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["data=synthetic"],
        ["data=cifar10"],
        ["data=imagefolder"],
        ["data=text"],
        ["data=tokens"],
        ["data=synthetic_text"],
        ["model=gpt_tiny"],
        ["model=vit_tiny"],
        ["model=tiny"],
    ],
)
def test_every_value_rule_has_a_failing_case(overrides):
    """A rule added to runner.config.validation without a case above is a rule nobody saw fail."""
    covered = {key for _, key in VALUE_CASES} | {"data.root"}  # cifar's: the test below
    rules = {key for key, _, _ in _rules(compose_config(*overrides))}
    assert rules - covered == set()


@pytest.mark.parametrize(
    "overrides,given,taker",
    [
        (["model=gpt_tiny", "data=synthetic_text", "data.block_size=0"], "data", "model"),
        (["model=vit_tiny", "data=synthetic", "data.image_size=0"], "data", "model"),
        (["model=gpt_tiny", "data=synthetic_text", "model.block_size=0"], "model", None),
    ],
)
def test_a_bad_value_is_named_where_it_was_given_not_where_it_is_copied(overrides, given, taker):
    """model.block_size is `${oc.select:data.block_size,256}`: `data.block_size=0` broke the
    model's rule first and was reported as model.block_size, a key the user never typed."""
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    leaf = overrides[-1].split("=")[0].rpartition(".")[2]
    assert info.value.key == f"{given}.{leaf}"
    if taker is not None:
        assert f"which {taker}.{leaf} takes" in str(info.value)
    assert info.value.allowed


def test_cifar_root_that_is_a_file_is_refused(tmp_path: Path):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="data.root"):
        validate(compose_config("data=cifar10", f"data.root={a_file}"))


def test_valid_values_pass():
    for overrides in (
        ["optimizer=adam", "optimizer.lr=3e-4"],
        ["optimizer=sgd", "optimizer.nesterov=true"],
        ["scheduler=onecycle", "scheduler.max_lr=0.5"],
        ["trainer.grad_clip_norm=1.0", "trainer.limit_train_batches=3"],
    ):
        validate(compose_config(*overrides))
    assert not math.isnan(compose_config().optimizer.lr)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("trainer.num_workers", 3, None),
        ("trainer.num_workers", -1, "trainer.num_workers: got -1 (allowed: an integer >= 0)"),
        ("trainer.num_workers", "3", "trainer.num_workers: got '3' (allowed: a value of type int)"),
        ("trainer.compile", 1, "trainer.compile: got 1 (allowed: a value of type bool)"),
        ("trainer.pin_memory", None, None),
        ("trainer.compile_mode", "max-autotune", None),
        ("trainer.cuda_graphs", "step", None),
        ("trainer.cuda_graphs", True, None),
        (
            "trainer.cuda_graphs",
            "whole",
            "trainer.cuda_graphs: got 'whole' (allowed: false, optimizer, step (true: optimizer))",
        ),
        (
            "precision.kernels",
            "fast",
            "precision.kernels: got 'fast' (allowed: auto, fused, torch)",
        ),
        ("precision.kernels", "torch", None),
        ("model._target_", "os.system", "model._target_ is not a key of a typed section"),
        ("trainer.nope", 1, "trainer.nope is not a key of a typed section"),
    ],
)
def test_a_value_from_outside_the_config_is_checked_as_the_config_would_be(key, value, said):
    """A value that does not come through Hydra (a tune cache's row) gets the schema's type,
    exactly (OmegaConf would turn "3" into 3 at a typed int), and the key's rule: the one
    account of what a key may hold, in words `validate` uses."""
    found = setting_problem(key, value)
    if said is None:
        assert found is None
    else:
        assert found is not None and found.startswith(said), found
    if said is None:  # what is allowed here passes validate too, set on a composed config
        cfg = compose_config()
        OmegaConf.update(cfg, key, value, merge=False)
        validate(cfg)
