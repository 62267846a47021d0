"""benchmarks/gpu_suite.sh's prepared lease commands, checked without a GPU: every piece they list
names a benchmark whose own parser accepts its flags and levels (as on a CPU), and a bad part or
option is refused. (`--dry` runs them all at tiny sizes: minutes, see benchmarks/README.md.)"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers.benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.sh"


def listed(part: str, *options: str) -> list[tuple[str, int, list[str]]]:
    """(name, limit in seconds, command) of each piece of `part`."""
    out = subprocess.run(
        ["bash", str(SUITE), part, "--list", *options],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHON": "python3"},
    ).stdout
    pieces = []
    for line in out.splitlines():
        name, cap, command = line.split("\t")
        pieces.append((name, int(cap), shlex.split(command)))
    return pieces


@pytest.mark.parametrize("part", ["lease", "lease2"])
def test_each_piece_of_a_lease_is_accepted_by_its_benchmark(part: str, tmp_path: Path):
    pieces = listed(part)
    names = [name for name, _, _ in pieces]
    assert names[0] == "kernels_build" and len(set(names)) == len(names)
    scripts = 0
    for name, cap, command in pieces:
        assert 0 < cap <= 300, (name, cap)
        if len(command) > 1 and command[1].startswith("benchmarks/"):
            args = ["cpu" if a == "cuda" else a for a in command[2:]]  # its parser wants CUDA
            args = [str(tmp_path / Path(a).name) if a.startswith("/tmp/") else a for a in args]
            bench = load_benchmark(Path(command[1]).stem)
            parsed = bench.parse_args(args)  # SystemExit(2) on an unknown flag, level or model
            assert parsed.device == "cpu", name
            scripts += 1
    assert scripts >= 3


def test_the_first_lease_runs_its_pieces_in_order_of_priority():
    names = [name for name, _, _ in listed("lease")]
    order = ["tests_gpu", "bench_kernels", "bench_graphs", "bench_peers_tuned_rn50"]
    order += ["steady_densenet"]
    assert [n for n in names if n in order] == order
    gpu_tests = next(cmd for name, _, cmd in listed("lease") if name == "tests_gpu")
    assert "-m" in gpu_tests and "gpu" in gpu_tests


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
