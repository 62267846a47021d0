"""Sharded runs (runner.run.fsdp): FSDP2 under real torchrun processes (Gloo on CPU, 2 ranks)
against one unsharded process with the same global batch, the checks before any work, the one
overflow decision across ranks, memory by kind per rank, and checkpoints resumed into another
world size.

Tolerances: as tests/integration/test_distributed.py's. O0 differs from one process only by the
order of the gradient sums (rtol 1e-5, atol 1e-6 after 10 SGD steps; measured 9e-8). The 16-bit
levels compute each rank's half batch in bf16: the updates differ by the bf16 rounding of the
gradients (atol 5e-3; measured 2.6e-3 at o1_bf16, 2.9e-3 at o2_bf16); O3 keeps bf16 shards and
reduces its gradients in bf16, so a weight may land one bf16 spacing apart (atol 1.6e-2; measured
7.8e-3); o3_bf16_sr rounds each shard's elements with the bits the unsharded run draws for them (the
element's index in the whole tensor), its differences come from the bf16 gradient reduction (atol
1.6e-2; measured 3.9e-3). The weights moved by 0.088 in those 10 steps: each comparison is 4x finer
than that at least."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.components.lm_models import GPT
from runner.components.models import TinyCNN
from runner.errors import ConfigError
from runner.run import app, fsdp
from runner.run.build import build
from runner.run.plan import default_run_name, make_plan
from tests.helpers.distributed import COMMON, start_torchrun, torchrun
from tests.helpers.runs import HELPERS, compose_config

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


def _checkpoint(folder: Path, run_name: str) -> Path:
    from runner.run import checkpoint

    return checkpoint.find(
        "auto", checkpoint.run_folder(folder / "checkpoints", "amp-runner", run_name)
    )


def _weights(folder: Path, run_name: str) -> dict[str, torch.Tensor]:
    """The whole model of a run's last checkpoint: an unsharded one's, or a sharded one's shards
    put together (torch's dcp_to_torch_save: the test's own files)."""
    from runner.run import checkpoint

    path = _checkpoint(folder, run_name)
    state = checkpoint.load(path)
    if "sharded" not in state:
        return state["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent.parent / "whole.pt"
    dcp_to_torch_save(path.parent, out)
    return torch.load(out, weights_only=False)["model"]


# ---- before any work ---------------------------------------------------------------------------
def test_fsdp_without_torchrun_is_refused():
    with pytest.raises(ConfigError) as bad:
        make_plan(compose_config(*COMMON, "trainer.strategy=fsdp"))
    assert bad.value.key == "trainer.strategy" and "torchrun" in str(bad.value)
    with pytest.raises(ConfigError, match="trainer.strategy.*allowed: ddp, fsdp"):
        make_plan(compose_config(*COMMON, "trainer.strategy=zero3"))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.compile=true"], "trainer.compile"),
        (["trainer.sync_batchnorm=true"], "trainer.sync_batchnorm"),
        (["precision=o2_bf16_int8state", "optimizer=adamw"], "precision.optimizer_state"),
        (["+precision.layers.5=float32"], "precision.layers"),
        (["precision.layer_plan=auto"], "precision.layer_plan"),
        (["precision.kernels=fused"], "precision.kernels"),
        (["trainer.fsdp_wrap=[blocks.*]"], "trainer.fsdp_wrap"),
    ],
)
def test_what_a_sharded_run_cannot_take_is_refused_naming_the_key(monkeypatch, overrides, key):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    cfg = compose_config(
        *COMMON, "model=tiny", "precision=o2_bf16", "trainer.strategy=fsdp", *overrides
    )
    with pytest.raises(ConfigError) as bad:
        make_plan(cfg)
    assert bad.value.key == key


def test_the_default_units_are_the_repeated_blocks():
    import torchvision

    assert fsdp.default_units(TinyCNN(10)) == ["0", "1", "2", "5"]
    assert fsdp.default_units(GPT(64, 32, 2, 2, 32)) == ["blocks.0", "blocks.1"]
    assert fsdp.default_units(torchvision.models.resnet18())[:2] == ["layer1.0", "layer1.1"]
    vit = torchvision.models.VisionTransformer(32, 4, 2, 2, 32, 64)
    assert fsdp.default_units(vit) == [
        "encoder.layers.encoder_layer_0",
        "encoder.layers.encoder_layer_1",
    ]
    # a class name, or a glob whose * stays within one name; children before parents
    assert fsdp.units_for(GPT(64, 32, 2, 2, 32), ["Block", "head"]) == [
        "blocks.0",
        "blocks.1",
        "head",
    ]
    assert fsdp.units_for(GPT(64, 32, 2, 2, 32), ["blocks.*", "blocks.*.mlp"]) == [
        "blocks.0.mlp",
        "blocks.1.mlp",
        "blocks.0",
        "blocks.1",
    ]
    with pytest.raises(ConfigError, match="trainer.fsdp_wrap.*'blocks.x' matches no module"):
        fsdp.units_for(GPT(64, 32, 2, 2, 32), ["blocks.x"])
    with pytest.raises(ConfigError, match="'Blok' matches no module .*; did you mean Block\\?"):
        fsdp.units_for(GPT(64, 32, 2, 2, 32), ["Blok"])
    with pytest.raises(ConfigError, match="did you mean blocks.0"):
        fsdp.units_for(GPT(64, 32, 2, 2, 32), ["blocks.0x"])


# ---- training, against one process ------------------------------------------------------------
def _one_and_two(
    tmp_path: Path, *extra: str, ranks: tuple[str, ...] = ()
) -> tuple[Path, Path, str]:
    """One process with batch 32 and two sharded ranks with 16 each (`ranks`: more overrides of
    theirs); returns their folders and the run's name."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    store = "mlflow.tracking_uri=sqlite:///{}/mlflow.db"
    reference = compose_config(
        *COMMON,
        *extra,
        "trainer.batch_size=32",
        store.format(one),
        f"trainer.checkpoint_dir={one}/checkpoints",
    )
    app.run(reference)
    result = torchrun(
        2,
        [
            *COMMON,
            *extra,
            "trainer.batch_size=16",
            "trainer.strategy=fsdp",
            *ranks,
            store.format(two),
            f"trainer.checkpoint_dir={two}/checkpoints",
        ],
        two,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return one, two, default_run_name(reference)


def _run(folder: Path):
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    return client, run


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, rtol, atol",
    [
        ("o0", 1e-5, 1e-6),
        ("o1_bf16", 0.0, 5e-3),
        ("o2_bf16", 0.0, 5e-3),
        ("o3_bf16_sr", 0.0, 1.6e-2),  # (O3's bf16 shards; o3_bf16 differs only in its rounding)
    ],
)
def test_two_sharded_ranks_train_like_one_process(tmp_path, preset, rtol, atol):
    one, two, run_name = _one_and_two(tmp_path, f"precision={preset}")
    a, b = _weights(one, run_name), _weights(two, run_name)  # the full state, from rank 0
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            b[key].float(),
            a[key].float(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, key=key: f"{key}: {m}",
        )
    start = build(make_plan(compose_config(*COMMON, f"precision={preset}"))).model
    moved = max((a[k].float() - start.state_dict()[k].float()).abs().max().item() for k in a)
    assert moved > 4 * max(atol, 1e-5), moved
    _, run1 = _run(one)
    client, run = _run(two)
    assert run.info.status == "FINISHED" and run.data.params["trainer.strategy"] == "fsdp"
    assert run.data.params["distributed.world_size"] == "2"
    assert run.data.metrics["skipped_steps"] == 0
    # memory by kind, rank 0's: half of the parameters (rank 0's chunks are the larger where a
    # size is odd), in fp32 shards (they are O2's masters: no copy) or O3's bf16 ones
    half = int(run.data.params["model.num_parameters"]) / 2 / 2**20
    width = 2 if preset.startswith("o3") else 4
    for kind in ("mem_weights_mb", "mem_grads_mb"):
        assert 1.0 <= run.data.metrics[kind] / (width * half) <= 1.15, kind
    assert run.data.metrics["mem_master_weights_mb"] == 0
    # the all-gather working set: the largest unit gathered whole (a conv block of the tiny CNN)
    gathered = run.data.metrics["mem_allgather_mb"]
    assert 0 < gathered < width * 2 * half
    assert run.data.metrics["layers_off_plan"] == 0  # each layer computed as the level says


@pytest.mark.slow
@pytest.mark.parametrize("preset, atol", [("o2_bf16", 5e-3), ("o3_bf16_sr", 1.6e-2)])
def test_sharded_ranks_accumulating_two_batches_train_like_one_process(tmp_path, preset, atol):
    """Each rank's 16 images as two batches of 8 a step: o2_bf16's fp32 shards add up each
    batch's reduce-scattered gradients; o3_bf16_sr's bf16 ones are unscaled into an fp32 sum
    between the batches. Either way, the weights of one process with 32 (tolerances as above)."""
    ranks = ("trainer.batch_size=8", "trainer.accumulate_grad_batches=2")
    one, two, run_name = _one_and_two(tmp_path, f"precision={preset}", ranks=ranks)
    a, b = _weights(one, run_name), _weights(two, run_name)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            b[key].float(),
            a[key].float(),
            rtol=0.0,
            atol=atol,
            msg=lambda m, key=key: f"{key}: {m}",
        )
    client, run = _run(two)
    assert run.data.params["trainer.global_batch_size"] == "32"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps == list(range(1, 11))  # 5 steps an epoch, of 2 batches each


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_sharded_step_on_every_rank(tmp_path):
    """tests/helpers/fsdp_flag_probe.py: fp16 compute, fp32 reduction; rank 1 alone puts an inf into
    its gradient shard at step 2: both ranks skip it, halve the scale and keep stepping alike."""
    result = torchrun(2, [str(tmp_path)], tmp_path, script=str(HELPERS / "fsdp_flag_probe.py"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in ranks:
        assert record["stepped"] == [True, False, True, True]
        assert record["skipped_steps"] == [0, 1, 1, 1]
        assert record["loss_scale"][1] == record["loss_scale"][0] / 2
        assert record["grad_dtype"] == "torch.float32"  # reduce_dtype: the masters' gradients
    assert ranks[0]["loss_scale"] == ranks[1]["loss_scale"]
    assert ranks[0]["weights"] and all(
        all(v == v and abs(v) < 1e3 for v in values) for values in ranks[0]["weights"].values()
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind, first, second", [("sharded", 2, 1), ("full", 1, 2)])
def test_a_sharded_checkpoint_resumes_into_another_world_size(tmp_path, kind, first, second):
    """2 ranks train an epoch and 1 rank resumes it to epoch 2, or the other way round: the
    shards (sharded: torch.distributed.checkpoint reshards them) or the full state (full) load into
    the new world's shards and training goes on from where it was. (Each kind one way: both
    load through the same code whichever world is the larger.)"""
    store = f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"
    base = [
        *COMMON,
        "precision=o2_bf16",
        "trainer.batch_size=16",
        "trainer.strategy=fsdp",
        f"trainer.fsdp_checkpoint={kind}",
        "optimizer.lr=0.2",
        store,
        f"trainer.checkpoint_dir={tmp_path}/checkpoints",
    ]
    name = f"{first}-{second}"
    result = torchrun(first, [*base, "trainer.max_epochs=1", f"mlflow.run_name={name}"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = _weights(tmp_path, name)
    result = torchrun(
        second,
        [*base, "trainer.max_epochs=2", f"mlflow.run_name={name}", "resume=auto"],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resuming" in result.stdout + result.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    }
    run = runs[name]
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    losses = [
        m.value
        for m in sorted(
            client.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step
        )
    ]
    assert losses[-1] < losses[0]
    after = _weights(tmp_path, name)
    assert after.keys() == saved.keys()
    assert any(not torch.equal(after[k], saved[k]) for k in saved)  # it trained on


@pytest.mark.slow
def test_a_mid_epoch_sharded_checkpoint_does_not_resume_at_another_world_size(tmp_path):
    from runner.run import checkpoint

    store = f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"
    base = [
        *COMMON,
        "precision=o0",
        "trainer.batch_size=16",
        "trainer.strategy=fsdp",
        store,
        f"trainer.checkpoint_dir={tmp_path}/checkpoints",
        "mlflow.run_name=mid",
    ]
    result = torchrun(2, [*base, "trainer.max_epochs=1"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path = _checkpoint(tmp_path, "mid")
    state = dict(checkpoint.load(path))
    state["batch"] = 2  # as if stopped two batches into an epoch
    checkpoint.save(path, state)
    result = torchrun(1, [*base, "trainer.max_epochs=2", "resume=auto"], tmp_path)
    assert result.returncode != 0  # (the rank exits 2; torchrun reports its child's failure)
    assert (
        "world_size: 2 -> 1 (a sharded run resumes at another world size from an epoch's end"
        in result.stdout + result.stderr
    )


def _losses(folder: Path) -> list[float]:
    client, run = _run(folder)
    return [
        m.value
        for m in sorted(
            client.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step
        )
    ]


TRANSFORMERS = {
    "vit_tiny": [
        "model=vit_tiny",
        "data=synthetic",
        "data.num_train=64",
        "data.num_val=16",
        "data.image_size=32",
        "optimizer=adamw",
    ],
    "gpt_tiny": [
        "model=gpt_tiny",
        "data=synthetic_text",
        "data.num_train=4200",
        "data.num_val=1100",
        "data.block_size=64",
        "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2",
        "optimizer=adamw",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, level",
    [
        ("gpt_tiny", "o2_bf16"),
        ("gpt_tiny", "o3_bf16_sr"),
        ("gpt_tiny", "o1_fp8"),
        ("vit_tiny", "o0"),
        ("vit_tiny", "o1_fp8"),
    ],
)
def test_transformers_shard_their_blocks_and_train_like_one_process(tmp_path, name, level):
    """Each level on a transformer, fp8 on both (o1_fp8: torchao's fp8 Linear layers, emulated,
    sharded), AdamW, 1 epoch: the per-step training losses of 2 sharded ranks (global
    batch 16) within 2% of one process's (measured under 0.5% in the steps of equal batches; the
    last batch of an epoch differs where 2 ranks pad their shares to equal sizes: 1.6%)."""
    model = [*TRANSFORMERS[name], f"precision={level}"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    common = [
        *model,
        "trainer.max_epochs=1",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "scheduler=none",
    ]
    store = "mlflow.tracking_uri=sqlite:///{}/mlflow.db"
    app.run(
        compose_config(
            *common,
            "trainer.batch_size=16",
            store.format(one),
            f"trainer.checkpoint_dir={one}/checkpoints",
        )
    )
    result = torchrun(
        2,
        [
            *common,
            "trainer.batch_size=8",
            "trainer.strategy=fsdp",
            store.format(two),
            f"trainer.checkpoint_dir={two}/checkpoints",
        ],
        two,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "FSDP2: 2 units" in result.stdout + result.stderr
        or "FSDP2: 4 units" in result.stdout + result.stderr
    )
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) >= 4
    for x, y in zip(a, b):
        assert y == pytest.approx(x, rel=0.02), (a, b)
    assert a[-1] < a[0]


@pytest.mark.slow  # three torchrun jobs of 2 ranks
def test_a_rank_killed_mid_epoch_resumes_to_the_uninterrupted_history(tmp_path):
    """kill -9 of rank 1 in the middle of epoch 2; resume=auto continues from epoch 1's
    checkpoint, and the run's metric history is the uninterrupted run's, point for point (a step
    logged twice holds the same value both times). The kill comes while the ranks' datasets hold
    them a third into epoch 2 (tests.helpers.held_data), not after a guessed sleep; then rank 0
    is let go, meets its lost peer at its next collective and ends at once (held, it outlasted
    torchrun's SIGTERM until the SIGKILL 30 s later)."""
    import signal

    import psutil

    from tests.helpers.held_data import HELD, HELD_DATA, HOLD_AFTER, RELEASE
    from tests.helpers.store import metric_history

    store = f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"
    per_rank = 512 // 2  # a rank's samples an epoch (16 steps)
    base = [
        "model=tiny_gn",
        *HELD_DATA,
        "+data.num_train=512",
        "trainer.batch_size=16",
        "trainer.max_epochs=3",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=4",
        "precision=o2_bf16",
        "trainer.strategy=fsdp",
        store,
        f"trainer.checkpoint_dir={tmp_path}/checkpoints",
    ]
    reference = torchrun(2, [*base, "mlflow.run_name=reference"], tmp_path)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    chaos = [*base, "mlflow.run_name=chaos", "resume=auto"]
    release = tmp_path / "release"
    hold = {HOLD_AFTER: str(per_rank + per_rank // 3), RELEASE: str(release)}
    agent = start_torchrun(
        2, chaos, tmp_path, env=hold, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        seen = []
        for line in agent.stdout:
            seen.append(line)
            if HELD in line:
                break
        said = "".join(seen)
        assert HELD in said and "(after epoch 1)" in said, said[-3000:]
        ranks = [
            p
            for p in psutil.Process(agent.pid).children(recursive=True)
            if p.environ().get("LOCAL_RANK") == "1"
        ]
        assert ranks, "".join(seen)[-3000:]
        ranks[0].send_signal(signal.SIGKILL)
        release.touch()
        seen += agent.stdout.readlines()
        agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    said = "".join(seen)
    assert agent.returncode != 0, said[-3000:]
    assert "A collective operation of the 2 ranks failed" in said, said[-3000:]
    from runner.run import checkpoint

    path = _checkpoint(tmp_path, "chaos")  # the sharded checkpoint of epoch 1
    assert path.parent.name == "last.dcp"
    assert checkpoint.load(path)["epoch"] == 1, "the kill missed epoch 2"

    resumed = torchrun(2, chaos, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = {
        r.info.run_name: r
        for r in client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    }
    finished = runs["chaos"]
    assert finished.info.status == "FINISHED" and finished.data.tags["resume.count"] == "1"
    want = metric_history(client, runs["reference"])
    assert {"train_loss", "val_acc", "val_loss"} <= set(want)
    assert metric_history(client, finished) == want


# ---- sharded checkpoints (torch.distributed.checkpoint) ------------------------------------------
def _two_ranks(tmp_path: Path, name: str, epochs: int, *extra: str):
    store = f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"
    args = [
        *COMMON,
        "precision=o2_bf16",
        "trainer.batch_size=16",
        "trainer.strategy=fsdp",
        "optimizer=adamw",
        store,
        f"trainer.checkpoint_dir={tmp_path}/checkpoints",
        f"trainer.max_epochs={epochs}",
        f"mlflow.run_name={name}",
        *extra,
    ]
    return torchrun(2, args, tmp_path)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_bit_identical_and_refuses_a_damaged_shard(tmp_path):
    """Each rank writes its shards (last.dcp: __0_0.distcp, __1_0.distcp, .metadata, trainer.pt
    listing their SHA-256); 1 epoch then resume=auto to 2 equals 2 epochs straight, bit for bit;
    a flipped byte in one shard is refused before anything is read."""
    straight = _two_ranks(tmp_path, "straight", 2)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    first = _two_ranks(tmp_path, "resumed", 1)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    path = _checkpoint(tmp_path, "resumed")
    assert path.name == "trainer.pt" and path.parent.name == "last.dcp"
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "trainer.pt",
    ]
    from runner.run import checkpoint

    listed = checkpoint.load(path)["sharded"]
    assert listed["world_size"] == 2 and sorted(listed["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    again = _two_ranks(tmp_path, "resumed", 2, "resume=auto")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    a, b = _weights(tmp_path, "straight"), _weights(tmp_path, "resumed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not list(path.parent.parent.glob(".last.dcp.*"))  # nothing left of the swap

    shard = path.parent / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    refused = _two_ranks(tmp_path, "resumed", 3, "resume=auto")
    assert refused.returncode != 0
    text = refused.stdout + refused.stderr
    assert "is corrupted: __1_0.distcp: checksum mismatch" in text


def test_a_crafted_index_is_refused_without_running_anything(tmp_path):
    """A sharded checkpoint's .metadata is a pickle: one that would run code is refused by name,
    even with its SHA-256 recomputed into trainer.pt (a digest is no defence against a crafted
    file); the planner's non-tensor items go through the safe unpickler too."""
    import pickle

    from runner.run import checkpoint
    from runner.run.checkpoint import sharded

    folder = tmp_path / "last.dcp"
    folder.mkdir()
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    (folder / "__0_0.distcp").write_bytes(b"")
    files = {p.name: sharded._digest(p) for p in folder.iterdir()}
    state = {
        "model": {},
        "optimizer": sharded.EMPTY_OPTIMIZER,
        "engine": {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}},
        "scheduler": None,
        "epoch": 1,
        "batch": 0,
        "global_step": 5,
        "best_val_acc": 0.1,
        "history": [],
        "elapsed_s": 1.0,
        "skip_streak": 0,
        "bad_loss_streak": 0,
        "rng": {"torch": torch.get_rng_state(), "python": __import__("random").getstate()},
        "sharded": {"files": files, "world_size": 2},
    }
    checkpoint.save(folder / "trainer.pt", state)
    loaded = checkpoint.load(folder / "trainer.pt")  # intact: the digests are right
    assert loaded["sharded"]["files"] == files
    with pytest.raises(ConfigError, match=r"posix\.system is not part of a checkpoint's index"):
        sharded.read_metadata(folder)
    assert not marker.exists()


def test_find_takes_the_previous_sharded_checkpoint_where_a_swap_was_cut_short(tmp_path):
    from runner.run import checkpoint

    run = tmp_path / "run-id"
    for name in (".last.dcp.old", ".last.dcp.tmp"):
        (run / name).mkdir(parents=True)
        (run / name / "trainer.pt").write_bytes(b"x")
    assert checkpoint.find("auto", tmp_path) == run / ".last.dcp.old" / "trainer.pt"
    (run / "last.dcp").mkdir()
    (run / "last.dcp" / "trainer.pt").write_bytes(b"x")
    assert checkpoint.find("auto", tmp_path) == run / "last.dcp" / "trainer.pt"
    assert checkpoint.find(str(run), tmp_path) == (run / "last.dcp" / "trainer.pt").resolve()


@pytest.mark.slow
def test_a_sharded_tensor_rounds_as_the_whole_tensor_does(tmp_path):
    """tests/helpers/fsdp_rounding_probe.py: each rank's stochastically rounded shard is, bit for
    bit, its slice of the whole tensor rounded in one process (uneven shards of 7 and 6 rows);
    keying the bits by the shard's own indices instead would differ on rank 1."""
    result = torchrun(2, [str(tmp_path)], tmp_path, script=str(HELPERS / "fsdp_rounding_probe.py"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rows"] for r in ranks] == [7, 6]
    assert all(r["equal"] and r["dtype"] == "torch.bfloat16" for r in ranks)
    assert ranks[1]["differs_from_unkeyed"] and not ranks[0]["differs_from_unkeyed"]


def test_a_sharded_checkpoint_lists_exactly_its_files(tmp_path):
    """`sharded.verify` before any file is read: a missing shard, a file it does not list, a
    changed byte: each refused naming the file."""
    from runner.run.checkpoint import sharded

    folder = tmp_path / "last.dcp"
    folder.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (folder / name).write_bytes(name.encode() * 10)
    files = {p.name: sharded._digest(p) for p in folder.iterdir()}
    trainer = folder / "trainer.pt"
    trainer.write_bytes(b"")
    sharded.verify(trainer, files)  # intact
    (folder / "__1_0.distcp").rename(folder / "__2_0.distcp")
    with pytest.raises(ConfigError, match=r"missing __1_0\.distcp"):
        sharded.verify(trainer, files)
    (folder / "__2_0.distcp").rename(folder / "__1_0.distcp")
    (folder / "extra.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"files it does not list: extra\.bin"):
        sharded.verify(trainer, files)
    (folder / "extra.bin").unlink()
    (folder / ".metadata").write_bytes(b"changed")
    with pytest.raises(ConfigError, match=r"\.metadata: checksum mismatch"):
        sharded.verify(trainer, files)
