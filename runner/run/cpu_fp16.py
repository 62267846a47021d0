"""fp16 on a CPU: a run that would not finish in reasonable time is refused in planning.

A CPU has no fp16 arithmetic: torch emulates it, about a hundred times slower than bfloat16.
`python -m runner precision=o2 model=densenet161 data=synthetic` on a 2-core CPU ran at 550 s a
step, weeks for its default run, after a warning finding it ran past. So where a level computes
in float16 on a CPU (O1, O2, O3, and fp16 overrides), the run's time is estimated before anything
is built: its samples (runner.run.batches) times their training FLOPs (counted on the meta model)
over this CPU's measured rate of an fp16 convolution's training step
(runner.measure.probes.training_rate). Over `MAX_RUN_S` the run is refused (exit 2, in seconds),
saying the estimate, the bfloat16 preset of the same level with its own estimate, and the key
that runs it anyway (`trainer.allow_slow_fp16=true`). A small model (the test suite's, a user's
smoke test) runs. Where the FLOPs or the steps are unknown (a dataset of one's own), nothing is
estimated: the warning finding stays the only word.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from runner.errors import ConfigError
from runner.measure.probes import training_rate
from runner.precision import Properties
from runner.precision.level_rules import level_preset
from runner.run.time_left import duration

MAX_RUN_S = 3600.0  # an fp16 run on a CPU estimated to take longer is refused


def estimate_s(samples: int, flops_per_sample: float, dtype: torch.dtype) -> float:
    """What training on `samples` samples of `flops_per_sample` training FLOPs takes on this
    CPU in `dtype`, at its measured rate."""
    return samples * flops_per_sample / training_rate(dtype)


def refusal(
    cfg: Any,
    properties: Properties,
    device: torch.device,
    flops_per_sample: Optional[float],
    steps: Optional[int],
    samples: Optional[int],
) -> Optional[ConfigError]:
    """Why the run of `cfg` may not start (None: it may): an fp16 level on a CPU estimated to
    take longer than MAX_RUN_S, unless trainer.allow_slow_fp16."""
    if (
        device.type != "cpu"
        or torch.float16 not in properties.compute_dtypes
        or cfg.trainer.allow_slow_fp16
        or not flops_per_sample
        or not steps
        or not samples
    ):
        return None
    run_s = estimate_s(samples, flops_per_sample, torch.float16)
    if run_s <= MAX_RUN_S:
        return None
    step_s = run_s / steps
    bf16_s = estimate_s(samples, flops_per_sample, torch.bfloat16)
    rate = training_rate(torch.float16) / 1e9
    preset = OmegaConf.select(cfg, "precision.preset", default=None)  # missing in one's own file
    named = f"precision={preset}" if preset else f"precision.opt_level={properties.opt_level}"
    return ConfigError(
        "precision",
        f"{named} computes in fp16, which a CPU emulates (about 100x "
        f"slower than bfloat16): this run would take ~{duration(run_s)} here ({steps} steps of "
        f"~{duration(step_s)}; fp16 measured at {rate:.2g} GFLOP/s on this CPU)",
        f"{level_preset(properties.opt_level, torch.bfloat16)} (bfloat16, ~{duration(bf16_s)} "
        "here), the run on a CUDA GPU, or trainer.allow_slow_fp16=true to run it anyway",
    )
