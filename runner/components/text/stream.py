"""A corpus's token stream: its files' UTF-8 bytes, or a tokenizer's ids, written to a flat
token file with bounded memory.

Between documents (files) stands `SEPARATOR`. Bytes are read and written `READ_CHUNK` bytes at
a time; a tokenizer encodes pieces of at most `PIECE_CHARS` characters (a longer document is cut
after a newline), a batch of `BATCH_CHARS` characters at a time.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np

SEPARATOR = "\n\n"  # between documents (files): the text for a tokenizer, its UTF-8 for bytes
READ_CHUNK = 16 * 2**20  # bytes of a file read (and written as tokens) at once, for bytes
# A tokenizer encodes text in pieces of at most this many characters (a document longer than
# that is cut after a newline), a batch of pieces at a time: memory stays bounded on any corpus.
PIECE_CHARS = 4 * 2**20
BATCH_CHARS = 16 * 2**20


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(READ_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pieces(text: str, limit: Optional[int] = None) -> Iterator[str]:
    """`text` in pieces of at most `limit` (`PIECE_CHARS`) characters, each cut after a newline
    where there is one (a tokenizer never sees a word cut in two unless a line is longer)."""
    limit = limit or PIECE_CHARS
    start = 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit)
        cut = start + limit if cut <= start else cut + 1
        yield text[start:cut]
        start = cut
    yield text[start:]


def _bytes_chunks(paths: Sequence[str]) -> Iterator[bytes]:
    sep = SEPARATOR.encode()
    for i, path in enumerate(paths):
        if i:
            yield sep
        with open(path, "rb") as f:
            yield from iter(lambda: f.read(READ_CHUNK), b"")


def _tokenizer_chunks(
    paths: Sequence[str], tokenizer: Any, dtype: str, not_utf8: list[str]
) -> Iterator[np.ndarray]:
    """Token ids of the documents, each followed by the separator (but the last), encoded without
    special tokens, a batch of pieces at a time (tokenizers encodes a batch in parallel). A file
    that is not UTF-8 is read with U+FFFD for its bad bytes and its path added to `not_utf8`."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def encode(pieces: list[str]) -> Iterator[np.ndarray]:
        for encoding in encode_batch(pieces, add_special_tokens=False):
            yield np.asarray(encoding.ids, dtype=dtype)

    batch: list[str] = []
    chars = 0
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            not_utf8.append(path)
        if i < len(paths) - 1:
            text += SEPARATOR
        for piece in pieces(text):
            batch.append(piece)
            chars += len(piece)
            if chars >= BATCH_CHARS:
                yield from encode(batch)
                batch, chars = [], 0
    if batch:
        yield from encode(batch)


def tokenise(
    paths: Sequence[str],
    tokenizer: Optional[Any],
    dtype: str,
    out: str,
    not_utf8: Optional[list[str]] = None,
) -> tuple[int, str]:
    """Write the corpus's token stream to `out`; (number of tokens, SHA-256 of the file). With a
    tokenizer, the files that are not UTF-8 are added to `not_utf8` (bytes need no decoding)."""
    digest, count = hashlib.sha256(), 0
    with open(out, "wb") as f:
        if tokenizer is None:
            chunks: Iterator[np.ndarray] = (
                np.frombuffer(b, dtype=np.uint8).astype(dtype) for b in _bytes_chunks(paths)
            )
        else:
            chunks = _tokenizer_chunks(
                paths, tokenizer, dtype, [] if not_utf8 is None else not_utf8
            )
        for ids in chunks:
            data = ids.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes()
            f.write(data)
            digest.update(data)
            count += len(ids)
        f.flush()
        os.fsync(f.fileno())
    return count, digest.hexdigest()
