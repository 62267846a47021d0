"""A model's training FLOPs per sample, counted on the meta device: a Linear stack's 6 FLOPs per
weight and sample, GPT-2 small against nanoGPT's 6N + 12LTd (attention included), ResNet-18
against its known multiply-adds, and a model the meta device cannot run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.components.models import build_model
from runner.measure.flops import training_flops_per_sample
from tests.helpers.runs import compose_config


def test_a_linear_stack_costs_six_flops_per_weight_and_sample():
    """Forward 2 per weight (a multiply-add), backward 4 (the input's and the weight's
    gradients): 6 x params x batch for the batch."""
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(64, 256, bias=False),
            nn.ReLU(),
            nn.Linear(256, 128, bias=False),
            nn.ReLU(),
            nn.Linear(128, 10, bias=False),
        )
    params = sum(p.numel() for p in model.parameters())
    batch = 8
    per_sample = training_flops_per_sample(model, (64,), batch=batch)
    assert per_sample * batch == 6 * params * batch
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_gpt2_small_matches_nanogpts_formula_with_attention():
    """nanoGPT's estimate per token: 6N + 12 * n_layer * T * n_embd, N the parameters the
    products use (its head shares the token embedding's weights; the runner's gpt2_small keeps
    a head of its own, and an embedding lookup is no product: N leaves out both embeddings but
    counts the head), T the context; within 5%."""
    cfg = compose_config("model=gpt2_small", "data=synthetic_text", "data.block_size=1024")
    vocab, T = 50304, 1024
    with torch.device("meta"):
        model = build_model(cfg.model, vocab, T)
    L, d = cfg.model.n_layer, cfg.model.n_embd
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embeddings
    nanogpt = (6 * n + 12 * L * T * d) * T
    counted = training_flops_per_sample(model, (T,), torch.int64)
    assert counted == pytest.approx(nanogpt, rel=0.05)
    attention = 12 * L * T * d * T
    assert counted - 6 * n * T == pytest.approx(attention, rel=0.05)  # attention is in it


def test_resnet18_is_three_times_its_forward_multiply_adds():
    """torchvision's ResNet-18 at 224 px: 1.81 G multiply-adds forward, so about 3 x 2 x 1.81
    GFLOPs for a training step (the convolutions' and the classifier's)."""
    cfg = compose_config("model=resnet18")
    with torch.device("meta"):
        model = build_model(cfg.model, 1000, 224)
    counted = training_flops_per_sample(model, (3, 224, 224))
    assert counted == pytest.approx(3 * 2 * 1.814e9, rel=0.05)


class HostRead(nn.Module):
    """A model that reads a value on the host: the meta device cannot run it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum().item() > 0:
            return self.fc(x)
        return self.fc(-x)


def test_a_model_the_meta_device_cannot_run_has_no_count():
    with torch.device("meta"):
        model = HostRead()
    assert training_flops_per_sample(model, (4,)) is None
    assert all(p.grad is None for p in model.parameters())
