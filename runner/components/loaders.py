"""DataLoaders over a `DataBundle`: the training order (a permutation per epoch drawn from the
seed and the epoch alone, sharded over the ranks), the validation order, and the end of the
worker processes (they ignore Ctrl-C and SIGTERM, which the main process handles, and are ended
before the interpreter's exit handlers would wait on them).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.context
import signal
import weakref
from typing import Optional

from torch.utils.data import DataLoader, DistributedSampler, Sampler

from runner.components.data import DataBundle

log = logging.getLogger(__name__)


class EpochSampler(DistributedSampler):
    """The training order: a permutation drawn from (seed, epoch) alone, so that an epoch's order
    does not depend on what ran before it (a resumed run sees what an uninterrupted one would),
    each rank taking every world_size-th index (DistributedSampler's sharding, also for one
    process). `skip` leaves out the first samples of this rank's share: the batches an
    interrupted epoch already trained on."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip)


class ShardSampler(Sampler[int]):
    """Validation order: rank r of w takes indices r, r + w, ... (no padding, so that the summed
    counts over the ranks are exactly the dataset's)."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1):
        self.indices = range(rank, size, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGINT/SIGTERM to the main process: a terminal's Ctrl-C and a
    scheduler's SIGTERM reach the whole process group, and the main process alone stops the run
    (after its step, with a checkpoint) and then shuts the workers down. A worker starts with
    these signals blocked (`WorkerLoader`): one that came before this is dropped here."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class WorkerLoader(DataLoader):
    """A DataLoader whose worker processes start with SIGINT/SIGTERM blocked, until they ignore
    them (`_ignore_stop_signals`). A forked worker inherits the main process's handlers: a
    Ctrl-C between its start and its init function ran the run's stop handler there too (a
    second "SIGINT received"), and a worker of another start method would have died of it.
    The main process takes a signal that came meanwhile once its workers have started."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


# Every loader with worker processes this process built: at exit, whatever is still alive of them
# is ended before multiprocessing's own exit handler would wait on it (see shutdown_workers).
_WORKER_LOADERS: weakref.WeakSet[DataLoader] = weakref.WeakSet()
_EXIT_HOOK = False
WORKER_EXIT_TIMEOUT_S = 10.0  # how long a worker may take to end before it is killed


def shutdown_workers(*loaders: DataLoader) -> None:
    """End the worker processes of `loaders` now. Persistent workers live as long as their loader,
    and a loader can outlive its run (a reference cycle keeps it until Python's cyclic collector
    runs, which an exiting interpreter never does before its exit handlers). Since the workers
    ignore SIGTERM (`_ignore_stop_signals`), multiprocessing's exit handler, which terminates
    and then joins them, would wait on them forever. Each worker is asked to end, joined within
    `WORKER_EXIT_TIMEOUT_S`, and killed (SIGKILL, with a warning) if it did not."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # the persistent workers' iterator
        if iterator is None:
            continue
        loader._iterator = None
        workers = list(getattr(iterator, "_workers", ()))
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()  # torch's own: sends each worker its end, joins them
        for worker in workers:
            worker.join(timeout=WORKER_EXIT_TIMEOUT_S)
            if worker.is_alive():
                log.warning(
                    "DataLoader worker %s did not end within %.0f s; killing it",
                    worker.pid,
                    WORKER_EXIT_TIMEOUT_S,
                )
                worker.kill()
                worker.join(timeout=WORKER_EXIT_TIMEOUT_S)


def _end_workers_at_exit() -> None:
    shutdown_workers(*list(_WORKER_LOADERS))


def _track_workers(*loaders: DataLoader) -> None:
    """Remember `loaders` for the exit hook, registered once, after multiprocessing's own (exit
    handlers run last-registered first, so this one runs before multiprocessing's)."""
    global _EXIT_HOOK
    for loader in loaders:
        _WORKER_LOADERS.add(loader)
    if not _EXIT_HOOK:
        import multiprocessing.util  # noqa: F401  (its exit handler registered before ours)

        atexit.register(_end_workers_at_exit)
        _EXIT_HOOK = True


def worker_context() -> Optional[multiprocessing.context.BaseContext]:
    """How the loaders start their workers: torch's default (None) in a plain process. In a
    process whose default start method is another library's (a sweep job under
    hydra/launcher=joblib or parallel runs in one of joblib's loky workers, whose default context
    is loky's), the platform's own default method (fork on Linux): loky's process starter
    expects loky's own Process objects and fails on the loader's workers
    ("'Process' object has no attribute 'env'")."""
    method = multiprocessing.get_start_method(allow_none=True)
    standard = multiprocessing.get_all_start_methods()
    if method is None or method in standard:
        return None
    return multiprocessing.get_context(standard[0])


def build_loaders(
    bundle: DataBundle,
    batch_size: int,
    num_workers: int,
    device_type: str,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: Optional[bool] = None,
) -> tuple[DataLoader, DataLoader]:
    """Train loader (shuffled per epoch from `seed`: see EpochSampler; this rank's share of
    every epoch) and val loader (fixed order, this rank's share). `batch_size` is per process.
    Pinned memory only helps host-to-GPU copies, so only on cuda (`pin_memory` False: not
    there either); persistent workers avoid re-forking (and re-rendering synthetic patterns)
    every epoch."""
    common = dict(
        batch_size=int(batch_size),
        num_workers=int(num_workers),
        pin_memory=device_type == "cuda" and pin_memory is not False,
        persistent_workers=int(num_workers) > 0,
        drop_last=False,
        worker_init_fn=_ignore_stop_signals if int(num_workers) > 0 else None,
        multiprocessing_context=worker_context() if int(num_workers) > 0 else None,
    )
    train_sampler = EpochSampler(
        bundle.train,
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=int(seed),
        drop_last=False,
    )
    if len(train_sampler) < int(batch_size):  # (a typo'd size, or a subset meant for a test)
        log.warning(
            "trainer.batch_size=%d is more than the %d training samples%s: each epoch is one "
            "step, of %d samples",
            int(batch_size),
            len(train_sampler),
            " of this process" if world_size > 1 else "",
            len(train_sampler),
        )
    train = WorkerLoader(bundle.train, sampler=train_sampler, **common)
    val = WorkerLoader(
        bundle.val, sampler=ShardSampler(len(bundle.val), rank, world_size), **common
    )
    if int(num_workers) > 0:
        _track_workers(train, val)
    return train, val
