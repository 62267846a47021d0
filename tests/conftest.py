"""Shared fixtures and pytest hooks (the helpers they use live in tests/helpers): real SQLite
MLflow stores, the O0-O3 sweep made once per session, a real `mlflow server`, every test in its own
temporary folder, and `gpu` tests skipped without CUDA."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import LEVELS_SWEEP, run_cli
from tests.helpers.server import MlflowServer


def pytest_configure(config):
    """Under pytest-xdist each worker computes on one thread, and so does every process a test
    starts (OMP_NUM_THREADS, unless set): `-n auto` runs a worker per core, and torch's default
    of a thread per core in each made every parallel region wait for a core the other worker
    held (the tiny GPT's 200 steps: 1.0 s alone, 6.1 s beside a busy process on 2 threads, 2.5 s
    on 1). The fused kernels' tests split their work over two threads themselves."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))


@pytest.fixture
def tracking_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="session")
def levels_sweep(tmp_path_factory):
    """(completed process, tracking URI) of `python -m runner -m precision=o0,o1,o2,o3 ...`."""
    folder = tmp_path_factory.mktemp("levels-sweep")
    result = run_cli("-m", *LEVELS_SWEEP, cwd=folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, f"sqlite:///{folder / 'mlflow.db'}"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where CUDA is present and skip cleanly elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _store_template(tmp_path_factory) -> Path:
    """A new MLflow SQLite store, made by MLflow once per test process."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("store-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(autouse=True)
def _cpu_bf16_as_fast_as_fp32(request, monkeypatch):
    """A run in the test process reads its CPU as one with bfloat16 instructions (a bf16 matrix
    product as fast as an fp32 one), so that its findings, and a strict run's refusal, do not
    depend on the machine the suite runs on. The warning for a slow CPU is tested with
    `DeviceInfo`'s ratio given; a test marked `real_cpu_speed` measures this CPU's."""
    if "real_cpu_speed" not in request.keywords:
        from runner.precision import checks

        monkeypatch.setattr(checks, "cpu_bf16_matmul_ratio", lambda: 1.0)


@pytest.fixture(autouse=True)
def _a_store_in_the_folder(request, tmp_path: Path, _store_template: Path):
    """Each test's folder starts with `mlflow.db`, the runs' default store there, as a copy of a
    store MLflow made: as after a user's first run (MLflow's creation of a store, its ~50 schema
    migrations, takes 1-2 s, paid once by a user and once per test here: 8-10% of the time of
    test_docs.py and test_report.py, measured). A test marked `new_store` starts in an empty
    folder: a run that creates the store, or a check that nothing (no store) was created."""
    if "new_store" not in request.keywords:
        shutil.copyfile(_store_template, tmp_path / "mlflow.db")


@pytest.fixture(autouse=True)
def _launch_in_tmp_dir(tmp_path: Path, monkeypatch):
    """A run writes ./mlruns (artifacts), ./outputs and ./data where it is launched: keep every
    test's files in its own temporary folder, never in the checkout. Modules a run imported from
    that folder (a user's `my_pkg`, also as a namespace package) are forgotten afterwards, so the
    next test's `my_pkg` is its own, as in a fresh process. trainer.tune's cache of decisions
    is the test's own too (a decision measured by another test is never reused), and the
    environment is restored after the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMP_RUNNER_TUNE_CACHE", str(tmp_path / "tune-cache"))
    before = set(sys.modules)
    environment = dict(os.environ)
    yield
    # what the code under test set in os.environ (MLflow's HTTP settings, which a tracker sets
    # where the user has not) goes with the test: a later test's child processes inherit only
    # what a user's shell would give them (one such leak once hid a hang of the replay)
    for key in set(os.environ) - set(environment):
        del os.environ[key]
    for key, value in environment.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    folder = str(tmp_path)
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        places = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", [])]
        if any(str(place).startswith(folder) for place in places):
            del sys.modules[name]


@pytest.fixture
def mlflow_server(tmp_path: Path):
    server = MlflowServer(f"sqlite:///{tmp_path / 'server.db'}", tmp_path)
    yield server
    server.stop()
