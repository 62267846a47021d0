"""The kernel cache is content-addressed: two checkouts of the same sources, started at once on an
empty cache, build the C++ kernels once (one builds, the other waits for it and loads its
module); a later process loads that module without a compiler; a build folder whose module is
not marked complete is built again, never loaded."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner import csrc
from tests.conftest import REPO

PROBE = ("import logging, sys\n"
         "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
         "from runner import csrc\n"
         "kernels = csrc.build('cpp')\n"
         "print('loaded', kernels.ops.__file__, csrc.__file__)\n")


def _checkout(root: Path) -> Path:
    """A copy of the package, as another clone or worktree of the same commit would hold it."""
    shutil.copytree(REPO / "runner", root / "runner",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return root


def _start(checkout: Path, cache: Path, **env: str) -> subprocess.Popen:
    full = dict(os.environ, PYTHONPATH=str(checkout), AMP_RUNNER_KERNEL_CACHE=str(cache), **env)
    return subprocess.Popen([sys.executable, "-c", PROBE], cwd=checkout, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_two_checkouts_build_once_and_share_the_module(tmp_path):
    cache = tmp_path / "cache"
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    first, second = _start(a, cache), _start(b, cache)  # at once, on an empty cache
    outputs = [_finish(first), _finish(second)]
    builds = sum(out.count("Building amp-runner's cpp kernels") for out in outputs)
    assert builds == 1, outputs
    loaded = [line.split()[1] for out in outputs for line in out.splitlines()
              if line.startswith("loaded")]
    assert len(loaded) == 2 and loaded[0] == loaded[1] and loaded[0].startswith(str(cache)), outputs
    assert [line.split()[2] for out in outputs for line in out.splitlines()
            if line.startswith("loaded")] == [str(a / "runner" / "csrc" / "__init__.py"),
                                              str(b / "runner" / "csrc" / "__init__.py")]

    # a later process of either checkout loads it as it is: no compiler is even looked for
    later = _finish(_start(a, cache, CXX=str(tmp_path / "no-such-compiler")))
    assert "Building" not in later and f"loaded {loaded[0]}" in later, later

    # a module not marked complete (a builder killed while linking) is built again
    (Path(loaded[0]).parent / csrc.BUILT_MARK).unlink()
    again = _finish(_start(b, cache))
    assert "Building amp-runner's cpp kernels" in again, again
    assert (Path(loaded[0]).parent / csrc.BUILT_MARK).is_file()


def test_the_cache_folder_is_named_by_content_not_by_checkout(tmp_path, monkeypatch):
    """The module (and folder) name is the digest of the sources and flags: the same for any
    checkout of them, another for changed sources."""
    name = csrc._module_name("cpp")
    copy = _checkout(tmp_path / "other") / "runner" / "csrc"
    monkeypatch.setattr(csrc, "SOURCE_DIR", copy)
    assert csrc._module_name("cpp") == name
    (copy / "cpu.cpp").write_text((copy / "cpu.cpp").read_text() + "\n// changed\n")
    assert csrc._module_name("cpp") != name
