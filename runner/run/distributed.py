"""Data-parallel training under torchrun: the process group, this process's device, and the few
collectives the runner needs (metric sums and maxima, one verdict from rank 0).

`torchrun --nproc_per_node=N -m runner ...` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE set; each joins the process group (NCCL on GPUs, Gloo on CPUs), takes GPU LOCAL_RANK,
trains its shard of every batch with DistributedDataParallel, and only rank 0 talks to MLflow and
writes checkpoints. Multi-node runs work the same through torchrun's rendezvous. Without torchrun
`Comm()` is one process and every collective is a no-op.

When a rank dies (killed, out of memory, an error), the others meet it in their next collective:
Gloo's connection to it breaks, NCCL's watchdog or torchrun's SIGTERM ends the wait.
`catch_lost_peers` turns that failure into `PeersLost`, one line that says what is kept, instead
of an unexpected error with the backend's traceback; `tell_torchrun` gives torchrun's failure
summary each rank's own line (its error file) instead of a link to torch's documentation.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch
import torch.distributed as dist

from runner.errors import ConfigError, PeersLost, chain

T = TypeVar("T")


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def will_join_a_group() -> bool:
    """Whether this process will join a process group (torchrun, or a SLURM job of several tasks
    under submitit), told from the environment alone, with nothing exported."""
    return launched_by_torchrun() or (
        os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
        and int(os.environ.get("SLURM_NTASKS", "1")) > 1
    )


def from_slurm_tasks() -> bool:
    """A SLURM job of several tasks submitted by Hydra's submitit launcher (hydra/launcher=slurm):
    torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) are made from SLURM's
    by submitit's own helper, and each task is one rank."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return False
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


@dataclass
class Comm:
    """This process's place in the job; world_size 1 and no process group without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    active: bool = False  # a process group exists (torchrun, any world size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- collectives (no-ops in a single process) ------------------------------------------
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def from_main(self, value: T) -> T:
        """Rank 0's `value`, on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable[[], T]) -> Optional[T]:
        """Run `fn` on rank 0 only; an exception there is raised on every rank (as a RuntimeError
        naming rank 0's error on the others), so no rank waits forever for a failed rank 0."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
                error = exc
        failure = self.from_main(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(f"rank 0 failed: {failure}")
        return result

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()
        self.active = False


def setup(device: torch.device | str) -> tuple[Comm, torch.device]:
    """Join torchrun's process group when launched by it: (comm, this rank's device). `device` is
    the run's planned device (runner.run.plan: cpu or cuda, already checked): a torchrun rank on
    CUDA takes GPU LOCAL_RANK with NCCL, on a CPU Gloo. Without torchrun: (Comm(), `device`)."""
    device = torch.device(device)
    if not launched_by_torchrun() and not from_slurm_tasks():
        return Comm(), device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                "trainer.device",
                f"local rank {local_rank} has no GPU (this node "
                f"has {torch.cuda.device_count()}); start at most that many "
                "processes per node",
                "--nproc_per_node <= the GPUs per node",
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return Comm(rank=rank, world_size=world, local_rank=local_rank, active=True), device


def flag_reducer(comm: Comm) -> Optional[Callable[[torch.Tensor], None]]:
    """For AmpEngine: sums the non-finite flags over the ranks (so that all skip together)."""
    return (lambda t: comm.sum_(t)) if comm.active else None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


# Gloo's errors are RuntimeErrors that start with the source file that raised them:
# "[.../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:55494: Connection reset by peer.
# This is typically caused by a remote worker hanging or bugs in the application. ..."
_GLOO_SOURCE = re.compile(r"^\[[^\]]*/gloo/[^\]]*\]\s*")
_GLOO_ADVICE = " This is typically caused"


def collective_failure(error: BaseException) -> Optional[str]:
    """The failed collective in `error`'s chain, in one line: torch.distributed's own errors
    (`DistError`: NCCL's, the rendezvous store's, the network's) and Gloo's (without its source
    file and its advice); None for any other error."""
    for link in chain(error):
        text = str(link).strip()
        gloo = isinstance(link, RuntimeError) and _GLOO_SOURCE.match(text) is not None
        if not gloo and not isinstance(link, dist.DistError):
            continue
        lines = _GLOO_SOURCE.sub("", text).splitlines()
        line = lines[0].split(_GLOO_ADVICE)[0].rstrip(". ") if lines else ""
        return f"{'Gloo' if gloo else type(link).__name__}: {line}".rstrip(": ")
    return None


@contextmanager
def catch_lost_peers(comm: Comm, kept: Callable[[], str] = lambda: "") -> Iterator[None]:
    """Around a part of a distributed run: a collective that fails (another rank gone) becomes
    `PeersLost`: what failed, what most likely happened, where to look, and `kept()` (what this
    rank keeps: its last checkpoint), instead of an unexpected error with the backend's
    traceback. Anything else passes unchanged, as does everything in a single process."""
    try:
        yield
    except PeersLost:
        raise
    except Exception as error:
        failed = collective_failure(error) if comm.active else None
        if failed is None:
            raise
        more = kept()
        where = (  # (torchrun's agent sets TORCHELASTIC_RUN_ID; a SLURM job's tasks have none)
            "torchrun's summary names the rank that failed first and how; that rank's own "
            "lines say why."
            if under_torchrun()
            else "Each rank's own lines (its task's log) say which ended and why."
        )
        raise PeersLost(
            f"A collective operation of the {comm.world_size} ranks failed ({failed}): most "
            "likely another rank ended (an error, out of memory, killed) or cannot be reached, "
            f"and the run cannot go on without it. {where}" + (f" {more}" if more else "")
        ) from None


def under_torchrun() -> bool:
    """Whether torchrun's agent started this process (and writes a failure summary)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size, from the environment (torchrun's variables, a
    SLURM job's tasks), before any process group; (0, 1) in a single process."""
    if launched_by_torchrun():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if will_join_a_group():
        return int(os.environ.get("SLURM_PROCID", "0")), int(os.environ["SLURM_NTASKS"])
    return 0, 1


def rank_label() -> str:
    """The start of a line on a rank other than 0 of a distributed run: "rank R of W: "; "" on
    rank 0 (the run's story, unlabelled) and in a single process."""
    rank, world = _rank_and_world()
    return f"rank {rank} of {world}: " if rank != 0 else ""


class _RankLabel(logging.Filter):
    """Starts each runner record's message with the rank's label, once (a record goes through
    every handler)."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] == "runner" and not getattr(record, "_rank_label", False):
            record.msg = f"{self.label}{record.msg}"
            record._rank_label = True
        return True


def rank_zero_logging() -> None:
    """One console story, rank 0's: on the other ranks of a distributed run the runner's lines
    are its warnings and errors only, each labelled with the rank (`rank_label`) on every
    handler of the root logger (the console, the job log): each rank measures its own data
    wait, and a rank's error is told by that rank."""
    label = rank_label()
    if not label:
        return
    logging.getLogger("runner").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RankLabel) for f in handler.filters):
            handler.addFilter(_RankLabel(label))


def tell_torchrun(message: str) -> None:
    """`message`, this rank's error in a line, into torchrun's error file for it
    (TORCHELASTIC_ERROR_FILE, set by torchrun): its failure summary then shows the line, where it
    shows a link to torch's documentation for a rank that wrote none. Nothing outside torchrun;
    a file that cannot be written changes nothing (the line is on the console already)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as file:  # (the form torch's `record` writes)
            info = {"py_callstack": message, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": message, "extraInfo": info}}, file)
    except OSError:
        pass
