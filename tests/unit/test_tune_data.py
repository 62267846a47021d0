"""trainer.tune's loader candidate: the worker counts tried, the fewest workers that keep up
with the step, and the same batches in the same order whatever the count."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from runner.components.data import build_datasets
from runner.components.loaders import build_loaders, shutdown_workers
from runner.config import ImageFolderConfig
from runner.run import tune_data
from runner.run.tune_measure import Row
from tests.helpers.images import write_image_folder

W, PIN = tune_data.WORKERS, tune_data.PIN


def rows(*measured):
    """A row per (workers, ms a batch, start-up s)."""
    return [Row({W: n}, ms, start) for n, ms, start in measured]


def chosen(candidates, step_ms, steps=None):
    return tune_data.choose(candidates, step_ms, steps).settings[W]


def test_the_counts_tried_are_bounded_by_the_cpus_and_hold_the_configs_own():
    assert tune_data.counts(2, 2) == [0, 2]
    assert tune_data.counts(2, 1) == [0, 1, 2]
    assert tune_data.counts(2, 6) == [0, 2, 4, 6]
    assert tune_data.counts(2, 64) == [0, 2, 4, 8]
    assert tune_data.counts(12, 64) == [0, 2, 4, 8, 12]


def test_the_fewest_workers_that_keep_up_with_the_step_win():
    measured = rows((0, 30.0, 0.0), (2, 8.0, 0.5), (4, 5.0, 0.6))
    assert chosen(measured, step_ms=10.0) == 2  # 2 and 4 keep up: the fewer
    assert chosen(measured, step_ms=2000.0) == 0  # a 30 ms batch is 1.5% of the step
    assert chosen(measured, step_ms=1.0) == 4  # none keeps up: the fastest
    # a short run: the workers' start (training and validation loaders) does not repay
    assert chosen(measured, step_ms=10.0, steps=10) == 0
    assert chosen(measured, step_ms=10.0, steps=100_000) == 2


def test_a_count_not_measured_is_never_chosen():
    measured = rows((0, 30.0, 0.0), (2, 8.0, 0.5))
    measured[1].note = "not measured: over the budget of 1 s"
    assert chosen(measured, step_ms=10.0) == 0
    assert tune_data.choose(rows(), 10.0, None) is None


def decided(measured, free=(PIN,)):
    tuning = SimpleNamespace(settings={}, reasons={}, loader=[])
    tune_data.decide(tuning, None, measured, list(free), 10.0, None)
    return tuning


def test_pinned_memory_is_turned_off_only_where_a_copied_batch_comes_faster_without():
    pinned, unpinned = Row({W: 2}, 8.0, 0.5), Row({W: 2, PIN: False}, 5.0, 0.5)
    tuning = decided([pinned, unpinned])
    assert tuning.settings == {PIN: False}
    assert tuning.reasons[PIN] == "tuned: 5.0 ms a batch unpinned, 8.0 pinned (copied to the GPU)"
    assert "| trainer.num_workers=2, trainer.pin_memory=false | 5.0 | 0.50 | yes |" in (
        tune_data.table(tuning.loader, tuning.settings)
    )
    unpinned.steady_ms = 7.3  # within the margin (10%): the default stays
    tuning = decided([pinned, unpinned])
    assert tuning.settings == {}  # (the config's null: pinned on CUDA)
    assert tuning.reasons[PIN].startswith("kept: pinned measured as fast or faster")
    assert "| trainer.num_workers=2 | 8.0 | 0.50 | yes |" in (
        tune_data.table(tuning.loader, tuning.settings)
    )
    unpinned.note = "not measured: the epoch has too few batches"
    assert decided([pinned, unpinned]).reasons[PIN] == f"kept: {unpinned.note}"


def test_the_batches_come_in_the_same_order_whatever_the_worker_count(tmp_path):
    root = write_image_folder(tmp_path / "images", per_class={"train": 6, "val": 2}, size=8)
    cfg = ImageFolderConfig(name="imagefolder", root=str(root), image_size=8, augment=False)
    bundle = build_datasets(OmegaConf.structured(cfg))
    seen = []
    for workers in (0, 2):
        train, val = build_loaders(bundle, 4, workers, "cpu", seed=3)
        try:
            seen.append([(x, y) for x, y in train])
        finally:
            shutdown_workers(train, val)
    assert len(seen[0]) == len(seen[1]) == 3
    for pin, pinned in ((None, True), (True, True), (False, False)):  # (on CUDA; never on a CPU)
        loaders = build_loaders(bundle, 4, 0, "cuda", seed=3, pin_memory=pin)
        assert [loader.pin_memory for loader in loaders] == [pinned, pinned]
        assert not build_loaders(bundle, 4, 0, "cpu", seed=3, pin_memory=pin)[0].pin_memory
    for (xa, ya), (xb, yb) in zip(*seen):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
