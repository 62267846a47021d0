"""Gradient accumulation (`trainer.accumulate_grad_batches`), on a CPU with the tiny CNN: a step
over k batches is a step over one batch k times larger, 16-bit gradients sum in fp32, an overflow
in any of a step's batches skips it, and steps, schedule and interrupts count optimizer steps.

Tolerances: fp32 paths differ from the one large batch only in the order of their sums (rtol
1e-5); the fp32 sum of bfloat16 gradients is compared bit for bit with the same sum done here.
"""

from __future__ import annotations

import copy
import math
import signal

import pytest
import torch

from runner.run import recorded
from runner.run.interrupts import RunInterrupted, StopRequest
from runner.run.plan import make_plan
from tests.helpers.runs import FAST, compose_config
from tests.helpers.trainer import make_trainer, planned_trainer


def _masters(trainer) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in trainer.engine.master_params(trainer.optimizer)]


def test_two_batches_of_eight_step_as_one_batch_of_sixteen():
    """GroupNorm (no batch statistics), fp32: an epoch in steps of 2 x 8 samples ends where an
    epoch in steps of 16 does (the same samples in the same order), with the same losses."""
    ends, losses = [], []
    for batch_size, accumulate in ((16, 1), (8, 2)):
        torch.manual_seed(0)
        trainer, logged = make_trainer(
            "O0",
            {},
            batch_size=batch_size,
            norm="group",
            accumulate_grad_batches=accumulate,
            log_every_n_steps=1,
        )
        start = _masters(trainer)
        _, samples, _ = trainer.train_epoch(1)
        assert (trainer.global_step, samples, trainer.scheduler.last_epoch) == (4, 64, 4)
        moved = max((a - b).abs().max().item() for a, b in zip(_masters(trainer), start))
        assert moved > 1e-3  # (the comparison below is not vacuous)
        ends.append(_masters(trainer))
        losses.append([metrics["train_loss"] for metrics, _ in logged if "train_loss" in metrics])
    for one, accumulated in zip(*ends):
        torch.testing.assert_close(accumulated, one, rtol=1e-5, atol=1e-6)
    assert len(losses[1]) == 4
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_bfloat16_gradients_of_a_step_sum_in_fp32():
    """O2 with a bfloat16 model: the fp32 masters' gradient at the step is the fp32 sum of each
    batch's bfloat16 gradient (of its loss / 2), not their sum in bfloat16 (8 bits of mantissa:
    it differs)."""
    torch.manual_seed(0)
    trainer, _ = make_trainer(
        "O2",
        {"cast_model_type": "bfloat16", "loss_scale": 1.0},
        batch_size=8,
        norm="group",
        accumulate_grad_batches=2,
    )
    batches = [trainer.to_device(x, y) for x, y in list(trainer.train_loader)[:2]]
    copy_ = copy.deepcopy(trainer.module)
    each = []
    for x, y in batches:
        copy_.zero_grad()
        (trainer.task.loss(trainer.criterion, copy_(x), y) / 2).backward()
        each.append([p.grad.clone() for p in copy_.parameters()])
    assert all(g.dtype == torch.bfloat16 for g in each[0])
    seen = []
    step = trainer.engine.step

    def recorded(optimizer, *args, **kwargs):
        trainer.engine.unscale_(optimizer)  # (the step's own unscale: the last batch's added)
        seen.extend(p.grad.clone() for p in trainer.engine.master_params(optimizer))
        return step(optimizer, *args, **kwargs)

    trainer.engine.step = recorded
    trainer.train_step(*batches[0], batches[1])
    assert len(seen) == len(each[0])
    in_half = 0
    for got, a, b in zip(seen, *each):
        assert got.dtype == torch.float32
        assert torch.equal(got, a.float() + b.float())
        in_half += int(not torch.equal(got, (a + b).float()))
    assert in_half > 0  # (a sum in bfloat16 would have been caught)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("poisoned", [0, 1, 2])
def test_an_overflow_in_any_batch_of_a_step_skips_it_once(poisoned, kernels):
    """O2 in fp16 with a dynamic scale, through torch's ops or the runner's kernels: inf in one
    of a step's three batches skips the step (the masters stay as they were) and backs the scale
    off once."""
    torch.manual_seed(0)
    trainer, _ = make_trainer(
        "O2", {}, batch_size=8, norm="group", kernels=kernels, accumulate_grad_batches=3
    )
    batches = [trainer.to_device(x, y) for x, y in list(trainer.train_loader)[:3]]
    x, y = batches[poisoned]
    batches[poisoned] = (torch.full_like(x, math.inf), y)
    before, scale = _masters(trainer), trainer.engine.loss_scale
    trainer.train_step(*batches[0], *batches[1:])
    assert trainer.engine.skipped_steps == 1
    assert trainer.engine.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(trainer)))
    # the next step, clean, steps
    trainer.train_step(*batches[(poisoned + 1) % 3], batches[(poisoned + 2) % 3])
    assert trainer.engine.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, _masters(trainer)))


def test_steps_logging_and_the_schedule_count_optimizer_steps():
    """4 batches an epoch in steps of 3: a step of 3 and a step of 1 an epoch; the schedule is
    as long as the steps (one-cycle refuses a step past its end), the losses logged at steps."""
    trainer, logged = make_trainer("O0", {}, scheduler="onecycle", accumulate_grad_batches=3)
    result = trainer.fit()
    assert trainer.global_step == 4 and trainer.scheduler.last_epoch == 4
    assert trainer.scheduler.total_steps == 4
    # the first step, every 3, each epoch's end
    assert [s for m, s in logged if "train_loss" in m] == [1, 2, 3, 4]
    assert len(result.epochs) == 2


def test_a_planned_run_s_schedule_counts_optimizer_steps():
    """Through the run's own plan and build: 64 samples in batches of 8 with 3 accumulated are 3
    steps an epoch (3 + 3 + 2 batches) for one-cycle's length."""
    cfg = compose_config(
        "model=tiny",
        "data=synthetic",
        "data.num_train=64",
        "data.num_val=16",
        "data.image_size=8",
        "scheduler=onecycle",
        "trainer.batch_size=8",
        "trainer.accumulate_grad_batches=3",
        "trainer.max_epochs=2",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.tune=off",
    )
    trainer, _, parts = planned_trainer(cfg)
    try:
        assert trainer.scheduler.total_steps == 6
        trainer.fit()
        assert trainer.global_step == 6
    finally:
        parts.close()


def test_a_stop_is_taken_between_steps_at_a_step_s_first_batch():
    """A stop requested during the first step of three batches: the interrupt saves the epoch's
    batches done after that step (3), where a resumed run's next step starts."""
    trainer, _ = make_trainer("O0", {}, batch_size=8, accumulate_grad_batches=3)
    request = StopRequest()
    request.signum = signal.SIGINT  # (as its handler records a Ctrl-C)
    trainer.context.stop = request
    saved = []
    trainer._save = lambda epochs, batches: saved.append((epochs, batches))
    with pytest.raises(RunInterrupted):
        trainer.train_epoch(1)
    assert saved == [(0, 3)] and trainer.global_step == 1
    groups = [(done, len(group)) for done, group in trainer._step_batches(6)]
    assert groups == [(8, 2)]  # (resumed at 6 of 8: one step of the 2 left)


def test_more_batches_to_a_step_than_an_epoch_has_is_said(caplog):
    """Said when the run trains (`fit`), not when a Trainer is made: trainer.tune and the
    range pre-flight make some of their own, and would say it again each time."""
    trainer, _ = make_trainer("O0", {}, accumulate_grad_batches=8)  # (4 batches an epoch)
    said = "trainer.accumulate_grad_batches=8 is more than an epoch's 4 batches: each epoch is "
    assert said not in caplog.text
    trainer.fit()
    assert caplog.text.count(said + "one step, of 4") == 1
    assert trainer.global_step == 2 and trainer.scheduler.last_epoch == 2  # (2 epochs)


def test_an_out_of_memory_message_says_the_batches_a_step_sums():
    plan = make_plan(compose_config(*FAST, "trainer.accumulate_grad_batches=4"))
    said = "tiny at O0, trainer.batch_size=32 (x trainer.accumulate_grad_batches=4)"
    assert recorded.sizes(plan) == said
    assert "accumulate" not in recorded.sizes(make_plan(compose_config(*FAST)))
