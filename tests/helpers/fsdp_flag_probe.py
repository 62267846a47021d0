"""Run by tests/integration/test_fsdp.py under torchrun (not a test itself): a sharded model (FSDP2)
at O2 with fp16 compute and dynamic loss scaling; rank 1 alone puts an inf into its gradient shard
at step 2: every rank must skip that step and back off alike, so the fp32 shards stay consistent.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/helpers/fsdp_flag_probe.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torchrun_probe import finish  # beside this script (sys.path[0])

from runner.precision import AmpEngine, resolve
from runner.run import distributed, fsdp


def main(out: Path) -> None:
    comm, device = distributed.setup("cpu")
    torch.manual_seed(0)  # the same model and data on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    properties = resolve("O2", {"loss_scale": "dynamic"}, device=device).properties  # fp16
    engine = AmpEngine(
        properties,
        device,
        kernels="torch",
        sharded=True,
        flag_reducer=distributed.flag_reducer(comm),
    )
    engine.cast(model)
    fsdp.shard(model, properties, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine.add_optimizer(optimizer, [model])
    record = {"stepped": [], "loss_scale": [], "skipped_steps": [], "grad_dtype": None}
    for step in range(4):
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        grad = list(model.parameters())[-1].grad
        record["grad_dtype"] = str(grad.dtype)
        if step == 1 and comm.rank == 1:  # this rank alone overflows, in its own shard
            fsdp.local(grad).view(-1)[-1] = float("inf")
        record["stepped"].append(bool(engine.step(optimizer)))
        engine.zero_grad(optimizer)
        record["loss_scale"].append(engine.loss_scale)
        record["skipped_steps"].append(engine.skipped_steps)
    full = fsdp.full_model_state(model)  # a collective; rank 0 holds the whole model
    record["weights"] = {k: v.flatten().tolist() for k, v in full.items()}
    (out / f"rank{comm.rank}.json").write_text(json.dumps(record))
    comm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish()
