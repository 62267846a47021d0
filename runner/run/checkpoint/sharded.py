"""Sharded checkpoints of FSDP2 runs, through `torch.distributed.checkpoint` (DCP).

Layout, beside where an unsharded run keeps `last.pt`:

    <run folder>/<run id>/last.dcp/
        __0_0.distcp, __1_0.distcp, ...   each rank's shards of the model and optimizer state
        .metadata                         DCP's index of them (which rank's file holds what)
        trainer.pt                        everything else, in the ordinary checkpoint format
                                          (digested, read with the safe unpickler), with the
                                          SHA-256 of every file above under `sharded.files`

Writing (`save`, a collective: every rank calls it): every rank writes its shards into a fresh
`.last.dcp.tmp/`; rank 0 then hashes every file, writes `trainer.pt` there, and swaps the folder
into place (the previous `last.dcp` moved aside, the new one renamed in, the old one removed), so a
crash at any moment leaves a finished checkpoint or the previous one, never a mix: `find` takes
`last.dcp` where it is whole, else the one moved aside (`folders.find`).

Reading: `trainer.pt` is loaded and checked as any checkpoint (`format.load`), then `verify` checks
every file it lists, before anything of them is read (a missing, extra or altered shard is refused
naming the file). DCP's `.metadata` is a pickle: it is read with an unpickler that admits only
DCP's own metadata classes, torch's dtypes and sizes, so nothing in it can run code (a digest is
no defence against a crafted file: anyone can compute one). DCP's planner would unpickle the
non-tensor items (the optimizer's hyperparameters) with `weights_only=False`; here they go through
`torch.load(weights_only=True)`. The shards load into this run's own sharding, whatever the world
size that wrote them (DCP reshards); a checkpoint of another model is refused by comparing the
index's parameter shapes with this run's.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runner.errors import ConfigError
from runner.files import fsync_folder
from runner.run.checkpoint import format as fmt
from runner.run.checkpoint.contents import ALLOWED
from runner.run.checkpoint.folders import SHARDED_FOLDER as FOLDER
from runner.run.checkpoint.folders import SHARDED_OLD as _OLD
from runner.run.checkpoint.folders import SHARDED_TRAINER as TRAINER

_TMP = ".last.dcp.tmp"
EMPTY_OPTIMIZER = {"state": {}, "param_groups": []}  # trainer.pt's: the shards hold the real one


# ---- writing ---------------------------------------------------------------------------------
def _digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return fmt._sha256(handle, os.fstat(handle.fileno()).st_size)


def save(
    folder: Path,
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: Any,
) -> Path:
    """Write the sharded checkpoint of `model` and `optimizer` (their shards, from every rank)
    and `state` (the trainer's and the run's keys; rank 0's) as `<folder>/last.dcp`, atomically.
    A collective: every rank calls it with the same `folder`. Returns `trainer.pt`'s path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final, tmp, old = folder / FOLDER, folder / _TMP, folder / _OLD
    if comm.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier left it
        tmp.mkdir(parents=True)
    comm.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
    )
    comm.barrier()
    if comm.is_main:
        files = {p.name: _digest(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        fmt.save(
            tmp / TRAINER,
            {
                **state,
                "model": {},
                "optimizer": EMPTY_OPTIMIZER,
                "sharded": {"files": files, "world_size": comm.world_size},
            },
        )
        fsync_folder(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_folder(folder)
        shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    return final / TRAINER


# ---- reading ---------------------------------------------------------------------------------
def verify(path: Path, files: Mapping[str, str]) -> None:
    """Every file `trainer.pt` (at `path`) lists is there, whole, and nothing else is: else a
    ConfigError naming the file, before any of them is read."""
    folder = path.parent

    def corrupted(why: str) -> ConfigError:
        return ConfigError(
            "resume", f"the sharded checkpoint {folder} is corrupted: {why}", ALLOWED
        )

    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != TRAINER}
    listed = set(files)
    if listed - present:
        raise corrupted(f"missing {', '.join(sorted(listed - present))}")
    if present - listed:
        raise corrupted(f"files it does not list: {', '.join(sorted(present - listed))}")
    for name, digest in sorted(files.items()):
        if _digest(folder / name) != digest:
            raise corrupted(f"{name}: checksum mismatch")


# the classes DCP's metadata pickle is made of (torch 2.4 - 2.14), and nothing else
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's index")


def read_metadata(folder: Path) -> Any:
    """DCP's `.metadata`, read so that nothing in it can run code."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as handle:
            return _MetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
        raise ConfigError(
            "resume",
            f"the sharded checkpoint {folder} was refused: its index "
            f"(.metadata) {error} (nothing in it was run)",
            ALLOWED,
        ) from None


def _reader(folder: Path) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner with the non-tensor items (hyperparameters, step counts) read by
        the safe unpickler, where DCP's own reads them with `weights_only=False`."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as error:
                raise ConfigError(
                    "resume",
                    f"an item of the sharded checkpoint "
                    f"({read_item.dest_index.fqn}) was refused by the safe "
                    f"unpickler: {str(error).splitlines()[0]} (nothing in it was "
                    "run)",
                    ALLOWED,
                ) from None
            if self.flatten_state_dict:
                set_element(
                    self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
                )
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner()


def shape_differences(folder: Path, model: torch.nn.Module) -> list[str]:
    """`model.<key>: checkpoint's -> this run's` for every parameter or buffer whose global shape
    differs from the checkpoint index's, or that one side lacks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_metadata(folder).state_dict_metadata
    saved = {
        key[len("model.") :]: list(meta.size)
        for key, meta in index.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    current = {
        key: list(value.shape)
        for key, value in model.state_dict().items()
        if isinstance(value, torch.Tensor)
    }
    out = []
    for key in list(saved) + [k for k in current if k not in saved]:
        a, b = saved.get(key), current.get(key)
        if a != b:
            out.append(
                f"model.{key}: {a if a is not None else '(absent)'} -> "
                f"{b if b is not None else '(absent)'}"
            )
    return out


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The shards of the checkpoint whose `trainer.pt` is `path` into this run's model and
    optimizer (their own sharding, whatever world size wrote them). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(path).parent
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, storage_reader=_reader(folder), planner=_planner())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
