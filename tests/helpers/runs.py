"""Running the runner from tests: the repository's root, the settings that make a real run take
seconds on a CPU, real Hydra composition of the project's config tree, and `python -m runner` in a
subprocess, in the background, or through the real CLI entry in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import runner.config  # noqa: F401  (registers the schemas)
from runner.config.finder import config_dir

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent  # the probe scripts, apex_l0.sh, preset_values.json

# Settings that make a real run take seconds on a CPU: tiny model, small synthetic images.
# the tiny CNN on 96 + 32 synthetic 16-px images: a run of seconds
TINY = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=96",
    "data.num_val=32",
    "data.image_size=16",
]
# ... with no loader workers and no progress bar (the defaults on: TINY alone)
FAST = [
    *TINY,
    "trainer.batch_size=32",
    "trainer.max_epochs=2",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=2",
]


def compose_config(*overrides: str, return_hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = 600,
    python_flags: tuple[str, ...] = (),
    address_limit: int | None = None,
    module: str = "runner",
    file_limit: int | None = None,
    reader_gone: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` in a real subprocess, as a user would type it (`python_flags`:
    interpreter options such as `-X importtime`; `address_limit`: its address space in bytes,
    as `ulimit -v` sets it, so that an allocation beyond it fails at once; `module`: another
    command, such as runner.diagnose; `file_limit`: the largest file it may write, in bytes, as
    `ulimit -f` sets it: a write past it fails as on a full disk, with EFBIG; `reader_gone`: its
    stdout a pipe whose reader has gone, as after `| head` read what it wanted: each write to it
    fails with EPIPE, and the result has no stdout: None)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))

    def limited() -> None:
        import resource

        if address_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_limit, address_limit))
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    stdout: int = subprocess.PIPE
    if reader_gone:
        read, stdout = os.pipe()
        os.close(read)
    try:
        return subprocess.run(
            [sys.executable, *python_flags, "-m", module, *args],
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            preexec_fn=limited if address_limit is not None or file_limit is not None else None,
        )
    finally:
        if reader_gone:
            os.close(stdout)


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


def start_cli(
    *args: str,
    cwd: Path,
    env: dict | None = None,
    new_session: bool = False,
    stderr_apart: bool = False,
) -> subprocess.Popen:
    """`python -m runner ARGS` started in the background (stdout and stderr merged, line by line;
    `stderr_apart`: a pipe of its own), for tests that act on a run while it trains (signals, a
    server going away, its reader leaving). `new_session`: its own process group, which
    `os.killpg` signals as a terminal's Ctrl-C would."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT,
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
