"""Data-parallel training under torchrun: the process group, this process's device, and the few
collectives the runner needs (metric sums and maxima, one verdict from rank 0).

`torchrun --nproc_per_node=N -m runner ...` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE set; each joins the process group (NCCL on GPUs, Gloo on CPUs), takes GPU LOCAL_RANK,
trains its shard of every batch with DistributedDataParallel, and only rank 0 talks to MLflow and
writes checkpoints. Multi-node runs work the same through torchrun's rendezvous. Without torchrun
`Comm()` is one process and every collective is a no-op.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch
import torch.distributed as dist

from runner.errors import ConfigError

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
