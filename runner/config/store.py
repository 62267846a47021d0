"""The schemas registered in Hydra's ConfigStore, where the YAML files of conf/ find them.

`base_run` types the root, `schema/<group>/<kind>` types each option (option files pull theirs
with `- /schema/<group>/<kind>@_here_` in their defaults list, which keeps the schemas out of the
group's list of choices), `schema/precision/level/<level>` holds each Apex level's properties.
Importing `runner.config` registers them once (`register_configs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from runner.config.levels import LEVEL_VALUES
from runner.config.options import schemas
from runner.config.precision import precision_schema
from runner.config.schema import (
    MlflowConfig,
    PrecisionConfig,
    RunConfig,
    TaskConfig,
    TrackingConfig,
    TrainerConfig,
)

SCHEMAS: dict[str, dict[str, type]] = {
    **schemas(),  # model, data, optimizer and scheduler: from the option specs
    "precision": {"apex": PrecisionConfig},
    "trainer": {"default": TrainerConfig},
    "task": {"default": TaskConfig},
    "mlflow": {"default": MlflowConfig},
    "tracking": {"default": TrackingConfig},
}


def _by_reference(cls: type, name: str) -> type:
    """A schema made at run time, reachable as `runner.config.store.<name>`: pickled by
    reference (a sweep launcher that sends the config store to its workers, joblib's or
    submitit's, pickles the class by name), not by value, which would copy dataclasses' MISSING
    sentinel of a field with a default factory (precision.layers) and lose its default there."""
    cls.__module__, cls.__qualname__, cls.__name__ = __name__, name, name
    globals()[name] = cls
    return cls


def register_configs() -> None:
    """Store the schemas: `base_run` types the root, `schema/<group>/<kind>` types each option,
    `schema/precision/level/<level>` holds each Apex level's properties.

    The precision node is derived from the property table (runner.config.precision) each time,
    so a property added to the table is typed everywhere once the schemas are stored again.
    """
    precision = _by_reference(precision_schema(), "PrecisionConfig")
    root = _by_reference(
        dataclasses.make_dataclass(  # RunConfig, its precision typed by today's table
            "RunConfig", [("precision", precision, field(default=MISSING))], bases=(RunConfig,)
        ),
        "TypedRunConfig",
    )
    cs = ConfigStore.instance()
    cs.store(name="base_run", node=root)
    for group, kinds in {**SCHEMAS, "precision": {"apex": precision}}.items():
        for kind, node in kinds.items():
            cs.store(group=f"schema/{group}", name=kind, node=node)
    # a precision preset pulls its level's properties with `- /schema/precision/level/O2@_here_`
    # and states only what differs (the level table is defined once, in runner.config.levels)
    for level, values in LEVEL_VALUES.items():
        cs.store(group="schema/precision/level", name=level, node={"opt_level": level, **values})


register_configs()
