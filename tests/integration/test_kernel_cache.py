"""The kernel cache is content-addressed: two checkouts of the same sources, started at once on an
empty cache, build the C++ kernels once (one builds, the other waits for it and loads its
module); a later process loads that module without a compiler; a build folder whose module is
not marked complete is built again, never loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner import csrc
from runner.csrc import loader
from tests.helpers.runs import REPO

PROBE = (
    "import logging, os, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
    "from runner import csrc\n"
    "from runner.csrc import loader\n"
    # as if this process had built the same module name from another cache folder before:
    # torch's builder then names the library <name>_v1.so
    "if os.environ.get('SAME_NAME_BUILT_BEFORE'):\n"
    "    from torch.utils import cpp_extension, _cpp_extension_versioner as versioner\n"
    "    cpp_extension.JIT_EXTENSION_VERSIONER.entries[loader._module_name('cpp')] = "
    "versioner.Entry(0, 1)\n"
    "kernels = csrc.build('cpp')\n"
    "print('loaded', kernels.ops.__file__, csrc.__file__)\n"
)


# A C++ source that builds in seconds where the real kernels take a minute or more: the cache's
# logic (content-addressed folders, the lock, the completion mark, torch's `_v1` names) is the
# same whatever the source holds, and `csrc.build` does not look inside the module it loads.
STAND_IN = (
    "#include <pybind11/pybind11.h>\n"
    'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("stand_in", []() { return 1; }); }\n'
)


def _checkout(root: Path, stand_in: bool = False) -> Path:
    """A copy of the package, as another clone or worktree of the same commit would hold it
    (`stand_in`: with the C++ kernels' source replaced by `STAND_IN`, in every copy alike)."""
    shutil.copytree(
        REPO / "runner", root / "runner", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    if stand_in:
        (root / "runner" / "csrc" / "cpu.cpp").write_text(STAND_IN)
    return root


def _start(checkout: Path, cache: Path, **env: str) -> subprocess.Popen:
    full = dict(os.environ, PYTHONPATH=str(checkout), AMP_RUNNER_KERNEL_CACHE=str(cache), **env)
    return subprocess.Popen(
        [sys.executable, "-c", PROBE],
        cwd=checkout,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_two_checkouts_build_once_and_share_the_module(tmp_path):
    cache = tmp_path / "cache"
    a, b = _checkout(tmp_path / "a", stand_in=True), _checkout(tmp_path / "b", stand_in=True)
    first, second = _start(a, cache), _start(b, cache)  # at once, on an empty cache
    outputs = [_finish(first), _finish(second)]
    builds = sum(out.count("Building amp-runner's cpp kernels") for out in outputs)
    assert builds == 1, outputs
    loaded = [
        line.split()[1] for out in outputs for line in out.splitlines() if line.startswith("loaded")
    ]
    assert len(loaded) == 2 and loaded[0] == loaded[1] and loaded[0].startswith(str(cache)), outputs
    assert [
        line.split()[2] for out in outputs for line in out.splitlines() if line.startswith("loaded")
    ] == [str(a / "runner" / "csrc" / "__init__.py"), str(b / "runner" / "csrc" / "__init__.py")]

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
    assert (folder / csrc.BUILT_MARK).read_text().split() == [
        loader._digest(Path(rebuilt[0])),
        Path(rebuilt[0]).name,
    ]
    # and a later process loads that file as it is, without a compiler
    last = _finish(_start(a, cache, CXX=str(tmp_path / "no-such-compiler")))
    assert "Building" not in last and f"loaded {rebuilt[0]}" in last, last


def test_the_cache_folder_is_named_by_content_not_by_checkout(tmp_path, monkeypatch):
    """The module (and folder) name is the digest of the sources and flags: the same for any
    checkout of them, another for changed sources."""
    name = loader._module_name("cpp")
    copy = _checkout(tmp_path / "other") / "runner" / "csrc"
    monkeypatch.setattr(loader, "SOURCE_DIR", copy)
    assert loader._module_name("cpp") == name
    (copy / "cpu.cpp").write_text((copy / "cpu.cpp").read_text() + "\n// changed\n")
    assert loader._module_name("cpp") != name


# ---- a first run does not wait for the compiler ----------------------------------------------
def _kernels_param(uri: str, run_name: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("amp-runner")
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{run_name}'"
    )
    assert run.info.status == "FINISHED"
    return run.data.params["precision.kernels"]


@pytest.mark.slow
def test_a_first_run_builds_the_kernels_in_the_background(tmp_path, monkeypatch):
    """On an empty kernel cache a single run starts the build in a background process and trains
    on torch's ops meanwhile (logged as precision.kernels=torch, and said); it exits while the
    compiler still works; once that build is complete, the next run loads the kernels."""
    from tests.helpers.runs import FAST, run_cli

    cache = tmp_path / "cache"
    monkeypatch.setenv("AMP_RUNNER_KERNEL_CACHE", str(cache))
    folder = csrc.cache_dir("cpp") / loader._module_name("cpp")
    args = [
        *FAST,
        "trainer.max_epochs=1",
        "precision=o2_bf16",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    first = run_cli(*args, "mlflow.run_name=first", cwd=tmp_path)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert "kernels are not built yet: a background process" in out, out
    assert not (folder / csrc.BUILT_MARK).exists(), "the run waited for the build"
    assert _kernels_param(f"sqlite:///{tmp_path / 'mlflow.db'}", "first") == "torch"

    def built() -> bool:  # the mark, then (its folder's lock released) the builder's last line
        log = (folder / csrc.BACKGROUND_LOG).read_text()
        return (folder / csrc.BUILT_MARK).exists() and "cpp: ready" in log

    deadline = time.monotonic() + 900
    while not built() and time.monotonic() < deadline:
        time.sleep(2)
    assert built(), (folder / csrc.BACKGROUND_LOG).read_text()

    second = run_cli(*args, "mlflow.run_name=second", cwd=tmp_path)
    out = second.stdout + second.stderr
    assert second.returncode == 0 and "background" not in out, out
    assert _kernels_param(f"sqlite:///{tmp_path / 'mlflow.db'}", "second") == "cpp"


def test_a_failed_background_build_is_remembered(tmp_path, monkeypatch, caplog):
    """A background build that fails (no compiler) leaves its reason in the cache folder: later
    runs warn with it and start no build of their own; a build asked for by hand tries again."""
    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setattr(loader, "_FAILED", {})
    monkeypatch.setenv("AMP_RUNNER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    folder = csrc.cache_dir("cpp") / loader._module_name("cpp")
    with caplog.at_level("INFO", logger="runner.csrc"):
        assert csrc.load("cpu", "auto", wait=False) is None
    assert "a background process" in caplog.text
    deadline = time.monotonic() + 300
    while not (folder / csrc.FAILED_MARK).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "no-such-compiler" in (folder / csrc.FAILED_MARK).read_text(), (
        folder / csrc.BACKGROUND_LOG
    ).read_text()

    caplog.clear()
    monkeypatch.setattr(loader, "_FAILED", {})  # a new process
    with caplog.at_level("INFO", logger="runner.csrc"):
        assert csrc.load("cpu", "auto", wait=False) is None
        assert csrc.load("cpu", "auto", wait=False) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not be built" in warnings[0], caplog.text
    assert "no-such-compiler" in warnings[0] and "background process" not in caplog.text

    by_hand = subprocess.run(
        [sys.executable, "-m", "runner.csrc", "build", "--backend", "cpp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert by_hand.returncode == 1 and "no-such-compiler" in by_hand.stderr
    assert not (folder / csrc.FAILED_MARK).exists()  # only a background build records a failure


def test_a_build_in_progress_is_not_waited_for(tmp_path, monkeypatch, caplog):
    """While another process holds the build folder's lock (it is compiling), a single run uses
    torch's ops at once and starts no second build."""
    import fcntl

    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setattr(loader, "_FAILED", {})
    monkeypatch.setenv("AMP_RUNNER_KERNEL_CACHE", str(tmp_path / "cache"))
    folder = csrc.cache_dir("cpp") / loader._module_name("cpp")
    folder.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(folder / '.lock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with caplog.at_level("INFO", logger="runner.csrc"):
            assert csrc.load("cpu", "auto", wait=False) is None
        assert time.monotonic() - started < 5
        assert "being built by another process" in caplog.text
        assert not (folder / csrc.BACKGROUND_LOG).exists()
        with open(folder / ".lock", "a+") as probe:  # the holder still has it: nothing waited
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
