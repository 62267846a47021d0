"""Smoke test of benchmarks/fused_step.py: a small model's parameter list, one step per variant, the
result files with the expected structure (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import fused_step as bench


def test_kernels_benchmark_smoke(tmp_path: Path, capsys):
    out = tmp_path / "results" / "kernels.md"
    assert (
        bench.main(
            [
                "--device",
                "cpu",
                "--models",
                "resnet18",
                "--iters",
                "1",
                "--warmup",
                "1",
                "--host-iters",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = out.read_text()
    for label in (
        "(a) fused kernels (engine, `precision.kernels`=cpp)",
        "(b) stock torch composition",
        "(c) AdamW fused, fp32",
        "(d) fused kernels, SGD (engine, `precision.kernels`=cpp)",
        "(e) SGD fused, fp32",
        "(f) AdamW fused, fp32, under GradScaler",
    ):
        assert f"| resnet18 | 11.7M | {label} |" in table
    assert "Verdict:" in table and "Load average" in table and "Command:" in table
    assert "## Host cost of one step (161 tensors, resnet50's count, of 16 elements each)" in table
    assert "| (c) AdamW fused, fp32 |" in table.split("## Host cost")[1]
    assert "Verdict:" in capsys.readouterr().out
    report = json.loads(out.with_suffix(".json").read_text())
    (result,) = report["results"]
    assert result["params"] == 11689512 and result["tensors"] == 62
    assert {v["bytes_per_param"] for v in result["variants"].values()} == {30, 48, 28, 22, 20, 40}
    assert report["copy_gb_per_s"] > 0 and result["speedup_a_vs_b"] > 0
    assert result["speedup_a_vs_c"] > 0 and result["speedup_a_vs_f"] > 0
    assert "(a) against (f), torch's fused AdamW under GradScaler" in table
    assert result["speedup_d_vs_c"] > 0 and result["speedup_d_vs_e"] > 0
    assert "SGD (d)" in report["verdict"] and "(d) >= 1.0x torch's fused AdamW" in report["verdict"]
    host = report["host"]
    assert host["tensors"] == 161 and host["kernels"] == "cpp"
    assert host["variants"]["a_fused"]["median_us"] > 0
    assert host["variants"]["d_fused_sgd"]["median_us"] > 0


def test_the_gradscaler_variant_steps_as_adamw_on_the_unscaled_gradients():
    """(f) times torch's loss-scaled step: its update is AdamW's on the gradients divided by the
    loss scale (fp32, to rounding), step after step (its `reset` puts back the scaled gradients,
    which the step leaves unscaled), and an inf gradient skips the whole step."""
    shapes = [torch.Size([3, 5]), torch.Size([7])]
    device = torch.device("cpu")
    grads = bench.scaled_grads(shapes, device)
    step, _ = bench.variant_adamw_scaler(shapes, grads, device)
    params = list(bench.Params(shapes, torch.float32, device).parameters())  # the same start
    for p, g in zip(params, grads):
        p.grad = g.float() / bench.LOSS_SCALE
    reference = torch.optim.AdamW(params, lr=1e-4)
    mine = step.optimizer.param_groups[0]["params"]
    before = [p.detach().clone() for p in mine]
    for _ in range(3):
        step.reset()
        step()
        reference.step()
    for p, q, start in zip(mine, params, before):
        assert not torch.equal(p, start)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
    step.reset()
    for p, g in zip(mine, grads):
        assert torch.equal(p.grad, g.float())
    mine[1].grad[3] = float("inf")
    kept = [p.detach().clone() for p in mine]
    step()
    assert all(torch.equal(p, k) for p, k in zip(mine, kept))


def test_kernels_benchmark_refuses_unknown_models_and_a_missing_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "cpu", "--models", "resnet1000"])
    assert e.value.code == 2 and "resnet1000" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--device", "cuda"])
        assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err
