"""The step timer on a GPU: its marks are CUDA events, so the steady steps between two logging
steps never wait for the device (torch's sync debug mode raises at any host sync), and the
epoch's figures are read once, at its end."""

from __future__ import annotations

import pytest
import torch

from runner.measure.timing import DATA_WAIT_FRAC, SAMPLES_PER_S, STEP_TIME_MS_P50, CudaClock
from runner.run.build import build
from runner.run.plan import make_plan
from runner.run.trainer import RunContext, Trainer, trainer_config
from tests.helpers.runs import FAST, compose_config


@pytest.mark.gpu
def test_steady_steps_between_logging_steps_never_sync():
    cfg = compose_config(
        *FAST,
        "data.num_train=320",
        "precision=o1_bf16",  # (no loss scale: no found-inf read in the step)
        "trainer.device=cuda",
        "trainer.log_every_n_steps=1000",
    )
    plan = make_plan(cfg)
    parts = build(plan)
    trainer = Trainer(
        trainer_config(cfg.trainer),
        parts,
        RunContext(on_metrics=lambda metrics, step: None),
        device=plan.device,
    )
    batches = [trainer._to_device(x, y) for x, y in parts.train_loader]
    torch.cuda.synchronize()
    trainer.model.train()
    trainer.instruments.start_epoch(1)
    for step, (x, y) in enumerate(batches, start=1):
        steady = step > cfg.trainer.warmup_steps  # (the first: memory by kind, the audit)
        torch.cuda.set_sync_debug_mode("error" if steady else 0)
        try:
            trainer.train_step(x, y)
            trainer.instruments.counted(step, y.shape[0], y.shape[0])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        trainer.global_step = step
    trainer.instruments.steps_done()
    metrics = trainer.instruments.epoch_metrics()
    assert metrics[SAMPLES_PER_S] > 0 and metrics[STEP_TIME_MS_P50] > 0
    assert 0 <= metrics[DATA_WAIT_FRAC] < 1
    parts.close()


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
