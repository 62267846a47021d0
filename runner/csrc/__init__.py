"""The engine's fused multi-tensor kernels: C++ for CPU tensors, CUDA for GPU tensors.

Both backends expose the same functions (see `ops.h`): `unscale_check`, `check_finite`,
`l2norm`, `copy_scale`, `sgd_step`, `adam_step`, `update_scale` (the dynamic loss scale's
update, one op), and for bf16 weights without fp32 masters
`stochastic_round`, `sgd_step_sr`, `adam_step_sr` (see runner/precision/rounding.py). They are
compiled with `torch.utils.cpp_extension.load` (ninja) into a per-user cache keyed by content,
reused by later runs and rebuilt when a source file or a compiler flag changes: on first use, by a
background process that a single run starts without waiting for it (`load(..., wait=False)`),
or ahead of time by `python -m runner.csrc build`. When a build fails (no compiler, no CUDA
toolkit), `load` says why and the engine uses torch's own ops instead: which backend runs is
printed at start and logged as `precision.kernels` (cuda | cpp | torch).

Here: the sources (`cpu.cpp`; `cuda.cu` and `cuda_bindings.cpp`; the shared headers `ops.h`,
`step_math.h`, `multi_tensor_apply.cuh`), the loader that builds and loads them (`loader.py`,
its names re-exported below) and the build command (`__main__.py`).
"""

from runner.csrc.loader import (  # noqa: F401  (what callers use: runner.csrc.load, ...)
    BACKENDS,
    BACKGROUND_LOG,
    BUILT_MARK,
    CHOICES,
    FAILED_MARK,
    HEADERS,
    SOURCE_DIR,
    SOURCES,
    KernelBuildError,
    Kernels,
    backend_for,
    build,
    build_flags,
    cache_dir,
    clear_background_failure,
    cuda_arch_list,
    cuda_toolkit,
    load,
    name_of,
    record_background_failure,
    start_background_build,
)
