"""The experiment configs: each is documented, dry-runs every job it promises, and trains at its
own shape (a real fixed-budget run on synthetic data of the same shape; the full runs need a GPU
and the real datasets)."""

from __future__ import annotations

import math
import os

import pytest

from runner.config.finder import config_dir
from runner.run import app
from runner.run.plan import check_config
from tests.helpers.runs import REPO, compose_config, run_in_process

EXPERIMENTS = {
    "cpu_demo": 8,
    "cifar10_opt_levels": 16,
    "vgg16_batch_sizes": 15,
    "modern_precisions": 14,
    "gpt_precisions": 6,
}  # jobs each
# what an experiment needs on the command line: gpt_precisions' corpus (a folder of the
# standard library's sources, as its command takes the whole library)
NEEDS = {"gpt_precisions": [f"data.path={os.path.join(os.path.dirname(os.__file__), 'json')}"]}


def test_every_experiment_states_its_command_and_needs():
    folder = config_dir() / "experiment"
    assert sorted(p.stem for p in folder.glob("*.yaml")) == sorted(EXPERIMENTS)
    readme = (REPO / "docs" / "results.md").read_text() + (folder / "README.md").read_text()
    for name in EXPERIMENTS:
        text = (folder / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_")
        assert f"python -m runner -m +experiment={name}" in text
        assert "python -m runner.report --experiment" in text
        assert "What the full run needs" in text or "What it needs" in text
        assert f"`{name}`" in readme or f"`{name}.yaml`" in readme


@pytest.mark.parametrize("name,jobs", list(EXPERIMENTS.items()))
@pytest.mark.new_store  # checks that nothing, no store, is created
def test_dry_run_resolves_every_job_of_the_sweep(name, jobs, capsys, tmp_path):
    assert (
        run_in_process(
            "-m", f"+experiment={name}", "dry_run=true", "trainer.device=cpu", *NEEDS.get(name, [])
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("  opt_level: O") == jobs  # one resolved config per job
    assert f"name: {name}" in out  # the experiment's own settings
    assert "defines a sweep" not in out  # (what a command without -m is told)
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    "name,one_job",
    [
        ("gpt_precisions", "precision=o0"),
        # a group the sweep adds is not in the one job
        ("cifar10_opt_levels", "model=densenet161, without +experiment/cifar10_optimizer, "),
    ],
)
def test_an_experiment_s_sweep_without_m_says_it_runs_one_job(name, one_job, capsys):
    """`python -m runner +experiment=gpt_precisions` (no -m) trained O0 alone and said nothing of
    the other five: Hydra ignores `hydra.sweeper.params` outside a multirun. It runs one job still,
    saying so with the command that runs the sweep; a config without sweep params says nothing."""
    args = [f"+experiment={name}", "dry_run=true", "trainer.device=cpu", *NEEDS.get(name, [])]
    assert run_in_process(*args) == 0
    out = capsys.readouterr().out
    assert out.count("  opt_level: O") == 1
    told = [line for line in out.splitlines() if "The config defines a sweep" in line]
    assert len(told) == 1, out[-3000:]
    assert f"a sweep ({EXPERIMENTS[name]} jobs): " in told[0]
    assert f"without -m Hydra runs one job, {one_job}" in told[0]
    assert told[0].endswith(f" -m {' '.join(args)}")
    assert run_in_process("dry_run=true", "trainer.device=cpu") == 0
    assert "defines a sweep" not in capsys.readouterr().out


def test_cifar10_comparison_uses_the_published_batch_sizes_and_epochs():
    for level, batch, epochs in [
        ("o0", 512, 25),
        ("o1", 1024, 50),
        ("o2", 1024, 50),
        ("o3", 1024, 50),
    ]:
        cfg = compose_config("+experiment=cifar10_opt_levels", f"precision={level}")
        assert (cfg.trainer.batch_size, cfg.trainer.max_epochs) == (batch, epochs), level
        assert cfg.data.name == "cifar10" and cfg.mlflow.experiment_name == "cifar10-opt-levels"
    # Adam's eps must survive O3's fp16 optimizer state (1e-8 is 0 there; the runner refuses it)
    cfg = compose_config(  # (a GPU's experiment, checked here on a CPU: fp16's time no matter)
        "+experiment=cifar10_opt_levels",
        "+experiment/cifar10_optimizer=adam",
        "precision=o3",
        "trainer.allow_slow_fp16=true",
    )
    assert cfg.optimizer.name == "adam" and cfg.optimizer.eps == 1e-4
    check_config(cfg)


@pytest.mark.parametrize(
    "name,overrides",
    [
        (
            "cifar10_opt_levels",
            ["model=densenet161", "+experiment/cifar10_optimizer=adam", "precision=o0"],
        ),
        (
            "cifar10_opt_levels",
            ["model=resnext50_32x4d", "+experiment/cifar10_optimizer=sgd", "precision=o2_bf16"],
        ),
        ("vgg16_batch_sizes", ["precision=o1_bf16"]),
        ("cpu_demo", ["model=resnet18", "precision=o3_bf16"]),
        # one of its precisions at its shape (ViT-B/16, 224 px): fp8, which converts the ViT's
        # Linear layers (o3_bf16_sr trains and resumes on the tiny models in test_modern_precisions;
        # one o3_bf16_sr step of ViT-B/16 here took 54 s of emulated bf16 on a 2-core CPU)
        ("modern_precisions", ["precision=o1_fp8", "trainer.compile=false"]),
    ],
)
def test_experiment_trains_on_synthetic_data_of_its_shape(name, overrides, tracking_uri):
    # ViT-B/16 at 224 px: one bf16 backward of 4 images takes ~160 s on a 2-core CPU without
    # bf16 instructions, so its experiment steps on single images (the shapes are the same)
    batch = 1 if name == "modern_precisions" else 4
    budget = [
        "data=synthetic",
        "data.num_train=8",
        "data.num_val=4",
        f"trainer.batch_size={batch}",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=1",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
    ]
    cfg = compose_config(
        f"+experiment={name}", *overrides, *budget, f"mlflow.tracking_uri={tracking_uri}"
    )
    expected = {"cpu_demo": 16, "modern_precisions": 224}.get(name, 32)  # else CIFAR's 32x32
    assert cfg.data.image_size == expected and cfg.data.num_classes == 10
    best = app.run(cfg, overrides=overrides)
    assert math.isfinite(best)


@pytest.mark.parametrize("precision", ["o3_bf16_sr", "o1_fp8"])
def test_gpt_experiment_trains_on_a_part_of_its_corpus(precision, tracking_uri, tmp_path):
    """gpt_precisions at its own shape (gpt_tiny, 128-token sequences, AdamW with eps 1e-6) on
    one package of the standard library's sources (its command takes the whole library): a few
    steps, a finite best loss."""
    if precision.endswith("fp8"):
        pytest.importorskip("torchao")
    cfg = compose_config(
        "+experiment=gpt_precisions",
        f"precision={precision}",
        *NEEDS["gpt_precisions"],
        f"data.cache_dir={tmp_path / 'tokens'}",
        "trainer.batch_size=4",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=2",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    assert cfg.model.name == "gpt_tiny" and cfg.model.block_size == 128
    assert cfg.optimizer.name == "adamw" and cfg.optimizer.eps == 1e-6
    assert math.isfinite(app.run(cfg))
