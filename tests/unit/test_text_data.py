"""Text datasets (runner/components/text/): windows, the token cache, the three builders and
their plan-time checks, on small corpora each test writes in its own folder."""

from __future__ import annotations

import logging
import math
import os
import pickle
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from runner.components import text
from runner.components.data import LANGUAGE_MODEL
from runner.components.text import (
    SyntheticLanguage,
    TokenWindows,
    build_synthetic_text,
    build_text,
    build_tokens,
    check_text,
    check_tokens,
    synthetic_text_vocab_size,
    text_vocab_size,
    tokens_vocab_size,
)
from runner.components.text import cache as token_cache
from runner.components.text import stream as token_stream
from runner.errors import ConfigError
from tests.helpers.runs import compose_config

LOGGER = "runner.components.text"

DOCS = {  # relative path -> text; the .md file is not matched by the default glob
    "a.txt": "The quick brown fox jumps over the lazy dog.\nCafé crème, naïve résumé.\n" * 6,
    "notes.md": "# not part of the corpus\n",
    "sub/b.txt": "Pack my box with five dozen liquor jugs! 日本語のテキスト。\n" * 5,
    "sub/deeper/c.txt": "How vexingly quick daft zebras jump; sphinx of black quartz.\n" * 4,
}
TXT = ["a.txt", "sub/b.txt", "sub/deeper/c.txt"]  # the corpus files, in relative-path order


def compose_data(*overrides: str):
    return compose_config(*overrides).data


def write_corpus(folder: Path, docs: dict[str, str] = DOCS) -> Path:
    for rel, content in docs.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    return folder


def joined(folder: Path, names=TXT) -> str:
    return "\n\n".join((folder / n).read_text(encoding="utf-8") for n in names)


def node(**keys):
    return OmegaConf.create(keys)


def text_node(tmp_path: Path, corpus: Path, **keys):
    base = dict(
        name="text",
        path=str(corpus),
        glob="**/*.txt",
        tokenizer=None,
        block_size=16,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    return node(**{**base, **keys})


def all_items(ds) -> list:
    return [ds[i] for i in range(len(ds))]


def assert_same_items(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ---- TokenWindows ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_are_shifted_by_one_token(dtype):
    offset = 70_000 if dtype == "uint32" else 0  # ids past uint16 survive as int64
    tokens = (np.arange(1000) + offset).astype(dtype)
    ds = TokenWindows(tokens, 16)
    assert len(ds) == 999 // 16 == 62
    x, y = ds[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert x.tolist() == list(range(offset, offset + 16))
    assert torch.equal(y[:-1], x[1:]) and int(y[-1]) == offset + 16
    x, y = ds[-1]  # the last window ends within the array (its y's last token included)
    assert int(x[0]) == offset + 61 * 16 and int(y[-1]) == offset + 61 * 16 + 16 <= offset + 999
    assert torch.equal(x, ds[61][0])
    with pytest.raises(IndexError):
        ds[62]
    # a (start, stop) range: windows start at `start` and never read past `stop`
    part = TokenWindows(tokens, 10, start=100, stop=131)
    assert len(part) == 3 and part[0][0].tolist() == list(range(offset + 100, offset + 110))
    assert int(part[2][1][-1]) == offset + 130


def test_exactly_one_window_and_none():
    assert len(TokenWindows(np.arange(9, dtype=np.uint16), 8)) == 1
    assert len(TokenWindows(np.arange(8, dtype=np.uint16), 8)) == 0


def test_file_backed_windows_pickle_without_their_tokens(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50_000, size=200_000).astype(np.uint16)
    tokens.tofile(tmp_path / "corpus.bin")
    ds = TokenWindows.from_file(str(tmp_path / "corpus.bin"), "uint16", 32, 1000, 150_000)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # path, dtype, offset, length: not 300 kB of tokens
    back = pickle.loads(blob)
    assert_same_items(all_items(back), all_items(ds))
    assert back[0][0].tolist() == tokens[1000:1032].tolist()
    # a memmap (a slice of one, too) passed in is recorded by its file and byte offset
    mm = np.memmap(tmp_path / "corpus.bin", dtype=np.uint16, mode="r", offset=2 * 500)
    sliced = TokenWindows(mm[500:], 32, start=0, stop=149_000)
    assert sliced.path == str(tmp_path / "corpus.bin") and sliced.offset == 2000
    assert len(pickle.dumps(sliced)) < 2000
    assert_same_items(all_items(pickle.loads(pickle.dumps(sliced))), all_items(ds))


def test_in_memory_windows_pickle_their_array():
    ds = TokenWindows(np.arange(5000, dtype=np.uint16), 8, 100, 900)
    back = pickle.loads(pickle.dumps(ds))
    assert_same_items(all_items(back), all_items(ds))
    assert back[0][0].tolist() == list(range(100, 108))


def test_windows_in_a_dataloader_with_two_spawned_workers(tmp_path):
    """Workers started by spawn receive the dataset pickled: the memmap is reopened there."""
    tokens = np.arange(20_000, dtype=np.uint32) * 3
    tokens.tofile(tmp_path / "t.bin")
    ds = TokenWindows.from_file(str(tmp_path / "t.bin"), "uint32", 64)
    loader = DataLoader(ds, batch_size=50, num_workers=2, multiprocessing_context="spawn")
    xs, ys = zip(*loader)
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.shape == (len(ds), 64) and x.dtype == torch.int64
    assert torch.equal(x.flatten(), torch.from_numpy(tokens[: len(ds) * 64].astype(np.int64)))
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:-1, -1], x[1:, 0])


# ---- data=text with bytes ----------------------------------------------------------------------
def test_text_bytes_tokens_are_the_utf8_of_the_joined_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    bundle = build_text(text_node(tmp_path, corpus))
    raw = joined(corpus).encode("utf-8")  # a.txt, then sub/b.txt, then sub/deeper/c.txt
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    assert bundle.num_classes == 256 and bundle.task == LANGUAGE_MODEL
    assert bundle.block_size == bundle.image_size == 16 and bundle.name == "text"
    x, y = bundle.train[0]
    assert x.tolist() == list(b"The quick brown ") and y.tolist() == list(b"he quick brown f")
    n = len(ids)
    num_val = max(int(0.1 * n), 17)
    train_tokens, val_tokens = bundle.train.tokens(), bundle.val.tokens()
    assert len(train_tokens) + len(val_tokens) == n and len(val_tokens) == num_val
    assert np.array_equal(np.concatenate([train_tokens, val_tokens]), ids)
    assert bundle.val[0][0].tolist() == ids[n - num_val : n - num_val + 16].tolist()  # the tail
    assert len(bundle.train) == (n - num_val - 1) // 16 and len(bundle.val) == (num_val - 1) // 16
    # the cache: nanoGPT's flat layout and a sidecar that describes it
    (bin_path,) = (tmp_path / "cache").glob("*.bin")
    assert np.array_equal(np.fromfile(bin_path, dtype="<u2"), ids)
    meta = token_cache.read_meta(str(bin_path.with_suffix(".json")))
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == n and meta["vocab_size"] == 256
    assert meta["tokenizer"] == "bytes" and [f[0] for f in meta["files"]] == TXT
    assert meta["sha256"] == token_stream.sha256_file(str(bin_path))


def test_text_reads_the_cache_and_a_new_corpus_gets_a_new_file(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = text_node(tmp_path, corpus)
    caplog.set_level(logging.INFO, logger=LOGGER)
    first = build_text(cfg)
    size = sum((corpus / name).stat().st_size for name in TXT) / 1e3  # a small corpus: in kB
    assert f"Tokenising 3 files ({size:.1f} kB) with bytes into" in caplog.text
    (bin_path,) = (tmp_path / "cache").glob("*.bin")
    stamp = bin_path.stat().st_mtime_ns
    caplog.clear()
    second = build_text(cfg)
    assert "Tokenising" not in caplog.text and "from the token cache" in caplog.text
    assert bin_path.stat().st_mtime_ns == stamp
    assert_same_items(all_items(second.train), all_items(first.train))
    # an edited file gives another cache file, with the new text in it
    (corpus / "a.txt").write_text("Edited. " * 40, encoding="utf-8")
    caplog.clear()
    third = build_text(cfg)
    assert "Tokenising 3 files" in caplog.text
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2
    assert third.train[0][0].tolist() == list(b"Edited. Edited. ")


def test_a_corrupted_cache_file_is_detected_and_tokenised_again(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = text_node(tmp_path, corpus)
    expected = all_items(build_text(cfg).train)
    (bin_path,) = (tmp_path / "cache").glob("*.bin")
    data = bytearray(bin_path.read_bytes())
    data[10] ^= 0x01  # one flipped bit, same size: only the SHA-256 can tell
    bin_path.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, logger=LOGGER)
    again = build_text(cfg)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "corrupted" in warnings[0].getMessage()
    assert "SHA-256" in warnings[0].getMessage() and "Tokenising" in caplog.text
    assert_same_items(all_items(again.train), expected)
    # a truncated file (another size than the sidecar's) is caught the same way
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    caplog.clear()
    assert_same_items(all_items(build_text(cfg).train), expected)
    assert "bytes, its sidecar says" in caplog.text


def test_the_cache_folder_defaults_to_the_environment_variable(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    monkeypatch.setenv("AMP_RUNNER_TOKEN_CACHE", str(tmp_path / "env-cache"))
    build_text(text_node(tmp_path, corpus, cache_dir=None))
    assert len(list((tmp_path / "env-cache").glob("*.bin"))) == 1


def test_two_runs_starting_at_once_tokenise_once(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = text_node(tmp_path, corpus)
    calls = []
    original = token_cache.tokenise

    def slow_tokenise(*args, **kwargs):  # long enough that the second run arrives meanwhile
        calls.append(threading.get_ident())
        threading.Event().wait(0.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(token_cache, "tokenise", slow_tokenise)
    barrier, results = threading.Barrier(2), []

    def run():
        barrier.wait()
        results.append(text.tokenised_corpus(cfg))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_block_size_larger_than_the_corpus_says_how_many_tokens(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"tiny.txt": "x" * 100})
    for check in (check_text, build_text):
        with pytest.raises(ConfigError) as err:
            check(text_node(tmp_path, corpus, block_size=64))
        assert err.value.key == "data.block_size" and "only 100 tokens" in str(err.value)
        assert "<= 49" in str(err.value)


def test_stdlib_package_as_a_corpus(tmp_path):
    folder = Path(os.path.dirname(os.__file__)) / "json"
    files = sorted(folder.glob("**/*.py"), key=lambda p: p.relative_to(folder).as_posix())
    cfg = text_node(tmp_path, folder, glob="**/*.py", block_size=128)
    check_text(cfg)
    bundle = build_text(cfg)
    n = sum(p.stat().st_size for p in files) + 2 * (len(files) - 1)
    num_train = len(bundle.train.tokens())
    assert num_train + len(bundle.val.tokens()) == n > 10_000
    assert num_train == n - int(0.1 * n)
    assert len(bundle.train) == (num_train - 1) // 128 > 50
    first = files[0].read_bytes()[:128]
    assert bytes(bundle.train[0][0].tolist()) == first
    assert int(bundle.train.tokens().max()) < 256


# ---- data=text with a tokenizer ----------------------------------------------------------------
@pytest.fixture
def bpe_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    corpus = write_corpus(tmp_path / "corpus")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"], show_progress=False)
    tok.train([str(corpus / n) for n in TXT], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return corpus, path, tokenizers.Tokenizer.from_file(str(path))


def test_text_with_a_tokenizer_gives_its_ids_of_the_joined_text(tmp_path, bpe_tokenizer):
    corpus, path, tok = bpe_tokenizer
    cfg = text_node(tmp_path, corpus, tokenizer=str(path), block_size=8, val_fraction=0.2)
    check_text(cfg)
    assert text_vocab_size(cfg) == tok.get_vocab_size()
    bundle = build_text(cfg)
    expected = tok.encode(joined(corpus)).ids
    assert bundle.num_classes == tok.get_vocab_size() and bundle.num_classes < 256
    stream = np.concatenate([bundle.train.tokens(), bundle.val.tokens()])
    assert stream.tolist() == expected
    assert bundle.train[0][0].tolist() == expected[:8]
    assert bundle.train[0][1].tolist() == expected[1:9]
    # the same corpus with bytes is another cache file
    build_text(text_node(tmp_path, corpus))
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2
    meta = token_cache.read_meta(str(next((tmp_path / "cache").glob("*.json"))))
    assert meta["dtype"] == "uint16"


def test_a_file_that_is_not_utf8_is_named_at_every_run(tmp_path, bpe_tokenizer, caplog):
    """A Latin-1 file among the corpus's: the tokenizer reads its bad bytes as U+FFFD (as
    before), but the run says which file, when it tokenises and when it reads the cache; bytes
    (no tokenizer) need no decoding and say nothing."""
    corpus, path, tok = bpe_tokenizer
    (corpus / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    cfg = text_node(tmp_path, corpus, tokenizer=str(path), block_size=4, val_fraction=0.2)
    for run in ("tokenises", "reads the cache"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="runner"):
            bundle = build_text(cfg)
        said = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
        assert len(said) == 1 and "1 of the corpus's files" in said[0], (run, caplog.text)
        assert "(latin1.txt)" in said[0] and "data.exclude" in said[0]
    stream = np.concatenate([bundle.train.tokens(), bundle.val.tokens()]).tolist()
    names = ["a.txt", "latin1.txt", "sub/b.txt", "sub/deeper/c.txt"]  # (relative-path order)
    read = [(corpus / n).read_bytes().decode("utf-8", errors="replace") for n in names]
    assert stream == tok.encode("\n\n".join(read)).ids
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner"):
        build_text(text_node(tmp_path, corpus, block_size=4))
    assert "not UTF-8" not in caplog.text


def test_a_large_corpus_is_encoded_in_pieces_with_the_same_ids(
    tmp_path, bpe_tokenizer, monkeypatch
):
    """Long documents are cut after newlines and encoded a batch of pieces at a time (bounded
    memory); for a tokenizer that splits at whitespace the ids are still those of the whole."""
    corpus, path, tok = bpe_tokenizer
    monkeypatch.setattr(token_stream, "PIECE_CHARS", 100)
    monkeypatch.setattr(token_stream, "BATCH_CHARS", 250)
    bundle = build_text(text_node(tmp_path, corpus, tokenizer=str(path), block_size=8))
    stream = np.concatenate([bundle.train.tokens(), bundle.val.tokens()])
    assert stream.tolist() == tok.encode(joined(corpus)).ids


def test_pieces_cut_after_newlines_and_join_back():
    doc = "".join(f"line {i} " + "word " * (i % 7) + "\n" for i in range(200))
    pieces = list(token_stream.pieces(doc, 60))
    assert "".join(pieces) == doc and len(pieces) > 10
    assert all(len(p) <= 60 and p.endswith("\n") for p in pieces)
    long_line = "x" * 250  # no newline to cut after: cut at the limit
    assert [len(p) for p in token_stream.pieces(long_line, 100)] == [100, 100, 50]


# ---- plan-time checks of data=text -------------------------------------------------------------
def check_error(check, cfg) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check(cfg)
    return err.value


def test_a_token_cache_the_disk_refuses_names_data_cache_dir(tmp_path):
    """A full disk while tokenising (here a file size limit, `ulimit -f`: EFBIG where a full
    disk says ENOSPC) ended in a traceback without the file; now a ConfigError names
    data.cache_dir, the file, the cause and the room the corpus needs, and leaves no part file.
    A corpus file that cannot be read is still the corpus's error, not the cache's."""
    import resource

    corpus = write_corpus(tmp_path / "corpus", {"big.txt": "x" * 60_000})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))  # the tokens take 120,000 bytes
    try:
        err = check_error(build_text, text_node(tmp_path, corpus))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert err.key == "data.cache_dir" and "cannot write the token cache" in str(err)
    assert "File too large" in str(err) and "the corpus needs up to 0.1 MB" in str(err)
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".lock"]

    (corpus / "big.txt").chmod(0)
    if os.access(corpus / "big.txt", os.R_OK):  # (root reads it all the same)
        return
    with pytest.raises(PermissionError):
        build_text(text_node(tmp_path, corpus))


def test_check_text_errors(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    check_text(text_node(tmp_path, corpus))  # a good corpus passes
    check_text(text_node(tmp_path, corpus / "a.txt"))  # a single file too

    err = check_error(check_text, text_node(tmp_path, tmp_path / "nowhere"))
    assert err.key == "data.path" and "does not exist" in str(err)
    err = check_error(check_text, node(**{**text_node(tmp_path, corpus), "path": None}))
    assert err.key == "data.path" and "not set" in str(err)

    (tmp_path / "empty-folder").mkdir()
    err = check_error(check_text, text_node(tmp_path, tmp_path / "empty-folder"))
    assert err.key == "data.glob" and "matches no file" in str(err)
    assert str(tmp_path / "empty-folder") in str(err)
    err = check_error(check_text, text_node(tmp_path, corpus, glob="**/*.rst"))
    assert err.key == "data.glob" and "'**/*.rst'" in str(err) and str(corpus) in str(err)

    (tmp_path / "empty.txt").write_text("")
    err = check_error(check_text, text_node(tmp_path, tmp_path / "empty.txt"))
    assert err.key == "data.path" and "empty" in str(err)
    blanks = write_corpus(tmp_path / "blanks", {"a.txt": "", "b/c.txt": ""})
    err = check_error(check_text, text_node(tmp_path, blanks))
    assert err.key == "data.path" and "all 2 files" in str(err) and "empty" in str(err)

    for bad, why in (
        ({"val_fraction": 1.5}, "data.val_fraction"),
        ({"block_size": 0}, "data.block_size"),
    ):
        assert check_error(check_text, text_node(tmp_path, corpus, **bad)).key == why


def test_check_text_tokenizer_errors(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    err = check_error(check_text, text_node(tmp_path, corpus, tokenizer=str(tmp_path / "no.json")))
    assert err.key == "data.tokenizer" and "does not exist" in str(err)
    pytest.importorskip("tokenizers")
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"model": {"type": "BPE", "vocab": [1, 2')
    err = check_error(check_text, text_node(tmp_path, corpus, tokenizer=str(garbage)))
    assert err.key == "data.tokenizer" and "cannot be read as a Hugging Face" in str(err)
    assert str(garbage) in str(err)
    # without the tokenizers package: say how to install it
    garbage.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    err = check_error(check_text, text_node(tmp_path, corpus, tokenizer=str(garbage)))
    assert err.key == "data.tokenizer" and 'pip install "amp-runner[hf]"' in str(err)


def test_a_tokenizer_folder_or_a_wrong_json_file_is_told_in_the_readers_terms(
    tmp_path, bpe_tokenizer
):
    corpus, path, tok = bpe_tokenizer  # tmp_path/tokenizer.json
    # a Hugging Face model's folder: its tokenizer.json
    assert text_vocab_size(text_node(tmp_path, corpus, tokenizer=str(tmp_path))) == (
        tok.get_vocab_size()
    )
    err = check_error(check_text, text_node(tmp_path, corpus, tokenizer=str(corpus)))
    assert err.key == "data.tokenizer" and "is a folder without a tokenizer.json" in str(err)
    # the folder's other JSON files: the tokenizer.json beside them named
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"model_max_length": 1024}')
    err = check_error(check_text, text_node(tmp_path, corpus, tokenizer=str(config)))
    assert "JSON of another kind: a tokenizer.json has a 'model' entry" in str(err)
    assert f"the tokenizer.json beside it is {path}" in str(err)
    config.write_text("model_max_length: 1024\n")
    err = check_error(check_text, text_node(tmp_path, corpus, tokenizer=str(config)))
    assert "not JSON: Expecting value at line 1, column 1" in str(err)


def test_text_vocab_size_is_256_for_bytes(tmp_path):
    assert text_vocab_size(text_node(tmp_path, tmp_path)) == 256


# ---- data=tokens -------------------------------------------------------------------------------
def test_tokens_whose_val_is_their_train_file_say_so(tmp_path, caplog):
    np.arange(2000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    cfg = dict(name="tokens", train=str(tmp_path / "train.bin"), dtype="uint16", block_size=32)
    with caplog.at_level("WARNING"):
        build_tokens(node(**cfg, val=str(tmp_path / "train.bin"), vocab_size=None))
    assert "data.train and data.val are the same" in caplog.text
    caplog.clear()
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with caplog.at_level("WARNING"):
        build_tokens(node(**cfg, val=str(tmp_path / "val.bin"), vocab_size=None))
    assert "are the same" not in caplog.text


@pytest.mark.parametrize("dtype,high", [("uint16", 50_257), ("uint32", 100_000)])
def test_tokens_round_trip(tmp_path, dtype, high):
    rng = np.random.default_rng(1)
    train = rng.integers(0, high - 1, size=5000).astype(dtype)
    val = rng.integers(0, high - 1, size=700).astype(dtype)
    val[5] = high - 1  # the largest id is in val
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    cfg = node(
        name="tokens",
        train=str(tmp_path / "train.bin"),
        val=str(tmp_path / "val.bin"),
        dtype=dtype,
        vocab_size=None,
        block_size=32,
    )
    check_tokens(cfg)
    assert tokens_vocab_size(cfg) is None
    bundle = build_tokens(cfg)
    assert bundle.num_classes == high and bundle.task == LANGUAGE_MODEL
    assert bundle.block_size == bundle.image_size == 32
    assert len(bundle.train) == 4999 // 32 and len(bundle.val) == 699 // 32
    x, y = bundle.train[3]
    assert x.tolist() == train[96:128].tolist() and y.tolist() == train[97:129].tolist()
    assert bundle.val[0][0].tolist() == val[:32].tolist()
    declared = build_tokens(node(**{**cfg, "vocab_size": high + 10}))
    assert (
        declared.num_classes == high + 10
        and tokens_vocab_size(node(**{**cfg, "vocab_size": high + 10})) == high + 10
    )
    assert_same_items(all_items(pickle.loads(pickle.dumps(bundle.val))), all_items(bundle.val))


def test_a_stray_large_token_id_is_said_before_it_sizes_the_model(tmp_path, caplog):
    """Ids below 300 and one stray 65535 (a corrupted token): vocab_size=null still takes the
    largest id + 1, as documented, but the run warns that one rare id sets it, naming the file;
    a real corpus whose largest id is as common as the others, or a vocabulary given, is quiet."""
    rng = np.random.default_rng(2)
    train = rng.integers(0, 300, size=20_000).astype(np.uint16)
    train[5] = 65_535
    train.tofile(tmp_path / "train.bin")
    rng.integers(0, 300, size=3000).astype(np.uint16).tofile(tmp_path / "val.bin")
    cfg = node(
        name="tokens",
        train=str(tmp_path / "train.bin"),
        val=str(tmp_path / "val.bin"),
        dtype="uint16",
        vocab_size=None,
        block_size=32,
    )
    with caplog.at_level("WARNING", logger="runner"):
        assert build_tokens(cfg).num_classes == 65_536
    (said,) = [r.getMessage() for r in caplog.records if "data.vocab_size=null" in r.getMessage()]
    assert "id 65535 appears only 1 time(s)" in said and "next largest id is 299" in said
    assert f"data.train={tmp_path / 'train.bin'}" in said
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner"):
        build_tokens(node(**{**cfg, "vocab_size": 70_000}))
        rng.integers(0, 300, size=20_000).astype(np.uint16).tofile(tmp_path / "train.bin")
        assert build_tokens(cfg).num_classes == 300
    assert "data.vocab_size=null" not in caplog.text


def test_tokens_errors(tmp_path):
    train = np.arange(1000, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    train[:200].tofile(tmp_path / "val.bin")
    good = dict(
        train=str(tmp_path / "train.bin"),
        val=str(tmp_path / "val.bin"),
        dtype="uint16",
        vocab_size=None,
        block_size=16,
    )

    err = check_error(build_tokens, node(**{**good, "vocab_size": 500}))
    assert err.key == "data.vocab_size" and "999" in str(err) and "train.bin" in str(err)

    (tmp_path / "odd.bin").write_bytes(train.tobytes()[:-1])  # a truncated file
    for check in (check_tokens, build_tokens):
        err = check_error(check, node(**{**good, "val": str(tmp_path / "odd.bin")}))
        assert err.key == "data.val" and "odd.bin" in str(err)
        assert "not a multiple of 2" in str(err)
    (tmp_path / "six.bin").write_bytes(b"\x00" * 6)
    err = check_error(
        check_tokens, node(**{**good, "dtype": "uint32", "train": str(tmp_path / "six.bin")})
    )
    assert err.key == "data.train" and "not a multiple of 4" in str(err)

    err = check_error(check_tokens, node(**{**good, "dtype": "int64"}))
    assert err.key == "data.dtype" and "uint16, uint32" in str(err)
    err = check_error(check_tokens, node(**{**good, "train": str(tmp_path / "nope.bin")}))
    assert err.key == "data.train" and "does not exist" in str(err)
    (tmp_path / "empty.bin").write_bytes(b"")
    err = check_error(check_tokens, node(**{**good, "val": str(tmp_path / "empty.bin")}))
    assert err.key == "data.val" and "empty" in str(err)
    err = check_error(check_tokens, node(**{**good, "block_size": 500}))
    assert err.key == "data.block_size" and "only 200 tokens" in str(err)


def test_a_file_of_the_other_width_is_refused_before_any_work(tmp_path):
    """GPT-2's ids written as uint32 and read as uint16 trained on every second token 0; ids
    written as uint16 and read as uint32 made a vocabulary of millions and ran out of memory in
    the first step (598 GiB of logits). Both are refused at plan time, naming the file; files
    of the right width, a real uint32 vocabulary over 65,536 included, pass."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50_257, size=4000)
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")
    ids.astype(np.uint32).tofile(tmp_path / "u32.bin")
    rng.integers(0, 200_000, size=4000).astype(np.uint32).tofile(tmp_path / "big32.bin")
    both16 = dict(train=str(tmp_path / "u16.bin"), val=str(tmp_path / "u16.bin"))
    base = dict(name="tokens", dtype="uint16", vocab_size=None, block_size=16, **both16)

    err = check_error(check_tokens, node(**{**base, "val": str(tmp_path / "u32.bin")}))
    assert err.key == "data.val" and "u32.bin" in str(err)
    assert "every second token of its first 8000" in str(err) and "uint32" in str(err)
    err = check_error(check_tokens, node(**{**base, "dtype": "uint32"}))
    assert err.key == "data.train" and "u16.bin" in str(err)
    assert f"largest id is {ids.max()}:" in str(err) and "2-byte (uint16) ids" in str(err)

    check_tokens(node(**base))
    for name in ("u32.bin", "big32.bin"):
        path = str(tmp_path / name)
        check_tokens(node(**{**base, "dtype": "uint32", "train": path, "val": path}))


# ---- data=synthetic_text -----------------------------------------------------------------------
def conditional_entropy(tokens: np.ndarray, vocab: int) -> float:
    """The empirical entropy (nats) of a token given the two before it."""
    t = tokens.astype(np.int64)
    counts = np.bincount((t[:-2] * vocab + t[1:-1]) * vocab + t[2:], minlength=vocab**3)
    counts = counts.reshape(vocab * vocab, vocab).astype(np.float64)
    context = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, context, out=np.ones_like(counts), where=counts > 0)
    return float(-(counts * np.log(p)).sum() / counts.sum())


def synthetic(**keys):
    base = dict(
        name="synthetic_text",
        vocab_size=64,
        num_train=50_000,
        num_val=5000,
        block_size=32,
        seed=0,
        branching=4,
    )
    return build_synthetic_text(node(**{**base, **keys}))


def test_synthetic_text_is_deterministic_and_seeded():
    a, b, c = synthetic(), synthetic(), synthetic(seed=1)
    assert np.array_equal(a.train.tokens(), b.train.tokens())
    assert np.array_equal(a.val.tokens(), b.val.tokens())
    assert not np.array_equal(a.train.tokens(), c.train.tokens())
    assert a.num_classes == 64 and a.task == LANGUAGE_MODEL and a.block_size == 32
    assert len(a.train) == 49_999 // 32 and len(a.val) == 4999 // 32
    for bundle in (a, c):
        for split in (bundle.train, bundle.val):
            assert int(split.tokens().max()) < 64 and len(np.unique(split.tokens())) == 64
    # train and val are consecutive stretches of one stream, not the same stretch
    stream = SyntheticLanguage(64, 4, 0).sample(55_000)
    assert np.array_equal(np.concatenate([a.train.tokens(), a.val.tokens()]), stream)
    assert not np.array_equal(a.val.tokens()[:100], a.train.tokens()[:100])
    assert synthetic_text_vocab_size(node(vocab_size=100)) == 100
    assert synthetic_text_vocab_size(node()) == 64
    x, y = a.train[5]
    assert torch.equal(y[:-1], x[1:]) and x.dtype == torch.int64
    assert_same_items(all_items(pickle.loads(pickle.dumps(a.val))), all_items(a.val))


def test_synthetic_text_is_learnable_and_not_periodic():
    bundle = synthetic(num_train=200_000)
    language = SyntheticLanguage(64, 4, 0)
    tokens = bundle.train.tokens()
    h = conditional_entropy(tokens, 64)
    assert 0.3 < language.entropy_rate <= math.log(4) + 1e-9
    assert h < 0.5 * math.log(64)  # far below ln(vocab): a model can learn it
    assert abs(h - language.entropy_rate) < 0.1  # ... down to the documented floor
    # given only the previous token the next one stays uncertain: the context is two tokens
    t = tokens.astype(np.int64)
    pairs = np.bincount(t[:-1] * 64 + t[1:], minlength=64 * 64).reshape(64, 64).astype(float)
    p = np.divide(pairs, pairs.sum(1, keepdims=True), out=np.ones_like(pairs), where=pairs > 0)
    assert -(pairs * np.log(p)).sum() / pairs.sum() > h + 0.8
    # not periodic: many distinct 16-grams
    grams = {tokens[i : i + 16].tobytes() for i in range(0, 100_000, 16)}
    assert len(grams) > 6000


def test_synthetic_text_errors():
    with pytest.raises(ConfigError) as err:
        synthetic(branching=100)
    assert err.value.key == "data.branching"
    with pytest.raises(ConfigError) as err:
        synthetic(num_train=10)
    assert err.value.key == "data.num_train"
    # the minimum says what sets it (a bare ">= 65" left the user to guess)
    assert err.value.allowed == (
        "an integer >= 33 (tokens: one sequence of data.block_size=32, and the token after it)"
    )


# ---- the YAML options ------------------------------------------------------------------------
def test_the_yaml_options_build(tmp_path):
    """conf/data/{text,synthetic_text}.yaml, composed by Hydra with their schemas, build."""
    corpus = write_corpus(tmp_path / "corpus")
    cfg = compose_data(
        "data=text",
        f"data.path={corpus}",
        "data.block_size=16",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    check_text(cfg)
    assert text_vocab_size(cfg) == 256 and build_text(cfg).train[0][0].tolist() == list(
        b"The quick brown "
    )
    err = check_error(check_text, compose_data("data=text"))  # path: ??? in the YAML
    assert err.key == "data.path" and "not set" in str(err)
    bundle = build_synthetic_text(compose_data("data=synthetic_text", "data.num_train=5000"))
    assert bundle.num_classes == 64 and bundle.block_size == 64 and len(bundle.val) == 312


def test_exclude_leaves_files_out_of_the_corpus(tmp_path):
    """data.exclude: shell patterns on the relative path ("*" crosses folders) leave files out
    of the corpus (the standard library's folder holds site-packages); nothing left is an error
    that says so."""
    (tmp_path / "lib" / "site-packages" / "pkg").mkdir(parents=True)
    (tmp_path / "lib" / "os.py").write_text("import sys\n")
    (tmp_path / "lib" / "site-packages" / "pkg" / "mod.py").write_text("x = 1\n")
    base = dict(path=str(tmp_path / "lib"), glob="**/*.py")
    _, every = text.corpus_files(node(**base))
    assert [rel for rel, _ in every] == ["os.py", "site-packages/pkg/mod.py"]
    _, kept = text.corpus_files(node(**base, exclude=["site-packages/*"]))
    assert [rel for rel, _ in kept] == ["os.py"]
    with pytest.raises(ConfigError, match="less data.exclude"):
        text.corpus_files(node(**base, exclude=["*.py"]))


def test_hidden_files_are_not_part_of_the_corpus(tmp_path):
    """Jupyter's `.ipynb_checkpoints/` holds a copy of each file opened (the text twice, some of
    it in both the training and the validation part), macOS leaves `._<name>` forks (binary) and
    `.git/` its objects: all left out, unless the glob itself names a hidden part."""
    (tmp_path / "corpus" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("alpha\n")
    (tmp_path / "corpus" / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("alpha\n")
    (tmp_path / "corpus" / "._a.txt").write_bytes(b"\x00\x05\x16\x07Mac OS X")
    _, files = text.corpus_files(node(path=str(tmp_path / "corpus"), glob="**/*.txt"))
    assert [rel for rel, _ in files] == ["a.txt"]
    named = node(path=str(tmp_path / "corpus"), glob=".ipynb_checkpoints/*.txt")
    _, files = text.corpus_files(named)
    assert [rel for rel, _ in files] == [".ipynb_checkpoints/a-checkpoint.txt"]
