"""One GPU per job when a sweep's jobs run in parallel (the joblib launcher,
`hydra/launcher=parallel`): how many jobs at once, and which GPU a job takes."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from runner.files import HeldLock, try_lock


def claim_gpu(lock_dir: Path, count: int) -> tuple[int, HeldLock] | None:
    """The first GPU index no other job of this sweep holds (an exclusive lock file per GPU in the
    sweep folder, released when the lock is closed); None when all are taken."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        held = try_lock(lock_dir / f".gpu{index}.lock")
        if held is not None:
            return index, held
    return None


def gpu_count() -> int:
    import torch  # here, not at import: single runs load this module too

    return torch.cuda.device_count()


def parallel_jobs() -> int:
    """`hydra/launcher=parallel`'s n_jobs: one job per GPU, one at a time without a GPU, so that
    no job's timings and peak memory are spoiled by a neighbour on the same device."""
    return max(1, gpu_count())


def register_resolvers() -> None:
    """The config resolvers the runner's config tree uses (`${runner.parallel_jobs:}` in
    conf/hydra/launcher/parallel.yaml); the CLI calls this before Hydra composes."""
    OmegaConf.register_new_resolver("runner.parallel_jobs", parallel_jobs, replace=True)
