"""Checkpoints: everything a run needs to continue exactly where it stopped, written atomically,
read back only when they are intact, hold nothing but data, and fit the run that resumes them.

A run writes `<trainer.checkpoint_dir>/<experiment>/<run name>/<MLflow run id>/last.pt` (relative
to the launch directory, not Hydra's timestamped output folder) after every
`trainer.checkpoint_every_n_epochs` epochs and when it is interrupted. Each run has its own folder,
so a new run never overwrites another's checkpoint, and `resume=auto` takes the most recent one
under the experiment and run name. A file is written to a temporary name (`.last.pt.<pid>.tmp`),
flushed to disk, renamed into place and the folder flushed too, so a crash or a power loss while
writing leaves the previous checkpoint intact; a temporary file left by a process that is gone is
removed at the next save into the same folder.

Contents: the model's state (fp32: the O2 masters' exact values), the optimizer's (its state for
the masters), the precision engine's (every loss scaler), the scheduler's, the position (epoch,
batch within it, global step), the divergence counters, the metric history, the RNG states of
torch, CUDA, Python and NumPy (tensors and plain types), the MLflow run id, the world size and the
resolved config.

File format (FORMAT 2): the `torch.save` archive (a zip file) of that dict, whose zip comment
holds `amp-runner checkpoint format 2 sha256:<hex>`, the SHA-256 of every byte before the
comment. The comment is part of the zip format, so the file is still an ordinary PyTorch file;
the digest sits inside the one file it covers (no sidecar to lose or to get out of step). Open one
in Python with `runner.run.checkpoint.load(path)`: it checks the digest before anything is
unpickled, unpickles with torch's safe unpickler and checks the contents' types.
`torch.load(path, weights_only=True)` reads it as well, without those checks.

What loading checks, in this order (each refusal a ConfigError naming the file, so the CLI exits
2 with the message and no traceback, before any MLflow run is reopened):

1. integrity: the digest matches (a flipped byte, a truncated or foreign file: "checkpoint
   <path> is corrupted"). FORMAT 1 files (amp-runner before the digest) carry none: they load
   with a warning that they cannot be verified.
2. safety: `torch.load(weights_only=True)`, so nothing in the file can run code; a file that
   needs any other class or function is refused, naming it. The digest guards against damage, not
   against a crafted file (anyone can compute a SHA-256): the safe unpickler does that. A FORMAT 1
   file also gets NumPy's array reconstruction allowed by name (its NumPy RNG state was an array),
   and that array is converted to a tensor on loading.
3. contents (`load`): every key known, the trainer's keys present, each value of its type
   (tensors where tensors belong, plain numbers and strings elsewhere), the RNG states accepted by
   fresh generators of their kind, every loss scaler's entry valid.
4. the run (`check_resumable`, `check_structure`): the config is the checkpoint's (but a grown
   `trainer.max_epochs`); the model state has this run's keys, shapes and dtypes; the optimizer
   has this run's number of parameter groups and parameters and is of its kind; the engine has one
   loss scaler per loss of this run (a static scale equal to this run's); the scheduler is of this
   run's kind (or both none); the world size is this run's. Each difference names the key, the
   checkpoint's side and this run's.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import random
import re
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from runner.errors import ConfigError
from runner.precision.scaler import state_dict_problems

log = logging.getLogger(__name__)

FILENAME = "last.pt"
FORMAT = 2  # the digest in the zip comment; RNG states as tensors and plain types
LEGACY_FORMAT = 1  # no digest; NumPy's RNG state as an ndarray
# config keys a resumed run may change: the epoch budget may grow, and these say how to resume
RESUMABLE_CHANGES = ("trainer.max_epochs", "resume")
# keys added to the config after checkpoints were written without them: the value those runs had
# (before the `loss` group, every run trained with a plain cross-entropy)
IMPLIED_BEFORE = {"loss._target_": "torch.nn.CrossEntropyLoss", "loss.label_smoothing": 0.0}

_ALLOWED = "an intact checkpoint written by amp-runner"
_TRAILER_PREFIX = b"amp-runner checkpoint format 2 sha256:"
_TRAILER_SIZE = len(_TRAILER_PREFIX) + 64  # the zip comment: prefix + hex digest
_EOCD_SIGNATURE = b"PK\x05\x06"  # zip's end of central directory record: 22 bytes + comment
_EOCD_SIZE = 22
_CHUNK = 1 << 20
_TMP_PATTERN = re.compile(rf"^\.{re.escape(FILENAME)}\.(\d+)\.tmp$")


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


# ---- writing -----------------------------------------------------------------------------------
def save(path: Path, state: Mapping[str, Any]) -> None:
    """Write `state` (Trainer.state plus the run's keys) to `path` atomically: a temporary file
    in the same folder, with its digest, flushed to disk, renamed over the old one, the folder
    flushed. A state `load` would refuse is never written (TypeError: a bug, not the user's)."""
    full = {"format": FORMAT, **state}
    problems = _content_problems(full)
    if problems:
        raise TypeError("refusing to write a checkpoint that could not be loaded: "
                        + "; ".join(problems))
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w+b") as handle:
            torch.save(full, handle)
            _append_digest(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _append_digest(handle) -> None:
    """Turn the archive `torch.save` just wrote (its zip comment empty) into FORMAT 2: the comment
    length set to the trailer's, the SHA-256 of everything up to there appended as the comment."""
    end = handle.seek(0, os.SEEK_END)
    handle.seek(end - _EOCD_SIZE)
    eocd = handle.read(_EOCD_SIZE)
    if eocd[:4] != _EOCD_SIGNATURE or eocd[-2:] != b"\x00\x00":
        raise RuntimeError("torch.save did not end its file with a zip directory record without "
                           "a comment; cannot add the checkpoint's digest")
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


def _fsync_folder(folder: Path) -> None:
    """Flush the folder's entry list, so the renamed file survives a power loss (where the OS
    and filesystem allow it; some refuse to fsync a folder, or to open one)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_temporaries(folder: Path) -> None:
    """Remove `.last.pt.<pid>.tmp` files of processes that no longer exist (a process killed
    while writing); another live process's (or this one's) stays. Only POSIX can tell: elsewhere
    nothing is removed."""
    if os.name != "posix":
        return
    for entry in folder.iterdir():
        match = _TMP_PATTERN.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _process_exists(pid):
            continue
        entry.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence and permission check only, nothing is sent
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or not a real pid
        return True
    return True


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
                log.warning("Checkpoint %s has no checksum (written by amp-runner before format "
                            "%d): it cannot be verified; it is loaded as it is (the resumed "
                            "run's next checkpoint carries one)", path, FORMAT)
            handle.seek(0)
            state = _unpickle(handle, path, legacy=not verified)
    except OSError as error:
        raise ConfigError("resume", f"cannot read the checkpoint {str(path)!r}: {error}",
                          _ALLOWED) from error
    if not isinstance(state, dict):
        raise ConfigError("resume", f"{str(path)!r} is not an amp-runner checkpoint (it holds "
                          f"a {type(state).__name__}, not a dict)", _ALLOWED)
    found = state.get("format")
    wanted = FORMAT if verified else LEGACY_FORMAT
    if found != wanted:
        what = (f"format {found!r} without the checksum that format carries" if found == FORMAT
                else f"format {found!r}")
        raise ConfigError("resume", f"{str(path)!r} is not an amp-runner checkpoint of a "
                          f"format this version reads: {what}", _ALLOWED)
    if not verified:
        _upgrade_legacy_rng(state)
    problems = _content_problems(state)
    if problems:
        raise ConfigError("resume", f"the checkpoint {path} is malformed: " + "; ".join(problems),
                          _ALLOWED)
    return state


def _verify(handle, size: int, path: Path) -> bool:
    """True: a FORMAT 2 file whose digest matches; False: a complete archive without a comment
    (FORMAT 1, nothing to verify). Anything else is corrupted: ConfigError."""
    def corrupted(why: str) -> ConfigError:
        return ConfigError("resume", f"checkpoint {path} is corrupted: {why}", _ALLOWED)

    tail_size = min(size, _EOCD_SIZE + _TRAILER_SIZE)
    handle.seek(size - tail_size)
    tail = handle.read(tail_size)
    trailer = tail[-_TRAILER_SIZE:]
    if len(tail) == _EOCD_SIZE + _TRAILER_SIZE and trailer.startswith(_TRAILER_PREFIX):
        eocd = tail[:_EOCD_SIZE]
        if eocd[:4] != _EOCD_SIGNATURE or eocd[-2:] != struct.pack("<H", _TRAILER_SIZE):
            raise corrupted("its zip directory record is damaged")
        saved = trailer[len(_TRAILER_PREFIX):].decode("ascii", errors="replace")
        if _sha256(handle, size - _TRAILER_SIZE) != saved:
            raise corrupted("checksum mismatch")
        return True
    eocd = tail[-_EOCD_SIZE:]
    if len(eocd) == _EOCD_SIZE and eocd[:4] == _EOCD_SIGNATURE and eocd[-2:] == b"\x00\x00":
        return False
    raise corrupted("it ends neither in amp-runner's checksum nor in a complete PyTorch archive "
                    "(truncated, or not a checkpoint)")


def _unpickle(handle, path: Path, legacy: bool) -> Any:
    """`torch.load` with the safe unpickler: a refused class or function is named, nothing of it
    runs; any other failure (a damaged archive) is a ConfigError too."""
    allow = _legacy_numpy_globals() if legacy else contextlib.nullcontext()
    try:
        with allow:
            return torch.load(handle, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ConfigError(
            "resume", f"the checkpoint {path} was refused by the safe unpickler: "
            f"{_refused(error)} (a checkpoint holds tensors and plain data only; nothing in the "
            "file was run)", _ALLOWED) from None
    except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged archive)
        raise ConfigError("resume", f"cannot read the checkpoint {str(path)!r}: "
                          f"{type(error).__name__}: {error}", _ALLOWED) from None


def _refused(error: Exception) -> str:
    """What the safe unpickler refused, from torch's message (which also suggests
    weights_only=False: advice not to give for a file from elsewhere)."""
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return f"it tries to load {found.group(1)}"
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    return (found.group(1).strip() if found else text.splitlines()[0] if text
            else type(error).__name__)


def _legacy_numpy_globals() -> contextlib.AbstractContextManager:
    """Exactly what a FORMAT 1 file's NumPy RNG state (a uint32 ndarray) needs, by name."""
    try:
        import numpy
    except ImportError:
        return contextlib.nullcontext()
    reconstruct = numpy.ndarray.__reduce__(numpy.zeros(0))[0]  # numpy(._)core.multiarray's
    allowed: list[Any] = [reconstruct, numpy.ndarray, numpy.dtype,
                          (reconstruct, "numpy.core.multiarray._reconstruct"),
                          (reconstruct, "numpy._core.multiarray._reconstruct")]
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


# ---- contents ----------------------------------------------------------------------------------
# Exact types, not subclasses: a NumPy float is a float subclass that torch.save pickles as
# NumPy's, which the safe unpickler refuses (and bool is an int subclass).
def _is_int(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


def _is_real(value: Any) -> bool:
    return type(value) in (int, float)


def _is_tensor_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.layout == torch.strided
        for k, v in value.items())


def _is_plain(value: Any) -> bool:
    """Config-like data: dicts with str keys, lists, str, numbers, bools, None."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    return False


def _optimizer_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping) or set(value) != {"state", "param_groups"}:
        return ["optimizer: a torch optimizer state dict (state, param_groups) belongs here"]
    groups, state = value["param_groups"], value["state"]
    if not isinstance(groups, list) or not all(
            isinstance(g, Mapping) and all(isinstance(k, str) for k in g)
            and isinstance(g.get("params"), list) and all(_is_int(i) for i in g["params"])
            and all(_is_plain(v) for k, v in g.items() if k != "params") for g in groups):
        return ["optimizer.param_groups: a list of groups of plain hyperparameters and integer "
                "parameter ids belongs here"]
    if not isinstance(state, Mapping):
        return ["optimizer.state: a mapping of parameter ids to their state belongs here"]
    ids = {i for g in groups for i in g["params"]}
    for index, entry in state.items():
        if index not in ids:
            return [f"optimizer.state.{index}: a state for no parameter of param_groups"]
        if not isinstance(entry, Mapping) or not all(
                isinstance(k, str) and (_is_real(v) or isinstance(v, torch.Tensor)
                                        and v.layout == torch.strided)
                for k, v in entry.items()):
            return [f"optimizer.state.{index}: a mapping of names to tensors or numbers belongs "
                    "here"]
    return []


def _engine_problems(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return ["engine: a mapping of loss_scaler<i> entries and skipped_steps belongs here"]
    problems = []
    for key, entry in value.items():
        if key in ("skipped_steps", "rounding_steps"):  # (rounding: stochastic rounding's count)
            if not _is_int(entry):
                problems.append(f"engine.{key}: {entry!r} is not an integer >= 0")
        elif isinstance(key, str) and re.fullmatch(r"loss_scaler(0|[1-9][0-9]*)", key):
            problems += state_dict_problems(entry, f"engine.{key}")
        else:
            problems.append(f"engine.{key}: unknown key (allowed: loss_scaler<i>, skipped_steps, "
                            "rounding_steps)")
    if "loss_scaler0" not in value:
        problems.append("engine.loss_scaler0: missing")
    return problems


def _rng_problems(value: Any) -> list[str]:
    """Each RNG state must be accepted by a fresh generator of its kind (nothing global is set
    here)."""
    if not isinstance(value, Mapping):
        return ["rng: a mapping of RNG states (torch, python, cuda, numpy) belongs here"]
    problems = [f"rng.{k}: unknown key (allowed: torch, python, cuda, numpy)"
                for k in value if k not in ("torch", "python", "cuda", "numpy")]
    for key in ("torch", "python"):
        if key not in value:
            problems.append(f"rng.{key}: missing")
    checks: dict[str, Callable[[Any], None]] = {
        "torch": lambda s: torch.Generator().set_state(_byte_tensor(s)),
        "python": lambda s: random.Random().setstate(s),
        "cuda": lambda s: [_byte_tensor(t) for t in _as_list(s)],
        "numpy": _check_numpy_state,
    }
    for key, check in checks.items():
        if key in value:
            try:
                check(value[key])
            except (TypeError, ValueError, OverflowError, RuntimeError, IndexError) as error:
                problems.append(f"rng.{key}: not a valid state ({error})")
    return problems


def _byte_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError("a 1-D uint8 tensor belongs here")
    return value


def _as_list(value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError("a list belongs here")
    return value


def _content_problems(state: Mapping[str, Any]) -> list[str]:
    """What is wrong with a checkpoint's contents without looking at the run: unknown keys,
    missing trainer keys, values of the wrong type. Each problem names its key."""
    problems = [f"{key}: unknown key" for key in state if key not in _SCHEMA]
    for key, (check, wanted, required) in _SCHEMA.items():
        if key not in state:
            if required:
                problems.append(f"{key}: missing ({wanted})")
            continue
        value = state[key]
        if key == "optimizer":
            problems += _optimizer_problems(value)
        elif key == "engine":
            problems += _engine_problems(value)
        elif key == "rng":
            problems += _rng_problems(value)
        elif not check(value):
            problems.append(f"{key}: {_show(value)} where {wanted} belongs")
    return problems


def _show(value: Any) -> str:
    text = repr(value) if _is_plain(value) else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_history(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, Mapping) and all(isinstance(k, str) and _is_real(v) for k, v in m.items())
        for m in value)


# key: (check, what belongs there, required by `load`); optimizer, engine and rng have their own
# problem finders. The run's keys (mlflow_run_id, config, world_size) are written by the app and
# required by `check_resumable`; a trainer's state alone (Trainer.state) also loads.
_SCHEMA: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "format": (_is_int, "an integer", True),
    "model": (_is_tensor_map, "a mapping of names to tensors", True),
    "optimizer": (lambda v: True, "an optimizer state dict", True),
    "engine": (lambda v: True, "the loss scalers' state", True),
    "scheduler": (lambda v: v is None or isinstance(v, dict) and _is_plain(v),
                  "a scheduler state dict of plain values, or None", True),
    "epoch": (_is_int, "an integer >= 0", True),
    "batch": (_is_int, "an integer >= 0", True),
    "global_step": (_is_int, "an integer >= 0", True),
    "best_val_acc": (_is_real, "a number", True),
    "history": (_is_history, "a list of {metric name: number}", True),
    "elapsed_s": (_is_real, "a number", True),
    "skip_streak": (_is_int, "an integer >= 0", True),
    "bad_loss_streak": (_is_int, "an integer >= 0", True),
    "rng": (lambda v: True, "the RNG states", True),
    "mlflow_run_id": (lambda v: isinstance(v, str) and bool(v), "an MLflow run id", False),
    "config": (lambda v: isinstance(v, dict) and _is_plain(v),
               "the resolved config (a mapping of plain values)", False),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1", False),
}
RUN_KEYS = ("mlflow_run_id", "config", "world_size")


# ---- the run -----------------------------------------------------------------------------------
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
        old, new = a.get(key, IMPLIED_BEFORE.get(key, missing)), b.get(key, missing)
        if old != new:
            show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            out.append(f"{key}: {show(old)} -> {show(new)}")
    return out


def _require_run_keys(state: Mapping[str, Any], path: Path) -> None:
    missing = [key for key in RUN_KEYS if key not in state]
    if missing:
        raise ConfigError("resume", f"the checkpoint {path} lacks the key(s) "
                          f"{', '.join(missing)}, which every run's checkpoint holds", _ALLOWED)


def check_resumable(state: Mapping[str, Any], config: Mapping[str, Any], path: Path) -> None:
    """The current config must be the checkpoint's, but for a grown `trainer.max_epochs`."""
    _require_run_keys(state, path)
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


def check_structure(state: Mapping[str, Any], *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, engine: Any, scheduler: Any,
                    world_size: int, path: Path) -> None:
    """The loaded state (see `load`) must fit the parts this run built: the model's state keys,
    shapes and dtypes, the optimizer's groups, parameters and kind, one loss scaler per loss (a
    static one at this run's scale), the scheduler's kind, the world size. Call it before the
    MLflow run is reopened; ConfigError("resume") lists every difference as
    `key: checkpoint's -> this run's`."""
    _require_run_keys(state, path)
    problems: list[str] = []
    if state["world_size"] != world_size:
        problems.append(f"world_size: {state['world_size']} -> {world_size}")
    problems += _tensor_differences("model", state["model"], model.state_dict())
    problems += _optimizer_differences(state["optimizer"], optimizer)
    problems += _engine_differences(state["engine"], engine)
    problems += _scheduler_differences(state["scheduler"], scheduler)
    if problems:
        shown = problems[:_SHOWN] + ([f"... and {len(problems) - _SHOWN} more"]
                                     if len(problems) > _SHOWN else [])
        raise ConfigError(
            "resume", f"the checkpoint {path} does not fit this run in {len(problems)} key(s) "
            "(the checkpoint's -> this run's): " + "; ".join(shown),
            "a checkpoint of this run's model, optimizer, precision level, scheduler and world "
            "size")


_SHOWN = 8  # differences listed in the message (another architecture has one per tensor)


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _tensor_differences(prefix: str, saved: Mapping[str, torch.Tensor],
                        current: Mapping[str, torch.Tensor]) -> list[str]:
    out = []
    for key in list(saved) + [k for k in current if k not in saved]:
        a, b = saved.get(key), current.get(key)
        if a is None:
            out.append(f"{prefix}.{key}: (absent) -> {_describe(b)}")
        elif b is None:
            out.append(f"{prefix}.{key}: {_describe(a)} -> (absent)")
        elif a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{prefix}.{key}: {_describe(a)} -> {_describe(b)}")
    return out


# Optimizers told apart by the hyperparameters only their kind has, and the per-parameter state
# their kind keeps (the optimizers runner.components.optim builds; others are checked for counts and shapes).
_OPTIMIZER_KINDS: dict[str, tuple[tuple[type, ...], frozenset, frozenset]] = {
    "SGD": ((torch.optim.SGD,), frozenset({"momentum", "dampening", "nesterov"}),
            frozenset({"momentum_buffer"})),
    "Adam/AdamW": ((torch.optim.Adam, torch.optim.AdamW), frozenset({"betas", "eps", "amsgrad"}),
                   frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})),
}


_KIND_KEYS = frozenset().union(*(keys for _, keys, _ in _OPTIMIZER_KINDS.values()))


def _group_kind(group: Mapping[str, Any]) -> Optional[str]:
    for name, (_, keys, _) in _OPTIMIZER_KINDS.items():
        if keys <= set(group):
            return name
    return None


def _optimizer_differences(saved: Mapping[str, Any],
                           optimizer: torch.optim.Optimizer) -> list[str]:
    current = optimizer.param_groups
    groups = saved["param_groups"]
    if len(groups) != len(current):
        return [f"optimizer.param_groups: {len(groups)} group(s) -> {len(current)}"]
    kind = next((name for name, (classes, _, _) in _OPTIMIZER_KINDS.items()
                 if isinstance(optimizer, classes)), None)
    out = []
    shapes: dict[int, torch.Size] = {}
    for g, (a, b) in enumerate(zip(groups, current)):
        if len(a["params"]) != len(b["params"]):
            out.append(f"optimizer.param_groups.{g}.params: {len(a['params'])} parameter(s) "
                       f"-> {len(b['params'])}")
            continue
        shapes.update((index, p.shape) for index, p in zip(a["params"], b["params"]))
        saved_kind = _group_kind(a)
        if kind is not None and saved_kind != kind:
            names = ", ".join(sorted(set(a) & _KIND_KEYS) or ["none of theirs"])
            out.append(f"optimizer.param_groups.{g}: the hyperparameters of "
                       f"{saved_kind or 'another optimizer'} ({names}) -> "
                       f"{type(optimizer).__name__}'s "
                       f"({', '.join(sorted(_OPTIMIZER_KINDS[kind][1]))})")
    if out:
        return out
    allowed = _OPTIMIZER_KINDS[kind][2] if kind is not None else None
    for index, entry in saved["state"].items():
        if allowed is not None and not set(entry) <= allowed:
            out.append(f"optimizer.state.{index}: {', '.join(sorted(entry))} -> "
                       f"{type(optimizer).__name__}'s {', '.join(sorted(allowed))}")
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape != shapes[index]:
                out.append(f"optimizer.state.{index}.{name}: {list(value.shape)} -> "
                           f"{list(shapes[index])} (the parameter's shape)")
    return out


def _engine_differences(saved: Mapping[str, Any], engine: Any) -> list[str]:
    scalers = engine.scalers
    wanted = [f"loss_scaler{i}" for i in range(len(scalers))]
    have = sorted((k for k in saved if k.startswith("loss_scaler")),
                  key=lambda k: int(k[len("loss_scaler"):]))
    if have != wanted:
        return [f"engine: {len(have)} loss scaler(s) ({', '.join(have)}) -> {len(wanted)} "
                f"({', '.join(wanted)})"]
    out = []
    rounding = "rounding_steps" in engine.state_dict()
    if ("rounding_steps" in saved) != rounding:
        out.append(f"engine.rounding_steps: {'present' if 'rounding_steps' in saved else 'absent'}"
                   f" -> {'present' if rounding else 'absent'} (stochastic rounding "
                   f"{'on' if rounding else 'off'} in this run)")
    for key, scaler in zip(wanted, scalers):
        scale = saved[key]["loss_scale"]
        if not scaler.dynamic and scale != scaler.scale:
            out.append(f"engine.{key}.loss_scale: {scale!r} -> {scaler.scale!r} (this run's "
                       "static scale)")
    return out


def _scheduler_differences(saved: Optional[Mapping[str, Any]], scheduler: Any) -> list[str]:
    """The kind, told by the public keys of its state (its constructor's settings, base_lrs,
    last_epoch); private bookkeeping keys vary with the torch version and are not compared."""
    if saved is None or scheduler is None:
        if (saved is None) != (scheduler is None):
            return [f"scheduler: {'(none)' if saved is None else 'a scheduler'} -> "
                    f"{'(none)' if scheduler is None else type(scheduler).__name__}"]
        return []
    current = scheduler.state_dict()
    public = lambda keys: {k for k in keys if not k.startswith("_") and k != "verbose"}  # noqa
    a, b = public(saved), public(current)
    if a != b:
        return [f"scheduler: the state of another scheduler ({', '.join(sorted(a))}) -> "
                f"{type(scheduler).__name__} ({', '.join(sorted(b))})"]
    return [f"scheduler.{k}: {_show(saved[k])} -> {_show(current[k])}" for k in sorted(a)
            if _kind(saved[k]) != _kind(current[k])]


def _kind(value: Any) -> Any:
    """A value's shape for comparing scheduler states: number, bool, str, None, or a list's length
    with its items' kinds."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    if _is_real(value):
        return "number"
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_kind(v) for v in value))
    return type(value).__name__


# ---- RNG ---------------------------------------------------------------------------------------
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

        numpy.random.set_state(_numpy_legacy(state["numpy"]))


def _numpy_portable(legacy: tuple) -> dict[str, Any]:
    """NumPy's `get_state()` tuple (its key an ndarray) as a tensor and plain types."""
    kind, key, pos, has_gauss, cached_gaussian = legacy
    return {"kind": str(kind), "key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def _numpy_legacy(portable: Mapping[str, Any]) -> tuple:
    import numpy

    key = portable["key"]
    if not isinstance(key, torch.Tensor) or key.dim() != 1 or key.is_floating_point():
        raise TypeError("key: a 1-D integer tensor belongs here")
    return (portable["kind"], key.numpy().astype(numpy.uint32), int(portable["pos"]),
            int(portable["has_gauss"]), float(portable["cached_gaussian"]))


def _check_numpy_state(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != {"kind", "key", "pos", "has_gauss",
                                                        "cached_gaussian"}:
        raise TypeError("a mapping of kind, key, pos, has_gauss, cached_gaussian belongs here")
    if not (isinstance(value["kind"], str) and _is_int(value["pos"])
            and _is_int(value["has_gauss"]) and _is_real(value["cached_gaussian"])):
        raise TypeError("kind a str, pos and has_gauss integers, cached_gaussian a number")
    key = value["key"]
    if isinstance(key, torch.Tensor) and not key.is_floating_point() and key.numel() and (
            int(key.min()) < 0 or int(key.max()) >= 2 ** 32):
        raise ValueError("key: values outside 0 .. 2**32 - 1")
    try:
        import numpy
    except ImportError:
        return
    numpy.random.RandomState().set_state(_numpy_legacy(value))


def _upgrade_legacy_rng(state: dict[str, Any]) -> None:
    """A FORMAT 1 file's NumPy RNG state (the `get_state()` tuple, its key an ndarray) in
    FORMAT 2's form; anything else there is left for the content check to refuse."""
    rng = state.get("rng")
    if not isinstance(rng, dict) or "numpy" not in rng:
        return
    legacy = rng["numpy"]
    try:
        import numpy

        if isinstance(legacy, tuple) and len(legacy) == 5 and isinstance(legacy[1],
                                                                         numpy.ndarray):
            rng["numpy"] = _numpy_portable(legacy)
    except (ImportError, TypeError, ValueError):
        pass
