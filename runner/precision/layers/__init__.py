"""Precision per layer: formats given by module name on top of the level, enforced on the model,
and compared afterwards with what each layer computed in ("what ran where").

- `rules`: the entries (`LayerRule`) from `precision.layers` and plan files, read and written;
- `findings`: what the level and the device say about the entries' formats, before any model;
- `assignment`: the plan for one model (`assign` -> `LayerPlan`) and what ran where;
- `enforcement`: the plan enforced on the built model (`enforce`).

How plans are matched, refused, enforced and audited: README.md beside this file. The names
below are the package's whole interface (`from runner.precision import layers; layers.assign`).
"""

from runner.precision.layers.assignment import (
    Expect,
    LayerPlan,
    PlannedLayer,
    assign,
    exact_glob,
    fp8_ineligible,
    level_expect,
    param_layers,
    rule_expect,
    text_table,
)
from runner.precision.layers.enforcement import Enforcement, enforce
from runner.precision.layers.findings import LAYER_RULES, fp8_refusal, level_half, rule_findings
from runner.precision.layers.rules import (
    AUTO,
    DTYPES,
    FP8,
    LAYERS_KEY,
    PLAN_KEY,
    SHORT,
    LayerRule,
    config_rules,
    load_plan_file,
    parse_plan,
    plan_yaml,
)

__all__ = [
    "AUTO",
    "DTYPES",
    "FP8",
    "LAYERS_KEY",
    "LAYER_RULES",
    "PLAN_KEY",
    "SHORT",
    "Enforcement",
    "Expect",
    "LayerPlan",
    "LayerRule",
    "PlannedLayer",
    "assign",
    "config_rules",
    "enforce",
    "exact_glob",
    "fp8_ineligible",
    "fp8_refusal",
    "level_expect",
    "level_half",
    "load_plan_file",
    "param_layers",
    "parse_plan",
    "plan_yaml",
    "rule_expect",
    "rule_findings",
    "text_table",
]
