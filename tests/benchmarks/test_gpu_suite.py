"""benchmarks/gpu_suite.sh's prepared lease commands, checked without a GPU: every piece they list
names a benchmark whose own parser accepts its flags and levels (as on a CPU), and a bad part or
option is refused. (`--dry` runs them all at tiny sizes: minutes, see benchmarks/README.md.)"""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.sh"


def _list(part: str, *options: str, env: dict[str, str] | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPU_SUITE_SKIP"} | (env or {})
    return subprocess.run(
        ["bash", str(SUITE), part, "--list", *options],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "PYTHON": "python3"},
    ).stdout.splitlines()


def listed(part: str, *options: str) -> list[tuple[str, int, list[str]]]:
    """(name, limit in seconds, command) of each piece of `part`."""
    pieces = []
    for line in _list(part, *options):
        if not line.startswith("#"):
            name, cap, command = line.split("\t")
            pieces.append((name, int(cap), shlex.split(command)))
    return pieces


def skipped(part: str, *options: str, env: dict[str, str] | None = None) -> set[str]:
    """The pieces `part` would skip (GPU_SUITE_SKIP, or the part's own default)."""
    lines = [line for line in _list(part, *options, env=env) if line.startswith("# skipped")]
    return set(lines[0].split(": ", 1)[1].split(",")) if lines else set()


@pytest.mark.parametrize("part", ["lease", "lease2"])
def test_each_piece_of_a_lease_is_accepted_by_its_benchmark(part: str, tmp_path: Path):
    pieces = listed(part)
    names = [name for name, _, _ in pieces]
    assert names[0] == "kernels_build" and len(set(names)) == len(names)
    scripts = 0
    for name, cap, command in pieces:
        assert 0 < cap <= 300, (name, cap)
        if command[1:2] == ["-m"] and command[2].startswith("benchmarks."):
            args = ["cpu" if a == "cuda" else a for a in command[3:]]  # its parser wants CUDA
            args = [str(tmp_path / Path(a).name) if a.startswith("/tmp/") else a for a in args]
            bench = importlib.import_module(command[2])
            parsed = bench.parse_args(args)  # SystemExit(2) on an unknown flag, level or model
            assert parsed.device == "cpu", name
            scripts += 1
    assert scripts >= 3


def test_the_first_lease_runs_its_pieces_in_order_of_priority():
    names = [name for name, _, _ in listed("lease")]
    order = ["tests_gpu", "bench_graphs", "bench_kernels", "steady_densenet"]
    order += ["bench_peers_tuned_rn50"]
    assert [n for n in names if n in order] == order
    # the whole-step graph's benchmark (issue 72's targets) straight after the CUDA tests
    assert names.index("bench_graphs") == names.index("tests_gpu") + 1
    gpu_tests = next(cmd for name, _, cmd in listed("lease") if name == "tests_gpu")
    assert "-m" in gpu_tests and "gpu" in gpu_tests


def test_the_lease_measures_the_whole_step_graph_at_the_issues_shapes():
    from benchmarks import graphs

    command = next(cmd for name, _, cmd in listed("lease") if name == "bench_graphs")
    args = graphs.parse_args(["cpu" if a == "cuda" else a for a in command[3:]])
    assert args.model == "densenet161" and args.shapes == [(32, 128), (224, 64)]
    assert args.levels == ["o2", "o0"] and set(args.sides) == set(graphs.SIDES)
    dry = next(cmd for name, _, cmd in listed("lease", "--dry") if name == "bench_graphs")
    assert graphs.parse_args(dry[3:]).shapes == [(32, 2)]  # (DenseNet-161's least: 32 px)


@pytest.mark.parametrize("part", ["lease", "lease2"])
def test_a_lease_skips_what_earlier_leases_measured_unless_told(part: str):
    names = {name for name, _, _ in listed(part)}
    default = skipped(part)
    # each a piece of this part (a misspelt name would skip nothing), never the tests or the build
    assert default and default <= names - {"kernels_build", "tests_gpu"}
    assert skipped(part, env={"GPU_SUITE_SKIP": ""}) == set()  # set empty: every piece runs
    assert skipped(part, env={"GPU_SUITE_SKIP": "bench_graphs"}) == {"bench_graphs"}
    assert skipped(part, "--dry") == set()  # a dry run checks every piece


def test_the_dry_run_lists_cpu_commands_at_tiny_sizes():
    for name, _, command in listed("lease", "--dry"):
        assert "cuda" not in command, name
        if name == "tests_gpu":
            assert "--collect-only" in command


@pytest.mark.parametrize(
    "args,needle",
    [(["5"], "usage:"), (["lease", "--fast"], "unknown option --fast"), (["2", "--dry"], "--dry")],
)
def test_a_bad_part_or_option_is_refused(args: list[str], needle: str, tmp_path: Path):
    done = subprocess.run(
        ["bash", str(SUITE), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": "python3"},
    )
    assert done.returncode == 2 and needle in done.stderr, done.stderr
