"""Text datasets for next-token prediction: a `data` config section in, a `DataBundle` out.

Three sources, all yielding (x, y) pairs of `block_size` int64 token ids with y = x shifted by one
token (`TokenWindows`):

* `data=text`: a text file or a folder of them, tokenised once (UTF-8 bytes, or a Hugging Face
  `tokenizer.json`) into a cached flat token file in nanoGPT's layout, the tail held out as
  validation. Later runs memory-map the cached file after checking it against its sidecar.
* `data=tokens`: flat token files tokenised elsewhere (nanoGPT's train.bin / val.bin).
* `data=synthetic_text`: a seeded order-2 Markov language generated in memory, with a known
  entropy rate (the loss floor), for tests and benchmarks that must not touch the disk.

The `check_*` functions run at plan time (cheap: no tokenising, nothing read beyond sizes and a
tokenizer's JSON) and raise `ConfigError` naming the key; the `*_vocab_size` functions give the
vocabulary (the model's output size) without building anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf.errors import MissingMandatoryValue
from torch.utils.data import Dataset

from runner.components.data import LANGUAGE_MODEL, DataBundle
from runner.errors import ConfigError

log = logging.getLogger(__name__)

# Bumped whenever the token stream a corpus gives changes (separator, piece splitting, ...):
# part of the cache key, so an old cache file is never read as the new format.
FORMAT_VERSION = 1
CACHE_ENV = "AMP_RUNNER_TOKEN_CACHE"
DEFAULT_GLOB = "**/*.txt"
DEFAULT_BLOCK_SIZE = 256
DEFAULT_VAL_FRACTION = 0.1
BYTES_VOCAB = 256
SEPARATOR = "\n\n"  # between documents (files): the text for a tokenizer, its UTF-8 for bytes
DTYPES = ("uint16", "uint32")
HF_INSTALL = 'pip install "amp-runner[hf]"'

_READ_CHUNK = 16 * 2**20  # bytes of a file read (and written as tokens) at once, for bytes
# A tokenizer encodes text in pieces of at most this many characters (a document longer than
# that is cut after a newline), a batch of pieces at a time: memory stays bounded on any corpus.
_PIECE_CHARS = 4 * 2**20
_BATCH_CHARS = 16 * 2**20


# ---- the dataset ---------------------------------------------------------------------------
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


# ---- config helpers ------------------------------------------------------------------------
def _get(node: Any, key: str, default: Any = None) -> Any:
    """node.key, or `default` where it is absent, null or missing (`???`)."""
    try:
        value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    except MissingMandatoryValue:  # `???` in an option's YAML
        return default
    return default if value is None or (isinstance(value, str) and value == "???") else value


def _int_key(node: Any, key: str, default: Any, minimum: int) -> int:
    value = _get(node, f"{key}", default)
    if value is None:
        raise ConfigError(f"data.{key}", "is not set", f"an integer >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"data.{key}", f"is {value!r}", f"an integer >= {minimum}")
    return int(value)


def _block_size(node: Any, default: Optional[int] = DEFAULT_BLOCK_SIZE) -> int:
    return _int_key(node, "block_size", default, 1)


def _val_fraction(node: Any) -> float:
    value = _get(node, "val_fraction", DEFAULT_VAL_FRACTION)
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = math.nan
    if isinstance(value, bool) or not 0.0 < fraction < 1.0:
        raise ConfigError("data.val_fraction", f"is {value!r}", "a number in (0, 1)")
    return fraction


def _path(node: Any, key: str, what: str) -> str:
    value = _get(node, key)
    if value is None or str(value).strip() == "":
        raise ConfigError(f"data.{key}", "is not set", what)
    return os.path.abspath(os.path.expanduser(str(value)))


# ---- data=text: the corpus ---------------------------------------------------------------------
def corpus_files(node: Any) -> tuple[str, list[tuple[str, str]]]:
    """(root, [(relative path, absolute path), ...]) of the corpus `data.path` names: the file
    itself, or the files of the folder that match `data.glob`, sorted by relative path (their
    order in the token stream). Raises ConfigError when the path does not exist or nothing
    matches."""
    root = _path(node, "path", "a text file, or a folder of text files")
    if os.path.isfile(root):
        return os.path.dirname(root), [(os.path.basename(root), root)]
    if not os.path.isdir(root):
        raise ConfigError(
            "data.path", f"{root} does not exist", "a text file, or a folder of text files"
        )
    pattern = str(_get(node, "glob", DEFAULT_GLOB))
    try:
        found = [p for p in Path(root).glob(pattern) if p.is_file()]
    except (ValueError, NotImplementedError, OSError) as exc:
        raise ConfigError(
            "data.glob",
            f"{pattern!r} cannot be used under {root} ({exc})",
            'a glob relative to data.path, e.g. "**/*.txt"',
        ) from exc
    # data.exclude: shell patterns on the relative path ("*" crosses folders): "site-packages/*"
    excluded = [str(e) for e in (_get(node, "exclude", None) or [])]
    files = sorted(
        (rel, str(p))
        for p in found
        for rel in [p.relative_to(root).as_posix()]
        if not any(fnmatch.fnmatch(rel, e) for e in excluded)
    )
    if not files:
        but = f" (less data.exclude={excluded})" if excluded else ""
        raise ConfigError(
            "data.glob",
            f"{pattern!r} matches no file under data.path={root}{but}",
            'a glob that matches the corpus files, e.g. "**/*.txt" or "*.md"',
        )
    return root, files


def _stat_files(files: Sequence[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """[(relative path, size, mtime_ns)]: what the cache key digests."""
    out = []
    for rel, path in files:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ConfigError("data.path", f"corpus file {path} cannot be read ({exc})") from exc
        out.append((rel, st.st_size, st.st_mtime_ns))
    return out


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_READ_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _tokenizer_at(path: str, size: int, mtime_ns: int) -> tuple[Any, str]:
    """(tokenizers.Tokenizer, SHA-256 of its file), parsed once per file version."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ConfigError(
            "data.tokenizer",
            f"{path} needs the `tokenizers` package, which is not installed",
            HF_INSTALL + ", or data.tokenizer=null for bytes",
        ) from exc
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(
            "data.tokenizer",
            f"{path} cannot be read as a Hugging Face tokenizer.json ({type(exc).__name__}: {exc})",
            "the path of a tokenizer.json saved by `tokenizers`, or null for bytes",
        ) from exc
    return tokenizer, _sha256_file(path)


def load_tokenizer(node: Any) -> Optional[tuple[Any, str, str]]:
    """None for bytes (`data.tokenizer` null), else (Tokenizer, its path, its SHA-256)."""
    if _get(node, "tokenizer") is None:
        return None
    path = _path(node, "tokenizer", "the path of a tokenizer.json, or null for bytes")
    if not os.path.isfile(path):
        raise ConfigError(
            "data.tokenizer",
            f"{path} does not exist",
            "the path of a tokenizer.json, or null for bytes",
        )
    try:
        st = os.stat(path)
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError("data.tokenizer", f"{path} cannot be read ({exc})") from exc
    tokenizer, digest = _tokenizer_at(path, st.st_size, st.st_mtime_ns)
    return tokenizer, path, digest


def text_vocab_size(node: Any) -> int:
    """The vocabulary of `data=text`: 256 for bytes, else the tokenizer's (with added tokens)."""
    loaded = load_tokenizer(node)
    return BYTES_VOCAB if loaded is None else int(loaded[0].get_vocab_size())


def check_text(node: Any) -> None:
    """Plan-time checks of `data=text` (no tokenising): the corpus exists, its files are
    readable and not all empty, the tokenizer parses, for bytes (whose token count is the byte
    count) the corpus holds a training and a validation window, and the cache can be written."""
    block_size = _block_size(node)
    fraction = _val_fraction(node)
    root, files = corpus_files(node)
    sizes = _stat_files(files)
    for _, path in files:
        if not os.access(path, os.R_OK):
            raise ConfigError("data.path", f"corpus file {path} is not readable")
    if not any(size for _, size, _ in sizes):
        what = (
            files[0][1]
            if len(files) == 1
            else (
                f"all {len(files)} files matching {_get(node, 'glob', DEFAULT_GLOB)!r} under {root}"
            )
        )
        raise ConfigError(
            "data.path",
            f"{what} {'is' if len(files) == 1 else 'are'} empty",
            "a corpus with some text in it",
        )
    if load_tokenizer(node) is None:
        total = sum(size for _, size, _ in sizes) + len(SEPARATOR) * (len(files) - 1)
        _split_sizes(total, block_size, fraction)
    folder = cache_dir(node)
    existing = folder
    while not os.path.exists(existing):  # the folder is created when the corpus is tokenised
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            "data.cache_dir",
            f"{folder} cannot be written ({existing} is not a writable folder)",
            f"a writable folder (or set ${CACHE_ENV})",
        )


# ---- data=text: tokenising into the cache ------------------------------------------------------
def cache_dir(node: Any) -> str:
    """`data.cache_dir`, else $AMP_RUNNER_TOKEN_CACHE, else ~/.cache/amp-runner/tokens."""
    folder = (
        _get(node, "cache_dir")
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


def _dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _read_meta(meta_path: str) -> Optional[dict]:
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _verify(bin_path: str, meta_path: str, key: str) -> tuple[Optional[dict], Optional[str]]:
    """(sidecar, None) when the cached file is whole: its size is num_tokens * itemsize and its
    SHA-256 is the sidecar's; else (None, why not) -- why is None when there is no cache yet."""
    if not os.path.exists(bin_path) and not os.path.exists(meta_path):
        return None, None
    meta = _read_meta(meta_path)
    if meta is None or meta.get("key") != key or meta.get("dtype") not in DTYPES:
        return None, f"its sidecar {meta_path} is missing or unreadable"
    try:
        size = os.path.getsize(bin_path)
    except OSError:
        return None, f"{bin_path} is missing"
    expected = int(meta.get("num_tokens", -1)) * np.dtype(meta["dtype"]).itemsize
    if size != expected:
        return None, f"{bin_path} has {size} bytes, its sidecar says {expected}"
    if _sha256_file(bin_path) != meta.get("sha256"):
        return None, f"the SHA-256 of {bin_path} is not its sidecar's"
    return meta, None


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive fcntl lock on `path` (a lock file in the cache folder): the first run
    tokenises, a concurrent one waits here and then finds the cache written."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("Waiting for another process tokenising into the same cache (%s)", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pieces(text: str, limit: Optional[int] = None) -> Iterator[str]:
    """`text` in pieces of at most `limit` (`_PIECE_CHARS`) characters, each cut after a newline
    where there is one (a tokenizer never sees a word cut in two unless a line is longer)."""
    limit = limit or _PIECE_CHARS
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
            yield from iter(lambda: f.read(_READ_CHUNK), b"")


def _tokenizer_chunks(paths: Sequence[str], tokenizer: Any, dtype: str) -> Iterator[np.ndarray]:
    """Token ids of the documents, each followed by the separator (but the last), encoded without
    special tokens, a batch of pieces at a time (tokenizers encodes a batch in parallel)."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def encode(pieces: list[str]) -> Iterator[np.ndarray]:
        for encoding in encode_batch(pieces, add_special_tokens=False):
            yield np.asarray(encoding.ids, dtype=dtype)

    batch: list[str] = []
    chars = 0
    for i, path in enumerate(paths):
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
        if i < len(paths) - 1:
            text += SEPARATOR
        for piece in _pieces(text):
            batch.append(piece)
            chars += len(piece)
            if chars >= _BATCH_CHARS:
                yield from encode(batch)
                batch, chars = [], 0
    if batch:
        yield from encode(batch)


def _tokenise(
    paths: Sequence[str], tokenizer: Optional[Any], dtype: str, out: str
) -> tuple[int, str]:
    """Write the corpus's token stream to `out`; (number of tokens, SHA-256 of the file)."""
    digest, count = hashlib.sha256(), 0
    with open(out, "wb") as f:
        if tokenizer is None:
            chunks: Iterator[np.ndarray] = (
                np.frombuffer(b, dtype=np.uint8).astype(dtype) for b in _bytes_chunks(paths)
            )
        else:
            chunks = _tokenizer_chunks(paths, tokenizer, dtype)
        for ids in chunks:
            data = ids.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes()
            f.write(data)
            digest.update(data)
            count += len(ids)
        f.flush()
        os.fsync(f.fileno())
    return count, digest.hexdigest()


def _write_json_atomic(path: str, payload: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def tokenised_corpus(node: Any) -> tuple[str, dict]:
    """(path of the flat token file, its sidecar) for the `data=text` corpus: read from the cache
    when a whole one is there, else tokenised once (under a lock) and written atomically."""
    root, files = corpus_files(node)
    stats = _stat_files(files)
    loaded = load_tokenizer(node)
    tokenizer, tok_path, tok_digest = loaded if loaded is not None else (None, None, "bytes")
    vocab = BYTES_VOCAB if tokenizer is None else int(tokenizer.get_vocab_size())
    dtype = _dtype_for(vocab)
    key = cache_key(stats, tok_digest)
    folder = cache_dir(node)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            "data.cache_dir",
            f"{folder} cannot be created ({exc})",
            f"a writable folder (or set ${CACHE_ENV})",
        ) from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(
            "data.cache_dir",
            f"{folder} is not writable",
            f"a writable folder (or set ${CACHE_ENV})",
        )
    bin_path = os.path.join(folder, f"text-{key}.bin")
    meta_path = os.path.join(folder, f"text-{key}.json")

    meta, problem = _verify(bin_path, meta_path, key)
    if meta is None:
        with _locked(os.path.join(folder, f"text-{key}.lock")):
            meta, problem = _verify(bin_path, meta_path, key)  # another run may have written it
            if meta is None:
                if problem is not None:
                    log.warning(
                        "Cached tokens %s are corrupted (%s): tokenising again", bin_path, problem
                    )
                meta = _write_cache(
                    files,
                    stats,
                    tokenizer,
                    tok_path,
                    tok_digest,
                    vocab,
                    dtype,
                    key,
                    root,
                    bin_path,
                    meta_path,
                )
                return bin_path, meta
    log.info(
        "Loading %d tokens (%s) of %d files from the token cache %s",
        meta["num_tokens"],
        "bytes" if tokenizer is None else "tokenizer",
        len(files),
        bin_path,
    )
    return bin_path, meta


def _write_cache(
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
    total = sum(size for _, size, _ in stats)
    log.info(
        "Tokenising %d files (%.1f MB) with %s into %s (once)",
        len(files),
        total / 1e6,
        "bytes" if tokenizer is None else f"tokenizer {tok_path}",
        bin_path,
    )
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(bin_path), prefix=".tmp-", suffix=".bin")
    os.close(fd)
    try:
        count, sha = _tokenise([path for _, path in files], tokenizer, dtype, tmp)
        os.replace(tmp, bin_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
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
    }
    _write_json_atomic(meta_path, meta)  # after the .bin: a sidecar always describes its file
    return meta


def _split_sizes(num_tokens: int, block_size: int, val_fraction: float) -> tuple[int, int]:
    """(train tokens, val tokens): the last max(val_fraction * N, block_size + 1) tokens are
    validation; both splits must hold one window (block_size + 1 tokens)."""
    num_val = max(int(val_fraction * num_tokens), block_size + 1)
    num_train = num_tokens - num_val
    if num_train < block_size + 1:
        largest = min(num_tokens - int(val_fraction * num_tokens), num_tokens // 2) - 1
        raise ConfigError(
            "data.block_size",
            f"is {block_size} but the corpus has only {num_tokens} tokens: a training and a "
            f"validation window of block_size + 1 tokens each need at least "
            f"{2 * (block_size + 1)}, and data.val_fraction={val_fraction} holds out {num_val}",
            f"an integer <= {largest}" if largest >= 1 else "a larger corpus",
        )
    return num_train, num_val


def build_text(cfg: Any) -> DataBundle:
    """`data=text`: the corpus tokenised (once, cached), the last `val_fraction` of the token
    stream as validation, both as `TokenWindows` over the memory-mapped cache file.

    The token stream: for bytes, exactly the UTF-8 bytes of the files joined by b"\n\n". For a
    tokenizer, each file's text (read as UTF-8, errors replaced) followed by "\n\n" (all but the
    last) is encoded on its own, without the tokenizer's special tokens (no BOS/CLS per piece),
    files longer than `_PIECE_CHARS` in pieces cut after a newline: memory stays bounded on any
    corpus. These are the ids of `tokenizer.encode(joined text)` whenever the pre-tokenizer
    splits at whitespace (Whitespace, WhitespaceSplit, BertPreTokenizer, ...); a byte-level BPE
    (GPT-2's) may split the whitespace at a file boundary or a cut differently (a token there).
    """
    block_size = _block_size(cfg)
    fraction = _val_fraction(cfg)
    bin_path, meta = tokenised_corpus(cfg)
    num_tokens = int(meta["num_tokens"])
    num_train, _ = _split_sizes(num_tokens, block_size, fraction)
    train = TokenWindows.from_file(bin_path, meta["dtype"], block_size, 0, num_train)
    val = TokenWindows.from_file(bin_path, meta["dtype"], block_size, num_train, num_tokens)
    return DataBundle(
        train,
        val,
        int(meta["vocab_size"]),
        block_size,
        str(_get(cfg, "name", "text")),
        task=LANGUAGE_MODEL,
        block_size=block_size,
    )


# ---- data=tokens ---------------------------------------------------------------------------------
def _tokens_dtype(node: Any) -> str:
    dtype = _get(node, "dtype", "uint16")
    if dtype not in DTYPES:
        raise ConfigError("data.dtype", f"is {dtype!r}", DTYPES)
    return str(dtype)


def check_tokens(node: Any) -> None:
    """Plan-time checks of `data=tokens`: the dtype is known, both files exist, are not empty,
    hold whole tokens (size a multiple of the item size) and at least one window each."""
    dtype = _tokens_dtype(node)
    block_size = _block_size(node)
    vocab = _get(node, "vocab_size")
    if vocab is not None:
        _int_key(node, "vocab_size", None, 1)
    itemsize = np.dtype(dtype).itemsize
    for key in ("train", "val"):
        path = _path(node, key, f"the path of a flat {dtype} token file")
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


def tokens_vocab_size(node: Any) -> Optional[int]:
    """The declared vocabulary of `data=tokens` (None: found from the files when built)."""
    vocab = _get(node, "vocab_size")
    return None if vocab is None else int(vocab)


def _max_id(tokens: np.ndarray) -> int:
    step = _READ_CHUNK // tokens.itemsize
    return max(int(tokens[i : i + step].max()) for i in range(0, len(tokens), step))


def build_tokens(cfg: Any) -> DataBundle:
    """`data=tokens`: already tokenised flat files (`data.train`, `data.val`, nanoGPT's layout),
    memory-mapped; the vocabulary is `data.vocab_size`, or the largest id in the files + 1."""
    check_tokens(cfg)
    dtype = _tokens_dtype(cfg)
    block_size = _block_size(cfg)
    splits = {
        key: TokenWindows.from_file(_path(cfg, key, ""), dtype, block_size)
        for key in ("train", "val")
    }
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
    vocab = declared if declared is not None else top + 1
    return DataBundle(
        splits["train"],
        splits["val"],
        vocab,
        block_size,
        str(_get(cfg, "name", "tokens")),
        task=LANGUAGE_MODEL,
        block_size=block_size,
    )


# ---- data=synthetic_text -----------------------------------------------------------------------
class SyntheticLanguage:
    """A seeded order-2 Markov language over `vocab_size` tokens: learnable, with a known floor.

    Every token b owns a seeded pool of P = min(vocab_size, 4 * branching) distinct tokens, and
    every token a a seeded offset u[a] in [0, P). After the context (a, b) the next token is
    pool[b][(u[a] + k) % P] with k ~ p, where p is ONE seeded Dirichlet(1) draw over `branching`
    outcomes: so each context has `branching` distinct possible next tokens (depending on both
    previous tokens), with the probabilities p in a context-specific order.

    Entropy rate: since every context's next-token distribution is p (permuted), the
    conditional entropy of a token given the whole past is exactly
        H(p) = -sum_k p_k ln p_k  <=  ln(branching)  nats/token     (`entropy_rate`),
    the loss no model can beat (1.28 nats for the defaults: vocab 64, branching 4, seed 0). A
    model that only learns the previous token gets to a little under ln(P) (2.6 for the
    defaults; ln 16 = 2.77), one that learns nothing stays at ln(vocab_size) (4.16 for 64): the
    loss falls in two visible stages (a 2-layer, 64-wide GPT reaches 1.6 in 400 steps of 32 x 64
    tokens). The stream is not periodic (it is a
    random walk over vocab_size**2 contexts) and is deterministic for a given seed.
    """

    POOL_FACTOR = 4

    def __init__(self, vocab_size: int = 64, branching: int = 4, seed: int = 0):
        if vocab_size < 2:
            raise ConfigError("data.vocab_size", f"is {vocab_size}", "an integer >= 2")
        if not 1 <= branching <= vocab_size:
            raise ConfigError(
                "data.branching",
                f"is {branching} with data.vocab_size={vocab_size}",
                f"an integer in [1, {vocab_size}]",
            )
        self.vocab_size, self.branching, self.seed = int(vocab_size), int(branching), int(seed)
        self.pool_size = min(self.vocab_size, self.POOL_FACTOR * self.branching)
        rng = np.random.default_rng([self.seed, 0x7E47])
        self.probs = rng.dirichlet(np.ones(self.branching))
        # pool[b]: P distinct tokens, a draw per token (no V x V table: large vocabularies too)
        self.pool = np.stack(
            [
                rng.choice(self.vocab_size, self.pool_size, replace=False)
                for _ in range(self.vocab_size)
            ]
        )
        self.offsets = rng.integers(0, self.pool_size, size=self.vocab_size)
        self.entropy_rate = float(-(self.probs * np.log(self.probs)).sum())

    def sample(self, num_tokens: int) -> np.ndarray:
        """The first `num_tokens` tokens of the seeded stream (uint16, or uint32 past 65536)."""
        rng = np.random.default_rng([self.seed, 0x5EED])
        choices = rng.choice(self.branching, size=num_tokens, p=self.probs).tolist()
        start = rng.integers(0, self.vocab_size, size=2).tolist()
        pool, offsets, size = self.pool.tolist(), self.offsets.tolist(), self.pool_size
        out = start[:num_tokens]
        a, b = start
        for k in choices[2:]:
            a, b = b, pool[b][(offsets[a] + k) % size]
            out.append(b)
        return np.asarray(out, dtype=_dtype_for(self.vocab_size))


def synthetic_text_vocab_size(node: Any) -> int:
    return _int_key(node, "vocab_size", 64, 2)


def build_synthetic_text(cfg: Any) -> DataBundle:
    """`data=synthetic_text`: train is the first `num_train` tokens of a `SyntheticLanguage`
    stream, val the `num_val` after them (in memory; nothing on disk)."""
    vocab = synthetic_text_vocab_size(cfg)
    block_size = _block_size(cfg, 64)
    num_train = _int_key(cfg, "num_train", 200_000, block_size + 1)
    num_val = _int_key(cfg, "num_val", 20_000, block_size + 1)
    language = SyntheticLanguage(
        vocab, _int_key(cfg, "branching", 4, 1), _int_key(cfg, "seed", 0, 0)
    )
    tokens = language.sample(num_train + num_val)
    train = TokenWindows(tokens, block_size, 0, num_train)
    val = TokenWindows(tokens, block_size, num_train, num_train + num_val)
    return DataBundle(
        train,
        val,
        vocab,
        block_size,
        str(_get(cfg, "name", "synthetic_text")),
        task=LANGUAGE_MODEL,
        block_size=block_size,
    )
