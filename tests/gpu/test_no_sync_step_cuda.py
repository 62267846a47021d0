"""No host sync inside a training step on a GPU, at any level: the overflow flag, the dynamic loss
scale's update, Adam's step counters and the skipped-step count stay on the device, and the
trainer reads them only at its logging steps (torch's sync debug mode raises at any host sync
inside a step). The real trainer and engine, 20 steps a level, with the runner's kernels."""

from __future__ import annotations

import pytest
import torch

from runner.measure.instruments import Instrument, Instruments
from runner.measure.memory import MemoryInstrument
from tests.helpers.runs import FAST, compose_config
from tests.helpers.trainer import planned_trainer

STEPS = 20
LEVELS = ["o1", "o2", "o3", "o1_bf16", "o2_bf16", "o3_bf16"]


class StrictSteps(Instrument):
    """Started first and closed last at every step: a step past the warm-up at which no
    sometimes-due instrument measures (the memory probe reads the first step that stepped) runs
    entirely under torch's sync debug mode "error"; the loop's reads between steps (the logging
    steps' read, the epoch's end) run outside it."""

    every_step = True

    def __init__(self, warmup_steps: int, others: tuple[Instrument, ...]):
        self.warmup_steps, self.others, self.strict = warmup_steps, others, []

    def start(self, step: int) -> None:
        if step > self.warmup_steps and not any(i.due(step) for i in self.others):
            torch.cuda.set_sync_debug_mode("error")
            self.strict.append(step)

    def close(self) -> None:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "level, optimizer", [(level, "sgd") for level in LEVELS] + [("o1", "adamw"), ("o2", "adamw")]
)
def test_twenty_steps_never_sync_between_logging_steps(level, optimizer):
    # (the kernels built before the run: no torch-ops fallback meanwhile)
    _twenty_steps(level, optimizer, "precision.kernels=fused")


# The updates the kernels do not take, each the optimizer's own step undone on the device where
# the flag is set: torch's ops (O1 and O2 with a dynamic scale), an option the kernels lack
# (amsgrad), O3's fp16 weights with a dynamic scale. A lower first scale, so that the first step
# (the one that creates the optimizer's state, and reads the flag) steps within the warm-up.
OWN_STEPS = [
    ("o1", "sgd", ("precision.kernels=torch",)),
    ("o2", "sgd", ("precision.kernels=torch",)),
    ("o1", "adamw", ("precision.kernels=torch",)),
    ("o2", "adam", ("precision.kernels=torch",)),
    ("o2", "adamw", ("precision.kernels=fused", "optimizer.amsgrad=true")),
    ("o3", "sgd", ("precision.kernels=fused", "precision.loss_scale=dynamic")),
    (
        "o3",
        "adamw",
        ("precision.kernels=fused", "precision.loss_scale=dynamic", "optimizer.eps=1e-4"),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("level, optimizer, overrides", OWN_STEPS)
def test_an_optimizers_own_step_never_syncs_between_logging_steps(level, optimizer, overrides):
    trainer = _twenty_steps(level, optimizer, "precision.init_scale=256", *overrides)
    if optimizer.startswith("adam"):  # (torch's counters on the device, the groups as made)
        steps = [s["step"] for s in trainer.optimizer.state.values()]
        assert steps and all(s.device.type == "cuda" for s in steps)
        assert not any(g["capturable"] for g in trainer.optimizer.param_groups)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["o1", "o2", "o3_bf16"])
def test_steps_of_two_batches_never_sync_between_logging_steps(level):
    """Gradient accumulation: O1's fp32 gradients add up in place; O2's and O3's 16-bit ones are
    unscaled into the engine's fp32 sum between a step's batches, their flags kept on the
    device for the step's verdict."""
    _twenty_steps(
        level,
        "sgd",
        "precision.kernels=fused",
        f"data.num_train={2 * 32 * STEPS}",  # (40 batches: 20 steps of 2)
        "trainer.accumulate_grad_batches=2",
    )


def _twenty_steps(level: str, optimizer: str, *overrides: str):
    """20 steps of the real trainer at `level`, every step past the warm-up (and not measured
    by a sometimes-due instrument) under the sync debug mode "error"; returns the trainer."""
    cfg = compose_config(
        *FAST,
        f"data.num_train={32 * STEPS}",  # 20 steps of 32 in the epoch
        f"precision={level}",
        f"optimizer={optimizer}",
        *overrides,
        "trainer.device=cuda",
        "trainer.log_every_n_steps=5",
    )
    trainer, logged, parts = planned_trainer(cfg)
    others = tuple(i for i in trainer.instruments.all if not i.every_step)
    strict = StrictSteps(cfg.trainer.warmup_steps, others)
    trainer.instruments = Instruments(strict, *trainer.instruments.all)
    try:
        trainer.train_epoch(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        parts.close()
    assert len(strict.strict) >= STEPS - cfg.trainer.warmup_steps - 2
    assert trainer.global_step == STEPS
    assert len([m for m in logged if "train_loss" in m]) == STEPS // 5  # read at logging steps
    # what stayed on the device reads back at the end: a finite scale, a count of skips
    assert trainer.engine.loss_scale > 0 and 0 <= trainer.engine.skipped_steps < STEPS
    assert trainer.guard.skip_streak <= trainer.engine.skipped_steps
    return trainer


@pytest.mark.gpu
def test_an_overflow_is_skipped_on_the_device_and_counted_at_the_read():
    """O2 with a loss scale far above fp16's range: every step overflows and is skipped on the
    device, the scale backs off there; the reads at the logging steps see the count and the
    scale, and the guard's streak."""
    cfg = compose_config(
        *FAST,
        f"data.num_train={32 * 10}",
        "precision=o2",
        "precision.kernels=fused",
        f"precision.init_scale={2.0**40}",
        f"precision.max_loss_scale={2.0**40}",
        "trainer.device=cuda",
        "trainer.log_every_n_steps=5",
        "trainer.max_bad_steps=100",
    )
    trainer, _, parts = planned_trainer(cfg)
    # (the memory probe waits for a step that stepped, which never comes here: left out)
    strict = StrictSteps(cfg.trainer.warmup_steps, ())
    kept = [i for i in trainer.instruments.all if not isinstance(i, MemoryInstrument)]
    trainer.instruments = Instruments(strict, *kept)
    masters = [m.detach().clone() for m in trainer.engine.master_params(trainer.optimizer)]
    try:
        trainer.train_epoch(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        parts.close()
    assert strict.strict == list(range(cfg.trainer.warmup_steps + 1, 11))
    assert trainer.engine.skipped_steps == 10 and trainer.guard.skip_streak == 10
    assert trainer.engine.loss_scale == 2.0**30
    after = trainer.engine.master_params(trainer.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(masters, after))
