"""Settings shared by the data-parallel and sharded tests: the GroupNorm variant of `tiny`
(BatchNorm's batch statistics differ by construction between 2 x 16 and 1 x 32 images), small
synthetic data; and torchrun, started as the tests start it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.runs import REPO

COMMON = [
    "model=tiny_gn",
    "data=synthetic",
    "data.num_train=160",
    "data.num_val=40",
    "data.image_size=16",
    "trainer.max_epochs=2",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "scheduler=none",
]


def torchrun_env() -> dict[str, str]:
    """The environment of a torchrun the tests start: this checkout importable, output
    unbuffered, one thread a process (two processes share two cores)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def torchrun_command(nproc: int, *entry: str) -> list[str]:
    """torchrun (its module) starting `entry` (`-m runner ...`, or a script and its arguments)
    `nproc` times."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, f"--nproc_per_node={nproc}", *entry]


def start_torchrun(
    nproc: int,
    args: list[str],
    cwd: Path,
    script: str | None = None,
    env: dict[str, str] | None = None,
    **streams: Any,
) -> subprocess.Popen:
    """`torchrun --nproc_per_node=nproc -m runner ARGS` (or a script) started, not waited for,
    in a session of its own (`os.killpg` ends it all); `env`: variables added to its
    environment; `streams`: Popen's stdout and stderr."""
    target = [script] if script else ["-m", "runner"]
    return subprocess.Popen(
        torchrun_command(nproc, *target, *args),
        cwd=cwd,
        env=dict(torchrun_env(), **(env or {})),
        text=True,
        start_new_session=True,
        **streams,
    )


def torchrun(
    nproc: int, args: list[str], cwd: Path, script: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=nproc -m runner ARGS` (or a script) in a session of its own:
    a rank left waiting on a collective is killed with the whole group when time is up, not
    left behind."""
    process = start_torchrun(
        nproc, args, cwd, script, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"torchrun did not end within {timeout} s:\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
