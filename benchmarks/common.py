"""What every benchmark records beside its numbers: the machine, the versions, the exact command
and the date, so that a committed result can be reproduced and compared like with like."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/<name>.py` from a checkout
    sys.path.insert(0, str(REPO))


def machine(device: str) -> dict[str, str]:
    """CPU (and GPU) model, core and thread counts, torch/CUDA/Python versions, platform."""
    import torch

    from runner.precision.checks import DeviceInfo

    info = {
        "cpu": DeviceInfo.from_torch("cpu").name,
        "cores": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = DeviceInfo.from_torch("cuda").describe()
        info["cuda"] = str(torch.version.cuda)
    return info


def command(script: str, argv: Sequence[str]) -> str:
    """The command line that reproduces this run."""
    return f"python benchmarks/{script} " + shlex.join(argv) if argv else \
        f"python benchmarks/{script}"


def now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")
