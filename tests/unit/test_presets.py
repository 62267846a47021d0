"""The precision presets after the level table moved into code (`runner.config.levels`): every
preset composes and resolves to exactly what it did when each YAML spelled out every property
(tests/helpers/preset_values.json was captured from those files before the change; the
optimizer_state property and its two presets were added to it with that property, the layer plan's
keys with theirs: no entry, no plan file, the auto plan's default settings)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from runner.precision import resolve
from runner.run.plan import preset_options
from tests.helpers.runs import HELPERS, compose_config

BEFORE = json.loads((HELPERS / "preset_values.json").read_text())


def test_the_presets_are_the_ones_captured():
    assert preset_options() == sorted(BEFORE)


@pytest.mark.parametrize("preset", sorted(BEFORE))
def test_a_preset_composes_and_resolves_as_before(preset):
    values = OmegaConf.to_container(compose_config(f"precision={preset}").precision, resolve=True)
    assert values == BEFORE[preset]["composed"]
    properties = resolve(values.pop("opt_level"), values).properties
    assert properties.as_params() == BEFORE[preset]["resolved"]
