"""Smoke test of benchmarks/lm_parity.py: a tiny corpus and budget, real runs and a real overhead
round, the three result files with the expected structure (never a timing); and the verdict and
summary logic on hand-made results, a level just inside and just outside each target."""

from __future__ import annotations

import csv
import importlib.util
import json
import random
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks import lm_parity as bench

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _write_corpus(folder: Path) -> Path:
    """A few small Python-like files (about 40 KB) and a file the glob must leave out."""
    rng = random.Random(0)
    words = (
        "def class return import self if else for while in range print yield lambda None True False"
    ).split()
    (folder / "pkg").mkdir(parents=True)
    for i in range(4):
        lines = [
            "    " * rng.randint(0, 2)
            + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
            for _ in range(250)
        ]
        (folder / "pkg" / f"m{i}.py").write_text("\n".join(lines) + "\n")
    (folder / "notes.txt").write_text("not Python: not in the corpus\n")
    return folder


@pytest.mark.slow  # three real runs, torchao's import and an overhead round: 20-40 s on 2 cores
def test_lm_parity_benchmark_smoke(tmp_path: Path, capsys):
    corpus = _write_corpus(tmp_path / "corpus")
    out = tmp_path / "results" / "lm_parity.md"
    code = bench.main(
        [
            "--corpus",
            str(corpus),
            "--glob",
            "**/*.py",
            "--levels",
            "o1_bf16,o1_fp8",
            "--seeds",
            "0",
            "--steps",
            "5",
            "--val-batches",
            "2",
            "--overhead-rounds",
            "1",
            "--overhead-levels",
            "o0,o2_bf16",
            "--out",
            str(out),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--token-cache",
            str(tmp_path / "tokens"),
            "--extra",
            "trainer.batch_size=4",
            "data.block_size=16",
        ]
    )
    assert code == 0, capsys.readouterr().err
    levels = ["o0", "o1_bf16", "o1_fp8"] if HAS_TORCHAO else ["o0", "o1_bf16"]

    table = out.read_text()
    assert "# Language-model parity (cpu)" in table
    assert "| O0 | `o0` | float32 | " in table and "| baseline |" in table
    assert "| O1 | `o1_bf16` | float32 weights, autocast bfloat16 | " in table
    assert "| `o0` | " in table.split("| `o1_bf16` |")[1]  # o1_bf16's reference is o0
    verdict = next(line for line in table.splitlines() if line.startswith("Verdict: "))
    assert verdict.split(":")[1].strip() in {"PASS", "MISS"}
    assert "## Corpus" in table and "4 files" in table  # notes.txt is not matched
    assert "## Step overhead" in table and "Overhead verdict: " in table
    assert "| O0 | `o0` | plain fp32 loop |" in table
    assert "| O2 | `o2_bf16` | 16-bit model + fp32 masters" in table
    assert "Command: `python -m benchmarks.lm_parity --corpus" in table
    assert "Load average" in table and "Versions: " in table
    if HAS_TORCHAO:
        assert (
            "| O1 | `o1_fp8` | float32 weights, autocast bfloat16, fp8 Linear (tensorwise) |"
            in table
        )
        assert "fp8 layers: 13 in every fp8 run, as expected" in verdict
    else:
        assert "o1_fp8 skipped (torchao is not installed" in verdict
    assert "Verdict: " in capsys.readouterr().out  # the report is printed too

    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["level"], r["seed"], r["status"]) for r in rows] == [
        (lvl, "0", "finished") for lvl in levels
    ]
    for row in rows:
        assert 0.0 < float(row["best_val_loss"]) < 10.0  # nats per token, vocabulary 256
        assert float(row["tokens_per_s"]) > 0 and row["run_id"]
        assert int(row["train_windows"]) > 0 and int(row["val_windows"]) > 0
    fp8 = {r["level"]: r["fp8_layers"] for r in rows}
    assert fp8["o0"] == "" and (not HAS_TORCHAO or fp8["o1_fp8"] == "13")

    report = json.loads(out.with_suffix(".json").read_text())
    for key in (
        "summary",
        "verdict",
        "runs",
        "corpus",
        "overhead",
        "targets",
        "machine",
        "command",
        "load_start",
        "load_end",
        "skipped",
    ):
        assert key in report, key
    assert [s["level"] for s in report["summary"]] == levels
    assert report["summary"][1]["reference"] == "o0" and report["summary"][1]["checked"]
    corpus_info = report["corpus"]
    assert corpus_info["files"] == 4 and corpus_info["block_size"] == 16
    assert corpus_info["train_tokens"] + corpus_info["val_tokens"] == corpus_info["tokens"]
    assert corpus_info["train_windows"] == int(rows[0]["train_windows"])  # the run's own params
    assert [r["level"] for r in report["overhead"]["results"]] == ["o0", "o2_bf16"]
    assert [r["target"] for r in report["overhead"]["results"]] == ["<= 1.03", "< 1"]
    for row in report["overhead"]["results"]:  # same weights, same batch: the same first loss
        assert row["first_loss_runner"] == pytest.approx(row["first_loss_handwritten"], rel=1e-2)
    assert report["overhead"]["task"]["sequence_length"] == 16
    assert not HAS_TORCHAO or report["summary"][2]["fp8_layers"] == [13]


def _runs(bench, level: str, mean: float, status: str = "finished", fp8_layers: int | None = None):
    """Two seeds of `level` whose mean best val loss is `mean` (one 0.01 above, one below)."""
    return [
        bench.RunResult(
            level,
            seed,
            opt_level=level[:2].upper(),
            status=status,
            fp8="tensorwise" if "fp8" in level else None,
            best_val_loss=None if status != "finished" else mean + delta,
            tokens_per_s=1000.0,
            fp8_layers=fp8_layers,
            error=(None if status == "finished" else "RuntimeError: boom"),
        )
        for seed, delta in ((0, -0.01), (1, 0.01))
    ]


def _results(bench, margins: dict[str, float], fp8_layers: int = 13):
    """o0 at 1.5; each other level its reference's mean plus its margin."""
    means = {"o0": 1.5}
    for level in ("o1_bf16", "o2_bf16", "o3_bf16_sr", "o1_fp8", "o2_fp8"):
        reference, _ = bench.TARGETS[level]
        means[level] = means[reference] + margins[level]
    return [
        run
        for level, mean in means.items()
        for run in _runs(bench, level, mean, fp8_layers=fp8_layers if "fp8" in level else None)
    ], list(means)


def test_lm_parity_targets_just_inside_and_just_outside():
    inside = {
        "o1_bf16": 0.019,
        "o2_bf16": -0.019,
        "o3_bf16_sr": 0.029,
        "o1_fp8": 0.049,
        "o2_fp8": -0.049,
    }
    results, levels = _results(bench, inside)
    rows = bench.summarise(results, levels, [0, 1])
    by_level = {r.level: r for r in rows}
    assert by_level["o0"].mean == pytest.approx(1.5) and by_level["o0"].std == pytest.approx(
        0.0141421, rel=1e-4
    )
    assert by_level["o0"].perplexity == pytest.approx(4.481689, rel=1e-6)  # exp(1.5)
    for level, margin in inside.items():
        assert by_level[level].diff == pytest.approx(margin) and by_level[level].within_target
    assert by_level["o3_bf16_sr"].reference == "o2_bf16"
    assert by_level["o2_fp8"].diff_vs_o0 == pytest.approx(-0.019 - 0.049)
    text = bench.verdict(rows)
    assert text.startswith("Verdict: PASS: every checked level within its target: ")
    assert "o3_bf16_sr +0.0290 vs o2_bf16 (target 0.03)" in text
    assert "fp8 layers: 13 in every fp8 run, as expected" in text

    outside = {
        "o1_bf16": 0.021,
        "o2_bf16": -0.021,
        "o3_bf16_sr": 0.031,
        "o1_fp8": 0.051,
        "o2_fp8": -0.051,
    }
    for level, margin in outside.items():  # one level outside at a time, the others inside
        results, levels = _results(bench, {**inside, level: margin})
        rows = {r.level: r for r in bench.summarise(results, levels, [0, 1])}
        assert rows[level].diff == pytest.approx(margin) and rows[level].within_target is False
        assert all(r.within_target for name, r in rows.items() if r.checked and name != level)
        text = bench.verdict(list(rows.values()))
        assert (
            text.startswith("Verdict: MISS: outside the target: ") and level in text.split(";")[0]
        )

    # an fp8 run that converted fewer than all 13 Linear layers is a miss, whatever its loss
    results, levels = _results(bench, inside, fp8_layers=12)
    text = bench.verdict(bench.summarise(results, levels, [0, 1]))
    assert text.startswith("Verdict: MISS") and "UNEXPECTED o1_fp8 12, o2_fp8 12" in text


def test_lm_parity_unjudged_levels_and_unfinished_runs():
    # o1_fp8 without o1_bf16; o2_bf16 with a crashed seed; o3_bf16 reported against o0
    results = [
        *_runs(bench, "o0", 1.5),
        *_runs(bench, "o1_fp8", 1.52, fp8_layers=13),
        *_runs(bench, "o3_bf16", 1.6),
    ]
    results += [_runs(bench, "o2_bf16", 1.5)[0], _runs(bench, "o2_bf16", 1.5, "crashed")[1]]
    levels = ["o0", "o2_bf16", "o3_bf16", "o1_fp8"]
    rows = bench.summarise(results, levels, [0, 1])
    by_level = {r.level: r for r in rows}
    assert by_level["o2_bf16"].mean is None and by_level["o2_bf16"].within_target is None
    assert not by_level["o3_bf16"].checked and by_level["o3_bf16"].diff_vs_o0 == pytest.approx(0.1)
    text = bench.verdict(rows, {"o2_fp8": "torchao is not installed"})
    assert text.startswith("Verdict: INCOMPLETE: ")
    assert "o2_bf16 NOT JUDGED (a run did not finish)" in text
    assert "o1_fp8 NOT JUDGED (o1_bf16 was not run)" in text
    assert "reported, not checked: o3_bf16 +0.1000 vs o0" in text
    assert "o2_fp8 skipped (torchao is not installed)" in text

    report = {
        "device": "cpu",
        "seeds": [0, 1],
        "steps": 5,
        "val_batches": 2,
        "batch_size": 16,
        "block_size": 64,
        "skipped": {},
        "corpus": None,
        "overhead_rounds": 0,
        "overhead": None,
        "_results": results,
        "runs": [],
        "command": "c",
        "date": "d",
        "total_wall_s": 6.0,
        "tracking_uri": "u",
        "experiment": "e",
        "load_start": [],
        "load_end": [],
        "versions": "v",
        "overrides": ["model=gpt_tiny"],
        "machine": {
            "cpu": "x",
            "cores": "2",
            "torch_threads": "2",
            "torch": "t",
            "python": "p",
            "platform": "l",
        },
    }
    table = bench.render_markdown(report, rows)
    assert (
        "| O2 | `o2_bf16` | ? | 1.4900 | crashed | - | - | `o0` | - | ±0.02 | not judged |" in table
    )
    assert "## Runs that did not finish" in table
    assert "- `o2_bf16` seed 1: crashed: RuntimeError: boom" in table
    assert "Skipped (`--overhead-rounds 0`)." in table
    assert harness.finish("", [], results) == 1  # a crashed run: exit status 1

    base_crashed = _runs(bench, "o0", 1.5, "crashed") + _runs(bench, "o1_bf16", 1.5)
    assert bench.verdict(bench.summarise(base_crashed, ["o0", "o1_bf16"], [0, 1])).startswith(
        "Verdict: NO BASELINE"
    )


def test_lm_parity_arguments(monkeypatch, capsys):
    args = bench.parse_args(["--levels", "o2_bf16"])
    assert args.levels == ["o0", "o2_bf16"] and args.seeds == [0, 1, 2]
    assert args.device == "cpu" and args.steps == 400 and args.val_batches == 50
    assert args.overhead_levels == ["o0", "o1_bf16", "o2_bf16"] and args.overhead_rounds == 15
    assert args.corpus == Path(bench.stdlib_folder()).resolve() and args.glob == "**/*.py"
    assert args.out.name == "lm_parity_cpu.md"
    monkeypatch.setattr(bench, "fp8_unavailable", lambda device: "torchao is not installed")
    args = bench.parse_args([])
    assert args.levels == ["o0", "o1_bf16", "o2_bf16", "o3_bf16_sr"]
    assert args.skipped == {"o1_fp8": "torchao is not installed"}
    for argv, message in [
        (["--levels", "o9"], "unknown level"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--overhead-levels", "o3_bf16_sr"], "no hand-written counterpart"),
        (["--corpus", "/no/such/folder"], "does not exist"),
        (["--seeds", "a"], "--seeds must be integers"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_lm_parity_optimizer_state_levels_against_their_own_level():
    """bf16 and int8 state are checked within 0.02 nats of the same level with its own state,
    int4 is reported; each state row's memory ratio to that level is judged where it has a
    target (int8 0.3x, int4 0.2x)."""
    assert bench.target_of("o2_bf16_int8state") == ("o2_bf16", 0.02, "int8", "o2_bf16")
    assert bench.target_of("o2_bf16+bf16state") == ("o2_bf16", 0.02, "bf16", "o2_bf16")
    assert bench.target_of("o2_bf16+int4state") == (None, None, "int4", "o2_bf16")
    assert bench.target_of("o3_bf16_sr") == ("o2_bf16", 0.03, None, None)
    assert bench.run_name("o2_bf16+int4state", 1) == "gpt_tiny-o2_bf16-int4state-seed1"

    def runs(level, loss, state_mb, state):
        return [
            bench.RunResult(
                level,
                seed,
                opt_level="O2",
                best_val_loss=loss + 0.001 * seed,
                state_mb=state_mb,
                optimizer_state=state,
            )
            for seed in (0, 1)
        ]

    results = [
        *runs("o0", 2.00, 1.0, "float32"),
        *runs("o2_bf16", 2.00, 1.0, "float32"),
        *runs("o2_bf16_int8state", 2.015, 0.27, "int8"),
        *runs("o2_bf16+bf16state", 2.03, 0.5, "bfloat16"),
        *runs("o2_bf16+int4state", 2.10, 0.25, "int4"),
        *runs("o3_bf16_sr", 2.01, 0.5, "bfloat16"),  # O3: the weights' bf16 state
        *runs("o3_bf16_sr_int8state", 2.01, 0.27, "int8"),
    ]
    levels = [
        "o0",
        "o2_bf16",
        "o2_bf16_int8state",
        "o2_bf16+bf16state",
        "o2_bf16+int4state",
        "o3_bf16_sr",
        "o3_bf16_sr_int8state",
    ]
    rows = {r.level: r for r in bench.summarise(results, levels, [0, 1])}
    sr8 = rows["o3_bf16_sr_int8state"]  # of fp32 state, not of its level's bf16 state
    assert sr8.state_memory_ratio == pytest.approx(0.27) and sr8.within_memory_target
    assert sr8.state_vs_reference == pytest.approx(0.54)
    assert (
        rows["o2_bf16_int8state"].within_target and rows["o2_bf16_int8state"].within_memory_target
    )
    assert not rows["o2_bf16+bf16state"].within_target  # 0.03 nats worse
    assert rows["o2_bf16+int4state"].within_target is None  # reported
    assert rows["o2_bf16+int4state"].state_memory_ratio == pytest.approx(0.25)
    assert rows["o2_bf16+int4state"].within_memory_target is False  # above 0.2x
    text = bench.verdict(list(rows.values()))
    assert text.startswith("Verdict: MISS")
    assert "o2_bf16_int8state 0.27x of fp32 state (target <= 0.3: yes)" in text
    assert "o2_bf16+int4state 0.25x of fp32 state (target <= 0.2: NO)" in text
    assert (
        "o3_bf16_sr_int8state 0.27x of fp32 state (target <= 0.3: yes), 0.54x of "
        "o3_bf16_sr's bfloat16"
    ) in text
    with pytest.raises(SystemExit):
        bench.parse_args(["--levels", "o2_bf16+int8state+compile", "--device", "cpu"])
