"""The config tree ships inside the wheel: `python -m runner` works from a non-editable install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import REPO


@pytest.mark.slow
def test_wheel_install_finds_conf_and_experiments(tmp_path: Path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", str(REPO), "--no-deps", "-w", str(wheels)],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    wheel = next(wheels.glob("amp_runner-*.whl"))
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = subprocess.run(
        [sys.executable, "-c", "import runner.config.finder as p; print(p.config_dir())"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    conf = Path(probe.stdout.strip())
    assert conf == site / "runner" / "conf"  # the wheel's copy, not the source tree
    source = REPO / "conf"
    shipped = {p.relative_to(conf) for p in conf.rglob("*.yaml")}
    assert {p.relative_to(source) for p in source.rglob("*.yaml")} <= shipped  # every option
    # experiments/ ships as the `experiment` group (conf/experiment is a link to it, which
    # rglob does not follow on every Python: look at the folder itself)
    experiments = {p.name for p in (REPO / "experiments").glob("*.yaml")}
    assert experiments and experiments <= {p.name for p in (conf / "experiment").glob("*.yaml")}
    assert (conf / "experiment" / "README.md").is_file()
    # every module of the package, in every room, ships (a sub-package missing from
    # pyproject's list would install without it)
    package = REPO / "runner"
    modules = {p.relative_to(package) for p in package.rglob("*.py")}
    assert modules <= {p.relative_to(site / "runner") for p in (site / "runner").rglob("*.py")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "model=tiny",
            "data=synthetic",
            "precision=o1",
            "dry_run=true",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "opt_level: O1" in result.stdout
    experiment = subprocess.run(  # an experiment, composed from the wheel's copy, as a sweep
        [sys.executable, "-m", "runner", "-m", "+experiment=cpu_demo", "dry_run=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert experiment.returncode == 0, experiment.stderr[-2000:]
    assert "opt_level: O0" in experiment.stdout and "opt_level: O2" in experiment.stdout
