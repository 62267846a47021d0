"""Each precision property is declared once (runner.config.precision.PROPERTIES): a row added in a
fixture, and nowhere else, is typed by the schema Hydra composes with, parsed (bad values refused
with the key named), resolved into Properties, logged as a param and shown in the run name."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest
import torch
from hydra.errors import ConfigCompositionException

import runner.config
from runner.config import precision as table
from runner.config.levels import LEVEL_VALUES, SCALER_DEFAULTS
from runner.errors import ConfigError
from runner.precision import recipe, resolve
from runner.precision.properties import (
    LEVELS,
    LossScale,
    Properties,
    parse_property,
    resolve_properties,
)
from runner.run.plan import default_run_name
from tests.helpers.runs import compose_config


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


# ---- Properties' fields are the table's rows --------------------------------------------------
# `Properties` takes its fields from the table (`recipe.property_types()`: each row's type from its
# kind; its values are keyed by the table at run time). These tests hold the fields to the table:
# name by name, in order, type by type, every default (the table's and each level's) a value of
# its field's type, and no property declared anywhere but in the table.


def _field_type(row: table.Property) -> Any:
    """The type a row's value has in `Properties`, read from the row alone: a dtype's name
    becomes a torch.dtype, the layers' mapping an ordered tuple of (glob, format) pairs, a
    nullable row Optional."""
    if row.kind == "number":
        base: Any = int if row.integer else float
    else:
        base = {
            "dtype": torch.dtype,
            "bool": bool,
            "choice": str,
            "loss_scale": LossScale,
            "layers": tuple[tuple[str, str], ...],
            "layer_plan": str,
        }[row.kind]
    return Optional[base] if row.allow_none else base


def _fits(value: Any, tp: Any) -> bool:
    """`value` is a value of the annotation `tp` (exact types: a bool is no int, an int no
    float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return any(_fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    if tp is type(None):
        return value is None
    if tp in (bool, int, float, str):
        return type(value) is tp
    return isinstance(value, tp)


def test_properties_fields_are_the_tables_rows():
    fields = typing.get_type_hints(Properties)
    assert list(fields) == list(table.property_names())  # name by name, in the table's order
    for row in table.PROPERTIES:
        assert fields[row.name] == _field_type(row), row.name


def test_a_property_is_declared_in_the_table_alone():
    """The table is the one declaration of a property: `Properties` spells none out in its body
    (its fields are the rows'), every kind a row may have is parsed and typed, and each level's
    values and the loss scaler's defaults name rows of the table. A property (or a kind) written
    in one of these places and not in the other fails here."""
    tree = ast.parse(Path(recipe.__file__).read_text())
    (body,) = [n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Properties"]
    targets = [n.target for n in body if isinstance(n, ast.AnnAssign)]
    targets += [t for n in body if isinstance(n, ast.Assign) for t in n.targets]
    spelled = {t.id for t in targets if isinstance(t, ast.Name)}
    assert spelled & set(table.property_names()) == set()
    kinds = set(typing.get_args(table.Kind))
    assert set(table._PARSERS) == kinds
    assert set(recipe.KIND_TYPES) == kinds - {"number"}  # (a number: int or float, by its row)
    for level, values in LEVEL_VALUES.items():
        assert set(values) <= set(table.property_names()), level
    assert set(SCALER_DEFAULTS) <= set(table.property_names())


def test_a_new_row_is_a_field_of_properties(dummy_property):
    assert recipe.property_types()["dummy_knob"] is float
    assert list(recipe.property_types())[-1] == "dummy_knob"


def test_every_default_is_a_value_of_its_field():
    fields = typing.get_type_hints(Properties)
    for row in table.PROPERTIES:  # the table's default, as the engine reads it
        value = parse_property(row.name, row.default)
        assert _fits(value, fields[row.name]), (row.name, value)
    for level in LEVELS:  # each level's own values on top of the table's defaults
        props, _ = resolve_properties(level)
        for name in table.property_names():
            value = getattr(props, name)
            assert _fits(value, fields[name]), (level, name, value)


def test_the_field_check_would_catch_a_wrong_type():
    """The checks are not vacuous: a float is no int, a dtype's name no torch.dtype."""
    assert not _fits(2000.0, int) and not _fits(True, int) and not _fits(1, float)
    assert not _fits("bfloat16", Optional[torch.dtype]) and _fits(None, Optional[torch.dtype])
    assert _fits("dynamic", LossScale) and not _fits("static", LossScale)
    assert _fits((("head", "float32"),), tuple[tuple[str, str], ...])
    assert not _fits({"head": "float32"}, tuple[tuple[str, str], ...])
    row = table.property_for("growth_interval")
    assert _field_type(dataclasses.replace(row, integer=False)) is float


def test_properties_keeps_no_default_of_its_own():
    """The defaults live in the table alone: `Properties` assigns none (a class-level value would
    also shadow the resolved one), and it refuses to be built without every row's value."""
    for name in table.property_names():
        assert name not in vars(Properties), name
    props, _ = resolve_properties("O2", {"growth_interval": 7, "loss_scale": 128})
    assert (props.growth_interval, props.loss_scale) == (7, 128.0)
    values = {n: getattr(props, n) for n in table.property_names()}
    del values["growth_interval"]
    with pytest.raises(TypeError, match="missing \\['growth_interval'\\]"):
        Properties("O2", **values)
