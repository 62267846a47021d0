"""A training step reads nothing from the device: the overflow verdict, the loss scale's update,
Adam's step counters and the skipped-step count stay there (CPU proxy of the GPU's sync check:
every op that hands a device value to the host is counted, on the real engine and trainer)."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.precision import AmpEngine, resolve
from tests.helpers.precision import KernelSpy, fresh_amp  # noqa: F401  (fresh_amp: autouse)
from tests.helpers.trainer import make_trainer

CPU = torch.device("cpu")
READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}
# the levels a run trains at: fp16 with a dynamic scale (O1, O2), pure fp16 (O3, scale 1), bf16
# without a scale; the third entry: the optimizer takes its own step (no masters, no check)
LEVELS = [
    ("O1", {}, False),
    ("O2", {}, False),
    ("O3", {}, True),
    ("O1", {"autocast_dtype": "bfloat16", "loss_scale": 1.0}, True),
    ("O2", {"cast_model_type": "bfloat16", "autocast_dtype": "bfloat16", "loss_scale": 1.0}, False),
    ("O3", {"cast_model_type": "bfloat16", "loss_scale": 1.0}, True),
]


class CountReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _engine(level: str, overrides: dict, optimizer: str, **opt_kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    params = model.parameters()
    opt = (
        torch.optim.AdamW(params, lr=1e-3, **opt_kw)
        if optimizer == "adamw"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9, **opt_kw)
    )
    engine = AmpEngine(resolve(level, overrides, device=CPU).properties, CPU)
    engine.prepare(model, opt)
    return model, opt, engine


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)


def _step(model, opt, engine, x, y, clip: bool = False):
    with engine.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    engine.backward(loss)
    if clip:
        engine.clip_grad_norm_(1.0, opt)
    stepped = engine.step(opt, wait=False)
    engine.zero_grad(opt)
    return stepped


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("level, overrides, own_step", LEVELS)
def test_engine_steps_read_nothing_from_the_device(level, overrides, own_step, optimizer):
    model, opt, engine = _engine(level, overrides, optimizer)
    _step(model, opt, engine, *_batch(0))  # (state created, kernels loaded)
    # (torch's own AdamW, stepping the weights itself, reads its step counters: see `_counters`)
    with CountDeviceReads(_counters(opt)) as counted:
        for i in range(3):
            _step(model, opt, engine, *_batch(i + 1), clip=i == 1)
    assert counted.reads == []


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fp16_weights_stepped_by_torchs_fused_optimizer_skip_on_the_device(optimizer):
    """O3 with a dynamic scale: the fp16 weights are stepped by the optimizer itself, and a
    fused torch optimizer takes the device flag (as GradScaler gives it), so no read either;
    an overflow leaves the weights as they were."""
    model, opt, engine = _engine("O3", {"loss_scale": "dynamic"}, optimizer, fused=True)
    _step(model, opt, engine, *_batch(0))
    with CountReads() as counted:
        for i in range(2):
            _step(model, opt, engine, *_batch(i + 1))
        x, y = _batch(3)
        engine.backward(nn.functional.cross_entropy(model(x.half()).float(), y))
        next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        stepped = engine.step(opt, wait=False)
    assert counted.reads == [] and not bool(stepped)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert engine.skipped_steps == 1 and engine.loss_scale == 2.0**15


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_an_overflow_skips_on_the_device_exactly_as_the_host_decided(where, optimizer):
    """An inf in the first, a middle or the last gradient: the step is skipped (params, state
    and Adam's counters as they were), the scale backs off; the same as with the host's
    verdict (`wait=True`), and without a read."""
    runs = []
    for wait in (True, False):
        model, opt, engine = _engine("O2", {}, optimizer)
        _step(model, opt, engine, *_batch(0))
        x, y = _batch(1)
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        engine.backward(loss)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        index = {"first": 0, "middle": len(grads) // 2, "last": len(grads) - 1}[where]
        grads[index].view(-1)[0] = float("inf")
        before = [m.detach().clone() for m in engine.master_params(opt)]
        with CountReads() as counted:
            stepped = engine.step(opt, wait=wait)
        engine.zero_grad(opt)
        if not wait:
            assert counted.reads == [] and not bool(stepped)
        assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params(opt)))
        _step(model, opt, engine, *_batch(2))  # a clean step after it
        steps = [s["step"].item() for s in opt.state.values() if "step" in s]
        runs.append(
            (
                [m.detach().clone() for m in engine.master_params(opt)],
                engine.loss_scale,
                engine.skipped_steps,
                steps,
            )
        )
    (host, host_scale, host_skips, host_steps), (dev, dev_scale, dev_skips, dev_steps) = runs
    assert all(torch.equal(a, b) for a, b in zip(host, dev))
    assert host_scale == dev_scale == 2.0**15 and host_skips == dev_skips == 1
    assert host_steps == dev_steps and set(dev_steps) <= {2.0}


def test_the_scale_updates_on_the_device_as_on_the_host():
    """Growth, back-off, hysteresis, min and max scale: the device update (a flag tensor) gives
    the host update's (a bool) scale, counters and state dict, step by step."""
    from runner.precision.scaler import LossScaler
    from tests.helpers.kernel_cases import SCALE_BOUNDED

    host, dev = LossScaler(**SCALE_BOUNDED), LossScaler(**SCALE_BOUNDED)
    pattern = [0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0]
    scales = []
    for found in pattern:
        host.update(bool(found))
        dev.update(torch.tensor([float(found) * 3.0]))
        assert dev.state_dict() == host.state_dict()
        assert dev.inv_scale_tensor.item() == 1.0 / host.scale
        assert dev.scale_tensor.item() == host.scale
        scales.append(host.scale)
    assert min(scales) == 2.0 and max(scales) == 32.0  # (both bounds held)


def test_trainer_steps_between_logging_steps_read_nothing():
    """The real trainer (O2, dynamic scale; an overflowing first step): its steps read nothing;
    the skipped steps, the scale and the guard's streaks are read at the logging steps."""
    trainer, logged = make_trainer("O2", {}, log_every_n_steps=50)
    batches = list(trainer.train_loader)
    trainer.train_step(*batches[0])  # (the memory probe measures the first step that stepped)
    trainer.engine.scaler.scale = 2.0**40  # the next steps overflow fp16's gradients
    with CountReads() as counted:
        for x, y in batches[1:]:
            trainer.train_step(x, y)
    assert counted.reads == []
    assert trainer.engine.skipped_steps == len(batches) - 1
    assert trainer.engine.loss_scale == 2.0 ** (40 - len(batches) + 1)
    assert trainer.guard.skip_streak == len(batches) - 1


def test_trainer_on_torchs_ops_reads_nothing_between_logging_steps():
    """The same with torch's ops (no kernels): SGD's own step, taken and undone on the device at
    every overflowing step; the momentum buffers and the weights stay as the last clean step
    left them."""
    trainer, logged = make_trainer("O2", {}, log_every_n_steps=50)
    trainer.engine.kernels = None  # (every optimizer on torch's ops)
    batches = list(trainer.train_loader)
    trainer.train_step(*batches[0])  # (the momentum buffers made: a step that reads the flag)
    opt = trainer.optimizer
    kept = [t.detach().clone() for t in trainer.engine.master_params(opt)]
    kept += [s["momentum_buffer"].clone() for s in opt.state.values()]
    trainer.engine.scaler.scale = 2.0**40
    with CountReads() as counted:
        for x, y in batches[1:]:
            trainer.train_step(x, y)
    assert counted.reads == []
    assert trainer.engine.skipped_steps == len(batches) - 1
    after = list(trainer.engine.master_params(opt))
    after += [s["momentum_buffer"] for s in opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(kept, after))


# ---- host work per step: per group, not per param ---------------------------------------------
def _ready_to_step(layers: int, optimizer: str, wait: bool = False):
    """An O2 engine (dynamic scale, the C++ kernels behind a `KernelSpy`) with `layers` Linear
    layers, after two steps that prepared it and the backward of a third: (engine, opt, spy)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    engine = AmpEngine(resolve("O2", {}, device=CPU).properties, CPU, kernels="fused")
    spy = KernelSpy(engine)  # (before prepare: every path and scaler calls through it)
    engine.prepare(model, opt)
    x = torch.randn(2, 4)
    for i in range(3):
        with engine.autocast():
            loss = model(x).float().mean()
        engine.backward(loss)
        if i < 2:
            assert bool(engine.step(opt, wait=wait))
            engine.zero_grad(opt)
    spy.reset()
    return engine, opt, spy


def _python_calls_of_a_step(layers: int, optimizer: str) -> int:
    """The Python function calls one `engine.step` makes, after two steps that prepared it."""
    engine, opt, _ = _ready_to_step(layers, optimizer)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        engine.step(opt, wait=False)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_steps_python_work_does_not_grow_with_the_params(optimizer):
    """The tensor lists, the optimizer state's lists and the kernels' arguments are prepared
    once: a step over 100 params makes the Python calls a step over 10 makes."""
    assert _python_calls_of_a_step(5, optimizer) == _python_calls_of_a_step(50, optimizer)


def _python_calls_of_a_zero_grad(layers: int) -> int:
    """The Python function calls of one `engine.zero_grad`, after one that listed its tensors."""
    engine, opt, _ = _ready_to_step(layers, "adamw")
    engine.step(opt, wait=False)
    engine.zero_grad(opt)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"  # a generator's resumption counts too (a module walk)

    sys.setprofile(count)
    try:
        engine.zero_grad(opt)
    finally:
        sys.setprofile(None)
    return calls


def test_zero_grad_walks_no_module_tree_per_step():
    """What zero_grad clears is listed once: its Python calls do not grow with the model (a walk
    of ResNet-50's modules alone cost 0.13 ms a step)."""
    assert _python_calls_of_a_zero_grad(5) == _python_calls_of_a_zero_grad(50)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_params_added_after_it_listed_them(set_to_none):
    """A submodule registered on the model, then a param group added to the optimizer, after the
    list was made: their grads are cleared too, with the model's params and the masters."""
    model, opt, engine = _engine("O2", {}, "adamw")
    _step(model, opt, engine, *_batch(0))  # zero_grad listed the tensors

    def check(held):
        for p in held:
            p.grad = torch.ones_like(p)
        engine.zero_grad(opt, set_to_none=set_to_none)
        # the fp32 masters (BatchNorm's fp32 params are stepped as they are: not masters)
        masters = {id(m) for m in engine.master_params(opt)} - {id(p) for p in model.parameters()}
        assert masters
        for p in held:
            if set_to_none or id(p) in masters:  # the masters' grads go either way
                assert p.grad is None
            else:
                assert p.grad is not None and not p.grad.any()

    model.add_module("late", nn.Linear(3, 3).half())  # the optimizer does not change
    check([*model.parameters(), *engine.master_params(opt)])
    extra = nn.Linear(3, 3).half()
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-2})
    engine.sync_param_groups(opt)
    check([*model.parameters(), *extra.parameters(), *engine.master_params(opt)])


class CountOps(TorchDispatchMode):
    """Counts the torch ops dispatched, by name (views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# (optimizer, wait) -> the most torch ops one step may dispatch; with the kernel calls (the check,
# the update, the loss scale's update) a CPU proxy of the CUDA step's launches
MOST_OPS = {
    ("adamw", True): 3,  # the flag, the verdict's read, the counters' add
    ("adamw", False): 8,  # the flag, the counters' add of (flag == 0), the skip count, ~skipped
    ("sgd", True): 2,
    ("sgd", False): 6,
}


def _ops_of_a_step(layers: int, optimizer: str, wait: bool) -> tuple[collections.Counter, dict]:
    engine, opt, spy = _ready_to_step(layers, optimizer, wait)
    with CountOps() as counted:
        stepped = engine.step(opt, wait=wait)
    assert bool(stepped)
    counters = [s["step"].item() for s in opt.state.values() if "step" in s]
    assert counters in ([], [3.0] * len(opt.state))
    return counted.ops, dict(spy.calls)


@pytest.mark.parametrize("wait", [False, True], ids=["on-device", "host-verdict"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_fused_steps_ops_are_few_and_do_not_grow_with_the_params(optimizer, wait):
    """The torch ops and kernel calls of one step: the same for 10 and 100 params (the step
    counters advance in one op, the loss scale updates in one kernel call), and a handful."""
    ops, calls = _ops_of_a_step(5, optimizer, wait)
    assert (ops, calls) == _ops_of_a_step(50, optimizer, wait)
    assert sum(ops.values()) <= MOST_OPS[(optimizer, wait)], ops
    update = "adam_step" if optimizer == "adamw" else "sgd_step"
    assert calls == {"check_finite": 1, update: 1, "update_scale": 1}


def test_prepared_lists_follow_a_new_param_group():
    """The prepared lists are made again when the groups change: a group added after some steps
    is stepped (its master and its fp16 copy move), and the old groups go on as before."""
    model, opt, engine = _engine("O2", {}, "adamw")
    for i in range(2):
        _step(model, opt, engine, *_batch(i))
    extra = nn.Linear(3, 3).half()
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-2})
    engine.sync_param_groups(opt)
    before = [p.detach().clone() for p in extra.parameters()]
    x = torch.randn(4, 3).half()
    with engine.autocast():
        loss = nn.functional.cross_entropy(model(_batch(3)[0]).float(), _batch(3)[1])
        loss = loss + extra(x).float().pow(2).mean()
    engine.backward(loss)
    assert bool(engine.step(opt, wait=False))
    assert all(not torch.equal(a, b) for a, b in zip(before, extra.parameters()))
    assert [s["step"].item() for s in opt.state.values()] == [3.0] * 6 + [1.0] * 2


# ---- an optimizer's own step (torch's ops, an option the kernels lack, O3's fp16 weights) ------
# (level, overrides, kernels, optimizer): the steps the kernels do not take, each undone on the
# device where the flag is set (runner.precision.device_skip)
OWN_STEPS = [
    ("O2", {}, "torch", "sgd"),
    ("O2", {}, "torch", "adamw"),
    ("O1", {}, "torch", "sgd"),
    ("O1", {}, "torch", "adam"),
    ("O2", {}, "auto", "amsgrad"),
    ("O2", {}, "auto", "rmsprop"),
    ("O2", {}, "torch", "nesterov"),
    ("O3", {"loss_scale": "dynamic"}, "auto", "sgd"),
    ("O3", {"loss_scale": "dynamic"}, "auto", "adamw"),
]


def _own_engine(level: str, overrides: dict, kernels: str, optimizer: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    params = list(model.parameters())
    eps = 1e-4 if level == "O3" else 1e-8  # (fp16 weights: an eps fp16 holds)
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2),
        "nesterov": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3, eps=eps),
        "amsgrad": lambda: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5),
    }[optimizer]()
    props = resolve(level, overrides, device=CPU).properties
    engine = AmpEngine(props, CPU, kernels=kernels)
    engine.prepare(model, opt)
    return model, opt, engine


def _counters(opt) -> set[int]:
    """The storage of the optimizer's step counters: torch's own Adam reads its counter on the
    host (a CPU tensor: no device sync on a GPU, where the step undone on the device keeps it on
    the device, `capturable`), which this CPU proxy would count."""
    return {s["step"].data_ptr() for s in opt.state.values() if torch.is_tensor(s.get("step"))}


class CountDeviceReads(CountReads):
    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS and args and args[0].data_ptr() in self.ignore:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _overflow_step(model, opt, engine, seed: int, index, wait: bool):
    """One step whose `index`-th gradient gets an inf (None: a clean step); what `step`
    returned (a device tensor with `wait=False`)."""
    x, y = _batch(seed)
    with engine.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    engine.backward(loss)
    if index is not None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grads[{"first": 0, "middle": len(grads) // 2, "last": len(grads) - 1}[index]].view(-1)[
            0
        ] = float("inf")
    stepped = engine.step(opt, wait=wait)
    engine.zero_grad(opt)
    return stepped


def _snapshot(model, opt, engine) -> tuple:
    state = {
        (i, k): v.detach().clone() if torch.is_tensor(v) else v
        for i, s in opt.state_dict()["state"].items()
        for k, v in s.items()
    }
    return (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in engine.master_params(opt)],
        state,
        engine.loss_scale,
        engine.skipped_steps,
    )


def _same(a: tuple, b: tuple) -> bool:
    def eq(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return x == y

    return eq(a, b)


@pytest.mark.parametrize("level, overrides, kernels, optimizer", OWN_STEPS)
def test_an_optimizers_own_step_reads_nothing_from_the_device(level, overrides, kernels, optimizer):
    model, opt, engine = _own_engine(level, overrides, kernels, optimizer)
    for i in range(3):  # (until a step made the optimizer's state: that one reads the flag)
        if _overflow_step(model, opt, engine, i, None, wait=False):
            break
    with CountDeviceReads(_counters(opt)) as counted:
        for i in range(3):
            _step(model, opt, engine, *_batch(i + 5), clip=i == 1)
        _overflow_step(model, opt, engine, 9, "middle", wait=False)
    assert counted.reads == []
    assert engine.skipped_steps == 1


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("level, overrides, kernels, optimizer", OWN_STEPS)
def test_an_own_step_undone_on_the_device_is_the_hosts_skip(
    level, overrides, kernels, optimizer, where
):
    """An inf in the first, a middle or the last gradient: the step taken and undone on the
    device leaves the params, the masters, the optimizer state (step counters included), the
    scale and the skipped-step count exactly as the host's verdict (`wait=True`) leaves them."""
    runs = []
    for wait in (True, False):
        model, opt, engine = _own_engine(level, overrides, kernels, optimizer)
        _overflow_step(model, opt, engine, 0, None, wait)
        before = _snapshot(model, opt, engine)
        with CountDeviceReads(_counters(opt)) as counted:
            stepped = _overflow_step(model, opt, engine, 1, where, wait)
        assert not bool(stepped)
        if not wait:
            assert counted.reads == []
        after = _snapshot(model, opt, engine)
        assert _same(before[:3], after[:3])
        _overflow_step(model, opt, engine, 2, None, wait)
        runs.append(_snapshot(model, opt, engine))
    assert _same(runs[0], runs[1])
    assert runs[1][4] == 1


def test_an_own_step_is_undone_with_the_ops_of_torch_2_11(monkeypatch):
    """torch 2.11 (the GPU machines' torch) has no `torch._foreach_clone`: the copies that undo
    an own step are made with what it has, and the skip is still the host's, bit for bit."""
    monkeypatch.delattr(torch, "_foreach_clone", raising=False)
    test_an_own_step_undone_on_the_device_is_the_hosts_skip("O2", {}, "torch", "adamw", "middle")


@pytest.mark.parametrize("level, overrides, kernels, optimizer", OWN_STEPS)
def test_twenty_own_steps_on_the_device_equal_the_hosts_step_by_step(
    level, overrides, kernels, optimizer
):
    """20 steps, the first (before any optimizer state exists), two in the middle and the last
    overflowing: after every step the device-skipped run equals the host-decided one."""
    overflow = {0: "first", 7: "middle", 8: "last", 19: "middle"}
    host = _own_engine(level, overrides, kernels, optimizer)
    dev = _own_engine(level, overrides, kernels, optimizer)
    for i in range(20):
        a = _overflow_step(*host, i, overflow.get(i), wait=True)
        b = bool(_overflow_step(*dev, i, overflow.get(i), wait=False))
        assert a == b == (i not in overflow)
        assert _same(_snapshot(*host), _snapshot(*dev)), f"step {i}"
    assert dev[2].skipped_steps == 4 and dev[2].loss_scale == 2.0**12


def test_a_step_only_the_host_can_skip_says_so_once(caplog):
    """A step with a closure cannot be undone from copies: the flag is read on the host (the
    skip as before), and the log says why, once per optimizer."""
    model, opt, engine = _own_engine("O2", {}, "torch", "sgd")
    x, y = _batch(0)

    def closure():
        return nn.functional.cross_entropy(model(x).float(), y)

    caplog.set_level("INFO", logger="runner.precision.paths")
    for i in range(2):
        with engine.autocast():
            loss = closure()
        engine.backward(loss)
        if i == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        stepped = engine.step(opt, closure, wait=False)
        engine.zero_grad(opt)
        assert bool(stepped) == (i == 0)
    said = [r.getMessage() for r in caplog.records if "overflow flag on the host" in r.message]
    assert len(said) == 1 and "SGD" in said[0] and "closure" in said[0]
    assert engine.skipped_steps == 1


class _Replacing(torch.optim.Optimizer):
    """An optimizer whose step puts a new tensor into its state each time (not in place)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["avg"] = state.get("avg", torch.zeros_like(p)) * 0.5 + p.grad
                    p.sub_(state["avg"], alpha=group["lr"])


def test_a_step_that_replaces_its_state_is_skipped_on_the_host_and_says_so(caplog):
    """Copies cannot undo a state tensor the step replaced: such a step reads the flag, puts
    params and state back on an overflow (the old tensors, as they were), and says so once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = _Replacing(model.parameters())
    engine = AmpEngine(resolve("O2", {}, device=CPU).properties, CPU, kernels="torch")
    engine.prepare(model, opt)
    caplog.set_level("INFO", logger="runner.precision.paths")
    assert bool(_overflow_step(model, opt, engine, 0, None, wait=False))
    before = _snapshot(model, opt, engine)
    kept = [s["avg"] for s in opt.state.values()]
    assert not bool(_overflow_step(model, opt, engine, 1, "last", wait=False))
    assert _same(before[:3], _snapshot(model, opt, engine)[:3])
    assert all(s["avg"] is t for s, t in zip(opt.state.values(), kept))
    assert bool(_overflow_step(model, opt, engine, 2, None, wait=False))
    said = [r.getMessage() for r in caplog.records if "overflow flag on the host" in r.message]
    assert len(said) == 1 and "replaces its state tensor 'avg'" in said[0]
