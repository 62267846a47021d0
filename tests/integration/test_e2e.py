"""End-to-end runs on CPU at every Apex level, read back from a real SQLite MLflow store.

In-process runs go through real Hydra composition and `runner.run.app.run`; a few subprocess runs
check
what a user sees from `python -m runner` (exit status, messages, final run state).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError, DataError
from runner.run import app
from runner.run.plan import make_plan
from tests.helpers.resume import last_checkpoint, settings
from tests.helpers.runs import (
    FAST,
    REPO,
    compose_config,
    read_until,
    run_cli,
    run_in_process,
    start_cli,
)
from tests.helpers.store import EPOCH_METRICS, FINAL_METRICS, all_runs, only_run

PRECISION_KEYS = [
    "opt_level",
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
]


@pytest.mark.parametrize("level", ["o0", "o1", "o2", "o3"])
def test_each_level_trains_and_logs_the_contract(level, tracking_uri):
    from runner import csrc

    csrc.build("cpp")  # built before: a single run on an empty cache would step with torch's ops
    cfg = compose_config(*FAST, f"precision={level}", f"mlflow.tracking_uri={tracking_uri}")
    best = app.run(cfg, overrides=[f"precision={level}"])

    client, run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"tiny-{level.upper()}"
    metrics = run.data.metrics
    for name in ["train_loss", *EPOCH_METRICS, *FINAL_METRICS]:
        assert name in metrics, f"{name} not logged"
        assert math.isfinite(metrics[name]), f"{name} = {metrics[name]}"
    assert 0.0 <= metrics["val_acc"] <= 1.0
    assert metrics["best_val_acc"] == pytest.approx(best)
    assert metrics["epoch_time_s"] > 0 and metrics["samples_per_s"] > 0
    assert metrics["peak_mem_mb"] >= 0
    history = client.get_metric_history(run.info.run_id, "val_acc")
    assert [m.step for m in history] == [1, 2]  # one value per epoch
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) >= 2

    params = run.data.params
    for key in PRECISION_KEYS:
        assert f"precision.{key}" in params
    assert params["precision.opt_level"] == level.upper()
    assert params["precision.kernels"] == "cpp"  # the backend in use, not the choice "auto"
    assert params["model.name"] == "tiny" and params["trainer.max_epochs"] == "2"
    tags = run.data.tags
    assert tags["opt_level"] == level.upper()
    assert tags["overrides"] == f"precision={level}"
    assert tags["peak_mem_kind"].startswith("cpu_")
    assert "torch_version" in tags and "device_name" in tags
    assert tags["cuda_version"] == str(torch.version.cuda)
    if (REPO / ".git").exists():  # a git checkout: the commit the run's code came from
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        assert tags.get("git_commit") == head or not head  # (no git: no tag)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "overrides.yaml", "precision.txt"} <= artifacts
    # beside the database, whatever folder the run was launched from
    db = Path(tracking_uri[len("sqlite:///") :])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == (db.parent / "mlartifacts").resolve().as_uri()


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "precision=o2",
            "optimizer=adamw",
            "scheduler=onecycle",
            "trainer.grad_clip_norm=1.0",
            "trainer.channels_last=true",
            "precision.loss_scale=128",
        ],
        [
            "precision=o1",
            "precision.autocast_dtype=bfloat16",
            "optimizer=adam",
            "scheduler=step",
            "scheduler.step_epochs=1",
            "mlflow.run_name=bf16-autocast",
            "+mlflow.tags.team=vision",
            # a dotted tag (MLflow's run description): Hydra reads its dots as levels, and it
            # was refused as "Cannot convert 'dict' to string"
            "+mlflow.tags.mlflow.note.content=fp16 autocast on bf16",
        ],
        [
            "precision=o3",
            "precision.cast_model_type=bfloat16",
            "scheduler=none",
            "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1",
            "precision.kernels=torch",
        ],
    ],
    ids=["o2-adamw-onecycle-clip-channels_last-static128", "o1-bf16-adam-step", "o3-bf16-limits"],
)
def test_option_combinations_finish(overrides, tracking_uri):
    cfg = compose_config(*FAST, *overrides, f"mlflow.tracking_uri={tracking_uri}")
    app.run(cfg, overrides=overrides)
    _, run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    assert all(math.isfinite(run.data.metrics[m]) for m in EPOCH_METRICS)
    if "precision.kernels=torch" in overrides:
        assert run.data.params["precision.kernels"] == "torch"
    if "mlflow.run_name=bf16-autocast" in overrides:
        assert run.info.run_name == "bf16-autocast"
        assert run.data.tags["team"] == "vision"
        assert run.data.tags["mlflow.note.content"] == "fp16 autocast on bf16"
        assert run.data.params["precision.autocast_dtype"] == "bfloat16"


@pytest.mark.parametrize("preset", ["o1_bf16", "o2_bf16", "o3_bf16"])
def test_bf16_presets_train_without_loss_scaling(preset, tracking_uri):
    cfg = compose_config(
        *FAST, f"precision={preset}", "trainer.max_epochs=1", f"mlflow.tracking_uri={tracking_uri}"
    )
    app.run(cfg, overrides=[f"precision={preset}"])
    client, run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    level = preset.split("_")[0].upper()
    assert run.info.run_name == f"tiny-{level}-bf16"  # told apart from the fp16 preset's runs
    assert run.data.params["precision.opt_level"] == level
    assert run.data.params["precision.preset"] == preset
    assert run.data.params["precision.loss_scale"] == "1.0"
    assert "bfloat16" in (
        run.data.params["precision.cast_model_type"],
        run.data.params["precision.autocast_dtype"],
    )
    assert run.data.metrics["loss_scale"] == 1.0 and run.data.metrics["skipped_steps"] == 0
    assert run.data.tags["precision.findings"] == "0 error, 0 warning, 0 info"
    assert run.data.tags["precision.findings_list"] == "none"


def test_findings_are_tagged_and_attached(tracking_uri):
    overrides = ["precision=o2", "precision.master_weights=false", "trainer.max_epochs=1"]
    cfg = compose_config(*FAST, *overrides, f"mlflow.tracking_uri={tracking_uri}")
    app.run(cfg, overrides=overrides)
    client, run = only_run(tracking_uri)
    tags = run.data.tags
    assert tags["precision.findings"] == "0 error, 2 warning, 0 info"
    assert tags["precision.findings_list"] == (
        "warning precision.master_weights; warning precision.cast_model_type"
    )
    text = client.download_artifacts(run.info.run_id, "precision.txt")
    content = open(text).read()
    assert "2^-11" in content and "emulated on CPU" in content
    assert run.data.params["precision.hysteresis"] == "1"
    assert run.data.params["trainer.max_bad_steps"] == "50"


def test_findings_that_are_notes_only_are_logged_as_info(tracking_uri, caplog):
    """bf16 with dynamic loss scaling is an info finding (unneeded, harmless): the block of
    findings was logged as a WARNING all the same."""
    overrides = ["precision=o2_bf16", "precision.loss_scale=dynamic", "trainer.max_epochs=1"]
    cfg = compose_config(*FAST, *overrides, f"mlflow.tracking_uri={tracking_uri}")
    with caplog.at_level("INFO", logger="runner.run.app"):
        app.run(cfg, overrides=overrides)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Precision findings:")]
    assert record.levelname == "INFO" and "dynamic loss scaling is unneeded" in record.getMessage()
    caplog.clear()
    overrides = ["precision=o2", "precision.master_weights=false", "trainer.max_epochs=1"]
    with caplog.at_level("INFO", logger="runner.run.app"):
        app.run(compose_config(*FAST, *overrides, f"mlflow.tracking_uri={tracking_uri}"))
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Precision findings:")]
    assert record.levelname == "WARNING"


def test_strict_refuses_before_a_run_exists(tmp_path):
    uri = f"sqlite:///{tmp_path / 'never.db'}"
    cfg = compose_config(
        *FAST, "precision=o2", "precision.strict=true", f"mlflow.tracking_uri={uri}"
    )
    with pytest.raises(ConfigError) as e:
        app.run(cfg)
    assert e.value.key == "precision.cast_model_type" and "emulated on CPU" in str(e.value)
    assert not (tmp_path / "never.db").exists()


def test_dry_run_shows_findings_and_scaling_knobs(capsys):
    cfg = compose_config(
        "precision=o2", "precision.cast_model_type=bfloat16", "dry_run=true", "trainer.device=cpu"
    )
    assert app.run(cfg) is None
    out = capsys.readouterr().out
    assert "hysteresis" in out and "max_loss_scale" in out
    assert "info" in out and "unneeded with bfloat16" in out


def test_cifar10_in_the_real_format_trains(tmp_path, tracking_uri):
    from tests.helpers.cifar import write_cifar10

    write_cifar10(tmp_path)
    cfg = compose_config(
        *[o for o in FAST if not o.startswith("data")],
        "data=cifar10",
        f"data.root={tmp_path}",
        "data.download=false",
        "trainer.batch_size=8",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    app.run(cfg)
    _, run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    assert run.data.params["data.train_size"] == "20" and run.data.params["data.val_size"] == "6"
    assert run.data.params["data.num_classes"] == "10"


def test_training_learns_on_synthetic_data(tracking_uri):
    """Accuracy must mean something: the tiny model beats chance (10%) clearly."""
    cfg = compose_config(
        *FAST,
        "data.num_train=256",
        "data.num_val=64",
        "trainer.max_epochs=3",
        "optimizer=adam",
        "optimizer.lr=3e-3",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    best = app.run(cfg)
    assert best > 0.5


def test_dry_run_prints_and_creates_no_run(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'dry.db'}"
    cfg = compose_config("precision=o2", "dry_run=true", f"mlflow.tracking_uri={uri}")
    assert app.run(cfg) is None
    out = capsys.readouterr().out
    assert "opt_level: O2" in out  # the resolved config
    assert "master_weights" in out and "float16" in out  # the precision table
    assert "warning" in out and "emulated on CPU" in out  # the findings (fp16 on this CPU)
    assert not (tmp_path / "dry.db").exists()


def test_failure_mid_run_marks_the_run_failed(tmp_path, tracking_uri):
    """A corrupt image met during training fails the run: FAILED, with the error as a tag."""
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = tmp_path / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (12, 12), (40 * i, 10, 200)).save(folder / f"{i}.png")
    (tmp_path / "images" / "val" / "b" / "9.png").write_bytes(b"not a png")
    cfg = compose_config(
        *[o for o in FAST if not o.startswith("data")],
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "data.image_size=16",
        "trainer.batch_size=4",
        "trainer.max_epochs=1",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    with pytest.raises(DataError, match="9.png is not a readable image"):
        app.run(cfg)
    _, run = only_run(tracking_uri)
    assert run.info.status == "FAILED"
    assert "UnidentifiedImageError" in run.data.tags["error"] and "9.png" in run.data.tags["error"]


def test_a_share_of_the_epoch_limits_its_batches(tmp_path):
    """trainer.limit_train_batches=0.5, as Lightning's: half of the epoch's 5 batches, rounded
    down (2 steps an epoch), through the CLI; the tuner's estimate counts the same steps; 1.0
    takes every batch (validation's one)."""
    args = settings(
        tmp_path,
        "trainer.limit_train_batches=0.5",
        "trainer.limit_val_batches=1.0",
        "mlflow.run_name=share",
    )
    assert make_plan(compose_config(*args)).estimated_steps() == 4  # (160 samples, batch 32)
    assert run_in_process(*args) == 0
    assert last_checkpoint(tmp_path, "share")["global_step"] == 4
    (run,) = all_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and math.isfinite(run.data.metrics["val_acc"])


# ---- peak memory on a CPU ---------------------------------------------------------------------
@pytest.mark.slow
def test_cpu_peak_memory_counts_the_training_state_not_the_data(tmp_path):
    """Two real runs in fresh processes: 60000 synthetic 16-px images (176 MiB of data) with the
    narrow tiny net, and 96 images with a 16x wider net. peak_mem_mb must follow the model and
    its activations, as the GPU figure does, not the datasets held in host memory."""

    def peak(*overrides: str) -> float:
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        result = run_cli(
            *FAST,
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=3",
            f"mlflow.tracking_uri={uri}",
            *overrides,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        runs = MlflowClient(uri).search_runs(
            [MlflowClient(uri).get_experiment_by_name("amp-runner").experiment_id],
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        assert runs[0].data.tags["peak_mem_kind"] == "cpu_tensor_accounted"
        return runs[0].data.metrics["peak_mem_mb"]

    data_mb = 60000 * 3 * 16 * 16 * 4 / 2**20
    big_data = peak("data.num_train=60000")
    wide_model = peak("model.width=256", "data.image_size=32")
    assert big_data < data_mb / 2, (big_data, data_mb)  # the data is not counted
    assert wide_model > big_data + 100  # the wider net's weights and activations are


# ---- what a user sees from the command line ---------------------------------------------------
@pytest.mark.slow
def test_the_progress_bar_written_to_a_pipe_draws_at_most_twice_an_epoch(tmp_path):
    """On a terminal tqdm redraws every 0.1 s; written to a file or a pipe (a SLURM job's
    output), each redraw stays, so there it redraws every 30 s: an epoch of a few seconds
    leaves its first and last state only. On a terminal the interval stays tqdm's."""
    from runner.run.trainer import NON_TERMINAL_BAR_S, bar_interval_s

    result = run_cli(
        *FAST,
        "trainer.progress_bar=true",
        "data.num_train=4096",
        "trainer.max_epochs=2",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    draws = [d for d in result.stderr.replace("\n", "\r").split("\r") if "batch/s" in d]
    for epoch in (1, 2):
        mine = [d for d in draws if f"epoch {epoch}/2:" in d]
        assert 2 <= len(mine) <= 3, mine  # (0/128, 128/128; a third at most on a slow machine)
        assert "128/128" in mine[-1]
    assert bar_interval_s() == NON_TERMINAL_BAR_S  # (pytest's stderr is no terminal)
    leader, follower = os.openpty()  # a terminal
    try:
        with open(follower, "w", closefd=False) as tty, pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stderr", tty)
            assert bar_interval_s() == 0.1
    finally:
        os.close(leader)
        os.close(follower)


def test_cli_run_finishes_and_attaches_config_and_log(tmp_path):
    result = run_cli(*FAST, "precision=o2", "trainer.max_epochs=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the default store, in the launch directory
    client, run = only_run(uri)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tiny-O2"
    assert "precision=o2" in run.data.tags["overrides"]
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    assert "logs/runner.log" in logs
    # system metrics are on by default (MLflow's monitors; a last sample at the end)
    assert {
        "system/cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
        "system/disk_usage_percentage",
    } <= set(run.data.metrics)
    assert run.data.metrics["system/system_memory_usage_megabytes"] > 0
    # the datasets, as MLflow's dataset inputs (the run page's "Datasets used")
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["synthetic/train", "synthetic/val"]
    train = inputs["synthetic/train"]
    assert json.loads(train.dataset.profile)["num_rows"] == 96
    assert [(t.key, t.value) for t in train.tags] == [("mlflow.data.context", "training")]
    assert json.loads(train.dataset.source)["num_train"] == 96 and len(train.dataset.digest) == 16
    output = result.stdout + result.stderr
    assert "mlflow ui --backend-store-uri" in output and "#/experiments/" in output
    assert not (tmp_path / "outputs").exists() or any((tmp_path / "outputs").rglob("runner.log"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["model=resnet1000"], "model: unknown option 'resnet1000'"),
        (["trainer.max_epoch=2"], "trainer.max_epoch"),
        (["optimizer.lr=-0.1"], "optimizer.lr"),
        (["data=cifar10", "data.download=false", "data.root=missing-folder"], "data.root"),
    ],
)
def test_cli_bad_input_exits_nonzero_naming_the_key(tmp_path, args, needle):
    result = run_cli(*args, "trainer.device=cpu", cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert needle in output
    assert "Traceback" not in output
    if (tmp_path / "mlflow.db").exists():
        assert all(
            r.info.status != "RUNNING" for r in all_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [["trainer.max_epoch=2"], ["model=resnet1000"], ["trainer.batch_size=many"]]
)
def test_a_config_error_stops_before_torch_is_imported(tmp_path, args):
    """A typo'd key, an unknown choice or a wrong type is Hydra's compose-time error: no data,
    no model, not even torch is loaded (seconds, not the import of a deep-learning stack)."""
    result = run_cli(*args, cwd=tmp_path, timeout=300, python_flags=("-X", "importtime"))
    assert result.returncode != 0
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "hydra" in imported  # the probe works
    assert not {m for m in imported if m.split(".")[0] in ("torch", "torchvision", "mlflow")}


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.slow
def test_cli_missing_cifar_says_how_to_fix_it(tmp_path):
    """CIFAR's files that are missing and not to be downloaded are refused by the plan: before
    anything is built or tracked (the MLflow store was made first, then the data refused)."""
    result = run_cli("data=cifar10", "data.download=false", "data.root=nowhere", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "data.root" in output and "data=synthetic" in output
    assert "cifar10 not found under data.root=" in output and "Traceback" not in output
    assert not list(tmp_path.rglob("mlflow.db")) and not (tmp_path / "mlruns").exists()
    # a sweep: refused before its first job, no parent run
    sweep = run_cli(
        "-m",
        "data=cifar10",
        "data.download=false",
        "data.root=nowhere",
        "precision=o0,o2_bf16",
        cwd=tmp_path,
    )
    output = sweep.stdout + sweep.stderr
    assert sweep.returncode == 2 and "cifar10 not found under data.root=" in output, output
    assert not list(tmp_path.rglob("mlflow.db")) and not (tmp_path / "mlruns").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch",
    [
        *[[f"hydra/job_logging={p}"] for p in ("default", "stdout", "none", "disabled")],
        ["-m", "precision=o0,o2_bf16", "hydra/hydra_logging=disabled"],  # (a sweep's parent)
    ],
    ids=lambda launch: launch[-1].split("/")[-1],
)
def test_a_refusal_is_told_under_each_of_hydras_logging_presets(tmp_path, launch):
    """Hydra's `disabled` presets (root level ERROR, every existing logger disabled) silenced
    the runner's loggers too: a refused run or sweep exited 2 without a word."""
    result = run_cli(
        *launch[:-1],
        "data=cifar10",
        "data.download=false",
        "data.root=nowhere",
        launch[-1],
        cwd=tmp_path,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "cifar10 not found under data.root=" in output, output


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_marks_the_run_killed(tmp_path, workers):
    """Ctrl-C as a terminal sends it: to the whole process group, DataLoader workers included;
    the main process alone acts on it (one message), and the run stops cleanly."""
    args = [
        *FAST,
        "data.num_train=100000",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        f"trainer.num_workers={workers}",
    ]
    proc = start_cli(*args, cwd=tmp_path, new_session=True)
    seen = read_until(proc, "MLflow run")  # training has started
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + rest
    assert rest.count("Ctrl-C (SIGINT) received") == 1, rest  # (said once, as it came)
    assert "again: stopping at once" not in rest  # (the workers' copies are no second Ctrl-C)
    assert list(tmp_path.rglob("last.pt"))  # stopped after its step, with a checkpoint
    _, run = only_run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "KILLED"
    assert "interrupted" in run.data.tags["error"]
    assert "marked KILLED" in rest and "mlflow ui --backend-store-uri sqlite:///" in rest


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.slow
def test_cli_sweep_composes_bf16_presets(tmp_path):
    result = run_cli(
        "-m",
        "precision=o0,o1_bf16,o2_bf16",
        "dry_run=true",
        "trainer.device=cpu",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("opt_level: O0") == 1 and out.count("opt_level: O1") == 1
    assert out.count("opt_level: O2") == 1 and out.count("autocast_dtype: bfloat16") == 2
    assert not (tmp_path / "mlflow.db").exists()  # a dry-run sweep creates no parent run either


@pytest.mark.slow
def test_cli_opt_level_override_and_divergence_exit_2_without_traceback(tmp_path):
    result = run_cli(
        "precision=o1", "precision.opt_level=O2", "trainer.device=cpu", cwd=tmp_path, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "use precision=o2" in output and "Traceback" not in output
    result = run_cli(
        *FAST,
        "precision=o3",
        "precision.loss_scale=1e10",
        "trainer.max_bad_steps=2",
        cwd=tmp_path,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "consecutive steps were skipped" in output
    assert "Traceback" not in output
    _, run = only_run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FAILED" and "DivergenceError" in run.data.tags["error"]
    # a failed run still says where to look: the UI command and the runs page
    assert "marked FAILED" in output and f"#/experiments/{run.info.experiment_id}/runs" in output
