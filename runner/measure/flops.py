"""A model's training FLOPs per sample: one forward and backward of a small batch counted by
`torch.utils.flop_counter` on the device the model is on (the meta device in planning: shapes
only, no memory, no data).

What is counted is what torch's flop counter knows: matrix products and convolutions (and
attention through `scaled_dot_product_attention`, whose kernels it counts, or through the
products its math path runs on the meta device), at 2 FLOPs a multiply-add; the backward of each
product is its two products (the input's gradient and the weight's). A floating input requires a
gradient here, so that the first layer's input gradient is counted too, as the usual 6N
convention does (6 FLOPs per parameter and sample: 2 forward, 4 backward); training skips that
one product. Element-wise work (activations, normalisation, the loss, the optimizer) is not
counted: it is memory-bound, and MFU is measured against the device's matrix peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

COUNT_BATCH = 2  # BatchNorm refuses a one-sample batch in training mode


def _first_tensor(output) -> Optional[torch.Tensor]:
    """The model's output tensor: itself, the first in a tuple, list or dict, or `.logits` (a
    Hugging Face model's output object)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return next((t for t in map(_first_tensor, output) if t is not None), None)
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def training_flops_per_sample(
    model: nn.Module,
    sample_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    batch: int = COUNT_BATCH,
) -> Optional[float]:
    """FLOPs of one training step's forward and backward, per sample, for inputs of
    `sample_shape` and `dtype` (float images, integer token ids), counted on a batch of `batch`
    on the model's own device. None where the model cannot run there (an op without a meta
    implementation, a value read on the host). The model's gradients are cleared afterwards and
    its training mode kept: the count leaves it as it was (BatchNorm's step counter apart)."""
    from torch.utils.flop_counter import FlopCounterMode

    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    x = torch.zeros((batch, *sample_shape), dtype=dtype, device=device)
    if x.is_floating_point():
        x.requires_grad_(True)
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            out = _first_tensor(model(x))
            if out is None:
                return None
            if out.requires_grad:
                out.float().sum().backward()
    except (NotImplementedError, RuntimeError):
        return None
    finally:
        for p in params:
            p.grad = None
    return counter.get_total_flops() / batch
