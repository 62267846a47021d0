"""A real `mlflow server` on localhost over a real store, for tests of a tracking server that is not
there, goes away or comes back, and of the report read through its REST API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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
            # without MLflow 3's GenAI job runner: seven more processes (a runner and its huey
            # consumers) that each import MLflow at the server's start, 20 s of CPU on this
            # 2-core machine that slowed the runs under test fivefold in their first epoch
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
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
