"""Checkpoints: everything a run needs to continue exactly where it stopped, written atomically.

A run writes `<trainer.checkpoint_dir>/<experiment>/<run name>/<MLflow run id>/last.pt` (relative
to the launch directory, not Hydra's timestamped output folder) after every
`trainer.checkpoint_every_n_epochs` epochs and when it is interrupted. Each run has its own folder,
so a new run never overwrites another's checkpoint, and `resume=auto` takes the most recent one
under the experiment and run name. A file is written to a temporary name and renamed into place,
so a crash while writing leaves the previous checkpoint intact.

Contents: the model's state (fp32: the O2 masters' exact values), the optimizer's (its state for
the masters), the precision engine's (every loss scaler), the scheduler's, the position (epoch,
batch within it, global step), the divergence counters, the metric history, the RNG states of
torch, CUDA, Python and NumPy, the MLflow run id and the resolved config.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from runner.errors import ConfigError

FILENAME = "last.pt"
FORMAT = 1
# config keys a resumed run may change: the epoch budget may grow, and these say how to resume
RESUMABLE_CHANGES = ("trainer.max_epochs", "resume")


def _safe(name: str) -> str:
    """A folder name from an experiment or run name (no separators, nothing hidden)."""
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", name).strip("._") or "_"


def run_folder(root: str | os.PathLike, experiment: str, run_name: str) -> Path:
    """`<root>/<experiment>/<run name>`: the stable folder of every run of that name."""
    return Path(root).expanduser().resolve() / _safe(experiment) / _safe(run_name)


def path_for(folder: Path, run_id: str) -> Path:
    return folder / _safe(run_id) / FILENAME


def find(resume: Optional[str], folder: Path) -> Optional[Path]:
    """The checkpoint `resume` names: None for a fresh run; "auto": the most recent `last.pt`
    under the run's folder (None when there is none yet, so the run starts fresh); anything else
    a checkpoint file, or a folder holding one. A missing path is a ConfigError."""
    if resume is None or str(resume).strip() == "":
        return None
    if str(resume).strip().lower() == "auto":
        found = sorted(folder.glob(f"*/{FILENAME}"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if path.is_dir():
        path = path / FILENAME
    if not path.is_file():
        raise ConfigError("resume", f"no checkpoint at {str(resume)!r}",
                          f"auto, or a checkpoint file ({FILENAME}) or its folder")
    return path.resolve()


def save(path: Path, state: Mapping[str, Any]) -> None:
    """Write `state` to `path` atomically: a temporary file in the same folder, flushed to disk,
    then renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            torch.save({"format": FORMAT, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    """A checkpoint written by `save` (on the CPU; tensors move where they are loaded)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001  (a truncated or foreign file: say which)
        raise ConfigError("resume", f"cannot read the checkpoint {str(path)!r}: {error}",
                          "a checkpoint written by amp-runner") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError("resume", f"{str(path)!r} is not an amp-runner checkpoint "
                          f"(format {FORMAT})", "a checkpoint written by amp-runner")
    return state


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: saved -> current` for every key whose value differs (or exists on one side only),
    except the ones a resumed run may change."""
    a, b = _flatten(saved), _flatten(current)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_CHANGES:
            continue
        old, new = a.get(key, missing), b.get(key, missing)
        if old != new:
            show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            out.append(f"{key}: {show(old)} -> {show(new)}")
    return out


def check_resumable(state: Mapping[str, Any], config: Mapping[str, Any], path: Path) -> None:
    """The current config must be the checkpoint's, but for a grown `trainer.max_epochs`."""
    differences = config_differences(state["config"], config)
    if differences:
        raise ConfigError(
            "resume", f"the config differs from the checkpoint's ({path}) in "
            f"{len(differences)} key(s): " + "; ".join(differences),
            "the checkpoint's config; only trainer.max_epochs may change (grow)")
    done = int(state["epoch"])
    wanted = int(config["trainer"]["max_epochs"])
    if wanted < done:
        raise ConfigError("trainer.max_epochs", f"{wanted} is below the {done} epochs the "
                          f"checkpoint {path} has already trained", f"an integer >= {done}")


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
