"""An unexpected error in a run (a user's model whose forward raises): the full traceback is in the
run's `runner.log` and in the FAILED run (MLflow's artifact `traceback.txt`, or the record of a
`tracking=none` run, with the attached `logs/runner.log`); the console shows only the last frames
(from the user's own code on) and says where the full traceback is; the exit status stays 1. A
sweep's job says the same, and the sweep goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.tracking.json_file import FILE
from tests.helpers.runs import FAST, run_cli
from tests.helpers.store import all_runs

# a user's classifier whose forward raises on real data (the planning's meta forward passes)
BROKEN = """
from torch import nn


class Broken(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.head = nn.Linear(3, num_classes)

    def forward(self, x):
        out = self.head(x.mean(dim=(2, 3)))
        return out if x.is_meta else check(out)


def check(out):
    raise ValueError("my model's own bug")
"""
BROKEN_RUN = ["model=custom", "model._target_=my_pkg.Broken", "trainer.max_epochs=1"]
FULL = ["Traceback (most recent call last):", "in train_step", "in forward", "in check"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text(BROKEN)
    return tmp_path


def told(output: str, out: Path) -> str:
    """The console's account of the error, checked: the last frames, not the full traceback."""
    assert "The run failed with an unexpected error." in output
    assert re.search(r"Traceback \(the last \d+ of \d+ frames, most recent call last\):", output)
    assert 'my_pkg/__init__.py", line 12, in forward' in output and "in check" in output
    assert "ValueError: my model's own bug" in output
    assert "in train_step" not in output and "Traceback (most recent call last)" not in output
    assert "HYDRA_FULL_ERROR" not in output
    where = re.search(
        r"The full traceback: (\S+) and the artifact traceback\.txt of the FAILED run (\w+)", output
    )
    assert where, output[-3000:]
    assert Path(where.group(1)) == out / "runner.log"
    return where.group(2)


def test_the_full_traceback_is_kept_in_the_log_and_the_failed_mlflow_run(project):
    uri = f"sqlite:///{project / 'mlflow.db'}"
    out = project / "run"
    result = run_cli(
        *FAST, *BROKEN_RUN, f"mlflow.tracking_uri={uri}", f"hydra.run.dir={out}", cwd=project
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    run_id = told(output, out)
    log = (out / "runner.log").read_text()
    assert all(text in log for text in FULL), log[-3000:]
    (run,) = all_runs(uri)
    assert run.info.run_id == run_id and run.info.status == "FAILED"
    assert run.data.tags["error"] == "ValueError: my model's own bug"
    client = MlflowClient(uri)
    kept = Path(client.download_artifacts(run_id, "traceback.txt")).read_text()
    assert all(text in kept for text in FULL) and "in main" in kept  # from the CLI's entry on
    attached = Path(client.download_artifacts(run_id, "logs/runner.log")).read_text()
    assert all(text in attached for text in FULL)


def test_under_tracking_none_the_record_keeps_it(project):
    out = project / "run"
    result = run_cli(*FAST, *BROKEN_RUN, "tracking=none", f"hydra.run.dir={out}", cwd=project)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    run_id = told(output, out)
    record = json.loads((out / FILE).read_text())
    assert record["run_id"] == run_id and record["status"] == "FAILED"
    assert {"traceback.txt", "logs/runner.log"} <= set(record["artifacts"])
    for artifact in ("traceback.txt", "logs/runner.log"):
        text = (out / "artifacts" / artifact).read_text()
        assert all(needle in text for needle in FULL), artifact


def test_a_sweep_job_says_the_same_and_the_sweep_goes_on(project):
    sweep = project / "sweep"
    args = ["-m", *FAST, *BROKEN_RUN, "optimizer.lr=0.1,0.2", "tracking=none"]
    result = run_cli(*args, f"hydra.sweep.dir={sweep}", cwd=project)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]  # every job ran, and failed
    for job in ("0", "1"):
        assert f"Sweep job #{job} failed with an unexpected error." in output
        record = json.loads((sweep / job / FILE).read_text())
        assert record["status"] == "FAILED" and "traceback.txt" in record["artifacts"]
        text = (sweep / job / "artifacts" / "traceback.txt").read_text()
        assert all(needle in text for needle in FULL)
        assert f"{sweep / job / 'runner.log'} and the artifact traceback.txt" in output
    assert "in train_step" not in output and "Traceback (most recent call last)" not in output


# ---- data that is not finite ---------------------------------------------------------------------
class _WithNaN(torch.utils.data.Dataset):
    """Random 8-px images, two of them with a NaN pixel (a corrupt sample, a bad transform)."""

    classes = [str(i) for i in range(10)]

    def __init__(self, n: int, bad: tuple[int, ...] = ()):
        self.n, self.bad = n, set(bad)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(i))
        if i in self.bad:
            x[0, 0, 0] = float("nan")
        return x, i % 10


def nan_data():
    return _WithNaN(128, bad=(5, 77)), _WithNaN(32)


def test_inputs_that_are_not_finite_are_named_and_the_nan_model_fails(tmp_path, capsys):
    """Two samples with a NaN pixel made the O0 weights NaN; the run went on with NaN losses
    (fewer than trainer.max_bad_steps) and ended FINISHED, its accuracy chance's, saying nothing
    of the data. The batches' inputs are watched on the device and read with the loss: a warning
    names the data, and weights gone NaN stop the run at the epoch's end, FAILED."""
    from tests.helpers.runs import run_in_process

    code = run_in_process(
        "model=tiny",
        "data=custom",
        "data._target_=tests.integration.test_run_failures.nan_data",
        "trainer.batch_size=32",
        "trainer.max_epochs=2",
        "trainer.num_workers=0",
        "tracking=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    said = "".join(capsys.readouterr())
    assert code == 2, said[-3000:]
    held = r"(1 training batch|2 training batches) held inf/NaN inputs: the data itself is not "
    assert re.search(f"Up to step 4, {held}", said)
    record = json.loads((tmp_path / "run" / FILE).read_text())
    assert record["status"] == "FAILED"
    assert re.match(
        r"DivergenceError: training diverged: the model's weights or buffers \(a BatchNorm's "
        r"running statistics\) are inf/NaN after epoch 1 \(step 4\), and every later step would "
        f"start from them; the last checkpoint, if any, is the last good state: {held}",
        record["tags"]["error"],
    )
