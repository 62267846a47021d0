"""Each fact is declared once: a default, a name, a dtype's spelling, a bound. A group file in
conf/ restates no default of its schema; where a second copy must stand (a module that may import
nothing of the runner), these tests hold it equal to the first, key by key."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner.config import formats, schema
from runner.config import precision as table
from runner.config.finder import config_dir
from runner.config.levels import SCALER_DEFAULTS
from runner.diagnose import analysis as diagnose
from runner.errors import ConfigError
from runner.measure import audit, diagnostics
from runner.precision.dtypes import HALF_DTYPES, TORCH_DTYPES, dtype_name
from runner.precision.properties import resolve_properties
from runner.report.analysis import describe_dtype
from runner.report.tables import LAYER_FORMATS
from runner.tasks import TASK_CLASSES
from tests.helpers.runs import compose_config


def _restated(path: Path) -> list[str] | None:
    """The keys a group file sets to the value its schema already gives them: the dataclass's
    default, or (a precision preset) its level's. None where the file has no schema (`_target_`
    options, whose keys are a callable's arguments). A required key (`???`) sets no value."""
    stated = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    schemas = [
        d.split("@")[0].lstrip("/") + ".yaml"
        for d in stated.pop("defaults", None) or []
        if isinstance(d, str) and d.startswith("/schema/")
    ]
    if not schemas:
        return None
    store = ConfigStore.instance()
    given = OmegaConf.to_container(
        OmegaConf.merge(*(store.load(s).node for s in schemas)), resolve=False
    )
    return [k for k, v in stated.items() if k in given and v == given[k] and v != "???"]


GROUP_FILES = sorted(p.relative_to(config_dir()) for p in config_dir().glob("*/*.yaml"))


@pytest.mark.parametrize("path", GROUP_FILES, ids=str)
def test_no_group_file_restates_its_schemas_defaults(path):
    """A default lives in its dataclass only (Hydra's structured config): a group file sets what
    differs from it (its name, its own values), never a copy of a default."""
    assert not _restated(config_dir() / path), f"{path} restates its schema's defaults"


def test_the_restated_check_finds_a_restated_default(tmp_path):
    """Not vacuous: every typed file is read against its schema, and a default restated in one,
    a level's value restated in a preset, are found; a value of the file's own is not."""
    typed = [p for p in GROUP_FILES if _restated(config_dir() / p) is not None]
    assert {p.parts[0] for p in typed} >= {"trainer", "mlflow", "data", "model", "precision"}
    trainer = tmp_path / "trainer.yaml"
    trainer.write_text(
        "defaults:\n  - /schema/trainer/default@_here_\n  - _self_\n\nbatch_size: 128\nseed: 7\n"
    )
    assert _restated(trainer) == ["batch_size"]
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "defaults:\n  - /schema/precision/apex@_here_\n  - /schema/precision/level/O2@_here_\n"
        "  - _self_\n\npreset: mine\nloss_scale: dynamic\ncast_model_type: bfloat16\n"
    )
    assert _restated(preset) == ["loss_scale"]  # O2's own; bfloat16 is the preset's


def test_the_composed_defaults_are_the_dataclasses():
    cfg = compose_config()
    nodes = {
        "trainer": schema.TrainerConfig,
        "mlflow": schema.MlflowConfig,
        "task": schema.TaskConfig,
        "tracking": schema.TrackingConfig,
    }
    for group, cls in nodes.items():
        assert OmegaConf.to_container(cfg[group]) == OmegaConf.to_container(
            OmegaConf.structured(cls)
        ), group
    assert cfg.mlflow.experiment_name == schema.DEFAULT_EXPERIMENT


def test_task_names_are_the_task_group_and_the_tasks():
    choices = sorted(p.stem for p in (config_dir() / "task").glob("*.yaml"))
    assert choices == sorted(schema.TASK_CHOICES)
    assert set(TASK_CLASSES) == set(schema.TASKS)
    assert {cls.name for cls in TASK_CLASSES.values()} == set(schema.TASKS)


def test_short_names_are_one_table():
    assert audit.SHORT_NAMES == formats.SHORT_NAMES  # measure restates it (it imports no config)
    assert LAYER_FORMATS == ("fp32", "bf16", "fp16", "fp8")
    for fmt in (diagnostics.FP16, diagnostics.BF16):
        assert fmt.name == formats.SHORT_NAMES[dtype_name(fmt.dtype)]


def test_torch_dtypes_come_from_the_names():
    assert tuple(TORCH_DTYPES) == formats.FLOAT_TYPES
    assert all(dtype_name(dtype) == name for name, dtype in TORCH_DTYPES.items())
    assert tuple(dtype_name(d) for d in HALF_DTYPES) == formats.HALF_TYPES


def _spellings(name: str) -> list:
    """Every way a user or a caller may name the format `name`."""
    out = [name, name.upper(), f"torch.{name}", f" {name} "]
    out += [alias for alias, target in formats.ALIASES.items() if target == name]
    if name in TORCH_DTYPES:
        out.append(TORCH_DTYPES[name])
    return out


@pytest.mark.parametrize("name", formats.LAYER_FORMATS)
def test_every_spelling_reads_alike_wherever_a_format_is_read(name):
    for spelt in _spellings(name):
        assert table.parse_layer_format("precision.layers.x", spelt) == name, spelt
        assert table.parse("optimizer_state", spelt) == name, spelt
        if name in formats.FLOAT_TYPES:
            assert table.parse("cast_model_type", spelt) == name, spelt
            assert formats.dtype_name_of(spelt) == name, spelt
        else:
            assert formats.dtype_name_of(spelt) is None, spelt
            with pytest.raises(ConfigError, match="precision.cast_model_type"):
                table.parse("cast_model_type", spelt)


@pytest.mark.parametrize(
    "cast, masters",
    list(itertools.product(["float32", "float16", "bfloat16", None], [True, False, None])),
)
def test_the_stepped_type_is_one_rule(cast, masters):
    """`Properties.stepped_dtype` (torch) and the params' stepped type (the run name's state
    suffix, the report) are the same rule."""
    props, _ = resolve_properties("O2", {"cast_model_type": cast, "master_weights": masters})
    params = props.as_params()
    name = formats.stepped_dtype_name(params["cast_model_type"], params["master_weights"])
    assert dtype_name(props.stepped_dtype) == name
    assert props.state_format == name  # no optimizer_state: the stepped weights' own type
    assert describe_dtype({**params, "optimizer_state": name}).count("state") == 0


def test_the_scaler_bounds_are_the_scalers():
    """The pre-flight's recommended scale stops where the dynamic scaler would."""
    tiny_gradients = SimpleNamespace(max_log2=-60)  # what diagnose reads of the gradient ranges
    assert diagnose.recommended_scale(tiny_gradients) == SCALER_DEFAULTS["max_loss_scale"]
    assert table.property_for("max_loss_scale").default == SCALER_DEFAULTS["max_loss_scale"]


def test_every_metric_name_is_in_the_registry_and_its_docs():
    """Every metric name a run logs is declared once, in runner.metrics, which the writers (the
    trainer, the instruments), the report and the sweep's summary import; docs/results.md's
    list of what is logged names each of them (a name added to the registry without its line
    there fails here)."""
    from runner import metrics
    from tests.helpers.runs import REPO

    names = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)}
    names.discard(metrics.SUMMARY_PREFIX)
    names -= {metrics.LAYERS_IN, metrics.DIAG_GRAD, metrics.DIAG_ACT}  # (prefixes, below)
    names |= set(metrics.TIMING) | {metrics.memory_metric(k) for k in metrics.MEMORY_KINDS}
    names |= {f"{metrics.LAYERS_IN}{f}" for f in ("fp32", "bf16", "fp16", "fp8")}
    text = (REPO / "docs" / "results.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text and not n.startswith("model."))
    assert missing == [], missing
    assert f"`{metrics.SUMMARY_PREFIX}`" in text
    for prefix in (metrics.DIAG_GRAD, metrics.DIAG_ACT):
        assert f"`{prefix}_" in text
