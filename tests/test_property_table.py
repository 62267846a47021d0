"""Each precision property is declared once (runner.config.precision.PROPERTIES): a row added in a
fixture, and nowhere else, is typed by the schema Hydra composes with, parsed (bad values refused
with the key named), resolved into Properties, logged as a param and shown in the run name."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

import runner.config
from runner.config import precision as table
from runner.errors import ConfigError
from runner.precision import resolve
from runner.run.plan import default_run_name
from tests.conftest import compose_config


@pytest.fixture
def dummy_property(monkeypatch):
    """A seventh kind of knob, as a contributor would add it: one row of the table."""
    row = table.Property(
        "dummy_knob",
        "number",
        0.5,
        float,
        "a number in [0, 1]",
        check=lambda x: 0 <= x <= 1,
        allowed="a number in [0, 1]",
        suffix=lambda params: "knob" if params.get("dummy_knob") != "0.5" else None,
    )
    monkeypatch.setattr(table, "PROPERTIES", [*table.PROPERTIES, row])
    runner.config.register_configs()  # the schemas, stored again from the table
    yield row
    monkeypatch.undo()
    runner.config.register_configs()


def test_the_table_names_every_property_once():
    names = table.property_names()
    assert len(names) == len(set(names))
    assert names[:5] == (
        "cast_model_type",
        "patch_torch_functions",
        "keep_batchnorm_fp32",
        "master_weights",
        "loss_scale",
    )


def test_a_new_row_is_in_the_schema(dummy_property):
    cfg = compose_config("precision=o2", "precision.dummy_knob=0.25")
    assert cfg.precision.dummy_knob == 0.25
    assert compose_config("precision=o1").precision.dummy_knob == 0.5  # the row's default
    with pytest.raises(ConfigCompositionException, match="dummy_knob"):
        compose_config("precision=o2", "precision.dummy_knob=plenty")  # typed: a float


def test_a_new_row_is_parsed_resolved_and_logged(dummy_property):
    assert table.parse("dummy_knob", "0.75") == 0.75
    with pytest.raises(ConfigError) as bad:
        table.parse("dummy_knob", 2)
    assert bad.value.key == "precision.dummy_knob" and "a number in [0, 1]" in str(bad.value)
    props = resolve("O2", {"dummy_knob": 0.25}).properties
    assert props.dummy_knob == 0.25
    assert props.as_params()["dummy_knob"] == "0.25"
    assert "dummy_knob" in props.table()
    assert resolve("O2").properties.dummy_knob == 0.5


def test_a_new_row_names_the_run(dummy_property):
    cfg = compose_config("precision=o2_bf16", "model=tiny", "precision.dummy_knob=0.25")
    assert default_run_name(cfg) == "tiny-O2-bf16-knob"
    assert default_run_name(compose_config("precision=o2_bf16", "model=tiny")) == "tiny-O2-bf16"


def test_the_schema_is_back_without_the_row():
    with pytest.raises(ConfigCompositionException, match="dummy_knob"):
        compose_config("precision=o2", "precision.dummy_knob=0.25")
    with pytest.raises(ConfigError, match="precision.dummy_knob"):
        resolve("O2", {"dummy_knob": 0.25})
