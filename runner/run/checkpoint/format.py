"""The checkpoint file: written atomically with its digest, read only when intact and safe.

See `runner.run.checkpoint` for the format (FORMAT 2: the `torch.save` zip archive whose zip
comment holds the SHA-256 of every byte before it) and the order of the checks on loading.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pickle
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from runner.errors import CheckpointUnwritable, ConfigError, chain
from runner.files import atomic_write, free_space, remove_stale_temporaries
from runner.run.checkpoint.contents import ALLOWED, content_problems
from runner.run.rng import upgrade_legacy_rng

log = logging.getLogger(__name__)

FORMAT = 2  # the digest in the zip comment; RNG states as tensors and plain types
LEGACY_FORMAT = 1  # no digest; NumPy's RNG state as an ndarray

_TRAILER_PREFIX = b"amp-runner checkpoint format 2 sha256:"
_TRAILER_SIZE = len(_TRAILER_PREFIX) + 64  # the zip comment: prefix + hex digest
_EOCD_SIGNATURE = b"PK\x05\x06"  # zip's end of central directory record: 22 bytes + comment
_EOCD_SIZE = 22
_CHUNK = 1 << 20


# ---- writing -----------------------------------------------------------------------------------
def save(path: Path, state: Mapping[str, Any]) -> None:
    """Write `state` (Trainer.state plus the run's keys) to `path` atomically: a temporary file
    in the same folder, with its digest, flushed to disk, renamed over the old one, the folder
    flushed. A state `load` would refuse is never written (TypeError: a bug, not the user's)."""
    full = {"format": FORMAT, **state}
    problems = content_problems(full)
    if problems:
        raise TypeError(
            "refusing to write a checkpoint that could not be loaded: " + "; ".join(problems)
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    with atomic_write(path, "w+b") as handle:
        torch.save(full, handle)
        _append_digest(handle)


def unwritable(path: Path, error: BaseException) -> Optional[CheckpointUnwritable]:
    """What a checkpoint write that failed with `error` (`save`, or a sharded one into `path`'s
    folder) is, where the cause is the file system's (an OSError, raised or under torch.save's
    RuntimeError: "unexpected pos"): the file, the cause, the room left on its disk, and whether
    an earlier checkpoint is kept (the write is atomic: a failed one leaves the last one whole).
    None for any other error (a bug: its traceback). The run stops: training on without
    checkpoints would lose more the next time the process dies."""
    cause = next((link for link in chain(error) if isinstance(link, OSError)), None)
    if cause is None:
        return None
    path = Path(path)
    room = free_space(path.parent)
    free = f" ({room / 2**20:.1f} MB free there)" if room is not None else ""
    full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = "free some space" if full else "fix that"
    kept = (
        f"the checkpoint written before is kept there: {fix}, then resume=auto continues from it"
        if path.exists()
        else f"no checkpoint of this run was written before: {fix}, or set "
        "trainer.checkpoint_dir to a folder "
        + ("on a disk with room" if full else "you can write")
        + ", and run it again"
    )
    return CheckpointUnwritable(
        f"Cannot write the checkpoint {path}: {cause.strerror or cause}{free}. The run stops "
        f"here; {kept}"
    )


def _append_digest(handle) -> None:
    """Turn the archive `torch.save` just wrote (its zip comment empty) into FORMAT 2: the comment
    length set to the trailer's, the SHA-256 of everything up to there appended as the comment."""
    end = handle.seek(0, os.SEEK_END)
    handle.seek(end - _EOCD_SIZE)
    eocd = handle.read(_EOCD_SIZE)
    if eocd[:4] != _EOCD_SIGNATURE or eocd[-2:] != b"\x00\x00":
        raise RuntimeError(
            "torch.save did not end its file with a zip directory record without "
            "a comment; cannot add the checkpoint's digest"
        )
    handle.seek(end - 2)
    handle.write(struct.pack("<H", _TRAILER_SIZE))
    digest = _sha256(handle, end)
    handle.seek(end)
    handle.write(_TRAILER_PREFIX + digest.encode("ascii"))


def _sha256(handle, size: int) -> str:
    """SHA-256 (hex) of the first `size` bytes of `handle`, read in chunks."""
    handle.seek(0)
    digest = hashlib.sha256()
    left = size
    while left > 0:
        chunk = handle.read(min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


# ---- reading -----------------------------------------------------------------------------------
def load(path: Path) -> dict[str, Any]:
    """The state `save` wrote (tensors on the CPU; they move where they are loaded), after the
    integrity, safety and content checks of the module docstring (ConfigError naming the file).
    A FORMAT 1 file loads with a warning that it cannot be verified."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            verified = _verify(handle, size, path)
            if not verified:
                log.warning(
                    "Checkpoint %s has no checksum (written by amp-runner before format "
                    "%d): it cannot be verified; it is loaded as it is (the resumed "
                    "run's next checkpoint carries one)",
                    path,
                    FORMAT,
                )
            handle.seek(0)
            state = _unpickle(handle, path, legacy=not verified)
    except OSError as error:
        raise ConfigError(
            "resume", f"cannot read the checkpoint {str(path)!r}: {error}", ALLOWED
        ) from error
    if not isinstance(state, dict):
        raise ConfigError(
            "resume",
            f"{str(path)!r} is not an amp-runner checkpoint (it holds "
            f"a {type(state).__name__}, not a dict)",
            ALLOWED,
        )
    found = state.get("format")
    wanted = FORMAT if verified else LEGACY_FORMAT
    if found != wanted:
        what = (
            f"format {found!r} without the checksum that format carries"
            if found == FORMAT
            else f"format {found!r}"
        )
        raise ConfigError(
            "resume",
            f"{str(path)!r} is not an amp-runner checkpoint of a format this version reads: {what}",
            ALLOWED,
        )
    if not verified:
        upgrade_legacy_rng(state)
    problems = content_problems(state)
    if problems:
        raise ConfigError(
            "resume", f"the checkpoint {path} is malformed: " + "; ".join(problems), ALLOWED
        )
    return state


def _verify(handle, size: int, path: Path) -> bool:
    """True: a FORMAT 2 file whose digest matches; False: a complete archive without a comment
    (FORMAT 1, nothing to verify). Anything else is corrupted: ConfigError."""

    def corrupted(why: str) -> ConfigError:
        return ConfigError("resume", f"checkpoint {path} is corrupted: {why}", ALLOWED)

    tail_size = min(size, _EOCD_SIZE + _TRAILER_SIZE)
    handle.seek(size - tail_size)
    tail = handle.read(tail_size)
    trailer = tail[-_TRAILER_SIZE:]
    if len(tail) == _EOCD_SIZE + _TRAILER_SIZE and trailer.startswith(_TRAILER_PREFIX):
        eocd = tail[:_EOCD_SIZE]
        if eocd[:4] != _EOCD_SIGNATURE or eocd[-2:] != struct.pack("<H", _TRAILER_SIZE):
            raise corrupted("its zip directory record is damaged")
        saved = trailer[len(_TRAILER_PREFIX) :].decode("ascii", errors="replace")
        if _sha256(handle, size - _TRAILER_SIZE) != saved:
            raise corrupted("checksum mismatch")
        return True
    eocd = tail[-_EOCD_SIZE:]
    if len(eocd) == _EOCD_SIZE and eocd[:4] == _EOCD_SIGNATURE and eocd[-2:] == b"\x00\x00":
        return False
    raise corrupted(
        "it ends neither in amp-runner's checksum nor in a complete PyTorch archive "
        "(truncated, or not a checkpoint)"
    )


def _unpickle(handle, path: Path, legacy: bool) -> Any:
    """`torch.load` with the safe unpickler: a refused class or function is named, nothing of it
    runs; any other failure (a damaged archive) is a ConfigError too."""
    allow = _legacy_numpy_globals() if legacy else contextlib.nullcontext()
    start = handle.tell()
    try:
        try:
            with allow:
                return torch.load(handle, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            if not _registers_low_bit_state(error):
                raise
            handle.seek(start)  # torchao's optimizer-state classes are registered now: again
            with allow:
                return torch.load(handle, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ConfigError(
            "resume",
            f"the checkpoint {path} was refused by the safe unpickler: "
            f"{_refused(error)} (a checkpoint holds tensors and plain data only; nothing in the "
            "file was run)",
            ALLOWED,
        ) from None
    except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged archive)
        raise ConfigError(
            "resume",
            f"cannot read the checkpoint {str(path)!r}: {type(error).__name__}: {error}",
            ALLOWED,
        ) from None


# torchao's quantised optimizer state (precision.optimizer_state=int8/int4/fp8): tensor subclasses
# that torchao registers with torch's safe unpickler itself (add_safe_globals), when imported
_LOW_BIT_STATE_MODULE = re.compile(r"GLOBAL torchao\.optim\.subclass_(8bit|4bit|fp8)\.OptimState")


def _registers_low_bit_state(error: Exception) -> bool:
    """Whether the unpickler refused one of torchao's optimizer-state classes only because
    torchao was not imported yet, and importing it registered them (so a retry reads them)."""
    if not _LOW_BIT_STATE_MODULE.search(str(error)):
        return False
    try:
        import torchao.optim  # noqa: F401  (registers OptimState8bit/4bit/Fp8 as safe)
    except ImportError:
        return False
    return True


def _refused(error: Exception) -> str:
    """What the safe unpickler refused, from torch's message (which also suggests
    weights_only=False: advice not to give for a file from elsewhere)."""
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return f"it tries to load {found.group(1)}"
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    return (
        found.group(1).strip() if found else text.splitlines()[0] if text else type(error).__name__
    )


def _legacy_numpy_globals() -> contextlib.AbstractContextManager:
    """Exactly what a FORMAT 1 file's NumPy RNG state (a uint32 ndarray) needs, by name."""
    try:
        import numpy
    except ImportError:
        return contextlib.nullcontext()
    reconstruct = numpy.ndarray.__reduce__(numpy.zeros(0))[0]  # numpy(._)core.multiarray's
    allowed: list[Any] = [
        reconstruct,
        numpy.ndarray,
        numpy.dtype,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
    ]
    dtype_class = getattr(getattr(numpy, "dtypes", None), "UInt32DType", None)
    if dtype_class is not None:
        allowed.append(dtype_class)
    scoped = getattr(torch.serialization, "safe_globals", None)
    return scoped(allowed) if scoped is not None else _added_safe_globals(allowed)


@contextlib.contextmanager
def _added_safe_globals(allowed: list) -> Iterator[None]:
    """torch 2.4 has no `safe_globals` context manager: add, then restore the previous list."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
