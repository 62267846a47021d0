"""Smoke test of benchmarks/levels.py: a tiny model and budget on CPU, real runner cells, the
result files (Markdown, CSV, JSON, PNG) with the expected structure; two partial runs merged into
one table, and a table re-rendered from JSON files (no timing assertions)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks import levels as bench

TINY = [
    "--device",
    "cpu",
    "--models",
    "tiny",
    "--image-size",
    "16",
    "--batch-size",
    "8",
    "--steps",
    "1",
    "--warmup",
    "0",
]


def test_levels_benchmark_smoke_and_merge(tmp_path: Path, capsys):
    out = tmp_path / "results" / "levels.md"
    assert bench.main([*TINY, "--levels", "o0,o2_bf16", "--out", str(out)]) == 0
    # a second command adds cells to the same table
    assert bench.main([*TINY, "--levels", "o3_bf16,torch_amp", "--out", str(out), "--merge"]) == 0

    table = out.read_text()
    assert "| tiny | O0 | `o0` | float32 | 16 | 8 |" in table
    assert "| tiny | O2 | `o2_bf16` | bfloat16 (fp32 BatchNorm, fp32 master weights) |" in table
    assert "| tiny | O3 | `o3_bf16` |" in table
    assert "| tiny | - | `torch_amp` | float32 weights, autocast bfloat16 |" in table
    assert "NO TARGETS on CPU" in table and "Run 2 (tiny)" in table
    assert "Verdict:" in capsys.readouterr().out

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["device"] == "cpu" and len(report["runs"]) == 2
    cells = report["cells"]
    assert [c["level"] for c in cells] == ["o0", "o2_bf16", "o3_bf16", "torch_amp"]
    assert [c["run"] for c in cells] == [0, 0, 1, 1]
    for c in cells:
        assert c["status"] == "ok" and c["memory_kind"].startswith("cpu_")
        assert c["samples_per_s"] > 0 and c["step_ms"] > 0 and c["peak_mem_mb"] >= 0
    assert cells[0]["speedup_vs_o0"] == pytest.approx(1.0)
    for run in report["runs"]:
        assert len(run["load_start"]) == 3
        assert run["command"].startswith("python -m benchmarks.levels ")

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["level"] for r in rows] == ["o0", "o2_bf16", "o3_bf16", "torch_amp"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # re-rendered from JSON alone (how GPU parts fetched separately are combined)
    again = tmp_path / "again" / "levels.md"
    assert bench.main(["--from-json", str(out.with_suffix(".json")), "--out", str(again)]) == 0
    assert json.loads(again.with_suffix(".json").read_text())["cells"] == cells
    assert again.with_suffix(".png").is_file()


def test_a_language_models_table_is_primed_with_the_tiny_gpt(tmp_path: Path, capsys):
    """GPT-2 small's GPU rows pass `--extra model.vocab_size=50304`: the throwaway pass must
    run a language model (the tiny CNN has no vocab_size, and its failures would leave one-time
    start-up in the first cell), and the padded vocabulary must be accepted."""
    out = tmp_path / "levels.md"
    assert (
        bench.main(
            [
                "--device",
                "cpu",
                "--models",
                "gpt_tiny",
                "--image-size",
                "16",
                "--batch-size",
                "2",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--levels",
                "o0,o1_bf16",
                "--extra",
                "model.vocab_size=80",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert "primed in" in printed.out and "throwaway pass's" not in printed.out
    assert "ConfigError" not in printed.err and "Could not override" not in printed.err
    cells = json.loads(out.with_suffix(".json").read_text())["cells"]
    assert [(c["level"], c["status"]) for c in cells] == [("o0", "ok"), ("o1_bf16", "ok")]


@pytest.mark.slow  # one compiled cell: a cold CPU compile of the tiny model, 15-30 s on 2 cores
def test_levels_benchmark_compiled_and_fp8_rows(tmp_path: Path, monkeypatch):
    # torch.compile's cache in this test's folder (the benchmark keeps a cache that is set)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / "levels.md"
    assert (
        bench.main(
            [
                "--device",
                "cpu",
                "--models",
                "tiny",
                "--image-size",
                "16",
                "--batch-size",
                "8",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--no-prime",
                "--levels",
                "o0,o0+compile,o1_fp8",
                "--out",
                str(out),
            ]
        )
        == 0
    )

    table = out.read_text()
    assert "| tiny | O0 | `o0+compile` | float32; torch.compile | 16 | 8 |" in table
    assert (
        "| tiny | O1 | `o1_fp8` | float32 weights, autocast bfloat16, fp8 Linear (tensorwise) |"
        in table
        and "| 0 Linear layers in fp8 |" in table
    )
    assert "torch.compile, throughput against the same preset eager: tiny: o0 " in table
    assert "no throwaway pass (--no-prime)" in table

    report = json.loads(out.with_suffix(".json").read_text())
    cells = {c["level"]: c for c in report["cells"]}
    assert list(cells) == ["o0", "o1_fp8", "o0+compile"]  # the eager levels first
    assert all(c["status"] == "ok" for c in cells.values())
    compiled = cells["o0+compile"]
    # the compiling first step is taken even with --warmup 0 and kept out of the timed steps
    assert compiled["compiled"] and compiled["warmup"] == 1 and compiled["steps"] == 1
    assert compiled["first_step_ms"] > 0 and compiled["compile_s"] >= 0
    assert compiled["speedup_vs_eager"] == pytest.approx(
        compiled["samples_per_s"] / cells["o0"]["samples_per_s"]
    )
    assert "first_step_ms" not in cells["o0"] and cells["o0"].get("compile_s") is None
    assert cells["o1_fp8"]["fp8_layers"] == 0
    assert report["runs"][0]["settings"]["compile_cache"].startswith(
        f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'inductor'}"
    )
    with out.with_suffix(".csv").open() as f:
        assert [r["compiled"] for r in csv.DictReader(f)] == ["False", "False", "True"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_levels_default_compiled_rows_are_for_one_model_per_device():
    args = bench.parse_args(["--device", "cpu"])
    assert args.levels["resnet18"] == [*bench.CPU_LEVELS, "o0+compile", "o2_bf16+compile"]
    for model in ("resnet50", "densenet161", "vgg16_bn"):
        assert args.levels[model] == bench.CPU_LEVELS
    assert bench.default_levels("cuda", "resnet50")[-5:] == bench.CUDA_COMPILE_LEVELS
    assert bench.default_levels("cuda", bench.VIT) == bench.default_levels("cuda", "resnet50")
    assert {"o1_fp8", "o2_fp8"} <= set(bench.default_levels("cuda", "vgg16_bn"))
    assert not any(lvl.endswith("+compile") for lvl in bench.default_levels("cuda", "vgg16_bn"))
    args = bench.parse_args(
        ["--device", "cpu", "--models", "tiny", "--levels", "o2_bf16+compile,torch_amp"]
    )
    assert args.levels == {"tiny": ["o2_bf16+compile", "torch_amp"]}
    assert common.model_overrides(bench.VIT) == ["model=torchvision", "model.arch=vit_b_16"]
    assert common.model_overrides("resnet50") == ["model=resnet50"]


def test_levels_benchmark_rejects_bad_arguments(tmp_path: Path, capsys):
    for argv, message in [
        (["--levels", "o9"], "unknown level"),
        (["--levels", "o2_bf16+fast"], "the suffixes are +compile"),
        (["--levels", "o2_bf16+int8state"], "the only suffix here is +compile"),
        (["--levels", "torch_amp+compile"], "unknown level 'torch_amp'"),
        (["--models", "resnet99"], "unknown model"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--from-json", str(tmp_path / "none.json")], "no such file"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(["--device", "cpu", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_the_fp8_target_is_judged_from_the_vits_compiled_cells():
    """The fp8 target: compiled o1_fp8 at least 1.2x compiled o1_bf16 on ViT-B/16, judged
    wherever both cells were measured (with or without ResNet-50's cells), silent otherwise."""

    def cell(level, samples_per_s, status="ok"):
        return {
            "model": bench.VIT,
            "level": level,
            "status": status,
            "samples_per_s": samples_per_s,
        }

    cells = {
        (c["model"], c["level"]): c
        for c in (cell("o1_bf16+compile", 3131.0), cell("o1_fp8+compile", 2829.0))
    }
    assert bench.fp8_verdict(cells) == (
        " fp8 (vit_b_16): compiled o1_fp8 0.90x compiled o1_bf16's throughput (>= 1.2x): misses."
    )
    cells[(bench.VIT, "o1_fp8+compile")]["samples_per_s"] = 3800.0
    assert bench.fp8_verdict(cells).endswith(
        "1.21x compiled o1_bf16's throughput (>= 1.2x): meets."
    )
    cells[(bench.VIT, "o1_fp8+compile")]["status"] = "crashed"
    assert bench.fp8_verdict(cells) == ""
    report = {"device": "cuda", "cells": list(cells.values())}
    cells[(bench.VIT, "o1_fp8+compile")]["status"] = "ok"
    assert "NOT JUDGED" in bench.verdict(report) and "fp8 (vit_b_16)" in bench.verdict(report)
