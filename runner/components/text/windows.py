"""Windows over a flat token array: the (x, y) pairs every text dataset yields.

`TokenWindows` cuts a 1-D array of token ids (in memory, or a memory-mapped flat token file) into
non-overlapping windows of `block_size` tokens, y being x shifted by one token. `DTYPES` are the
token files' item types, `dtype_for` picks the one a vocabulary needs.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

DTYPES = ("uint16", "uint32")


class TokenWindows(Dataset):
    """Non-overlapping windows of a flat token array: item i is (x, y) with
    x = tokens[i*T : i*T+T] and y = tokens[i*T+1 : i*T+T+1] (int64 tensors of shape (T,)), so
    y[j] is the token after x[j]; there are (len(tokens) - 1) // T items.

    `tokens` is a 1-D integer array (uint16 / uint32) or an `np.memmap` of a flat token file;
    `start`/`stop` select a token range of it (a split: train and val can share one file).
    A file-backed dataset pickles as (path, dtype, byte offset, length) and maps the file again,
    lazily, in the process that unpickles it (DataLoader workers), so a multi-gigabyte corpus is
    never copied; an in-memory one pickles its (small) array.
    """

    def __init__(
        self, tokens: np.ndarray, block_size: int, start: int = 0, stop: Optional[int] = None
    ):
        if not isinstance(tokens, np.memmap):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
            )
        start, stop = _token_range(start, stop, len(tokens))
        self.block_size = _positive_block(block_size)
        self.dtype = tokens.dtype.name
        self.length = stop - start
        path = tokens.filename if isinstance(tokens, np.memmap) else None
        self.path: Optional[str] = str(path) if path else None
        self.offset = _file_offset(tokens) + start * tokens.itemsize if self.path else 0
        self._tokens: Optional[np.ndarray] = tokens[start:stop]

    @property
    def in_memory(self) -> bool:
        """Whether its tokens are an array in memory (not a file's): an item is a slice, a batch
        costs its collation alone, and loader workers have nothing to overlap."""
        return self.path is None

    @classmethod
    def from_file(
        cls, path: str, dtype: str, block_size: int, start: int = 0, stop: Optional[int] = None
    ) -> TokenWindows:
        """Windows over tokens [start, stop) of the flat token file `path` (no header), mapped
        on first access."""
        itemsize = np.dtype(dtype).itemsize
        size = os.path.getsize(path)
        if size % itemsize:
            raise ValueError(f"{path} has {size} bytes, not a multiple of {itemsize} ({dtype})")
        start, stop = _token_range(start, stop, size // itemsize)
        self = cls.__new__(cls)
        self.block_size = _positive_block(block_size)
        self.dtype = np.dtype(dtype).name
        self.length = stop - start
        self.path = os.path.abspath(path)
        self.offset = start * itemsize
        self._tokens = None
        return self

    def tokens(self) -> np.ndarray:
        """This dataset's token range (a memory map for a file-backed one)."""
        if self._tokens is None:
            if self.length == 0:
                self._tokens = np.empty(0, dtype=self.dtype)
            else:
                self._tokens = np.memmap(
                    self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.length,)
                )
        return self._tokens

    def __len__(self) -> int:
        return max(0, (self.length - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        tokens, t = self.tokens(), self.block_size
        begin = index * t
        x = torch.from_numpy(tokens[begin : begin + t].astype(np.int64))
        y = torch.from_numpy(tokens[begin + 1 : begin + t + 1].astype(np.int64))
        return x, y

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path is not None:
            state["_tokens"] = None  # mapped again where it is unpickled
        return state

    def __repr__(self) -> str:
        where = f"{self.path}@{self.offset}" if self.path else "memory"
        return (
            f"TokenWindows({where}, tokens={self.length}, dtype={self.dtype}, "
            f"block_size={self.block_size}, windows={len(self)})"
        )


def _positive_block(block_size: Any) -> int:
    if isinstance(block_size, bool) or int(block_size) != block_size or int(block_size) < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    return int(block_size)


def _token_range(start: int, stop: Optional[int], n: int) -> tuple[int, int]:
    stop = n if stop is None else int(stop)
    start = int(start)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"token range [{start}, {stop}) is not within [0, {n}]")
    return start, stop


def _file_offset(tokens: np.memmap) -> int:
    """The byte offset in its file of a memory map's first element (also for a slice of one:
    numpy keeps the whole map's `offset` on slices)."""
    mm = getattr(tokens, "_mmap", None)
    if mm is None or len(tokens) == 0:
        return int(tokens.offset)
    mapped = np.frombuffer(mm, dtype=np.uint8)  # the mapping starts at an aligned file offset
    aligned = tokens.offset - tokens.offset % mmap.ALLOCATIONGRANULARITY
    inside = tokens.ctypes.data - mapped.ctypes.data
    if tokens.strides != (tokens.itemsize,) or not 0 <= inside < len(mapped):
        raise ValueError("a memory-mapped token array must be a contiguous range of its file")
    return int(aligned + inside)


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"
