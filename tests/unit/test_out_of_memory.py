"""How an out-of-memory error is told apart and described (runner.run.out_of_memory); the runs
themselves: tests/integration/test_out_of_memory.py."""

from __future__ import annotations

import pytest
import torch

from runner.errors import OutOfMemory
from runner.run import out_of_memory

CPU = torch.device("cpu")


def test_only_an_allocators_refusal_is_out_of_memory():
    assert out_of_memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**62, dtype=torch.uint8)  # beyond any machine's address space
    assert out_of_memory.is_out_of_memory(refused.value)
    assert not out_of_memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be"))
    assert not out_of_memory.is_out_of_memory(MemoryError())  # Python's own, not torch's


def _raise_in(*names: str):
    """Raise torch's CPU refusal from nested functions called `names`, outermost first."""

    def call(depth: int) -> None:
        if depth == len(names):
            torch.empty(2**62, dtype=torch.uint8)
        code = compile(f"def {names[depth]}(go, d): go(d)", "<test>", "exec")
        scope: dict = {}
        exec(code, scope)
        scope[names[depth]](call, depth + 1)

    return lambda: call(0)


@pytest.mark.parametrize(
    "names, said",
    [
        (("fit", "train_step"), "a training step"),
        (("fit", "evaluate"), "validation"),
        (("prepared", "build_model"), "building the model"),
        (("tuned", "measure", "train_step"), "a training step of trainer.tune's measurements"),
        (("planned", "train_step"), "a training step of the layer plan's pre-flight"),
        (("somewhere",), "the run"),
    ],
)
def test_the_message_says_where_at_which_sizes_and_what_to_change(names, said):
    with pytest.raises(OutOfMemory) as error:
        out_of_memory.guarded(_raise_in(*names), CPU, "O1", lambda: "net at O1, batch 8")
    message = str(error.value)
    assert message.startswith(f"Out of memory on cpu in {said} (net at O1, batch 8): ")
    assert f"the CPU allocator could not get {2**62 / 1024**3:.1f} GiB" in message
    assert "precision=o2_bf16" in message and "fsdp" not in message  # (a CPU: one device)
    assert error.value.__context__ is None and error.value.__cause__ is None  # frames freed


def test_any_other_error_passes_unchanged():
    def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        out_of_memory.guarded(broken, CPU, "O0", lambda: "")
    assert out_of_memory.guarded(lambda: 7, CPU, "O0", lambda: "") == 7


KILLED = "DataLoader worker (pid 4242) is killed by signal: Killed. "
GONE = "DataLoader worker (pid(s) 4242, 4243) exited unexpectedly"


@pytest.mark.parametrize(
    "text, oom_kills, said",
    [
        (KILLED, 1, "A DataLoader worker (pid 4242) was killed (SIGKILL): the kernel's OOM killer"),
        (GONE, 2, "A DataLoader worker (pid 4242, 4243) exited unexpectedly: the kernel's OOM"),
        (
            "DataLoader worker (pid 7) is killed by signal: Bus error. ",
            0,
            "A DataLoader worker (pid 7) crashed with a bus error",
        ),
        (KILLED, 0, None),  # a kill -9 from outside, not memory: the error as it is
        (GONE, 0, None),
        ("DataLoader worker (pid 7) is killed by signal: Segmentation fault. ", 3, None),  # a bug
        ("mat1 and mat2 shapes cannot be multiplied", 3, None),
    ],
)
def test_a_worker_ended_by_memory_is_told_apart(text, oom_kills, said):
    """torch's words for a worker that died, by what memory did to it: the OOM killer (its
    machine-wide count grew meanwhile) or shared memory run out (a bus error); any other death
    keeps torch's error and traceback."""
    found = out_of_memory.worker_killed(RuntimeError(text), oom_kills)
    if said is None:
        assert found is None
        return
    assert found.startswith(said)
    if oom_kills:
        assert f"ended {oom_kills} process(es) on this machine during the run" in found
        assert "fewer workers, a smaller trainer.batch_size" in found
    else:
        assert "--shm-size" in found and "trainer.num_workers" in found
    assert out_of_memory.worker_killed(ValueError(text), oom_kills) is None  # torch's own only
