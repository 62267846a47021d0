"""`data=text`: a text file or a folder of them, tokenised once into the token cache (UTF-8
bytes, or a Hugging Face `tokenizer.json`), the tail held out as validation.

`corpus_files` finds the files, `load_tokenizer` the tokenizer, `check_text` checks both at plan
time (no tokenising), `tokenised_corpus` reads the cache or fills it, and `build_text` cuts the
cached token file into training and validation windows.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from runner.components.data import LANGUAGE_MODEL, DataBundle
from runner.components.text import keys
from runner.components.text.cache import (
    CACHE_ENV,
    cache_dir,
    cache_key,
    locked,
    say_not_utf8,
    verify,
    write_cache,
)
from runner.components.text.stream import SEPARATOR, sha256_file
from runner.components.text.windows import TokenWindows, dtype_for
from runner.config import options
from runner.errors import ConfigError
from runner.files import folder_problem

log = logging.getLogger(__name__)

DEFAULT_GLOB = "**/*.txt"
BYTES_VOCAB = 256
HF_INSTALL = 'pip install "amp-runner[hf]"'


def corpus_files(node: Any) -> tuple[str, list[tuple[str, str]]]:
    """(root, [(relative path, absolute path), ...]) of the corpus `data.path` names: the file
    itself, or the files of the folder that match `data.glob`, sorted by relative path (their
    order in the token stream). Raises ConfigError when the path does not exist or nothing
    matches."""
    root = keys.path(node, "path", "a text file, or a folder of text files")
    if os.path.isfile(root):
        return os.path.dirname(root), [(os.path.basename(root), root)]
    if not os.path.isdir(root):
        raise ConfigError(
            "data.path", f"{root} does not exist", "a text file, or a folder of text files"
        )
    pattern = str(keys.get(node, "glob", DEFAULT_GLOB))
    try:
        found = [p for p in Path(root).glob(pattern) if p.is_file()]
    except (ValueError, NotImplementedError, OSError) as exc:
        raise ConfigError(
            "data.glob",
            f"{pattern!r} cannot be used under {root} ({exc})",
            'a glob relative to data.path, e.g. "**/*.txt"',
        ) from exc
    # data.exclude: shell patterns on the relative path ("*" crosses folders): "site-packages/*"
    excluded = [str(e) for e in (keys.get(node, "exclude", None) or [])]
    # hidden files and folders are not text (Jupyter's .ipynb_checkpoints/ copies of each file,
    # .git/, macOS's ._<name> forks) unless the glob itself names a hidden part
    hidden_too = any(options.hidden(part) for part in Path(pattern).parts)
    files = sorted(
        (rel, str(p))
        for p in found
        for rel in [p.relative_to(root).as_posix()]
        if not any(fnmatch.fnmatch(rel, e) for e in excluded)
        and (hidden_too or not any(options.hidden(part) for part in rel.split("/")))
    )
    if not files:
        but = f" (less data.exclude={excluded})" if excluded else ""
        raise ConfigError(
            "data.glob",
            f"{pattern!r} matches no file under data.path={root}{but}",
            'a glob that matches the corpus files, e.g. "**/*.txt" or "*.md"',
        )
    return root, files


def stat_files(files: Sequence[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """[(relative path, size, mtime_ns)]: what the cache key digests."""
    out = []
    for rel, path in files:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ConfigError("data.path", f"corpus file {path} cannot be read ({exc})") from exc
        out.append((rel, st.st_size, st.st_mtime_ns))
    return out


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
            f"{path} cannot be read as a Hugging Face tokenizer.json ({_why_not(path, exc)})",
            "the path of a tokenizer.json saved by `tokenizers`, or null for bytes",
        ) from exc
    return tokenizer, sha256_file(path)


def _why_not(path: str, exc: Exception) -> str:
    """Why `tokenizers` refused the file, in the reader's terms: not JSON (where), JSON of
    another kind (a Hugging Face folder's tokenizer_config.json or vocab.json: its
    tokenizer.json beside it named), else tokenizers' own message."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as err:
        return f"{type(err).__name__}: {err}"
    except json.JSONDecodeError as err:
        return f"not JSON: {err.msg} at line {err.lineno}, column {err.colno}"
    if isinstance(data, dict) and "model" in data:
        return f"{type(exc).__name__}: {exc}"
    beside = os.path.join(os.path.dirname(path), "tokenizer.json")
    hint = (
        f"; the tokenizer.json beside it is {beside}"
        if os.path.basename(path) != "tokenizer.json" and os.path.isfile(beside)
        else ""
    )
    return f"JSON of another kind: a tokenizer.json has a 'model' entry at its top{hint}"


def load_tokenizer(node: Any) -> Optional[tuple[Any, str, str]]:
    """None for bytes (`data.tokenizer` null), else (Tokenizer, its path, its SHA-256)."""
    if keys.get(node, "tokenizer") is None:
        return None
    path = keys.path(node, "tokenizer", "the path of a tokenizer.json, or null for bytes")
    if os.path.isdir(path):  # a Hugging Face model's folder: its tokenizer.json
        inside = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(inside):
            raise ConfigError(
                "data.tokenizer",
                f"{path} is a folder without a tokenizer.json",
                "the path of a tokenizer.json (or of a folder holding one), or null for bytes",
            )
        path = inside
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
    block_size = keys.block_size(node)
    fraction = keys.val_fraction(node)
    root, files = corpus_files(node)
    sizes = stat_files(files)
    for _, path in files:
        if not os.access(path, os.R_OK):
            raise ConfigError("data.path", f"corpus file {path} is not readable")
    if not any(size for _, size, _ in sizes):
        what = (
            files[0][1]
            if len(files) == 1
            else (
                f"all {len(files)} files matching "
                f"{keys.get(node, 'glob', DEFAULT_GLOB)!r} under {root}"
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
    problem = folder_problem(folder)  # (made when the corpus is tokenised)
    if problem is not None:
        raise ConfigError(
            "data.cache_dir",
            f"{folder} cannot be written: {problem}",
            f"a writable folder (or set ${CACHE_ENV})",
        )


def tokenised_corpus(node: Any) -> tuple[str, dict]:
    """(path of the flat token file, its sidecar) for the `data=text` corpus: read from the cache
    when a whole one is there, else tokenised once (under a lock) and written atomically."""
    root, files = corpus_files(node)
    stats = stat_files(files)
    loaded = load_tokenizer(node)
    tokenizer, tok_path, tok_digest = loaded if loaded is not None else (None, None, "bytes")
    vocab = BYTES_VOCAB if tokenizer is None else int(tokenizer.get_vocab_size())
    dtype = dtype_for(vocab)
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

    meta, problem = verify(bin_path, meta_path, key)
    if meta is None:
        with locked(os.path.join(folder, f"text-{key}.lock")):
            meta, problem = verify(bin_path, meta_path, key)  # another run may have written it
            if meta is None:
                if problem is not None:
                    log.warning(
                        "Cached tokens %s are corrupted (%s): tokenising again", bin_path, problem
                    )
                meta = write_cache(
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
                say_not_utf8(meta, root)
                return bin_path, meta
    say_not_utf8(meta, root)
    log.info(
        "Loading %d tokens (%s) of %d files from the token cache %s",
        meta["num_tokens"],
        "bytes" if tokenizer is None else "tokenizer",
        len(files),
        bin_path,
    )
    return bin_path, meta


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
    files longer than `stream.PIECE_CHARS` in pieces cut after a newline: memory stays bounded on
    any corpus. These are the ids of `tokenizer.encode(joined text)` whenever the pre-tokenizer
    splits at whitespace (Whitespace, WhitespaceSplit, BertPreTokenizer, ...); a byte-level BPE
    (GPT-2's) may split the whitespace at a file boundary or a cut differently (a token there).
    """
    block_size = keys.block_size(cfg)
    fraction = keys.val_fraction(cfg)
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
        str(keys.get(cfg, "name", "text")),
        task=LANGUAGE_MODEL,
        block_size=block_size,
    )
