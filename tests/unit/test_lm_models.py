"""The language models of runner.components.lm_models: the runner's GPT (shapes, causality, the
module-name contract, weight tying, initialisation, bf16, that it learns) and its builders, and
Hugging Face causal LMs built by model type offline with random weights. Tiny sizes, CPU."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F

from runner.components import hf_models, lm_models
from runner.components.lm_models import GPT, build_gpt
from runner.errors import ConfigError

TINY = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)  # gpt_tiny's sizes


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{**TINY, **overrides})


def _tokens(batch: int, length: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- GPT ---------------------------------------------------------------------------------
def test_gpt_maps_token_ids_to_logits_per_position():
    model = _gpt()
    logits = model(_tokens(3, 17))
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model(_tokens(2, 64)).shape == (2, 64, 256)  # the full context


def test_gpt_refuses_a_sequence_longer_than_its_context():
    with pytest.raises(ValueError, match=r"65.*64"):
        _gpt()(_tokens(1, 65))


def test_gpt_refuses_a_width_the_heads_do_not_divide():
    with pytest.raises(ValueError, match="divisible"):
        GPT(vocab_size=32, block_size=8, n_layer=1, n_head=3, n_embd=64)


def test_gpt_is_causal():
    """A position's logits depend on the tokens up to it, never on later ones."""
    model = _gpt().eval()
    idx = _tokens(2, 24)
    t = 10
    changed_future = idx.clone()
    changed_future[:, t + 1 :] = (idx[:, t + 1 :] + 7) % 256
    changed_now = idx.clone()
    changed_now[:, t] = (idx[:, t] + 7) % 256
    with torch.no_grad():
        base, future, now = model(idx), model(changed_future), model(changed_now)
    assert torch.equal(base[:, : t + 1], future[:, : t + 1])
    assert not torch.allclose(base[:, t + 1 :], future[:, t + 1 :])
    assert torch.equal(base[:, :t], now[:, :t])
    assert not torch.allclose(base[:, t], now[:, t])


def test_gpt_module_names_are_the_contract_and_fp8_sized():
    model = _gpt()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {f"blocks.{i}.attn.{p}" for i in (0, 1) for p in ("q", "k", "v", "proj")}
    expected |= {f"blocks.{i}.mlp.{p}" for i in (0, 1) for p in ("up", "down")} | {"head"}
    assert set(linears) == expected
    for name, layer in linears.items():
        assert layer.in_features % 16 == 0 and layer.out_features % 16 == 0, name
    modules = dict(model.named_modules())
    assert isinstance(modules["tok_emb"], nn.Embedding)
    assert isinstance(modules["pos_emb"], nn.Embedding) and modules["pos_emb"].num_embeddings == 64
    assert isinstance(modules["drop"], nn.Dropout)
    for i in (0, 1):
        assert isinstance(modules[f"blocks.{i}.ln1"], nn.LayerNorm)
        assert isinstance(modules[f"blocks.{i}.ln2"], nn.LayerNorm)
        assert isinstance(modules[f"blocks.{i}.mlp.act"], nn.GELU)
        assert modules[f"blocks.{i}.mlp.up"].out_features == 4 * 64
    assert isinstance(modules["ln_f"], nn.LayerNorm)
    assert modules["head"].bias is None and modules["head"].out_features == 256
    assert modules["blocks.0.attn.q"].bias is not None
    assert _gpt(bias=False).blocks[0].attn.q.bias is None


def test_tied_weights_stay_one_parameter():
    tied, untied = _gpt(tie_weights=True), _gpt()
    assert tied.head.weight is tied.tok_emb.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 256 * 64
    optimizer = torch.optim.SGD(tied.parameters(), lr=0.5)
    before = tied.tok_emb.weight.detach().clone()
    idx = _tokens(2, 16)
    F.cross_entropy(tied(idx).flatten(0, 1), idx.flatten()).backward()
    optimizer.step()
    assert tied.head.weight is tied.tok_emb.weight
    assert torch.equal(tied.head.weight, tied.tok_emb.weight)
    assert not torch.equal(before, tied.tok_emb.weight)


def test_gpt_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
    pattern = torch.tensor([3, 17, 42, 8, 29, 55, 11, 60])
    stream = pattern.repeat(5)  # 40 tokens
    x = torch.stack([stream[i : i + 32] for i in range(4)])
    y = torch.stack([stream[i + 1 : i + 33] for i in range(4)])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(200):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(64)) < 0.5  # starts from chance
    assert losses[-1] < 0.3 < math.log(64)


def test_gpt_initialisation_is_gpt2s():
    model = _gpt(n_layer=4, n_embd=128, vocab_size=512, block_size=128)
    residual = 0.02 / math.sqrt(2 * 4)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            want = residual if name.endswith(("attn.proj", "mlp.down")) else 0.02
            std = module.weight.std().item()
            assert abs(std - want) < 0.05 * want, (name, std, want)
            assert abs(module.weight.mean().item()) < 0.1 * want, name
        if isinstance(module, nn.Linear) and module.bias is not None:
            assert torch.count_nonzero(module.bias) == 0, name


def test_gpt_runs_forward_and_backward_in_bfloat16():
    model = _gpt().to(torch.bfloat16)
    idx = _tokens(2, 16)
    logits = model(idx)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_gpt_dropout_is_active_in_training_only():
    model = _gpt(dropout=0.5)
    idx = _tokens(1, 8)
    with torch.no_grad():
        assert not torch.equal(model.train()(idx), model(idx))
        assert torch.equal(model.eval()(idx), model(idx))


# ---- build_gpt -----------------------------------------------------------------------------
def _node(**keys):
    return OmegaConf.create({"name": "gpt_tiny", **keys})


def test_build_gpt_takes_the_datas_vocabulary_by_default():
    model = build_gpt(
        _node(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=None),
        num_classes=50,
        small_input=False,
    )
    assert isinstance(model, GPT)
    assert model.tok_emb.num_embeddings == 50 and model.head.out_features == 50
    assert model.pos_emb.num_embeddings == 16 and len(model.blocks) == 1
    assert model(_tokens(2, 16, vocab=50)).shape == (2, 16, 50)


def test_build_gpt_defaults_and_a_larger_declared_vocabulary():
    model = build_gpt(OmegaConf.create({"name": "gpt", "vocab_size": 300}), 256, False)
    assert model.head.out_features == 300
    assert (len(model.blocks), model.block_size, model.tok_emb.embedding_dim) == (2, 256, 64)
    tied = build_gpt(
        {"name": "gpt", "tie_weights": True, "bias": False, "block_size": 8}, 20, False
    )
    assert tied.head.weight is tied.tok_emb.weight and tied.blocks[0].mlp.up.bias is None


def test_build_gpt_refuses_a_vocabulary_smaller_than_the_datas():
    with pytest.raises(ConfigError, match="token ids up to 255") as err:
        build_gpt(_node(vocab_size=100, block_size=16), num_classes=256, small_input=False)
    assert err.value.key == "model.vocab_size"


def test_build_gpt_on_the_meta_device():
    """The planning check builds models on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        model = build_gpt(_node(block_size=16), 50, False)
    out = model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert out.shape == (2, 16, 50) and out.is_meta


def test_check_gpt_names_the_key():
    with pytest.raises(ConfigError) as err:
        lm_models.check_gpt(_node(n_embd=64, n_head=5))
    assert err.value.key == "model.n_head"


# ---- Hugging Face ------------------------------------------------------------------------
LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_hf_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(ConfigError, match="needs transformers") as err:
        hf_models.check_hf(_hf("llama"))
    assert err.value.key == "model" and "amp-runner[hf]" in err.value.allowed


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _hf(arch, **keys):
    return OmegaConf.create({"name": "hf", "arch": arch, **keys})


def test_hf_llama_builds_offline_with_the_datas_vocabulary(transformers):
    torch.manual_seed(0)
    model = hf_models.build_hf(_hf("llama", **LLAMA), num_classes=96, small_input=False)
    assert os.environ["HF_HUB_OFFLINE"] and os.environ["TRANSFORMERS_OFFLINE"]
    assert isinstance(model, lm_models.HFCausalLM)
    assert isinstance(model.model, transformers.LlamaForCausalLM)
    assert model.model.config.vocab_size == 96 and model.model.config.hidden_size == 64
    assert len(model.model.model.layers) == 2
    logits = model(_tokens(2, 12, vocab=96))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 12, 96)
    assert torch.isfinite(logits).all()
    logits.float().mean().backward()
    assert model.model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_hf_gpt2_builds_with_its_own_key_names(transformers):
    node = _hf("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=128)
    hf_models.check_hf(node)
    model = hf_models.build_hf(node, num_classes=40, small_input=False)
    assert isinstance(model.model, transformers.GPT2LMHeadModel)
    assert model(_tokens(3, 10, vocab=40)).shape == (3, 10, 40)
    declared = hf_models.build_hf(
        _hf("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64), 40, False
    )
    assert declared(_tokens(1, 5, vocab=40)).shape == (1, 5, 64)


def test_hf_refuses_a_vocabulary_smaller_than_the_datas(transformers):
    with pytest.raises(ConfigError) as err:
        hf_models.build_hf(_hf("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=10), 40, False)
    assert err.value.key == "model.vocab_size"


def test_check_hf_suggests_the_model_type(transformers):
    with pytest.raises(
        ConfigError, match="unknown Hugging Face model type 'lama'; closest: llama"
    ) as err:
        hf_models.check_hf(_hf("lama", **LLAMA))
    assert err.value.key == "model.arch"


def test_check_hf_refuses_a_type_without_a_causal_lm(transformers):
    with pytest.raises(ConfigError, match="'vit'.*no causal language model") as err:
        hf_models.check_hf(_hf("vit"))
    assert err.value.key == "model.arch"


def test_check_hf_refuses_an_unknown_setting(transformers):
    with pytest.raises(
        ConfigError, match="has no setting 'hiden_size'; closest: hidden_size"
    ) as err:
        hf_models.check_hf(_hf("llama", hiden_size=64))
    assert err.value.key == "model.hiden_size"


@pytest.mark.parametrize(
    "key, value",
    [
        ("pretrained_model_name_or_path", "meta-llama/Llama-2-7b"),
        ("name_or_path", "gpt2"),
        ("pretrained", True),
        ("weights", "DEFAULT"),
    ],
)
def test_check_hf_refuses_downloads(transformers, key, value):
    with pytest.raises(ConfigError, match="nothing may be downloaded") as err:
        hf_models.check_hf(_hf("llama", **{key: value}))
    assert err.value.key == f"model.{key}"


def test_check_hf_reports_values_the_config_rejects(transformers):
    with pytest.raises(ConfigError, match="not a multiple"):
        hf_models.check_hf(_hf("llama", hidden_size=63, num_attention_heads=4))


# ---- causality -----------------------------------------------------------------------------------
class Bidirectional(nn.Module):
    """A "language model" whose every position sees the mean of the whole sequence."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + h.mean(dim=1, keepdim=True))


def test_a_model_that_sees_later_tokens_is_told_from_a_causal_one():
    gpt, both = _gpt().train(), Bidirectional()
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    assert not lm_models.sees_ahead(gpt, 256, 32) and gpt.training  # mode given back
    assert lm_models.sees_ahead(both, 64, 32)
    assert not lm_models.sees_ahead(both, 64, 1)  # one position: nothing to see
    dict_out = nn.Module()
    dict_out.forward = lambda idx: {"logits": both(idx)}  # (not judged: the output check tells)
    assert not lm_models.sees_ahead(dict_out, 64, 32)
    assert torch.equal(torch.rand(2), expected)  # the run's random state is left alone


BERT = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)


def test_an_encoders_causal_lm_head_is_built_as_a_decoder(transformers, caplog):
    """transformers' BertLMHeadModel attends both ways unless its config says is_decoder: a
    run on next-token prediction would see the tokens it predicts."""
    with caplog.at_level("INFO", logger="runner.components.hf_models"):
        model = hf_models.build_hf(_hf("bert", **BERT), num_classes=64, small_input=False)
    assert model.model.config.is_decoder and not lm_models.sees_ahead(model, 64, 32)
    assert "model.arch=bert is an encoder with a causal LM head: built with is_decoder=true" in (
        caplog.text
    )
    with pytest.raises(ConfigError) as bad:  # said so: refused in planning
        hf_models.check_hf(_hf("bert", is_decoder=False, **BERT))
    assert bad.value.key == "model.is_decoder" and "sees the tokens it predicts" in str(bad.value)
    gpt2 = hf_models.build_hf(_hf("gpt2", n_embd=32, n_layer=1, n_head=2), 64, False)
    assert not getattr(gpt2.model.config, "is_decoder", False)  # a decoder's type: as it is
