"""Planning computes each fact once and carries it on the RunPlan: per `make_plan`, the plan file
is read once and the model is built on the meta device at most once (the output check, the layer
plan, the FSDP units and a dry run's findings share it), and building the run from its plan
builds no meta model at all.

The counts come from the real functions, wrapped (what they do is unchanged): the runner's
`build_model` where the default device is meta, and `Path.read_text` of the plan file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from runner.components import models
from runner.errors import ConfigError
from runner.run import app, build
from runner.run.distributed import Comm
from runner.run.plan import make_plan
from runner.run.recorded import Launch
from tests.helpers.runs import compose_config

COMMON = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=64",
    "data.num_val=32",
    "data.image_size=16",
    "trainer.batch_size=16",
    "trainer.num_workers=0",
    "precision=o2_bf16",
]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


def token_files(folder: Path) -> list[str]:
    """Token files of 97 ids in `folder` (train 4096 tokens, val 1024), no vocabulary declared,
    and the overrides of a small GPT on them."""
    import numpy as np

    for name, size in (("train.bin", 4096), ("val.bin", 1024)):
        (np.arange(size) % 97).astype(np.uint16).tofile(folder / name)
    return [
        "model=gpt_tiny",
        "data=tokens",
        f"data.train={folder / 'train.bin'}",
        f"data.val={folder / 'val.bin'}",
        "data.block_size=32",
        "trainer.batch_size=8",
        "trainer.num_workers=0",
    ]


@pytest.fixture
def counted(monkeypatch, tmp_path) -> tuple[Counter, Path]:
    """(the counts, a plan file): `meta` counts models built on the meta device (through the
    names the runner builds with), `reads` the plan file's reads. The output check's memo of
    configs already checked is emptied, so that every plan makes its own build."""
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("layers:\n  '5': float32\nwhy:\n  '5': the head\n")
    counts: Counter = Counter()
    real_build = models.build_model

    def build_model(*args, **kwargs):
        if torch.get_default_device().type == "meta":
            counts["meta"] += 1
        return real_build(*args, **kwargs)

    monkeypatch.setattr(models, "build_model", build_model)
    monkeypatch.setattr(build, "build_model", build_model)
    monkeypatch.setattr(models, "_CHECKED_OUTPUTS", set())
    real_read = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.resolve() == plan_file.resolve():
            counts["reads"] += 1
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    return counts, plan_file


def test_a_plan_file_is_read_once_and_the_model_built_once(counted):
    counts, plan_file = counted
    plan = make_plan(
        compose_config(*COMMON, f"precision.layer_plan={plan_file}", "+precision.layers.1=float32")
    )
    assert counts == {"meta": 1, "reads": 1}
    assert [(r.pattern, r.format) for r in plan.layer_rules] == [("5", "float32"), ("1", "float32")]
    assert plan.layer_check.get("5").planned == "float32"  # checked on the meta model, carried
    assert plan.declared == (10, (3, 16, 16)) and plan.meta_model() is plan.meta_model()
    app.print_dry_run(plan)  # the dry run's layer table and findings: from the plan, no rebuild
    assert counts == {"meta": 1, "reads": 1}


def test_with_layer_plan_auto_no_file_is_read_and_the_model_is_built_once(counted):
    counts, _ = counted
    plan = make_plan(
        compose_config(*COMMON, "precision.layer_plan=auto", "+precision.layers.5=float32")
    )
    assert counts == {"meta": 1}
    assert [(r.pattern, r.source) for r in plan.layer_rules] == [("5", "precision.layers")]


def test_a_sharded_run_is_checked_on_the_same_model(counted, monkeypatch):
    counts, plan_file = counted
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    plan = make_plan(compose_config(*COMMON, "trainer.strategy=fsdp"))  # accepted
    assert plan.shards and counts == {"meta": 1}
    counts.clear()
    with pytest.raises(ConfigError, match="trainer.fsdp_wrap"):  # its units, on the meta model
        make_plan(compose_config(*COMMON, "trainer.strategy=fsdp", "trainer.fsdp_wrap=[nothing]"))
    assert counts == {"meta": 1}
    counts.clear()
    with pytest.raises(ConfigError) as refused:  # a plan file: checked, then refused with fsdp
        make_plan(
            compose_config(*COMMON, "trainer.strategy=fsdp", f"precision.layer_plan={plan_file}")
        )
    assert refused.value.key == "precision.layer_plan" and "sharded" in refused.value.problem
    assert counts == {"meta": 1, "reads": 1}


def test_no_check_that_needs_the_model_builds_nothing(counted):
    """The output check's memo covers a config it has checked: with no layer plan and no FSDP,
    nothing else asks for the meta model, so a second plan builds none."""
    counts, _ = counted
    cfg = compose_config(*COMMON)
    assert not make_plan(cfg).shards and counts == {"meta": 1}
    plan = make_plan(cfg)
    assert counts == {"meta": 1} and plan.layer_check is None
    assert plan.meta_model() is not None and counts == {"meta": 2}  # built when asked


def test_the_build_makes_no_meta_model(counted):
    counts, plan_file = counted
    plan = make_plan(compose_config(*COMMON, f"precision.layer_plan={plan_file}"))
    counts.clear()
    parts = build.build(plan)
    try:
        assert counts == {}  # neither the model's check nor the layer plan built one again
        assert parts.engine.layer_plan.digest() == plan.layer_check.digest()
    finally:
        parts.close()


def test_the_flops_are_counted_once_on_the_plans_meta_model(counted, monkeypatch):
    """The model's training FLOPs per sample: counted on the plan's meta model (no other
    build), the first time asked, and carried to the run's parts."""
    from runner.measure import flops as flop_counting

    counts, _ = counted
    real_count = flop_counting.training_flops_per_sample

    def count(*args, **kwargs):
        counts["flops"] += 1
        return real_count(*args, **kwargs)

    monkeypatch.setattr(flop_counting, "training_flops_per_sample", count)
    plan = make_plan(compose_config(*COMMON))
    assert counts == {"meta": 1}
    flops = plan.flops_per_sample()
    assert flops > 0 and plan.flops_per_sample() == flops
    assert counts == {"meta": 1, "flops": 1}
    parts = build.build(plan)
    try:
        assert parts.flops_per_sample == flops and counts == {"meta": 1, "flops": 1}
    finally:
        parts.close()


def test_data_that_declares_no_shape_gets_its_flops_counted_on_the_loaded_input(counted, tmp_path):
    """Token files of no declared vocabulary: only the loaded data tells the model's sizes, so
    the build makes one meta model of them, for the output check and the FLOPs alike; the count
    is the one the same data declared gets when planned."""
    tokens = token_files(tmp_path)
    counts, _ = counted
    plan = make_plan(compose_config(*tokens))
    assert plan.declared is None and plan.flops_per_sample() is None and counts == {}
    parts = build.build(plan)
    try:
        assert counts == {"meta": 1}  # the output check's model counted the FLOPs
        declared = make_plan(compose_config(*tokens, "data.vocab_size=97"))
        assert parts.flops_per_sample is not None
        assert parts.flops_per_sample == declared.flops_per_sample() > 0
    finally:
        parts.close()


def test_data_counted_for_tuning_is_the_data_the_run_trains_on(monkeypatch, tmp_path):
    """trainer.tune=auto counts a run's steps where only the dataset knows them (token files, a
    corpus, CIFAR, an ImageFolder tree): it loaded the datasets, and the build loaded them
    again (a corpus said "Loading N tokens" twice; a large ImageFolder tree was walked twice).
    The run loads them once, before tuning, and its build takes them; a build of the plan
    alone loads its own."""

    from runner.components import data
    from runner.run import tune

    loads: list[object] = []
    real = data.build_datasets

    def build_datasets(*args, **kwargs):
        loads.append(real(*args, **kwargs))
        return loads[-1]

    monkeypatch.setattr(data, "build_datasets", build_datasets)
    monkeypatch.setattr(build, "build_datasets", build_datasets)
    given = make_plan(compose_config(*token_files(tmp_path), "trainer.tune=auto"))
    assert given.estimated_steps() is None and tune.counts_on_data(given, Comm())
    plan, tuning, parts = app.prepare(given, Comm(), torch.device("cpu"), Launch())
    try:
        assert len(loads) == 1 and parts.bundle is loads[0]
        steps = plan.estimated_steps(loads[0])
        assert steps == -(-len(loads[0].train) // 8) * plan.cfg.trainer.max_epochs > 0
        assert tuning is None  # (too few steps to repay tuning: counted, then not tuned)
    finally:
        parts.close()
    again = build.build(plan)
    try:
        assert len(loads) == 2 and again.bundle is loads[1]
    finally:
        again.close()
