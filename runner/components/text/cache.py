"""The token cache of `data=text`: where a tokenised corpus is kept, under which name, and how
it is checked, locked and written.

A corpus is tokenised once into `<cache_dir>/text-<key>.bin` (a flat token file in nanoGPT's
layout) with its sidecar `text-<key>.json` (dtype, token count, vocabulary, tokenizer, files,
SHA-256); `key` digests the files (relative path, size, mtime), the tokenizer's content and
`FORMAT_VERSION`. A cached file is read only when its size and SHA-256 are its sidecar's, and
concurrent first runs take a lock: one tokenises, the others wait and read what it wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Optional

import numpy as np

from runner.components.text import keys
from runner.components.text.stream import sha256_file, tokenise
from runner.components.text.windows import DTYPES
from runner.errors import ConfigError
from runner.files import atomic_path, file_lock, free_space, write_atomic

log = logging.getLogger(__name__)

# Bumped whenever the token stream a corpus gives changes (separator, piece splitting, ...):
# part of the cache key, so an old cache file is never read as the new format.
FORMAT_VERSION = 1
CACHE_ENV = "AMP_RUNNER_TOKEN_CACHE"


def cache_dir(node: Any) -> str:
    """`data.cache_dir`, else $AMP_RUNNER_TOKEN_CACHE, else ~/.cache/amp-runner/tokens."""
    folder = (
        keys.get(node, "cache_dir")
        or os.environ.get(CACHE_ENV)
        or os.path.join("~", ".cache", "amp-runner", "tokens")
    )
    return os.path.abspath(os.path.expanduser(str(folder)))


def cache_key(files: Sequence[tuple[str, int, int]], tokenizer_digest: str) -> str:
    """The digest naming a corpus's cache file: its files (relative path, size, mtime_ns), the
    tokenizer's content digest ("bytes" for bytes) and the format version."""
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "tokenizer": tokenizer_digest,
            "files": [list(f) for f in files],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_meta(meta_path: str) -> Optional[dict]:
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def verify(bin_path: str, meta_path: str, key: str) -> tuple[Optional[dict], Optional[str]]:
    """(sidecar, None) when the cached file is whole: its size is num_tokens * itemsize and its
    SHA-256 is the sidecar's; else (None, why not) -- why is None when there is no cache yet."""
    if not os.path.exists(bin_path) and not os.path.exists(meta_path):
        return None, None
    meta = read_meta(meta_path)
    if meta is None or meta.get("key") != key or meta.get("dtype") not in DTYPES:
        return None, f"its sidecar {meta_path} is missing or unreadable"
    try:
        size = os.path.getsize(bin_path)
    except OSError:
        return None, f"{bin_path} is missing"
    expected = int(meta.get("num_tokens", -1)) * np.dtype(meta["dtype"]).itemsize
    if size != expected:
        return None, f"{bin_path} has {size} bytes, its sidecar says {expected}"
    if sha256_file(bin_path) != meta.get("sha256"):
        return None, f"the SHA-256 of {bin_path} is not its sidecar's"
    return meta, None


def say_not_utf8(meta: dict, root: str) -> None:
    """A warning, at every run that reads these tokens, naming the corpus files a tokenizer read
    with U+FFFD in place of bytes that are not UTF-8 (binary files, another encoding)."""
    bad = meta.get("not_utf8") or []
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        log.warning(
            "%d of the corpus's files under data.path=%s are not UTF-8 (%s): the tokenizer read "
            "their undecodable bytes as U+FFFD. Convert them, or leave them out with data.glob "
            "or data.exclude",
            len(bad),
            root,
            shown,
        )


def locked(path: str) -> AbstractContextManager[None]:
    """An exclusive lock on `path` (a lock file in the cache folder): the first run tokenises, a
    concurrent one waits here and then finds the cache written."""
    return file_lock(
        path,
        on_wait=lambda: log.info(
            "Waiting for another process tokenising into the same cache (%s)", path
        ),
    )


def write_cache(
    files: Sequence[tuple[str, str]],
    stats: Sequence[tuple[str, int, int]],
    tokenizer: Optional[Any],
    tok_path: Optional[str],
    tok_digest: str,
    vocab: int,
    dtype: str,
    key: str,
    root: str,
    bin_path: str,
    meta_path: str,
) -> dict:
    """Tokenise the corpus into `bin_path` (through a temporary file renamed into place), then
    write its sidecar `meta_path`; returns the sidecar."""
    total = sum(size for _, size, _ in stats)
    log.info(
        "Tokenising %d files (%s) with %s into %s (once)",
        len(files),
        f"{total / 1e6:.1f} MB" if total >= 100_000 else f"{total / 1e3:.1f} kB",
        "bytes" if tokenizer is None else f"tokenizer {tok_path}",
        bin_path,
    )
    not_utf8: list[str] = []
    paths = [path for _, path in files]
    try:
        with atomic_path(bin_path) as tmp:
            count, sha = tokenise(paths, tokenizer, dtype, str(tmp), not_utf8)
    except OSError as error:  # (a full disk: the cache's fault, not the corpus's)
        if error.filename is not None and os.fsdecode(error.filename) in paths:
            raise
        raise _unwritable(bin_path, error, total * np.dtype(dtype).itemsize) from error
    names = {path: name for name, path in files}
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "num_tokens": count,
        "vocab_size": vocab,
        "tokenizer": "bytes" if tokenizer is None else {"path": tok_path, "sha256": tok_digest},
        "root": root,
        "files": [list(s) for s in stats],
        "sha256": sha,
        "not_utf8": [names[path] for path in not_utf8],
    }
    # after the .bin: a sidecar always describes its file
    try:
        write_atomic(meta_path, json.dumps(meta, indent=1))
    except OSError as error:
        raise _unwritable(meta_path, error, 0) from error
    return meta


def _unwritable(path: str, error: OSError, most: int) -> ConfigError:
    """A token cache file the file system refused (a full disk, a folder made read-only): the
    file, the cause, the room left and the room a corpus of `most` bytes' tokens can take."""
    room = free_space(os.path.dirname(path))
    free = f"; {room / 2**20:.1f} MB free there" if room is not None else ""
    need = f", the corpus needs up to {most / 2**20:.1f} MB" if most else ""
    return ConfigError(
        "data.cache_dir",
        f"cannot write the token cache {path}: {error.strerror or error}{free}{need}",
        f"a folder with room (or set ${CACHE_ENV})",
    )
