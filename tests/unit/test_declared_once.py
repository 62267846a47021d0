"""Each fact is declared once: a default, a name, a dtype's spelling, a bound. Where a second copy
must stand (a YAML file users read, a module that may import nothing of the runner), these tests
hold it equal to the first, key by key."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
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

# Each group file whose keys restate its schema's defaults, with that schema.
RESTATED = {
    "trainer/default.yaml": schema.TrainerConfig,
    "mlflow/default.yaml": schema.MlflowConfig,
    "task/auto.yaml": schema.TaskConfig,
    "tracking/mlflow.yaml": schema.TrackingConfig,
}


@pytest.mark.parametrize("path", sorted(RESTATED))
def test_a_group_file_states_its_schema_defaults_as_they_are(path):
    """The dataclass is the source; the YAML (what users read and copy) may only repeat it."""
    stated = OmegaConf.to_container(OmegaConf.load(config_dir() / path))
    stated.pop("defaults")
    defaults = {f.name: f for f in dataclasses.fields(RESTATED[path])}
    unknown = sorted(set(stated) - set(defaults))
    assert unknown == [], f"{path} states keys its schema lacks: {unknown}"
    source = OmegaConf.to_container(OmegaConf.structured(RESTATED[path]))
    differ = {k: (v, source[k]) for k, v in stated.items() if v != source[k]}
    assert differ == {}, f"{path}: (YAML, dataclass) where they differ: {differ}"


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
