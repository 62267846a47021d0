"""Language models: a config section in, a randomly initialised causal language model out.

A language model maps token ids (B, T) to next-token logits (B, T, V). The builders keep the
project's signature `build_x(cfg, num_classes, small_input)`: for a language model `num_classes`
is the data's vocabulary size (the largest token id + 1) and `small_input` is ignored.

Two families:

* `GPT`, a decoder-only transformer written for this runner (nanoGPT-like). Every projection is
  an `nn.Linear` with a fixed, documented name (`blocks.N.attn.q/k/v/proj`, `blocks.N.mlp.up/down`,
  `head`) so that fp8 conversion (`runner.precision.fp8`) and per-layer precision plans can address
  each one by name. `model=gpt`, `gpt_tiny`, `gpt2_small` (`build_gpt`).
* Hugging Face transformers' causal language models by model type, with random weights and nothing
  downloaded: `model=hf model.arch=llama +model.hidden_size=64 ...`, checked and built by
  `runner.components.hf_models` and wrapped here (`HFCausalLM`, whose module path is the run's
  `model.class` tag).

`sees_ahead` tells, on the built model, whether a language model would see the tokens it
predicts.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from runner.config.values import heads_refusal
from runner.errors import ConfigError


# ---- the runner's GPT ------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: separate `q`, `k`, `v` projections (so a precision plan
    can treat each one on its own), PyTorch's fused scaled-dot-product attention, and the output
    projection `proj` back into the residual stream."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, n_head, T, head_dim), the layout SDPA takes."""
        b, t, c = x.shape
        return x.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        y = F.scaled_dot_product_attention(
            self._heads(self.q(x)),
            self._heads(self.k(x)),
            self._heads(self.v(x)),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward network: `up` to 4x the width, GELU, `down` back."""

    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2's layout, as in nanoGPT): token + learned position
    embeddings, `n_layer` pre-norm blocks, a final LayerNorm and a bias-free `head` to the
    vocabulary. forward(idx (B, T) int64) -> logits (B, T, vocab_size), T <= block_size.

    Module names are a contract that precision plans and fp8 conversion glob on: `tok_emb`,
    `pos_emb`, `drop`, `blocks.N.{ln1, attn.{q, k, v, proj}, ln2, mlp.{up, act, down}}`, `ln_f`,
    `head`. Initialised as GPT-2: N(0, 0.02) for Linear and Embedding weights, zero biases, and
    N(0, 0.02 / sqrt(2 * n_layer)) for the residual projections (`attn.proj`, `mlp.down`), so
    the residual stream's variance does not grow with depth. `tie_weights`: the head shares the
    token embedding's Parameter (GPT-2 does; saves vocab_size * n_embd parameters).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        tie_weights: bool = False,
        bias: bool = True,
    ):
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
        ):
            if int(value) < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.vocab_size = int(vocab_size)
        self.block_size = int(block_size)
        self.n_layer = int(n_layer)
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self._init_weights()
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.proj", "mlp.down")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def size_keys(self) -> dict[int, str]:
        """{layer size: the config key it comes from}: what a Tensor Core or fp8 shape finding
        names (runner.precision.checks.size_origins)."""
        n_embd = self.tok_emb.embedding_dim
        return {
            4 * n_embd: "4 x model.n_embd",
            n_embd: "model.n_embd",
            self.vocab_size: "model.vocab_size",
        }

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.block_size:
            raise ValueError(
                f"sequence length {t} is longer than the model's block_size {self.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- builders for the GPT --------------------------------------------------------------------
# the keys build_gpt reads, with their defaults (schema: runner.config.options.GPTConfig)
GPT_DEFAULTS: dict[str, Any] = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "block_size": 256,
    "vocab_size": None,
    "dropout": 0.0,
    "tie_weights": False,
    "bias": True,
}


def _value(cfg: Any, key: str, default: Any) -> Any:
    """`cfg.key` (a DictConfig, a dict or an object), `default` when absent or null."""
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def gpt_sizes(cfg: Any) -> dict[str, Any]:
    """The GPT's constructor arguments from the config (vocab_size: None = the data's)."""
    sizes = {key: _value(cfg, key, default) for key, default in GPT_DEFAULTS.items()}
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        sizes[key] = int(sizes[key])
    sizes["vocab_size"] = None if sizes["vocab_size"] is None else int(sizes["vocab_size"])
    sizes["dropout"] = float(sizes["dropout"])
    sizes["tie_weights"] = bool(sizes["tie_weights"])
    sizes["bias"] = bool(sizes["bias"])
    return sizes


def check_gpt(cfg: Any) -> None:
    """ConfigError, before any data or run exists, where the GPT's sizes do not fit together:
    n_head must divide n_embd. Each size's own range (n_layer >= 1, dropout in [0, 1), ...) is a
    value rule of the option's spec (`runner.config.options`), checked before this one."""
    sizes = gpt_sizes(cfg)
    if sizes["n_head"] >= 1 and sizes["n_embd"] % sizes["n_head"]:
        raise heads_refusal("n_embd", sizes["n_embd"], "n_head", sizes["n_head"])


def vocab_size_for(declared: Optional[int], num_classes: int) -> int:
    """The model's vocabulary (model=gpt's and model=hf's): the declared one (at least the
    data's), else the data's."""
    if declared is None:
        return int(num_classes)
    if int(declared) < int(num_classes):
        raise ConfigError(
            "model.vocab_size",
            f"is {declared}, but the data has token ids up to {int(num_classes) - 1}",
            f"null (the data's: {num_classes}) or an integer >= {num_classes}",
        )
    return int(declared)


def build_gpt(cfg: Any, num_classes: int, small_input: bool = False) -> GPT:
    """model=gpt (gpt_tiny, gpt2_small): the runner's GPT, random init, sized by the keys
    n_layer, n_head, n_embd, block_size, vocab_size (null: `num_classes`, the data's
    vocabulary), dropout, tie_weights and bias. `small_input` has no meaning for text."""
    check_gpt(cfg)
    sizes = gpt_sizes(cfg)
    sizes["vocab_size"] = vocab_size_for(sizes["vocab_size"], num_classes)
    return GPT(**sizes)


# ---- Hugging Face's, wrapped -----------------------------------------------------------------
class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as the runner's language model: forward(idx (B, T)) returns the
    logits tensor (B, T, V) alone, not transformers' output object. The wrapped model is
    `model`, so its layers are named `model.<transformers' names>` (e.g.
    `model.model.layers.0.self_attn.q_proj` for llama). Built by
    `runner.components.hf_models.build_hf`; defined here, beside the GPT, as a run records its
    model's class by module path (`model.class`: runner.components.lm_models.HFCausalLM)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=idx)
        logits = getattr(output, "logits", None)
        return output[0] if logits is None else logits


# ---- causality -------------------------------------------------------------------------------
def _two_forwards(model: nn.Module, vocab_size: int, length: int) -> Optional[list]:
    """The model's outputs for `length` random tokens and for the same with the last changed;
    None where it cannot run them."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)  # (the run's own random state is left alone)
    tokens = torch.randint(0, vocab_size, (1, length), generator=g)
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % vocab_size
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [model(t.to(device)) for t in (tokens, changed)]
    except Exception:  # noqa: BLE001
        return None
    finally:
        model.train(training)


def sees_ahead(model: nn.Module, vocab_size: int, block_size: int) -> bool:
    """Whether a language model's outputs at earlier positions change with a later token (it
    attends forwards, so it would see the tokens it predicts): two forwards, in eval mode and
    without gradients, of one sequence of up to 16 random tokens and of the same with its last
    token changed, on the model's device; of `block_size` tokens where the model runs only its
    whole context. False where the model cannot run them (the first step will tell why)."""
    if vocab_size < 2:
        return False
    for length in dict.fromkeys((min(int(block_size), 16), int(block_size))):
        outputs = _two_forwards(model, vocab_size, length) if length >= 2 else None
        if outputs is not None:
            break
    else:
        return False
    try:
        first, second = (o if isinstance(o, torch.Tensor) else o[0] for o in outputs)
        before = slice(0, length - 1)
        scale = first[:, before].abs().max().clamp_min(1.0)
        return not torch.allclose(
            first[:, before].float(),
            second[:, before].float(),
            rtol=1e-4,
            atol=1e-5 * float(scale),
        )
    except Exception:  # noqa: BLE001  (an output of another shape: the output check tells)
        return False
