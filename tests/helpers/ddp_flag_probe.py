"""Run by tests/integration/test_distributed.py under torchrun (not a test itself): a found-inf flag
raised on one rank only must make every rank skip that step and back off its loss scale alike, so
the fp32 masters stay identical on all ranks. No DDP wrapper here (DDP's gradient average would
carry the inf to every rank by itself): this checks the engine's own flag reduction.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/helpers/ddp_flag_probe.py OUT_FOLDER KERNELS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torchrun_probe import finish  # beside this script (sys.path[0])

from runner.precision import AmpEngine, resolve
from runner.run import distributed


def main(out: Path, kernels: str) -> None:
    comm, device = distributed.setup("cpu")
    torch.manual_seed(0)  # the same model and data on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    properties = resolve(
        "O2", {"cast_model_type": "bfloat16", "loss_scale": "dynamic"}, device=device
    ).properties
    engine = AmpEngine(
        properties, device, kernels=kernels, flag_reducer=distributed.flag_reducer(comm)
    )
    model, optimizer = engine.prepare(model, optimizer)
    record = {
        "backend": engine.kernels.name if engine.kernels else "torch",
        "stepped": [],
        "loss_scale": [],
        "skipped_steps": [],
    }
    for step in range(4):
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        engine.backward(loss)
        if step == 1 and comm.rank == 1:  # this rank alone overflows, in its last gradient
            list(model.parameters())[-1].grad.view(-1)[-1] = float("inf")
        record["stepped"].append(bool(engine.step(optimizer)))
        engine.zero_grad(optimizer)
        record["loss_scale"].append(engine.loss_scale)
        record["skipped_steps"].append(engine.skipped_steps)
    masters = [p.detach().clone() for p in engine.master_params(optimizer)]
    record["masters"] = [p.flatten().tolist() for p in masters]
    (out / f"rank{comm.rank}.json").write_text(json.dumps(record))
    comm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    finish()
