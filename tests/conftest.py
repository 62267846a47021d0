"""Shared fixtures: real Hydra composition of the project's config tree, real SQLite MLflow
stores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import runner.config  # noqa: F401  (registers the schemas)
from runner.config.finder import config_dir

REPO = Path(__file__).resolve().parent.parent

# Settings that make a real run take seconds on a CPU: tiny model, small synthetic images.
FAST = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=96",
    "data.num_val=32",
    "data.image_size=16",
    "trainer.batch_size=32",
    "trainer.max_epochs=2",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=2",
]


def compose_config(*overrides: str, return_hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


@pytest.fixture
def tracking_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def run_cli(
    *args: str, cwd: Path, timeout: float = 600, python_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` in a real subprocess, as a user would type it (`python_flags`:
    interpreter options such as `-X importtime`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *python_flags, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_in_process(*args: str) -> int:
    """`python -m runner ARGS` through the real CLI entry and Hydra, in this process (no import
    cost; the sweep's jobs run here too); returns the exit status."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    from runner.__main__ import cli

    root = logging.getLogger()
    saved = sys.argv, root.handlers[:], root.level
    sys.argv = ["runner", *args]
    try:
        cli()
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv, root.handlers[:], level = saved
        root.setLevel(level)  # Hydra configured logging for its jobs: undo it for later tests
        GlobalHydra.instance().clear()  # so that later compose() calls can initialise again


# A sweep over the four Apex levels, small enough for a CPU: fp16 is emulated there (slow), so few
# batches. Run once per test session, in a real subprocess; tests read its store.
LEVELS_SWEEP = [*FAST, "data.num_train=64", "precision=o0,o1,o2,o3"]


@pytest.fixture(scope="session")
def levels_sweep(tmp_path_factory):
    """(completed process, tracking URI) of `python -m runner -m precision=o0,o1,o2,o3 ...`."""
    folder = tmp_path_factory.mktemp("levels-sweep")
    result = run_cli("-m", *LEVELS_SWEEP, cwd=folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, f"sqlite:///{folder / 'mlflow.db'}"


def start_cli(
    *args: str, cwd: Path, env: dict | None = None, new_session: bool = False
) -> subprocess.Popen:
    """`python -m runner ARGS` started in the background (stdout and stderr merged, line by line),
    for tests that act on a run while it trains (signals, a server going away). `new_session`:
    its own process group, which `os.killpg` signals as a terminal's Ctrl-C would."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def read_until(proc: subprocess.Popen, text: str, timeout: float = 240) -> list[str]:
    """The lines `proc` prints up to the first that holds `text` (or until it ends or `timeout`
    seconds pass: the caller's assertions then show what it printed)."""
    import time

    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line or time.monotonic() > deadline:
            break
    return seen


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where CUDA is present and skip cleanly elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _launch_in_tmp_dir(tmp_path: Path, monkeypatch):
    """A run writes ./mlruns (artifacts), ./outputs and ./data where it is launched: keep every
    test's files in its own temporary folder, never in the checkout."""
    monkeypatch.chdir(tmp_path)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` on localhost over a store; stop() and start() again keep the port
    and the store (a server that goes away and comes back)."""

    def __init__(self, backend_uri: str, folder: Path, port: int | None = None):
        self.backend_uri = backend_uri
        self.folder = folder
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = 120) -> MlflowServer:
        import time
        import urllib.error
        import urllib.request

        self._log = (self.folder / f"server-{self.port}.log").open("a")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                self.backend_uri,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--artifacts-destination",
                str(self.folder / "server-artifacts"),
            ],
            cwd=self.folder,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log_text()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # (a slow start)
                assert time.monotonic() < deadline, "mlflow server did not start in time"
                time.sleep(0.5)

    def stop(self) -> None:
        import os as _os
        import signal as _signal

        if self.process is None:
            return
        try:
            _os.killpg(self.process.pid, _signal.SIGTERM)  # the server and its workers
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            _os.killpg(self.process.pid, _signal.SIGKILL)
            self.process.wait()
        self.process = None
        self._log.close()

    def log_text(self) -> str:
        return "".join(p.read_text() for p in self.folder.glob("server-*.log"))[-3000:]


@pytest.fixture
def mlflow_server(tmp_path: Path):
    server = MlflowServer(f"sqlite:///{tmp_path / 'server.db'}", tmp_path)
    yield server
    server.stop()
