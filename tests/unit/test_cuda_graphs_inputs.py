"""What a replayed optimizer step (`trainer.cuda_graphs`) costs outside the graph: this step's
gradients fed into the graph's own tensors by one foreach copy, into the same tensors at every
step (whose addresses the graph holds), laid out as the gradients are (the copy's fast path).
Checked on the CPU with the same tensors a GPU run feeds; the replay itself needs a GPU
(tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.run import cuda_graphs


class _Ops(TorchDispatchMode):
    """The aten ops issued while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    return model.to(memory_format=torch.channels_last)


def _backward(model: nn.Module, seed: int) -> None:
    for p in model.parameters():
        p.grad = None  # (the trainer's zero_grad: each backward makes new gradient tensors)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    model(x.contiguous(memory_format=torch.channels_last)).square().sum().backward()


def test_each_replay_feeds_its_gradients_in_one_copy_into_the_same_tensors():
    model = _model()
    params = list(model.parameters())
    graph = cuda_graphs.StepGraph(None, torch.optim.SGD(params, lr=0.1), params)
    _backward(model, seed=0)
    graph._take_inputs()  # (the capture's: the graph's gradient tensors)
    static = list(graph.static)
    assert [s.stride() for s in static] == [p.grad.stride() for p in params]
    assert all(s.data_ptr() != p.grad.data_ptr() for s, p in zip(static, params))
    for seed in (1, 2, 3):
        _backward(model, seed)
        with _Ops() as ops:
            graph._feed()
        assert ops.names == ["aten._foreach_copy_.default"]  # one op, not one per tensor
        assert all(a is b for a, b in zip(graph.static, static))  # the graph's own tensors
        for s, p in zip(graph.static, params):
            torch.testing.assert_close(s, p.grad, rtol=0, atol=0)


def test_a_parameter_that_lost_its_gradient_is_named_before_a_replay():
    model = _model()
    params = list(model.parameters())
    graph = cuda_graphs.StepGraph(None, torch.optim.SGD(params, lr=0.1), params)
    _backward(model, seed=0)
    graph._take_inputs()
    _backward(model, seed=1)
    params[0].grad = None
    with pytest.raises(RuntimeError, match="1 parameters that had a gradient when the step"):
        graph._feed()
