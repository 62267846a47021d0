"""The random generators a training step draws from (torch, CUDA, Python, NumPy): their state
as tensors and plain types, which a checkpoint holds and the safe unpickler reads back."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from, as tensors and plain types (what the
    safe unpickler reads back)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = _numpy_portable(numpy.random.get_state())
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

        numpy.random.set_state(numpy_legacy(state["numpy"]))


def _numpy_portable(legacy: tuple) -> dict[str, Any]:
    """NumPy's `get_state()` tuple (its key an ndarray) as a tensor and plain types."""
    kind, key, pos, has_gauss, cached_gaussian = legacy
    return {
        "kind": str(kind),
        "key": torch.from_numpy(key.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def numpy_legacy(portable: Mapping[str, Any]) -> tuple:
    import numpy

    key = portable["key"]
    if not isinstance(key, torch.Tensor) or key.dim() != 1 or key.is_floating_point():
        raise TypeError("key: a 1-D integer tensor belongs here")
    return (
        portable["kind"],
        key.numpy().astype(numpy.uint32),
        int(portable["pos"]),
        int(portable["has_gauss"]),
        float(portable["cached_gaussian"]),
    )


def upgrade_legacy_rng(state: dict[str, Any]) -> None:
    """A FORMAT 1 file's NumPy RNG state (the `get_state()` tuple, its key an ndarray) in
    FORMAT 2's form; anything else there is left for the content check to refuse."""
    rng = state.get("rng")
    if not isinstance(rng, dict) or "numpy" not in rng:
        return
    legacy = rng["numpy"]
    try:
        import numpy

        if isinstance(legacy, tuple) and len(legacy) == 5 and isinstance(legacy[1], numpy.ndarray):
            rng["numpy"] = _numpy_portable(legacy)
    except (ImportError, TypeError, ValueError):
        pass
