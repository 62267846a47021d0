"""Small shared pieces of the precision tests: resolved properties, an op recorder, a tiny net,
a gradient norm, the amp reset around a test, the cross-entropy loss."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.precision import Properties, amp, resolve
from runner.precision import autocast as ac
from runner.precision.apex_engine import ApexEngine


def props(level: str, **overrides) -> Properties:
    return resolve(level, overrides).properties


@pytest.fixture(autouse=True)
def fresh_amp():
    """No amp engine, no `amp.init()` handle and no autocast registrations before or after a
    test: a test module that imports this fixture gets it around each of its tests."""
    _reset_amp()
    yield
    _reset_amp()


def _reset_amp() -> None:
    amp.deinitialize()
    vars(amp._amp_state).pop("opt_properties", None)  # as before any initialize
    if amp._amp_state.handle is not None:  # an amp.init() handle: its casts end
        amp._amp_state.handle._deactivate()
        amp._amp_state.handle = None
    ac.clear_registrations()
    assert not ac.in_patched_region()


def ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def two_optimizers():
    """One Apex facade engine (`ApexEngine`: O0, dynamic loss scale, CPU) over two Linear layers
    meant to run in a row, 4 -> 4 -> 2 (weights from seed 0), each with its own SGD (lr 0.1): a
    loss over both is one loss over two optimizers. Returns engine, a, b, a's optimizer, b's
    optimizer."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    engine = ApexEngine(props("O0", loss_scale="dynamic"), torch.device("cpu"))
    for model, opt in ((a, oa), (b, ob)):
        engine.cast(model)
        engine.add_optimizer(opt, [model])
    return engine, a, b, oa, ob


class OpRecorder(TorchDispatchMode):
    """Records every aten op that runs (to prove what the engine does or does not do)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(name in op for op in self.ops)


def net(seed: int = 0) -> nn.Module:
    """Linear-BatchNorm-ReLU-Linear: every layer kind whose precision handling differs."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def batch(seed: int = 1, n: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def total_norm(grads) -> torch.Tensor:
    """The 2-norm of all `grads` together, computed explicitly (torch.nn.utils.get_total_norm
    needs torch 2.6; the package supports torch 2.4)."""
    return torch.linalg.vector_norm(torch.cat([g.detach().float().flatten() for g in grads]))


class Snapshot:
    """Model weights, masters and optimizer state at one moment, to prove a skipped step left
    every one of them bit-identical."""

    def __init__(self, model: nn.Module, masters, optimizer: torch.optim.Optimizer):
        self.weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.masters = [p.detach().clone() for p in masters]
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())

    def assert_unchanged(self, model: nn.Module, masters, optimizer: torch.optim.Optimizer):
        for k, v in model.named_parameters():
            assert torch.equal(v, self.weights[k]), k
        for p, m in zip(masters, self.masters, strict=True):
            assert torch.equal(p, m)
        after = optimizer.state_dict()
        assert after["param_groups"] == self.optimizer_state["param_groups"]
        for i, state in self.optimizer_state["state"].items():
            for k, v in state.items():
                assert torch.equal(after["state"][i][k], v), (i, k)


class KernelSpy:
    """Counts an engine's calls into its compiled kernels; every call still runs the real kernel
    (the spy only sits between the engine and the module, so the engine's choices are visible)."""

    OPS = (
        "unscale_check",
        "check_finite",
        "l2norm",
        "copy_scale",
        "sgd_step",
        "adam_step",
        "stochastic_round",
        "sgd_step_sr",
        "adam_step_sr",
        "update_scale",
    )

    def __init__(self, engine):
        import dataclasses
        from collections import Counter
        from types import SimpleNamespace

        assert engine.kernels is not None, "the engine runs without kernels"
        self.calls: Counter = Counter()
        real = engine.kernels.ops

        def wrap(name):
            def call(*args, **kwargs):
                self.calls[name] += 1
                return getattr(real, name)(*args, **kwargs)

            return call

        engine.kernels = dataclasses.replace(
            engine.kernels, ops=SimpleNamespace(**{n: wrap(n) for n in self.OPS})
        )

    def count(self, name: str) -> int:
        return self.calls[name]

    def reset(self) -> None:
        self.calls.clear()
