"""The step timer on a GPU: its marks are CUDA events, so the steady steps between two logging
steps never wait for the device (torch's sync debug mode raises at any host sync), and the
epoch's figures are read once, at its end."""

from __future__ import annotations

import pytest
import torch

from runner.measure.instruments import Instrument, Instruments
from runner.measure.timing import CudaClock
from runner.metrics import DATA_WAIT_FRAC, SAMPLES_PER_S, STEP_TIME_MS_P50
from tests.helpers.runs import FAST, compose_config
from tests.helpers.trainer import planned_trainer


class NoSyncInSteadySteps(Instrument):
    """Started first and closed last at every step: a steady step (past the warm-up) runs
    entirely under torch's sync debug mode "error", so any host sync inside it (the timer's
    marks included) raises; the loop's own reads between steps (the periodic loss read, the
    epoch's end) run outside it."""

    every_step = True

    def __init__(self, warmup_steps: int):
        self.warmup_steps, self.strict = warmup_steps, []

    def start(self, step: int) -> None:
        if step > self.warmup_steps:
            torch.cuda.set_sync_debug_mode("error")
            self.strict.append(step)

    def close(self) -> None:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_steady_steps_between_logging_steps_never_sync():
    cfg = compose_config(
        *FAST,
        "data.num_train=320",  # 10 steps of 32: 3 warm-up, 7 steady, logging every 4
        "precision=o1_bf16",  # (no loss scale: no found-inf read in the step)
        "trainer.device=cuda",
        "trainer.log_every_n_steps=4",
    )
    trainer, logged, parts = planned_trainer(cfg)
    guard = NoSyncInSteadySteps(cfg.trainer.warmup_steps)
    trainer.instruments = Instruments(guard, *trainer.instruments.all)
    try:
        trainer.train_epoch(1)
        metrics = trainer.instruments.epoch_metrics()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        parts.close()
    assert guard.strict == list(range(4, 11))
    assert [m for m in logged if "train_loss" in m]  # the periodic reads happened, between steps
    assert metrics[SAMPLES_PER_S] > 0 and metrics[STEP_TIME_MS_P50] > 0
    assert 0 <= metrics[DATA_WAIT_FRAC] < 1


@pytest.mark.gpu
def test_cuda_marks_time_the_device_not_the_host():
    """Work queued between two marks is timed when the GPU runs it, without a sync at record."""
    clock = CudaClock()
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        start = clock.mark()
        for _ in range(20):
            x = x @ x / 4096
        end = clock.mark()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    clock.wait(end)
    assert clock.ready(start) and clock.seconds(start, end) > 0
