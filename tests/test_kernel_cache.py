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

PROBE = ("import logging, os, sys\n"
         "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
         "from runner import csrc\n"
         # as if this process had built the same module name from another cache folder before:
         # torch's builder then names the library <name>_v1.so
         "if os.environ.get('SAME_NAME_BUILT_BEFORE'):\n"
         "    from torch.utils import cpp_extension, _cpp_extension_versioner as versioner\n"
         "    cpp_extension.JIT_EXTENSION_VERSIONER.entries[csrc._module_name('cpp')] = "
         "versioner.Entry(0, 1)\n"
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

    # a module not marked complete (a builder killed while linking) is built again; here by a
    # process that had built the same module name before (from another folder), so torch names
    # the library <name>_v1.so: the mark records the file that was built (CI saw a lookup of
    # <name>.so fail when one pytest process built the CUDA kernels in two cache folders)
    folder = Path(loaded[0]).parent
    (folder / csrc.BUILT_MARK).unlink()
    again = _finish(_start(b, cache, SAME_NAME_BUILT_BEFORE="1"))
    assert "Building amp-runner's cpp kernels" in again, again
    rebuilt = [line.split()[1] for line in again.splitlines() if line.startswith("loaded")]
    assert rebuilt == [str(folder / f"{folder.name}_v1.so")], again
    assert (folder / csrc.BUILT_MARK).read_text().split() == [csrc._digest(Path(rebuilt[0])),
                                                              Path(rebuilt[0]).name]
    # and a later process loads that file as it is, without a compiler
    last = _finish(_start(a, cache, CXX=str(tmp_path / "no-such-compiler")))
    assert "Building" not in last and f"loaded {rebuilt[0]}" in last, last


def test_the_cache_folder_is_named_by_content_not_by_checkout(tmp_path, monkeypatch):
    """The module (and folder) name is the digest of the sources and flags: the same for any
    checkout of them, another for changed sources."""
    name = csrc._module_name("cpp")
    copy = _checkout(tmp_path / "other") / "runner" / "csrc"
    monkeypatch.setattr(csrc, "SOURCE_DIR", copy)
    assert csrc._module_name("cpp") == name
    (copy / "cpu.cpp").write_text((copy / "cpu.cpp").read_text() + "\n// changed\n")
    assert csrc._module_name("cpp") != name
