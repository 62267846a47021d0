"""Apex's O1 function lists (apex/amp/lists/{functional,torch,tensor}_overrides.py, release 25.04
at e13873de): which functions of `torch.nn.functional`, `torch` and `torch.Tensor` run in 16
bits (half), in fp32 (float), in the widest type of their arguments (promote), or are banned.

`apex_o1` wraps them; README.md beside this file says how and where this runner departs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FUNCTIONAL_HALF = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "linear",
)
FUNCTIONAL_FLOAT = (
    "interpolate",
    "grid_sample",
    "softplus",
    "softmin",
    "log_softmax",
    "softmax",
    "gelu",
    "layer_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "cross_entropy",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "multi_margin_loss",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "ctc_loss",
)
FUNCTIONAL_BANNED = ("binary_cross_entropy",)

TORCH_HALF = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "mm",
    "mv",
    # Apex put the batched GEMMs here when CUDA >= 9.1 (every CUDA of today)
    "addbmm",
    "baddbmm",
    "bmm",
)
TORCH_FLOAT = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "cumprod",
    "cumsum",
    "dist",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    "renorm",
)
TORCH_PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "bilinear",
    "dot",
    "add",
    "div",
    "mul",
    "eq",
    "equal",
    "ge",
    "gt",
    "le",
    "lt",
    "ne",
)
TORCH_SEQUENCE = ("cat", "stack")

TENSOR_HALF_OWN = ("__matmul__",)
TENSOR_FLOAT_OWN = ("__ipow__", "__pow__", "__rpow__", "cpu")
TENSOR_PROMOTE_OWN = (
    "__add__",
    "__div__",
    "__eq__",
    "__ge__",
    "__gt__",
    "__le__",
    "__lt__",
    "__mul__",
    "__ne__",
    "__radd__",
    "__rdiv__",
    "__rmul__",
    "__rsub__",
    "__rtruediv__",
    "__sub__",
    "__truediv__",
)
# Apex promoted these too (out of place); here they stay in place, in the tensor's own type.
TENSOR_INPLACE_OPERATORS = ("__iadd__", "__idiv__", "__imul__", "__isub__", "__itruediv__")

RNN_NAMES = ("rnn_tanh", "rnn_relu", "gru", "lstm")
RNN_CELLS = tuple(f"{name}_cell" for name in RNN_NAMES)


def _on_tensor(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(n for n in names if hasattr(torch.Tensor, n))


TENSOR_HALF = _on_tensor((*TENSOR_HALF_OWN, *TORCH_HALF))
TENSOR_FLOAT = _on_tensor((*TENSOR_FLOAT_OWN, *TORCH_FLOAT))
TENSOR_PROMOTE = _on_tensor((*TENSOR_PROMOTE_OWN, *TORCH_PROMOTE))
