"""Language models, first class: a text corpus and a user's own GPT package written
into a temporary folder and trained through the real CLI into a real SQLite MLflow store (by
`_target_`, and the built-in `model=gpt_tiny data=text`, at two levels and as a sweep); a Hugging
Face llama by type; every precision feature on the GPT (bf16 presets, stochastic rounding, fp8 on
every projection, range diagnostics, memory by kind, compile, checkpoint/resume bit for bit); the
report's language-model columns; and each bad input, refused before any work.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError
from runner.run import app
from runner.run.plan import make_plan
from tests.helpers.runs import compose_config, run_cli, run_in_process
from tests.helpers.store import VARIABLE, all_runs

LM_EPOCH_METRICS = [
    "val_loss",
    "val_perplexity",
    "val_token_acc",
    "tokens_per_s",
    "samples_per_s",
    "epoch_tokens_per_s",
    "epoch_samples_per_s",
    "epoch_time_s",
    "peak_mem_mb",
    "loss_scale",
    "skipped_steps",
]
LM_FINAL_METRICS = ["best_val_loss", "train_time_s"]

# a tiny GPT and a synthetic language that trains in seconds on a CPU
FAST_LM = [
    "model=gpt_tiny",
    "data=synthetic_text",
    "data.num_train=6144",
    "data.num_val=1024",
    "data.block_size=32",
    "trainer.batch_size=16",
    "trainer.max_epochs=2",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=4",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.eps=1e-6",
    "trainer.device=cpu",
]

MYLM = '''
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class TinyGPT(nn.Module):
    """A user's own 2-layer decoder: embeddings, two pre-norm blocks, a head."""

    def __init__(self, vocab_size=256, block_size=32, width=32, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(block_size, width)
        layer = lambda: nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0,
                                                   batch_first=True, norm_first=True)
        self.blocks = nn.ModuleList([layer() for _ in range(layers)])
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(h)


class Windows(Dataset):
    def __init__(self, ids, block):
        self.ids, self.block = torch.tensor(ids, dtype=torch.long), block

    def __len__(self):
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i):
        s = i * self.block
        return self.ids[s:s + self.block], self.ids[s + 1:s + self.block + 1]


def text(path, block_size=32):
    """Byte-level text from a local file: (train, val) windows, the last tenth for validation."""
    ids = list(open(path, "rb").read())
    cut = int(len(ids) * 0.9)
    return Windows(ids[:cut], block_size), Windows(ids[cut:], block_size)


class SeqCE(nn.Module):
    """A token-level cross-entropy: the task hands it (tokens, vocabulary) logits."""

    def forward(self, logits, targets):
        return nn.functional.cross_entropy(logits, targets)
'''


def corpus(folder: Path) -> Path:
    """A small English corpus in several files (and a file the default glob skips)."""
    folder.mkdir(parents=True, exist_ok=True)
    sentences = [
        "the quick brown fox jumps over the lazy dog. ",
        "a stitch in time saves nine. ",
        "all that glitters is not gold. ",
        "mixed precision keeps the master weights in float32. ",
    ]
    for i in range(4):
        (folder / f"part{i}.txt").write_text("".join(sentences[(i + j) % 4] for j in range(60)))
    (folder / "notes.md").write_text("# not text for the default glob\n")
    return folder


def metric_names(run) -> set[str]:
    return set(run.data.metrics)


def _lm_contract(run, level: str):
    assert run.info.status == "FINISHED", run.data.tags.get("error")
    names = metric_names(run)
    for name in [*LM_EPOCH_METRICS, *LM_FINAL_METRICS, "train_loss"]:
        assert name in names, f"{name} not logged ({sorted(names)})"
        assert math.isfinite(run.data.metrics[name]), name
    assert "val_acc" not in names and "best_val_acc" not in names
    loss = run.data.metrics["val_loss"]
    assert run.data.metrics["val_perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert 0 <= run.data.metrics["val_token_acc"] <= 1
    assert run.data.params["task.name"] == "language_model"
    assert run.data.params["precision.opt_level"] == level.upper()[:2]


# ---- through the CLI, as a user runs it -------------------------------------------------------
@pytest.mark.slow
def test_a_users_gpt_package_and_the_builtin_gpt_train_on_text(tmp_path):
    """A user's command (their own GPT, their byte-level data and a token cross-entropy, each by
    `_target_`) now trains; the built-in gpt_tiny on a text folder at O2, then as a sweep of two
    levels with DataLoader workers on (the default) and the progress bar: FINISHED runs with the
    language-model metrics, and the sweep returns."""
    (tmp_path / "mylm.py").write_text(MYLM)  # the launch folder: on the path of `python -m`
    text_dir = corpus(tmp_path / "corpus")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [
        "trainer.max_epochs=1",
        "trainer.batch_size=16",
        "trainer.device=cpu",
        "trainer.log_every_n_steps=2",
        f"mlflow.tracking_uri={uri}",
        "optimizer=adamw",
        "optimizer.lr=0.003",
        "optimizer.eps=1e-6",
    ]
    # that command: no task named, the dataset's integer token sequences tell it
    own = run_cli(
        "model=custom",
        "model._target_=mylm.TinyGPT",
        "data=custom",
        "data._target_=mylm.text",
        f"+data.path={text_dir / 'part0.txt'}",
        "data.num_classes=256",
        "loss=custom",
        "loss._target_=mylm.SeqCE",
        "precision=o2_bf16",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        *common,
        cwd=tmp_path,
    )
    assert own.returncode == 0, own.stdout + own.stderr
    assert "the run is a language model's (task=language_model)" in own.stdout + own.stderr
    builtin = ["model=gpt_tiny", "data=text", f"data.path={text_dir}", "data.block_size=32"]
    done = run_cli(
        *builtin,
        "precision=o2_bf16",
        "trainer.num_workers=0",
        "trainer.progress_bar=false",
        *common,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    swept = run_cli("-m", *builtin, "precision=o0,o1_bf16", *common, cwd=tmp_path, timeout=900)
    assert swept.returncode == 0, swept.stdout + swept.stderr

    runs = {
        (r.info.run_name, r.data.tags.get("mlflow.parentRunId") is not None): r
        for r in all_runs(uri)
    }
    _lm_contract(runs[("TinyGPT-O2-bf16", False)], "o2")
    assert runs[("TinyGPT-O2-bf16", False)].data.params["loss._target_"] == "mylm.SeqCE"
    for name, level, in_sweep in (
        ("gpt_tiny-O2-bf16", "o2", False),
        ("gpt_tiny-O0", "o0", True),
        ("gpt_tiny-O1-bf16", "o1", True),
    ):
        run = runs[(name, in_sweep)]
        _lm_contract(run, level)
        assert run.data.params["data.num_classes"] == "256"  # byte-level: the vocabulary
    # the sweep's parent reports success; the report has the language-model columns
    report = run_in_process_report(uri, tmp_path / "report")
    assert "best val loss (nats/token)" in report and "perplexity" in report
    assert "throughput (tokens/s)" in report and "best val acc" not in report
    # the figures draw the loss, and their files say so (they were named for accuracy)
    figures = {p.name for p in (tmp_path / "report").glob("*.png")}
    assert figures == {"time_memory_loss.png", "memory_by_kind.png", "val_loss_curves.png"}
    assert "](val_loss_curves.png)" in report and "](time_memory_loss.png)" in report


def run_in_process_report(uri: str, out: Path) -> str:
    from runner.report.cli import main as report_main
    from runner.report.tables import TABLE_MD

    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    return (out / TABLE_MD).read_text()


# ---- every precision feature on the GPT ---------------------------------------------------------
def _one(tracking_uri: str, *overrides: str) -> tuple[float, object]:
    cfg = compose_config(*FAST_LM, *overrides, f"mlflow.tracking_uri={tracking_uri}")
    best = app.run(cfg)
    client = MlflowClient(tracking_uri)
    run = client.get_run(
        client.search_runs(
            [client.get_experiment_by_name("amp-runner").experiment_id],
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )[0].info.run_id
    )
    return best, run


@pytest.mark.parametrize("preset", ["o0", "o1_bf16", "o2_bf16", "o3_bf16", "o3_bf16_sr"])
def test_gpt_tiny_learns_at_every_bf16_level(preset, tracking_uri):
    """Each level trains the GPT on the synthetic language: the returned objective is the best
    validation loss (minimised), below the uniform guess ln(64) by a margin after two short
    epochs, and every language-model metric is logged; O2 keeps fp32 masters (memory by kind)."""
    best, run = _one(tracking_uri, f"precision={preset}")
    _lm_contract(run, preset)
    assert best == pytest.approx(run.data.metrics["best_val_loss"])
    assert best < math.log(64) - 0.3, best
    if preset.startswith("o2"):
        assert run.data.metrics["mem_master_weights_mb"] > 0
    if preset == "o3_bf16_sr":
        assert run.data.params["precision.stochastic_rounding"] == "True"


def test_a_vocabulary_padded_past_the_datas_trains(tracking_uri):
    """model.vocab_size above the data's (nanoGPT pads GPT-2's 50257 tokens to 50304, a multiple
    of 64 for the GEMMs): the plan accepts the wider logits (the model-output check on the meta
    device included), the run learns, and the padded logits are never a target."""
    best, run = _one(tracking_uri, "precision=o1_bf16", "model.vocab_size=80")
    _lm_contract(run, "o1")
    assert run.data.params["model.vocab_size"] == "80"
    # it starts at ln(80) = 4.38 (16 logits no target ever takes); the unpadded model reaches
    # 3.82 in these two short epochs, the padded one 3.93 (the padding's mass is learnt away)
    assert best < math.log(64) - 0.15, best


def test_a_language_model_narrower_than_the_vocabulary_is_refused():
    """The output check still refuses logits over fewer tokens than the data has (a user's
    model by _target_, which check_vocabulary cannot read), before any work."""
    with pytest.raises(ConfigError) as info:
        make_plan(
            compose_config(
                "model=custom",
                "model._target_=torch.nn.Embedding",
                "+model.num_embeddings=64",
                "+model.embedding_dim=48",
                "data=synthetic_text",
                "task=language_model",
                "trainer.device=cpu",
            )
        )
    assert "outputs (2, 64, 48)" in str(info.value) and "V >= 64" in str(info.value)


def test_fp8_converts_every_gpt_projection(tracking_uri, tmp_path):
    """o1_fp8 on gpt_tiny: every Linear layer (q, k, v, proj and the MLP's up and down in both
    blocks, and the head: 13) runs in fp8 (emulated on a CPU), listed in fp8_layers.txt; it
    learns, and its losses follow o1_bf16's."""
    pytest.importorskip("torchao")
    best_fp8, run = _one(tracking_uri, "precision=o1_fp8")
    _lm_contract(run, "o1")
    assert run.data.params["precision.fp8_layers"] == "13"
    client = MlflowClient(tracking_uri)
    listing = open(
        client.download_artifacts(run.info.run_id, "fp8_layers.txt", str(tmp_path))
    ).read()
    for layer in ("blocks.0.attn.q", "blocks.1.attn.proj", "blocks.1.mlp.down", "head"):
        assert layer in listing, listing
    best_bf16, _ = _one(tracking_uri, "precision=o1_bf16")
    assert best_fp8 == pytest.approx(best_bf16, abs=0.1)


def test_diagnostics_and_compile_on_the_gpt(tracking_uri):
    """Range diagnostics reach every transformer layer (their per-layer metrics are logged), and
    a compiled GPT trains to the same losses as the eager one."""
    _, run = _one(
        tracking_uri,
        "precision=o2_bf16",
        "trainer.diagnose_every_n_steps=4",
        "trainer.max_epochs=1",
    )
    _lm_contract(run, "o2")
    assert any(name.startswith("diag_") for name in run.data.metrics), sorted(run.data.metrics)
    eager, _ = _one(tracking_uri, "precision=o0", "trainer.max_epochs=1")
    compiled, run = _one(
        tracking_uri, "precision=o0", "trainer.max_epochs=1", "trainer.compile=true"
    )
    assert "compile_time_s" in run.data.metrics
    assert compiled == pytest.approx(eager, abs=2e-3)


def test_a_gpt_run_resumes_bit_for_bit(tmp_path):
    """Two epochs straight against one epoch then resume=auto: identical per-step losses and
    per-epoch metrics, identical weights (o2_bf16: the fp32 masters and AdamW's moments come
    back exactly)."""
    from tests.helpers.resume import last_checkpoint
    from tests.helpers.store import runs_by_name

    def history(uri, run_id):
        client = MlflowClient(uri)
        return {
            name: sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
            for name in client.get_run(run_id).data.metrics
        }

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [
        *FAST_LM,
        "precision=o2_bf16",
        "scheduler=none",
        f"mlflow.tracking_uri={uri}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
    ]
    app.run(compose_config(*common, "trainer.max_epochs=2", "mlflow.run_name=straight"))
    app.run(compose_config(*common, "trainer.max_epochs=1", "mlflow.run_name=resumed"))
    best = app.run(
        compose_config(*common, "trainer.max_epochs=2", "mlflow.run_name=resumed", "resume=auto")
    )
    runs = runs_by_name(uri)
    got, want = (
        history(uri, runs["resumed"].info.run_id),
        history(uri, runs["straight"].info.run_id),
    )
    assert got.pop("best_val_loss")[-1] == want.pop("best_val_loss")[-1] == (2, best)
    # (its headline copy too: each session logs it at its end, the last is the run's)
    assert got.pop("summary/best_val_loss")[-1] == want.pop("summary/best_val_loss")[-1]
    for name in list(want):  # timings, memory by kind (measured once per session), the load
        if VARIABLE.search(name):
            got.pop(name, None), want.pop(name)
    for name in list(got):  # (the resumed session's own warm-up)
        if VARIABLE.search(name):
            got.pop(name)
    assert got == want
    a, b = last_checkpoint(tmp_path, "straight"), last_checkpoint(tmp_path, "resumed")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    # a finished run resumed again returns its best loss without training
    assert (
        app.run(
            compose_config(
                *common, "trainer.max_epochs=2", "mlflow.run_name=resumed", "resume=auto"
            )
        )
        == best
    )


@pytest.mark.slow
def test_a_hugging_face_llama_trains_one_epoch(tracking_uri):
    """model=hf model.arch=llama at tiny sizes: built from its config class with random weights
    (nothing downloaded), its logits taken from the model output, one epoch at o2_bf16."""
    pytest.importorskip("transformers")
    best, run = _one(
        tracking_uri,
        "model=hf",
        "model.arch=llama",
        "+model.hidden_size=64",
        "+model.intermediate_size=128",
        "+model.num_hidden_layers=2",
        "+model.num_attention_heads=4",
        "+model.num_key_value_heads=2",
        "+model.max_position_embeddings=64",
        "precision=o2_bf16",
        "trainer.max_epochs=1",
    )
    _lm_contract(run, "o2")
    assert run.info.run_name == "llama-O2-bf16"
    assert run.data.tags["model.class"] == "runner.components.lm_models.HFCausalLM"
    assert math.isfinite(best)


# ---- bad input: exit 2 (or ConfigError), the key named, before any work -------------------------
@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (
            ["model=gpt_tiny", "data=synthetic_text", "model.vocab_size=32"],
            "model.vocab_size",
            "token ids go up to 63",
        ),
        (
            ["model=gpt_tiny", "data=synthetic_text", "data.block_size=64", "model.block_size=32"],
            "data.block_size",
            "context holds 32",
        ),
        (["model=tiny", "data=synthetic_text"], "model.name", "is an image classifier"),
        (["model=tiny", "data=synthetic_text"], "model.name", "or an image dataset (data=synth"),
        (["model=gpt_tiny", "data=synthetic"], "model.name", "is a language model"),
        # the data for the model named too: a language model's first run forgets the data
        (["model=gpt_tiny"], "model.name", "or text (data=synthetic_text, text, tokens)"),
        (
            ["model=tiny", "data=synthetic", "task=language_model"],
            "task.name",
            "is a classification dataset",
        ),
        (
            ["model=gpt_tiny", "data=synthetic_text", "task=classification"],
            "task.name",
            "is a text (language-model) dataset",
        ),
        (["model=gpt_tiny", "data=text", "data.path=/no/such/corpus"], "data.path", "/no/such"),
    ],
)
def test_bad_language_model_input_names_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        make_plan(compose_config(*overrides, "trainer.device=cpu"))
    assert info.value.key == key, str(info.value)
    assert words in str(info.value)


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_bad_corpus_or_tokenizer_stops_the_cli_before_any_run(tmp_path, capsys):
    """An empty corpus folder, and a tokenizer file that does not parse: exit 2, the key named,
    no traceback, no MLflow run."""
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{ not json")
    text_dir = corpus(tmp_path / "corpus")
    for args, key in (
        (["data.path=" + str(empty)], "data.path"),
        ([f"data.path={text_dir}", f"data.tokenizer={broken}"], "data.tokenizer"),
    ):
        code = run_in_process(
            "model=gpt_tiny",
            "data=text",
            *args,
            "trainer.device=cpu",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        )
        assert code == 2, args
        output = "".join(capsys.readouterr())
        assert key in output and "Traceback" not in output, output[-2000:]
    assert not (tmp_path / "mlflow.db").exists()


class SeesAhead(torch.nn.Module):
    """A language model of one's own without a causal mask: each position sees the mean of the
    whole sequence."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.emb = torch.nn.Embedding(num_classes, 16)
        self.head = torch.nn.Linear(16, num_classes)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + h.mean(dim=1, keepdim=True))


def test_a_segment_table_is_not_taken_for_a_short_positional_one():
    """BERT looks up its token types (2 rows, all zeros) over every position as it looks up the
    positions: planning took it for a positional table of 2 and refused data.block_size=64."""
    pytest.importorskip("transformers")
    tiny = ["+model.num_hidden_layers=1", "+model.hidden_size=32", "+model.num_attention_heads=2"]
    make_plan(compose_config("model=hf", "model.arch=bert", *tiny, "data=synthetic_text"))
    with pytest.raises(ConfigError, match="the model.s context holds 32"):
        make_plan(
            compose_config(
                "model=hf",
                "model.arch=bert",
                *tiny,
                "+model.max_position_embeddings=32",
                "data=synthetic_text",
            )
        )


class SeesAheadOverItsWholeContext(SeesAhead):
    """SeesAhead, which runs its whole context only (data.block_size=64), as a model with a
    learned position table of exactly that size may."""

    def forward(self, idx):
        assert idx.shape[1] == 64, "a sequence of the whole context"
        return super().forward(idx)


@pytest.mark.parametrize("model", ["SeesAhead", "SeesAheadOverItsWholeContext"])
def test_a_model_that_sees_the_tokens_it_predicts_is_refused_before_any_run(
    model, tracking_uri, capsys
):
    """Next-token training of a model that attends forwards teaches it to copy: its loss falls
    to nothing and means nothing. Two forwards of 16 tokens of the built model tell, before any
    run; of the whole context where the model runs no other length (it was not judged)."""
    code = run_in_process(
        "model=custom",
        f"model._target_=tests.integration.test_language_model_runs.{model}",
        "data=synthetic_text",
        "trainer.device=cpu",
        f"mlflow.tracking_uri={tracking_uri}",
    )
    output = "".join(capsys.readouterr())
    assert code == 2 and "Traceback" not in output, output[-2000:]
    assert f"model: {model} sees the tokens it predicts" in output
    assert not all_runs(tracking_uri)


def test_the_dry_run_checks_the_gpt_on_the_meta_device(capsys):
    """A dry run builds the GPT on the meta device and feeds it integer token ids: a (B, T, V)
    output passes, and the resolved task is printed with the config."""
    assert (
        run_in_process(
            "model=gpt2_small", "data=synthetic_text", "dry_run=true", "trainer.device=cpu"
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "name: gpt2_small" in out and "n_embd: 768" in out
    assert "Task: language_model (task=auto: the dataset's)" in out


@pytest.mark.parametrize("preset", ["o1", "o2", "o3"])
def test_the_fp16_levels_step_the_gpt(preset, tracking_uri):
    """Apex's fp16 levels on the GPT (emulated on a CPU: a few steps): O1 autocasts, O2 keeps
    fp32 masters with a dynamic loss scale, O3 runs pure fp16 (AdamW's eps 1e-6 survives fp16
    state); each ends FINISHED with finite language-model metrics."""
    best, run = _one(
        tracking_uri,
        f"precision={preset}",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=2",
        "trainer.warmup_steps=1",  # two steady steps: the steady tokens_per_s is logged
    )
    _lm_contract(run, preset)
    assert math.isfinite(best)
    assert run.data.metrics["loss_scale"] == (1.0 if preset == "o3" else 65536.0)


def test_shape_findings_name_n_embd_and_vocab_size():
    """A GPT whose width and vocabulary are not multiples of 8 (Tensor Cores) or 16 (fp8): the
    findings name the layers and the settings they come from, model.n_embd and
    model.vocab_size, with the padding advice for a vocabulary."""
    from runner.components.lm_models import GPT
    from runner.precision import resolve
    from runner.precision.checks import DeviceInfo, tensor_core_findings

    gpu = DeviceInfo("cuda", (9, 0), "NVIDIA H100")
    model = GPT(vocab_size=50257, block_size=32, n_layer=1, n_head=4, n_embd=100)
    (finding,) = tensor_core_findings(model, 16, resolve("O2", device=gpu).properties, gpu)
    assert (
        "blocks.0.attn.q (in_features 100 = model.n_embd, out_features 100 = model.n_embd)"
        in finding.message
    )
    assert "blocks.0.mlp.up (in_features 100 = model.n_embd)" in finding.message  # 400: fine
    assert (
        "head (in_features 100 = model.n_embd, out_features 50257 = model.vocab_size)"
        in finding.message
    )
    assert "set model.n_embd, model.vocab_size to multiples of 8" in finding.hint
    assert "50304" in finding.hint

    pytest.importorskip("torchao")
    from runner.precision.fp8 import convert

    small = GPT(vocab_size=250, block_size=32, n_layer=1, n_head=2, n_embd=64)
    conversion = convert(small, "tensorwise", emulate=True)
    assert conversion.skipped == [
        ("head", "out_features 250 = model.vocab_size not a multiple of 16")
    ]
    (finding,) = conversion.findings()
    assert "set model.vocab_size to multiples of 16" in finding.hint
