"""Data-parallel training with real torchrun processes (Gloo on CPU) against one process.

2 processes with batch 16 each see, step for step, the same 32 images as 1 process with batch 32
(runner.components.loaders.EpochSampler shards every epoch's permutation), and DDP averages their
gradients, so
both must reach the same weights. The model is the GroupNorm variant of `tiny` (BatchNorm's batch
statistics differ by construction between 2 x 16 and 1 x 32 images).

Tolerances: O0 (fp32) differs only by the order of the gradient sums: rtol 1e-5, atol 1e-6 on
the weights after 10 SGD steps. o2_bf16 computes each half batch's gradients in bfloat16 and
all-reduces them in bfloat16 (8 bits of mantissa), so the updates differ by the bf16 rounding of
the gradients: at most 10 steps x lr 0.1 x a momentum sum of up to 1/(1-0.9) x |g| x 2^-8, a few
1e-3 in absolute terms: atol 5e-3 (measured: 2.5e-3; one process under torchrun matches the
plain run to 3e-6). The test also checks that training moved the weights by far more than that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError
from runner.run import app, checkpoint
from runner.run.build import build
from runner.run.plan import default_run_name, make_plan
from tests.helpers.distributed import COMMON, start_torchrun, torchrun
from tests.helpers.runs import HELPERS, compose_config


def _weights(folder: Path, run_name: str) -> dict[str, torch.Tensor]:
    root = checkpoint.run_folder(folder / "checkpoints", "amp-runner", run_name)
    return checkpoint.load(checkpoint.find("auto", root))["model"]


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("preset,rtol,atol", [("o0", 1e-5, 1e-6), ("o2_bf16", 0.0, 5e-3)])
def test_two_gloo_processes_train_like_one_with_the_global_batch(
    tmp_path, preset, rtol, atol, accumulate
):
    """With `accumulate` 2, each process's 16 images are two batches of 8 a step: fp32
    gradients add up under DDP's no_sync and are all-reduced once, bfloat16 ones are all-reduced
    per batch and summed in fp32; either way the ranks step as one process with 32 does."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    store = "mlflow.tracking_uri=sqlite:///{}/mlflow.db"
    reference = compose_config(
        *COMMON,
        f"precision={preset}",
        "trainer.batch_size=32",
        store.format(one),
        f"trainer.checkpoint_dir={one}/checkpoints",
    )
    app.run(reference)
    result = torchrun(
        2,
        [
            *COMMON,
            f"precision={preset}",
            f"trainer.batch_size={16 // accumulate}",
            f"trainer.accumulate_grad_batches={accumulate}",
            store.format(two),
            f"trainer.checkpoint_dir={two}/checkpoints",
        ],
        two,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the ranks share the run's output folder (Hydra's, by the second): none took one of its own
    assert not list((two / "outputs").glob("*/*-1")), list((two / "outputs").glob("*/*"))

    run_name = default_run_name(reference)
    a, b = _weights(one, run_name), _weights(two, run_name)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            b[key], a[key], rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )
    start = build(make_plan(reference)).model.state_dict()  # the initial weights
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    assert moved > 10 * max(atol, 1e-5), moved  # the comparison is not vacuous

    # only rank 0 logged: one run, with the world size and the global batch size
    client = MlflowClient(f"sqlite:///{two}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["distributed.world_size"] == "2"
    assert run.data.params["trainer.global_batch_size"] == "32"
    # metrics reduced over the ranks: the same validation accuracy as one process (all 40 images)
    client1 = MlflowClient(f"sqlite:///{one}/mlflow.db")
    (run1,) = client1.search_runs([client1.get_experiment_by_name("amp-runner").experiment_id])
    assert run.data.metrics["samples_per_s"] > 0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(
        range(1, 11)
    )  # 5 steps per epoch: each step of the global batch, once
    if preset == "o0":
        assert run.data.metrics["val_acc"] == pytest.approx(
            run1.data.metrics["val_acc"], abs=1 / 40
        )


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, kernels):
    """tests/helpers/ddp_flag_probe.py under torchrun: rank 1 alone puts an inf into its gradients
    at step 2; both ranks skip that step, halve the scale, and end with identical masters."""
    for attempt in (1, 2, 3):
        for stale in tmp_path.glob("rank*.json"):
            stale.unlink()
        result = torchrun(
            2,
            [str(tmp_path), kernels],
            tmp_path,
            script=str(HELPERS / "ddp_flag_probe.py"),
            timeout=600,
        )
        # Seen in full-suite runs, never alone (20 runs): one rank aborting with "terminate
        # called without an active exception" (a C++ thread of the process group's transport),
        # at start-up before its first step, and once (2026-11-25) after its results were
        # written; the cause is not found yet. Only that abort is retried,
        # twice at most, each from scratch, and the retry is reported: a run must still pass whole.
        if (
            attempt < 3
            and result.returncode != 0
            and "terminate called without an active exception" in result.stderr
        ):
            print(f"torchrun abort (attempt {attempt}), retried:\n" + result.stderr[-2000:])
            continue
        break
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in ranks:
        assert record["backend"] == ("cpp" if kernels == "fused" else "torch")
        assert record["stepped"] == [True, False, True, True]
        assert record["skipped_steps"] == [0, 1, 1, 1]
        assert record["loss_scale"][1] == record["loss_scale"][0] / 2
    assert ranks[0]["loss_scale"] == ranks[1]["loss_scale"]
    assert ranks[0]["masters"] == ranks[1]["masters"]  # bit for bit


def test_sync_batchnorm_on_a_cpu_is_a_config_error():
    cfg = compose_config(*COMMON, "trainer.sync_batchnorm=true", "trainer.device=cpu")
    with pytest.raises(ConfigError) as e:
        make_plan(cfg)
    assert e.value.key == "trainer.sync_batchnorm" and "NCCL" in str(e.value)


def test_the_slurm_launcher_runs_one_task_per_gpu():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = compose_config(
        "hydra/launcher=slurm",
        "hydra.launcher.gpus_per_node=4",
        "hydra.launcher.partition=gpu",
        return_hydra_config=True,
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"
    assert launcher.tasks_per_node == 4 and launcher.signal_delay_s > 0


def test_slurm_tasks_become_ranks():
    """What a task of a 2-node, 4-task SLURM job sees: SLURM's variables; submitit's helper
    turns them into the ones torch.distributed reads."""
    pytest.importorskip("submitit")
    from runner.run import distributed

    saved = dict(os.environ)  # submitit writes os.environ itself: restore all of it after
    try:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        os.environ.update(
            {
                "SUBMITIT_EXECUTOR": "slurm",
                "SLURM_JOB_ID": "123",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "3",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_NUM_NODES": "2",
                "SLURM_NODEID": "1",
                "SLURM_JOB_NODELIST": "node[7-8]",
                "SLURM_STEP_NODELIST": "node[7-8]",
            }
        )
        assert distributed.from_slurm_tasks()
        assert distributed.launched_by_torchrun()
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
            "3",
            "4",
            "1",
        )
        assert os.environ["MASTER_ADDR"] == "node7"
        os.environ["SLURM_NTASKS"] = "1"  # one task: an ordinary single-process run
        assert not distributed.from_slurm_tasks()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow
def test_two_gloo_processes_train_a_gpt_like_one(tmp_path):
    """A language model under torchrun: 2 processes of 8 sequences train gpt_tiny to the same
    weights as 1 process of 16 (64 training sequences: 4 full global batches; fp32: only the
    order of the gradient sums differs), and the per-token validation metrics reduced over the
    ranks equal the single process's."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    lm = [
        "model=gpt_tiny",
        "data=synthetic_text",
        "data.num_train=2049",
        "data.num_val=700",
        "data.block_size=32",
        "trainer.max_epochs=1",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "scheduler=none",
        "precision=o0",
    ]  # SGD: Adam would amplify the sums' rounding where gradients are ~0
    store = "mlflow.tracking_uri=sqlite:///{}/mlflow.db"
    reference = compose_config(
        *lm, "trainer.batch_size=16", store.format(one), f"trainer.checkpoint_dir={one}/checkpoints"
    )
    app.run(reference)
    result = torchrun(
        2,
        [
            *lm,
            "trainer.batch_size=8",
            store.format(two),
            f"trainer.checkpoint_dir={two}/checkpoints",
        ],
        two,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_name = default_run_name(reference)
    a, b = _weights(one, run_name), _weights(two, run_name)
    for key in a:
        torch.testing.assert_close(
            b[key], a[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
    runs = []
    for folder in (one, two):
        client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
        assert run.info.status == "FINISHED" and run.data.params["task.name"] == "language_model"
        runs.append(run)
    assert runs[1].data.params["distributed.world_size"] == "2"
    for metric in ("val_loss", "val_token_acc", "best_val_loss"):
        assert runs[1].data.metrics[metric] == pytest.approx(
            runs[0].data.metrics[metric], rel=1e-4
        ), metric
    assert runs[1].data.metrics["tokens_per_s"] > 0


@pytest.mark.slow
def test_rank_0_tunes_and_the_other_ranks_take_its_decision(tmp_path):
    """trainer.tune under torchrun: rank 0 measures while the other rank waits, then both train
    with rank 0's settings (DDP's collectives would hang or fail on ranks that built differently);
    one decision is kept, and the run logs it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = torchrun(
        2,
        [
            *COMMON,
            f"mlflow.tracking_uri={uri}",
            f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
            "trainer.tune=on",
            "mlflow.run_name=tuned",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.data.params["tune.source"] == "measured"
    assert "tune_time_s" in run.data.metrics
    assert len(list((tmp_path / "tune-cache").glob("*.json"))) == 1


@pytest.mark.slow
def test_a_rank_killed_mid_run_fails_the_run_in_one_line_and_resume_goes_on(tmp_path):
    """Rank 1 killed (SIGKILL: the OOM killer, a lost node) while the run trains: rank 0 meets it
    in its next collective (Gloo's connection reset) and ends the run FAILED in one line (what
    failed, where to look, the checkpoint it keeps), not as an unexpected error with Gloo's
    traceback; the same command with resume=auto then continues from that checkpoint."""
    args = [*COMMON, "data.num_train=640", "trainer.log_every_n_steps=5"]
    out = tmp_path / "torchrun.log"
    with out.open("w") as sink:
        args_long = [*args, "trainer.max_epochs=1000"]
        started = start_torchrun(2, args_long, tmp_path, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while "Checkpoint: " not in out.read_text(errors="replace"):  # (after epoch 1)
                assert started.poll() is None, out.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "no checkpoint in 300 s"
                time.sleep(0.2)
            ranks = {p.environ().get("RANK"): p for p in psutil.Process(started.pid).children()}
            ranks["1"].kill()
            started.wait(timeout=120)
        finally:
            if started.poll() is None:
                os.killpg(started.pid, signal.SIGKILL)
                started.wait()
    told = out.read_text(errors="replace")
    assert started.returncode != 0
    assert "A collective operation of the 2 ranks failed (Gloo: " in told, told[-3000:]
    assert "unexpected error" not in told and "GLHF" not in told and "pair.cc" not in told
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : -9" in told  # (torchrun's root cause)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FAILED"
    error = run.data.tags["error"]
    assert error.startswith("PeersLost: A collective operation of the 2 ranks failed (Gloo: ")
    kept = re.search(
        r"The checkpoint after epoch (\d+) is kept \((.+?)\): the same torchrun ", error
    )
    assert kept is not None, error
    epochs = int(kept[1])
    assert checkpoint.load(Path(kept[2]))["epoch"] == epochs >= 1

    resumed = torchrun(2, [*args, f"trainer.max_epochs={epochs + 1}", "resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (run,) = client.search_runs([run.info.experiment_id])
    assert run.info.status == "FINISHED"
    assert checkpoint.load(Path(kept[2]))["epoch"] == epochs + 1


@pytest.mark.new_store
def test_torchrun_s_summary_says_each_rank_s_error(tmp_path):
    """A rank's error reaches torchrun's failure summary in the rank's own words (its error
    file), not as a link to torch's documentation; a rank other than 0 labels its lines."""
    result = torchrun(2, [*COMMON, "optimizer.lr=-1"], tmp_path)
    told = result.stdout + result.stderr
    assert result.returncode != 0
    assert "traceback : optimizer.lr: got -1.0 (allowed: a finite number > 0)" in told, told
    assert "To enable traceback see" not in told.split("Root Cause")[1]
    # each rank's own line: one plain line, as every refusal (the first rank to fail ends the
    # others: either may tell it), a rank other than 0 labelled
    lines = [line for line in told.splitlines() if "optimizer.lr: got -1.0" in line]
    lines = [line for line in lines if "traceback :" not in line]
    assert lines, told
    for line in lines:
        assert re.fullmatch(r"(rank 1 of 2: )?optimizer.lr: got -1.0 \(allowed: .*\)", line), line
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_sweep_under_torchrun_is_refused_in_one_line(tmp_path):
    """`torchrun --nproc_per_node=2 -m runner -m ...`: each rank ran the whole sweep on its own,
    the second refused as "in use by a sweep that is running" while the first waited for it in
    its first job's process group. Every rank stops at once, saying why in its error file."""
    result = torchrun(2, ["-m", *COMMON, "precision=o0,o2_bf16"], tmp_path)
    told = result.stdout + result.stderr
    assert result.returncode != 0
    said = "-m (a sweep) under torchrun (WORLD_SIZE=2): every rank would run the whole sweep"
    # torchrun's summary, in the rank's own words (the first rank to stop ends the other, so
    # rank 0's own line may not come)
    assert f"traceback : {said}" in told
    assert "hydra/launcher=parallel" in told and "To enable traceback see" not in told
    assert not (tmp_path / "mlflow.db").exists(), sorted(p.name for p in tmp_path.iterdir())
    assert not (tmp_path / "multirun").exists()
