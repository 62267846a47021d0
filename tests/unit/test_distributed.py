"""What a distributed run's ranks say when one of them is gone (runner.run.distributed): the
backend's failure in one line, `PeersLost` in place of an unexpected error, the other ranks'
lines labelled. The runs themselves, with a rank killed for real: tests/integration/
test_distributed.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch.distributed as dist

from runner.errors import PeersLost
from runner.run import distributed
from runner.run.distributed import Comm

# what Gloo raised in a real run when the other rank was killed (torch 2.14)
GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
    "[127.0.0.1]:55494: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application. Check the logs of the remote worker before reporting "
    "an error. GLHF! \U0001f3d6\ufe0f"
)


def test_a_failed_collective_is_said_in_one_line():
    assert (
        distributed.collective_failure(RuntimeError(GLOO))
        == "Gloo: Read error [127.0.0.1]:55494: Connection reset by peer"
    )
    nccl = dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:2000, remote process exited or there was a network "
        "error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network "
        "error or a remote process exiting prematurely."
    )
    assert distributed.collective_failure(nccl) == (
        "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2000, remote process exited or "
        "there was a network error, NCCL version 2.27.3"
    )
    try:  # found under the error it caused
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as gloo:
            raise ValueError("while reducing the metrics") from gloo
    except ValueError as outer:
        assert distributed.collective_failure(outer).startswith("Gloo: Read error")
    for other in (RuntimeError("boom"), RuntimeError("[not gloo] x"), ConnectionError("gone")):
        assert distributed.collective_failure(other) is None


@pytest.mark.parametrize(
    "agent,where",
    [
        ("run-1", "torchrun's summary names the rank that failed first and how; that rank's "),
        (None, "Each rank's own lines (its task's log) say which ended and why. "),  # SLURM's
    ],
)
def test_a_rank_gone_is_peers_lost_with_what_is_kept(monkeypatch, agent, where):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if agent is not None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", agent)
    pair = Comm(rank=0, world_size=2, active=True)
    with pytest.raises(PeersLost) as lost:
        with distributed.catch_lost_peers(
            pair, lambda: "The checkpoint after epoch 3 is kept (x)."
        ):
            raise RuntimeError(GLOO)
    message = str(lost.value)
    assert message.startswith(
        "A collective operation of the 2 ranks failed (Gloo: Read error [127.0.0.1]:55494: "
        "Connection reset by peer): most likely another rank ended"
    )
    assert where in message and message.endswith(" The checkpoint after epoch 3 is kept (x).")
    assert lost.value.__cause__ is None and lost.value.__suppress_context__
    # anything else passes unchanged, and so does a single process's error
    with pytest.raises(ValueError, match="boom"):
        with distributed.catch_lost_peers(pair):
            raise ValueError("boom")
    with pytest.raises(RuntimeError, match="GLHF"):
        with distributed.catch_lost_peers(Comm()):
            raise RuntimeError(GLOO)


@contextmanager
def own_root_handlers() -> Iterator[list[list[str]]]:
    """Two handlers of the root logger's own, in place of every other (pytest's capture handlers
    live as long as the test session: a filter added to them would label later tests' lines),
    all restored afterwards; what each handler was given."""
    root, runner_log = logging.getLogger(), logging.getLogger("runner")
    saved, level = root.handlers[:], runner_log.level
    seen: list[list[str]] = [[], []]

    class Keep(logging.Handler):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def emit(self, record):
            self.into.append(record.getMessage())

    root.handlers[:] = [Keep(seen[0]), Keep(seen[1])]
    try:
        yield seen
    finally:
        root.handlers[:] = saved
        runner_log.setLevel(level)


@pytest.mark.parametrize(
    "env,label",
    [
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "rank 1 of 2: "),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ""),
        (
            {"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "4", "SLURM_PROCID": "3"},
            "rank 3 of 4: ",
        ),
        ({}, ""),
    ],
)
def test_the_other_ranks_lines_say_their_rank(monkeypatch, env, label):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SUBMITIT_EXECUTOR", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with own_root_handlers() as seen:
        logging.getLogger("runner").setLevel(logging.INFO)
        distributed.rank_zero_logging()
        distributed.rank_zero_logging()  # (twice: one label)
        logging.getLogger("runner.run.trainer").info("epoch 1/2")
        logging.getLogger("runner.run.trainer").warning("Epoch 1: the loop waited")
        logging.getLogger("runner").error("optimizer.lr: got -1.0")
        logging.getLogger("a.library").warning("not the runner's")
    told = ["Epoch 1: the loop waited", "optimizer.lr: got -1.0"]
    if not label:  # rank 0 and a single process: the whole story, unlabelled
        told.insert(0, "epoch 1/2")
    expected = [label + line for line in told] + ["not the runner's"]
    assert seen == [expected, expected]


def test_torchrun_s_error_file_takes_the_rank_s_line(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    distributed.tell_torchrun("nothing to write to")  # (outside torchrun: nothing, no error)
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    distributed.tell_torchrun("optimizer.lr: got -1.0 (allowed: a finite number > 0)")
    # read as torchrun's agent reads it for its summary
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(path))
    assert failure.message["extraInfo"]["py_callstack"] == (
        "optimizer.lr: got -1.0 (allowed: a finite number > 0)"
    )
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no" / "folder.json"))
    distributed.tell_torchrun("a file that cannot be written changes nothing")
