"""Checkpoints a user can trust: nothing in a file runs, nothing corrupted is used,
nothing that does not fit the run is resumed, and every refusal is a clear error (exit 2 from the
CLI, no traceback) before the MLflow run is reopened.

Real checkpoint files from a real run (tiny model, o2: fp16 model, fp32 masters, Adam, dynamic
loss scale), real MLflow SQLite stores, real `python -m runner` subprocesses for what the CLI
does. Crafted files are written the way an attacker or a damaged disk would: a FORMAT 2 file is an
ordinary `torch.save` archive whose zip comment holds the SHA-256 of the bytes before it (the
format runner.run.checkpoint documents), so `signed()` below writes one independently of the
runner's
writer. Tolerance: none; a loaded state is compared bit for bit with the original.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import math
import os
import pickle
import random
import stat
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy
import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from runner.components.models import build_model
from runner.errors import ConfigError
from runner.precision import AmpEngine, amp, resolve
from runner.run import app, checkpoint, rng
from runner.run.build import build
from runner.run.checkpointer import restore_trainer
from runner.run.context import RunContext
from runner.run.plan import make_plan
from runner.run.trainer import Trainer, trainer_config
from tests.helpers.runs import FAST, compose_config, run_cli

TRAILER_PREFIX = b"amp-runner checkpoint format 2 sha256:"
BASE = ["precision=o2", "optimizer=adam", "trainer.max_epochs=1"]


def settings(folder: Path, *extra: str) -> list[str]:
    """FAST, a store and a checkpoint folder in `folder`; torch's ops rather than the fused
    kernels (a checkpoint holds the same state either way, and no kernel build is waited for)."""
    return [
        *FAST,
        "precision.kernels=torch",
        f"mlflow.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
        f"trainer.checkpoint_dir={folder / 'checkpoints'}",
        *extra,
    ]


def replaced(args: list[str], *new: str) -> list[str]:
    """`args` with each of `new` replacing the override of the same key (a group such as
    `model=` may be given once only)."""
    keys = {n.split("=")[0] for n in new}
    return [a for a in args if a.split("=")[0] not in keys] + list(new)


def signed(payload: bytes) -> bytes:
    """A `torch.save` archive (empty zip comment) as FORMAT 2: the comment set to the trailer,
    the SHA-256 of every byte before it."""
    body = payload[:-2] + struct.pack("<H", len(TRAILER_PREFIX) + 64)
    return body + TRAILER_PREFIX + hashlib.sha256(body).hexdigest().encode()


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_signed(path: Path, state: dict) -> Path:
    path.write_bytes(signed(torch_bytes(state)))
    return path


def numpy_tuple(portable: dict) -> tuple:
    """FORMAT 2's NumPy RNG state as `numpy.random.get_state()`'s tuple (its key an ndarray)."""
    return (
        portable["kind"],
        portable["key"].numpy().astype(numpy.uint32),
        portable["pos"],
        portable["has_gauss"],
        portable["cached_gaussian"],
    )


def write_legacy(path: Path, state: dict) -> Path:
    """A checkpoint as amp-runner wrote it before FORMAT 2: `torch.save({"format": 1, ...})`, no
    checksum, NumPy's RNG state as `numpy.random.get_state()`'s tuple."""
    rng = dict(state["rng"])
    rng["numpy"] = numpy_tuple(rng["numpy"])
    torch.save({**state, "format": 1, "rng": rng}, path)
    return path


def equal(a, b) -> bool:
    """Bit-for-bit equality of two checkpoint states (tensors, NaN-aware numbers, containers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def store_snapshot(uri: str) -> list[tuple]:
    """Every run of the store: id, status, end time, tags, params and metric history lengths."""
    client = MlflowClient(uri)
    out = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            metrics = {
                k: len(client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics
            }
            out.append(
                (
                    run.info.run_id,
                    run.info.status,
                    run.info.end_time,
                    sorted(run.data.tags.items()),
                    sorted(run.data.params.items()),
                    sorted(metrics.items()),
                )
            )
    return sorted(out)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One real 1-epoch run: its folder, checkpoint path, loaded state and settings."""
    folder = tmp_path_factory.mktemp("base")
    args = replaced(settings(folder), *BASE)
    with contextlib.chdir(folder):
        app.run(compose_config(*args))
    path = checkpoint.find(
        "auto", checkpoint.run_folder(folder / "checkpoints", "amp-runner", "tiny-O2")
    )
    return {
        "folder": folder,
        "path": path,
        "state": checkpoint.load(path),
        "args": args,
        "uri": f"sqlite:///{folder / 'mlflow.db'}",
    }


@pytest.fixture(scope="module")
def parts(base):
    """The parts a resumed run builds for the base config (the other side of check_structure)."""
    cfg = compose_config(*base["args"])
    return cfg, build(make_plan(cfg))


def check(state, parts, **overrides):
    cfg, built = parts
    kwargs = dict(
        model=built.model,
        optimizer=built.optimizer,
        engine=built.engine,
        scheduler=built.scheduler,
        world_size=1,
        path=Path("ckpt.pt"),
    )
    kwargs.update(overrides)
    checkpoint.check_structure(state, **kwargs)


# ---- 1. safe loading -------------------------------------------------------------------------
class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def payload_state(base, marker: Path) -> dict:
    return {**base["state"], "config": {"note": Payload(marker)}}


def test_the_payload_is_real(tmp_path):
    """The control: the unsafe unpickler (what the runner used) does run it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("fmt", ["format 2 (valid checksum)", "format 1 (no checksum)"])
def test_a_payload_is_refused_naming_what_it_needs_and_never_runs(tmp_path, base, fmt):
    marker = tmp_path / "ran"
    state = payload_state(base, marker)
    path = tmp_path / "last.pt"
    if fmt.startswith("format 2"):
        write_signed(path, state)
    else:
        torch.save({**state, "format": 1}, path)
    with pytest.raises(ConfigError) as e:
        checkpoint.load(path)
    assert e.value.key == "resume" and str(path) in str(e.value)
    assert "safe unpickler" in str(e.value) and "posix.system" in str(e.value)
    assert "weights_only=False" not in str(e.value)  # torch's advice is not passed on
    assert not marker.exists()


@pytest.mark.slow
def test_the_cli_refuses_a_payload_with_exit_2_and_runs_nothing(tmp_path, base):
    marker = tmp_path / "ran"
    path = write_signed(tmp_path / "shared.pt", payload_state(base, marker))
    before = store_snapshot(base["uri"])
    result = run_cli(*base["args"], f"resume={path}", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "posix.system" in output and str(path) in output and "Traceback" not in output
    assert not marker.exists()
    assert store_snapshot(base["uri"]) == before


# ---- 2. integrity --------------------------------------------------------------------------------
def test_every_single_byte_flip_and_truncation_is_refused(tmp_path, base):
    """200 single-byte flips at seeded random offsets and 20 truncations of a real checkpoint:
    each is refused (ConfigError "is corrupted") or loads a state identical to the original; the
    digest covers every byte, so here all are refused. Any other exception fails the test."""
    data = base["path"].read_bytes()
    original = base["state"]
    rnd = random.Random(18)
    cases = [("flip", rnd.randrange(len(data)), 1 << rnd.randrange(8)) for _ in range(200)]
    cases += [("truncate", rnd.randrange(len(data)), 0) for _ in range(20)]
    path = tmp_path / "damaged.pt"
    refused = identical = 0
    for kind, offset, bit in cases:
        damaged = bytearray(data)
        if kind == "flip":
            damaged[offset] ^= bit
        else:
            del damaged[offset:]
        path.write_bytes(damaged)
        try:
            state = checkpoint.load(path)
        except ConfigError as error:
            assert f"checkpoint {path} is corrupted" in str(error), (kind, offset, str(error))
            refused += 1
            continue
        assert equal(state, original), f"{kind} at {offset}: a silently different state"
        identical += 1
    assert refused + identical == 220 and identical == 0


def test_flips_behind_a_valid_checksum_never_escape_as_another_error(tmp_path, base, parts):
    """What the checksum cannot catch (a crafted file, or a writer's bug: the digest is
    recomputed): flips in the pickle and in the zip records. Each is refused with a ConfigError,
    or loads a state that passes check_structure and restores into a real Trainer; never any
    other exception. Seeded."""
    data = base["path"].read_bytes()
    body = data[: -(len(TRAILER_PREFIX) + 64)]
    archive = zipfile.ZipFile(io.BytesIO(data))
    pickle_entry = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    # the pickle (local header and data), and the central directory up to the end record
    regions = [
        (pickle_entry.header_offset, pickle_entry.header_offset + 100 + pickle_entry.compress_size),
        (archive.start_dir, len(body)),
    ]
    cfg, built = parts
    trainer = Trainer(
        trainer_config(cfg.trainer),
        built,
        RunContext(on_metrics=lambda m, s: None),
        device=torch.device("cpu"),
    )
    rnd = random.Random(1800)
    path = tmp_path / "crafted.pt"
    outcomes = {"refused": 0, "restored": 0}
    for i in range(150):
        start, end = regions[i % 2]
        damaged = bytearray(body)
        damaged[rnd.randrange(start, end)] ^= 1 << rnd.randrange(8)
        damaged[-2:] = b"\x00\x00"
        path.write_bytes(signed(bytes(damaged)))
        try:
            state = checkpoint.load(path)
            check(state, parts)
        except ConfigError as error:
            assert error.key == "resume" and (str(path) in str(error) or "ckpt.pt" in str(error))
            outcomes["refused"] += 1
            continue
        restore_trainer(trainer, state)
        outcomes["restored"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 150


# ---- 3. structure --------------------------------------------------------------------------------
def test_the_real_checkpoint_fits_its_run(base, parts):
    check(base["state"], parts)  # no ConfigError: the baseline every refusal below differs from


def _refusal(state, parts, **overrides) -> str:
    with pytest.raises(ConfigError) as e:
        check(state, parts, **overrides)
    assert e.value.key == "resume" and "ckpt.pt" in str(e.value)
    return str(e.value)


def test_a_model_of_another_architecture_or_shape_is_refused_naming_the_tensor(base, parts):
    state = base["state"]
    other = {**state, "model": {**state["model"]}}
    name, tensor = next((k, v) for k, v in other["model"].items() if v.dim() == 4)
    other["model"][name] = torch.zeros(tensor.shape[0] * 2, *tensor.shape[1:])
    message = _refusal(other, parts)
    shape = list(tensor.shape)
    assert f"model.{name}: {[shape[0] * 2, *shape[1:]]} float32 -> {shape} float32" in message
    missing = {**state, "model": {k: v for k, v in state["model"].items() if k != name}}
    assert f"model.{name}: (absent) -> {shape} float32" in _refusal(missing, parts)
    with torch.device("meta"):  # resnet18's state: its shapes, no memory
        foreign = build_model(compose_config("model=resnet18").model, 10, 16).state_dict()
    message = _refusal({**state, "model": foreign}, parts)
    assert "model.conv1.weight: [64, 3, 3, 3] float32 -> (absent)" in message
    # one difference per tensor (no key in common): the first 8 are listed, then the count
    assert "model.0.0.weight: (absent) -> [16, 3, 3, 3] float32" not in message
    assert f"... and {len(foreign) + len(state['model']) - 8} more" in message


def test_an_optimizer_of_another_kind_is_refused_naming_both(base, parts):
    cfg, built = parts
    params = [
        torch.nn.Parameter(p.detach().clone()) for p in built.engine.master_params(built.optimizer)
    ]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    sgd.step()
    message = _refusal({**base["state"], "optimizer": sgd.state_dict()}, parts)
    assert (
        "optimizer.param_groups.0: the hyperparameters of SGD (dampening, momentum, "
        "nesterov) -> Adam's (amsgrad, betas, eps)" in message
    )
    # the hyperparameters of Adam, the state of SGD (a file edited by hand)
    state = base["state"]["optimizer"]
    mixed = {"param_groups": state["param_groups"], "state": sgd.state_dict()["state"]}
    assert (
        "optimizer.state.0: momentum_buffer -> Adam's exp_avg, exp_avg_sq, max_exp_avg_sq, "
        "step" in _refusal({**base["state"], "optimizer": mixed}, parts)
    )
    fewer = {
        "param_groups": [
            {**state["param_groups"][0], "params": state["param_groups"][0]["params"][:-1]}
        ],
        "state": {
            k: v for k, v in state["state"].items() if k in state["param_groups"][0]["params"][:-1]
        },
    }
    n = len(state["param_groups"][0]["params"])
    assert f"optimizer.param_groups.0.params: {n - 1} parameter(s) -> {n}" in _refusal(
        {**base["state"], "optimizer": fewer}, parts
    )


def test_an_engine_scheduler_or_world_size_of_another_kind_is_refused(base, parts):
    state = base["state"]
    scale = state["engine"]["loss_scaler0"]["loss_scale"]
    static = AmpEngine(resolve("O0", {}).properties, "cpu", kernels="torch")
    assert (
        f"engine.loss_scaler0.loss_scale: {scale!r} -> 1.0 (this run's static scale)"
        in _refusal(state, parts, engine=static)
    )
    two = {**state, "engine": {**state["engine"], "loss_scaler1": state["engine"]["loss_scaler0"]}}
    assert "engine: 2 loss scaler(s) (loss_scaler0, loss_scaler1) -> 1 (loss_scaler0)" in _refusal(
        two, parts
    )
    other = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    step = torch.optim.lr_scheduler.StepLR(other, 3)
    message = _refusal(state, parts, scheduler=step)
    assert (
        "scheduler: the state of another scheduler (T_max, base_lrs, eta_min, last_epoch) "
        "-> StepLR (base_lrs, gamma, last_epoch, step_size)" in message
    )
    assert "scheduler: a scheduler -> (none)" in _refusal(state, parts, scheduler=None)
    assert "world_size: 1 -> 2" in _refusal(state, parts, world_size=2)


# ---- contents: every malformed value is a ConfigError naming its key ----------------------------
def _bad_states(state):
    nan_scale = {
        **state["engine"],
        "loss_scaler0": {**state["engine"]["loss_scaler0"], "loss_scale": float("nan")},
    }
    no_unskipped = {**state["engine"], "loss_scaler0": {"loss_scale": 2.0}}
    rng_python = {**state["rng"], "python": (3, (1, 2, 3), None)}
    rng_torch = {**state["rng"], "torch": torch.zeros(7, dtype=torch.uint8)}
    rng_numpy = {**state["rng"], "numpy": {**state["rng"]["numpy"], "key": torch.zeros(3)}}
    return {
        "epoch": {**state, "epoch": "1"},
        "batch": {**state, "batch": -1},
        "model": {**state, "model": {"w": [1.0, 2.0]}},
        "optimizer": {**state, "optimizer": {"state": {}}},
        "engine.loss_scaler0.loss_scale": {**state, "engine": nan_scale},
        "engine.loss_scaler0.unskipped": {**state, "engine": no_unskipped},
        "rng.python": {**state, "rng": rng_python},
        "rng.torch": {**state, "rng": rng_torch},
        "rng.numpy": {**state, "rng": rng_numpy},
        "history": {**state, "history": [{"val_acc": "high"}]},
        "config": {**state, "config": [1, 2]},
        "world_size": {**state, "world_size": 0},
        "surprise": {**state, "surprise": 1},
        "global_step": {k: v for k, v in state.items() if k != "global_step"},
    }


BAD = [
    "epoch",
    "batch",
    "model",
    "optimizer",
    "engine.loss_scaler0.loss_scale",
    "engine.loss_scaler0.unskipped",
    "rng.python",
    "rng.torch",
    "rng.numpy",
    "history",
    "config",
    "world_size",
    "surprise",
    "global_step",
]


@pytest.mark.parametrize("key", BAD)
def test_a_malformed_value_is_refused_naming_its_key(tmp_path, base, key):
    bad = _bad_states(base["state"])
    assert list(bad) == BAD
    path = write_signed(tmp_path / "last.pt", bad[key])
    with pytest.raises(ConfigError) as e:
        checkpoint.load(path)
    assert e.value.key == "resume" and f"{key}:" in str(e.value) and str(path) in str(e.value)


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_save_never_writes_what_load_would_refuse(tmp_path, base):
    state = {k: v for k, v in base["state"].items() if k != "format"}
    with pytest.raises(TypeError, match="history"):
        checkpoint.save(tmp_path / "last.pt", {**state, "history": [{"val_acc": numpy.float64(1)}]})
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["missing config", "resnet18 config, tiny weights", "sgd config, adam state"]
)
def test_the_cli_refuses_a_checkpoint_that_does_not_fit_before_reopening_its_run(
    tmp_path, base, case
):
    """Exit 2, the key named, no traceback, the MLflow store untouched. The crafted configs are
    the ones the CLI resolves for the same overrides, so only the structure check stands in the
    way (a plain `model=resnet18` is refused earlier, by the config comparison). The resumed run
    asks for a second epoch: a run that has already trained its epochs only says so and changes
    nothing, without building a model to compare."""
    state = dict(base["state"])
    extra: list[str] = ["trainer.max_epochs=2"]
    if case == "missing config":
        del state["config"]
        wanted = "lacks the key(s) config, which every run's checkpoint holds"
    else:
        extra += ["model=resnet18"] if case.startswith("resnet18") else ["optimizer=sgd"]
        cfg = compose_config(*replaced(base["args"], *extra))
        state["config"] = OmegaConf.to_container(cfg, resolve=True)
        wanted = (
            "model.0.0.weight: [16, 3, 3, 3] float32 -> (absent)"
            if "model=resnet18" in extra
            else "optimizer.param_groups.0: the hyperparameters of Adam/AdamW (amsgrad, betas, "
            "eps) -> SGD's (dampening, momentum, nesterov)"
        )
    path = tmp_path / "last.pt"
    checkpoint.save(path, {k: v for k, v in state.items() if k != "format"})
    before = store_snapshot(base["uri"])
    result = run_cli(*replaced(base["args"], *extra), f"resume={path}", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert wanted in output and str(path) in output and "Traceback" not in output, output[-3000:]
    assert store_snapshot(base["uri"]) == before


# ---- 4. old checkpoints --------------------------------------------------------------------------
def test_a_format_1_checkpoint_loads_with_a_warning_and_its_exact_rng(tmp_path, base, caplog):
    path = write_legacy(tmp_path / "old.pt", base["state"])
    with caplog.at_level(logging.WARNING, logger="runner.run.checkpoint"):
        state = checkpoint.load(path)
    assert "has no checksum" in caplog.text and "cannot be verified" in caplog.text
    assert equal(
        {k: v for k, v in state.items() if k != "format"},
        {k: v for k, v in base["state"].items() if k != "format"},
    )
    rng.restore_rng(state["rng"])
    want = numpy_tuple(base["state"]["rng"]["numpy"])
    got = numpy.random.get_state()
    assert got[0] == want[0] and numpy.array_equal(got[1], want[1]) and got[2:] == want[2:]


def test_a_format_1_checkpoint_still_resumes_with_the_warning(tmp_path, caplog):
    args = replaced(settings(tmp_path), "trainer.max_epochs=1", "mlflow.run_name=old")
    app.run(compose_config(*args))
    path = checkpoint.find(
        "auto", checkpoint.run_folder(tmp_path / "checkpoints", "amp-runner", "old")
    )
    write_legacy(path, checkpoint.load(path))
    with caplog.at_level(logging.WARNING, logger="runner.run.checkpoint"):
        app.run(compose_config(*replaced(args, "trainer.max_epochs=2"), f"resume={path}"))
    assert f"Checkpoint {path} has no checksum" in caplog.text
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("amp-runner").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    resumed = checkpoint.load(path)  # rewritten by the resumed run: FORMAT 2, verified
    assert resumed["format"] == checkpoint.FORMAT and resumed["epoch"] == 2


# ---- 5. durability and leftovers -----------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_the_disk_refuses_stops_the_run_in_one_line_keeping_the_last(tmp_path):
    """A write the file system refuses (here past `ulimit -f`, EFBIG, as a full disk refuses
    with ENOSPC; torch.save reports either as "unexpected pos") ended in a traceback, exit 1.
    Now one line names the file, the cause and what is kept: the checkpoint before stays whole
    (the write is atomic) and resume=auto continues from it once the disk has room."""
    args = [
        *FAST,
        "tracking=none",
        "precision.kernels=torch",  # (nothing compiled: no file but the checkpoint's is large)
    ]
    first = run_cli(*args, "trainer.max_epochs=1", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (path,) = tmp_path.glob("checkpoints/amp-runner/tiny-O0/*/last.pt")
    before = path.read_bytes()
    limit = len(before) // 2  # room for every other file, not for the checkpoint
    refused = run_cli(
        *args, "trainer.max_epochs=2", "resume=auto", cwd=tmp_path, timeout=300, file_limit=limit
    )
    told = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "Traceback" not in told, told[-3000:]
    assert f"Cannot write the checkpoint {path}: File too large" in told
    assert "the checkpoint written before is kept there: fix that, then resume=auto" in told
    assert path.read_bytes() == before and not list(path.parent.glob(".*.tmp"))
    (record,) = [
        json.loads(p.read_text())
        for p in tmp_path.glob("outputs/*/*/tracking.json")
        if json.loads(p.read_text())["status"] == "FAILED"
    ]
    assert "Cannot write the checkpoint" in record["tags"]["error"]
    again = run_cli(*args, "trainer.max_epochs=2", "resume=auto", cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and "Resuming tiny-O0" in again.stdout + again.stderr
    assert checkpoint.load(path)["epoch"] == 2


def test_a_write_error_that_is_not_the_file_systems_stays_a_bug(tmp_path):
    """Only an OSError (raised, or under torch.save's RuntimeError) is the disk's; any other
    error of a save is a bug and keeps its traceback."""
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 2")
    wrapped.__context__ = full
    said = str(checkpoint.unwritable(tmp_path / "a" / "last.pt", wrapped))
    assert said.startswith(f"Cannot write the checkpoint {tmp_path / 'a' / 'last.pt'}: No space")
    assert "MB free there)" in said and "no checkpoint of this run was written before" in said
    assert "on a disk with room" in said
    assert checkpoint.unwritable(tmp_path / "last.pt", TypeError("a bug")) is None


def test_save_flushes_the_folder_after_the_rename(tmp_path, base, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    checkpoint.save(
        tmp_path / "run" / "last.pt", {k: v for k, v in base["state"].items() if k != "format"}
    )
    assert synced == [False, True]  # the file, then its folder


def test_a_dead_process_temporary_file_is_removed_at_the_next_save(tmp_path, base):
    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid no longer exists
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = folder / f".last.pt.{dead.pid}.tmp"
        live = folder / f".last.pt.{alive.pid}.tmp"
        other = folder / "notes.tmp"
        for leftover in (stale, live, other):
            leftover.write_bytes(b"partial")
        checkpoint.save(
            folder / "last.pt", {k: v for k, v in base["state"].items() if k != "format"}
        )
        assert not stale.exists()
        assert live.exists() and other.exists()  # a live writer's file, and not ours to judge
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["last.pt", live.name, other.name]
        )
    finally:
        alive.kill()
        alive.wait()


# ---- 6. the Apex facade: amp.load_state_dict -----------------------------------------------------
@pytest.fixture
def two_losses():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", num_losses=2, verbosity=0)
    yield
    amp.deinitialize()


GOOD = {"loss_scale": 8.0, "unskipped": 3}


@pytest.mark.parametrize(
    "sd,error,names",
    [
        ({"loss_scaler0": GOOD, "loss_scaler2": GOOD}, ValueError, "loss_scaler1 is missing"),
        ({"loss_scaler0": {"unskipped": 0}}, ValueError, "loss_scaler0.loss_scale: missing"),
        (
            {"loss_scaler0": {"loss_scale": -2.0, "unskipped": 0}},
            ValueError,
            "loss_scaler0.loss_scale: -2.0 is not a finite number > 0",
        ),
        (
            {"loss_scaler0": {"loss_scale": float("nan"), "unskipped": 0}},
            ValueError,
            "loss_scaler0.loss_scale: nan",
        ),
        (
            {"loss_scaler0": {"loss_scale": "8", "unskipped": 0}},
            ValueError,
            "loss_scaler0.loss_scale: '8'",
        ),
        (
            {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1.5}},
            ValueError,
            "loss_scaler0.unskipped: 1.5 is not an integer >= 0",
        ),
        (
            {"loss_scaler0": {**GOOD, "scale_window": 5}},
            ValueError,
            "loss_scaler0.scale_window: unknown key",
        ),
        ({"loss_scaler0": 8.0}, ValueError, "loss_scaler0: a dict of loss_scale and unskipped"),
        (
            {"loss_scaler0": GOOD, "optimizer": {}},
            RuntimeError,
            'Unexpected key(s) in state_dict: "optimizer"',
        ),
        ([("loss_scaler0", GOOD)], TypeError, "expects the dict amp.state_dict() returns"),
    ],
)
def test_amp_load_state_dict_refuses_a_malformed_dict_naming_the_key(two_losses, sd, error, names):
    before = amp.state_dict()
    with pytest.raises(error) as e:
        amp.load_state_dict(sd)
    assert names in str(e.value)
    assert amp.state_dict() == before  # checked before any scaler changed


def test_amp_load_state_dict_still_loads_the_engine_layout(two_losses):
    amp.load_state_dict(
        {"loss_scaler0": GOOD, "loss_scaler1": {**GOOD, "loss_scale": 4.0}, "skipped_steps": 7}
    )
    assert amp.state_dict()["loss_scaler1"] == {
        "loss_scale": 4.0,
        "unskipped": 3,
        "hysteresis_tracker": 1,
    }
