"""The kernels' loader: compile a backend into the per-user cache, load it, or say why not.

A backend's sources (`SOURCES` and `HEADERS`, beside this file) are compiled with
`torch.utils.cpp_extension.load` (ninja) into a folder of the cache named by the digest of those
sources and the compiler flags (`_module_name`), so a later run of any checkout loads the module
as it is; a change to a source file or a flag builds a new one. `load` picks the backend for a
device and a `precision.kernels` choice: on first use a single run starts the build in a
background process without waiting for it (`wait=False`), `python -m runner.csrc build` builds
ahead of time, and a failed build says why and leaves the engine on torch's own ops.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from runner.config import KERNEL_CHOICES
from runner.errors import RunnerError
from runner.files import file_lock, try_lock, write_atomic

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
HEADERS = ("ops.h", "step_math.h", "multi_tensor_apply.cuh")
SOURCES = {"cpp": ("cpu.cpp",), "cuda": ("cuda.cu", "cuda_bindings.cpp")}
BACKENDS = tuple(SOURCES)
# What `precision.kernels` accepts (declared with the schema, which imports no torch)
CHOICES = KERNEL_CHOICES


class KernelBuildError(RunnerError, RuntimeError):
    """The kernels could not be compiled or loaded; the message says why, `fix` what to do
    where it is not the compiler's (None: install one, see the full log)."""

    def __init__(self, reason: str, fix: Optional[str] = None):
        super().__init__(reason)
        self.fix = fix


CACHE_FIX = (
    "set AMP_RUNNER_KERNEL_CACHE to a folder you can write (the default is "
    "~/.cache/amp-runner/kernels, under $XDG_CACHE_HOME where set)"
)


def _made(directory: Path) -> Path:
    """A build folder of the cache, made if it is not there; KernelBuildError where it cannot
    be (a read-only home on a cluster's nodes, a cache path through a file)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KernelBuildError(
            f"the kernel cache {directory} cannot be made ({error.strerror or error})", CACHE_FIX
        ) from error
    return directory


@dataclass(frozen=True)
class Kernels:
    """A loaded backend: `ops` is the compiled module, `name` is "cpp" or "cuda"."""

    name: str
    ops: ModuleType
    device_type: str  # "cpu" or "cuda": the tensors this backend takes


def backend_for(device: torch.device | str) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpp"


# The flags torch's own build compiles its AVX2 and AVX-512 kernels with (its CPU_CAPABILITY
# builds), and the macros that select ATen's matching Vectorized in the vec headers.
_CAPABILITY_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


def _cpu_flags() -> list[str]:
    """The vector ISA of torch's own kernels on this CPU (`torch.backends.cpu`'s capability,
    which honours ATEN_CPU_CAPABILITY): the C++ kernels use ATen's Vectorized of the same width.
    Any other capability (another architecture, an x86 CPU without AVX2) builds the portable
    Vectorized with the compiler's default ISA. The flags are spelled out, so the cache key
    differs between CPUs that need different builds (a home shared over NFS)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return list(_CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), []))


def build_flags(backend: str) -> dict[str, list[str]]:
    # -fno-math-errno: sqrtf without the errno path, so the Adam loop vectorises
    cflags = ["-O3", "-fno-math-errno", "-fopenmp", *_cpu_flags()] if backend == "cpp" else ["-O3"]
    flags = {"extra_cflags": cflags, "extra_ldflags": ["-fopenmp"] if backend == "cpp" else []}
    if backend == "cuda":
        # no --use_fast_math: IEEE division/sqrt and no flush of subnormal gradients to zero,
        # so both backends compute the same values
        flags["extra_cuda_cflags"] = ["-O3", "-lineinfo"]
    return flags


def cache_dir(backend: str) -> Path:
    """`$AMP_RUNNER_KERNEL_CACHE` or `~/.cache/amp-runner/kernels`, per torch build and backend
    (an extension is tied to the torch it was compiled against)."""
    root = Path(
        os.environ.get("AMP_RUNNER_KERNEL_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "amp-runner"
        / "kernels"
    )
    tag = f"torch{torch.__version__}-py{platform.python_version()}".replace("+", "_")
    return root / tag / backend


def _module_name(backend: str) -> str:
    """One module name per source/flag content, so a stale .so of the same name, already
    imported or cached, is never mistaken for the current sources."""
    digest = hashlib.sha256()
    for name in (*HEADERS, *SOURCES[backend]):
        path = SOURCE_DIR / name
        if path.exists():
            digest.update(name.encode() + path.read_bytes())
    digest.update(repr(build_flags(backend)).encode())
    if backend == "cuda":
        digest.update(os.environ.get("TORCH_CUDA_ARCH_LIST", "").encode())
    return f"amp_runner_{backend}_{digest.hexdigest()[:12]}"


_LOADED: dict[str, Kernels] = {}
_FAILED: dict[str, str] = {}


BUILT_MARK = "built.sha256"  # in a build folder: the SHA-256 of the module that was built there


def build(backend: str, verbose: bool = False) -> Kernels:
    """Compile (or load from the cache) one backend; raises KernelBuildError with the reason.

    The cache is content-addressed: a build folder is named by the sources' and flags' digest
    (`_module_name`) under the torch build and Python version (`cache_dir`), and the build
    compiles a copy of the sources kept in that folder. A module built there, by any checkout or
    virtualenv, is loaded as it is (no compiler, no ninja); `BUILT_MARK` holds its digest, written
    once it is complete, so a half-written module is never loaded (it is built again). Concurrent
    first builds (a sweep's parallel jobs, two terminals) take a lock on the folder: one builds,
    the others wait and load what it built. The lock is the kernel's (flock: runner.files),
    released when its holder exits, however it exits."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend in _LOADED:
        return _LOADED[backend]
    name = _module_name(backend)
    directory = _made(cache_dir(backend) / name)
    try:
        try:
            held = _folder_lock(directory)
        except OSError as error:  # a folder this user cannot write: a complete build loads
            module = _load_built(name, directory)
            if module is None:
                raise KernelBuildError(
                    f"the kernel cache {directory} is not writable ({error.strerror or error}) "
                    "and holds no complete build",
                    CACHE_FIX,
                ) from error
        else:
            with held:
                module = _load_built(name, directory) or _compile(backend, name, directory, verbose)
    except KernelBuildError:
        raise
    except Exception as error:  # compiler missing, compile error, ninja missing, ...
        raise KernelBuildError(f"{type(error).__name__}: {_last_lines(str(error))}") from error
    kernels = Kernels(name=backend, ops=module, device_type="cuda" if backend == "cuda" else "cpu")
    _LOADED[backend] = kernels
    return kernels


def _folder_lock(directory: Path) -> AbstractContextManager[None]:
    return file_lock(
        directory / ".lock",
        on_wait=lambda: log.info(
            "Waiting for another process building the kernels in %s", directory
        ),
    )


def _library(name: str, directory: Path) -> Path:
    from torch.utils import cpp_extension

    return directory / f"{name}{cpp_extension.LIB_EXT}"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_built(name: str, directory: Path) -> Optional[ModuleType]:
    """The module a complete earlier build left in `directory`, imported; None when there is
    none (or an incomplete one: its digest does not match the mark).

    The mark holds "<sha256> <file name>": torch's builder names the library `<name>_v1.so` (and
    so on) when one process builds the same module name twice (from two cache folders), so the
    file that was built is recorded, not guessed."""
    mark = directory / BUILT_MARK
    if not mark.is_file():
        return None
    fields = mark.read_text().split()
    if not fields:
        return None
    library = directory / fields[1] if len(fields) > 1 else _library(name, directory)
    if library.parent != directory or not library.is_file() or fields[0] != _digest(library):
        return None
    module_name = library.name.split(".")[0]  # its PyInit_ symbol is named after the file
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(backend: str, name: str, directory: Path, verbose: bool) -> ModuleType:
    """Build `name` from a copy of the sources in `directory` (the same paths whichever
    checkout built it), then mark it complete."""
    from torch.utils import cpp_extension

    if backend == "cuda":
        _check_cuda_home()
        _check_arch_list()
    log.info("Building amp-runner's %s kernels into %s (once; about a minute)", backend, directory)
    started = time.perf_counter()
    (directory / BUILT_MARK).unlink(missing_ok=True)
    copies = directory / "src"
    copies.mkdir(exist_ok=True)
    for source in (*HEADERS, *SOURCES[backend]):
        shutil.copyfile(SOURCE_DIR / source, copies / source)
    module = cpp_extension.load(
        name=name,
        sources=[str(copies / s) for s in SOURCES[backend]],
        build_directory=str(directory),
        with_cuda=backend == "cuda",
        verbose=verbose,
        **build_flags(backend),
    )
    library = Path(module.__file__)
    write_atomic(directory / BUILT_MARK, f"{_digest(library)} {library.name}\n")
    log.info("Built the %s kernels in %.0f s", backend, time.perf_counter() - started)
    return module


def cuda_toolkit() -> Optional[str]:
    """The CUDA toolkit torch's builder will use (CUDA_HOME, else where nvcc is), or None when
    there is none usable (no nvcc, or a folder without the CUDA headers)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
        return home
    return None


def cuda_arch_list() -> str:
    """The GPU architectures a CUDA build targets: TORCH_CUDA_ARCH_LIST, else the GPUs present."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps) or "torch's default list"


def _check_cuda_home() -> None:
    if cuda_toolkit() is None:
        from torch.utils import cpp_extension

        raise KernelBuildError(
            f"no usable CUDA toolkit (CUDA_HOME={cpp_extension.CUDA_HOME}): set CUDA_HOME to the "
            "folder that holds bin/nvcc and include/cuda_runtime.h, e.g. /usr/local/cuda"
        )


def _check_arch_list() -> None:
    """A CUDA build needs GPUs to target: those present, or TORCH_CUDA_ARCH_LIST (without either,
    torch's builder fails with an IndexError that says nothing)."""
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        raise KernelBuildError(
            "no GPU here to build the CUDA kernels for: set TORCH_CUDA_ARCH_LIST to the compute "
            "capabilities of the GPUs they will run on, e.g. 9.0 for an H100 or H200 ('8.0;9.0' "
            "for several)"
        )


def _last_lines(text: str, n: int = 12) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


FAILED_MARK = "failed.txt"  # in a build folder: why its last background build failed
BACKGROUND_LOG = "build.log"  # in a build folder: the background builder's output


def load(
    device: torch.device | str, choice: str = "auto", *, wait: bool = True
) -> Optional[Kernels]:
    """The kernels for `device`'s tensors per `choice` (see CHOICES): None means torch's ops.

    With "auto" a failed build logs one warning (why, and how to fix it) and returns None; with
    "fused" it raises KernelBuildError. With "auto" and `wait=False` (a single run: its first
    run ever should not wait a minute for a compiler), kernels not built yet are built by a
    background process (`start_background_build`) while this run steps with torch's ops, and
    the next run loads them; "fused" always waits for the build.
    """
    if choice not in CHOICES:
        raise ValueError(f"precision.kernels={choice!r}; expected one of {CHOICES}")
    if choice == "torch":
        return None
    backend = backend_for(device)
    if backend in _FAILED and choice == "auto":
        return None
    try:
        if choice == "auto" and not wait and backend not in _LOADED:
            if _load_if_built(backend) is None:
                return None
        return build(backend)
    except KernelBuildError as error:
        if choice == "fused":
            raise KernelBuildError(
                f"precision.kernels=fused: amp-runner's fused {backend} kernels could not be "
                f"built. Why:\n{error}\nTo fix: {_fix(backend, error.fix)}; or "
                "precision.kernels=auto, which steps with torch's ops where they cannot be built",
                error.fix,
            ) from error
        _warn_failed(backend, str(error), error.fix)
        return None


def _fix(backend: str, fix: Optional[str] = None) -> str:
    """What to do about a failed build: `fix` where the reason has one of its own (the cache),
    else the compiler's."""
    if fix is not None:
        return fix
    cuda = " and point CUDA_HOME at the CUDA toolkit (the folder holding bin/nvcc)"
    return (
        f"install a C++ compiler and ninja{cuda if backend == 'cuda' else ''}, then run "
        "`python -m runner.csrc build` to see the full log"
    )


def _warn_failed(backend: str, reason: str, fix: Optional[str] = None) -> None:
    _FAILED[backend] = reason
    log.warning(
        "amp-runner's fused %s kernels could not be built, so the engine uses torch's own "
        "ops (slower: more passes over the parameters). Why:\n%s\nTo fix: %s; "
        "precision.kernels=torch silences this.",
        backend,
        reason,
        _fix(backend, fix),
    )


def _load_if_built(backend: str) -> Optional[Kernels]:
    """The kernels when a complete build is in the cache (loaded now: `build` finds them);
    otherwise None, having started a background build, or found one running, or found why the
    last one failed (warned once)."""
    name = _module_name(backend)
    directory = _made(cache_dir(backend) / name)
    try:
        lock = try_lock(directory / ".lock")
    except OSError:  # a folder this user cannot write: `build` loads a complete build, or says
        return build(backend)
    if lock is None:
        log.info(
            "amp-runner's %s kernels are being built by another process (%s); this run "
            "uses torch's ops, later runs the kernels.",
            backend,
            directory,
        )
        return None
    with lock:
        module = _load_built(name, directory)
    if module is not None:
        _LOADED[backend] = Kernels(
            name=backend, ops=module, device_type="cuda" if backend == "cuda" else "cpu"
        )
        return _LOADED[backend]
    failed = directory / FAILED_MARK
    if failed.is_file():
        _warn_failed(
            backend,
            f"{failed.read_text().strip()}\n(the last build's log: {directory / BACKGROUND_LOG})",
        )
        return None
    pid = start_background_build(backend, directory)
    log.warning(
        "amp-runner's fused %s kernels are not built yet: a background process (pid %d, "
        "log %s) builds them now, once for every later run (about a minute); this run "
        "steps with torch's own ops (precision.kernels is logged as torch). "
        "precision.kernels=fused waits for the build instead; `python -m runner.csrc "
        "build` builds ahead of time.",
        backend,
        pid,
        directory / BACKGROUND_LOG,
    )
    return None


def start_background_build(backend: str, directory: Path) -> int:
    """Start `python -m runner.csrc build --backend <backend> --background`: its own session (a
    Ctrl-C or the end of the run does not stop it), the lowest CPU priority, output to
    `<directory>/build.log`; returns its pid. It takes the folder's lock, so a run that starts
    meanwhile sees the build in progress and never loads a half-written module."""
    import subprocess
    import sys

    package_root = str(SOURCE_DIR.parent.parent)  # the folder that holds `runner`
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with open(directory / BACKGROUND_LOG, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runner.csrc", "build", "--backend", backend, "--background"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=directory,
            start_new_session=True,
            close_fds=True,
        )
    return proc.pid


def record_background_failure(backend: str, reason: str) -> None:
    """What a background build that failed leaves for the next runs (they warn, and no longer
    start builds that fail the same way); `python -m runner.csrc build` clears it."""
    directory = cache_dir(backend) / _module_name(backend)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / FAILED_MARK, reason + "\n")


def clear_background_failure(backend: str) -> None:
    (cache_dir(backend) / _module_name(backend) / FAILED_MARK).unlink(missing_ok=True)


def name_of(kernels: Optional[Kernels]) -> str:
    """What `precision.kernels` is logged as: cuda | cpp | torch."""
    return kernels.name if kernels is not None else "torch"
