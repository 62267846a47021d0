"""benchmarks/profile_step.py: a CPU run at a tiny size (the profiled step's time split by kind,
the files written), and the GPU split checked on events shaped as torch.profiler gives them
(kernels charged to the outermost ATen operator, kernels of no operator kept apart)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import profile_step as bench


def test_a_cpu_profile_splits_each_levels_step_and_writes_after_each(tmp_path: Path):
    out = tmp_path / "profile.md"
    argv = ["--device", "cpu", "--model", "tiny", "--image-size", "8", "--batch-size", "4"]
    argv += ["--levels", "o0,o2_bf16", "--warmup", "1", "--steps", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {r["level"]: r for r in report["rows"]}
    assert list(rows) == ["o0", "o2_bf16"]
    for row in rows.values():
        assert row["status"] == "ok" and 0 < row["busy_ms"] <= row["wall_ms"]
        # the step timed without the profiler too; on a CPU busy is the operators' share of
        # the profiled wall (on a GPU, the kernels' share of the plain step)
        assert row["plain_ms"] > 0
        assert row["busy_share"] == pytest.approx(row["busy_ms"] / row["wall_ms"], rel=1e-6)
        # on a CPU the kinds are the operators' own time plus what no operator holds: the wall
        assert sum(row["kinds"].values()) == pytest.approx(row["wall_ms"], rel=1e-6)
        assert row["kinds"]["convolution"] > 0
        assert all(op.startswith("aten::") for op, _ in row["top_ops"])
    text = out.read_text()
    assert "| kind of work | o0 | o2_bf16 |" in text and "o2_bf16 / o0: plain step time" in text
    assert "## Setup" in text and "Command:" in text


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--device", "cpu", "--levels", "o9"])
    assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--device", "cpu", "--steps", "-1"])
    assert stop.value.code == 2 and "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # 0 is refused, not taken for the default
        bench.parse_args(["--device", "cpu", "--image-size", "0"])
    assert stop.value.code == 2 and "--image-size must be at least 1" in capsys.readouterr().err


def _event(name, parent=None, kernels=(), device="CPU", us=0.0, annotation=False):
    return SimpleNamespace(
        is_user_annotation=annotation,
        name=name,
        cpu_parent=parent,
        kernels=[SimpleNamespace(duration=d) for d in kernels],
        device_type=SimpleNamespace(name=device),
        time_range=SimpleNamespace(elapsed_us=lambda: us),
    )


def test_gpu_kernels_are_charged_to_the_outermost_operator():
    conv2d = _event("aten::conv2d")
    conv = _event("aten::convolution", conv2d)
    cudnn = _event("aten::cudnn_convolution", conv, kernels=[300.0])
    autograd = _event("autograd::engine::evaluate_function: CudnnBatchNormBackward0")
    bn_back = _event("aten::cudnn_batch_norm_backward", autograd, kernels=[50.0, 25.0])
    cat = _event("aten::cat", kernels=[40.0])
    launch = _event("cudaLaunchKernel", kernels=[10.0])  # the runner's kernel: no operator
    device = [_event(f"k{i}", device="CUDA", us=us) for i, us in enumerate([300, 75, 40, 10, 5])]
    # a record_function range and its span on the GPU's timeline: not work of their own
    step = _event("Optimizer.step#SGD.step", kernels=[60.0], annotation=True)
    device.append(_event("Optimizer.step#SGD.step", device="CUDA", us=60.0, annotation=True))
    kinds, ops, total = bench.split(
        [conv2d, conv, cudnn, autograd, bn_back, cat, launch, step, *device], True
    )
    assert total == 430.0  # every device event, a memcpy's 5 us of no CPU event included
    assert ops == {
        "aten::conv2d": 300.0,
        "aten::cudnn_batch_norm_backward": 75.0,
        "aten::cat": 40.0,
        bench.OUTSIDE: 10.0,
    }
    assert kinds == {
        "convolution": 300.0,
        "normalisation": 75.0,
        "concatenation": 40.0,
        bench.OUTSIDE: 15.0,  # the launch outside any operator and the memcpy
    }
    assert bench.kind_of("aten::_foreach_add_") == "optimizer (torch's)"
    assert bench.kind_of("aten::relu_") == bench.OTHER_OPS
