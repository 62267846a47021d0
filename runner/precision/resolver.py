"""`resolve`: a level and overrides in, the properties to run with and every finding about them out.

The rules run in a fixed order: those about the combination of properties
(`properties.LEVEL_RULES`), then those about the machine (`checks.DEVICE_RULES`), then those
about the optimizer (`optimizer_rules.OPTIMIZER_RULES`). This module sits above them, so none
imports another's rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from runner.precision.checks import DEVICE_RULES, DeviceInfo
from runner.precision.optimizer_rules import OPTIMIZER_RULES
from runner.precision.properties import (
    LEVEL_RULES,
    Context,
    Resolution,
    resolve_properties,
    strict_finding,
)

RULES = (*LEVEL_RULES, *DEVICE_RULES, *OPTIMIZER_RULES)


def resolve(
    opt_level: str,
    overrides: Mapping[str, Any] | None = None,
    device: Any = None,
    *,
    optimizer: Optional[Mapping[str, Any]] = None,
    compiled: Optional[bool] = None,
    strict: Optional[bool] = None,
) -> Resolution:
    """Level defaults, then `overrides` by key, parsed and normalised; then every rule's findings.

    `overrides` may be the whole precision config (see `properties.resolve_properties`; its
    `strict` key is read like the `strict` argument). `device` is a torch.device, a device string
    or a `checks.DeviceInfo` (None: unknown, no hardware rules). `optimizer` is the optimizer
    config (`name`, `eps`, ...; None: no optimizer rules). `compiled`: whether the forward runs
    through torch.compile (None: unknown). `strict=True` turns every warning into an error.
    """
    props, strict_from_config = resolve_properties(opt_level, overrides)
    if strict is None:
        strict = strict_from_config
    if device is not None and not isinstance(device, DeviceInfo):
        device = DeviceInfo.from_torch(device)
    ctx = Context(device=device, optimizer=optimizer, compiled=compiled)
    findings = [f for r in RULES for f in r(props, ctx)]
    if strict:
        findings = [strict_finding(f) for f in findings]
    return Resolution(properties=props, findings=findings)
