"""Run by tests/integration/test_fsdp.py under torchrun (not a test itself): stochastic rounding of
a tensor sharded over the ranks (a DTensor, FSDP2's Shard(0)) gives each rank exactly the slice of
what rounding the whole tensor in one process gives: every element's bits are keyed by its index in
the whole tensor. Rows 13 over 2 ranks: uneven shards (7 and 6 rows).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/helpers/fsdp_rounding_probe.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torchrun_probe import finish  # beside this script (sys.path[0])

from runner.precision.rounding import stochastic_round
from runner.run import distributed


def main(out: Path) -> None:
    comm, _ = distributed.setup("cpu")
    torch.manual_seed(0)
    whole = torch.randn(13, 5, dtype=torch.float32)  # the same on every rank
    mesh = init_device_mesh("cpu", (comm.world_size,))
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    rounded = stochastic_round(sharded, seed=7, step=3, tensor_id=2)
    reference = stochastic_round(whole, seed=7, step=3, tensor_id=2)
    local = rounded.to_local()
    rows = (13 + comm.world_size - 1) // comm.world_size
    start = comm.rank * rows
    want = reference[start : start + local.shape[0]]
    record = {
        "equal": bool(torch.equal(local.view(torch.int16), want.view(torch.int16))),
        "rows": local.shape[0],
        "dtype": str(rounded.dtype),
        "differs_from_unkeyed": not torch.equal(
            local.view(torch.int16),
            stochastic_round(sharded.to_local().clone(), seed=7, step=3, tensor_id=2).view(
                torch.int16
            ),
        ),
    }
    (out / f"rank{comm.rank}.json").write_text(json.dumps(record))
    comm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish()
