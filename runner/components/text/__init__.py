"""Text datasets for next-token prediction: a `data` config section in, a `DataBundle` out.

Three sources, all yielding (x, y) pairs of `block_size` int64 token ids with y = x shifted by one
token (`TokenWindows`, windows.py):

* `data=text` (corpus.py): a text file or a folder of them, tokenised once (UTF-8 bytes, or a
  Hugging Face `tokenizer.json`; stream.py) into a cached flat token file in nanoGPT's layout
  (cache.py), the tail held out as validation. Later runs memory-map the cached file after
  checking it against its sidecar.
* `data=tokens` (tokens.py): flat token files tokenised elsewhere (nanoGPT's train.bin / val.bin).
* `data=synthetic_text` (synthetic.py): a seeded order-2 Markov language generated in memory, with
  a known entropy rate (the loss floor), for tests and benchmarks that must not touch the disk.

The `check_*` functions run at plan time (cheap: no tokenising, nothing read beyond sizes and a
tokenizer's JSON) and raise `ConfigError` naming the key (keys.py reads the keys); the
`*_vocab_size` functions give the vocabulary (the model's output size) without building anything.
The names below are what the config options (`runner.config.options`) and callers use.
"""

from runner.components.text.cache import cache_dir, cache_key  # noqa: F401  (re-exported)
from runner.components.text.corpus import (  # noqa: F401  (re-exported)
    build_text,
    check_text,
    corpus_files,
    load_tokenizer,
    text_vocab_size,
    tokenised_corpus,
)
from runner.components.text.synthetic import (  # noqa: F401  (re-exported)
    SyntheticLanguage,
    build_synthetic_text,
    synthetic_text_vocab_size,
)
from runner.components.text.tokens import (  # noqa: F401  (re-exported)
    build_tokens,
    check_tokens,
    tokens_vocab_size,
)
from runner.components.text.windows import TokenWindows  # noqa: F401  (re-exported)
