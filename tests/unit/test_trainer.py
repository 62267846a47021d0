"""The training loop with real parts: schedulers under skipped steps, clipping, logging cadence."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.measure.busy import BusyInstrument
from runner.measure.instruments import IDLE, Watch
from runner.measure.memory import MemoryInstrument
from runner.run.trainer import Trainer
from runner.run.whole_step import WholeStepGraph
from tests.helpers.trainer import make_trainer


@pytest.mark.parametrize("scheduler", ["cosine", "step", "onecycle"])
def test_scheduler_advances_once_per_attempt_even_when_every_step_is_skipped(scheduler):
    """A static scale of 2^40 overflows fp16 gradients, so every step is skipped (a known Apex
    failure: the schedule froze or PyTorch warned); the schedule must still follow the data."""
    trainer, _ = make_trainer("O2", {"loss_scale": 2.0**40}, scheduler=scheduler)
    masters_before = [p.detach().clone() for p in trainer.engine.master_params(trainer.optimizer)]
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_epoch(1)
    attempts = trainer.train_batches
    assert trainer.engine.skipped_steps == attempts == 4
    assert trainer.scheduler.last_epoch == attempts
    assert trainer.optimizer.param_groups[0]["lr"] != lr_before or scheduler == "step"
    for before, after in zip(masters_before, trainer.engine.master_params(trainer.optimizer)):
        assert torch.equal(before, after)  # nothing reached the weights
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [
        str(w.message) for w in caught
    ]


LEVELS = [
    ("O0", {}),
    ("O1", {"autocast_dtype": "bfloat16"}),
    ("O2", {}),
    ("O2", {"cast_model_type": "bfloat16", "loss_scale": 1.0}),
    ("O3", {}),
    ("O3", {"loss_scale": "dynamic"}),
]


@pytest.mark.parametrize("scheduler", ["cosine", "step", "onecycle"])
@pytest.mark.parametrize("level,overrides", LEVELS, ids=lambda v: str(v))
def test_scheduler_steps_once_per_attempt_at_every_level_without_warnings(
    level, overrides, scheduler
):
    """Steps that are taken, at every level and type (fp16 is emulated here, the model tiny):
    the schedule advances once per step and PyTorch says nothing about the call order."""
    trainer, _ = make_trainer(level, overrides, scheduler=scheduler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_epoch(1)
    assert trainer.engine.skipped_steps < trainer.train_batches  # real steps, not only skips
    assert trainer.scheduler.last_epoch == trainer.train_batches == 4
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [
        str(w.message) for w in caught
    ]


def test_fit_logs_every_n_steps_and_each_epoch():
    trainer, logged = make_trainer("O0", {})
    result = trainer.fit()
    loss_steps = [s for m, s in logged if "train_loss" in m]
    # 4 steps per epoch, log every 3: the first step (a run stopped early has its loss), step
    # 3, the epoch's remainder at 4, then 6 and 8.
    assert loss_steps == [1, 3, 4, 6, 8]
    epoch_steps = [s for m, s in logged if "val_acc" in m]
    assert epoch_steps == [1, 2]
    final = [m for m, s in logged if "best_val_acc" in m][0]
    assert final["best_val_acc"] == result.best_val_acc
    assert final["train_time_s"] >= sum(e["epoch_time_s"] for e in result.epochs)


@pytest.mark.parametrize("scheduler", ["onecycle", "cosine"])
def test_the_logged_lr_is_the_rate_its_step_trained_with(scheduler):
    """`lr` at step N is the rate step N trained with, not the next step's (the schedule moves
    on after each step, and these change it at every step): 8 steps over 2 epochs, logged at
    the first, 3, the first epoch's remainder at 4, then 6 and 8."""
    trainer, logged = make_trainer("O0", {}, scheduler=scheduler)
    used: dict[int, float] = {}
    step = trainer.train_step

    def watched(x, y):
        used[trainer.global_step + 1] = trainer.optimizer.param_groups[0]["lr"]
        return step(x, y)

    trainer.train_step = watched
    trainer.fit()
    lrs = {s: metrics["lr"] for metrics, s in logged if "lr" in metrics}
    assert sorted(lrs) == [1, 3, 4, 6, 8]
    assert lrs == {s: used[s] for s in lrs}
    assert len(set(used.values())) == 8  # (so the next step's rate would differ)


def test_grad_clipping_bounds_the_update():
    """With clipping at 1e-3, one SGD step (lr 0.1, no momentum yet) moves the fp32 masters by at
    most lr * 1e-3 in L2 norm, whatever the loss scale (clipping sees unscaled gradients)."""
    trainer, _ = make_trainer("O2", {}, grad_clip_norm=1e-3, limit_train_batches=1)
    params = list(trainer.engine.master_params(trainer.optimizer))
    before = [p.detach().clone() for p in params]
    trainer.train_epoch(1)
    assert trainer.engine.skipped_steps == 0
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(params, before)))
    lr = trainer.optimizer.param_groups[0]["initial_lr"]
    # weight decay adds lr * wd * |w| to the step; bound it generously but far below unclipped
    decay = lr * 5e-4 * torch.sqrt(sum((b**2).sum() for b in before))
    assert 0 < moved <= lr * 1e-3 + decay + 1e-6


# ---- what watches a step ---------------------------------------------------------------------
def test_the_step_is_six_calls_on_one_screen():
    """forward, backward, clip, step, schedule, zero_grad: what watches the step is the
    instruments' business, not the step's (the loop over a step's batches is gradient
    accumulation's)."""
    source = inspect.getsource(Trainer.train_step)
    body = source.split('"""')[2].strip().splitlines()  # after the docstring
    assert len(body) <= 20, source
    # (the forward, backward, clip and step of an eager step: beside a whole-step graph's)
    source += inspect.getsource(Trainer._eager_step)
    calls = ["self.model(x)", "backward(", "clip_grad_norm_(", "self.engine.step(", "scheduler("]
    assert all(call in source for call in calls) and "zero_grad(" in source


# ---- trainer.cuda_graphs=step: which steps the graph takes (the replay itself: tests/gpu) ----
def test_the_whole_step_graph_is_made_only_for_its_mode():
    for value in (False, True, "optimizer"):
        trainer, _ = make_trainer("O0", {}, cuda_graphs=value)
        assert trainer.whole_step is None
    trainer, _ = make_trainer("O0", {}, cuda_graphs="step", grad_clip_norm=1.0)
    graph = trainer.whole_step
    assert isinstance(graph, WholeStepGraph) and trainer.step_graph is None
    assert (graph.batch_size, graph.clip_norm, graph.model) == (16, 1.0, trainer.model)


def test_a_watched_step_and_another_shape_run_eagerly_beside_the_graph():
    """The graph takes a full batch at a step only instruments that hook nothing watch (the
    step timer, the busy share); a step the memory meter watches (its hooks and saved-tensor
    meter would see no replay), and the epoch's last, partial batch, run eagerly: on a CPU the
    eager path is all there is to run, and counts as beside the graph."""
    trainer, _ = make_trainer("O0", {}, cuda_graphs="step")
    graph = trainer.whole_step
    x, y = next(iter(trainer.train_loader))
    first = trainer.instruments.step(1)
    assert any(isinstance(i, MemoryInstrument) for i in first.instruments)
    assert not graph.takes(x, y, first)
    loss = trainer.train_step(x, y)  # (eager: the meter watches it)
    assert torch.isfinite(loss) and (graph.beside, graph.eager_steps, graph.replays) == (1, 0, 0)
    usual = trainer.instruments.step(2)  # (the step timer alone: it marks, hooks nothing)
    assert [type(i).__name__ for i in usual.instruments] == ["TimingInstrument"]
    assert graph.takes(x, y, usual)
    assert not graph.takes(x[:5], y[:5], usual)  # (a partial batch: another shape)
    busy = BusyInstrument(torch.device("cpu"), 1, lambda frac, step: None)
    assert graph.takes(x, y, Watch(2, [*usual.instruments, busy]))  # (replayable)
    memory = trainer.instruments.find(MemoryInstrument)
    assert not graph.takes(x, y, Watch(2, [*usual.instruments, memory]))


def test_once_captured_the_graph_takes_batches_laid_out_as_the_captured_one():
    trainer, _ = make_trainer("O0", {}, cuda_graphs="step")
    graph = trainer.whole_step
    x, y = next(iter(trainer.train_loader))
    graph.inputs, graph.graph = (x.clone(), y.clone()), object()  # (as a capture leaves them)
    usual = Watch(2, trainer.instruments.all[:1])  # (the step timer alone)
    assert graph.takes(x.clone(), y.clone(), usual)
    assert not graph.takes(x.contiguous(memory_format=torch.channels_last), y, usual)
    assert not graph.takes(x.double(), y, usual)
    assert not graph.takes(x, y[:-1], usual)


def test_instruments_are_due_only_on_their_steps_and_a_usual_step_costs_a_shared_watch():
    """O0 with diagnostics every 3 steps: the step timer at every step, first; the memory meter
    on step 1 (it steps), the range probe and the layer audit on steps 1 and 4; every other step
    gets the one shared watch of the timer alone, which installs no hook."""
    trainer, _ = make_trainer("O0", {}, diagnose_every_n_steps=3)
    due: dict[int, list[str]] = {}
    usual = []
    for step in range(1, 7):
        watch = trainer.instruments.step(step)
        due[step] = [type(i).__name__ for i in watch.instruments]
        if due[step] == ["TimingInstrument"]:
            usual.append(watch)
        x, y = next(iter(trainer.train_loader))
        trainer.train_step(x, y)
        trainer.global_step += 1
    instruments = ["TimingInstrument", "MemoryInstrument", "RangeInstrument", "AuditInstrument"]
    timer = instruments[:1]
    assert due == {
        1: instruments,
        2: timer,
        3: timer,
        4: [*timer, *instruments[2:]],
        5: timer,
        6: timer,
    }
    assert len(usual) == 4 and all(w is usual[0] for w in usual) and usual[0] is not IDLE
    with trainer.instruments.step(5):
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in trainer.module.modules())


def test_a_step_that_fails_leaves_no_hook_behind():
    """A forward that raises on a diagnosed and audited step: the probe's, the audit's and the
    meter's hooks are all gone with the error."""
    trainer, _ = make_trainer("O0", {}, diagnose_every_n_steps=1)

    def broken(logits, y):
        raise RuntimeError("a loss that fails")

    trainer.criterion = broken
    x, y = next(iter(trainer.train_loader))
    with pytest.raises(RuntimeError, match="a loss that fails"):
        trainer.train_step(x, y)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trainer.module.modules())
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False)  # the meter's gone


def test_targets_are_read_as_class_indices_of_the_model_s_outputs():
    """Only torch's class-index losses are checked, on the host: labels in [0, outputs) and
    the loss's ignore_index pass; any other integer is named; soft (floating) targets and a
    criterion of the user's are theirs."""
    from runner.tasks.base import class_indices, target_problem

    indices = class_indices(nn.CrossEntropyLoss(), 4)
    assert indices == (4, -100)
    assert target_problem(torch.tensor([0, 3, -100, 2]), indices) is None
    assert "holds the target 4, but the model has 4 outputs" in target_problem(
        torch.tensor([0, 4]), indices
    )
    assert "holds the target -1" in target_problem(torch.tensor([[-1, 2]]), indices)
    lm = class_indices(nn.CrossEntropyLoss(ignore_index=0), 256)
    assert target_problem(torch.tensor([[0, 255]]), lm) is None
    assert target_problem(torch.rand(2, 4), indices) is None  # probabilities: soft targets
    assert "targets of torch.float32 and shape (2,): cross-entropy takes class indices" in (
        target_problem(torch.tensor([1.0, 2.0]), indices)  # ("expected target dtype Long")
    )
    assert class_indices(nn.MSELoss(), 4) is None and class_indices(nn.NLLLoss(), None) is None
    assert target_problem(torch.tensor([9]), None) is None
    # a label kept as a tensor of one item: (batch, 1) ("multi-target not supported")
    assert "class indices of shape (3, 1), where cross-entropy takes 1 dimension" in (
        target_problem(torch.tensor([[0], [1], [2]]), indices, dims=1)
    )
    assert target_problem(torch.tensor([[0, 1], [2, 3]]), indices, dims=2) is None  # (B, T)
    assert target_problem(torch.tensor([[0], [1]]), None, dims=1) is None  # the user's loss
    # strings are no targets, whatever the criterion
    assert "targets that are no tensor (list of str: 'cat', 'dog', ...)" in (
        target_problem(["cat", "dog"], None, dims=1)
    )


def test_accuracy_against_class_probabilities_takes_the_class_they_favour():
    from runner.tasks import task_for

    output = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    soft = torch.tensor([[0.9, 0.1, 0.0], [0.7, 0.2, 0.1], [0.0, 0.0, 1.0]])
    sums = task_for("classification").eval_sums(nn.CrossEntropyLoss(), output, soft)
    assert sums.count == 3 and float(sums.correct) == 2.0  # the second favours class 0
    hard = task_for("classification").eval_sums(nn.CrossEntropyLoss(), output, soft.argmax(-1))
    assert float(hard.correct) == 2.0 and torch.allclose(
        hard.loss_sum, nn.CrossEntropyLoss()(output, soft.argmax(-1)).double() * 3
    )


def test_a_trainer_built_without_folders_leaves_none_behind(tmp_path):
    """A Trainer built without a run's folders (the Python API, the benchmarks, these tests)
    that hands its files on writes its layer audit and diagnostics into temporary folders,
    there while the process lives and removed when it exits: they piled up under /tmp by the
    thousand. A forked child (a DataLoader worker) exiting removes nothing of its parent's; a
    folder given is kept. One whose files go nowhere (a tuning trial, a pre-flight) writes
    no audit file at all."""
    import os
    import subprocess
    import sys

    from tests.helpers.runs import REPO

    code = """
import atexit, os, sys
from pathlib import Path
from runner.measure.instruments import Instruments, output_folder
from tests.helpers.trainer import make_trainer
nowhere, _ = make_trainer("O1", {"autocast_dtype": "bfloat16"})
nowhere.train_step(*next(iter(nowhere.train_loader)))
(audit,) = [i for i in nowhere.instruments.all if hasattr(i, "plan")]
assert audit.audited and audit._folder is None  # audited, and wrote nowhere
handed = []
trainer, _ = make_trainer(
    "O1", {"autocast_dtype": "bfloat16"}, diagnose_every_n_steps=1, artifacts=handed
)
x, y = next(iter(trainer.train_loader))
trainer.train_step(x, y)
assert handed, "the audit's first files go to the sink at once"
# (the step timer's traces go out at an epoch's end: no folder yet at a step)
folders = [i.folder for i in trainer.instruments.all if getattr(i, "folder", None) is not None]
folders += [i.diagnostics.folder for i in trainer.instruments.all if hasattr(i, "diagnostics")]
given = output_folder(Path(sys.argv[1]), "unused-")
assert all(any(f.iterdir()) for f in folders), folders  # the files are there while it runs
child = os.fork()
if child == 0:  # a forked worker's exit, its atexit functions run
    atexit._run_exitfuncs()
    os._exit(0)
os.waitpid(child, 0)
assert all(f.is_dir() for f in folders), folders
print("\\n".join(str(f) for f in folders))
"""
    given = tmp_path / "given"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(given)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folders = [Path(line) for line in done.stdout.split()]
    assert {f.name.rsplit("-", 1)[0] for f in folders} == {
        "amp-runner-layers",
        "amp-runner-diagnostics",
    }
    assert not [f for f in folders if f.exists()]
    assert given.is_dir()
