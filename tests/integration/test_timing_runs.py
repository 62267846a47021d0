"""The step timer in real runs through the CLI: a slow first step stays out of the steady
throughput, a slow dataset shows as the data wait and a finding, a resumed run warms up again,
and planning's FLOPs count reaches the params and the epochs' tflops."""

from __future__ import annotations

import json
import statistics

import pytest

from runner.measure import spread, step_trace
from runner.measure.spread import number
from runner.tracking.json_file import FILE
from tests.helpers import timing_models
from tests.helpers.runs import run_in_process

QUIET = ["trainer.progress_bar=false", "trainer.num_workers=0", "tracking=none"]


def record(folder) -> dict:
    return json.loads((folder / FILE).read_text())


def values(rec: dict, metric: str) -> list[tuple[int, float]]:
    return [(step, value) for step, value, *_ in rec["metrics"].get(metric, [])]


def test_a_slow_first_step_stays_out_of_the_steady_throughput(tmp_path):
    """A user model whose first training step sleeps 3 s and every later one 50 ms: the
    logged samples_per_s is the batch over the step time the model itself saw (within 10%),
    the warm-up took at least the 3 s, and the epoch's own figure, which counts them, is lower.
    (The runner times the steps' ends, the model their starts: a stall in the last step counts
    on one side only; 50 ms steps keep a loaded machine's stalls well inside the 10%.)"""
    out = tmp_path / "run"
    code = run_in_process(
        "model=custom",
        "model._target_=tests.helpers.timing_models.SleepyFirstStep",
        "data=synthetic",
        "data.image_size=8",
        "data.num_train=480",
        "data.num_val=16",
        "trainer.batch_size=16",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=10",
        *QUIET,
        f"hydra.run.dir={out}",
    )
    assert code == 0
    rec = record(out)
    ((_, steady),) = values(rec, "samples_per_s")
    ((_, warmup),) = values(rec, "warmup_time_s")
    ((_, epoch),) = values(rec, "epoch_samples_per_s")
    starts = timing_models.FORWARD_STARTS
    assert len(starts) == 30  # 480 samples in batches of 16
    periods = [b - a for a, b in zip(starts[3:], starts[4:])]  # the steady steps' own period
    assert steady == pytest.approx(16 / statistics.mean(periods), rel=0.10)
    # the epoch's figure counts the 3 s stall: its 480 samples took at least the stall and the
    # other 29 steps (26 counted, for slack) at the steady period, however loaded the machine
    # (steady / 2 was that bound on an idle one: a loaded one, steps twice as long, missed it)
    assert warmup >= 3.0 and epoch < 480 / (3.0 + 26 * 16 / steady) < steady
    ((_, p50),) = values(rec, "step_time_ms_p50")
    assert p50 == pytest.approx(1e3 * statistics.median(periods), rel=0.10)
    # the spread: the rates at the steps' 90th and 10th percentile times, around the median's
    ((_, p10),), ((_, p90),) = values(rec, "samples_per_s_p10"), values(rec, "samples_per_s_p90")
    assert p10 <= steady <= p90
    log = (out / "runner.log").read_text()
    said = f"steady {number(steady)} samples/s (p10-p90 {number(p10)}-{number(p90)})"
    assert log.count(said) == 2  # the epoch's line and the run's summary
    # the steady steps' times in order, the run's artifact (what a speed-up's interval is from)
    (trace,) = step_trace.read_all(
        {p.name: p.read_text() for p in (out / "artifacts" / "timing").iterdir()}
    )
    assert len(trace.step_time_s) == 27 and trace.samples_per_step == 16  # 30 steps, 3 warm
    assert spread.epoch_rate(trace) == pytest.approx(steady, rel=0.005)
    assert "timing/steps_0001.json" in rec["artifacts"]


def test_a_slow_dataset_is_the_data_wait_and_a_finding(tmp_path):
    """A dataset whose samples take 30 ms each to load, in the training process: the loop waits
    for its batches most of the time, and the run says so, naming what to change. (At 4 ms a
    sample the wait was 0.27 of the time on a machine busy with another test process: a tiny
    model's step slows under load, so the sleep is made long beside any step.)"""
    out = tmp_path / "run"
    code = run_in_process(
        "model=tiny",
        "model.width=4",
        "data=custom",
        "data._target_=tests.helpers.timing_models.sleepy_datasets",
        "data.num_classes=10",
        "+data.num_train=160",
        "+data.sleep_s=0.03",
        "trainer.batch_size=16",
        "trainer.max_epochs=1",
        *QUIET,
        f"hydra.run.dir={out}",
    )
    assert code == 0
    rec = record(out)
    ((_, wait),) = values(rec, "data_wait_frac")
    assert wait > 0.5
    log = (out / "runner.log").read_text()
    finding = next(line for line in log.splitlines() if "waited for its next batch" in line)
    assert "data_wait_frac" in finding and "trainer.num_workers (now 0" in finding
    assert "dataset[i]" in finding


def test_a_resumed_run_is_a_new_session_with_its_own_warm_up(tmp_path):
    """Two epochs, then resumed for a third: each session logs its warm-up once, and the
    resumed session's first steps are left out of its steady figure."""
    common = [
        "model=tiny",
        "data=synthetic",
        "data.num_train=128",
        "data.num_val=16",
        "data.image_size=8",
        "trainer.batch_size=16",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
        "mlflow.run_name=resumable",
        *QUIET,
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_in_process(*common, "trainer.max_epochs=2", f"hydra.run.dir={first}") == 0
    assert (
        run_in_process(*common, "trainer.max_epochs=3", "resume=auto", f"hydra.run.dir={second}")
        == 0
    )
    a, b = record(first), record(second)
    assert [s for s, _ in values(a, "warmup_time_s")] == [1]
    assert [s for s, _ in values(b, "warmup_time_s")] == [3]  # the new session's
    assert [s for s, _ in values(b, "samples_per_s")] == [3]
    assert [s for s, _ in values(a, "samples_per_s")] == [1, 2]
