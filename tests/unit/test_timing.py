"""The step timer on a scripted clock: steady throughput without the warm-up and compiled steps,
step-time percentiles, the data wait, FLOPs and MFU, what it says once; the peak table's
lookups and the level's compute format; the device's busy share (its arithmetic, its finding, its
window of steps, profiled on the CPU here)."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from torch import nn

from runner import metrics as m
from runner.measure import busy, peaks
from runner.measure.instruments import Instruments
from runner.measure.timing import FOLD_EVERY, HostClock, TimingInstrument, percentile
from runner.metrics import (
    DATA_WAIT_FRAC,
    MFU,
    SAMPLES_PER_S,
    SAMPLES_PER_S_P10,
    SAMPLES_PER_S_P90,
    STEP_TIME_MS_P50,
    STEP_TIME_MS_P90,
    TFLOPS,
    TOKENS_PER_S,
    TOKENS_PER_S_P10,
    TOKENS_PER_S_P90,
    WARMUP_TIME_S,
)

CPU = torch.device("cpu")


class ScriptedClock(HostClock):
    """The wall clock's marks, but read from `now`, which the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now


class Loop:
    """A training loop's calls to the instruments, on a scripted clock: each step waits `wait`
    seconds for its batch, then works `work` seconds inside its watch."""

    def __init__(self, warmup_steps: int = 3, **kw):
        self.timer = TimingInstrument(CPU, warmup_steps, **kw)
        self.clock = self.timer.clock = ScriptedClock()
        self.instruments = Instruments(self.timer)
        self.step = 0

    def epoch(self, epoch: int, steps, samples: int = 16, items: int = 16, tail: float = 0.0):
        """`steps`: (wait, work) per step, or a callable run inside the step's watch."""
        self.instruments.start_epoch(epoch)
        for wait, work in steps:
            self.step += 1
            self.clock.now += wait
            with self.instruments.step(self.step):
                if callable(work):
                    work()
                else:
                    self.clock.now += work
            self.instruments.counted(self.step, samples, items)
        self.clock.now += tail
        self.instruments.steps_done()
        return self.instruments.epoch_metrics()


def test_the_steady_rate_leaves_out_the_warm_up():
    """A first step of 3 s and then 20 ms steps (5 ms waiting for each batch): the steady rate
    is the batch over 25 ms; the warm-up's time is its three steps; the data wait is the waits'
    share of the epoch."""
    loop = Loop()
    steps = [(0.005, 3.0)] + [(0.005, 0.020)] * 19
    out = loop.epoch(1, steps, tail=0.1)
    assert out[SAMPLES_PER_S] == pytest.approx(16 / 0.025)
    assert out[WARMUP_TIME_S] == pytest.approx(3.005 + 2 * 0.025)
    assert out[STEP_TIME_MS_P50] == pytest.approx(25.0, rel=0.005)
    assert out[STEP_TIME_MS_P90] == pytest.approx(25.0, rel=0.005)
    epoch_s = 3.005 + 19 * 0.025 + 0.1
    assert out[DATA_WAIT_FRAC] == pytest.approx(20 * 0.005 / epoch_s)
    assert TOKENS_PER_S not in out and TFLOPS not in out and MFU not in out
    later = loop.epoch(2, [(0.005, 0.020)] * 5)  # warm-up is once per session
    assert WARMUP_TIME_S not in later and later[SAMPLES_PER_S] == pytest.approx(640.0)


def test_an_epoch_without_a_steady_step_logs_no_rate_and_says_why_once(caplog):
    loop = Loop(warmup_steps=3)
    with caplog.at_level(logging.WARNING):
        first = loop.epoch(1, [(0.0, 0.01)] * 2)
        second = loop.epoch(2, [(0.0, 0.01)] * 2)  # step 3 warm, step 4 steady
        third = Loop(warmup_steps=5)
        third.epoch(1, [(0.0, 0.01)] * 2)
    assert SAMPLES_PER_S not in first and WARMUP_TIME_S not in first and DATA_WAIT_FRAC in first
    assert second[SAMPLES_PER_S] == pytest.approx(1600.0)
    assert second[WARMUP_TIME_S] == pytest.approx(0.03)
    said = [r.getMessage() for r in caplog.records if "no steady step" in r.getMessage()]
    assert len(said) == 2  # once for each session (two instruments), never again
    assert "Epoch 1: no steady step (2 of its 2 steps were warm-up" in said[0]
    assert "trainer.warmup_steps=3" in said[0] and "epoch_samples_per_s" in said[0]


def test_steps_that_compile_are_not_steady():
    """A step over which torch.compile's count grows (a recompile) is left out, and said."""
    compiles = {"n": 0}
    loop = Loop(warmup_steps=0, compiles=lambda: compiles["n"])

    def recompiling():
        compiles["n"] += 1
        loop.clock.now += 5.0

    steps = [(0.0, 0.01)] * 3 + [(0.0, recompiling)] + [(0.0, 0.01)] * 3
    out = loop.epoch(1, steps)
    assert out[SAMPLES_PER_S] == pytest.approx(1600.0)
    assert out[WARMUP_TIME_S] == 0.0  # no warm-up steps asked for
    assert loop.timer.compiled_steps == 1 and loop.timer.steady_steps == 6


def test_stragglers_and_the_data_wait_are_said_once(caplog):
    loop = Loop(warmup_steps=0, data_advice="Raise trainer.num_workers (now 0).")
    steps = [(0.0, 0.01)] * 8 + [(0.0, 0.05)] * 2  # p90 5x the median
    with caplog.at_level(logging.WARNING):
        out = loop.epoch(1, steps)
        loop.epoch(2, steps)
    assert out[STEP_TIME_MS_P50] == pytest.approx(10.0, rel=0.005)
    assert out[STEP_TIME_MS_P90] == pytest.approx(50.0, rel=0.005)
    # the rate is the median step's: two stragglers of ten leave it, and show in its spread
    assert out[SAMPLES_PER_S] == pytest.approx(1600.0)  # (the steps' mean time: 1000)
    assert out[SAMPLES_PER_S_P10] == pytest.approx(320.0) and out[SAMPLES_PER_S_P90] == 1600.0
    said = [r.getMessage() for r in caplog.records]
    assert len([s for s in said if "straggle" in s]) == 1
    assert not [s for s in said if "waited for its next batch" in s]

    slow = Loop(warmup_steps=0, data_advice="Raise trainer.num_workers (now 0).")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fed = slow.epoch(1, [(0.03, 0.01)] * 10)
        slow.epoch(2, [(0.03, 0.01)] * 10)
    assert fed[DATA_WAIT_FRAC] == pytest.approx(0.75)
    waits = [
        r.getMessage() for r in caplog.records if "waited for its next batch" in r.getMessage()
    ]
    assert len(waits) == 1 and "75%" in waits[0] and "trainer.num_workers" in waits[0]


def test_a_loader_that_only_starts_slowly_is_said_as_such_not_as_the_pace(caplog):
    """Half a second for the first batch (workers starting), then none: the epoch's data wait is
    high, but the pipeline keeps pace after the start; the run says that (INFO), not that the
    input pipeline sets the pace (WARNING). A wait that goes on after the start is the warning."""
    loop = Loop(warmup_steps=0, data_advice="Raise trainer.num_workers (now 0).")
    with caplog.at_level(logging.INFO):
        out = loop.epoch(1, [(0.5, 0.01)] + [(0.0, 0.01)] * 9)
    assert out[DATA_WAIT_FRAC] == pytest.approx(0.5 / 0.6)
    said = [r for r in caplog.records if "waited for its next batch" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    text = said[0].getMessage()
    assert "0.50 s of it for the epoch's first batch" in text and "wait was 0%" in text
    assert "sets the pace" not in text and "num_workers" not in text

    caplog.clear()
    with caplog.at_level(logging.INFO):
        loop.epoch(2, [(0.5, 0.01)] + [(0.03, 0.01)] * 9)  # and then waiting at every step
    (warned,) = [r for r in caplog.records if "waited for its next batch" in r.getMessage()]
    assert warned.levelno == logging.WARNING and "sets the pace" in warned.getMessage()


def test_flops_give_tflops_and_mfu_against_the_peak_of_every_rank():
    """1 GFLOP a sample at 1600 samples/s is 1.6 TFLOP/s; two ranks (the sum a collective
    would give: twice this rank's) do 3.2 against twice the peak."""
    one = Loop(warmup_steps=0, flops_per_sample=1e9, peak=10.0)
    out = one.epoch(1, [(0.0, 0.01)] * 4)
    assert out[TFLOPS] == pytest.approx(1.6) and out[MFU] == pytest.approx(0.16)
    two = Loop(
        warmup_steps=0,
        flops_per_sample=1e9,
        peak=10.0,
        world_size=2,
        reduce=lambda values: [2 * v for v in values],
    )
    out = two.epoch(1, [(0.0, 0.01)] * 4)
    assert out[SAMPLES_PER_S] == pytest.approx(3200.0)
    assert out[SAMPLES_PER_S_P10] == out[SAMPLES_PER_S_P90] == pytest.approx(3200.0)
    assert out[TFLOPS] == pytest.approx(3.2) and out[MFU] == pytest.approx(0.16)
    # another rank without a steady step: no rate from any
    lonely = Loop(warmup_steps=0, world_size=2, reduce=lambda values: values)
    assert SAMPLES_PER_S not in lonely.epoch(1, [(0.0, 0.01)] * 4)


def test_without_a_peak_only_tflops_and_why_once(caplog):
    loop = Loop(warmup_steps=0, flops_per_sample=1e9, no_peak="no mfu: 'Some GPU' unknown")
    with caplog.at_level(logging.WARNING):
        first = loop.epoch(1, [(0.0, 0.01)] * 4)
        loop.epoch(2, [(0.0, 0.01)] * 4)
    assert TFLOPS in first and MFU not in first
    assert [r.getMessage() for r in caplog.records].count("no mfu: 'Some GPU' unknown") == 1


def test_a_language_model_counts_tokens():
    loop = Loop(warmup_steps=1, items_metric=TOKENS_PER_S)
    out = loop.epoch(1, [(0.0, 0.01)] * 3, samples=4, items=4 * 128)
    assert out[SAMPLES_PER_S] == pytest.approx(400.0)
    assert out[TOKENS_PER_S] == pytest.approx(51200.0)
    assert out[TOKENS_PER_S_P10] == out[TOKENS_PER_S_P90] == pytest.approx(51200.0)


def test_a_long_epoch_keeps_a_bounded_state():
    """Finished marks are folded as the epoch goes: the pending steps stay under FOLD_EVERY and
    the step times are kept as a histogram, whatever the epoch's length."""
    loop = Loop(warmup_steps=0)
    loop.instruments.start_epoch(1)
    for step in range(1, 5001):
        loop.clock.now += 0.0001
        with loop.instruments.step(step):
            loop.clock.now += 0.01 + (step % 7) * 0.001
        loop.instruments.counted(step, 16, 16)
        assert len(loop.timer._pending) < FOLD_EVERY
    assert len(loop.timer.bins) <= 10
    loop.instruments.steps_done()
    out = loop.instruments.epoch_metrics()
    assert out[STEP_TIME_MS_P50] == pytest.approx(13.1, rel=0.01)


def test_steps_outside_an_epoch_are_not_timed():
    """A step the trainer takes outside train_epoch (a pre-flight, a test) records nothing."""
    loop = Loop()
    with loop.instruments.step(1):
        loop.clock.now += 1.0
    assert loop.timer.session_steps == 0 and loop.instruments.epoch_metrics() == {}


def test_percentile_is_the_nearest_rank():
    from collections import Counter

    from runner.measure.timing import _BIN

    bins = Counter({round(math.log(t) / _BIN): 1 for t in (0.01, 0.02, 0.03, 0.04)})
    assert percentile(bins, 0.5) == pytest.approx(0.02, rel=0.005)
    assert percentile(bins, 0.9) == pytest.approx(0.04, rel=0.005)


# ---- the peak table ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "torch_name,gpu,bf16",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5),
        ("NVIDIA H200", "H200", 989.4),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
        ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
        ("NVIDIA A100 80GB PCIe", "A100", 312.0),
        ("NVIDIA L4", "L4", 121.0),
        ("NVIDIA L40S", "L40S", 362.05),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ],
)
def test_the_peak_table_is_matched_on_torchs_names(torch_name, gpu, bf16):
    assert peaks.find_peak(torch_name).gpu == gpu
    assert peaks.peak_tflops(torch_name, "bf16") == bf16
    assert set(peaks.find_peak(torch_name).tflops) >= {"fp32", "tf32", "bf16", "fp16"}


def test_unknown_gpus_and_formats_have_no_peak():
    assert peaks.find_peak("NVIDIA L40") is None  # not an L40S, not an L4
    assert peaks.find_peak("NVIDIA GeForce RTX 4090 D") is None
    assert peaks.find_peak("Tesla T4") is None and peaks.peak_tflops("Tesla T4", "fp16") is None
    assert peaks.peak_tflops("NVIDIA A100-SXM4-40GB", "fp8") is None  # no fp8 on Ampere
    assert peaks.peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1978.9
    # every peak doubles from tf32 to 16 bits to fp8 (the datasheets' dense figures)
    for peak in peaks.PEAKS:
        t = peak.tflops
        assert t["bf16"] == t["fp16"] == pytest.approx(2 * t["tf32"], rel=0.02), peak.gpu
        if "fp8" in t:
            assert t["fp8"] == pytest.approx(2 * t["bf16"], rel=0.02), peak.gpu


def test_the_compute_format_of_a_level():
    linear, conv = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Conv2d(3, 4, 3))
    assert peaks.compute_format({torch.bfloat16}, fp8=True, model=linear) == "fp8"
    assert peaks.compute_format({torch.float16}, fp8=False, model=linear) == "fp16"
    assert peaks.compute_format({torch.bfloat16}, fp8=False, model=linear) == "bf16"
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        assert peaks.compute_format(set(), fp8=False, model=linear) == "fp32"
        assert peaks.compute_format(set(), fp8=False, model=conv) == "tf32"  # cuDNN's default
        torch.backends.cuda.matmul.allow_tf32 = True
        assert peaks.compute_format(set(), fp8=False, model=linear) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_the_compile_count_grows_when_torch_compile_compiles():
    """What the trainer gives the timer with trainer.compile: a count that grows over a step
    that compiles or recompiles (a new shape), not over one that reuses a compiled graph."""
    from runner.run.step_timing import compile_count

    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    before = compile_count()
    double(torch.ones(2))
    compiled = compile_count()
    double(torch.ones(2))
    reused = compile_count()
    double(torch.ones(3))
    assert compiled > before and reused == compiled and compile_count() > reused


def test_a_step_that_captured_the_whole_step_is_not_steady():
    """trainer.cuda_graphs=step: the capture's step is charged as a compile (its count grows
    over it), beside torch.compile's own count where both are on."""
    from runner.run.step_timing import _counting

    captures = [0]
    loop = Loop(warmup_steps=0, compiles=_counting(None, lambda: captures[0]))

    def capturing():
        captures[0] += 1

    rates = loop.epoch(1, [(0.0, 0.01), (0.0, capturing), (0.0, 0.01), (0.0, 0.01)])
    assert loop.timer.compiled_steps == 1 and loop.timer.steady_steps == 3
    assert rates[SAMPLES_PER_S] == pytest.approx(16 / 0.01)
    both = _counting(lambda: 2, lambda: captures[0])
    assert both() == 3 and _counting(None, None) is None


# ---- device_busy_frac (runner.measure.busy) --------------------------------------------------
@pytest.mark.parametrize(
    "intervals,length",
    [
        ([], 0.0),
        ([(0.0, 1.0)], 1.0),
        ([(0.0, 1.0), (2.0, 3.0)], 2.0),  # a gap between: both
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping (two streams): once
        ([(0.0, 4.0), (1.0, 2.0)], 4.0),  # one inside another
        ([(2.0, 3.0), (0.0, 1.0), (0.5, 2.5)], 3.0),  # out of order, chained
        ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
        ([(1.0, 1.0), (3.0, 2.0)], 0.0),  # empty and reversed: nothing
    ],
)
def test_the_busy_time_is_the_union_of_the_intervals(intervals, length):
    assert busy.union_length(intervals) == pytest.approx(length)


def test_the_busy_share_is_the_union_over_the_wall_time():
    kernels = [(0.0, 30.0), (10.0, 40.0), (60.0, 70.0)]  # µs: 50 busy of 100
    assert busy.busy_fraction(kernels, 100.0) == pytest.approx(0.5)
    assert busy.busy_fraction(kernels, 40.0) == 1.0  # (clocks a little apart: at most 1)
    assert math.isnan(busy.busy_fraction(kernels, 0.0))


def test_a_host_bound_step_is_a_finding_that_names_the_levers_and_their_gain():
    said = busy.busy_finding(0.25, 5)
    assert said.startswith(
        "The GPU was busy 25% of 5 steps after the warm-up (device_busy_frac 0.25, below 0.8): "
        "the host, launching the step's kernels one by one, sets the pace, not the GPU"
    )
    assert "At most 4.0x is to be had here (the step at the GPU's own pace)" in said
    assert "trainer.cuda_graphs=step (the whole step replayed as one CUDA graph, its launches " in (
        said
    )
    assert "1.2-3x on launch-bound steps, per NVIDIA's CUDA graphs guide" in said
    assert "trainer.compile=true (fewer, fused kernels" in said
    assert "trainer.batch_size (a larger one: more work per launch" in said
    # a lever already on is not named again; a busy device is no finding
    on = busy.busy_finding(0.5, 5, on=[busy.GRAPHS])
    assert "trainer.cuda_graphs=step" not in on and "trainer.compile=true" in on
    assert busy.busy_finding(0.8, 5) is None and busy.busy_finding(0.95, 5) is None
    assert busy.busy_finding(math.nan, 5) is None


def _profiled_steps(instrument, steps: int, work, epoch_end_at: int = 0) -> Instruments:
    """`steps` training steps (each `work()`) watched by `instrument` alone, the epoch's steps
    done after `epoch_end_at` of them where given."""
    instruments = Instruments(instrument)
    for step in range(1, steps + 1):
        with instruments.step(step):
            work()
        if step == epoch_end_at:
            instruments.steps_done()
    return instruments


def _matmuls() -> None:
    a = torch.randn(384, 384)
    for _ in range(4):
        a = torch.tanh(a @ a)  # (~12 ms on one thread, in few ops: few gaps between them)


@pytest.mark.parametrize("idle,low", [(0.0, False), (0.1, True)])
def test_the_busy_share_is_measured_once_on_its_window_of_steps(idle, low, caplog):
    """On a CPU the same instrument profiles the CPU's ops (a CUDA device's kernels in a run):
    steps 3 to 5 of 8, once; steps that compute without a pause keep the device busy, steps that
    also wait 100 ms for nothing leave it idle most of the time, a finding."""
    reported: list[tuple[float, int]] = []
    instrument = busy.BusyInstrument(
        CPU,
        3,
        lambda frac, step: reported.append((frac, step)),
        steps=3,
        activity=torch.profiler.ProfilerActivity.CPU,
        kind=torch.autograd.DeviceType.CPU,
    )

    def step():
        _matmuls()
        time.sleep(idle)

    with caplog.at_level(logging.INFO, logger="runner.measure.busy"):
        _profiled_steps(instrument, 8, step)
    ((frac, at),) = reported
    assert at == 5 and instrument.measured == 3 and instrument.frac == frac
    assert (frac < 0.5) if low else (frac > 0.5), frac
    assert ("below 0.8" in caplog.text) == (frac < busy.BUSY_LIMIT)
    assert "0.8 (" not in caplog.text  # (said at most as 0.79 where below the limit)


def test_an_epoch_that_ends_inside_the_window_ends_the_measurement():
    reported: list[tuple[float, int]] = []
    instrument = busy.BusyInstrument(
        CPU,
        2,
        lambda frac, step: reported.append((frac, step)),
        activity=torch.profiler.ProfilerActivity.CPU,
        kind=torch.autograd.DeviceType.CPU,
    )
    _profiled_steps(instrument, 6, _matmuls, epoch_end_at=3)
    assert [step for _, step in reported] == [3] and instrument.measured == 2


def test_a_cpu_run_measures_no_busy_share_and_logs_none(tmp_path, capsys):
    """The busy share is a CUDA device's: a CPU run has no such instrument, logs no
    device_busy_frac and says none in its summary line."""
    from tests.helpers.runs import FAST, run_in_process
    from tests.helpers.store import only_run
    from tests.helpers.trainer import make_trainer

    trainer, _ = make_trainer("O0", {})
    assert trainer.instruments.find(busy.BusyInstrument) is None
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert run_in_process(*FAST, f"mlflow.tracking_uri={uri}") == 0
    _, run = only_run(uri)
    assert "samples_per_s" in run.data.metrics and m.DEVICE_BUSY_FRAC not in run.data.metrics
    output = "".join(capsys.readouterr()).splitlines()
    (finished,) = [line for line in output if " - Finished tiny-O0: " in line]
    assert "samples/s (p10-p90" in finished and "device busy" not in finished
