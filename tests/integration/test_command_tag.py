"""The `command` tag holds the command line as the user typed it: `python -m runner ARGS` (the
interpreter as it was named), or `amp-runner ARGS` through the console script; a sweep's parent
run and its jobs carry the same. Real subprocesses, recorded under `tracking=none`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runner.tracking import tags as tag
from runner.tracking.json_file import FILE
from tests.helpers.runs import FAST, REPO, run_cli

SCRIPT = Path(sys.executable).parent / "amp-runner"


def command_of(folder: Path) -> str:
    return json.loads((folder / FILE).read_text())["tags"][tag.COMMAND]


def test_python_m_runner_is_recorded_as_typed(tmp_path):
    args = [*FAST, "trainer.max_epochs=1", "tracking=none", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    typed = " ".join([Path(sys.executable).name, "-m", "runner", *args])
    assert command_of(tmp_path / "run") == typed
    assert "__main__.py" not in typed


@pytest.mark.skipif(not SCRIPT.is_file(), reason="the amp-runner console script is not installed")
def test_the_console_script_is_recorded_as_typed_in_a_sweep(tmp_path):
    args = ["-m", *FAST, "trainer.max_epochs=1", "tracking=none", f"hydra.sweep.dir={tmp_path}/s"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    typed = " ".join(["amp-runner", *args])
    assert command_of(tmp_path / "s") == typed  # the sweep's parent run
    assert command_of(tmp_path / "s" / "0") == typed  # its one job


def test_a_sweep_with_overrides_after_its_m_is_recorded_as_typed(tmp_path):
    """The entry point puts the overrides together for Hydra's parser (`model=tiny -m
    precision=...`); the tag keeps them where they were typed."""
    args = [*FAST[:2], "-m", *FAST[2:], "trainer.max_epochs=1", "tracking=none"]
    args.append(f"hydra.sweep.dir={tmp_path}/s")
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    typed = " ".join([Path(sys.executable).name, "-m", "runner", *args])
    assert command_of(tmp_path / "s") == typed and command_of(tmp_path / "s" / "0") == typed


def test_a_command_with_quoted_values_pastes_back_as_typed(tmp_path):
    """Words the shell would split or change (a Hydra value quoted for its space and its
    non-ASCII letter, brackets) are recorded quoted: the tag, pasted into bash, gives the run
    the very arguments it had."""
    folder = tmp_path / "a run ü"
    args = [
        *FAST,
        "trainer.max_epochs=1",
        "tracking=none",
        f"hydra.run.dir='{folder}'",
        "optimizer=adam",
        "optimizer.betas=[0.9, 0.99]",
    ]
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    typed = command_of(folder)
    assert f"\"hydra.run.dir='{folder}'\"" in typed and "'optimizer.betas=[0.9, 0.99]'" in typed
    pasted = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {typed}"], capture_output=True, check=True
    ).stdout
    assert pasted.decode().split("\0")[:-1] == [Path(sys.executable).name, "-m", "runner", *args]
    # the `overrides` tag (a sweep job's own: what reruns the job alone) is quoted the same way
    overrides = json.loads((folder / FILE).read_text())["tags"][tag.OVERRIDES]
    assert shlex.split(overrides) == [a for a in args if not a.startswith("hydra.")]
