"""`data=tokens`: flat token files tokenised elsewhere (nanoGPT's train.bin / val.bin),
memory-mapped as they are."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import numpy as np

from runner.components.data import LANGUAGE_MODEL, DataBundle, say_if_one_split
from runner.components.text import keys
from runner.components.text.stream import READ_CHUNK
from runner.components.text.windows import DTYPES, TokenWindows
from runner.errors import ConfigError

log = logging.getLogger(__name__)
# A largest id this rare (at most this share of the tokens, or RARE_COUNT of them) and over twice
# the next largest + 1 makes a vocabulary found from the files suspect (a corrupted token)
RARE_SHARE, RARE_COUNT = 1e-4, 10
# The head of each file read at plan time to tell a file of the other dtype (tokens), and the
# least of it that makes the tell certain; no tokenizer's vocabulary reaches 2**24 ids
SNIFF_TOKENS, SNIFF_LEAST, HUGE_ID = 1 << 16, 256, 1 << 24


def _tokens_dtype(node: Any) -> str:
    dtype = keys.get(node, "dtype", "uint16")
    if dtype not in DTYPES:
        raise ConfigError("data.dtype", f"is {dtype!r}", DTYPES)
    return str(dtype)


def check_tokens(node: Any) -> None:
    """Plan-time checks of `data=tokens`: the dtype is known, both files exist, are not empty,
    hold whole tokens (size a multiple of the item size) and at least one window each."""
    dtype = _tokens_dtype(node)
    block_size = keys.block_size(node)
    vocab = keys.get(node, "vocab_size")
    if vocab is not None:
        keys.int_key(node, "vocab_size", None, 1)
    itemsize = np.dtype(dtype).itemsize
    for key in ("train", "val"):
        path = keys.path(node, key, f"the path of a flat {dtype} token file")
        try:
            size = os.path.getsize(path)
        except OSError:
            raise ConfigError(
                f"data.{key}", f"{path} does not exist", f"the path of a flat {dtype} token file"
            ) from None
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(f"data.{key}", f"{path} is not a readable file")
        if size == 0:
            raise ConfigError(f"data.{key}", f"{path} is empty", "a file with tokens in it")
        if size % itemsize:
            raise ConfigError(
                f"data.{key}",
                f"{path} has {size} bytes, not a multiple of "
                f"{itemsize} (data.dtype={dtype}): it is truncated or corrupted, "
                "or data.dtype is wrong",
                f"a flat {dtype} token file",
            )
        if size // itemsize < block_size + 1:
            raise ConfigError(
                "data.block_size",
                f"is {block_size} but data.{key}={path} holds "
                f"only {size // itemsize} tokens (a window needs block_size + 1)",
                f"an integer <= {size // itemsize - 1}",
            )
        _check_width(key, path, dtype, vocab)


def _check_width(key: str, path: str, dtype: str, vocab: Optional[int]) -> None:
    """Refuse a file whose head reads as tokens of the other width: 4-byte ids read as uint16
    leave every second token 0 (the high halves); 2-byte ids read as uint32 pair two tokens into
    ids of millions, a vocabulary (embedding and output rows) no tokenizer has, which ran out of
    memory in the first step (598 GiB of logits) rather than saying what was wrong."""
    head = np.fromfile(path, dtype=dtype, count=SNIFF_TOKENS)
    if len(head) < SNIFF_LEAST:
        return
    if dtype == "uint16" and not head[1::2].any() and head[0::2].any():
        raise ConfigError(
            f"data.{key}",
            f"{path} read as uint16 has 0 for every second token of its first {len(head)}: "
            "it holds 4-byte (uint32) ids",
            "files of data.dtype's width: data.dtype=uint32 if both files are uint32, "
            "else write this one as uint16",
        )
    top = int(head.max())
    if dtype == "uint32" and top >= HUGE_ID and (vocab is None or vocab <= top):
        halves = head.view(np.uint16)
        raise ConfigError(
            f"data.{key}",
            f"{path} read as uint32 holds token id {top} (a vocabulary of {top + 1:,}, which no "
            f"tokenizer has); read as uint16 its largest id is {int(halves.max())}: it holds "
            "2-byte (uint16) ids",
            "files of data.dtype's width: data.dtype=uint16 if both files are uint16, "
            "else write this one as uint32",
        )


def tokens_vocab_size(node: Any) -> Optional[int]:
    """The declared vocabulary of `data=tokens` (None: found from the files when built)."""
    vocab = keys.get(node, "vocab_size")
    return None if vocab is None else int(vocab)


def _max_id(tokens: np.ndarray) -> int:
    step = READ_CHUNK // tokens.itemsize
    return max(int(tokens[i : i + step].max()) for i in range(0, len(tokens), step))


def _below(tokens: np.ndarray, top: int) -> tuple[int, int]:
    """(how many tokens are `top`, the largest id below it; -1: none)."""
    step = READ_CHUNK // tokens.itemsize
    count, below = 0, -1
    for i in range(0, len(tokens), step):
        chunk = tokens[i : i + step]
        count += int(np.count_nonzero(chunk == top))
        rest = chunk[chunk < top]
        if rest.size:
            below = max(below, int(rest.max()))
    return count, below


def _say_if_suspect(splits: dict, top: int) -> None:
    """A warning where the vocabulary found from the files (the largest id + 1) rests on a few
    tokens far above all the others: a corrupted token, or a file of another dtype, would give
    the model's embedding and output layers that many rows, silently."""
    counts = {key: _below(ds.tokens(), top) for key, ds in splits.items()}
    count = sum(c for c, _ in counts.values())
    below = max(b for _, b in counts.values())
    total = sum(len(ds.tokens()) for ds in splits.values())
    if count <= max(RARE_COUNT, RARE_SHARE * total) and top + 1 > 2 * (below + 1):
        where = ", ".join(
            f"{n} in data.{key}={splits[key].path}" for key, (n, _) in counts.items() if n
        )
        log.warning(
            "data.vocab_size=null makes the vocabulary %d (the largest token id + 1), but id %d "
            "appears only %d time(s) (%s) and the next largest id is %d: a corrupted token, or a "
            "file of another data.dtype? The model gets %d embedding rows where %d would hold "
            "every other id. Fix the file, or set data.vocab_size to the tokenizer's own",
            top + 1,
            top,
            count,
            where,
            below,
            top + 1,
            below + 1,
        )


def build_tokens(cfg: Any) -> DataBundle:
    """`data=tokens`: already tokenised flat files (`data.train`, `data.val`, nanoGPT's layout),
    memory-mapped; the vocabulary is `data.vocab_size`, or the largest id in the files + 1."""
    check_tokens(cfg)
    dtype = _tokens_dtype(cfg)
    block_size = keys.block_size(cfg)
    splits = {
        key: TokenWindows.from_file(keys.path(cfg, key, ""), dtype, block_size)
        for key in ("train", "val")
    }
    say_if_one_split(*((f"data.{key}", keys.path(cfg, key, "")) for key in ("train", "val")))
    largest = {key: _max_id(ds.tokens()) for key, ds in splits.items()}
    top_key = max(largest, key=largest.get)
    top = largest[top_key]
    declared = tokens_vocab_size(cfg)
    if declared is not None and declared <= top:
        raise ConfigError(
            "data.vocab_size",
            f"is {declared} but data.{top_key}="
            f"{splits[top_key].path} holds token id {top} (the largest id found)",
            f"an integer >= {top + 1}, or null (= {top + 1})",
        )
    if declared is None:
        _say_if_suspect(splits, top)
    vocab = declared if declared is not None else top + 1
    return DataBundle(
        splits["train"],
        splits["val"],
        vocab,
        block_size,
        str(keys.get(cfg, "name", "tokens")),
        task=LANGUAGE_MODEL,
        block_size=block_size,
    )
