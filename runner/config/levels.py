"""Apex amp's optimization levels and the loss-scaler defaults: the one table of each.

Torch-free on purpose: `runner.config` registers a config node per level from `LEVEL_VALUES` (the
preset files in conf/precision/ name their level and only what differs from it) and takes the
scaler's defaults from `SCALER_DEFAULTS`, before Hydra composes and before torch is imported.
`runner.precision.properties.LEVELS` is this table with the dtype names parsed.
"""

from __future__ import annotations

from typing import Any

# The five properties each Apex level fixes (apex/amp/frontend.py), dtypes by name.
LEVEL_VALUES: dict[str, dict[str, Any]] = {
    "O0": dict(
        cast_model_type="float32",
        patch_torch_functions=False,
        keep_batchnorm_fp32=None,
        master_weights=False,
        loss_scale=1.0,
    ),
    "O1": dict(
        cast_model_type=None,
        patch_torch_functions=True,
        keep_batchnorm_fp32=None,
        master_weights=None,
        loss_scale="dynamic",
    ),
    "O2": dict(
        cast_model_type="float16",
        patch_torch_functions=False,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale="dynamic",
    ),
    "O3": dict(
        cast_model_type="float16",
        patch_torch_functions=False,
        keep_batchnorm_fp32=False,
        master_weights=False,
        loss_scale=1.0,
    ),
}

# Dynamic loss scaling knobs (Apex's / torch.amp.GradScaler's defaults; hysteresis is
# DeepSpeed's, 1 = Apex). They only matter when loss_scale is "dynamic".
SCALER_DEFAULTS: dict[str, Any] = dict(
    init_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    hysteresis=1,
    min_loss_scale=None,
    max_loss_scale=2.0**24,
)
